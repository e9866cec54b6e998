"""Exactness of the core: methods inside unmodified transformers models, on tiny random configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from cache_paths import (
    FULL_ARCH,
    PATHS,
    REPRESENTATIVE_INDEX,
    REPRESENTATIVES,
    assert_takes_its_paths,
    catalogue_cases,
    fast_cases,
    mechanism,
    recording_caches,
    tier,
)
from conftest import ARCHS, random_ids, tiny_model
from method_catalogue import (
    CATALOGUE,
    NOT_SCHEDULABLE,
    NOT_SWITCHES,
    SWITCHES_TESTED_ELSEWHERE,
    catalogue,
    ids,
)
from reference import (
    eager_attentions,
    masked_reference_logits,
    naive_column_sums,
    naive_snapkv_selection,
    record_visible,
)
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import snapkv
import snapkv.methods.snapkv
from snapkv import CompressedCache, build_method, generate_ids, prefill
from snapkv.forward import cache_kwarg
from snapkv.headwise import LAYOUTS
from snapkv.hooks import session
from snapkv.methods import METHODS, Method, base, register
from snapkv.methods.adakv import ALLOCATIONS, BASES, NORMALIZE
from snapkv.methods.base import GQA_ORDERS, GQA_REDUCTIONS, KEPT_ORDERS, PROTECTS
from snapkv.methods.chunkkv import CHUNK_SCORES
from snapkv.methods.criticalkv import CRITICAL_BASES
from snapkv.methods.kvzip import REPEAT_PROMPTS, SELECTIONS
from snapkv.methods.pyramidkv import SCHEDULES, SHORT_PROMPTS, pyramid_budgets
from snapkv.rope import rerotate

PROMPT = 96
NEW = 8
# Every catalogue entry on Llama: in the fast tier the first entry of each mechanism and the cache
# paths' representatives, the other switch settings in the slow tier (tests/cache_paths.py).
EVERY_METHOD = pytest.mark.parametrize("name,params", catalogue_cases())
# `model.generate` inside `snapkv.apply` is fed token ids with no question or template to protect:
# entries whose `protect` would keep the own loop's question ids run everything else.
UNPROTECTED = [(name, params) for name, params in CATALOGUE if "protect" not in params]


def test_catalogue_covers_every_method_and_switch():
    """Every registered method is in tests/method_catalogue.py, and every value of every switch
    (bool or enumerated field) is run by some entry; a new field must be classified."""
    choices = {
        "pooling": ("max", "avg", "none"),
        "gqa_reduce": GQA_REDUCTIONS,
        "gqa_order": GQA_ORDERS,
        "schedule": SCHEDULES,
        "short_prompt": SHORT_PROMPTS,
        "allocation": ALLOCATIONS,
        "base": BASES,
        "layout": LAYOUTS,
        ("adakv", "normalize"): NORMALIZE,
        ("criticalkv", "normalize"): NORMALIZE,
        ("criticalkv", "base"): CRITICAL_BASES,
        "chunk_score": CHUNK_SCORES,
        "selection": SELECTIONS,
        ("kvzip", "prompt"): tuple(REPEAT_PROMPTS),
        "kept_order": KEPT_ORDERS,
        # "none" never shows: `params()` leaves it out (every entry without the key runs it)
        "protect": tuple(p for p in PROTECTS if p != "none"),
    }
    assert {name for name, _ in CATALOGUE} == set(METHODS)
    # Every method that takes a decode schedule runs one (the schedule is on in some entry).
    scheduled = {name for name, params in CATALOGUE if (params.get("decode_schedule") or {}).get("interval")}
    assert scheduled == set(METHODS) - NOT_SCHEDULABLE, "add a scheduled entry (SCHEDULED) or NOT_SCHEDULABLE"
    covered: dict[str, set] = {}
    for name, params in CATALOGUE:
        method = build_method(name, **params)
        for key, value in method.params().items():
            covered.setdefault(key, set()).add(repr(value))
    for name, cls in METHODS.items():
        for key, default in cls().params().items() if name == "full" else cls(budget=64).params().items():
            if key in NOT_SWITCHES or (name, key) in SWITCHES_TESTED_ELSEWHERE:
                continue
            want = choices.get(
                (name, key), choices.get(key, (False, True) if isinstance(default, bool) else None)
            )
            assert want is not None, f"classify {name}.{key}: a switch (list its values) or NOT_SWITCHES"
            missing = {repr(v) for v in want} - covered.get(key, set())
            assert not missing, f"no catalogue entry runs {name}.{key} in {sorted(missing)}"


def run(model, method, ids, question=None, **kw):
    return generate_ids(model, ids, question, method, max_new_tokens=NEW, keep_logits=True, **kw)


def kept_positions(layer) -> torch.Tensor:
    """Original positions kept per head `[batch, kv_heads, n]` (per-head storage: padded with -1)."""
    return layer.head_positions() if layer.per_head else layer.positions


# Budget >= prompt + new tokens: nothing is ever evicted (also by the decode-time evicting methods).
NOT_EVICTING = catalogue(budget=PROMPT + NEW) + [
    ("snapkv", dict(budget=PROMPT, window=8)),  # the boundary: budget == prompt length
    ("snapkv", dict(budget=4096, window=32)),
]
# The catalogue x architecture matrices: the fast tier runs the first entry of each mechanism on
# FULL_ARCH (and the two boundary budgets past the catalogue) and each cache path's representative on
# every architecture (tests/cache_paths.py); the slow tier the rest.
NOT_EVICTING_CASES = [
    pytest.param(arch, name, params, id=f"{arch}-{case}", marks=tier(arch, i))
    for arch in ARCHS
    for i, ((name, params), case) in enumerate(zip(NOT_EVICTING, ids(NOT_EVICTING)))
]
MASKED_CASES = [
    pytest.param(arch, query_aware, name, params, id=f"{arch}-{query_aware}-{case}", marks=tier(arch, i))
    for arch in ARCHS
    for query_aware in (True, False)
    for i, ((name, params), case) in enumerate(zip(CATALOGUE, ids(CATALOGUE)))
]


def test_fast_matrices_cover_every_method_and_every_cache_path_on_every_architecture():
    """The fast tier's share of the catalogue x architecture matrices runs every mechanism of the
    catalogue (every method, every wrapper around another scorer) on FULL_ARCH and, on every
    architecture, each cache path's representative (whose case checks that it takes the path there),
    so that a new method, composition, layout or changed entry cannot fall out of it."""
    assert set(REPRESENTATIVE_INDEX) == set(PATHS)
    assert [name for name, _ in NOT_EVICTING[: len(CATALOGUE)]] == [name for name, _ in CATALOGUE]
    masked, budgets = fast_cases(MASKED_CASES), fast_cases(NOT_EVICTING_CASES)
    assert {name for arch, name, _ in masked if arch == FULL_ARCH} == set(METHODS)
    mechanisms = {mechanism(name, params) for name, params in CATALOGUE}
    assert {mechanism(n, p) for arch, n, p in masked if arch == FULL_ARCH} == mechanisms
    assert {mechanism(n, p) for arch, n, p in budgets if arch == FULL_ARCH} == mechanisms
    for name, params in NOT_EVICTING[len(CATALOGUE) :]:  # the boundary budgets
        assert (FULL_ARCH, name, params) in budgets, (name, params)
    # The catalogue-wide tests on FULL_ARCH alone: every mechanism and every representative.
    every = [(p.values[0], p.values[1]) for p in catalogue_cases() if not p.marks]
    assert {mechanism(*entry) for entry in every} == mechanisms
    assert all(entry in every for entry in REPRESENTATIVES.values())
    for arch in ARCHS:  # each representative's own case checks that it takes its path
        for path, i in REPRESENTATIVE_INDEX.items():
            assert (arch, *CATALOGUE[i]) in masked and (arch, *NOT_EVICTING[i]) in budgets, (path, arch)
    # Both query modes of each fast case.
    assert len(masked) == 2 * len({(a, n, repr(p)) for a, n, p in masked})
    # The rollback and padded-row matrices: every mechanism of their entries on FULL_ARCH, every
    # path's representative on every architecture (the padded rows run no decode schedule; the
    # rollback also compacts).
    from test_padding import METHODS as PADDED_ENTRIES
    from test_padding import PADDED_ROW_CASES
    from test_rollback import ENTRIES as ROLLBACK_ENTRIES
    from test_rollback import ROLLBACK_CASES

    for cases, entries, without in (
        (ROLLBACK_CASES, ROLLBACK_ENTRIES, set()),
        (PADDED_ROW_CASES, PADDED_ENTRIES, {"decode_schedule"}),
    ):
        fast = fast_cases(cases)
        assert {mechanism(n, p) for a, n, p in fast if a == FULL_ARCH} == {mechanism(*e) for e in entries}
        for arch in {p.values[0] for p in cases}:
            for path, entry in REPRESENTATIVES.items():
                assert path in without or (arch, *entry) in fast, (path, arch)


@pytest.mark.parametrize("arch,name,params", NOT_EVICTING_CASES)
def test_budget_at_least_length_equals_full(arch, name, params):
    model = tiny_model(arch)
    ids = random_ids(PROMPT)
    ref, rref = run(model, build_method("full"), ids)
    out, res = run(model, build_method(name, **params), ids)
    assert torch.equal(out, ref)
    assert not res.compressed
    for a, b in zip(res.logits, rref.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch,query_aware,name,params", MASKED_CASES)
def test_compressed_decoding_equals_masked_full_cache(arch, name, params, query_aware):
    model = tiny_model(arch)
    ids = random_ids(PROMPT, batch=2)  # two rows: per-row selections (Ada-KV: per-row head budgets)
    ctx, q = ids[:, :80], ids[:, 80:]
    method = build_method(name, **params)
    with recording_caches() as caches:
        (out, res), records = record_visible(
            model, lambda: run(model, method, ctx, q, query_aware=query_aware)
        )
    assert_takes_its_paths(arch, name, params, caches[0], method)
    assert res.compressed == (name != "full")
    # Query-agnostic: the question forward comes after compression (on a cache whose layers / heads
    # may hold different lengths), so it is a masked step too.
    fed = ([] if query_aware else [q]) + [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
    ref = masked_reference_logits(model, [ids if query_aware else ctx], fed, records)
    ref = ref[-len(res.logits) :]
    assert len(records) == 1 + len(fed)
    for step, (a, b) in enumerate(zip(res.logits, ref)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("order", ["reduce_first", "pool_first"])
@pytest.mark.parametrize("pooling", ["max", "avg", "none"])
@pytest.mark.parametrize("reduce", ["mean", "max", "sum"])
def test_snapkv_selection_equals_naive_reference(pooling, reduce, order):
    model = tiny_model("llama")
    ids = random_ids(64)
    method = build_method(
        "snapkv", budget=24, window=8, kernel_size=5, pooling=pooling, gqa_reduce=reduce, gqa_order=order
    )
    attns = eager_attentions(model, ids)
    cache = _prefilled_cache(model, ids, method)
    for layer_idx, layer in cache.compressible_layers():
        want = naive_snapkv_selection(attns[layer_idx], 2, 24, 8, 5, pooling, reduce, order)
        got = layer.positions[0].tolist()
        assert got == want, f"layer {layer_idx}"


def test_gqa_orders_differ_with_max_pooling_and_agree_when_linear():
    """The two GQA orders are two methods with max-pooling; with avg-pooling and a mean they rank
    alike (both steps linear). Compared: the share of kept prefix entries that differ."""
    model = tiny_model("llama", layers=4)
    ids = random_ids(200)

    def kept(**p):
        cache = _prefilled_cache(model, ids, build_method("snapkv", budget=40, window=8, kernel_size=7, **p))
        return [layer.positions[..., :-8] for _, layer in cache.compressible_layers()]

    def differ(a, b):
        same = sum(len(set(x.tolist()) & set(y.tolist())) for u, v in zip(a, b) for x, y in zip(u[0], v[0]))
        return 1 - same / sum(u[0].numel() for u in a)

    assert differ(kept(gqa_order="reduce_first"), kept(gqa_order="pool_first")) > 0.1
    linear = differ(
        kept(gqa_order="reduce_first", pooling="avg"), kept(gqa_order="pool_first", pooling="avg")
    )
    assert linear == 0


def _prefilled_cache(model, ids, method, chunk_size=None):
    cache = CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), session(model, method, cache) as s:
        prefill(model, ids, cache, session=s, chunk_size=chunk_size)
    return cache


def test_h2o_blockwise_scores_equal_eager_column_sums():
    model = tiny_model("qwen2")
    ids = random_ids(70)
    # budget >= length: nothing evicted, so the accumulated scores cover every position
    method = build_method("h2o", budget=70, block_size=16)
    cache = _prefilled_cache(model, ids, method)
    attns = eager_attentions(model, ids)
    for layer_idx, layer in cache.compressible_layers():
        want = naive_column_sums(attns[layer_idx], 2)
        torch.testing.assert_close(layer.scores[0].double(), want, atol=1e-5, rtol=1e-5)


def test_h2o_decode_eviction_holds_budget_exactly():
    model = tiny_model("llama")
    ids = random_ids(60)
    method = build_method("h2o", budget=32, recent=8)
    sizes = []
    orig = snapkv.hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        orig(self, module, layer, query, key)
        newest = layer.positions.sort(dim=-1).values[..., -8:]  # in-place eviction: slots unordered
        sizes.append((layer.state, layer.stored, newest, layer.seen))

    snapkv.hooks.Session.after_attention = spy
    try:
        generate_ids(model, ids, None, method, max_new_tokens=12)
    finally:
        snapkv.hooks.Session.after_attention = orig
    assert all(stored == 32 for _, stored, _, _ in sizes)
    for _, _, recent, seen in sizes:  # the recent window is always the last 8 positions
        assert torch.equal(recent[0, 0], torch.arange(seen - 8, seen))


def test_streamingllm_keeps_sinks_and_most_recent():
    model = tiny_model("mistral")
    ids = random_ids(100)
    method = build_method("streamingllm", budget=20, n_sink=4)
    cache = _prefilled_cache(model, ids, method)
    for _, layer in cache.compressible_layers():
        want = list(range(4)) + list(range(84, 100))
        assert layer.positions[0].tolist() == [want, want]


@EVERY_METHOD
def test_chunked_prefill_selects_exactly_as_single_pass(name, params):
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    single = _prefilled_cache(model, ids, build_method(name, **params))
    chunked = _prefilled_cache(model, ids, build_method(name, **params), chunk_size=24)
    for (_, a), (_, b) in zip(single.compressible_layers(), chunked.compressible_layers()):
        assert torch.equal(kept_positions(a), kept_positions(b))
        torch.testing.assert_close(a.keys, b.keys, atol=1e-5, rtol=1e-5)


def test_chunked_generation_equals_single_pass():
    model = tiny_model("qwen2")
    ids = random_ids(PROMPT)
    method = build_method("snapkv", budget=40, window=8)
    a, ra = generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True)
    b, rb = generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True, chunk_size=30)
    assert torch.equal(a, b)
    torch.testing.assert_close(ra.logits[-1], rb.logits[-1], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("query_aware", [True, False])
@pytest.mark.parametrize(
    "name,params",
    [
        ("snapkv", dict(budget=40, window=8, protect="question")),
        ("h2o", dict(budget=40, evict_during_decode=True)),
    ],
)
def test_generate_ids_is_compress_then_decode(name, params, query_aware):
    """`generate_ids` composes `compress` and `decode`: called one after the other they give the same
    tokens and logits, and between them every measurement of its result (the same values but the
    seconds; the memory peak, implementation and device are the composition's own)."""
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    ctx, q = ids[:, :80], ids[:, 80:]
    cfg = snapkv.GenerationConfig(
        query_aware=query_aware, max_new_tokens=NEW, keep_logits=True, chunk_size=32
    )
    out, res = generate_ids(model, ctx, q, build_method(name, **params), config=cfg)
    prompt = snapkv.compress(model, ctx, build_method(name, **params), question_ids=q, config=cfg)
    assert (prompt.question is None) == query_aware and prompt.input_tokens == PROMPT
    (decoded,) = snapkv.decode(model, prompt, config=cfg)
    assert torch.equal(decoded.ids, out) and out.shape == (1, NEW)
    assert len(decoded.logits) == len(res.logits) == NEW
    assert all(torch.equal(a, b) for a, b in zip(decoded.logits, res.logits))
    got = {**prompt.measurements(), **decoded.measurements()}
    want = res.measurements()
    assert set(got) == set(want) - {"peak_mem_bytes", "decode_peak_mem_bytes", "attn_impl", "device"}
    seconds = {k for k in got if k.endswith("_s")}
    assert seconds == {"prefill_s", "scoring_s", "ttft_s", "tpot_s", "e2e_s"}
    assert {k: v for k, v in got.items() if k not in seconds} == {k: want[k] for k in got if k not in seconds}
    assert res.compressed and (name != "h2o" or res.evicted_during_decode)
    assert 0 < got["prefill_s"] <= got["ttft_s"] <= got["e2e_s"]


@pytest.mark.parametrize("query_aware", [True, False])
@pytest.mark.parametrize(
    "name,params",
    [("snapkv", dict(budget=40, window=8)), ("h2o", dict(budget=40, evict_during_decode=True))],
)
def test_a_left_padded_prompt_decodes_each_row_as_alone(name, params, query_aware):
    """`compress` with an attention mask and a question (prefilled with the context, or fed on it by
    `decode`): each row's tokens as its prompt's alone, logits within fp32 rounding."""
    model = tiny_model("llama")
    rows = [random_ids(90, seed=1)[0], random_ids(50, seed=2)[0]]
    ctx = torch.zeros(2, 90, dtype=torch.long)
    mask = torch.zeros_like(ctx)
    for r, row in enumerate(rows):
        ctx[r, 90 - len(row) :], mask[r, 90 - len(row) :] = row, 1
    q = torch.cat([random_ids(6, seed=5), random_ids(6, seed=6)])
    cfg = snapkv.GenerationConfig(query_aware=query_aware, max_new_tokens=NEW, keep_logits=True)
    prompt = snapkv.compress(
        model, ctx, build_method(name, **params), question_ids=q, attention_mask=mask, config=cfg
    )
    (decoded,) = snapkv.decode(model, prompt, config=cfg)
    for r, row in enumerate(rows):
        alone, res = generate_ids(model, row[None], q[r : r + 1], build_method(name, **params), config=cfg)
        assert torch.equal(decoded.ids[r], alone[0]), f"row {r}"
        for x, y in zip(decoded.logits, res.logits, strict=True):
            torch.testing.assert_close(x[r], y[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,params", catalogue_cases(UNPROTECTED))
def test_model_generate_resumed_on_compressed_cache_matches_own_loop(name, params):
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    method = build_method(name, **params)
    # Own loop: compress the prompt minus its last token, then feed that token (query-agnostic path);
    # it stops at the model's EOS token, as model.generate does.
    eos = {model.generation_config.eos_token_id}
    own, _ = generate_ids(
        model, ids[:, :-1], ids[:, -1:], method, query_aware=False, max_new_tokens=NEW, stop_ids=eos
    )
    cache = _prefilled_cache(model, ids[:, :-1], method)
    with snapkv.apply(model, method), torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, **{cache_kwarg(model): cache})
    assert torch.equal(out[:, ids.shape[1] :], own)


@EVERY_METHOD
def test_apply_context_manager_matches_own_loop(name, params):
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    method = build_method(name, **params)
    # model.generate stops at the model's EOS token: the own loop does too.
    eos = {model.generation_config.eos_token_id}
    own, _ = generate_ids(model, ids, None, method, max_new_tokens=NEW, stop_ids=eos)
    with snapkv.apply(model, method), torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out[:, ids.shape[1] :], own)
    assert not snapkv.hooks_installed()


def test_hooks_are_removed_after_session_and_on_error():
    model = tiny_model("llama")
    assert not snapkv.hooks_installed()
    with pytest.raises(RuntimeError):
        with session(model, build_method("full")):
            assert snapkv.hooks_installed()
            raise RuntimeError("boom")
    assert not snapkv.hooks_installed()
    with snapkv.apply(model, build_method("snapkv", budget=16, window=4)):
        assert "generate" in vars(model)
    assert "generate" not in vars(model)


def test_a_local_attention_override_is_wrapped_too():
    # kvpress patches every entry of the shared ALL_ATTENTION_FUNCTIONS at import (its local
    # mapping, looked up before the class-wide one): the session must still reach the layers.
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    calls = []

    def override(module, query, key, value, attention_mask, *args, **kwargs):
        calls.append(key.shape[2])
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)

    model, ids = tiny_model("llama"), random_ids(PROMPT)
    saved = local.get("sdpa")
    local["sdpa"] = override
    try:
        cache = snapkv.compress_context(model, ids, build_method("snapkv", budget=16, window=4))
        assert local["sdpa"] is override and not snapkv.hooks_installed()  # restored
    finally:
        if saved is None:
            local.pop("sdpa", None)
        else:
            local["sdpa"] = saved
    assert cache.kept_tokens() == [16.0] * len(cache.kept_tokens())  # compressed
    assert calls and all(k == PROMPT for k in calls)  # the override still ran, on the whole prompt


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_bytes_match_kept_tokens(arch, dtype):
    model = tiny_model(arch).to(dtype)
    ids = random_ids(PROMPT)
    _, res = generate_ids(model, ids, None, build_method("snapkv", budget=40, window=8), max_new_tokens=1)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_token = cfg.num_key_value_heads * head_dim * 2 * torch.finfo(dtype).bits // 8
    n_comp = len(res.kv_tokens_per_layer)
    other = cfg.num_hidden_layers - n_comp  # gemma3's sliding layers keep sliding_window - 1 entries
    sliding = min(PROMPT, cfg.sliding_window - 1) if other else 0
    assert res.kv_tokens == 40
    assert res.kv_bytes == (40 * n_comp + sliding * other) * per_token
    assert res.kv_bytes_full == (PROMPT * n_comp + sliding * other) * per_token


