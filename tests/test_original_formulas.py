"""Each deviation switch against a naive transcription of the original code's formula.

Transcribed (definitions, re-written with Python loops; no code copied) from:
- AdaKV (FFY0/AdaKV, `adaptive_snapkv/monkeypatch/snapkv_utils.py`, `AdaptiveSnapKVCluster`
  `update_kv_gqa` / `calcul_attn_sore`): window-mean votes, group mean (gqa_support), pooling, per
  head `ratio = sum(top-P) / sum(all)` multiplied in (`normalize`), a global top-(h*P), per head
  `round(count * (1 - alpha) + int(P * alpha))` selected entries plus the window.
- KVCache-Factory (Zefan-Cai/KVCache-Factory, `pyramidkv/pyramidkv_utils.py`, `PyramidKVCluster.
  update_kv`): no compression below the budget, uniform SnapKV budgets while
  L < 2 (budget - window), else the floored pyramid `max_num - layer * steps` (+ window).
- KVzip (snu-mllab/KVzip and kvpress' `KVzipPress`): the reconstruction inputs, the max-attention
  scores (KVzip+ too) and the four selections, on a plain DynamicCache (section "KVzip").
- KVCache-Factory's kv-head mode / AdaKV's gqa_support for the GQA order: tests/test_core.py's
  `test_snapkv_selection_equals_naive_reference` (tests/reference.py, `order=`).
"""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction

import pytest
import torch
from conftest import COMMON, random_ids, tiny_model
from reference import eager_attentions, masked_attention, masked_reference_logits, record_visible
from transformers import DynamicCache

import snapkv
from snapkv import CompressedCache, build_method, generate_ids, prefill
from snapkv.forward import cache_kwarg
from snapkv.hooks import session
from snapkv.methods.adakv import head_budgets
from snapkv.methods.chunkkv import ChunkKV

W = 8


def _prefilled(model, ids, method):
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s)
    return cache


# ---- Ada-KV ----------------------------------------------------------------------------------------


def _round_half_even(x: float) -> int:
    return round(x)  # Python's round is half to even, as torch.round


def naive_pooled_votes(attn: torch.Tensor, kv_heads: int, window: int, kernel: int) -> list[list[float]]:
    """AdaKV's `calcul_attn_sore` with gqa_support, one layer `[1, heads, L, L]` -> per KV head:
    mean over the window queries, mean over the group, max-pool (stride 1, padding kernel // 2)."""
    _, h, length, _ = attn.shape
    g, prefix = h // kv_heads, length - window
    out = []
    for kvh in range(kv_heads):
        votes = [
            sum(float(attn[0, qh, length - window :, j].mean()) for qh in range(kvh * g, (kvh + 1) * g)) / g
            for j in range(prefix)
        ]
        half = kernel // 2
        out.append([max(votes[max(0, j - half) : j + half + 1]) for j in range(prefix)])
    return out


def naive_adakv_counts(scores: list[list[float]], per_head: int, alpha: float, normalize: bool) -> list[int]:
    """AdaKV's per-head selected counts for one batch row (`update_kv_gqa`)."""
    h = len(scores)
    flat = []
    for head, row in enumerate(scores):
        ranked = sorted(row, reverse=True)
        ratio = sum(ranked[:per_head]) / sum(ranked) if normalize else 1.0
        flat += [(v * ratio, head) for v in ranked]
    top = sorted(flat, key=lambda t: -t[0])[: h * per_head]
    counts = [sum(1 for _, head in top if head == i) for i in range(h)]
    floor = int(per_head * alpha)
    return [_round_half_even(c * (1 - alpha) + floor) for c in counts]


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
    cache = _prefilled(model, ids, method)
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


# ---- PyramidKV ------------------------------------------------------------------------------------


def naive_kvcache_factory_budgets(
    budget: int, window: int, n_layers: int, beta: int, length: int
) -> list[int]:
    """Entries each layer keeps in KVCache-Factory's `PyramidKVCluster.update_kv` (window included)."""
    out = []
    for layer in range(n_layers):
        min_num = (budget - window) // beta
        max_num = (budget - window) * 2 - min_num
        if max_num >= length - window:
            max_num = length - window
            min_num = (budget - window) * 2 - max_num
        steps = (max_num - min_num) // (n_layers - 1)
        if length < budget:
            out.append(length)  # not compressed
        elif length < (budget - window) * 2:
            out.append(budget)  # uniform SnapKV budgets
        else:
            out.append(max_num - layer * steps + window)
    return out


@pytest.mark.parametrize("length", [30, 40, 50, 63, 64, 70, 96, 200])
def test_pyramidkv_floor_schedule_and_short_prompt_fallback_equal_kvcache_factory(length):
    model = tiny_model("llama", layers=4)
    ids = random_ids(length)
    method = build_method("pyramidkv", budget=40, window=W, schedule="floor", short_prompt="uniform")
    _, res = generate_ids(model, ids, None, method, max_new_tokens=1)
    assert res.kv_tokens_per_layer == [float(b) for b in naive_kvcache_factory_budgets(40, W, 4, 20, length)]


@pytest.mark.parametrize("length", [41, 50, 63])
def test_pyramidkv_default_falls_back_to_uniform_on_short_prompts_and_clip_does_not(length):
    model = tiny_model("llama", layers=4)
    ids = random_ids(length)
    _, res = generate_ids(model, ids, None, build_method("pyramidkv", budget=40, window=W), max_new_tokens=1)
    assert res.kv_tokens_per_layer == [40.0] * 4  # B < L < 2 (B - w): SnapKV's uniform budgets
    clip = build_method("pyramidkv", budget=40, window=W, short_prompt="clip")
    _, res = generate_ids(model, ids, None, clip, max_new_tokens=1)
    assert res.kv_tokens_per_layer[0] == length and res.kv_tokens_per_layer[0] > res.kv_tokens_per_layer[-1]
    assert sum(res.kv_tokens_per_layer) == 4 * 40  # the clipped pyramid, mean still exact


