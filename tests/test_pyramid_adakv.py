"""PyramidKV (layer budgets) and Ada-KV (head budgets, per-head storage) on tiny random models."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import COMMON, random_ids, tiny_model
from reference import masked_reference_logits, record_visible
from transformers import AutoModelForCausalLM, Gemma3TextConfig

import snapkv.headwise as headwise
from snapkv import CompressedCache, build_method, generate_ids, prefill
from snapkv.forward import cache_kwarg
from snapkv.headwise import HeadwiseLayer, segment_attention
from snapkv.hooks import session
from snapkv.methods.adakv import head_budgets
from snapkv.methods.pyramidkv import pyramid_budgets

PROMPT = 96
NEW = 8
W = 8


def run(model, method, ids, question=None, **kw):
    return generate_ids(model, ids, question, method, max_new_tokens=NEW, keep_logits=True, **kw)


def prefilled(model, ids, method, chunk_size=None):
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s, chunk_size=chunk_size)
    return cache


# ---- exactness ---------------------------------------------------------------------------------


# The method-wide exactness tests (budget >= length == full, compressed decoding == the masked full
# cache, chunked prefill, model.generate inside apply) run over tests/method_catalogue.py in
# tests/test_core.py; the tests here are specific to layer and head budgets.


@pytest.mark.parametrize("layout", ["padded", "varlen"])
def test_eager_attention_and_chunked_prefill(layout):
    model = tiny_model("qwen2", attn="eager")
    ids = random_ids(PROMPT)
    ctx, q = ids[:, :80], ids[:, 80:]
    method = build_method("adakv", budget=40, window=W, layout=layout, base="pyramidkv")
    (out, res), records = record_visible(model, lambda: run(model, method, ctx, q, query_aware=False))
    fed = [q] + [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
    ref = masked_reference_logits(model, [ctx], fed, records)[-len(res.logits) :]
    for a, b in zip(res.logits, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    chunked, _ = run(model, method, ctx, q, query_aware=False, chunk_size=24)
    assert torch.equal(chunked, out)


def test_adakv_uniform_floor_selects_exactly_snapkv():
    # alpha = 1: every head keeps budget - window selected entries, SnapKV's own selection.
    model = tiny_model("mistral")
    ids = random_ids(PROMPT)
    snap = prefilled(model, ids, build_method("snapkv", budget=40, window=W))
    for layout in ("padded", "varlen"):
        ada = prefilled(model, ids, build_method("adakv", budget=40, window=W, alpha=1.0, layout=layout))
        for (_, a), (_, b) in zip(snap.compressible_layers(), ada.compressible_layers()):
            assert torch.equal(a.positions, b.head_positions())


# ---- budgets -----------------------------------------------------------------------------------


def _kvcache_factory_budgets(budget, window, n, beta=20):
    """KVCache-Factory's integer schedule (prefix floor step), for the overspend comparison."""
    p = budget - window
    lo = p // beta
    hi = 2 * p - lo
    step = (hi - lo) // (n - 1)
    return [hi - i * step + window for i in range(n)]


@pytest.mark.parametrize(
    "budget,window,n", [(64, 8, 30), (64, 8, 32), (64, 32, 28), (100, 16, 7), (2048, 32, 80)]
)
@pytest.mark.parametrize("length", [None, 100, 3000])
def test_pyramid_schedule_mean_is_exact(budget, window, n, length):
    if length is not None and length <= budget:
        length = budget + 1
    got = pyramid_budgets(budget, window, n, 20, length)
    assert sum(got) == budget * n and len(got) == n
    assert all(a >= b for a, b in zip(got, got[1:]))  # non-increasing with depth
    assert all(window < b <= (length or 10**9) for b in got)
    p = budget - window
    hi = min(2 * p - p / 20, (length or 10**9) - window)
    lo = 2 * p - hi
    for i, b in enumerate(got):  # within one entry of the real-valued linear schedule
        assert abs(b - window - (hi - (hi - lo) * i / (n - 1))) < 1


def test_kvcache_factory_floor_overspends_where_ours_does_not():
    theirs = _kvcache_factory_budgets(64, 8, 32)
    assert sum(theirs) / 32 == 71.5 and (sum(theirs) / 32 - 8) / 56 == pytest.approx(1.134, abs=1e-3)
    assert sum(pyramid_budgets(64, 8, 32, 20, None)) / 32 == 64


@pytest.mark.parametrize("name", ["pyramidkv", "adakv"])
def test_realised_mean_budget_equals_request_on_30_layers(name):
    model = tiny_model("llama", layers=30)
    ids = random_ids(200)
    params = dict(budget=64, window=W) | (
        dict(base="pyramidkv", allocation="exact") if name == "adakv" else {}
    )
    _, res = generate_ids(model, ids, None, build_method(name, **params), max_new_tokens=1)
    per_layer = res.kv_tokens_per_layer
    assert len(per_layer) == 30 and sum(per_layer) == 64 * 30  # mean exactly 64, never above
    assert per_layer == [float(b) for b in pyramid_budgets(64, W, 30, 20, 200)]
    assert per_layer[0] > per_layer[-1] > W


