"""Compression inside unmodified transformers models: wrapped attention functions + a session.

The stock `sdpa`, `flash_attention_2` and `eager` attention functions are wrapped in place (names
kept: a registered name containing "flash" would be treated as a Hub kernel). The wrapper receives
the model's own post-RoPE (post-QK-norm) queries and the layer's cached K/V, so no per-model
re-projection of queries is needed. It is inert unless a `Session` is active, and the wrappers are
installed only while one is (removed in `finally`). An override another library set on the shared
`ALL_ATTENTION_FUNCTIONS` instance (its local mapping, which models look up before the class-wide
one; kvpress patches every entry there at import) is wrapped too, around that override: without it
the model would call the override and never reach the wrapper, and nothing would be compressed.

After the attention of a compressible layer the session lets the method observe the queries and,
at the end of prefill, compress that layer's cache right away: only one layer's full K/V is alive
at a time during a single-pass prefill.

Left-padded batches (`apply` reads each forward's 2-D `attention_mask`): the method's hooks run per
row on the row's real entries and padded layers get a mask built from their kept slots
(`snapkv.padding`). A method may replace the model's attention (H2O's fused prefill) only where
the call is plain scaled softmax: no logit soft-capping, no attention sinks, no padding.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from snapkv import padding
from snapkv.cache import CompressedCache, CompressibleLayer
from snapkv.forward import cache_kwarg, clock, stepper
from snapkv.methods.base import Method, OwnAttention, OwnPass, check_model_generate

_ACTIVE: ContextVar[Session | None] = ContextVar("snapkv_session", default=None)
_WRAPPED = ("sdpa", "flash_attention_2", "eager")
_install_lock = threading.Lock()
_install_count = 0
_originals: dict[str, object] = {}
_local_originals: dict[str, object] = {}  # overrides in ALL_ATTENTION_FUNCTIONS' local mapping


class Session:
    """One compressed generation: the method, the cache it compresses, and the prefill phase.

    `phase`: "auto" (a layer's first forward is its whole prefill: `model.generate`), "prefill"
    (a non-final chunk of a chunked prefill: observe only), "final" (the last prefill chunk:
    compress after it), "decode", "score" (a method's own pass after the prefill, `after_prefill`:
    the attention calls reach only `method.observe`; the method restores the cache after it).
    """

    def __init__(self, model, method: Method, cache: CompressedCache | None = None):
        self.model = model
        self.method = method
        self.cache = cache
        self.phase = "auto"
        # The current forward's 2-D padding mask `[batch, length]` (None: no padding), set by
        # `apply` from the forward's `attention_mask` (see snapkv.padding).
        self.padding: torch.Tensor | None = None
        # Whether the method computed the current forward's attention itself (`OwnAttention`) and
        # took its statistics from it then: its `observe` is skipped.
        self.attended = False
        # `apply`: whether the current forward is the one that prefills the cache.
        self.prefilling = False
        method.post_init_from_model(model)

    # Called by the attention wrapper, after the layer's attention ran.
    def after_attention(
        self, module, layer: CompressibleLayer, query: torch.Tensor, key: torch.Tensor
    ) -> None:
        method = self.method
        padded = layer.pads is not None
        schedule = method.decode_schedule
        # What the decode schedule scores with, from every forward: the window's queries, or (per-step
        # eviction, `EveryStep`) the method's running scores, which `observe` keeps.
        if schedule.on and not schedule.per_step:
            layer.remember_queries(query, schedule.window or method.min_last_chunk)
        if layer.state in ("empty", "prefilling"):
            if self.phase == "prefill":
                if padded:
                    padding.observe_rows(method, layer, query, module)
                else:
                    self.observe(module, layer, query, key)
                layer.state = "prefilling"
                return
            layer.before_compress()  # quantized storage that is pruned after quantizing (snapkv.kv_quant)
            if padded:  # each row on its own real entries (snapkv.padding)
                padding.compress_prefill_rows(method, layer, query, module)
            else:
                self.observe(module, layer, query, key)
                method.compress_prefill(layer, query, key, module)
            layer.state = "ready"
        else:
            layer.decode_entries.append(layer.entries_now())  # what this forward attended to
            if schedule.per_step:
                if padded:
                    padding.observe_rows(method, layer, query, module)
                else:
                    self.observe(module, layer, query, key)
            if schedule.on:
                self.scheduled_step(module, layer, query.shape[2])

    def observe(self, module, layer: CompressibleLayer, query: torch.Tensor, key: torch.Tensor) -> None:
        """`method.observe` of an unpadded layer's forward, unless the method computed that
        forward's attention itself and scored it from the same computation (`attended`)."""
        if not self.attended:
            self.method.observe(layer, query, key, module)

    def after_prefill(self, ids: torch.Tensor) -> None:
        """Run the method's own pass (`OwnPass.after_prefill`) on the prefilled prompt `ids`
        `[batch, n]` (phase "score" meanwhile) and record its wall time (device synchronized) as
        `cache.scoring_s` (~0 for a method without one)."""
        model, cache = self.model, self.cache
        forward = stepper(model, cache)
        phase, self.phase = self.phase, "score"
        t0 = clock(model.device)
        try:
            if isinstance(self.method, OwnPass):
                self.method.after_prefill(ids, cache, forward)
        finally:
            self.phase = phase
        cache.scoring_s = clock(model.device) - t0

    def scheduled_step(self, module, layer: CompressibleLayer, fed: int) -> None:
        """The one decode-time mechanism (`Method.decode_schedule`): count the `fed` tokens of a
        forward after the prefill; every `interval` tokens, run the method's scheduled compression
        (`compress_decode`) with the window's queries, or on per-step eviction (`EveryStep`,
        interval 1) with its running scores. `count_from="start"`: a step whenever the tokens before
        this forward, prompt included, are a multiple of `interval` (padded rows count their pads,
        as R-KV's length does). `decode_compressions` counts the window's compressions only (per-step
        eviction's rows always said 0: its evictions are `decode_evicted`)."""
        method = self.method
        schedule = method.decode_schedule
        if schedule.count_from == "start":
            if (layer.seen - fed) % schedule.interval:
                return
        else:
            layer.since_schedule += fed
            if layer.since_schedule < schedule.interval:
                return
            layer.since_schedule = 0
        if layer.pads is not None:
            before = layer.row_entries()
            pruned = padding.compress_decode_rows(method, layer, layer.window_queries, module)
            evicted = float((before - layer.row_entries()).double().mean())
        else:  # every row holds `stored` entries: plain ints, no tensor ops on every step
            before = layer.stored
            pruned = method.compress_decode(layer, layer.window_queries, module)
            evicted = float(before - layer.stored)
        if pruned:
            if not schedule.per_step:
                layer.decode_compressions.append(layer.seen)
            layer.decode_evicted += evicted

    def note_padding(self, layer: CompressibleLayer, q: int) -> None:
        """Record the prompt's left padding on `layer` (its first forward) from the current
        forward's 2-D mask; ValueError for padding anywhere else (see snapkv.padding)."""
        mask = self.padding
        if mask is None:
            return
        if layer.state == "empty":
            if mask.shape[-1] != layer.seen:
                raise ValueError(
                    f"the attention mask covers {mask.shape[-1]} tokens, the layer's cache {layer.seen}"
                )
            pads = padding.left_pads(mask)
            layer.pads = layer.prompt_pads = None if pads is None else pads.to(layer.keys.device)
        elif not bool(mask[:, -q:].bool().all()):
            raise ValueError(
                "padding after the prompt (a 0 in the attention mask of a later forward) is not "
                "supported on a compressed cache"
            )

    def layer_for(self, module) -> CompressibleLayer | None:
        cache = self.cache
        idx = getattr(module, "layer_idx", None)
        if cache is None or idx is None or idx >= len(cache.layers):
            return None
        layer = cache.layers[idx]
        return layer if isinstance(layer, CompressibleLayer) else None


def _fix_mask(attention_mask, query: torch.Tensor, key: torch.Tensor, impl: str):
    """A mask sized for this layer when its stored length differs from what the model's shared
    mask was built for (per-layer budgets), or when sdpa would otherwise fall back to its
    top-left-aligned `is_causal`: every stored entry visible, causal inside the incoming block."""
    q, k = query.shape[2], key.shape[2]
    if impl.startswith("flash"):
        return attention_mask  # flash-attn's causal mask is bottom-right aligned: already right
    needs = (attention_mask is None and 1 < q < k) or (
        isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != k
    )
    if not needs:
        return attention_mask
    visible = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)
    if impl == "sdpa":
        return visible[None, None]
    mask = torch.zeros(q, k, dtype=query.dtype, device=query.device)
    return mask.masked_fill(~visible, torch.finfo(query.dtype).min)[None, None]