def test_adakv_pyramid_base_keeps_adakv_short_prompt_behaviour():
    # AdaKV's own pyramid mode has no uniform fallback: Ada-PyramidKV defaults to the clipped pyramid.
    method = build_method("adakv", budget=40, window=W, base="pyramidkv")
    assert (
        method.short_prompt == "clip"
        and build_method("pyramidkv", budget=40, window=W).short_prompt == "uniform"
    )


# ---- TOVA, K-norm, ChunkKV: shared fixtures ---------------------------------------------------------
# Selections against naive transcriptions on MHA (4 KV heads) and GQA (2 KV heads for 4 query heads)
# tiny models, prompts of budget - 1, budget and budget + 1 tokens, a batch of two rows and a
# left-padded batch (each row against the same prompt alone).

B = 40  # budget of these sections
LENGTHS_AROUND_BUDGET = [B - 1, B, B + 1, 2 * B + 7]


def _tiny(kv_heads: int, layers: int = 3):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **{**COMMON, "num_key_value_heads": kv_heads})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def _kept_rows(cache) -> dict[int, list[list[list[int]]]]:
    """Per layer, per batch row, per KV head: the real positions kept (filler slots left out)."""
    out = {}
    for i, layer in cache.compressible_layers():
        b = layer.positions.shape[0]
        pads = [0] * b if layer.pads is None else layer.pads.tolist()
        off = [0] * b if layer.prompt_pads is None else layer.prompt_pads.tolist()
        out[i] = [[(p[pads[r] :] - off[r]).tolist() for p in layer.positions[r]] for r in range(b)]
    return out


def _padded_kept(model, rows: list[torch.Tensor], method):
    """Prefill a left-padded batch of `rows` through `snapkv.apply` (the padded-batch path)."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with snapkv.apply(model, method), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_kwarg(model): cache})
    return _kept_rows(cache)


def distinct_ids(n: int, seed: int) -> torch.Tensor:
    """`[1, n]` token ids without repeats: at layer 0 a key's norm depends on its token alone (RoPE
    keeps norms), so a repeated token gives keys whose norms tie up to rounding, and such a tie
    falls either way when the same prompt is computed in another batch layout."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randperm(125, generator=g)[:n] + 3)[None]


def _check_batches(model, method, naive, length: int) -> None:
    """`naive(ids [1, L]) -> {layer: [kept per KV head]}` against the method on two rows of length
    `length` and on a left-padded batch of rows of lengths length, length - 9 and length + 5."""
    batch = torch.cat([distinct_ids(length, seed=3), distinct_ids(length, seed=4)])
    got = _kept_rows(_prefilled(model, batch, method))
    for r in range(2):
        want = naive(batch[r : r + 1])
        assert {i: rows[r] for i, rows in got.items()} == want, f"row {r}"
    rows = [distinct_ids(n, seed=5 + i)[0] for i, n in enumerate((length, max(length - 9, 1), length + 5))]
    got = _padded_kept(model, rows, method)
    for r, row in enumerate(rows):
        want = naive(row[None])
        assert {i: kept[r] for i, kept in got.items()} == want, f"padded row {r} (length {len(row)})"


def naive_evicting_decode(model, ids: torch.Tensor, new_tokens: int, choose):
    """Greedy decoding on the FULL cache (a plain DynamicCache: nothing is removed) with eager
    attention limited, per layer and KV head, to a kept set of positions (tests/reference.py's
    `masked_attention`). After every forward, `choose(layer, candidates, probs, keys, prefill)`
    returns the new kept sets: candidates [kv_heads][n] (the kept set plus the forward's tokens),
    probs `[heads, seen]` the forward's last query's attention (0 on hidden positions), keys
    `[kv_heads, seen, d]`. Returns the tokens and, per forward, {layer: kept sets}."""
    visible: dict = {}
    cache = DynamicCache(config=model.config)
    kept: dict[int, list[list[int]]] = {}
    tokens, history = [], []
    impl = model.config._attn_implementation
    x, pos = ids, 0
    with masked_attention(visible), torch.no_grad():
        model.set_attn_implementation("ref_masked")
        try:
            for step in range(new_tokens):
                p = torch.arange(pos, pos + x.shape[1])[None]
                out = model(
                    input_ids=x, position_ids=p, use_cache=True, output_attentions=True,
                    **{cache_kwarg(model): cache},
                )  # fmt: skip
                new = list(range(pos, pos + x.shape[1]))
                pos += x.shape[1]
                for i, attn in enumerate(out.attentions):
                    kv = cache.layers[i].keys.shape[1]
                    cand = [new] * kv if step == 0 else [k + new for k in kept[i]]
                    keys = cache.layers[i].keys[0].double()
                    kept[i] = choose(i, cand, attn[0, :, -1].double(), keys, step == 0)
                history.append({i: [list(k) for k in v] for i, v in kept.items()})
                x = out.logits[:, -1].argmax(-1, keepdim=True)
                tokens.append(int(x))
                for i, v in kept.items():  # the next forward sees the kept entries and itself
                    visible[i] = torch.tensor([k + [pos] for k in v])[None]
        finally:
            model.set_attn_implementation(impl)
    return tokens, history


def _decode_with_history(model, ids, method, new_tokens: int):
    """The method's own greedy generation, with the kept positions after every forward (in
    position order: decode-time eviction in place leaves the stored entries unordered)."""
    history: list[dict] = []
    original = snapkv.hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        original(self, module, layer, query, key)
        if module.layer_idx == 0:
            history.append({})
        history[-1][module.layer_idx] = layer.positions[0].sort(dim=-1).values.tolist()

    snapkv.hooks.Session.after_attention = spy
    try:
        out, res = generate_ids(model, ids, None, method, max_new_tokens=new_tokens)
    finally:
        snapkv.hooks.Session.after_attention = original
    return out[0].tolist(), history, res


