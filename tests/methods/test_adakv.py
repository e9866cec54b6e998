"""Ada-KV's head budgets against a naive transcription of the original's formula.

Transcribed from FFY0/AdaKV (`adaptive_snapkv/monkeypatch/snapkv_utils.py`, `AdaptiveSnapKVCluster`
`update_kv_gqa` / `calcul_attn_sore`): window-mean votes, group mean (gqa_support), pooling, per
head `ratio = sum(top-P) / sum(all)` multiplied in (`normalize`), a global top-(h*P), per head
`round(count * (1 - alpha) + int(P * alpha))` selected entries plus the window (the votes and
counts: tests/reference.py). `allocation="exact"` is this harness's own, against its own loop."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from conftest import random_ids, tiny_model
from reference import eager_attentions, naive_adakv_counts, naive_pooled_votes

from methods._common import W, prefilled
from snapkv import build_method
from snapkv.methods.adakv import head_budgets


def naive_exact_counts(
    scores: list[list[float]], per_head: int, alpha: float, normalize: bool | str
) -> list[int]:
    """This harness's `allocation="exact"` (and `normalize="sum"`): ceil floor, largest remainder."""
    h = len(scores)
    if normalize == "sum":
        scores = [[v / sum(row) for v in row] for row in scores]
    elif normalize is True:
        scores = [[v * sum(sorted(row, reverse=True)[:per_head]) / sum(row) for v in row] for row in scores]
    flat = sorted(((v, i, j) for i, row in enumerate(scores) for j, v in enumerate(row)), key=lambda t: -t[0])
    counts = [sum(1 for _, i, _ in flat[: h * per_head] if i == head) for head in range(h)]
    floor = math.ceil(Fraction(alpha).limit_denominator(10**6) * per_head)
    reals = [floor + Fraction(per_head - floor, per_head) * c for c in counts]
    ints = [math.floor(r) for r in reals]
    order = sorted(range(h), key=lambda i: (-(reals[i] - ints[i]), i))
    for i in order[: h * per_head - sum(ints)]:
        ints[i] += 1
    return ints


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.35])
@pytest.mark.parametrize("normalize", [False, True])
def test_adakv_default_allocation_is_the_original_formula(alpha, normalize):
    """Defaults (allocation="adakv") = AdaKV's int floor + per-head round; normalize=True = its
    top-P mass ratio. Checked on the counts and on the kept positions of a tiny GQA model."""
    model = tiny_model("mistral")
    ids = random_ids(96)
    budget = 40  # P = 32: alpha * P = 6.4 / 16 / 11.2 (int floor != ceil for 0.2 and 0.35)
    method = build_method("adakv", budget=budget, window=W, kernel_size=7, alpha=alpha, normalize=normalize)
    cache = prefilled(model, ids, method)
    attns = eager_attentions(model, ids)
    for layer_idx, layer in cache.compressible_layers():
        votes = naive_pooled_votes(attns[layer_idx], 2, W, 7)
        counts = naive_adakv_counts(votes, budget - W, alpha, normalize)
        assert (layer.lengths[0] - W).tolist() == counts, f"layer {layer_idx}"
        pos = layer.head_positions()
        for head, row in enumerate(votes):
            top = sorted(range(len(row)), key=lambda j: -row[j])[: counts[head]]
            want = sorted(top) + list(range(96 - W, 96))
            assert pos[0, head, : counts[head] + W].tolist() == want


def test_adakv_default_floor_differs_from_ceil_and_can_underspend():
    # P = 32, alpha = 0.2: the original's floor is int(6.4) = 6 (ceil: 7); its total falls short.
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(4, 8, 100, generator=g) ** 4
    scores[:, :3] += 10  # heads 0-2 hold the global top-256: the others count 0
    for row in range(4):
        s = scores[row].tolist()
        assert head_budgets(scores[row : row + 1], 32, 0.2)[0].tolist() == naive_adakv_counts(
            s, 32, 0.2, False
        )
    orig = head_budgets(scores, 32, 0.2)
    assert bool((orig.sum(-1) < 8 * 32).all())  # 0.4 entries per head below the budget, rounded
    exact = head_budgets(scores, 32, 0.2, allocation="exact")
    assert exact.sum(-1).tolist() == [8 * 32] * 4 and bool((exact >= 7).all())
    assert orig[:, 3:].eq(6).all()  # the int floor: 6 entries, where ceil(alpha * P) = 7


@pytest.mark.parametrize("normalize", [False, True, "sum"])
@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
def test_exact_allocation_equals_its_transcription(normalize, alpha):
    g = torch.Generator().manual_seed(1)
    scores = torch.rand(3, 4, 50, generator=g) ** 3
    scores[:, 0] *= 5  # head 0 has more mass: normalisations change the split
    for row in range(3):
        s = scores[row].tolist()
        got = head_budgets(scores[row : row + 1], 12, alpha, normalize, allocation="exact")[0].tolist()
        assert got == naive_exact_counts(s, 12, alpha, normalize)


def test_normalize_variants_are_different_formulas():
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(1, 4, 60, generator=g) ** 6
    scores[:, 1] *= 20
    got = {str(n): head_budgets(scores, 10, 0.0, n).tolist() for n in (False, True, "sum")}
    assert len({str(v) for v in got.values()}) == 3
    for n in (False, True):
        assert got[str(n)][0] == naive_adakv_counts(scores[0].tolist(), 10, 0.0, n)


def test_adakv_pyramid_base_keeps_adakv_short_prompt_behaviour():
    # AdaKV's own pyramid mode has no uniform fallback: Ada-PyramidKV defaults to the clipped pyramid.
    method = build_method("adakv", budget=40, window=W, base="pyramidkv")
    assert (
        method.short_prompt == "clip"
        and build_method("pyramidkv", budget=40, window=W).short_prompt == "uniform"
    )
