"""The harness on a CUDA device (`pytest -m gpu`), with the same test bodies run on CPU in CI.

Every test takes the `device` fixture: the `cpu` variant always runs (it proves the test logic
and the device handling of the code under test); the `cuda` variant is marked `gpu` and skipped,
with a reason, where no CUDA device is present. `pytest -m gpu tests/test_gpu.py` runs only the
CUDA variants (scripts/gpu_check.sh does).

What is checked per device, for every registered method:
- compressed decoding (fp32) == a masked full-cache reference (eager float64 attention limited to
  the entries each step really attended to): logits atol 1e-4 / rtol 1e-4 (CPU-vs-CPU tests use
  1e-5; CUDA's sdpa kernels reorder the float32 sums);
- the kept positions on the device (fp32) == the kept positions on CPU, exactly;
- bf16: compressed decoding vs the same masked reference in bf16: logits within atol 0.02 (this
  model's logits reach ~0.5; measured on CPU: at most 0.004 for every method), and the kept
  positions agree with fp32 for >= 95% of the entries (measured on CPU: 98.8-100%);
- top-k ties: `Method.select` on the device == a stable sort on CPU (earlier position wins);
- chunked prefill == single pass (kept positions exact, keys within 1e-5);
- the peak-memory probe sees a known allocation and stays within it plus a small slack.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from reference import masked_reference_logits, record_visible

import snapkv
from snapkv import METHODS, CompressedCache, build_method, generate_ids
from snapkv.generation import PeakMemory
from snapkv.hooks import cache_kwarg, session

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device present")]
    ),
]
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
    n = ids.shape[1]
    bounds = [(a, min(a + chunk_size, n)) for a in range(0, n, chunk_size)] if chunk_size else [(0, n)]
    with torch.no_grad(), session(model, method, cache) as s:
        for i, (a, b) in enumerate(bounds):
            s.phase = "final" if i == len(bounds) - 1 else "prefill"
            pos = torch.arange(a, b, device=ids.device)[None]
            model(
                input_ids=ids[:, a:b],
                position_ids=pos,
                use_cache=True,
                logits_to_keep=1,
                **{cache_kwarg(model): cache},
            )
    return cache


def decode_vs_reference(model, method, device):
    ids = random_ids(PROMPT).to(device)
    (out, res), records = record_visible(
        model, lambda: generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True)
    )
    fed = [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
    ref = masked_reference_logits(model, [ids], fed, records)[-len(res.logits) :]
    return res, [r.cpu() for r in ref]


@pytest.mark.parametrize("name,params", CASES, ids=IDS)
def test_compressed_decode_equals_masked_full_cache(device, name, params):
    model = model_on(device)
    res, ref = decode_vs_reference(model, build_method(name, **params), device)
    assert res.device.startswith(device.type)
    assert res.compressed == (name != "full")
    for step, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] != "full"], ids=IDS[1:])
def test_selections_equal_cpu_selections_in_fp32(device, name, params):
    ids = random_ids(PROMPT)
    method = build_method(name, **params)
    want = prefilled(model_on(torch.device("cpu")), ids, method)
    got = prefilled(model_on(device), ids.to(device), method)
    for (i, a), (_, b) in zip(want.compressible_layers(), got.compressible_layers()):
        assert torch.equal(positions(a), positions(b)), f"layer {i}"


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] != "full"], ids=IDS[1:])
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
        assert same >= 0.95 * pb[pb >= 0].numel(), f"layer {i}: {same} of {pb.numel()} kept positions agree"


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


@pytest.mark.parametrize("name,params", [c for c in CASES if c[0] != "full"], ids=IDS[1:])
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


def test_generation_peak_memory_is_at_least_the_kv_cache(device):
    model = model_on(device)
    _, res = generate_ids(model, random_ids(PROMPT).to(device), None, build_method("full"), max_new_tokens=2)
    assert res.kv_bytes > 0 and res.peak_mem_bytes >= res.kv_bytes
    assert not snapkv.hooks_installed()