# ---- TOVA -------------------------------------------------------------------------------------------
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
    model = _tiny(kv_heads)
    method = build_method("tova", budget=B, keep_last=keep_last)

    def naive(ids):
        return {
            i: naive_tova_kept(attn[0, :, -1], kv_heads, B, keep_last)
            for i, attn in enumerate(eager_attentions(model, ids))
        }

    _check_batches(model, method, naive, length)


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
    model = _tiny(kv_heads)
    ids = random_ids(length, seed=7)
    new = 12
    method = build_method("tova", budget=B, keep_last=keep_last, evict_during_decode=during_decode)
    tokens, history, res = _decode_with_history(model, ids, method, new)
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
    model = _tiny(2)
    ids = random_ids(2 * B, seed=7)
    newest_evicted = 0
    for keep_last in (False, True):
        method = build_method("tova", budget=B, keep_last=keep_last)
        _, history, _ = _decode_with_history(model, ids, method, 12)
        for step, kept in enumerate(history):
            newest = 2 * B - 1 + step
            for heads in kept.values():
                assert all(h == heads[0] for h in heads)  # one kept set per layer
                if newest not in heads[0]:
                    assert not keep_last, f"step {step}: keep_last evicted the newest token"
                    newest_evicted += 1
    assert newest_evicted > 0


# ---- K-norm -----------------------------------------------------------------------------------------
# Transcribed from alessiodevoto/l2compress @ f93d6ca2702d85a2db97d2ef350b44d955609761 (`cache.py`,
# `l2_compress`): per layer not in `skip_layers` whose cache holds >= `prune_after` entries, per batch
# row and KV head, the keys sorted by L2 norm (ascending), the first `tokens_to_keep` kept; its
# language-modelling loop calls it after every token. kvpress' `KnormPress` (NVIDIA/kvpress @
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


def knorm_choose(budget: int, skip_layers=(), prune_after: int = 0, during_decode: bool = False):
    def choose(layer, cand, probs, keys, prefill):
        n = len(cand[0])
        if layer in skip_layers or n < prune_after or n <= budget or not (prefill or during_decode):
            return cand
        kept = []
        for h, positions in enumerate(cand):
            top = naive_knorm_kept(keys[h : h + 1, positions], budget)[0]
            kept.append([positions[j] for j in top])
        return kept

    return choose


KNORM_VARIANTS = [
    dict(),  # kvpress: every layer, once
    dict(skip_layers=[0]),  # the authors' needle / passkey scripts
    dict(skip_layers=[0, 1], prune_after=B + 1),  # eval_lm_quick's layers, a length threshold
]


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", LENGTHS_AROUND_BUDGET)
@pytest.mark.parametrize("params", KNORM_VARIANTS, ids=str)
def test_knorm_prefill_selection_is_the_original(kv_heads, length, params):
    model = _tiny(kv_heads)
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

    _check_batches(model, method, naive, length)


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
    model = _tiny(kv_heads)
    ids = random_ids(length, seed=8)
    new = 12
    method = build_method("knorm", budget=B, **params)
    tokens, history, res = _decode_with_history(model, ids, method, new)
    skip = params.get("skip_layers", ())
    want_tokens, want_history = naive_evicting_decode(
        model, ids, new, knorm_choose(B, skip, params.get("prune_after", 0), during_decode=True)
    )
    assert tokens == want_tokens
    for step, (got, want) in enumerate(zip(history, want_history)):
        assert got == want, f"step {step}"
    assert res.evicted_during_decode and res.decode_evicted > 0


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


# ---- ChunkKV ----------------------------------------------------------------------------------------
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
    model = _tiny(kv_heads, layers=4)
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

    _check_batches(model, method, naive, length)


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
    cache = _prefilled(model, ids if query_aware else ctx, method)
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
    cache = _prefilled(model, ids, method)
    pos = {i: layer.positions for i, layer in cache.compressible_layers()}
    assert scored == [0, 2, 4]
    assert torch.equal(pos[1], pos[0]) and torch.equal(pos[3], pos[2])
    assert not torch.equal(pos[2], pos[0])


# ---- CriticalKV and Expected Attention -------------------------------------------------------------
#
# Transcribed (definitions re-written with loops; no code copied) from:
# - CriticalKV: FFY0/AdaKV-in-NVIDIA-kvpress @ 88f5b1fb245d356c4a37cc734dd47dcd817779f1 (branch
#   `criticalkv`, the authors' code), `kvpress/presses/criticalkv_press.py`: `CriticalKVPress.vwl1norm`
#   and `.score` (kept: ScorerPress's top n_kept), `CriticalAdaKVPress.compress`.
# - Expected Attention: NVIDIA/kvpress @ 8bb29b9c3078452a86d692f29123fa6c793e2b05,
#   `kvpress/presses/expected_attention_press.py` (`get_query_statistics`, `apply_avg_rope`,
#   `score`), `kvpress/utils.py` (`get_prerope_query_states`: q_proj of the hidden states, q_norm),
#   `kvpress/presses/adakv_press.py` (`AdaKVPress.compress`).
# CriticalKV's base scores are AdaKV's window-mean pooled votes (`naive_pooled_votes` above): the
# scale the original's SnapKV scores have. Protected entries (window, sinks) get max + 1, as
# kvpress's ExpectedAttentionPress does (its SnapKVPress pads with the max itself: a tie with the
# best prefix entry that topk may break either way). The budget is given as entries (n_kept)
# where kvpress derives it from a compression ratio. Every top-k here breaks ties towards the earlier
# position (`_top`), as this harness does: torch.topk's choice among equal scores is unspecified,
# and max-pooled votes have plateaus of equal scores.

