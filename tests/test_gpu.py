"""The harness on a CUDA device (`pytest -m gpu`), with a `cpu` variant of a test body where it
checks what the CPU tests do not already check.

Every test takes the `device` fixture; the `cuda` variant is marked `gpu` and skipped, with a
reason, where no CUDA device is present. `pytest -m gpu tests/test_gpu.py` runs only the CUDA
variants (scripts/gpu_check.sh does). No `cpu` variant for the selections compared with a CPU run
(on CPU, a run compared with itself), nor for the decode and chunked-prefill checks: on CPU,
tests/test_core.py runs both for every method of the catalogue at tighter tolerances, on two rows
(`test_compressed_decoding_equals_masked_full_cache`,
`test_chunked_prefill_selects_exactly_as_single_pass`).

What is checked per device, for every registered method:
- compressed decoding (fp32) == a masked full-cache reference (eager float64 attention limited to
  the entries each step really attended to): logits atol 1e-4 / rtol 1e-4 (CPU-vs-CPU tests use
  1e-5; CUDA's sdpa kernels reorder the float32 sums);
- the kept positions on the device (fp32) == the kept positions on CPU, exactly;
- bf16: compressed decoding vs the same masked reference in bf16: logits within atol 0.02 (this
  model's logits reach ~0.5), and the kept positions agree with fp32 for >= 90% of the entries
  (not all: this random model's scores are near-flat, so bf16 rounding flips near-ties at the cut);
- top-k ties: `Method.select` on the device == a stable sort on CPU (earlier position wins);
- chunked prefill == single pass (kept positions exact, keys within 1e-5);
- the peak-memory probe sees a known allocation and stays within it plus a small slack.
"""

from __future__ import annotations

import csv
import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model
from reference import masked_reference_logits, record_visible

import snapkv
from snapkv import METHODS, CompressedCache, build_method, generate_ids, prefill
from snapkv.forward import PeakMemory
from snapkv.hooks import session

HAS_CUDA = torch.cuda.is_available()
GPU = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device present")]
DEVICES = ["cpu", pytest.param("cuda", marks=GPU)]
PROMPT, NEW, W = 96, 8, 8

# One evicting configuration per method (and per storage layout); methods registered later get a
# default case below, so "every method" stays true.
CASES = [
    ("full", {}),
    ("snapkv", dict(budget=40, window=W, kernel_size=5)),
    ("h2o", dict(budget=40, evict_during_decode=True)),
    ("h2o", dict(budget=40, evict_during_decode=False)),
    ("streamingllm", dict(budget=40, n_sink=4)),
    ("pyramidkv", dict(budget=40, window=W, kernel_size=5)),
    ("adakv", dict(budget=40, window=W, layout="padded")),
    ("adakv", dict(budget=40, window=W, layout="varlen")),
]
for _name, _cls in sorted(METHODS.items()):
    if _name not in {n for n, _ in CASES}:
        _fields = _cls.__dataclass_fields__
        CASES.append((_name, {k: v for k, v in dict(budget=40, window=W).items() if k in _fields}))
IDS = [f"{n}-" + "-".join(f"{k}={v}" for k, v in p.items()) for n, p in CASES]


def on_cuda(cases, ids) -> list:
    """`device, name, params` rows of the `cuda` device alone (the `device` fixture's ids)."""
    return [
        pytest.param("cuda", name, params, id=f"cuda-{case_id}", marks=GPU)
        for (name, params), case_id in zip(cases, ids)
    ]


EVICTING, EVICTING_IDS = [c for c in CASES if c[0] != "full"], IDS[1:]


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


def model_on(device: torch.device, dtype=torch.float32, arch: str = "llama"):
    return tiny_model(arch).to(device=device, dtype=dtype)


def positions(layer) -> torch.Tensor:
    """Kept original positions `[batch, kv_heads, n]` (per-head layouts pad short heads with -1)."""
    return (layer.head_positions() if hasattr(layer, "head_positions") else layer.positions).cpu()


def prefilled(model, ids: torch.Tensor, method, chunk_size: int | None = None) -> CompressedCache:
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s, chunk_size=chunk_size)
    return cache