def test_streamingllm_compacted_positions_rerotate_keys():
    model = tiny_model("llama")
    rope = model.model.rotary_emb
    k = torch.randn(1, 2, 5, 16)
    src = torch.tensor([[3, 10, 11, 40, 41]])
    dst = torch.arange(5)[None]

    def rotate(x, pos):
        cos, sin = rope(x, pos)
        return x * cos[:, None] + torch.cat((-x[..., 8:], x[..., :8]), -1) * sin[:, None]

    moved = rerotate(rotate(k, src), (dst - src).expand(1, 2, 5), rope.inv_freq)
    torch.testing.assert_close(moved, rotate(k, dst), atol=1e-5, rtol=1e-5)


def test_streamingllm_compacted_generation_uses_slot_positions():
    model = tiny_model("llama")
    ids = random_ids(PROMPT)
    method = build_method("streamingllm", budget=24, n_sink=4, positions="compacted")
    out, res = generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True)
    # Reference: the kept tokens' keys moved to slots 0..23 equal recomputing RoPE there; check the
    # cache state through a fresh prefill and that decoding continues at slot == budget.
    cache = _prefilled_cache(model, ids, method)
    for _, layer in cache.compressible_layers():
        assert layer.compacted and layer.get_seq_length() == 24
    assert res.kv_tokens == 24 and out.shape[1] == NEW
    with pytest.raises(ValueError, match="compacted"):
        with snapkv.apply(model, method):
            pass


