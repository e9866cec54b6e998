"""Methods own their needs through explicit hooks on `Method`, or on a mixin where one method or two
need them (`OwnPass`, `OwnAttention`, `GenerateCheck`); the generic code never probes a method or a
cache layer for attributes."""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import random_ids, tiny_model

import snapkv
from snapkv import generate_ids, prefill
from snapkv.cache import CompressibleLayer
from snapkv.methods import METHODS, Method, build_method, check_model_generate, post_init_from_tokenizer
from snapkv.methods.base import GenerateCheck, KeptOrder, OwnAttention, OwnPass
from snapkv.methods.compose import ScorerWrapper

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ["snapkv/hooks.py", "snapkv/generation.py", "snapkv/cache.py", "snapkv/methods/base.py"]


@dataclass
class _ProbeState:
    chunks: list[int] = field(default_factory=list)
    pruned: bool = False


@dataclass
class _Probe(GenerateCheck, Method):
    """Test-only method (not registered) that uses hooks and declarations of `Method` (its last
    chunk's length: `observation_window`), and `GenerateCheck`'s hook."""

    name = "probe"
    observation_window = "last_chunk"
    budget: int | None = 32
    last_chunk: int = 20
    refuse_generate: bool = False

    models = ()  # what post_init_from_model saw (not a field)

    def post_init_from_model(self, model) -> None:
        self.models = (*self.models, model)

    def check_model_generate(self) -> None:
        if self.refuse_generate:
            raise ValueError("probe refuses model.generate")

    def observe(self, layer, query, key, module) -> None:
        if layer.method_state is None:
            layer.method_state = _ProbeState()
        layer.method_state.chunks.append(query.shape[2])

    def score(self, layer, query, key, module) -> torch.Tensor:
        return -key.float().norm(dim=-1)

    def prune(self, layer, scores, budget) -> None:
        super().prune(layer, scores, budget)
        layer.method_state.pruned = True


def test_a_method_defined_outside_the_package_uses_every_hook():
    model = tiny_model("llama")
    ids = random_ids(90)
    method = _Probe()
    _, res = generate_ids(model, ids, None, method, max_new_tokens=2, chunk_size=24)
    assert method.models == (model,)  # post_init_from_model: once per session
    assert res.compressed and res.kv_tokens == 32
    # Chunks of 24: the last one (18 < min_last_chunk = 20) merges into the one before.
    cache = snapkv.CompressedCache(model.config, layer_factory=method.cache_layer)
    with torch.no_grad(), snapkv.hooks.session(model, method, cache) as s:
        prefill(model, ids, cache, session=s, chunk_size=24)
    for _, layer in cache.compressible_layers():
        assert layer.method_state == _ProbeState(chunks=[24, 24, 42], pruned=True)
        layer.reset()
        assert layer.method_state is None
    with pytest.raises(ValueError, match="probe refuses"):
        with snapkv.apply(model, _Probe(refuse_generate=True)):
            pass


def test_chunked_prefill_last_chunk_follows_the_methods_declared_minimum():
    model = tiny_model("llama")
    ids = random_ids(90)
    seen = []

    class _Spy(_Probe):
        def observe(self, layer, query, key, module) -> None:
            super().observe(layer, query, key, module)
            if layer.index == 0:
                seen.append(query.shape[2])

    for last, want in [(1, [24, 24, 24, 18]), (20, [24, 24, 42]), (50, [24, 66])]:
        seen.clear()
        generate_ids(model, ids, None, _Spy(last_chunk=last), max_new_tokens=1, chunk_size=24)
        assert seen == want


def _probes(path: str) -> list[str]:
    tree = ast.parse((ROOT / path).read_text())
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
        ):
            target = ast.unparse(node.args[0]) if node.args else ""
            if "method" in target or "layer" in target:
                found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", GENERIC)
def test_no_attribute_probing_of_methods_or_cache_layers_in_generic_code(path):
    assert _probes(path) == []


def test_layer_declares_what_the_hooks_read():
    layer = CompressibleLayer()
    assert layer.per_head is False and layer.method_state is None


@dataclass
class _PassProbe(OwnPass, Method):
    """Test-only method whose `after_prefill` runs a pass over the model and rolls it back."""

    name = "pass_probe"
    budget: int | None = None

    calls = ()  # prompt lengths after_prefill saw (not fields)
    observed = ()  # (layer, queries, keys) of the attention calls during the pass
    _in_pass = False

    def after_prefill(self, ids, cache, forward) -> None:
        mark = cache.checkpoint()
        self._in_pass = True
        try:
            forward(ids[:, :5])
        finally:
            self._in_pass = False
        cache.rollback(mark)
        cache.release()
        self.calls = (*self.calls, ids.shape[1])

    def observe(self, layer, query, key, module) -> None:
        if self._in_pass:
            self.observed = (*self.observed, (layer.index, query.shape[2], key.shape[2]))