def decode_vs_reference(model, method, device):
    ids = random_ids(PROMPT).to(device)
    (out, res), records = record_visible(
        model, lambda: generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True)
    )
    fed = [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
    ref = masked_reference_logits(model, [ids], fed, records)[-len(res.logits) :]
    return res, [r.cpu() for r in ref]


@pytest.mark.parametrize("device,name,params", on_cuda(CASES, IDS), indirect=["device"])
def test_compressed_decode_equals_masked_full_cache(device, name, params):
    model = model_on(device)
    res, ref = decode_vs_reference(model, build_method(name, **params), device)
    assert res.device.startswith(device.type)
    assert res.compressed == (name != "full")
    for step, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("device,name,params", on_cuda(EVICTING, EVICTING_IDS), indirect=["device"])
def test_selections_equal_cpu_selections_in_fp32(device, name, params):
    ids = random_ids(PROMPT)
    method = build_method(name, **params)
    want = prefilled(model_on(torch.device("cpu")), ids, method)
    got = prefilled(model_on(device), ids.to(device), method)
    for (i, a), (_, b) in zip(want.compressible_layers(), got.compressible_layers()):
        assert torch.equal(positions(a), positions(b)), f"layer {i}"


@pytest.mark.parametrize("name,params", EVICTING, ids=EVICTING_IDS)
def test_bf16_decode_within_tolerance(device, name, params):
    method = build_method(name, **params)
    res, ref = decode_vs_reference(model_on(device, torch.bfloat16), method, device)
    for step, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=0.02, rtol=0.0, msg=f"step {step}")
    ids = random_ids(PROMPT).to(device)
    lo = prefilled(model_on(device, torch.bfloat16), ids, method)
    hi = prefilled(model_on(device), ids, method)
    for (i, a), (_, b) in zip(lo.compressible_layers(), hi.compressible_layers()):
        pa, pb = positions(a), positions(b)
        same = sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(pa.flatten(0, 1), pb.flatten(0, 1)))
        assert same >= 0.90 * pb[pb >= 0].numel(), f"layer {i}: {same} of {pb.numel()} kept positions agree"


@pytest.mark.parametrize("n", [64, 5000, 70000])
def test_topk_ties_are_stable(device, n):
    """Heavy ties (max-pooled scores repeat): the earlier position wins, the same on every device,
    at sizes where CUDA switches sort algorithms."""
    g = torch.Generator().manual_seed(n)
    scores = torch.randint(0, 4, (2, 3, n), generator=g).float()
    method = build_method("snapkv", budget=40, window=W)
    budget = n // 3
    got = method.select(scores.to(device), budget).cpu()
    want = method.select(scores, budget)
    assert torch.equal(got, want)
    # independent reference: order by (-score, position), keep the first `budget`, ascending
    s = scores.clone()
    s[..., -W:] = float("inf")  # the window is protected
    for b in range(2):
        for h in range(3):
            row = s[b, h].tolist()
            keep = sorted(sorted(range(n), key=lambda j: (-row[j], j))[:budget])
            assert got[b, h].tolist() == keep


@pytest.mark.parametrize("device,name,params", on_cuda(EVICTING, EVICTING_IDS), indirect=["device"])
def test_chunked_prefill_equals_single_pass(device, name, params):
    model = model_on(device)
    ids = random_ids(PROMPT).to(device)
    method = build_method(name, **params)
    single, chunked = prefilled(model, ids, method), prefilled(model, ids, method, chunk_size=24)
    for (i, a), (_, b) in zip(single.compressible_layers(), chunked.compressible_layers()):
        assert torch.equal(positions(a), positions(b)), f"layer {i}"
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)


def test_peak_memory_probe_sees_an_allocation(device):
    size = 256 * 2**20
    with PeakMemory(device) as idle:
        pass
    with PeakMemory(device) as mem:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)  # written: RSS sees the pages too
        del x
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        assert size <= mem.peak - base <= size + 2 * 2**20  # the allocator peak: exact up to its rounding
    else:
        assert mem.peak - idle.peak >= 0.9 * size  # process RSS, sampled: most of the pages seen