def test_empty_prompt_is_an_error():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="empty"):
        generate_ids(model, torch.zeros(1, 0, dtype=torch.long), None, build_method("full"))


@dataclass
class _LayerwiseSnapKV(snapkv.methods.snapkv.SnapKV):
    """Test-only: different budgets per layer, so layers store different lengths."""

    def layer_budget(self, layer):
        return self.budget - 8 * layer.index


@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_unequal_layer_lengths_get_a_per_layer_mask(arch_name, impl):
    model = tiny_model(arch_name, attn=impl)
    ids = random_ids(PROMPT)
    ctx, q = ids[:, :80], ids[:, 80:]
    method = _LayerwiseSnapKV(budget=40, window=8)
    # query-agnostic: a 16-token forward after compression, with layers at 40/32/24 entries
    (out, res), records = record_visible(model, lambda: run(model, method, ctx, q, query_aware=False))
    assert res.kv_tokens_per_layer == [40.0, 32.0, 24.0]
    fed = [q] + [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
    ref = masked_reference_logits(model, [ctx], fed, records)[-len(res.logits) :]
    for a, b in zip(res.logits, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _readme_method_example() -> str:
    """The first python block of CONTRIBUTING.md's "Adding a method" section."""
    guide = (Path(__file__).resolve().parents[1] / "CONTRIBUTING.md").read_text()
    section = guide.split("## Adding a method", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_example_method_is_at_most_thirty_lines_and_keeps_the_smallest_norm_keys():
    code = _readme_method_example()
    assert 3 < len(code.splitlines()) <= 30, code  # the guide's promise: a method in a few lines
    namespace = {"Method": Method, "register": register, "dataclass": dataclass}
    # The package registers its own "knorm" (snapkv.methods.knorm): set it aside while the
    # example's class takes the name.
    registered = METHODS.pop("knorm", None)
    try:
        exec(compile(code, "CONTRIBUTING.md:adding-a-method", "exec"), namespace)
        assert "knorm" in METHODS
        model = tiny_model("llama")
        ids = random_ids(PROMPT)
        method = build_method("knorm", budget=32)
        # Reference: the full cache's keys; each head keeps its 32 smallest-norm keys.
        with torch.no_grad():
            full = DynamicCache(config=model.config)
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): full})
        cache = _prefilled_cache(model, ids, method)
        for i, layer in cache.compressible_layers():
            norms = full.layers[i].keys.norm(dim=-1)  # [1, kv_heads, 96]
            want = norms.argsort(dim=-1)[..., :32].sort(dim=-1).values
            assert torch.equal(layer.positions, want), f"layer {i}"
        # ... and decoding on it is exact (the masked full-cache reference), through the harness.
        (out, res), records = record_visible(model, lambda: run(model, method, ids))
        assert res.compressed and res.kv_tokens == 32
        fed = [out[:, i : i + 1] for i in range(out.shape[1] - 1)]
        ref = masked_reference_logits(model, [ids], fed, records)
        for a, b in zip(res.logits, ref):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        # The guide's scorer, once registered, runs inside a wrapper: PyramidKV's layer budgets
        # filled with its smallest-norm keys.
        wrapped = build_method("pyramidkv", budget=32, beta=4, scorer="knorm")
        assert type(wrapped.scorer_method) is METHODS["knorm"]
        cache = _prefilled_cache(model, ids, wrapped)
        budgets = pyramid_budgets(32, 0, model.config.num_hidden_layers, 4, PROMPT)
        assert len(set(budgets)) > 1
        for i, layer in cache.compressible_layers():
            norms = full.layers[i].keys.norm(dim=-1)
            want = norms.argsort(dim=-1)[..., : budgets[i]].sort(dim=-1).values
            assert torch.equal(layer.positions, want), f"layer {i}"
    finally:
        METHODS.pop("knorm", None)
        if registered is not None:
            METHODS["knorm"] = registered