def test_hybrid_model_counts_only_full_attention_layers():
    torch.manual_seed(0)
    config = Gemma3TextConfig(num_hidden_layers=12, sliding_window=16, head_dim=16, **COMMON)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    ids = random_ids(PROMPT)
    _, res = generate_ids(model, ids, None, build_method("pyramidkv", budget=40, window=W), max_new_tokens=2)
    assert res.kv_tokens_per_layer == [float(b) for b in pyramid_budgets(40, W, 2, 20, PROMPT)]
    assert sum(res.kv_tokens_per_layer) == 80


def test_head_budgets_sum_floor_and_adaptivity():
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 4, 50, generator=g)
    scores[:, 0] += 10  # head 0 dominates the global top-k
    for alpha in (0.0, 0.2, 0.5, 1.0):
        for normalize in (False, True, "sum"):
            c = head_budgets(scores, 12, alpha, normalize, allocation="exact")
            assert c.sum(-1).tolist() == [48, 48, 48]
            assert bool((c >= math.ceil(alpha * 12)).all()) and bool((c <= 50).all())
    for allocation in ("exact", "adakv"):
        assert head_budgets(scores, 12, 1.0, allocation=allocation).eq(12).all()
        c = head_budgets(scores, 12, 0.2, allocation=allocation)
        assert bool((c[:, 0] > 12).all()) and bool((c[:, 1:] >= 2).all())
        # no floor: all to head 0
        assert head_budgets(scores, 12, 0.0, allocation=allocation)[:, 0].tolist() == [48, 48, 48]


@pytest.mark.parametrize("layout", ["padded", "varlen"])
@pytest.mark.parametrize("base", ["snapkv", "pyramidkv"])
def test_adakv_head_counts_sum_to_layer_budget_and_respect_floor(layout, base):
    model = tiny_model("llama")
    ids = random_ids(PROMPT, batch=2)
    method = build_method(
        "adakv", budget=40, window=W, layout=layout, base=base, alpha=0.2, allocation="exact"
    )
    cache = prefilled(model, ids, method)
    for _, layer in cache.compressible_layers():
        budget = method.layer_budget(layer)
        assert layer.per_head and layer.lengths.sum(-1).tolist() == [2 * budget, 2 * budget]
        assert bool((layer.lengths >= W + math.ceil(0.2 * (budget - W))).all())
        pos = layer.head_positions()
        for b in range(2):
            for h in range(2):
                kept = pos[b, h, : layer.lengths[b, h]]
                assert kept[-W:].tolist() == list(range(PROMPT - W, PROMPT))  # window kept
                assert bool((kept[1:] > kept[:-1]).all())
    assert any(not torch.equal(la.lengths[:, 0], la.lengths[:, 1]) for _, la in cache.compressible_layers())


# ---- bytes -------------------------------------------------------------------------------------


def test_allocated_bytes_follow_head_budgets():
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    res = {}
    for layout in ("padded", "varlen"):
        method = build_method("adakv", budget=40, window=W, layout=layout, allocation="exact")
        _, res[layout] = generate_ids(model, ids, None, method, max_new_tokens=1)
        cache = prefilled(model, ids, method)
        for _, layer in cache.compressible_layers():
            b, h, d = layer.dims
            logical = int(layer.lengths.sum()) * d * 2 * 4
            allocated = layer.keys.numel() * 4 + layer.values.numel() * 4
            if layout == "varlen":
                assert allocated == logical and layer.keys.shape == (int(layer.lengths.sum()), d)
            else:
                assert allocated == 2 * b * h * int(layer.lengths.max()) * d * 4 >= logical
    pad, var = res["padded"], res["varlen"]
    assert var.kv_bytes == var.kv_bytes_logical == pad.kv_bytes_logical == 3 * 40 * 2 * 16 * 2 * 4
    assert var.kv_bytes < pad.kv_bytes < pad.kv_bytes_full  # masking-only keeps all L entries
    assert pad.kv_bytes_full == var.kv_bytes_full == 3 * PROMPT * 2 * 16 * 2 * 4


