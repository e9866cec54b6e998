"""K-norm against a naive transcription of the authors' `l2_compress` (and kvpress' KnormPress)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import random_ids, tiny_model
from transformers import DynamicCache

from methods._common import (
    LENGTHS_AROUND_BUDGET,
    B,
    check_batches,
    decode_with_history,
    naive_evicting_decode,
    tiny_llama,
)
from snapkv import build_method, generate_ids
from snapkv.forward import cache_kwarg

# Transcribed from alessiodevoto/l2compress @ f93d6ca2702d85a2db97d2ef350b44d955609761 (`cache.py`,
# `l2_compress`): per layer not in `skip_layers` whose cache holds >= `prune_after` entries, per batch
# row and KV head, the keys sorted by L2 norm (ascending), the first `tokens_to_keep` =
# `ceil(keep_ratio * n)` of the layer's n entries kept. `gen_utils.generate_with_context` (needle,
# passkey) calls it once after the prompt's prefill; the language-modelling loops (`eval_lm_quick.py`,
# Gemma's `forward` in `models.py`) after every forward, the prefill of a prompt included. kvpress' `KnormPress` (NVIDIA/kvpress @
# 8bb29b9c3078452a86d692f29123fa6c793e2b05): score -||k||, every layer, once.


def naive_knorm_kept(keys: torch.Tensor, size: int) -> list[list[int]]:
    """`l2_compress` on one layer and batch row: keys `[kv_heads, n, d]` -> kept positions per head.
    The norms are the original's `torch.norm(keys, p=2, dim=-1)` in the cache's dtype (fp32 here):
    random keys have norms equal to ~1e-7, and a norm summed in another precision breaks such ties
    differently."""
    kept = []
    for h in range(keys.shape[0]):
        norms = torch.norm(keys[h].float(), p=2, dim=-1).tolist()
        kept.append(sorted(sorted(range(len(norms)), key=lambda j: norms[j])[:size]))
    return kept


def knorm_choose(
    budget: int | None,
    skip_layers=(),
    prune_after: int = 0,
    during_decode: bool = False,
    keep_ratio: float | None = None,
):
    """`l2_compress` as a `naive_evicting_decode` step: `keep_ratio` given, `ceil(keep_ratio * n)`
    of the layer's n entries are kept (the original's rule), else `budget`."""

    def choose(layer, cand, probs, keys, prefill):
        n = len(cand[0])
        size = budget if keep_ratio is None else math.ceil(keep_ratio * n)
        if layer in skip_layers or n < prune_after or n <= size or not (prefill or during_decode):
            return cand
        kept = []
        for h, positions in enumerate(cand):
            top = naive_knorm_kept(keys[h : h + 1, positions], size)[0]
            kept.append([positions[j] for j in top])
        return kept

    return choose


KNORM_VARIANTS = [
    dict(),  # kvpress: every layer, once
    dict(skip_layers=[0]),  # the authors' needle / passkey scripts
    dict(skip_layers=[0, 1], prune_after=B + 1),  # eval_lm_quick's layers, a length threshold
    dict(keep_ratio=0.6),  # the authors' ratio: ceil(0.6 x L) of an L-token prompt
    dict(keep_ratio=0.5, skip_layers=[0], prune_after=B),  # passkey's layers; prompts under B kept whole
]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", LENGTHS_AROUND_BUDGET)
@pytest.mark.parametrize("params", KNORM_VARIANTS, ids=str)
def test_knorm_prefill_selection_is_the_original(kv_heads, length, params):
    model = tiny_llama(kv_heads)
    method = build_method("knorm", budget=B, **params)
    choose = knorm_choose(B, **params)

    def naive(ids):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        out = {}
        for i, layer in enumerate(cache.layers):
            n = layer.keys.shape[2]
            out[i] = choose(i, [list(range(n))] * kv_heads, None, layer.keys[0], True)
        return out

    check_batches(model, method, naive, length)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", [B - 3, 2 * B])
@pytest.mark.parametrize(
    "params",
    [dict(evict_during_decode=True), dict(evict_during_decode=True, skip_layers=[1], prune_after=B + 4)],
    ids=str,
)
def test_knorm_reprune_every_step_equals_the_authors_loop(kv_heads, length, params):
    """evict_during_decode=True: `l2_compress` after every forward (the authors' LM loop), step by
    step against the naive masked full-cache loop; with prune_after = B + 4 the cache grows to
    B + 4 entries between prunes back to B."""
    model = tiny_llama(kv_heads)
    ids = random_ids(length, seed=8)
    new = 12
    method = build_method("knorm", budget=B, **params)
    tokens, history, res = decode_with_history(model, ids, method, new)
    skip = params.get("skip_layers", ())
    want_tokens, want_history = naive_evicting_decode(
        model, ids, new, knorm_choose(B, skip, params.get("prune_after", 0), during_decode=True)
    )
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(history, want_history)):
        assert got == want, f"step {step}"
    assert res.evicted_during_decode and res.decode_evicted > 0


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("ratio,length", [(0.9, 2 * B + 7), (0.96, 2 * B + 7), (0.96, B + 10)])
def test_knorm_keep_ratio_is_the_authors_loop_on_prompts_longer_than_prune_after(kv_heads, ratio, length):
    """The authors' loop on a prompt longer than prune_after = B: `l2_compress` after the prefill
    keeps ceil(r x L), then after every forward ceil(r x n) while n >= B (r = 0.9: the cache shrinks
    under B, then cycles B -> 36; r = 0.96 from 2B + 7: it shrinks by 2 a step, still above B; from
    B + 10 = 50 it settles at 48: 49 entries are pruned to 48 at every step). With `keep_ratio` the
    kept positions equal the transcription's after every forward; the fixed budget ceil(r x B),
    which reproduces the loop on prompts of at most B tokens, keeps other entries."""
    model = tiny_llama(kv_heads)
    ids = random_ids(length, seed=8)
    new = 12
    authors = knorm_choose(None, (1,), B, during_decode=True, keep_ratio=ratio)
    want_tokens, want_history = naive_evicting_decode(model, ids, new, authors)
    method = build_method(
        "knorm", budget=B, keep_ratio=ratio, prune_after=B, skip_layers=[1], evict_during_decode=True
    )
    tokens, history, res = decode_with_history(model, ids, method, new)
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(history, want_history)):
        assert got == want, f"step {step}"
    sizes = [len(h[0][0]) for h in want_history]
    assert sizes[0] == math.ceil(ratio * length)  # the prompt's ratio
    if length == B + 10:
        assert set(sizes) == {48}  # settled above ceil(0.96 x 40) = 39 for good
    assert len(want_history[1][1][0]) == length + 1  # skip_layers stay whole
    fixed = build_method(
        "knorm", budget=math.ceil(ratio * B), prune_after=B, skip_layers=[1], evict_during_decode=True
    )
    _, fixed_history, _ = decode_with_history(model, ids, fixed, new)
    assert all(f[0] != w[0] for f, w in zip(fixed_history, want_history))


@pytest.mark.parametrize("prompt", [B - 5, B + 3])
def test_knorm_fixed_budget_is_the_authors_loop_on_prompts_up_to_prune_after(prompt):
    """The narrower claim for a fixed budget: on a prompt of at most prune_after = P tokens,
    budget = ceil(r x P) < P runs the authors' loop (ceil(r x n) whenever n >= P) exactly; with
    prune_after = B + 3 the cache grows to B + 3 and drops back to ceil(0.9 x 43) = 39."""
    model = tiny_llama(2)
    ids = random_ids(prompt, seed=9)
    p, r, new = B + 3, 0.9, 12
    method = build_method("knorm", budget=math.ceil(r * p), prune_after=p, evict_during_decode=True)
    tokens, history, _ = decode_with_history(model, ids, method, new)
    want_tokens, want_history = naive_evicting_decode(
        model, ids, new, knorm_choose(None, (), p, during_decode=True, keep_ratio=r)
    )
    assert tokens == want_tokens and history == want_history
    assert {len(h[0][0]) for h in history} >= {math.ceil(r * p), p - 1}


def test_knorm_keep_ratio_is_left_out_of_params_while_off():
    """Configs without `keep_ratio` keep their hashes (RunSpec.method_hash hashes `params()`)."""
    assert "keep_ratio" not in build_method("knorm", budget=B).params()
    assert build_method("knorm", budget=B, keep_ratio=0.5).params()["keep_ratio"] == 0.5


def test_knorm_ties_go_to_the_earlier_position():
    """Keys of exactly equal norm (sign flips: the same squares) tie; the earlier one is kept. Where
    ties arise: at layer 0 the keys of a repeated token differ only by their RoPE rotation, so their
    norms agree up to rounding."""
    model = tiny_llama(2)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 9, 5, 7, 5]]), use_cache=True, **{cache_kwarg(model): cache})
    norms = cache.layers[0].keys[0].float().norm(dim=-1)  # [kv_heads, 5]
    torch.testing.assert_close(norms[:, 2], norms[:, 0])
    torch.testing.assert_close(norms[:, 4], norms[:, 0])
    assert not torch.allclose(norms[:, 1], norms[:, 0])
    keys = torch.tensor([[3.0, 4.0], [1.0, 1.0], [-3.0, 4.0], [3.0, -4.0], [-1.0, -1.0]])[None, None]
    method = build_method("knorm", budget=B)
    scores = method.score(None, None, keys, None)
    assert scores[0, 0, 0] == scores[0, 0, 2] == scores[0, 0, 3]
    assert method.select(scores, 3)[0, 0].tolist() == [0, 1, 4]  # of the three tied 5.0s, the first
    assert method.select(scores, 4)[0, 0].tolist() == [0, 1, 2, 4]


def test_knorm_is_attention_free(monkeypatch):
    """No attention weight is computed for K-norm: the scoring helpers are never called, and it runs
    beside eager and sdpa attention alike (the model's own attention output is used unchanged)."""
    from snapkv.methods import base

    def refuse(*args, **kwargs):
        raise AssertionError("K-norm computed attention scores")

    for helper in ("window_attention", "blockwise_attention", "causal_column_sums", "softmax_scores"):
        monkeypatch.setattr(base, helper, refuse)
    ids = random_ids(2 * B, seed=9)
    outs = []
    for attn in ("sdpa", "eager"):
        model = tiny_model("llama", attn=attn)
        method = build_method("knorm", budget=B, evict_during_decode=True)
        out, res = generate_ids(model, ids, None, method, max_new_tokens=6)
        assert res.compressed and res.kv_tokens == B and res.attn_impl == attn
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_knorm_skip_layers_beyond_the_model_is_an_error():
    model = tiny_model("llama")  # 3 layers
    with pytest.raises(ValueError, match=r"\[5\]"):
        generate_ids(model, random_ids(60), None, build_method("knorm", budget=B, skip_layers=[0, 5]))