FMAX = torch.finfo(torch.float32).max


def _mha_model(layers: int = 2):
    from conftest import COMMON
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(num_hidden_layers=layers, **{**COMMON, "num_key_value_heads": 4})
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


MODELS = {"mha": _mha_model, "gqa": lambda: tiny_model("llama", layers=2)}


def _left_padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
    return ids, mask


def _kept_by_method(model, method, rows: list[torch.Tensor]):
    """Our kept positions `{layer: [row][kv head] -> positions in the row}` after a prefill of
    `rows` as one batch (left-padded when their lengths differ) inside `snapkv.apply`."""
    import snapkv

    ids, mask = _left_padded(rows)
    padded = len({len(r) for r in rows}) > 1
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with snapkv.apply(model, method), torch.no_grad():
        model(input_ids=ids, attention_mask=mask if padded else None, **{cache_kwarg(model): cache})
    out = {}
    for idx, layer in cache.compressible_layers():
        b, h, _ = layer.dims
        per_row = []
        for r in range(b):
            off = 0 if layer.prompt_pads is None else int(layer.prompt_pads[r])
            heads = []
            for kvh in range(h):
                if layer.per_head:
                    pos = layer.head_positions()[r, kvh, : int(layer.lengths[r, kvh])]
                else:
                    pos = layer.positions[r, kvh, 0 if layer.pads is None else int(layer.pads[r]) :]
                heads.append((pos - off).tolist())
            per_row.append(heads)
        out[idx] = per_row
    return out


def _layer_inputs(model, ids: torch.Tensor):
    """Per decoder layer of one row `[1, L]`: (attention module, its input hidden states, the full
    cache's keys and values `[1, kv_heads, L, d]`)."""
    from transformers import DynamicCache

    layers = model.model.layers
    hidden = {}
    hooks = [
        layer.self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: hidden.__setitem__(m.layer_idx, kwargs["hidden_states"]), with_kwargs=True
        )
        for layer in layers
    ]
    cache = DynamicCache(config=model.config)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    finally:
        for hook in hooks:
            hook.remove()
    return [
        (lay.self_attn, hidden[i], cache.layers[i].keys, cache.layers[i].values)
        for i, lay in enumerate(layers)
    ]


