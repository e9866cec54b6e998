"""ChunkKV against a naive transcription of kvpress' ChunkKVPress, per batch row."""

from __future__ import annotations

import pytest
import torch
from conftest import random_ids, tiny_model
from reference import eager_attentions, masked_reference_logits, record_visible

from methods._common import LENGTHS_AROUND_BUDGET, B, W, check_batches, prefilled, tiny_llama
from snapkv import build_method, generate_ids
from snapkv.methods.chunkkv import ChunkKV

# Transcribed from kvpress' `ChunkKVPress` (NVIDIA/kvpress @ 8bb29b9c3078452a86d692f29123fa6c793e2b05,
# `kvpress/presses/chunkkv_press.py`, the paper's published code): per-position scores summed over
# the KV heads, `kv_len // chunk_length` complete chunks from position 0 plus the trailing
# `kv_len % chunk_length` positions as one more chunk, a chunk's mean (kvpress) or sum (the paper),
# the top chunks kept, indices sorted. Applied here to the prefix, the window kept whole, and per
# batch row (kvpress uses row 0's chunks for every row); the per-position scores are SnapKV's,
# transcribed with loops from the eager attention weights (a window sum where kvpress' SnapKVPress
# takes the window mean: the same ranking).


def naive_snapkv_scores(attn, kv_heads, window, kernel, pooling, reduce, order) -> list[list[float]]:
    """Per KV head, SnapKV's scores of the prefix positions of one row `[1, heads, L, L]`."""
    _, h, length, _ = attn.shape
    g, prefix = h // kv_heads, length - window

    def pooled(v):
        half = kernel // 2
        if pooling == "max":
            return [max(v[max(0, j - half) : j + half + 1]) for j in range(prefix)]
        if pooling == "avg":  # zero padding counted, as F.avg_pool1d's default
            return [sum(v[max(0, j - half) : j + half + 1]) / kernel for j in range(prefix)]
        return list(v)

    def reduced(rows):
        cols = list(zip(*rows))
        return {
            "mean": [sum(c) / g for c in cols],
            "max": [max(c) for c in cols],
            "sum": [sum(c) for c in cols],
        }[reduce]

    out = []
    for kvh in range(kv_heads):
        votes = [
            [float(attn[0, qh, prefix:, j].sum()) for j in range(prefix)]
            for qh in range(kvh * g, (kvh + 1) * g)
        ]
        out.append(pooled(reduced(votes)) if order == "reduce_first" else reduced([pooled(v) for v in votes]))
    return out