def test_a_peak_memory_phase_sees_only_what_follows_it(device):
    size = 256 * 2**20
    with PeakMemory(device) as mem:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        time.sleep(0.05)  # the CPU probe samples RSS every 5 ms
        del x
        mem.phase()
        y = torch.ones(size // 64, dtype=torch.float32, device=device)
        time.sleep(0.05)
        del y
    assert mem.phase_peak is not None and mem.peak - mem.phase_peak >= 0.9 * size


def test_generation_peak_memory_is_at_least_the_kv_cache(device):
    model = model_on(device)
    _, res = generate_ids(model, random_ids(PROMPT).to(device), None, build_method("full"), max_new_tokens=2)
    assert res.kv_bytes > 0 and res.peak_mem_bytes >= res.kv_bytes
    assert res.kv_bytes <= res.decode_peak_mem_bytes <= res.peak_mem_bytes  # decoding holds the cache
    assert not snapkv.hooks_installed()


# --- scripts/gpu_check.sh / gpu_check.py at toy sizes on CPU (the prepared GPU run's smoke test) ---

ROOT = Path(__file__).resolve().parents[1]
TOY = dict(MODEL="random:llama-tiny", DTYPE="float32", DEVICE="cpu", LENGTHS="[64,128]", BATCHES="[1,2]",
           BUDGET="48", WINDOW="8", CAP_LENGTHS="[256,320]", CAP_BUDGET="64", CAP_WINDOW="8", DECODE="3",
           EXACT_LENGTH="160", EXACT_BUDGET="48", EXACT_WINDOW="8", EXACT_THREADS="1")  # fmt: skip


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_out_of_memory_becomes_an_oom_row_and_the_run_goes_on(tmp_path, monkeypatch):
    gpu_check = _gpu_check_module()
    real = snapkv.generate_ids

    def fake(model, ids, question, method, **kw):
        if method.name == "full" and ids.shape[1] >= 256:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB")
        return real(model, ids, question, method, **kw)

    monkeypatch.setattr(snapkv, "generate_ids", fake)
    args = ["--out", str(tmp_path), "--model", "random:llama-tiny", "--dtype", "float32", "--device", "cpu",
            "--lengths", "64", "--batches", "1", "--decode", "2", "--cap-lengths", "256,320",
            "--cap-budget", "64", "--cap-window", "8", "--warmup", "0", "--parts", "tpot,capacity"]  # fmt: skip
    assert gpu_check.main(args) == 0
    cap = list(csv.DictReader((tmp_path / "gpu_capacity.csv").open()))
    assert [(r["method"], r["input_tokens"], r["status"]) for r in cap] == [
        ("full", "256", "oom"), ("snapkv", "256", "ok"), ("snapkv", "320", "ok")
    ]  # fmt: skip
    assert "out of memory" in cap[0]["error"]


def test_capacity_runs_stop_at_the_deadline(tmp_path):
    gpu_check = _gpu_check_module()
    args = ["--out", str(tmp_path), "--model", "random:llama-tiny", "--dtype", "float32", "--device", "cpu",
            "--lengths", "64", "--batches", "1", "--decode", "2", "--cap-lengths", "256,320",
            "--warmup", "0", "--deadline-s", "0", "--parts", "tpot,capacity"]  # fmt: skip
    assert gpu_check.main(args) == 0  # the first length's two runs always start; nothing after them
    cap = list(csv.DictReader((tmp_path / "gpu_capacity.csv").open()))
    assert [(r["method"], r["input_tokens"]) for r in cap] == [("full", "256"), ("snapkv", "256")]


def test_exactness_part_compares_every_method_on_two_devices(tmp_path):
    gpu_check = _gpu_check_module()
    args = ["--out", str(tmp_path), "--device", "cpu", "--parts", "exact", "--exact-length", "160",
            "--exact-budget", "48", "--exact-window", "8", "--exact-threads", "1"]  # fmt: skip
    assert gpu_check.main(args) == 0
    rows = list(csv.DictReader((tmp_path / "gpu_exactness.csv").open()))
    assert [r["method"] for r in rows] == sorted(set(METHODS) - {"full"})
    for r in rows:  # CPU against CPU: the same selection; every method really evicted (48 of 160)
        assert (r["exact"], float(r["agree"]), r["layers"]) == ("True", 1.0, "2"), r
        assert 0 < int(r["kept_per_head"]) < 160, r
        assert '"budget": 48' in r["params"]
    assert not (tmp_path / "gpu_tpot.csv").exists()  # part C alone loads no 7B-shape model


def test_agreement_sees_one_moved_position_and_ignores_head_padding():
    agreement = _gpu_check_module().agreement
    a = torch.tensor([[[0, 3, 5, 9], [1, 2, 4, -1]]])
    assert agreement([a], [a.clone()]) == (True, 1.0)
    b = a.clone()
    b[0, 0, 2] = 6  # one of seven kept positions differs
    assert agreement([a], [b]) == (False, 6 / 7)
    assert agreement([a, a], [a]) == (False, 1.0)  # a missing layer is not exact


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
@pytest.mark.parametrize(
    "bad,value",
    [(["--lengths", "4k"], "4k"), (["--model", "random:nope"], "nope"), (["--parts", "tpot,speed"], "speed"),
     (["--exact-length", "0"], "0")],
)  # fmt: skip
def test_gpu_check_bad_input_is_one_line_exit_2(tmp_path, bad, value):
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", "--out", str(tmp_path), "--device", "cpu", *bad],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and value in proc.stderr, proc.stderr


def _make_figures_module():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(path: Path, columns: list[str], rows: list[dict]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def test_gpu_tables_are_rendered_from_the_rows_into_the_report_and_the_docs(tmp_path):
    gpu_check, make_figures = _gpu_check_module(), _make_figures_module()
    folder = tmp_path / "results" / "gpu"
    folder.mkdir(parents=True)
    common = dict(model="random:llama2-7b", dtype="bfloat16", device="cuda:0", attn_impl="sdpa", decode_tokens=16,
                  part="tpot", window=32)  # fmt: skip

    def tpot_row(method, batch, length, tpot, status="ok"):
        ok = status == "ok"
        return dict(common, method=method, budget=2048 if method == "snapkv" else "", batch_size=batch,
                    input_tokens=length, status=status, prefill_s=1.5 if ok else "", tpot_s=tpot if ok else "",
                    tpot_q1_s=tpot * 0.9 if ok else "", tpot_q3_s=tpot * 1.1 if ok else "",
                    peak_mem_bytes=20 * 2**30 if ok else "", kv_bytes=(8 if method == "full" else 1) * 2**30 if ok else "")  # fmt: skip

    _write(folder / "gpu_tpot.csv", gpu_check.COLUMNS, [
        tpot_row("full", 1, 16384, 0.036), tpot_row("snapkv", 1, 16384, 0.012),
        tpot_row("full", 2, 131072, 0.0, status="oom"), tpot_row("snapkv", 2, 131072, 0.013),
    ])  # fmt: skip
    _write(folder / "gpu_capacity.csv", gpu_check.COLUMNS, [
        dict(tpot_row("full", 1, 393216, 0.0, status="oom"), part="capacity", peak_mem_bytes=139 * 2**30),
        dict(tpot_row("snapkv", 1, 393216, 0.02), part="capacity", budget=1024),
    ])  # fmt: skip
    _write(folder / "gpu_exactness.csv", gpu_check.EXACT_COLUMNS, [
        dict(method="h2o", params='{"budget": 1024}', input_tokens=32768, layers=2, kept_per_head=1024, exact=True,
             agree=1.0, cpu_s=3.0, device_s=0.5, device="cuda:0", dtype="float32", torch_threads=14, cpu="x"),
        dict(method="snapkv", params='{"budget": 1024, "window": 32}', input_tokens=32768, layers=2,
             kept_per_head=1024, exact=False, agree=0.999, cpu_s=3.0, device_s=0.5, device="cuda:0",
             dtype="float32", torch_threads=14, cpu="x"),
    ])  # fmt: skip
    docs = tmp_path / "benchmarking.md"
    docs.write_text(f"# Before\n\n{make_figures.GPU_BEGIN}\nstale\n{make_figures.GPU_END}\n\n## After\n")
    written = make_figures.gpu(tmp_path / "results", docs)
    assert set(written) == {folder / "gpu_check.png", folder / "report.md", docs}
    text = docs.read_text()
    assert text.startswith("# Before\n") and text.endswith(f"{make_figures.GPU_END}\n\n## After\n")
    assert "stale" not in text
    # full / snapkv from the rows (0.036 / 0.012), beside the paper's 3.6x at 16K, batch 1
    assert "| 1 | 16,384 | 36.0 [32.4, 39.6] | 12.0 [10.8, 13.2] | 3.00x | 3.6x |" in text
    assert "| 2 | 131,072 | oom | 13.0 [11.7, 14.3] | - |  |" in text
    assert "| full | - | 393,216 | oom | - | - | 139.0 |  |" in text
    assert "| snapkv | 1024 | 393,216 | ok | 1.5 | 20.0 | 20.0 | 380,000 on one A100-80GB |" in text
    assert "1 of 2 methods exact" in text and "| snapkv | `" in text and "| no | 99.90% |" in text
    assert (
        text.split(make_figures.GPU_BEGIN)[1]
        in (folder / "report.md").read_text() + make_figures.GPU_END + "\n\n## After\n"
    )
    assert (folder / "gpu_check.png").read_bytes()[:4] == b"\x89PNG"
    make_figures.gpu(tmp_path / "results", docs)  # a second rebuild changes nothing
    assert docs.read_text() == text