def test_cache_layers_grow_by_one_per_decoded_token():
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    for layout in ("padded", "varlen"):
        method = build_method("adakv", budget=40, window=W, layout=layout)
        cache = prefilled(model, ids, method)
        before = {i: la.lengths.clone() for i, la in cache.compressible_layers()}
        with torch.no_grad(), session(model, method, cache) as s:
            s.phase = "decode"
            model(
                input_ids=ids[:, :3], position_ids=torch.arange(96, 99)[None], **{cache_kwarg(model): cache}
            )
        for i, layer in cache.compressible_layers():
            assert torch.equal(layer.lengths, before[i] + 3) and layer.seen == 99
            pos = layer.head_positions()
            for h, n in enumerate(layer.lengths[0].tolist()):
                assert pos[0, h, n - 3 : n].tolist() == [96, 97, 98] and bool((pos[0, h, n:] == -1).all())


# ---- the varlen attention itself ------------------------------------------------------------------


def _varlen_layer(lengths, d=16, seen=50, q=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h = lengths.shape
    layer = HeadwiseLayer(layout="varlen")
    total = int(lengths.sum())
    layer.keys, layer.values = torch.randn(total, d, generator=g), torch.randn(total, d, generator=g)
    pos = []
    for n in lengths.flatten().tolist():  # random kept positions, then the q incoming tokens
        kept = torch.randperm(seen - q, generator=g)[: n - q].sort().values
        pos.append(torch.cat([kept, torch.arange(seen - q, seen)]))
    layer.positions, layer.dims, layer.seen = torch.cat(pos), (b, h, d), seen
    layer._set_lengths(lengths)
    return layer


def _dense_reference(query, layer, scaling):
    b, heads, q, d = query.shape
    h = layer.dims[1]
    pos = layer.head_positions()
    out = torch.zeros(b, q, heads, d, dtype=torch.float64)
    starts = layer.cu_seqlens[:-1].long().view(b, h)
    for bi in range(b):
        for hi in range(heads):
            kv = hi // (heads // h)
            s, n = int(starts[bi, kv]), int(layer.lengths[bi, kv])
            k, v = layer.keys[s : s + n].double(), layer.values[s : s + n].double()
            logits = query[bi, hi].double() @ k.T * scaling
            qpos = torch.arange(layer.seen - q, layer.seen)
            logits = logits.masked_fill(pos[bi, kv, :n][None] > qpos[:, None], -math.inf)
            out[bi, :, hi] = logits.softmax(-1) @ v
    return out


@pytest.mark.parametrize("q", [1, 5])
def test_segment_attention_is_exact(q):
    lengths = torch.tensor([[9, 20, 14], [12, 7, 30]])
    layer = _varlen_layer(lengths, q=q)
    query = torch.randn(2, 6, q, 16, generator=torch.Generator().manual_seed(1))
    want = _dense_reference(query, layer, 0.25)
    got = segment_attention(query, layer, 0.25, max_block_bytes=1)  # one query per block
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(segment_attention(query, layer, 0.25).double(), want, atol=1e-5, rtol=1e-5)


def test_flash_varlen_packing(monkeypatch):
    """The flash-attn call's packing, with a PyTorch stand-in for flash_attn_varlen_func that follows
    its documented semantics (causal = bottom-right aligned per sequence; nheads_k divides nheads)."""

    def fake(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, softcap):
        out = torch.empty_like(q)
        for i in range(len(cu_q) - 1):
            qs, qe, ks, ke = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
            logits = torch.einsum("qgd,kd->gqk", q[qs:qe].double(), k[ks:ke, 0].double()) * softmax_scale
            nq, nk = qe - qs, ke - ks
            visible = torch.ones(nq, nk, dtype=torch.bool).tril(nk - nq)
            logits = logits.masked_fill(~visible, -math.inf)
            out[qs:qe] = torch.einsum("gqk,kd->qgd", logits.softmax(-1), v[ks:ke, 0].double()).to(q.dtype)
        return out

    monkeypatch.setattr(headwise, "flash_attn_varlen_func", fake)
    monkeypatch.setattr(headwise, "_use_flash", lambda query, layer: True)
    lengths = torch.tensor([[9, 20], [12, 7]])
    for q in (1, 4):
        layer = _varlen_layer(lengths, q=q)
        query = torch.randn(2, 4, q, 16, generator=torch.Generator().manual_seed(2))
        got = headwise.varlen_attention(query, layer, 0.25)
        torch.testing.assert_close(got.double(), _dense_reference(query, layer, 0.25), atol=1e-5, rtol=1e-5)


# ---- errors ------------------------------------------------------------------------------------


def test_adakv_snapkv_base_needs_no_pyramid_headroom_and_plain_cache_is_refused():
    method = build_method("adakv", budget=20, window=8)  # base=snapkv: no beta constraint
    model = tiny_model("llama")
    cache = CompressedCache(model.config)  # plain layers: no per-head storage
    with pytest.raises(ValueError, match="per-head storage"):
        with torch.no_grad(), session(model, method, cache):
            model(input_ids=random_ids(40), use_cache=True, **{cache_kwarg(model): cache})
