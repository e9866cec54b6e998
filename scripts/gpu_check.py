"""The GPU speed and memory check behind scripts/gpu_check.sh (one prepared run on a CUDA machine).

    python scripts/gpu_check.py --out DIR [--model random:llama2-7b --dtype bfloat16 --device cuda ...]

A. TPOT vs input length, full vs snapkv (budget 2048, window 32: the paper's decode-speed setting),
   batch 1 and 2, with prefill time (prefill + compression) and the CUDA allocator peak.
B. Capacity: snapkv(budget 1024, window 16, kernel 5: the paper's 380K needle setting) vs full at
   393,216 tokens (384K, beyond the paper's 380K), then longer inputs while the time budget allows.

Only the library API (`snapkv.models.load_model`, `snapkv.generate_ids`) is used: no Hydra /
OmegaConf, so the GPU machine needs nothing beyond its image (pytest for the test step comes from
the carry kit where missing). Inputs are random token ids; EOS is off, every run decodes `--decode`
tokens. A run that raises CUDA out-of-memory becomes a row with status=oom (the memory it reached
in `peak_mem_bytes`); the TPOT sweep does not start a configuration whose weights + full KV cache
alone exceed the device (a row status=oom, error "not run: ..."). Writes gpu_tpot.csv,
gpu_capacity.csv and gpu_check.png into `--out`.
"""

from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from snapkv import build_method  # noqa: E402
from snapkv.models import DTYPES, load_model  # noqa: E402

COLUMNS = ["part", "method", "budget", "window", "kernel_size", "batch_size", "input_tokens", "status",
           "prefill_s", "ttft_s", "tpot_s", "decode_tokens", "peak_mem_bytes", "weights_bytes", "kv_bytes",
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
        row.update(status="ok", prefill_s=res.prefill_s, ttft_s=res.ttft_s, tpot_s=res.tpot_s,
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


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_since_reset(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def device_bytes(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


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


def main(argv: list[str]) -> int:
    args = parse(argv)
    # The shell script's start (the gpu tests ran before this process): the deadline is for the run.
    start = time.perf_counter() - (time.time() - float(os.environ.get("GPU_CHECK_T0", time.time())))
    try:
        snap = build_method("snapkv", budget=args.budget, window=args.window)
        cap_snap = build_method(
            "snapkv", budget=args.cap_budget, window=args.cap_window, kernel_size=args.cap_kernel
        )
        full = build_method("full")
        model, _, info = load_model(args.model, args.dtype, args.device, args.attn)
    except (ValueError, FileNotFoundError) as e:
        print(f"gpu_check: error: {e}", file=sys.stderr)
        return 2
    vocab = model.config.get_text_config(decoder=True).vocab_size
    device = model.device
    print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda, **info,
                      "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                      "weights_GiB": round(weights_bytes(model) / 2**30, 2)}), flush=True)  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warmup:  # cuBLAS / kernel selection / allocator warm-up, not recorded
        for method in (full, snap):
            run_one(model, vocab, method, args.warmup, 1, args, "warmup")
    per_token = kv_bytes_per_token(model.config, DTYPES[args.dtype])
    total = device_bytes(device)

    tpot_rows: list[dict] = []
    with open(args.out / "gpu_tpot.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for batch in args.batches:
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

        for i, length in enumerate(args.cap_lengths):
            # prefill is attention-bound at these lengths: quadratic in L
            if last and not fits("snapkv", length, last[1] * (length / last[0]) ** 2):
                break
            row = run_one(model, vocab, cap_snap, length, 1, args, "capacity")
            cap_rows.append(row)
            w.writerow(row)
            f.flush()
            show(row)
            if row["status"] != "ok":
                break
            last = (length, row["wall_s"])
            # full at the first (>= 380K) length: expected to run out of memory about halfway through
            # the prefill (its K/V for every layer do not fit); a full prefill at most costs what snapkv's did
            if i == 0 and fits("full", length, row["wall_s"]):
                row = run_one(model, vocab, full, length, 1, args, "capacity")
                cap_rows.append(row)
                w.writerow(row)
                f.flush()
                show(row)
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