def test_after_prefill_pass_reaches_observe_only_and_is_timed_on_every_entry_point():
    model = tiny_model("llama")
    ids = random_ids(40)
    want, _ = generate_ids(model, ids, None, snapkv.build_method("full"), max_new_tokens=4)
    method = _PassProbe()
    out, res = generate_ids(model, ids, None, method, max_new_tokens=4)
    assert torch.equal(out, want)  # the pass left the cache as the prefill did
    assert method.calls == (40,) and res.scoring_s > 0
    assert method.observed == tuple((i, 5, 45) for i in range(model.config.num_hidden_layers))
    cache = snapkv.compress_context(model, ids, method)
    assert method.calls == (40, 40) and cache.scoring_s > 0 and cache.get_seq_length() == 40
    with snapkv.apply(model, method), torch.no_grad():
        gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert method.calls == (40, 40, 40)  # once, after the prefill forward
    assert torch.equal(gen[:, 40:], want)


def test_hooks_of_one_method_are_on_mixins_and_asked_only_of_the_methods_that_are_one():
    for name in ("check_model_generate", "post_init_from_tokenizer", "after_prefill", "prefill_attention"):
        assert not hasattr(Method, name), name
    seen = []

    class _Text(_PassProbe):
        def post_init_from_tokenizer(self, tokenizer, chat_template: bool) -> None:
            seen.append((tokenizer, chat_template))

    post_init_from_tokenizer(_Text(), "tok", True)
    post_init_from_tokenizer(_Probe(), "tok", False)  # no pass of its own: nothing asked
    assert seen == [("tok", True)]
    check_model_generate(build_method("snapkv", budget=16, window=4))
    model = tiny_model("llama")
    ids = torch.cat([random_ids(30, seed=1), random_ids(30, seed=2)])
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    refused = r"^positions='compacted' is only supported by snapkv.generate, not model.generate$"
    compacted = build_method("streamingllm", budget=24, n_sink=4, positions="compacted")
    with pytest.raises(ValueError, match=refused):
        with snapkv.apply(model, compacted):
            pass
    with pytest.raises(ValueError, match=refused):  # a left-padded batch supports what generate does
        snapkv.compress_context(model, ids, compacted, attention_mask=mask)
    snapkv.compress_context(
        model, ids, build_method("streamingllm", budget=24, n_sink=4), attention_mask=mask
    )


# What a method may define: the hooks, its declarations (class attributes), and the few overrides of
# the base class's templates that `Method`'s docstring names (the per-step eviction's one slot,
# found without scores; Expected Attention's statistics of a scheduled step's queries).
HOOKS = {
    "validate",
    "post_init_from_model",
    "protected",
    "observe",
    "score",
    "decode_score",
    "layer_budget",
    "cache_layer",
    "prune",
    "compress",
    "upgrade_params",
}
DECLARATIONS = {
    "name",
    "checks",
    "legacy_params",
    "left_out_at_default",
    "schedulable",
    "observation_window",
    "decode_window_floor",
    "prompt_state",
}
TEMPLATE_OVERRIDES = {
    "streamingllm": {"victims", "evicts_in_place"},
    "tova": {"victims"},
    "expected_attention": {"compress_decode"},
    "adakv_expected_attention": {"compress_decode"},
}
# A wrapper around a scorer takes what the base class derives from a method's declarations from
# its scorer instead (`snapkv.methods.compose`).
WRAPPER_DELEGATES = {"min_last_chunk", "protected_tail", "params"}


def _overrides(cls: type, stop: type) -> dict[str, type]:
    """The attributes of `Method` that `cls` or a class between it and `stop` defines (fields aside)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    found = {}
    for klass in cls.__mro__:
        if klass is stop or klass is Method:
            break
        if klass in (OwnAttention, OwnPass, GenerateCheck, KeptOrder):
            continue
        for attr in vars(klass):
            if attr in fields or attr in ("__doc__", "__module__", "__annotations__", "__dict__"):
                continue
            if hasattr(Method, attr) and (not attr.startswith("__") or attr == "__post_init__"):
                found.setdefault(attr, klass)
    return found


@pytest.mark.parametrize("name", sorted(METHODS))
def test_methods_override_only_the_hooks(name):
    """Every registered method defines hooks and declarations only; the base class owns the rest."""
    cls = METHODS[name]
    allowed = HOOKS | DECLARATIONS | TEMPLATE_OVERRIDES.get(name, set())
    found = _overrides(cls, ScorerWrapper)
    assert {attr: k.__name__ for attr, k in found.items() if attr not in allowed} == {}


def test_the_scorer_wrapper_overrides_hooks_and_its_delegates_only():
    found = _overrides(ScorerWrapper, Method)
    assert set(found) - HOOKS - DECLARATIONS - WRAPPER_DELEGATES == set()
