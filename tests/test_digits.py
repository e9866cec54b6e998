"""SnapKV's `span` option (our variant, default off) and the kept-positions analysis of the needle."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from conftest import random_ids, tiny_model
from reference import eager_attentions

from eval.analysis.digits import digits_ablation_figure
from eval.analysis.kept_positions import kept_fractions, main
from eval.conf import method_config
from snapkv import CompressedCache, build_method, prefill
from snapkv.hooks import session
from snapkv.methods.base import pool, reduce_group, window_attention
from snapkv.methods.snapkv import spread_forward


def naive_spread(xs: list[float], span: int) -> list[float]:
    return [max(xs[max(0, i - span + 1) : i + 1]) for i in range(len(xs))]


@pytest.mark.parametrize("span", [1, 2, 3, 8, 40])
def test_spread_forward_equals_naive_transcription(span):
    g = torch.Generator().manual_seed(span)
    x = torch.rand(2, 3, 33, generator=g)
    got = spread_forward(x, span)
    want = torch.tensor([[naive_spread(row.tolist(), span) for row in head] for head in x])
    assert torch.equal(got, want)


def test_spread_forward_carries_a_vote_forward_only():
    x = torch.zeros(1, 1, 12)
    x[..., 3] = 5.0
    assert spread_forward(x, 4)[0, 0].tolist() == [0, 0, 0, 5, 5, 5, 5, 0, 0, 0, 0, 0]


def _prefill(model, ids, method) -> CompressedCache:
    cache = CompressedCache(model.config)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s)
    return cache


def naive_span_selection(attn, kv_heads, budget, window, kernel, span):
    """Kept positions per KV head from one layer's eager weights, max-pool + mean over the group +
    the span rule, with loops (the rule as the SnapKV docstring states it)."""
    _, h, length, _ = attn.shape
    g, prefix = h // kv_heads, length - window
    kept = []
    for kvh in range(kv_heads):
        per_head = []
        for qh in range(kvh * g, (kvh + 1) * g):
            votes = [float(attn[0, qh, prefix:, j].sum()) for j in range(prefix)]
            r = kernel // 2
            per_head.append([max(votes[max(0, j - r) : j + r + 1]) for j in range(prefix)])
        score = [sum(c) / g for c in zip(*per_head)]
        score = naive_spread(score, span)
        top = sorted(range(prefix), key=lambda j: -score[j])[: budget - window]
        kept.append(sorted(top) + list(range(prefix, length)))
    return kept


@pytest.mark.parametrize("span", [2, 6])
def test_span_selection_equals_naive_reference(span):
    model = tiny_model("llama")
    ids = random_ids(64)
    # The naive reference pools each query head, then averages the group (gqa_order=pool_first).
    method = build_method("snapkv", budget=24, window=8, kernel_size=5, span=span, gqa_order="pool_first")
    attns = eager_attentions(model, ids)
    cache = _prefill(model, ids, method)
    for layer_idx, layer in cache.compressible_layers():
        want = naive_span_selection(attns[layer_idx], 2, 24, 8, 5, span)
        assert layer.positions[0].tolist() == want, f"layer {layer_idx}"


@pytest.mark.parametrize("order", ["reduce_first", "pool_first"])
@pytest.mark.parametrize("span", [None, 1])
def test_span_off_is_the_paper_bit_for_bit(span, order):
    """span None (default) and 1: the scores are today's formula, to the bit, and so the selection."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 40, 16), torch.randn(1, 2, 40, 16)
    module = type("M", (), {"scaling": 0.25})()
    layer = type("L", (), {"softcap": None, "sinks": None, "state": "prefill"})()
    method = build_method("snapkv", budget=20, window=8, kernel_size=7, span=span, gqa_order=order)
    votes = window_attention(q, k, 8, 0.25)[..., :-8]
    want = torch.zeros(1, 2, 40)
    if order == "pool_first":
        want[..., :-8] = reduce_group(pool(votes, 7, "max"), "mean")
    else:
        want[..., :-8] = pool(reduce_group(votes, "mean"), 7, "max")
    got = method.score(layer, q, k, module)
    assert torch.equal(got, want)
    paper = build_method("snapkv", budget=20, window=8, gqa_order=order)
    assert torch.equal(method.select(got, 20), paper.select(want, 20))
    assert build_method("snapkv").span is None


@pytest.mark.parametrize("span", [2, 8, 31, 200])
def test_span_never_exceeds_the_budget(span):
    model = tiny_model("llama", layers=2)
    ids = random_ids(96)
    cache = _prefill(model, ids, build_method("snapkv", budget=40, window=8, kernel_size=7, span=span))
    for _, layer in cache.compressible_layers():
        pos = layer.positions[0]
        assert pos.shape[-1] == 40
        for head in pos.tolist():
            assert len(set(head)) == 40 and head[-8:] == list(range(88, 96))


def test_span_keeps_the_run_after_a_vote():
    """One strong vote at position 10: with span 6 the 5 positions after its pooled plateau are kept."""
    method = build_method("snapkv", budget=8 + 13, window=8, kernel_size=7, span=7)
    scores = torch.full((1, 1, 60), 0.01)
    scores[..., 10] = 1.0
    scores = spread_forward(pool(scores[..., :-8], 7, "max"), 7)
    full = torch.cat([scores, torch.zeros(1, 1, 8)], dim=-1)
    kept = method.select(full, 21)[0, 0].tolist()
    assert kept[:13] == list(range(7, 20))  # 10-3 .. 10+3 by pooling, then +6 by the span


def test_conf_snapkv_has_span_off():
    node = method_config("snapkv")
    assert "span" in node and node.span is None


def test_kept_fractions_count_what_each_head_kept():
    model = tiny_model("llama", layers=2)
    ids = random_ids(80)
    frac = kept_fractions(model, ids, build_method("snapkv", budget=30, window=8, span=4))
    assert frac.shape == (2, 80)
    assert torch.allclose(frac.sum(-1), torch.full((2,), 30.0))  # every KV head keeps exactly 30
    assert torch.equal(frac[:, -8:], torch.ones(2, 8))  # the window, always
    uncompressed = kept_fractions(model, ids, build_method("snapkv", budget=100, window=8))
    assert torch.equal(uncompressed, torch.ones(2, 80))


def test_digits_ablation_figure_bars_are_the_means():
    p7, p7s, full = dict(budget=512, kernel_size=7), dict(budget=512, kernel_size=7, span=8), {"budget": None}
    rows = pd.DataFrame(
        {
            "method_params": [p7, p7, p7s, p7s, full, full],
            "context_length": [1000] * 6,
            "score": [0.0, 1.0, 1.0, 1.0, 1.0, 1.0],
            "partial": [0.5, 1.0, 1.0, 0.75, 1.0, 1.0],
        }
    )
    fig = digits_ablation_figure(rows, "t")
    exact, partial = ([b.get_height() for b in ax.patches] for ax in fig.axes)
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == [
        "full cache",
        "k=7 (paper)",
        "k=7 span=8 (ours)",
    ]
    assert exact == [100.0, 50.0, 100.0] and partial == [100.0, 75.0, 87.5]


def test_kept_positions_cli_rejects_an_unknown_key_before_loading(capsys):
    assert main(["lenght=2000"]) == 2
    assert "'lenght'" in capsys.readouterr().err
