"""Results and rows say what decoding did: a prompt shorter than the budget is not compressed at
prefill, yet the methods that evict while decoding (H2O, StreamingLLM, TOVA, K-norm re-pruning)
evict once it has grown past the budget. Their one-entry-per-step eviction runs in place (no copy
of the layer) and keeps exactly what the copying path keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import random_ids, tiny_model
from test_rollback import feed

import snapkv.hooks
from eval.store import ROW_FIELDS
from snapkv import build_method, compress_context, generate_ids
from snapkv.methods.base import DecodeSchedule, EveryStep

PROMPT, BUDGET, NEW = 20, 24, 12
DECODE_FIELDS = ("compressed", "evicted_during_decode", "decode_evicted", "kv_tokens_end")


@pytest.mark.parametrize(
    "name,params",
    [
        ("h2o", dict(budget=BUDGET)),
        ("streamingllm", dict(budget=BUDGET, n_sink=4)),
        ("tova", dict(budget=BUDGET)),
        ("tova", dict(budget=BUDGET, keep_last=True)),
        ("knorm", dict(budget=BUDGET, evict_during_decode=True)),
    ],
)
def test_short_prompt_rows_report_decode_eviction_and_final_entries(name, params):
    model = tiny_model("llama")
    _, res = generate_ids(model, random_ids(PROMPT), None, build_method(name, **params), max_new_tokens=NEW)
    # The last generated token is never fed: PROMPT + NEW - 1 entries went through each layer.
    evicted = PROMPT + NEW - 1 - BUDGET
    assert not res.compressed and res.kv_tokens == PROMPT
    assert res.evicted_during_decode and res.decode_evicted == evicted
    assert res.kv_tokens_end == BUDGET and res.kv_tokens_end_per_layer == [BUDGET] * 3
    # The runner copies every measured GenerationResult field into the row (eval.runner).
    row = res.measurements()
    assert set(DECODE_FIELDS) <= set(ROW_FIELDS) and set(DECODE_FIELDS) <= set(row)
    assert not {"text", "output_ids", "decode_s", "logits"} & set(row)
    assert row["evicted_during_decode"] is True and row["decode_evicted"] == evicted
    assert row["kv_tokens_end"] == BUDGET and row["kv_tokens_end_per_layer"] == [BUDGET] * 3


@pytest.mark.parametrize(
    "name,params",
    [
        ("snapkv", dict(budget=BUDGET, window=8)),
        ("h2o", dict(budget=BUDGET, evict_during_decode=False)),
        ("tova", dict(budget=BUDGET, evict_during_decode=False, keep_last=True)),
        ("knorm", dict(budget=BUDGET)),
        ("chunkkv", dict(budget=BUDGET, window=8, chunk_length=4)),
    ],
)
def test_methods_that_never_evict_while_decoding_say_so(name, params):
    model = tiny_model("llama")
    _, res = generate_ids(model, random_ids(PROMPT), None, build_method(name, **params), max_new_tokens=NEW)
    assert not res.compressed and not res.evicted_during_decode and res.decode_evicted == 0
    assert res.kv_tokens_end == PROMPT + NEW - 1  # new tokens are appended


@pytest.mark.parametrize(
    "name,params",
    [
        ("h2o", dict(budget=BUDGET)),
        ("tova", dict(budget=BUDGET)),
        ("knorm", dict(budget=BUDGET, evict_during_decode=True)),
    ],
)
def test_compressed_prompt_with_decode_eviction_holds_the_budget(name, params):
    model = tiny_model("llama")
    method = build_method(name, **params)
    _, res = generate_ids(model, random_ids(60), None, method, max_new_tokens=NEW)
    assert res.compressed and res.kv_tokens == BUDGET
    assert res.evicted_during_decode and res.decode_evicted == NEW - 1 and res.kv_tokens_end == BUDGET


IN_PLACE = [
    ("h2o", dict(budget=BUDGET)),
    ("h2o", dict(budget=BUDGET, recent=4, normalize=True)),
    ("streamingllm", dict(budget=BUDGET, n_sink=4)),
    ("tova", dict(budget=BUDGET)),
    ("tova", dict(budget=BUDGET, keep_last=True)),
    ("knorm", dict(budget=BUDGET, evict_during_decode=True)),
]


def _traced(model, ids, method, monkeypatch=None, ordered=False):
    """Greedy generation with, after every forward of layer 0, its kept positions (as a set) and
    the address of its key buffer. `ordered`: the copying path (every eviction gathers)."""
    trace = []
    original = snapkv.hooks.Session.after_attention

    def spy(self, module, layer, query, key):
        original(self, module, layer, query, key)
        if module.layer_idx == 0:
            kept = layer.positions[0].sort(dim=-1).values.tolist()
            # The tensor itself, held: a freed buffer's address could be handed out again.
            trace.append((kept, layer.keys, layer.decode_evicted))

    monkeypatch.setattr(snapkv.hooks.Session, "after_attention", spy)
    if ordered:
        monkeypatch.setattr(type(method), "evicts_in_place", property(lambda self: False))
    out, res = generate_ids(model, ids, None, method, max_new_tokens=NEW, keep_logits=True)
    monkeypatch.undo()
    return out, res, trace


@pytest.mark.parametrize("length", [PROMPT, 60])
@pytest.mark.parametrize("name,params", IN_PLACE)
def test_in_place_eviction_equals_the_copying_path_and_reuses_one_buffer(name, params, length, monkeypatch):
    """Dropping a decode step's surplus entry in place (the newest entry moves into the victim's
    slot) keeps the same entries as sorting and gathering the layer, answers the same, and after
    the first eviction writes every new token into the same buffer (no copy of the layer)."""
    model = tiny_model("llama")
    ids = random_ids(length)
    method = build_method(name, **params)
    assert method.evicts_in_place
    got, res, trace = _traced(model, ids, method, monkeypatch)
    want, want_res, want_trace = _traced(model, ids, build_method(name, **params), monkeypatch, ordered=True)
    assert torch.equal(got, want)
    for a, b in zip(res.logits, want_res.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)  # the same sums in another order
    assert [kept for kept, *_ in trace] == [kept for kept, *_ in want_trace]
    evicting = [keys.untyped_storage().data_ptr() for _, keys, evicted in trace if evicted]
    assert len(evicting) >= NEW - 2 - max(0, BUDGET - length)
    assert len(set(evicting[1:])) == 1  # from the second eviction on, one buffer
    copied = [keys.untyped_storage().data_ptr() for _, keys, evicted in want_trace if evicted]
    assert len(set(copied)) == len(copied)  # the copying path: a new tensor every step
    assert res.decode_evicted == want_res.decode_evicted and res.kv_tokens_end == BUDGET


@pytest.mark.parametrize(
    "name,params",
    [
        ("h2o", dict(budget=16, recent=4)),
        ("tova", dict(budget=16)),
        ("knorm", dict(budget=16, evict_during_decode=True)),
    ],
)
def test_in_place_eviction_keeps_the_protected_question(name, params, monkeypatch):
    """With `protect="question"` the question's entries are never an in-place victim: every step
    keeps what the copying path (whose scores `shield` protects) keeps, and the question whole."""
    model = tiny_model("llama")
    ctx, question = random_ids(40), random_ids(8, seed=5)

    def kept(ordered: bool) -> list[list[int]]:
        trace = []
        original = snapkv.hooks.Session.after_attention

        def spy(self, module, layer, query, key):
            original(self, module, layer, query, key)
            if module.layer_idx == 0 and layer.state == "ready":
                trace.append(sorted(layer.positions[0, 0].tolist()))

        method = build_method(name, protect="question", **params)
        monkeypatch.setattr(snapkv.hooks.Session, "after_attention", spy)
        if ordered:
            monkeypatch.setattr(type(method), "evicts_in_place", property(lambda self: False))
        generate_ids(model, ctx, question, method, max_new_tokens=12)
        monkeypatch.undo()
        return trace

    got, want = kept(False), kept(True)
    assert got == want
    assert len(got) > 8 and all(set(range(40, 48)) <= set(step) for step in got)


def test_compacted_streamingllm_and_padded_rows_take_the_ordered_path():
    assert not build_method("streamingllm", budget=BUDGET, positions="compacted").evicts_in_place
    assert not build_method("adakv", budget=BUDGET, window=8).evicts_in_place  # splits the budget in prune


def test_a_multi_token_feed_after_in_place_evictions_restores_position_order():
    """A later turn fed in one forward needs the entries in position order (causal mask inside the
    block, index-based protections): the layer sorts them first."""
    model = tiny_model("llama")
    method = build_method("streamingllm", budget=BUDGET, n_sink=4)
    cache = compress_context(model, random_ids(60), method)
    for t in random_ids(NEW, seed=3)[0]:
        feed(model, cache, method, t.view(1, 1))
    layer = cache.layers[0]
    # The rolling buffer: each new token took the oldest non-sink entry's slot.
    assert not bool((layer.positions[..., 1:] >= layer.positions[..., :-1]).all())
    feed(model, cache, method, random_ids(5, seed=4))
    want = list(range(4)) + list(range(layer.seen - (BUDGET - 4), layer.seen))
    assert layer.stored == BUDGET and layer.positions[0].tolist() == [want] * layer.positions.shape[1]


@pytest.mark.parametrize("name,params", [("h2o", dict(budget=BUDGET)), ("tova", dict(budget=BUDGET))])
def test_a_decode_step_computes_its_attention_once(name, params, monkeypatch):
    """H2O and TOVA score a decode step with its own softmax row; they compute the step's attention
    output from that row instead of running the model's attention again: the same kept entries,
    tokens and logits (within fp32 rounding) as the model's attention plus a separate scoring."""
    model = tiny_model("llama")
    ids = random_ids(60)
    calls = []
    method = build_method(name, **params)
    original = type(method).decode_attention

    def counting(self, *args):
        out = original(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(type(method), "decode_attention", counting)
    got, res, trace = _traced(model, ids, method, monkeypatch)
    assert sum(calls) >= 3 * (NEW - 1)  # every layer of every evicting step
    monkeypatch.setattr(type(method), "decode_attention", lambda self, *args: None)
    want, want_res, want_trace = _traced(model, ids, build_method(name, **params), monkeypatch)
    assert torch.equal(got, want)
    for a, b in zip(res.logits, want_res.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert [kept for kept, *_ in trace] == [kept for kept, *_ in want_trace]


def test_h2o_unfused_leaves_the_decode_attention_to_the_model():
    model = tiny_model("llama")
    method = build_method("h2o", budget=BUDGET, fused=False)
    layer = compress_context(model, random_ids(60), method).layers[0]
    assert method.decode_attention(layer, None, None, None, None) is None


@pytest.mark.parametrize(
    ("name", "params"),
    [("streamingllm", {"n_sink": 4}), ("tova", {}), ("tova", {"keep_last": True})],
)
@pytest.mark.parametrize(
    ("batch", "prompt", "new", "evictions"), [(1, 60, NEW, NEW - 1), (2, 60, NEW, NEW - 1), (1, 3, 30, 8)]
)
def test_one_slot_victims_are_the_base_rule(monkeypatch, name, params, batch, prompt, new, evictions):
    """StreamingLLM (from positions alone) and TOVA with one row (one kept set per layer) name their
    victim as one slot for every head (StreamingLLM: and every row); at every in-place eviction it
    is the entry the base class's rule (lowest score, ties to the newest, protections by position)
    would drop in each row and head: after a compressed prompt, and after a prompt shorter than
    the budget (the cache fills while decoding)."""
    from snapkv.cache import CompressibleLayer
    from snapkv.methods.base import Method

    method = build_method(name, budget=BUDGET, **params)
    checked = []
    original = CompressibleLayer.evict_in_place

    def checking(self, victims):
        base = Method.victims(method, self)
        one_slot = isinstance(victims, int) or (name == "tova" and batch > 1)  # TOVA's rows differ
        checked.append(one_slot and bool((base == victims).all()))
        return original(self, victims)

    monkeypatch.setattr(CompressibleLayer, "evict_in_place", checking)
    generate_ids(tiny_model("llama"), random_ids(prompt, batch=batch), None, method, max_new_tokens=new)
    assert len(checked) == 3 * evictions and all(checked)


@pytest.mark.parametrize(
    "name,params,per_step",
    [
        ("h2o", dict(budget=BUDGET), True),
        ("h2o", dict(budget=BUDGET, evict_during_decode=False), False),
        ("tova", dict(budget=BUDGET), True),
        ("tova", dict(budget=BUDGET, evict_during_decode=False, decode_schedule=dict(interval=2)), False),
        ("knorm", dict(budget=BUDGET, evict_during_decode=True), True),
        ("knorm", dict(budget=BUDGET), False),
        ("streamingllm", dict(budget=BUDGET), True),
        ("snapkv", dict(budget=BUDGET, window=8, decode_schedule=dict(interval=1)), False),
    ],
)
def test_evict_during_decode_is_the_every_step_schedule(name, params, per_step):
    """One decode-time mechanism (`Method.decode_schedule`): the flat `evict_during_decode` switch is
    stored as the per-step schedule (interval 1, back to the layer's budget); `params()` still names
    it by the switch, so config hashes do not move, and a copy of the method (its schedule passed
    back in) is the same method."""
    method = build_method(name, **params)
    steps = method.decode_schedule
    assert steps.per_step is per_step and isinstance(steps, EveryStep) is per_step
    if per_step:
        assert (steps.interval, steps.buffer, steps.target, steps.window) == (1, 0, None, None)
        assert "decode_schedule" not in method.params()
    assert dataclasses.replace(method) == method
    if per_step and name != "streamingllm":  # the switch turned off again: no schedule left behind
        off = dataclasses.replace(method, evict_during_decode=False)
        assert off.decode_schedule == DecodeSchedule() and not off.decode_schedule.per_step


def test_per_step_eviction_and_a_decode_schedule_are_refused_together():
    with pytest.raises(ValueError, match="already evicts while decoding"):
        build_method("tova", budget=BUDGET, decode_schedule=dict(interval=2))