def naive_chunkkv_kept(scores, length, window, budget, chunk_length, how) -> list[int]:
    """ChunkKVPress.compress steps 2-4 on one row's prefix scores (per KV head), window appended."""
    if length <= budget:
        return list(range(length))
    c, prefix = chunk_length, length - window
    per_pos = [sum(head[j] for head in scores) for j in range(prefix)]
    complete, remaining = divmod(prefix, c)
    chunks = [per_pos[i * c : (i + 1) * c] for i in range(complete)]
    if remaining:
        chunks.append(per_pos[prefix - remaining :])
    chunk_scores = [sum(ch) / (len(ch) if how == "mean" else 1) for ch in chunks]
    top = sorted(range(len(chunks)), key=lambda i: -chunk_scores[i])[: (budget - window) // c]
    kept = sorted(j for i in top for j in range(i * c, min((i + 1) * c, prefix)))
    return kept + list(range(prefix, length))


CHUNKKV_VARIANTS = [
    dict(window=W, kernel_size=5, chunk_length=5),  # max-pool, reduce_first, chunk sums
    # kvpress' SnapKVPress scores (avg-pool 5, per query head then the group mean), chunk means
    dict(window=W, kernel_size=5, pooling="avg", gqa_order="pool_first", chunk_length=10, chunk_score="mean"),
    dict(window=W, pooling="none", gqa_reduce="max", chunk_length=4, reuse_layers=2),  # index reuse
]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", LENGTHS_AROUND_BUDGET)
@pytest.mark.parametrize("params", CHUNKKV_VARIANTS, ids=str)
def test_chunkkv_selection_is_the_original(kv_heads, length, params):
    model = tiny_llama(kv_heads, layers=4)
    method = build_method("chunkkv", budget=B, **params)

    def naive(ids):
        out = {}
        for i, attn in enumerate(eager_attentions(model, ids)):
            leader = i - i % method.reuse_layers  # layer-wise index reuse: the group's first layer
            if leader != i:
                out[i] = out[leader]
                continue
            scores = naive_snapkv_scores(
                attn, kv_heads, W, method.kernel_size, method.pooling, method.gqa_reduce, method.gqa_order
            )
            kept = naive_chunkkv_kept(scores, ids.shape[1], W, B, method.chunk_length, method.chunk_score)
            out[i] = [kept] * kv_heads  # one kept set per layer
        return out

    check_batches(model, method, naive, length)


def test_chunkkv_each_row_chooses_its_own_chunks():
    """kvpress applies batch row 0's chunks to every row; here each row keeps its own best chunks."""
    from snapkv.methods.chunkkv import chunk_selection

    scores = torch.zeros(2, 2, 30 + 4)  # prefix 30 = chunks [0,10) [10,20) [20,30); window 4
    scores[0, :, 12] = 1.0  # row 0 prefers chunk 1
    scores[1, 1, 25] = 1.0  # row 1 prefers chunk 2 (one head's score suffices: heads are summed)
    rows = chunk_selection(scores, window=4, chunk_length=10, n_chunks=1)
    window = list(range(30, 34))
    assert rows[0].tolist() == list(range(10, 20)) + window
    assert rows[1].tolist() == list(range(20, 30)) + window  # kvpress: row 0's chunk 1 here


def test_chunkkv_trailing_chunk_holds_the_last_positions_and_mean_favours_it():
    from snapkv.methods.chunkkv import chunk_selection

    # prefix 23 = chunks [0,10) [10,20) and the trailing [20,23); window 2
    scores = torch.full((1, 1, 25), 0.1)
    scores[..., 20:23] = 0.3  # trailing chunk: sum 0.9 < 1.0 of a full chunk, mean 0.3 > 0.1
    summed = chunk_selection(scores, window=2, chunk_length=10, n_chunks=1, how="sum")[0]
    meaned = chunk_selection(scores, window=2, chunk_length=10, n_chunks=1, how="mean")[0]
    assert summed.tolist() == list(range(0, 10)) + [23, 24]  # tie between full chunks: the earlier
    assert meaned.tolist() == [20, 21, 22, 23, 24]  # the short chunk: fewer entries than the budget


@pytest.mark.parametrize("c", [3, 10, 20])
def test_chunkkv_unused_budget_is_at_most_two_chunks_less_two(c):
    """Of the m = budget - window prefix entries of the budget, whole chunks leave m % c unused, and
    a kept trailing chunk of r = (L - window) % c positions leaves c - r more (it takes a whole
    chunk's slot): at most 2(c - 1), reached at m % c = c - 1 and r = 1."""
    from snapkv.methods.chunkkv import chunk_selection

    g, window = torch.Generator().manual_seed(c), 4
    worst = 0
    for m in range(c, 3 * c):
        for prefix in range(m + 1, m + 2 * c + 1):  # L = prefix + window > budget = m + window
            r = prefix % c
            for favour_trailing in (False, True):
                scores = torch.rand(1, 2, prefix + window, generator=g)
                if favour_trailing and r:
                    scores[..., prefix - r : prefix] += 1000.0
                kept = chunk_selection(scores, window, c, m // c)[0]
                unused = m - (len(kept) - window)
                trailing = r > 0 and int(kept[-window - 1]) == prefix - 1
                assert trailing or not (favour_trailing and r)
                assert unused == m % c + (c - r if trailing else 0), (m, prefix)
                worst = max(worst, unused)
    assert worst == 2 * (c - 1)


def test_chunkkv_kvpress_chunk_length_leaves_18_of_512_unused_with_a_2_position_trailing_chunk():
    """kvpress' chunk_length 20 at budget 512, window 32: 480 = 24 chunks, none left over; a prompt
    whose prefix ends in a 2-position chunk that is kept uses 23 x 20 + 2 = 462 of the 480."""
    from snapkv.methods.chunkkv import chunk_selection

    window, c, prefix = 32, 20, 2000 + 2
    scores = torch.rand(1, 2, prefix + window, generator=torch.Generator().manual_seed(0))
    scores[..., prefix - 2 : prefix] += 1000.0
    kept = chunk_selection(scores, window, c, (512 - window) // c)[0]
    assert 512 - len(kept) == 18


class _RowZeroTakesTheTrailingChunk(ChunkKV):
    """Test-only: row 0's trailing (short) prefix chunk gets the top score, so batch rows keep
    different numbers of entries."""

    def score(self, layer, query, key, module):
        scores = super().score(layer, query, key, module)
        prefix = scores.shape[-1] - self.window
        scores[0, :, prefix - prefix % self.chunk_length : prefix] += 100.0
        return scores


@pytest.mark.parametrize("query_aware", [True, False])
def test_chunkkv_rows_keeping_different_numbers_decode_as_the_masked_full_cache(query_aware):
    model = tiny_model("mistral")
    ids = random_ids(96, batch=2)
    ctx, q = ids[:, :80], ids[:, 80:]
    method = _RowZeroTakesTheTrailingChunk(budget=B, window=W, kernel_size=5, chunk_length=5)
    (out, res), records = record_visible(
        model,
        lambda: generate_ids(
            model, ctx, q, method, max_new_tokens=6, keep_logits=True, query_aware=query_aware
        ),
    )
    # Prefix of the compressed prompt: 88 (query-aware) or 72 (agnostic) positions, chunks of 5.
    prefix = (96 if query_aware else 80) - W
    rest = prefix % 5
    cache = prefilled(model, ids if query_aware else ctx, method)
    for _, layer in cache.compressible_layers():
        assert layer.pads.tolist() == [5 - rest, 0]  # row 0 keeps the short chunk: fewer entries
        assert layer.positions[0, 0, -W - rest : -W].tolist() == list(range(prefix - rest, prefix))
    assert res.kv_tokens == (2 * (30 + W) - (5 - rest)) / 2  # 6 whole chunks of 5 per row, one short
    fed = ([] if query_aware else [q]) + [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
    ref = masked_reference_logits(model, [ids if query_aware else ctx], fed, records)[-len(res.logits) :]
    for step, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"step {step}")


def test_chunkkv_reused_layers_keep_the_group_leaders_positions_without_scoring():
    model = tiny_model("llama", layers=5)
    ids = random_ids(96)
    scored = []

    class _Spy(ChunkKV):
        def score(self, layer, query, key, module):
            scored.append(layer.index)
            return super().score(layer, query, key, module)

    method = _Spy(budget=B, window=W, chunk_length=5, reuse_layers=2)
    cache = prefilled(model, ids, method)
    pos = {i: layer.positions for i, layer in cache.compressible_layers()}
    assert scored == [0, 2, 4]
    assert torch.equal(pos[1], pos[0]) and torch.equal(pos[3], pos[2])
    assert not torch.equal(pos[2], pos[0])