def _plain_causal(attention_mask, query: torch.Tensor, layer: CompressibleLayer) -> bool:
    """Whether a prefill chunk's mask is exactly causal over the layer's positions (no padding, no
    sliding window), so a method may compute the attention itself."""
    if attention_mask is None:
        return True  # transformers drops the mask only when it is purely causal
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        return False
    q = query.shape[2]
    qpos = torch.arange(layer.seen - q, layer.seen, device=query.device)
    causal = layer.positions[0, 0][None, :] <= qpos[:, None]  # [q, K]; uncompressed: all heads alike
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return allowed.shape[-2:] == causal.shape and bool((allowed == causal).all())


def _padding_mask(attention_mask, query: torch.Tensor, layer: CompressibleLayer, impl: str) -> bool:
    """Whether the mask of a layer's first forward hides tokens (padding) rather than being causal."""
    if attention_mask is None:
        return False
    if impl.startswith("flash"):  # flash-attn gets the 2-D padding mask itself
        return attention_mask.dim() == 2 and not bool(attention_mask.bool().all())
    return not _plain_causal(attention_mask, query, layer)


def _plain_softmax(kwargs) -> bool:
    """Whether the model's attention call is plain scaled softmax: no logit soft-capping (Gemma 2),
    no attention sinks (gpt-oss `s_aux`), no sliding window. Only then may a method replace it."""
    get = kwargs.get  # called for every layer and step: plain lookups, no generator
    return get("softcap") is None and get("s_aux") is None and get("sliding_window") is None


