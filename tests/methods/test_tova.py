"""TOVA against a naive transcription of the authors' `TOVACache.reduce` (and kvpress' TOVAPress)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids
from reference import eager_attentions

from methods._common import (
    LENGTHS_AROUND_BUDGET,
    B,
    check_batches,
    decode_with_history,
    naive_evicting_decode,
    tiny_llama,
)
from snapkv import build_method

# Transcribed from schwartz-lab-NLP/TOVA @ 9c7d09bfff64cfc92cfb5f9d7e138cb04866e5a7
# (`src/tova_cache.py`, `TOVACache.reduce`, called after every forward): if the layer holds more than
# `cache_size` keys, average the last query's attention weights over ALL query heads, keep the top
# `cache_size` (sorted), the same for every KV head. kvpress' `TOVAPress` (NVIDIA/kvpress @
# 8bb29b9c3078452a86d692f29123fa6c793e2b05): the same scores, the last token scored max + 1, once.


def naive_tova_kept(last_row: torch.Tensor, kv_heads: int, size: int, keep_last: bool) -> list[list[int]]:
    """`TOVACache.reduce` for one batch row: last_row `[heads, n]` = the last query's weights."""
    heads, n = last_row.shape
    if n <= size:
        return [list(range(n))] * kv_heads
    mean = [sum(float(last_row[h, j]) for h in range(heads)) / heads for j in range(n)]
    if keep_last:
        mean[-1] = max(mean) + 1
    top = sorted(range(n), key=lambda j: -mean[j])[:size]
    return [sorted(top)] * kv_heads


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", LENGTHS_AROUND_BUDGET)
@pytest.mark.parametrize("keep_last", [False, True])
def test_tova_prefill_selection_is_the_original(kv_heads, length, keep_last):
    model = tiny_llama(kv_heads)
    method = build_method("tova", budget=B, keep_last=keep_last)

    def naive(ids):
        return {
            i: naive_tova_kept(attn[0, :, -1], kv_heads, B, keep_last)
            for i, attn in enumerate(eager_attentions(model, ids))
        }

    check_batches(model, method, naive, length)


def tova_choose(budget: int, keep_last: bool = False, during_decode: bool = True):
    def choose(layer, cand, probs, keys, prefill):
        if not (prefill or during_decode):
            return cand
        n = len(cand[0])
        if n <= budget:
            return cand
        last = probs[:, cand[0]]  # the candidates' columns, ascending positions
        top = naive_tova_kept(last, len(cand), budget, keep_last)[0]
        return [[cand[0][j] for j in top]] * len(cand)

    return choose


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", [B - 3, B + 1, 2 * B])
@pytest.mark.parametrize("keep_last,during_decode", [(False, True), (True, False), (True, True)])
def test_tova_decode_eviction_step_by_step_equals_the_original(kv_heads, length, keep_last, during_decode):
    """Every forward (prefill, then each decoded token) against the naive masked full-cache loop:
    the kept positions after each step and the greedy tokens."""
    model = tiny_llama(kv_heads)
    ids = random_ids(length, seed=7)
    new = 12
    method = build_method("tova", budget=B, keep_last=keep_last, evict_during_decode=during_decode)
    tokens, history, res = decode_with_history(model, ids, method, new)
    want_tokens, want_history = naive_evicting_decode(
        model, ids, new, tova_choose(B, keep_last, during_decode)
    )
    assert tokens == want_tokens
    assert len(history) == new  # the prefill and the new - 1 fed tokens
    for step, (got, want) in enumerate(zip(history, want_history)):
        assert got == want, f"step {step}"
    assert res.kv_tokens_end == (B if during_decode else min(length, B) + new - 1)


def test_tova_default_evicts_the_newest_token_and_kvpress_mode_keeps_it():
    """The authors' TOVA scores the newest token like any other (here it is evicted at some steps);
    keep_last=True (kvpress) never evicts it."""
    model = tiny_llama(2)
    ids = random_ids(2 * B, seed=7)
    newest_evicted = 0
    for keep_last in (False, True):
        method = build_method("tova", budget=B, keep_last=keep_last)
        _, history, _ = decode_with_history(model, ids, method, 12)
        for step, kept in enumerate(history):
            newest = 2 * B - 1 + step
            for heads in kept.values():
                assert all(h == heads[0] for h in heads)  # one kept set per layer
                if newest not in heads[0]:
                    assert not keep_last, f"step {step}: keep_last evicted the newest token"
                    newest_evicted += 1
    assert newest_evicted > 0


def test_tova_fp32_scores_differ_from_the_originals_bf16_average_only_within_one_bf16_step():
    """On a bf16 model the original averages the model's bf16 attention weights (`TOVACache.reduce`
    reads them from eager attention); TOVA here scores in fp32. The kept sets differ (ties and
    one-step swaps of the rounded averages), but only at the margin: every entry kept here whose
    original average is below an entry dropped here is within one bf16 step (2^-7 relative)."""
    from methods._common import kept_rows, prefilled

    differ = 0
    for kv_heads in (4, 2):
        model = tiny_llama(kv_heads).to(torch.bfloat16)
        for seed in range(4):
            ids = random_ids(2 * B + 7, seed=seed)
            got = kept_rows(prefilled(model, ids, build_method("tova", budget=B)))
            model.set_attn_implementation("eager")
            with torch.no_grad():
                attentions = model(input_ids=ids, output_attentions=True).attentions
            model.set_attn_implementation("sdpa")
            for i, attn in enumerate(attentions):
                mean = torch.mean(attn[:, :, -1, :], dim=1)[0].float()  # bf16 average, as the original
                kept = torch.tensor(got[i][0][0])
                dropped = torch.ones(len(mean), dtype=torch.bool)
                dropped[kept] = False
                gap = float(mean[dropped].max() - mean[kept].min())
                differ += gap >= 0 and set(kept.tolist()) != set(torch.topk(mean, B).indices.tolist())
                assert gap <= 2**-7 * float(mean[kept].min()), f"seed {seed}, layer {i}"
    assert differ > 0  # the fp32 ranking is not the bf16 one