def _top(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of the 1-D `x`; ties to the earlier index."""
    return x.sort(descending=True, stable=True).indices[:k]


def _topk_rows(scores: torch.Tensor, k: int) -> list[list[int]]:
    """ScorerPress: per head the top-k positions of `scores` `[heads, L]`, ascending."""
    return [sorted(_top(scores[h], k).tolist()) for h in range(scores.shape[0])]


# ---- Expected Attention (kvpress ExpectedAttentionPress, AdaKVPress) -----------------------------


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
        s[h, _top(scores[h], n_safe)] = FMAX
    pruned = set(_top(-s.reshape(-1), heads * (length - n_kept)).tolist())
    return [[j for j in range(length) if h * length + j not in pruned] for h in range(heads)]


def _ea_expected(model, name, params, row: torch.Tensor, budget: int):
    """The original's kept positions per layer for one row `[L]`."""
    out = {}
    length = row.shape[0]
    for idx, (module, hidden, keys, values) in enumerate(_layer_inputs(model, row[None])):
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
            out[idx] = _topk_rows(scores, budget)
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
        got = _kept_by_method(model, method, batch)
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
        got = _kept_by_method(model, method, batch)
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
    got = _kept_by_method(model, method, [row])
    layers = dict(enumerate(_layer_inputs(model, row[None])))
    for idx, kept in got.items():
        module, hidden, keys, values = layers[idx]
        scores = naive_expected_attention(
            model, module, hidden, keys, values, 512, 4, True, True, 0.0, module.scaling
        )
        assert kept[0] == _topk_rows(scores, 24), f"layer {idx}"


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


# ---- CriticalKV (the authors' CriticalKVPress, CriticalAdaKVPress) -------------------------------


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
        first = _top(scores[h], int(n_kept * ratio))
        s = (scores[h] + eps) * norms[h]
        s[first] = FMAX
        kept.append(sorted(_top(s, n_kept).tolist()))
    return kept


def naive_critical_adakv_keep(scores, norms, n_kept, alpha, ratio, eps, counts=None) -> list[list[int]]:
    """`CriticalAdaKVPress.compress` for one row. `counts` (entries per head, protected included):
    given, they replace the original's allocation (kvpress's safeguard + global top-k)."""
    heads, length = scores.shape
    s = scores.clone()
    if counts is None:
        n_safe = int(n_kept * alpha)
        for h in range(heads):
            s[h, _top(s[h], n_safe)] = FMAX
        top = _top(s.reshape(-1), n_kept * heads) // length
        counts = [int((top == h).sum()) for h in range(heads)]
    for h in range(heads):  # stage 1
        # Ties among the safeguarded entries (all at FMAX) go by their score: topk's choice among
        # them is unspecified, and stage 1 is meant to keep the top entries by score.
        order = _top(scores[h], length)
        s[h, order[_top(s[h, order], int(counts[h] * ratio))]] = FMAX
    s = (s + eps) * norms  # stage 2
    for h in range(heads):
        s[h, _top(s[h], counts[h])] = FMAX
    if sum(counts) == heads * n_kept:  # the original's bottom-k prune over all heads
        pruned = set(_top(-s.reshape(-1), heads * (length - n_kept)).tolist())
        return [[j for j in range(length) if h * length + j not in pruned] for h in range(heads)]
    return [sorted(_top(s[h], counts[h]).tolist()) for h in range(heads)]


def _critical_expected(model, params, row: torch.Tensor, budgets: dict[int, int]):
    """The original's kept positions per layer for one row `[L]`; `budgets`: each layer's n_kept
    (PyramidKV's layer budgets are tested against KVCache-Factory above)."""
    w, kernel = params["window"], params["kernel_size"]
    ratio, eps, alpha = (
        params.get("first_stage_ratio", 0.5),
        params.get("epsilon", 1e-4),
        params.get("alpha", 0.2),
    )
    heads = model.config.num_attention_heads
    attns = eager_attentions(model, row[None])
    out = {}
    for idx, (module, _, _, values) in enumerate(_layer_inputs(model, row[None])):
        length, kv = row.shape[0], values.shape[1]
        if length <= params["budget"]:
            out[idx] = [list(range(length))] * kv
            continue
        votes = torch.tensor(naive_pooled_votes(attns[idx], kv, w, kernel))  # [kv, L - w]
        scores = torch.cat([votes, votes.new_full((kv, w), float(votes.max()) + 1)], dim=-1).float()
        norms = naive_vwl1norm(module, values, heads)
        n_kept = budgets[idx]
        if params.get("base", "snapkv") != "adakv":
            out[idx] = naive_criticalkv_keep(scores, norms, n_kept, ratio, eps)
        elif params.get("allocation") == "kvpress":
            out[idx] = naive_critical_adakv_keep(scores, norms, n_kept, alpha, ratio, eps)
        else:  # Ada-KV's own allocation (AdaKV's code, transcribed above), then the two stages
            counts = [c + w for c in naive_adakv_counts(votes.tolist(), n_kept - w, alpha, False)]
            out[idx] = naive_critical_adakv_keep(scores, norms, n_kept, alpha, ratio, eps, counts)
    return out


CRITICAL_CASES = [
    dict(base="snapkv"),
    dict(base="snapkv", first_stage_ratio=0.25, epsilon=1e-2),
    dict(base="pyramidkv"),
    dict(base="adakv", allocation="kvpress", alpha=0.5),
    dict(base="adakv", layout="padded"),
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
        got = _kept_by_method(model, method, batch)
        for r, row in enumerate(batch):
            alone = _kept_by_method(model, method, [row])  # the row's layer budgets (pyramid)
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


# ---- KVzip ------------------------------------------------------------------------------------------
# Transcribed from snu-mllab/KVzip @ 5d8472975d286e3da6b52178af39d18904330c0d (`model/wrapper.py`
# `prefill` / `self_task` / `scoring`, `model/template.py`'s Qwen strings, `attention/score.py`
# `_get_score` / `_threshold` / `_threshold_uniform`) and NVIDIA/kvpress @
# 8bb29b9c3078452a86d692f29123fa6c793e2b05 (`KVzipPress`: `prepare`, `score_kvzip`,
# `compress_post`): the model runs on a plain DynamicCache, each reconstruction input is fed and
# the cache cropped back, queries and keys are read from the model's attention call. Bottom-k /
# top-k ties keep the earlier (layer, head, position), as everywhere in this harness.

KVZIP_SYSTEM = "Hi."


def _kvzip_kept(cache) -> dict[int, list[list[list[int]]]]:
    """Per layer, per batch row, per KV head: the positions kept (per-head storage read per head)."""
    out = {}
    for i, layer in cache.compressible_layers():
        pos = layer.head_positions() if layer.per_head else layer.positions
        out[i] = [[[p for p in head.tolist() if p >= 0] for head in row] for row in pos]
    return out


KVZIP_PREFIX = f"<|im_start|>system\n{KVZIP_SYSTEM}<|im_end|>\n<|im_start|>user\n"  # the authors' Qwen prefix
KVZIP_POSTFIX = "<|im_end|>\n<|im_start|>assistant\n"  # the authors' Qwen postfix
KVZIP_FIRST = "\n\nRepeat the previous context exactly."
KVZIP_LATER = "\n\nRepeat the part of the previous context exactly, starting with "  # kvpress: no final space
KVZIP_TEMPLATE = (
    f"<|im_start|>system\n{KVZIP_SYSTEM}<|im_end|>\n"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer():
    """A character-level tokenizer (ids < 128, the tiny models' vocabulary) with a ChatML template
    that has a system prompt."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<|im_start|>", "<|im_end|>"]
    chars = sorted(
        set(KVZIP_PREFIX + KVZIP_POSTFIX + KVZIP_LATER + KVZIP_FIRST + "dummy context#") - set("<|>_")
    )
    chars += list("<|>_")
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.add_special_tokens(specials[1:])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    out.chat_template = KVZIP_TEMPLATE
    return out


@contextlib.contextmanager
def captured_attention(model):
    """The model's attention calls recorded: {layer: (query [b, heads, q, d] post-RoPE, key
    [b, kv, L, d] the whole cache, the attention module's input hidden states [b, q, hidden])}."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    seen: dict = {}
    hidden: dict = {}

    def attn(module, query, key, value, attention_mask, **kwargs):
        seen[module.layer_idx] = (query, key, value, hidden[module.layer_idx])
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def grab(module, args, kwargs):
        hidden[module.layer_idx] = kwargs["hidden_states"]

    hooks = [
        layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in model.model.layers
    ]
    AttentionInterface.register("kvzip_capture", attn)
    AttentionMaskInterface.register("kvzip_capture", sdpa_mask)
    impl = model.config._attn_implementation
    model.set_attn_implementation("kvzip_capture")
    try:
        yield seen
    finally:
        model.set_attn_implementation(impl)
        for h in hooks:
            h.remove()
        AttentionInterface._global_mapping.pop("kvzip_capture", None)
        AttentionMaskInterface._global_mapping.pop("kvzip_capture", None)


def naive_kvzip_chunk_score(module, query, key, value, hidden, sink, start, end, plus):
    """`_get_score` (kvpress' `score_kvzip` with `plus`) of one layer: per KV head, the max over
    its group's heads and the input's queries of the softmax over [sinks, chunk, input] keys."""
    heads, q_len, d = query.shape[1], query.shape[2], query.shape[3]
    kv = key.shape[1]
    g = heads // kv
    ctx = end - start
    out = []
    for h in range(kv):
        keys = torch.cat([key[0, h, :sink], key[0, h, start:end], key[0, h, -q_len:]])
        vals = torch.cat([value[0, h, :sink], value[0, h, start:end], value[0, h, -q_len:]])
        best = torch.zeros(ctx)
        for j in range(g):
            logits = query[0, h * g + j] @ keys.T / math.sqrt(d)
            for i in range(q_len):
                logits[i, keys.shape[0] - q_len + i + 1 :] = -math.inf
            w = logits.softmax(dim=-1)
            if plus:
                w = w / hidden[0].norm(dim=-1)[:, None]
                wo = module.o_proj.weight.T[(h * g + j) * d : (h * g + j + 1) * d]  # [d, hidden]
                w = w * (vals @ wo).norm(dim=-1)[None, :]
            best = torch.maximum(best, w[:, sink : sink + ctx].amax(dim=0))
        out.append(best)
    return torch.stack(out)  # [kv, ctx]


def naive_kvzip_kept(model, tok, ids, budget, variant, chunk, plus=False):
    """{layer: [kept positions per KV head]} for one row `ids` `[1, n]` starting with the prefix."""
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    prefix, n = len(enc(KVZIP_PREFIX)), ids.shape[1]
    later = KVZIP_LATER if variant in ("authors", "uniform") else KVZIP_LATER.rstrip(" ")
    n_layers, kv = model.config.num_hidden_layers, model.config.num_key_value_heads
    if n <= budget:
        return {i: [list(range(n))] * kv for i in range(n_layers)}
    cache = DynamicCache(config=model.config)
    ctx = ids[:, prefix:]
    chunks = [ctx[:, s : s + chunk] for s in range(0, ctx.shape[1], chunk)]
    scores = torch.zeros(n_layers, kv, n)
    with captured_attention(model) as seen, torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        start = prefix
        for i, a in enumerate(chunks):
            q = (
                torch.tensor([enc(KVZIP_FIRST)])
                if i == 0
                else torch.cat([torch.tensor([enc(later)]), chunks[i - 1][:, -8:]], 1)
            )
            repeat = torch.cat([q, torch.tensor([enc(KVZIP_POSTFIX)]), a], dim=1)
            end = start + a.shape[1]
            sink = prefix if variant in ("authors", "uniform") else min(4, start)
            model(input_ids=repeat, use_cache=True, **{cache_kwarg(model): cache})
            for layer in range(n_layers):
                module = model.model.layers[layer].self_attn
                scores[layer, :, start:end] = naive_kvzip_chunk_score(
                    module, *seen[layer], sink, start, end, plus
                )
            cache.crop(-repeat.shape[1])  # the authors' `kv.slice(seen_token_prev)`
            start = end
    kept = torch.zeros(n_layers, kv, n, dtype=torch.bool)
    if variant == "authors":  # `_threshold`: strictly above sorted[int(N r) - 1], the prefix kept
        ctx_scores = scores[..., prefix:]
        k = (budget - prefix) * kv * n_layers  # int(N * r)
        thres = ctx_scores.reshape(-1).sort(descending=True).values[max(k - 1, 0)]
        kept[..., prefix:] = ctx_scores > thres
        kept[..., :prefix] = True
    elif variant == "uniform":  # `_threshold_uniform`: each head its top int(n_seq r)
        for layer in range(n_layers):
            for h in range(kv):
                row = scores[layer, h, prefix:].tolist()
                top = sorted(range(len(row)), key=lambda j: -row[j])[: budget - prefix]
                kept[layer, h, [prefix + j for j in top]] = True
        kept[..., :prefix] = True
    else:  # kvpress `compress_post`: sinks scored 1, the bottom int(numel ratio) pruned
        scores[..., :4] = 1.0
        if variant == "kvpress":
            flat = scores.reshape(-1).tolist()
            order = sorted(range(len(flat)), key=lambda j: (flat[j], -j))
            pruned = order[: len(flat) - budget * kv * n_layers]
            kept.view(-1)[:] = True
            kept.view(-1)[pruned] = False
        else:  # layerwise
            for layer in range(n_layers):
                flat = scores[layer].reshape(-1).tolist()
                order = sorted(range(len(flat)), key=lambda j: (flat[j], -j))
                kept[layer].view(-1)[:] = True
                kept[layer].view(-1)[order[: len(flat) - budget * kv]] = False
    return {layer: [kept[layer, h].nonzero()[:, 0].tolist() for h in range(kv)] for layer in range(n_layers)}


KVZIP_VARIANTS = {
    "authors": dict(),
    "uniform": dict(selection="head"),
    "kvpress": dict(selection="global", n_sink=4, prompt="kvpress"),
    "layerwise": dict(selection="layer", n_sink=4, prompt="kvpress"),
}


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("length", LENGTHS_AROUND_BUDGET)
@pytest.mark.parametrize("variant", [*KVZIP_VARIANTS, "kvpress+plus"])
def test_kvzip_selection_is_the_original(kv_heads, length, variant):
    model, tok = _tiny(kv_heads, layers=2), char_tokenizer()
    name, plus = variant.split("+")[0], variant.endswith("+plus")
    method = build_method("kvzip", budget=B, repeat_chunk=9, kvzip_plus=plus, **KVZIP_VARIANTS[name])
    method.post_init_from_tokenizer(tok, True)
    head = torch.tensor([tok(KVZIP_PREFIX, add_special_tokens=False)["input_ids"]])
    rows = [torch.cat([head, distinct_ids(length - head.shape[1], seed=s)], dim=1) for s in (3, 4)]
    got = _kvzip_kept(_prefilled(model, torch.cat(rows), method))
    for r, row in enumerate(rows):
        want = naive_kvzip_kept(model, tok, row, B, name, chunk=9, plus=plus)
        assert {i: kept[r] for i, kept in got.items()} == want, f"row {r}"


def test_kvzip_repeat_prompt_pieces_are_the_authors_strings():
    """The template prefix / suffix derived from the chat template are the authors' hard-coded Qwen
    strings; the later chunks' instruction ends with a space (authors) or not (kvpress)."""
    from snapkv.methods.kvzip import RepeatPrompt

    tok = char_tokenizer()
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    p = RepeatPrompt.of(tok, True, "authors")
    assert (p.prefix, p.suffix, p.first, p.later) == (
        enc(KVZIP_PREFIX),
        enc(KVZIP_POSTFIX),
        enc(KVZIP_FIRST),
        enc(KVZIP_LATER),
    )
    assert RepeatPrompt.of(tok, True, "kvpress").later == enc(KVZIP_LATER)[:-1]
    raw = RepeatPrompt.of(tok, False, "authors")
    assert raw.prefix == [] and raw.suffix == enc("\n")


def test_kvzip_threshold_keeps_one_fewer_than_global_and_refuses_padding():
    model = _tiny(2, layers=2)
    ids = torch.cat([distinct_ids(90, seed=3), distinct_ids(90, seed=4)])
    kept = {}
    for selection in ("threshold", "global"):
        method = build_method("kvzip", budget=B, selection=selection, repeat_chunk=32)
        cache = _prefilled(model, ids, method)
        kept[selection] = [
            sum(len(h) for h in rows[r]) for r in range(2) for rows in [_kvzip_kept(cache)[i] for i in (0, 1)]
        ]
    total = [kept["threshold"][0] + kept["threshold"][1], kept["threshold"][2] + kept["threshold"][3]]
    assert total == [B * 2 * 2 - 1] * 2
    assert sum(kept["global"]) == 2 * B * 2 * 2
    method = build_method("kvzip", budget=B)
    with pytest.raises(ValueError, match="left-padded"):
        _padded_kept(model, [distinct_ids(90, seed=3)[0], distinct_ids(70, seed=5)[0]], method)


# ---- R-KV ------------------------------------------------------------------------------------------
# Transcribed from Zefan-Cai/R-KV @ d15c9767e67c2bd9807128fecc35223fa2484a69: `rkv/utils.py`
# (`compute_attention_scores`: q.k / sqrt(d), max over the GQA group; `cal_similarity`: cosine of
# normalised keys, diagonal 0, each row's last entry above the threshold set to 0 (index 0 when
# none), mean over rows, softmax) and `rkv/compression/r1_kv.py` (`R1KV.update_kv`: softmax of the
# window rows over the prefix columns, mean over the window, max-pool, lambda * attention -
# (1 - lambda) * similarity, top budget - window of the prefix, then the window). Per batch row
# here (the original: row 0's similarity for every row). SnapKV-D is the same with lambda = 1.


def naive_rkv_importance(q: torch.Tensor, k: torch.Tensor, window: int, kernel: int, scaling: float) -> list:
    """One batch row: q `[heads, >=window, d]`, k `[kv_heads, L, d]` -> [kv_heads][L - window]."""
    heads, kv, n = q.shape[0], k.shape[0], k.shape[1]
    g, prefix = heads // kv, n - window
    out = []
    for h in range(kv):
        mean = [0.0] * prefix
        for i in range(q.shape[1] - window, q.shape[1]):
            logits = [
                max(float(q[h * g + m, i].double() @ k[h, j].double()) * scaling for m in range(g))
                for j in range(prefix)
            ]
            top = max(logits)
            z = sum(math.exp(x - top) for x in logits)
            for j in range(prefix):
                mean[j] += math.exp(logits[j] - top) / z / window
        half = kernel // 2
        out.append(
            [max(mean[t] for t in range(j - half, j + half + 1) if 0 <= t < prefix) for j in range(prefix)]
        )
    return out


def naive_rkv_redundancy(k: torch.Tensor, threshold: float) -> list:
    """One batch row: k `[kv_heads, L, d]` -> [kv_heads][L]."""
    out = []
    for h in range(k.shape[0]):
        keys = [v.double() / (float(v.double().norm()) + 1e-8) for v in k[h]]
        n = len(keys)
        cos = [[0.0 if i == j else float(keys[i] @ keys[j]) for j in range(n)] for i in range(n)]
        for i in range(n):
            near = [j for j in range(n) if cos[i][j] > threshold]
            cos[i][max(near) if near else 0] = 0.0
        col = [sum(cos[i][j] for i in range(n)) / n for j in range(n)]
        top = max(col)
        z = sum(math.exp(c - top) for c in col)
        out.append([math.exp(c - top) / z for c in col])
    return out


def naive_rkv_kept(importance, redundancy, n: int, window: int, budget: int, lam: float) -> list:
    """Kept slots per KV head: top budget - window prefix slots by the final score (ties: earlier
    slot), then the window."""
    kept = []
    for imp, red in zip(importance, redundancy):
        final = [lam * imp[j] - (1 - lam) * red[j] for j in range(n - window)]
        best = sorted(range(n - window), key=lambda j: (-final[j], j))[: budget - window]
        kept.append(sorted(best) + list(range(n - window, n)))
    return kept


def _near_duplicate_keys(batch: int, kv: int, n: int, d: int, seed: int) -> torch.Tensor:
    """Random keys where every third one repeats an earlier one with a little noise (cosine well
    above 0.5), so the threshold rule has rows with and without near-duplicates."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(batch, kv, n, d, generator=g)
    for j in range(3, n, 3):
        k[:, :, j] = k[:, :, j - 3] + 0.1 * torch.randn(batch, kv, d, generator=g)
    return k


class _Module:
    scaling = 0.125


class _Layer:
    softcap = None


@pytest.mark.parametrize("kv,group", [(2, 2), (1, 4)])
@pytest.mark.parametrize("threshold", [0.5, 0.95])
def test_rkv_scores_and_selection_are_the_original_formula(kv, group, threshold):
    from snapkv.methods.rkv import key_redundancy
    from snapkv.methods.snapkv_d import window_importance

    n, d, w, kernel, budget, lam = 30, 16, 4, 5, 14, 0.07
    keys = _near_duplicate_keys(2, kv, n, d, seed=kv + group)
    query = torch.randn(2, kv * group, 6, d, generator=torch.Generator().manual_seed(5))
    method = build_method(
        "rkv", budget=budget, window=w, kernel_size=kernel, mix_lambda=lam, threshold=threshold
    )
    imp = window_importance(query, keys, w, kernel, _Module.scaling)
    red = key_redundancy(keys, threshold, block=7)  # blocks that do not divide L
    scores = method.score(_Layer(), query, keys, _Module())
    kept = method.select(scores, budget)
    for row in range(2):  # each row on its own keys
        want_imp = naive_rkv_importance(query[row], keys[row], w, kernel, _Module.scaling)
        want_red = naive_rkv_redundancy(keys[row], threshold)
        torch.testing.assert_close(
            imp[row].double(), torch.tensor(want_imp, dtype=torch.float64), rtol=1e-5, atol=1e-7
        )
        torch.testing.assert_close(
            red[row].double(), torch.tensor(want_red, dtype=torch.float64), rtol=1e-5, atol=1e-7
        )
        final = (
            lam * torch.tensor(want_imp, dtype=torch.float64)
            - (1 - lam) * torch.tensor(want_red, dtype=torch.float64)[:, :-w]
        )
        torch.testing.assert_close(scores[row, :, :-w].double(), final, rtol=1e-5, atol=1e-7)
        assert kept[row].tolist() == naive_rkv_kept(want_imp, want_red, n, w, budget, lam)
    # The rows differ, so row 0's redundancy (the original's) would be wrong for row 1.
    assert not torch.allclose(red[0], red[1])


def test_rkv_threshold_zeroes_the_most_recent_near_duplicate():
    from snapkv.methods.rkv import key_redundancy

    # Keys 0 and 2 are the same direction, 1 is orthogonal: row 2's most recent near-duplicate is 0,
    # row 0's is 2; row 1 has none, so its column 0 is zeroed (0 there anyway).
    k = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 0.0]])[None, None]
    col = torch.tensor([0.0, 0.0, 0.0])  # every off-diagonal similarity above 0.5 is zeroed
    torch.testing.assert_close(key_redundancy(k, 0.5)[0, 0], col.softmax(-1))
    # Threshold 1: nothing is a near-duplicate; each row zeroes its column 0 instead.
    col = torch.tensor([0.0, 0.0, 1.0]) / 3  # only C[0, 2] = 1 survives (row 0 zeroes column 0)
    torch.testing.assert_close(key_redundancy(k, 1.0)[0, 0], col.softmax(-1))


def _scheduled_steps(model, ids, method, new_tokens: int):
    """The method's own generation, recording layer 0's window queries, keys, target and kept
    positions around every compression (prefill and scheduled steps)."""
    steps = []
    prefill, scheduled = type(method).compress_prefill, type(method).compress_decode

    def record(layer, query, key, module, target, run):
        before = dict(query=query.clone(), keys=key.clone(), positions=layer.positions.clone(), target=target)
        done = run()
        if layer.index == 0 and layer.positions.shape[-1] != before["positions"].shape[-1]:
            steps.append({**before, "scaling": module.scaling, "kept": layer.positions.clone()})
        return done

    def spy_prefill(self, layer, query, key, module):
        return record(
            layer,
            query,
            key,
            module,
            self.layer_budget(layer),
            lambda: prefill(self, layer, query, key, module),
        )

    def spy_decode(self, layer, query, module):
        return record(
            layer,
            query,
            layer.keys,
            module,
            self.decode_target(layer),
            lambda: scheduled(self, layer, query, module),
        )

    cls = type(method)
    cls.compress_prefill, cls.compress_decode = spy_prefill, spy_decode
    try:
        generate_ids(model, ids, None, method, max_new_tokens=new_tokens)
    finally:
        cls.compress_prefill, cls.compress_decode = prefill, scheduled
    return steps


@pytest.mark.parametrize("name", ["rkv", "snapkv_d"])
def test_rkv_and_snapkv_d_compress_the_prompt_then_every_interval_as_the_original(name):
    model = _tiny(2)  # GQA groups of 2
    w, budget, interval = 4, 24, 5
    params = dict(budget=budget, window=w, decode_schedule=dict(interval=interval))
    if name == "rkv":
        params["threshold"] = 0.2  # random keys: a few near-duplicates
    method = build_method(name, **params)
    lam = method.mix_lambda if name == "rkv" else 1.0
    steps = _scheduled_steps(model, random_ids(40, seed=3), method, new_tokens=16)
    # The prompt (40 > 24), then forwards 5, 10, 15 (24 + 5 > 24 each time).
    assert [s["keys"].shape[2] for s in steps] == [
        40,
        budget + interval,
        budget + interval,
        budget + interval,
    ]
    for n, step in enumerate(steps):
        keys, query = step["keys"][0], step["query"][0]
        imp = naive_rkv_importance(query, keys, w, 7, step["scaling"])
        red = naive_rkv_redundancy(keys, 0.2) if name == "rkv" else [[0.0] * keys.shape[1]] * keys.shape[0]
        kept = naive_rkv_kept(imp, red, keys.shape[1], w, budget, lam)
        want = torch.stack([step["positions"][0, h, slots] for h, slots in enumerate(kept)])
        assert torch.equal(step["kept"][0], want), f"compression {n}"
