"""Compress once, ask many: `CompressedCache.checkpoint()` / `rollback(mark)` and `snapkv.answer`.

After answering one question and rolling back, a second question's tokens and logits must be
bit-identical to answering it on a deep copy of the cache taken right after compression, for every
method of the catalogue, on a GQA model and a hybrid one (Gemma 3: sliding layers uncompressed).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from cache_paths import entry_tier
from conftest import random_ids, tiny_model
from method_catalogue import CATALOGUE, ids
from test_padding import left_padded
from transformers.cache_utils import DynamicSlidingWindowLayer

from snapkv import CompressibleLayer, answer, build_method, compress_context, generate_ids
from snapkv.cache import LayerState
from snapkv.forward import cache_kwarg
from snapkv.hooks import session

PROMPT = 96  # the catalogue's budgets (40) evict from it
NEW = 4
Q1, Q2 = random_ids(5, seed=11), random_ids(6, seed=12)
# StreamingLLM's compacted positions are not a catalogue entry (snapkv.generate only); rollback must
# undo their re-rotation too.
ENTRIES = CATALOGUE + [("streamingllm", dict(budget=40, n_sink=4, positions="compacted"))]


@functools.cache
def model(arch: str):
    return tiny_model(arch)


@functools.cache
def context(n: int = PROMPT) -> torch.Tensor:
    return random_ids(n)


def ask(m, cache, method, question, **kw):
    return answer(m, cache, question, method, max_new_tokens=NEW, keep_logits=True, **kw)


def assert_same_answer(a, b):
    assert torch.equal(a.ids, b.ids)
    assert len(a.logits) == len(b.logits)
    for step, (x, y) in enumerate(zip(a.logits, b.logits)):
        assert torch.equal(x, y), f"step {step}"


def assert_same_value(x, y, where: str) -> None:
    """Equal tensors (values, shapes), recursively through dicts, lists and tuples; == otherwise."""
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), where
        assert x.shape == y.shape and torch.equal(x, y), where
    elif isinstance(x, dict) and isinstance(y, dict):
        assert x.keys() == y.keys(), where
        for k in x:
            assert_same_value(x[k], y[k], f"{where}[{k!r}]")
    elif isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        assert type(x) is type(y) and len(x) == len(y), where
        for k, (u, v) in enumerate(zip(x, y)):
            assert_same_value(u, v, f"{where}[{k}]")
    else:
        assert x == y, f"{where}: {x!r} != {y!r}"


def layer_attrs(layer) -> dict:
    """A layer's attributes, a compressible layer's bookkeeping (`st`, a `LayerState`) field by field."""
    attrs = dict(vars(layer))
    st = attrs.pop("st", None)
    if st is not None:
        attrs.update((f.name, getattr(st, f.name)) for f in dataclasses.fields(st))
    return attrs


def assert_same_state(cache, ref):
    """Every layer holds what `ref`'s does: equal tensors (values, shapes), equal bookkeeping (the
    layers' shared dict included: ChunkKV's layer-wise index reuse keeps its choice there)."""
    assert cache.get_seq_length() == ref.get_seq_length()
    for i, (a, b) in enumerate(zip(cache.layers, ref.layers)):
        assert type(a) is type(b)
        attrs_a, attrs_b = layer_attrs(a), layer_attrs(b)
        for name in sorted((set(attrs_a) | set(attrs_b)) - {"_mark", "method_state"}):
            assert_same_value(attrs_a.get(name), attrs_b.get(name), f"layer {i}.{name}")
        assert attrs_a.get("method_state") == attrs_b.get("method_state")


def feed(m, cache, method, tokens: torch.Tensor) -> None:
    """Forward `tokens` `[batch, q]` on the cache at its next positions (a decode step)."""
    with torch.inference_mode(), session(m, method, cache) as s:
        s.phase = "decode"
        start = cache.get_seq_length()
        pos = torch.arange(start, start + tokens.shape[1])[None].expand(tokens.shape[0], -1)
        m(input_ids=tokens, position_ids=pos, use_cache=True, logits_to_keep=1, **{cache_kwarg(m): cache})


# In the fast tier: on Llama the first entry of each mechanism (a rollback restores the cache a method
# writes, whatever its switches chose), on both architectures each cache path's representative and
# the compacted positions (refused on Gemma 3); the other entries in the slow tier
# (tests/cache_paths.py).
ROLLBACK_CASES = [
    pytest.param(
        arch,
        name,
        params,
        id=f"{case}-{arch}",
        marks=() if params.get("positions") == "compacted" else entry_tier(arch, name, params),
    )
    for (name, params), case in zip(ENTRIES, ids(ENTRIES))
    for arch in ("llama", "gemma3")
]


@pytest.mark.parametrize("arch,name,params", ROLLBACK_CASES)
def test_second_question_after_rollback_equals_a_fresh_copy(arch, name, params):
    m, method = model(arch), build_method(name, **params)
    if arch == "gemma3" and params.get("positions") == "compacted":
        # Gemma 3 has no single rotary embedding to re-rotate with: the library refuses it.
        with pytest.raises(ValueError, match="rotary|RoPE|rope"):
            compress_context(m, context(), method)
        return
    cache = compress_context(m, context(), method)
    fresh = copy.deepcopy(cache)
    ask(m, cache, method, Q1)
    assert_same_state(cache, fresh)
    # The next question's positions start right after the context (compacted: after the kept slots).
    compacted = params.get("positions") == "compacted"
    assert cache.get_seq_length() == (params["budget"] if compacted else PROMPT)
    assert_same_answer(ask(m, cache, method, Q2), ask(m, fresh, method, Q2))
    assert_same_state(cache, fresh)


QUERY_AGNOSTIC = [CATALOGUE[i] for i in (1, 5, 8, 9, 12)] + [ENTRIES[-1]]


@pytest.mark.parametrize("name,params", QUERY_AGNOSTIC, ids=ids(QUERY_AGNOSTIC))
def test_answer_equals_query_agnostic_generation(name, params):
    """compress_context + answer run the same forwards as generate_ids(query_aware=False)."""
    m, method = model("llama"), build_method(name, **params)
    want, res = generate_ids(
        m, context(), Q2, method, query_aware=False, max_new_tokens=NEW, keep_logits=True
    )
    got = ask(m, compress_context(m, context(), method), method, Q2)
    assert torch.equal(got.ids, want)
    assert all(torch.equal(x, y) for x, y in zip(got.logits, res.logits))


def test_chunked_context_equals_one_pass_for_append_only_methods():
    m, method = model("llama"), build_method("snapkv", budget=40, window=8)
    one = ask(m, compress_context(m, context(), method), method, Q1)
    chunked = ask(m, compress_context(m, context(), method, chunk_size=32), method, Q1)
    assert torch.equal(one.ids, chunked.ids)


PADDED = [
    ("snapkv", dict(budget=40, window=8, kernel_size=5)),
    ("adakv", dict(budget=40, window=8, layout="varlen")),
    ("adakv", dict(budget=40, window=8, layout="padded")),
    ("h2o", dict(budget=40, evict_during_decode=True)),
    ("streamingllm", dict(budget=40, n_sink=4)),
]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("name,params", PADDED, ids=ids(PADDED))
def test_padded_batch_rollback_equals_a_fresh_copy(arch, name, params):
    """Two left-padded rows (96 and 36 tokens: the short one is kept whole, then H2O / StreamingLLM
    evict from it while answering): exact after rollback, and each row answers as if alone."""
    m, method = model(arch), build_method(name, **params)
    rows = [context()[0], random_ids(36, seed=3)[0]]
    ctx, mask = left_padded(rows)
    q1, q2 = torch.cat([Q1, Q1.flip(1)]), torch.cat([Q2, Q2.flip(1)])
    cache = compress_context(m, ctx, method, attention_mask=mask)
    fresh = copy.deepcopy(cache)
    ask(m, cache, method, q1)
    assert_same_state(cache, fresh)
    second = ask(m, cache, method, q2)
    assert_same_answer(second, ask(m, fresh, method, q2))
    for r, row in enumerate(rows):
        alone = ask(m, compress_context(m, row[None], method), method, q2[r : r + 1])
        assert torch.equal(second.ids[r], alone.ids[0]), f"row {r}"
        for x, y in zip(second.logits, alone.logits):
            torch.testing.assert_close(x[r], y[0], atol=1e-5, rtol=1e-5)


def test_one_mark_serves_many_rollbacks():
    m, method = model("gemma3"), build_method("h2o", budget=40, evict_during_decode=True)
    cache = compress_context(m, context(), method)
    fresh = copy.deepcopy(cache)
    mark = cache.checkpoint()
    assert mark.seq_length == PROMPT
    for question in (Q1, Q2, torch.cat([Q1, Q2], 1)):
        feed(m, cache, method, question)
        feed(m, cache, method, question[:, :1])
        assert cache.get_seq_length() == PROMPT + question.shape[1] + 1
        cache.rollback(mark)
        assert_same_state(cache, fresh)


def tag_state(layer, tag: str) -> dict:
    """Set every field of `layer.st` to a value tagged `tag` that no default and no other tag equals
    and return them: a list for a list field, a dict for the method's state (both changeable in
    place), a string elsewhere; `seen` and `state` stay of a kind the checkpoint and the rollback
    check (ints that grow with every call, a lifecycle state)."""
    values = {}
    for f in dataclasses.fields(LayerState):
        old = getattr(layer.st, f.name)
        if f.name == "seen":
            new = old + 1
        elif f.name == "state":
            new = "ready" if tag == "marked" else f"{tag} state"
        elif f.name == "method_state":
            new = {tag: [f.name]}
        elif isinstance(old, list):
            new = [f"{tag} {f.name}"]
        else:
            new = f"{tag} {f.name}"
        setattr(layer.st, f.name, new)
        values[f.name] = copy.deepcopy(new)
    return values


def assert_state_is(layer, values: dict, where: str) -> None:
    for name, value in values.items():
        assert_same_value(getattr(layer.st, name), value, f"{where}: layer {layer.index}.{name}")


def test_rollback_restores_every_state_field():
    """Whatever the bookkeeping holds (`LayerState`, field by field, enumerated here), a rollback
    returns it to the marked value, also after the restored lists and method state were changed in
    place; and each field reads the same under its own name on the layer."""
    m, method = model("llama"), build_method("h2o", budget=40, evict_during_decode=True)
    cache = compress_context(m, context(), method)
    feed(m, cache, method, Q1)  # real decode bookkeeping beneath the tags
    layers = [layer for _, layer in cache.compressible_layers()]
    marked = [tag_state(layer, "marked") for layer in layers]
    mark = cache.checkpoint()
    for layer in layers:
        tag_state(layer, "changed")
    cache.rollback(mark)
    for layer, values in zip(layers, marked):
        assert_state_is(layer, values, "after a rollback")
        for name in values:
            assert getattr(layer, name) is getattr(layer.st, name), name
        layer.decode_compressions.append(-1)
        layer.decode_entries.append(-1.0)
        layer.method_state["marked"].append("changed in place")
    cache.rollback(mark)
    for layer, values in zip(layers, marked):
        assert_state_is(layer, values, "after a second rollback")


def test_reset_state_equals_a_fresh_layers():
    """`reset()` leaves no field of the bookkeeping as it was: each is what a new layer has."""
    m, method = model("llama"), build_method("h2o", budget=40, evict_during_decode=True)
    cache = compress_context(m, context(), method)
    feed(m, cache, method, Q1)
    for _, layer in cache.compressible_layers():
        tag_state(layer, "used")
        with torch.inference_mode():
            layer.reset()
        fresh = type(layer)(index=layer.index, num_layers=layer.num_layers).st
        assert_state_is(layer, {f.name: getattr(fresh, f.name) for f in dataclasses.fields(fresh)}, "reset")


def test_rollback_without_checkpoint_or_with_a_stale_mark_raises():
    m, method = model("llama"), build_method("snapkv", budget=40, window=8)
    cache = compress_context(m, context(), method)
    other = compress_context(m, context(), method)
    with pytest.raises(ValueError, match="without a checkpoint"):
        cache.rollback(other.checkpoint())
    with pytest.raises(ValueError, match="CacheMark"):
        cache.rollback(None)
    old = cache.checkpoint()
    with pytest.raises(ValueError, match="stale"):
        cache.rollback(other._mark)  # another cache's mark
    new = cache.checkpoint()
    with pytest.raises(ValueError, match="stale"):
        cache.rollback(old)
    ask(m, cache, method, Q1)  # answer() takes its own checkpoint: `new` is stale now
    with pytest.raises(ValueError, match="stale"):
        cache.rollback(new)
    mark = cache.checkpoint()
    # The cache's tensors were made under inference mode; some transformers versions reset a
    # layer by zeroing them in place, which only inference mode allows.
    with torch.inference_mode():
        cache.layers[0].reset()
    with pytest.raises(ValueError, match="stale"):
        cache.rollback(mark)
    with torch.inference_mode():
        cache.reset()
    with pytest.raises(ValueError, match="without a checkpoint"):
        cache.rollback(mark)
    with pytest.raises(ValueError, match="prefilled"):
        cache.checkpoint()  # nothing compressed yet
    with pytest.raises(ValueError, match="checkpoint"):
        other.layers[0].crop(-1)  # the refusal points at checkpoint/rollback


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


@pytest.mark.parametrize(
    "name,params",
    [
        ("full", {}),
        ("snapkv", dict(budget=40, window=8)),
        ("pyramidkv", dict(budget=40, window=8)),
        ("adakv", dict(budget=40, window=8, layout="varlen")),
        ("adakv", dict(budget=40, window=8, layout="padded")),
        ("h2o", dict(budget=40, evict_during_decode=False)),
    ],
)
def test_append_only_layers_hold_nothing(name, params):
    m, method = model("llama"), build_method(name, **params)
    cache = compress_context(m, context(), method)
    cache.checkpoint()
    assert cache.mark_bytes() == 0
    assert ask(m, cache, method, Q1).rollback_bytes == 0
    assert cache.rollback_bytes == 0


def test_decode_eviction_holds_the_marked_entries_once():
    """H2O's original evicts at every step: the mark holds one copy of each layer's marked entries
    (keys, values, positions), the scores and kept indices at the mark; without eviction (budget >
    everything fed) only the scores, which change every step."""
    m = model("llama")
    method = build_method("h2o", budget=40, evict_during_decode=True)
    cache = compress_context(m, context(), method)
    layers = [layer for _, layer in cache.compressible_layers()]
    want = sum(_nbytes([x.keys, x.values, x.positions, x.scores, x.last_kept]) for x in layers)
    cache.checkpoint()
    assert cache.mark_bytes() == 0  # nothing copied before the first eviction
    assert ask(m, cache, method, Q1).rollback_bytes == want
    assert cache.mark_bytes() == 0  # rolled back: the layers hold the marked copies themselves
    roomy = build_method("h2o", budget=PROMPT + 20, evict_during_decode=True)
    cache = compress_context(m, context(), roomy)
    scores = sum(_nbytes([layer.scores]) for _, layer in cache.compressible_layers())
    assert scores > 0 and ask(m, cache, roomy, Q1).rollback_bytes == scores


def test_hybrid_model_holds_only_the_sliding_windows():
    m, method = model("gemma3"), build_method("snapkv", budget=40, window=8)
    cache = compress_context(m, context(), method)
    sliding = [layer for layer in cache.layers if isinstance(layer, DynamicSlidingWindowLayer)]
    assert sliding and not any(isinstance(layer, CompressibleLayer) for layer in sliding)
    want = sum(_nbytes(vars(layer).values()) for layer in sliding)
    assert want < cache.kv_bytes()
    assert ask(m, cache, method, Q1).rollback_bytes == want