def _model_eager(module):
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"no eager_attention_forward next to {type(module).__name__}")
    return fn


def _make_wrapper(impl: str, original):
    @functools.wraps(original if callable(original) else _make_wrapper)
    def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
        fn = _model_eager(module) if impl == "eager" else original
        session = _ACTIVE.get()
        layer = session.layer_for(module) if session is not None else None
        if layer is None:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        session.note_padding(layer, query.shape[2])
        if (
            layer.pads is None
            and layer.state == "empty"
            and _padding_mask(attention_mask, query, layer, impl)
        ):
            raise ValueError(
                "a padding attention mask reached a compressed layer outside snapkv.apply: pass "
                "left-padded batches through `with snapkv.apply(model, method): model.generate(...)`"
            )
        # What the model's attention applies beyond scaled softmax; scores must honour it too.
        layer.softcap, layer.sinks = kwargs.get("softcap"), kwargs.get("s_aux")
        session.attended = False
        if layer.per_head:
            # Per-head lengths (snapkv.headwise, Ada-KV): the layer attends over its own layout
            # (padded + validity mask, or flat varlen); the model's shared mask does not apply.
            out = layer.attend(module, query, key, value, fn, impl, *args, **kwargs)
        else:
            out = None
            own = session.method if isinstance(session.method, OwnAttention) else None
            plain = own is not None and layer.pads is None and _plain_softmax(kwargs)
            if (
                layer.state in ("empty", "prefilling")
                and plain
                and _plain_causal(attention_mask, query, layer)
            ):
                fused = own.prefill_attention(layer, query, key, value, module)
                out = None if fused is None else (fused, None)
            elif layer.state == "ready" and plain and query.shape[2] == 1 and session.phase != "score":
                fused = own.decode_attention(layer, query, key, value, module)
                out = None if fused is None else (fused, None)
            session.attended = out is not None
            if out is None:
                if layer.pads is not None:  # the mask follows the kept entries, not the 2-D mask
                    if impl.startswith("flash"):  # flash kernels take no arbitrary mask
                        fn = sdpa_attention_forward
                    attention_mask = padding.attention_mask(layer, query, impl)
                else:
                    attention_mask = _fix_mask(attention_mask, query, key, impl)
                out = fn(module, query, key, value, attention_mask, *args, **kwargs)
        if session.phase == "score":  # the method's own pass (rolled back by the method): observed only
            session.method.observe(layer, query, key, module)
        else:
            session.after_attention(module, layer, query, key)
        return out

    wrapped.__snapkv_wrapper__ = True
    return wrapped


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Install the attention wrappers for the duration (re-entrant; removed when the last exits)."""
    global _install_count
    mapping = AttentionInterface._global_mapping
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    with _install_lock:
        if _install_count == 0:
            for impl in _WRAPPED:
                _originals[impl] = mapping.get(impl)
                mapping[impl] = _make_wrapper(impl, mapping.get(impl))
                # eager: the wrapper calls the model's own eager function, whatever is registered
                if impl != "eager" and callable(local.get(impl)):
                    _local_originals[impl] = local[impl]
                    local[impl] = _make_wrapper(impl, local[impl])
        _install_count += 1
    try:
        yield
    finally:
        with _install_lock:
            _install_count -= 1
            if _install_count == 0:
                for impl in _WRAPPED:
                    if _originals.get(impl) is None:
                        mapping.pop(impl, None)
                    else:
                        mapping[impl] = _originals[impl]
                for impl, fn in _local_originals.items():
                    local[impl] = fn
                _originals.clear()
                _local_originals.clear()


def hooks_installed() -> bool:
    mappings = (AttentionInterface._global_mapping, ALL_ATTENTION_FUNCTIONS._local_mapping)
    return any(getattr(f, "__snapkv_wrapper__", False) for m in mappings for f in m.values())


@contextlib.contextmanager
def session(model, method: Method, cache: CompressedCache | None = None) -> Iterator[Session]:
    """Activate `method` on `model` for the duration (wrappers installed, session current)."""
    s = Session(model, method, cache)
    token = _ACTIVE.set(s)
    try:
        with installed():
            yield s
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Run forwards with no session current, inside a compressed generation: the wrappers pass every
    call straight to the model's attention, so a side computation (the benchmark's reference
    forward, `eval.bench.clock.Reference`) neither reads nor changes the session's cache."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def apply(model, method: Method) -> Iterator[Session]:
    """Apply `method` to `model.generate` (and direct forwards given a `CompressedCache`).

    `model.generate(...)` inside the block gets a fresh `CompressedCache` unless one is passed;
    its prefill forward compresses each layer (then `OwnPass.after_prefill` runs on the forward's
    `input_ids`), later forwards decode (and evict, for methods that do). Positions stay original,
    so generate's own position bookkeeping is right.
    """
    check_model_generate(method)
    kw = cache_kwarg(model)
    original_generate = model.generate

    with session(model, method) as s:

        def hook(mod, args, kwargs):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is not None and not isinstance(cache, CompressedCache):
                raise ValueError(
                    f"method {method.name!r} needs a snapkv.CompressedCache, got {type(cache).__name__}"
                )
            s.cache = cache
            mask = kwargs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() != 2:
                raise ValueError(
                    f"snapkv.apply needs a 2-D padding attention mask, got shape {tuple(mask.shape)}"
                )
            has_pads = isinstance(mask, torch.Tensor) and not bool(mask.bool().all())
            s.padding = mask if has_pads else None
            # The forward that prefills the cache: some compressible layer has not seen a token yet.
            s.prefilling = cache is not None and any(
                layer.state == "empty" for _, layer in cache.compressible_layers()
            )

        def after(mod, args, kwargs, output):
            if not s.prefilling or s.phase == "score":
                return
            s.prefilling = False
            ids = kwargs.get("input_ids", args[0] if args else None)
            if not isinstance(ids, torch.Tensor):
                raise ValueError(f"method {method.name!r} needs the prompt's input_ids, got inputs_embeds")
            s.after_prefill(ids)

        @functools.wraps(original_generate)
        def generate(*args, **kwargs):
            if kwargs.get(kw) is None and kwargs.get("past_key_values") is None:
                kwargs[kw] = CompressedCache(model.config, layer_factory=method.cache_layer)
            return original_generate(*args, **kwargs)

        handle = model.register_forward_pre_hook(hook, with_kwargs=True)
        done = model.register_forward_hook(after, with_kwargs=True)
        model.generate = generate
        try:
            yield s
        finally:
            handle.remove()
            done.remove()
            del model.generate  # back to the class's method
