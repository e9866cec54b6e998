"""Expected Attention against a naive transcription of kvpress' ExpectedAttentionPress (and AdaKVPress)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids, tiny_model

from methods._common import FMAX, MODELS, kept_by_method, layer_inputs, top_indices, topk_rows
from snapkv import build_method

# Transcribed (definitions re-written with loops; no code copied) from NVIDIA/kvpress @
# 8bb29b9c3078452a86d692f29123fa6c793e2b05, `kvpress/presses/expected_attention_press.py`
# (`get_query_statistics`, `apply_avg_rope`, `score`), `kvpress/utils.py`
# (`get_prerope_query_states`: q_proj of the hidden states, q_norm),
# `kvpress/presses/adakv_press.py` (`AdaKVPress.compress`).
# Protected entries (the sinks) get max + 1, as ExpectedAttentionPress does. The budget is given
# as entries (n_kept) where kvpress derives it from a compression ratio. Every top-k here breaks
# ties towards the earlier position (`top_indices`), as this harness does: torch.topk's choice
# among equal scores is unspecified.


@torch.no_grad()
def naive_expected_attention(
    model, module, hidden, keys, values, n_future, n_sink, cov, vnorm, eps, scale=None
):
    """`ExpectedAttentionPress.score` for one row -> `[kv_heads, L]` (sinks at max + 1). `scale`:
    the logit scaling (the original: 1 / sqrt(head_dim))."""
    heads, d = model.config.num_attention_heads, module.head_dim
    length = hidden.shape[1]
    # Pre-RoPE queries of the hidden states after the sinks (get_prerope_query_states).
    q = module.q_proj(hidden[:, n_sink:]).view(1, length - n_sink, heads, d).transpose(1, 2)
    if hasattr(module, "q_norm"):
        q = module.q_norm(q)
    mu = q.mean(dim=2)  # [1, heads, d]
    sigma = None
    if cov:
        centred = q - mu[:, :, None]
        sigma = sum(centred[:, :, s, :, None] * centred[:, :, s, None, :] for s in range(length - n_sink)) / (
            length - n_sink
        )
    # Averaged RoPE matrix over the next n_future positions (apply_avg_rope).
    rotary = model.model.rotary_emb
    kw = {"layer_type": "full_attention"} if hasattr(rotary, "layer_types") else {}
    cos, sin = rotary(mu, torch.arange(length, length + n_future)[None], **kw)
    half = d // 2
    perm = torch.zeros(d, d)
    perm[half:, :half], perm[:half, half:] = torch.eye(half), -torch.eye(half)
    rot = sum(torch.diag(cos[0, p]) + torch.diag(sin[0, p]) @ perm for p in range(n_future)) / n_future
    mu = mu @ rot.T
    if cov:
        sigma = rot @ sigma @ rot.T
    kv = keys.shape[1]
    k = keys[:, :, n_sink:].repeat_interleave(heads // kv, dim=1)  # repeat_kv: [1, heads, n, d]
    scale = 1 / math.sqrt(d) if scale is None else scale
    n = k.shape[2]
    logits = (
        torch.stack([torch.stack([mu[0, h] @ k[0, h, j] for j in range(n)]) for h in range(heads)]) * scale
    )
    if cov:
        quad = torch.stack(
            [torch.stack([k[0, h, j] @ sigma[0, h] @ k[0, h, j] for j in range(n)]) for h in range(heads)]
        )
        logits = logits + quad * scale * scale / 2
    probs = logits.softmax(dim=-1).view(kv, heads // kv, n).mean(dim=1)
    if vnorm:
        probs = (probs + eps) * values[0, :, n_sink:].norm(dim=-1)
    return torch.cat([probs.new_full((kv, n_sink), float(probs.max()) + 1), probs], dim=-1)


def naive_adakv_press_keep(scores: torch.Tensor, n_kept: int, alpha: float) -> list[list[int]]:
    """`AdaKVPress.compress` for one row: each head's top int(n_kept x alpha) first, then the
    bottom H x (L - n_kept) entries over all heads pruned. Kept positions per head, ascending."""
    heads, length = scores.shape
    s = scores.clone()
    n_safe = int(n_kept * alpha)
    for h in range(heads):
        s[h, top_indices(scores[h], n_safe)] = FMAX
    pruned = set(top_indices(-s.reshape(-1), heads * (length - n_kept)).tolist())
    return [[j for j in range(length) if h * length + j not in pruned] for h in range(heads)]


def _ea_expected(model, name, params, row: torch.Tensor, budget: int):
    """The original's kept positions per layer for one row `[L]`."""
    out = {}
    length = row.shape[0]
    for idx, (module, hidden, keys, values) in enumerate(layer_inputs(model, row[None])):
        if length <= budget:  # not compressed
            out[idx] = [list(range(length))] * keys.shape[1]
            continue
        scale = module.scaling if params.get("scale") == "module" else None
        scores = naive_expected_attention(
            model, module, hidden, keys, values, params.get("n_future_positions", 512),
            params.get("n_sink", 4), params.get("use_covariance", True), params.get("use_vnorm", True),
            params.get("epsilon", 0.0 if name == "expected_attention" else 1e-2), scale,
        )  # fmt: skip
        if name == "expected_attention":
            out[idx] = topk_rows(scores, budget)
        else:
            out[idx] = naive_adakv_press_keep(scores, budget, params.get("alpha", 0.2))
    return out


