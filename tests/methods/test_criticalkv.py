"""CriticalKV against a naive transcription of the authors' CriticalKVPress and CriticalAdaKVPress."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids
from reference import eager_attentions, naive_adakv_counts, naive_kvpress_snapkv_votes, naive_pooled_votes

from methods._common import FMAX, MODELS, kept_by_method, layer_inputs, top_indices
from snapkv import build_method

# Transcribed (definitions re-written with loops; no code copied) from FFY0/AdaKV-in-NVIDIA-kvpress
# @ 88f5b1fb245d356c4a37cc734dd47dcd817779f1 (branch `criticalkv`, the authors' code),
# `kvpress/presses/criticalkv_press.py`: `CriticalKVPress.vwl1norm` and `.score` (kept:
# ScorerPress's top n_kept), `CriticalAdaKVPress.compress`.
# CriticalKV's base scores by default are AdaKV's window-mean max-pooled votes (tests/reference.py's
# `naive_pooled_votes`); with `pooling="avg", gqa_order="pool_first"` they are kvpress' SnapKVPress
# (`naive_kvpress_snapkv_votes`), the press the authors' `criti_snapkv` / `criti_adasnapkv`
# (`evaluation/evaluate.py`) wrap. Both are window means: the scale the original's scores have. Protected entries (the
# window) get max + 1, as kvpress's ExpectedAttentionPress does (its SnapKVPress pads with the max
# itself: a tie with the best prefix entry that topk may break either way). The budget is given as
# entries (n_kept) where kvpress derives it from a compression ratio. Every top-k here breaks ties
# towards the earlier position (`top_indices`), as this harness does: torch.topk's choice among
# equal scores is unspecified, and max-pooled votes have plateaus of equal scores.


def naive_vwl1norm(module, values: torch.Tensor, heads: int) -> torch.Tensor:
    """`CriticalKVPress.vwl1norm` for one row: per query head ||v W_o^h||_1, mean over the group ->
    `[kv_heads, L]`."""
    kv, length, d = values.shape[1:]
    w_o = module.o_proj.weight.T.reshape(heads, d, -1)  # [heads, d, hidden]
    v = values.repeat_interleave(heads // kv, dim=1)  # repeat_kv
    norms = torch.stack([(v[0, h] @ w_o[h]).abs().sum(dim=-1) for h in range(heads)])  # [heads, L]
    return norms.view(kv, heads // kv, length).mean(dim=1)


def naive_criticalkv_keep(scores, norms, n_kept: int, ratio: float, eps: float) -> list[list[int]]:
    """`CriticalKVPress.score`, then ScorerPress's top n_kept, per head."""
    kept = []
    for h in range(scores.shape[0]):
        first = top_indices(scores[h], int(n_kept * ratio))
        s = (scores[h] + eps) * norms[h]
        s[first] = FMAX
        kept.append(sorted(top_indices(s, n_kept).tolist()))
    return kept


def naive_critical_adakv_keep(scores, norms, n_kept, alpha, ratio, eps, counts=None) -> list[list[int]]:
    """`CriticalAdaKVPress.compress` for one row. `counts` (entries per head, protected included):
    given, they replace the original's allocation (kvpress's safeguard + global top-k)."""
    heads, length = scores.shape
    s = scores.clone()
    if counts is None:
        n_safe = int(n_kept * alpha)
        for h in range(heads):
            s[h, top_indices(s[h], n_safe)] = FMAX
        top = top_indices(s.reshape(-1), n_kept * heads) // length
        counts = [int((top == h).sum()) for h in range(heads)]
    for h in range(heads):  # stage 1
        # Ties among the safeguarded entries (all at FMAX) go by their score: topk's choice among
        # them is unspecified, and stage 1 is meant to keep the top entries by score.
        order = top_indices(scores[h], length)
        s[h, order[top_indices(s[h, order], int(counts[h] * ratio))]] = FMAX
    s = (s + eps) * norms  # stage 2
    for h in range(heads):
        s[h, top_indices(s[h], counts[h])] = FMAX
    if sum(counts) == heads * n_kept:  # the original's bottom-k prune over all heads
        pruned = set(top_indices(-s.reshape(-1), heads * (length - n_kept)).tolist())
        return [[j for j in range(length) if h * length + j not in pruned] for h in range(heads)]
    return [sorted(top_indices(s[h], counts[h]).tolist()) for h in range(heads)]


def _critical_expected(model, params, row: torch.Tensor, budgets: dict[int, int]):
    """The original's kept positions per layer for one row `[L]`; `budgets`: each layer's n_kept
    (PyramidKV's layer budgets are tested against KVCache-Factory in test_pyramidkv.py)."""
    w, kernel = params["window"], params["kernel_size"]
    ratio, eps, alpha = (
        params.get("first_stage_ratio", 0.5),
        params.get("epsilon", 1e-4),
        params.get("alpha", 0.2),
    )
    heads = model.config.num_attention_heads
    attns = eager_attentions(model, row[None])
    out = {}
    for idx, (module, _, _, values) in enumerate(layer_inputs(model, row[None])):
        length, kv = row.shape[0], values.shape[1]
        if length <= params["budget"]:
            out[idx] = [list(range(length))] * kv
            continue
        if params.get("pooling") == "avg" and params.get("gqa_order") == "pool_first":
            votes = torch.tensor(naive_kvpress_snapkv_votes(attns[idx], kv, w, kernel))  # [kv, L - w]
        else:
            votes = torch.tensor(naive_pooled_votes(attns[idx], kv, w, kernel))
        scores = torch.cat([votes, votes.new_full((kv, w), float(votes.max()) + 1)], dim=-1).float()
        norms = naive_vwl1norm(module, values, heads)
        n_kept = budgets[idx]
        if params.get("base", "snapkv") != "adakv":
            out[idx] = naive_criticalkv_keep(scores, norms, n_kept, ratio, eps)
        elif params.get("allocation") == "kvpress":
            out[idx] = naive_critical_adakv_keep(scores, norms, n_kept, alpha, ratio, eps)
        else:  # Ada-KV's own allocation (tests/reference.py), then the two stages
            counts = [c + w for c in naive_adakv_counts(votes.tolist(), n_kept - w, alpha, False)]
            out[idx] = naive_critical_adakv_keep(scores, norms, n_kept, alpha, ratio, eps, counts)
    return out