def test_prefill_holds_one_uncompressed_layer_at_a_time():
    """Each layer is compressed right after its attention: while layer i runs, layers < i are
    already at the budget, so the KV held never approaches all layers' full K/V."""
    model = tiny_model("llama", layers=4)
    ids = random_ids(200)
    method = build_method("snapkv", budget=32, window=8)
    cache = CompressedCache(model.config)
    held = []
    orig = snapkv.hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        held.append(cache.kv_bytes())  # before this layer's compression: it is the only full one
        orig(self, module, layer, query, key)

    snapkv.hooks.Session.after_attention = spy
    try:
        with torch.no_grad(), session(model, method, cache) as s:
            prefill(model, ids, cache, session=s)
    finally:
        snapkv.hooks.Session.after_attention = orig
    per_token = 2 * 2 * 16 * 4  # kv heads x head_dim x (K, V) x fp32
    for i, b in enumerate(held):
        assert b == (32 * i + 200) * per_token
    assert max(held) < 4 * 200 * per_token / 2


def test_h2o_scoring_memory_is_bounded_and_exact(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 300, 16, generator=g), torch.randn(1, 2, 300, 16, generator=g)
    pos = torch.arange(300)
    want = base.causal_column_sums(q, k, pos, pos.expand(1, 2, 300), 0.25, block=300, max_block_bytes=2**30)
    sizes = []
    matmul = torch.matmul

    def spy(a, b):
        out = matmul(a, b)
        sizes.append(out.numel() * out.element_size())
        return out

    monkeypatch.setattr(base.torch, "matmul", spy)
    # 300 keys x 4 heads x 4 bytes = 4800 bytes of logits per query row: 128 KiB -> 27-row blocks
    got = base.causal_column_sums(q, k, pos, pos.expand(1, 2, 300), 0.25, max_block_bytes=128 * 1024)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert max(sizes) <= 128 * 1024  # one block's logits: bounded whatever L is (memory linear in L)
    assert len(sizes) == -(-300 // 27)  # ... by splitting the queries into more blocks


@pytest.mark.parametrize("arch_name", ["llama", "gemma3"])
def test_h2o_fused_prefill_equals_model_attention_then_scoring(arch_name):
    model = tiny_model(arch_name)
    ids = random_ids(PROMPT)
    outs = {}
    for fused in (True, False):
        method = build_method("h2o", budget=40, fused=fused, block_size=16)
        for chunk in (None, 24):
            out, res = generate_ids(
                model, ids, None, method, max_new_tokens=NEW, keep_logits=True, chunk_size=chunk
            )
            outs[fused, chunk] = out, res.logits, _prefilled_cache(model, ids, method, chunk_size=chunk)
    for chunk in (None, 24):
        (a, la, ca), (b, lb, cb) = outs[True, chunk], outs[False, chunk]
        assert torch.equal(a, b)
        for x, y in zip(la, lb):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)
        for (_, u), (_, w) in zip(ca.compressible_layers(), cb.compressible_layers()):
            assert torch.equal(u.positions, w.positions)
            torch.testing.assert_close(u.scores, w.scores, atol=1e-5, rtol=1e-5)