EA_CASES = [
    ("expected_attention", {}),
    ("expected_attention", dict(use_covariance=False, n_future_positions=16, epsilon=0.05)),
    ("expected_attention", dict(use_vnorm=False, n_sink=2)),
    ("adakv_expected_attention", {}),
    ("adakv_expected_attention", dict(alpha=0.5, n_sink=2, layout="padded")),
]


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("name,params", EA_CASES)
@pytest.mark.parametrize("rows", ["single", "batch2", "padded"])
def test_expected_attention_selects_as_kvpress(kind, name, params, rows):
    """Kept positions == the transcription of kvpress's ExpectedAttentionPress (plain: ScorerPress's
    top-k; adakv_expected_attention: AdaKVPress), at L = budget - 1, budget, budget + 1 and a longer
    prompt; in a batch of two and in a left-padded batch, each row as if alone."""
    model = MODELS[kind]()
    budget = 24
    method = build_method(name, budget=budget, **params)
    lengths = {"single": [budget - 1, budget, budget + 1, 70], "batch2": [50], "padded": [70]}[rows]
    for length in lengths:
        if rows == "single":
            batch = [random_ids(length)[0]]
        elif rows == "batch2":
            batch = [random_ids(length, seed=s)[0] for s in (1, 2)]
        else:
            batch = [random_ids(n, seed=s)[0] for n, s in ((length, 1), (budget + 1, 2), (budget - 3, 3))]
        got = kept_by_method(model, method, batch)
        for r, row in enumerate(batch):
            want = _ea_expected(model, name, params, row, budget)
            for idx in want:
                assert got[idx][r] == want[idx], f"L={len(row)}, row {r}, layer {idx}"


@pytest.mark.parametrize("kind", ["mha", "gqa"])
@pytest.mark.parametrize("name", ["expected_attention", "adakv_expected_attention"])
def test_expected_attention_fits_its_queries_in_blocks_as_in_one_pass(kind, name, monkeypatch):
    """The Gaussian fit runs over blocks of queries (merged): blocks of 9 queries, the last one
    partial, select what kvpress's single pass does; a padded batch included."""
    import snapkv.methods.expected_attention as ea

    monkeypatch.setattr(ea, "QUERY_BLOCK", 9)
    model, budget = MODELS[kind](), 24
    method = build_method(name, budget=budget)
    for batch in ([random_ids(70)[0]], [random_ids(n, seed=s)[0] for n, s in ((70, 1), (budget + 1, 2))]):
        got = kept_by_method(model, method, batch)
        for r, row in enumerate(batch):
            want = _ea_expected(model, name, {}, row, budget)
            for idx in want:
                assert got[idx][r] == want[idx], f"L={len(row)}, row {r}, layer {idx}"


def test_expected_attention_on_a_qk_norm_model_with_per_layer_type_rope():
    """Gemma 3 (q_norm before RoPE; a rotary embedding per layer type; query_pre_attn_scalar
    scaling): the pre-RoPE statistics and the future rotation follow the model. Compared with the
    transcription using the module's scaling, where the original uses 1 / sqrt(head_dim)."""
    model = tiny_model("gemma3")
    row = random_ids(60)[0]
    method = build_method("expected_attention", budget=24)
    got = kept_by_method(model, method, [row])
    layers = dict(enumerate(layer_inputs(model, row[None])))
    for idx, kept in got.items():
        module, hidden, keys, values = layers[idx]
        scores = naive_expected_attention(
            model, module, hidden, keys, values, 512, 4, True, True, 0.0, module.scaling
        )
        assert kept[0] == topk_rows(scores, 24), f"layer {idx}"


def test_query_statistics_of_chunks_merge_to_those_of_all_queries():
    from snapkv.methods.expected_attention import QueryStats

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 50, 8, generator=g) * 5 + 100  # a large mean: no cancellation allowed
    merged = (
        QueryStats.of(q[:, :, :7]).merged(QueryStats.of(q[:, :, 7:30])).merged(QueryStats.of(q[:, :, 30:]))
    )
    whole = QueryStats.of(q)
    assert merged.count == 50
    torch.testing.assert_close(merged.mean, whole.mean)
    torch.testing.assert_close(merged.m2, whole.m2, rtol=1e-4, atol=1e-3)