CRITICAL_CASES = [
    dict(base="snapkv"),
    dict(base="snapkv", first_stage_ratio=0.25, epsilon=1e-2),
    dict(base="pyramidkv"),
    dict(base="adakv", allocation="kvpress", alpha=0.5),
    dict(base="adakv", layout="padded"),
    # The authors' `criti_snapkv` and `criti_adasnapkv`: CriticalKVPress / CriticalAdaKVPress around
    # kvpress' SnapKVPress (avg-pooled per query head, then the group mean).
    dict(base="snapkv", pooling="avg", gqa_order="pool_first"),
    dict(base="adakv", allocation="kvpress", pooling="avg", gqa_order="pool_first"),
]


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("params", CRITICAL_CASES, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("rows", ["single", "batch2", "padded"])
def test_criticalkv_selects_as_the_authors_code(kind, params, rows):
    """Kept positions == the transcription of the authors' CriticalKVPress (ScorerPress's top-k) /
    CriticalAdaKVPress over AdaKV's pooled window votes, at L = budget - 1, budget, budget + 1 and a
    longer prompt; in a batch of two and in a left-padded batch, each row as if alone."""
    model = MODELS[kind]()
    params = dict(budget=24, window=4, kernel_size=5, **params)
    method = build_method("criticalkv", **params)
    lengths = {"single": [23, 24, 25, 64], "batch2": [50], "padded": [64]}[rows]
    for length in lengths:
        if rows == "single":
            batch = [random_ids(length)[0]]
        elif rows == "batch2":
            batch = [random_ids(length, seed=s)[0] for s in (1, 2)]
        else:
            batch = [random_ids(n, seed=s)[0] for n, s in ((length, 1), (25, 2), (21, 3))]
        got = kept_by_method(model, method, batch)
        for r, row in enumerate(batch):
            alone = kept_by_method(model, method, [row])  # the row's layer budgets (pyramid)
            budgets = {idx: max(len(h) for h in kept[0]) for idx, kept in alone.items()}
            if params["base"] == "adakv":
                budgets = {idx: params["budget"] for idx in budgets}
            want = _critical_expected(model, params, row, budgets)
            for idx in want:
                assert got[idx][r] == want[idx], f"L={len(row)}, row {r}, layer {idx}"


@pytest.mark.parametrize("block", [None, 7])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_projected_value_norms_equal_the_per_head_loop(kv_heads, block, monkeypatch):
    """CriticalKV's ||v W_o^h||_1 (group mean) and KVzip+'s ||v W_o^h||_2 (per head) against a loop
    over heads; `block=7`: blocks of 7 entries (the last one partial) instead of one."""
    from types import SimpleNamespace

    import snapkv.methods.criticalkv as criticalkv
    from snapkv.methods.kvzip import head_output_norms

    if block is not None:
        monkeypatch.setattr(criticalkv, "CPU_BLOCK_BYTES", 1)
        monkeypatch.setattr(criticalkv, "MIN_BLOCK_ENTRIES", block)
        assert (
            len(list(criticalkv.head_projections(torch.zeros(2, kv_heads, 30, 8), torch.zeros(16, 32)))) == 5
        )
    g = torch.Generator().manual_seed(kv_heads)
    values = torch.randn(2, kv_heads, 30, 8, generator=g)
    proj = torch.nn.Linear(4 * 8, 16, bias=False)
    module = SimpleNamespace(o_proj=proj)
    got = criticalkv.projected_value_norms(values, proj.weight)
    l2 = head_output_norms(values, proj.weight)  # [b, kv, group, n]
    w_o = proj.weight.detach().T.reshape(4, 8, 16)  # [heads, d, hidden]
    for r in range(2):
        want = naive_vwl1norm(module, values[r : r + 1], 4)
        torch.testing.assert_close(got[r], want.detach())
        v = values[r].repeat_interleave(4 // kv_heads, dim=0)  # [heads, n, d]
        want_l2 = torch.stack([(v[h] @ w_o[h]).norm(dim=-1) for h in range(4)])
        torch.testing.assert_close(l2[r].reshape(4, 30), want_l2)


def test_criticalkv_and_expected_attention_refuse_models_without_what_they_need():
    from snapkv.methods.criticalkv import output_projections
    from snapkv.rope import Rotary

    bare = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ValueError, match="o_proj"):
        output_projections(bare)
    with pytest.raises(ValueError, match="rotary embedding"):
        Rotary(bare)
