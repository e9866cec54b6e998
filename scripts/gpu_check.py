"""The GPU speed and memory check behind scripts/gpu_check.sh (one prepared run on a CUDA machine).

    python scripts/gpu_check.py --out DIR [--model random:llama2-7b --dtype bfloat16 --device cuda ...]

A. TPOT vs input length, full vs snapkv (budget 2048, window 32: the paper's decode-speed setting),
   batch 1 and 2, with prefill time (prefill + compression) and the CUDA allocator peak.
B. Capacity: full, then snapkv(budget 1024, window 16, kernel 5: the paper's 380K needle setting), at
   393,216 tokens (384K, beyond the paper's 380K), then snapkv at longer inputs while the deadline allows.
C. Exactness at length: every registered method (budget 1024, window 32 where it has one) prefills
   one 32K-token input on a small random fp32 Llama on the device and on this machine's CPU; the
   kept positions of every layer and head are compared (exact, and the fraction that agree).

Only the library API (`snapkv_models.loading.load_model`, `snapkv.generate_ids`) is used: no Hydra /
OmegaConf, so the GPU machine needs nothing beyond its image (pytest for the test step comes from
the carry kit where missing). Inputs are random token ids; EOS is off, every run decodes `--decode`
tokens. A run that raises CUDA out-of-memory becomes a row with status=oom (the memory it reached
in `peak_mem_bytes`); the TPOT sweep does not start a configuration whose weights + full KV cache
alone exceed the device (a row status=oom, error "not run: ..."). Writes gpu_tpot.csv,
gpu_capacity.csv, gpu_exactness.csv and gpu_check.png into `--out`.
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapkv import METHODS, CompressedCache, build_method, prefill, session  # noqa: E402
from snapkv_models.loading import DTYPES, load_model  # noqa: E402

COLUMNS = ["part", "method", "budget", "window", "kernel_size", "batch_size", "input_tokens", "status",
           "prefill_s", "ttft_s", "tpot_s", "tpot_q1_s", "tpot_q3_s", "decode_tokens", "peak_mem_bytes", "weights_bytes", "kv_bytes",
           "kv_bytes_full", "kv_tokens", "error", "model", "dtype", "device", "attn_impl", "wall_s"]  # fmt: skip


class OneLineParser(argparse.ArgumentParser):
    def error(self, message: str):  # bad CLI input: exit 2 with one line naming the bad value
        self.exit(2, f"gpu_check: error: {message}\n")


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.strip("[]").split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"need a positive integer, got {text!r}")
    return value


PARTS = ("tpot", "capacity", "exact")


def parts_list(text: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise argparse.ArgumentTypeError(
            f"unknown part {', '.join(bad) or text!r}; known: {', '.join(PARTS)}"
        )
    return parts


def parse(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--model", default="random:llama2-7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--lengths", type=int_list, default=[4096, 16384, 32768, 65536, 131072])
    p.add_argument("--batches", type=int_list, default=[1, 2])
    p.add_argument("--budget", type=int, default=2048)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--cap-lengths", type=int_list, default=[393216, 458752, 524288])
    p.add_argument("--cap-budget", type=int, default=1024)
    p.add_argument("--cap-window", type=int, default=16)
    p.add_argument("--cap-kernel", type=int, default=5)
    p.add_argument(
        "--deadline-s",
        type=float,
        default=420.0,
        help="start no capacity run predicted to end later than this many seconds after the "
        "start ($GPU_CHECK_T0, epoch seconds, set by gpu_check.sh; else this process's start)",
    )
    p.add_argument("--warmup", type=int, default=1024, help="input length of the untimed warm-up (0: none)")
    p.add_argument(
        "--parts",
        type=parts_list,
        default=PARTS,
        help="which of A, B, C to run: a comma list of " + ",".join(PARTS),
    )
    p.add_argument("--exact-length", type=positive, default=32768, help="part C's input length")
    p.add_argument("--exact-budget", type=positive, default=1024)
    p.add_argument("--exact-window", type=positive, default=32)
    p.add_argument(
        "--exact-threads", type=int, default=0, help="CPU threads for part C's reference (0: torch's default)"
    )
    return p.parse_args(argv)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    cfg = config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (
        2
        * cfg.num_hidden_layers
        * cfg.num_key_value_heads
        * head_dim
        * torch.tensor([], dtype=dtype).element_size()
    )


def run_one(model, vocab: int, method, length: int, batch: int, args, part: str) -> dict:
    # Looked up per call, not at the top: tests replace `snapkv.generate_ids` (an out-of-memory stand-in).
    from snapkv import generate_ids

    device = model.device
    row = dict(part=part, method=method.name, budget=getattr(method, "budget", None),
               window=getattr(method, "window", None), kernel_size=getattr(method, "kernel_size", None),
               batch_size=batch, input_tokens=length, decode_tokens=args.decode, model=args.model,
               dtype=args.dtype, device=str(device), weights_bytes=weights_bytes(model))  # fmt: skip
    t = time.perf_counter()
    ids = torch.randint(100, vocab, (batch, length), generator=torch.Generator().manual_seed(length + batch))
    try:
        _, res = generate_ids(model, ids, None, method, max_new_tokens=args.decode, stop_ids=set())
        q1, _, q3 = quartiles(res.decode_s)
        row.update(status="ok", prefill_s=res.prefill_s, ttft_s=res.ttft_s, tpot_s=res.tpot_s, tpot_q1_s=q1, tpot_q3_s=q3,
                   peak_mem_bytes=res.peak_mem_bytes, kv_bytes=res.kv_bytes, kv_bytes_full=res.kv_bytes_full,
                   kv_tokens=res.kv_tokens, attn_impl=res.attn_impl)  # fmt: skip
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e).splitlines()[0][:300], peak_mem_bytes=peak_since_reset(device))
    finally:
        del ids
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    row["wall_s"] = round(time.perf_counter() - t, 2)
    return row


def quartiles(values: list[float]) -> tuple[float | None, float | None, float | None]:
    """(Q1, median, Q3) of the decode steps' seconds (None for fewer than two steps)."""
    if len(values) < 2:
        return None, None, None
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, med, q3


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_since_reset(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def device_bytes(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


EXACT_COLUMNS = ["method", "params", "input_tokens", "layers", "kept_per_head", "exact", "agree", "cpu_s",
                 "device_s", "device", "dtype", "torch_threads", "cpu"]  # fmt: skip


def cpu_name() -> str:
    """The CPU's model name (the reference's hardware: fp32 reductions may order sums differently
    on another CPU kind)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def small_llama(length: int):
    """Part C's model: a seeded random fp32 Llama small enough for a 32K CPU prefill in seconds, with
    GQA (4 query heads, 2 KV heads) and the positions of the whole input."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=length,
                         tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def kept_positions(model, ids: torch.Tensor, method) -> list[torch.Tensor]:
    """The original positions each compressed layer keeps after prefill, `[batch, kv_heads, n]` on CPU
    (per-head layouts pad short heads with -1)."""
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s)
    return [
        (layer.head_positions() if hasattr(layer, "head_positions") else layer.positions).cpu()
        for _, layer in cache.compressible_layers()
    ]


def agreement(want: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[bool, float]:
    """(every layer equal, the fraction of kept positions found in the other selection's same head)."""
    same = total = 0
    for a, b in zip(want, got):
        for x, y in zip(a.flatten(0, 1), b.flatten(0, 1)):
            x, y = x[x >= 0], y[y >= 0]
            same += int(torch.isin(x, y).sum())
            total += max(len(x), len(y))
    exact = len(want) == len(got) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(want, got))
    return exact, same / max(total, 1)


def exactness(args, write=lambda row: None) -> list[dict]:
    """Part C: every registered method's kept positions at `--exact-length` on the device vs on CPU
    (`write` gets each row as it is measured)."""
    if args.exact_threads:
        torch.set_num_threads(args.exact_threads)
    cpu_model = small_llama(args.exact_length)
    dev_model = copy.deepcopy(cpu_model).to(args.device)
    vocab = cpu_model.config.vocab_size
    ids = torch.randint(3, vocab, (1, args.exact_length), generator=torch.Generator().manual_seed(0))
    rows = []
    for name in sorted(METHODS):
        if name == "full":
            continue
        fields = METHODS[name].__dataclass_fields__
        wanted = dict(budget=args.exact_budget, window=args.exact_window)
        params = {k: v for k, v in wanted.items() if k in fields}
        method = build_method(name, **params)
        t = time.perf_counter()
        want = kept_positions(cpu_model, ids, method)
        cpu_s = time.perf_counter() - t
        t = time.perf_counter()
        got = kept_positions(dev_model, ids.to(dev_model.device), method)
        if dev_model.device.type == "cuda":
            torch.cuda.synchronize()
        dev_s = time.perf_counter() - t
        exact, agree = agreement(want, got)
        kept = want[0].shape[-1] if want else 0
        row = dict(method=name, params=json.dumps(params, sort_keys=True), input_tokens=args.exact_length,
                   layers=len(want), kept_per_head=kept, exact=exact, agree=round(agree, 6),
                   cpu_s=round(cpu_s, 2), device_s=round(dev_s, 2), device=str(dev_model.device),
                   dtype="float32", torch_threads=torch.get_num_threads(), cpu=cpu_name())  # fmt: skip
        print(f"   exact {name:>24}: {'exact' if exact else 'DIFFERS'}  agree {agree:.4%}  "
              f"cpu {cpu_s:6.1f} s  {dev_model.device.type} {dev_s:5.1f} s", flush=True)  # fmt: skip
        rows.append(row)
        write(row)
    del dev_model
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


def show(row: dict) -> None:
    def ms(v):
        return f"{v * 1e3:8.1f} ms" if isinstance(v, float) else "       -   "

    def gib(v):
        return f"{v / 2**30:7.2f} GiB" if v else "      -    "

    pre = f"{row['prefill_s']:7.2f} s" if isinstance(row.get("prefill_s"), float) else "      -  "
    print(f"{row['part']:>8} {row['method']:>6} b={row['batch_size']} L={row['input_tokens']:>7}: {row['status']:<4} "
          f"prefill {pre}  TPOT {ms(row.get('tpot_s'))}  peak {gib(row.get('peak_mem_bytes'))}  "
          f"KV {gib(row.get('kv_bytes'))}  ({row['wall_s']:.0f} s)", flush=True)  # fmt: skip


def plot(tpot: list[dict], cap: list[dict], path: Path) -> None:
    # Here, not at the top: matplotlib is needed for the figure only, and the Agg backend must be
    # chosen before pyplot is imported.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    ok = [r for r in tpot if r["status"] == "ok"]
    for ax, key, label, scale in [(axes[0], "tpot_s", "decode ms / token (TPOT)", 1e3),
                                  (axes[1], "prefill_s", "prefill + compression (s)", 1.0),
                                  (axes[2], "peak_mem_bytes", "peak memory (GiB; CUDA: allocator, CPU: RSS)", 2**-30)]:  # fmt: skip
        for method, batch in sorted({(r["method"], r["batch_size"]) for r in tpot}):
            pts = sorted((r["input_tokens"], r[key] * scale) for r in ok
                         if (r["method"], r["batch_size"]) == (method, batch) and r.get(key) is not None)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"{method} (batch {batch})")
            for r in tpot:
                if (r["method"], r["batch_size"]) == (method, batch) and r["status"] == "oom":
                    ax.axvline(r["input_tokens"], ls=":", color="red", alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("input tokens")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_title("dotted red: out of memory", fontsize=8)
    methods = sorted({r["method"] for r in cap})
    longest = [
        max([r["input_tokens"] for r in cap if r["method"] == m and r["status"] == "ok"] or [0])
        for m in methods
    ]
    axes[3].barh(methods, longest, color="#4C72B0")
    for i, (m, v) in enumerate(zip(methods, longest)):
        failed = sorted(r["input_tokens"] for r in cap if r["method"] == m and r["status"] != "ok")
        note = f" {v:,}" + (f"  (oom at {failed[0]:,})" if failed else "")
        axes[3].text(v, i, note, va="center", fontsize=8)
    axes[3].set_xlabel("longest input that ran (tokens)")
    axes[3].set_xlim(0, 1.6 * max(longest + [1]))
    r0 = (tpot or cap)[0]
    fig.suptitle(
        f"{r0['model']} ({r0['dtype']}, {r0.get('attn_impl') or 'sdpa'}, {r0['device']})", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# The SnapKV paper's headline numbers (arXiv 2404.14469, abstract and its 380K needle test): what the
# measured rows are set beside.
PAPER = {
    "speedup_16k": 3.6,  # generation speed, full / SnapKV, 16K input
    "memory_16k": 8.2,  # "memory efficiency", full / SnapKV, 16K input
    "capacity": 380_000,  # input tokens on one A100-80GB with SnapKV
}


def summary(out: Path) -> str:
    """The check's tables in Markdown, rendered from the CSVs in `out` (never typed): TPOT, prefill
    and peak memory full vs snapkv by input length with the paper's ratios beside them, the longest
    input each method ran, and part C's exactness."""
    import pandas as pd

    def gib(v) -> str:
        return "-" if pd.isna(v) else f"{v / 2**30:.1f}"

    tpot = pd.read_csv(out / "gpu_tpot.csv")
    r0 = tpot.iloc[0]
    lines = [f"Model `{r0['model']}` ({r0['dtype']}, {r0.get('attn_impl', 'sdpa')}), on `{r0['device']}`; "
             f"{int(r0['decode_tokens'])} decoded tokens per run, one run per cell: TPOT is the "
             f"median [Q1, Q3] of its decode steps; snapkv budget "
             f"{int(tpot.loc[tpot.method == 'snapkv', 'budget'].iloc[0])}, window "
             f"{int(tpot.loc[tpot.method == 'snapkv', 'window'].iloc[0])}.", "",
             "| batch | input tokens | TPOT full (ms) | TPOT snapkv (ms) | full / snapkv | paper | "
             "prefill full (s) | prefill snapkv (s) | peak full (GiB) | peak snapkv (GiB) | "
             "KV full / snapkv |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for (batch, length), g in tpot.groupby(["batch_size", "input_tokens"]):
        f = g[g.method == "full"].iloc[0] if (g.method == "full").any() else None
        s = g[g.method == "snapkv"].iloc[0]
        f_ok = f is not None and f["status"] == "ok"

        def cell(row, key, scale=1.0, fmt="{:.1f}"):
            if row is None or row["status"] != "ok":
                return "-" if row is None else row["status"]
            text = fmt.format(row[key] * scale)
            if key == "tpot_s" and not pd.isna(row.get("tpot_q1_s")):  # the decode steps' IQR
                text += f" [{row['tpot_q1_s'] * scale:.1f}, {row['tpot_q3_s'] * scale:.1f}]"
            return text

        ratio = f"{f['tpot_s'] / s['tpot_s']:.2f}x" if f_ok and s["status"] == "ok" else "-"
        kv = f"{f['kv_bytes'] / s['kv_bytes']:.1f}x" if f_ok and s["status"] == "ok" else "-"
        paper = f"{PAPER['speedup_16k']}x" if length == 16384 and batch == 1 else ""
        lines.append(f"| {batch} | {length:,} | {cell(f, 'tpot_s', 1e3)} | {cell(s, 'tpot_s', 1e3)} | {ratio} | "
                     f"{paper} | {cell(f, 'prefill_s', fmt='{:.2f}')} | {cell(s, 'prefill_s', fmt='{:.2f}')} | "
                     f"{gib(f['peak_mem_bytes']) if f_ok else '-'} | "
                     f"{gib(s['peak_mem_bytes']) if s['status'] == 'ok' else '-'} | {kv} |")  # fmt: skip
    cap = pd.read_csv(out / "gpu_capacity.csv")
    lines += ["", "| method | budget | input tokens | status | prefill (s) | TPOT (ms) | peak (GiB) | paper |",
              "|---|---:|---:|---|---:|---:|---:|---|"]  # fmt: skip
    first_snapkv = cap.index[cap.method == "snapkv"].min()
    for _, r in cap.iterrows():
        ok = r["status"] == "ok"
        budget = "-" if pd.isna(r["budget"]) else f"{int(r['budget'])}"
        paper = f"{PAPER['capacity']:,} on one A100-80GB" if r.name == first_snapkv else ""
        lines.append(f"| {r['method']} | {budget} | {int(r['input_tokens']):,} | {r['status']} | "
                     f"{f'{r.prefill_s:.1f}' if ok else '-'} | {f'{r.tpot_s * 1e3:.1f}' if ok else '-'} | "
                     f"{gib(r['peak_mem_bytes'])} | {paper} |")  # fmt: skip
    exact_csv = out / "gpu_exactness.csv"
    if exact_csv.exists():
        ex = pd.read_csv(exact_csv)
        n = int(ex.input_tokens.iloc[0])
        lines += ["", f"Kept positions after a {n:,}-token prefill on `{r0['device']}` vs on CPU (fp32, a small "
                  f"random Llama, GQA 4:2): {int(ex.exact.sum())} of {len(ex)} methods exact.", "",
                  "| method | parameters | exact | kept positions that agree |", "|---|---|---|---:|"]  # fmt: skip
        for _, r in ex.iterrows():
            lines.append(
                f"| {r['method']} | `{r['params']}` | {'yes' if r['exact'] else 'no'} | {r['agree']:.2%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    args = parse(argv)
    # The shell script's start (the gpu tests ran before this process): the deadline is for the run.
    start = time.perf_counter() - (time.time() - float(os.environ.get("GPU_CHECK_T0", time.time())))
    args.out.mkdir(parents=True, exist_ok=True)
    timed = bool({"tpot", "capacity"} & set(args.parts))
    try:  # bad input fails here, before any part runs
        snap = build_method("snapkv", budget=args.budget, window=args.window)
        cap_snap = build_method(
            "snapkv", budget=args.cap_budget, window=args.cap_window, kernel_size=args.cap_kernel
        )
        full = build_method("full")
        if timed:
            model, _, info = load_model(args.model, args.dtype, args.device, args.attn)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    if "exact" in args.parts:
        print(
            f"== C: kept positions at {args.exact_length:,} tokens, {args.device} vs CPU (fp32) ==",
            flush=True,
        )
        with open(args.out / "gpu_exactness.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=EXACT_COLUMNS, extrasaction="ignore")
            w.writeheader()
            rows = exactness(args, lambda row: (w.writerow(row), f.flush()))
        print(f"wrote {args.out / 'gpu_exactness.csv'}: {sum(r['exact'] for r in rows)} of {len(rows)} exact")
    if not timed:
        return 0
    vocab = model.config.get_text_config(decoder=True).vocab_size
    device = model.device
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, **info,
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                      "weights_GiB": round(weights_bytes(model) / 2**30, 2)}), flush=True)  # fmt: skip
    if args.warmup:  # cuBLAS / kernel selection / allocator warm-up, not recorded
        for method in (full, snap):
            run_one(model, vocab, method, args.warmup, 1, args, "warmup")
    per_token = kv_bytes_per_token(model.config, DTYPES[args.dtype])
    total = device_bytes(device)

    tpot_rows: list[dict] = []
    with open(args.out / "gpu_tpot.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for batch in args.batches if "tpot" in args.parts else []:
            for length in args.lengths:
                for method in (full, snap):
                    need = weights_bytes(model) + batch * length * per_token
                    if method is full and total is not None and need > total:
                        row = dict(part="tpot", method="full", batch_size=batch, input_tokens=length, status="oom",
                                   error=f"not run: weights + full KV = {need / 2**30:.1f} GiB > "
                                         f"{total / 2**30:.1f} GiB on the device", model=args.model,
                                   dtype=args.dtype, device=str(device), wall_s=0.0)  # fmt: skip
                    else:
                        row = run_one(model, vocab, method, length, batch, args, "tpot")
                    tpot_rows.append(row)
                    w.writerow(row)
                    f.flush()
                    show(row)
    print(f"wrote {args.out / 'gpu_tpot.csv'}")

    cap_rows: list[dict] = []
    with open(args.out / "gpu_capacity.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        last = None  # (length, wall seconds) of the last snapkv capacity run: predicts the next one

        def fits(what: str, length: int, predicted: float) -> bool:
            elapsed = time.perf_counter() - start
            if elapsed + predicted <= args.deadline_s:
                return True
            print(f"capacity: {what} at L={length:,} not started (predicted {predicted:.0f} s; "
                  f"{elapsed:.0f} s of the {args.deadline_s:.0f} s deadline used)", flush=True)  # fmt: skip
            return False

        def record(method, length: int) -> dict:
            row = run_one(model, vocab, method, length, 1, args, "capacity")
            cap_rows.append(row)
            w.writerow(row)
            f.flush()
            show(row)
            return row

        for i, length in enumerate(args.cap_lengths if "capacity" in args.parts else []):
            if i == 0:
                # full first, at the first (>= 380K) length: expected to run out of memory part-way
                # through the prefill (its K/V for every layer do not fit), so it costs less than
                # snapkv's run; both always start
                record(full, length)
            elif not fits("snapkv", length, last[1] * (length / last[0]) ** 2):
                break  # prefill is attention-bound at these lengths: quadratic in L
            row = record(cap_snap, length)
            if row["status"] != "ok":
                break
            last = (length, row["wall_s"])
    print(f"wrote {args.out / 'gpu_capacity.csv'}")
    plot(tpot_rows, cap_rows, args.out / "gpu_check.png")
    print(f"wrote {args.out / 'gpu_check.png'}")

    ok = {(r["method"], r["batch_size"], r["input_tokens"]): r for r in tpot_rows if r["status"] == "ok"}
    print("\nTPOT full / TPOT snapkv (the paper: 3.6x at 16K):")
    for (m, b, n), r in sorted(ok.items()):
        if m == "full" and ("snapkv", b, n) in ok and r["tpot_s"] and ok["snapkv", b, n]["tpot_s"]:
            print(f"  batch {b} L={n:>7}: {r['tpot_s'] / ok['snapkv', b, n]['tpot_s']:.2f}x")
    print(f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main(sys.argv[1:]))
