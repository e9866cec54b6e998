"""A transformers `DynamicCache` whose full-attention layers can be compressed per KV head.

Keys are cached after RoPE, so a kept key keeps its original position. What must change after
compression is the bookkeeping (docs/pitfalls.md, "Positions after eviction"): `get_seq_length()` has to keep returning the number
of tokens *seen* (so that `position_ids`, `generate()`'s input slicing and the causal mask stay
right), while `get_mask_sizes()` has to describe what is really *stored*. transformers' own
`DynamicSlidingWindowLayer` does exactly this; `CompressibleLayer` does it for arbitrary per-head
selections.

Compress once, ask many (`CompressedCache.checkpoint()` / `rollback(mark)`): a checkpoint taken
right after compression lets the cache return exactly (bit for bit) to that state after a question
was answered. Append-only layers need nothing but their lengths at the mark (the rollback is a crop);
only what decode-time eviction or a rolling window changes is kept (see `checkpoint`).
"""

from __future__ import annotations

import copy
import dataclasses
import operator

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from snapkv import compat
from snapkv import kv_quant as kvq
from snapkv.kv_quant import KVQuant

PACKS = (kvq.KiviPack, kvq.BackendPack)
# Decode-time slots allocated ahead of the stored entries (`CompressibleLayer._append`).
APPEND_ROOM = 64


@dataclasses.dataclass(slots=True, eq=False)  # eq: tensors do not compare to one bool
class LayerState:
    """A compressible layer's per-request bookkeeping: everything besides its stored entries that a
    checkpoint restores and `reset()` clears (`CompressibleLayer` documents the fields and exposes
    each under its own name). One object so that the checkpoint copies, the rollback restores and
    the reset replaces it whole: a field added here cannot be left out of any of them. Tensors are
    shared, never copied: none is modified in place (each change assigns a new one)."""

    seen: int = 0
    # "empty" -> "prefilling" (chunked prefill under way) -> "ready" (prefill done; decoding)
    state: str = "empty"
    compressed: bool = False
    compacted: bool = False
    pads: torch.Tensor | None = None  # [batch] leading slots without a real entry
    prompt_pads: torch.Tensor | None = None  # [batch] pads of the prompt
    last_kept: torch.Tensor | None = None  # indices of the last keep() (for re-rotation)
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    decode_evicted: float = 0.0
    # Decode schedules (`Method.decode_schedule`): the latest queries `[batch, heads, window,
    # head_dim]` (prompt and generated tokens), tokens fed since the prefill or the last
    # scheduled step, and `seen` at each scheduled compression that pruned this layer.
    window_queries: torch.Tensor | None = None
    since_schedule: int = 0
    decode_compressions: list[int] = dataclasses.field(default_factory=list)
    # Entries per KV head each forward after the prefill attended to (`entries_now`).
    decode_entries: list[float | torch.Tensor] = dataclasses.field(default_factory=list)
    # Per-layer state a method keeps beside its scores (an object of the method's own type,
    # e.g. Expected Attention's `QueryStats`); None until the method sets it.
    method_state: object | None = None
    # Positions `[start, end)` of the latest prompt's end that are never evicted (`Method.protect`,
    # set by `CompressedCache.protect` before the prompt is fed); None: nothing beyond the method's
    # own sinks / window.
    protected_span: tuple[int, int] | None = None
    # Quantized storage (`CompressibleLayer.kv_quant`): how many leading stored keys / values are
    # quantized (the rest: the full-precision residual), and the bytes of the quantized part of
    # quanto / hqq (codes, scales, zero points).
    quant_keys: int = 0
    quant_values: int = 0
    quant_bytes: int = 0
    # Packed storage (`KVQuant.packed`): the leading `quant_keys` keys / `quant_values` values as
    # codes, scales and zero points (`kvq.KiviPack` / `kvq.BackendPack`; never changed in place);
    # the layer's own tensors then hold only the full-precision residual after them.
    kpack: kvq.KiviPack | kvq.BackendPack | None = None
    vpack: kvq.KiviPack | kvq.BackendPack | None = None

    def snapshot(self) -> LayerState:
        """A copy that later changes of this state cannot reach: the lists copied (the hooks append
        to them), the method's state deep-copied (methods update it in place), tensors shared."""
        return dataclasses.replace(
            self,
            decode_compressions=list(self.decode_compressions),
            decode_entries=list(self.decode_entries),
            method_state=copy.deepcopy(self.method_state),
        )

    def tensors(self) -> list[torch.Tensor]:
        """The tensors among the fields (what a mark of this state keeps alive)."""
        values = (getattr(self, f.name) for f in dataclasses.fields(self))
        packs = [t for p in (self.kpack, self.vpack) if isinstance(p, PACKS) for t in p.tensors()]
        return [v for v in values if isinstance(v, torch.Tensor)] + packs


class LayerMark:
    """A compressible layer's state at a checkpoint (`CompressibleLayer.checkpoint`).

    `stored`: the layer's stored entries at the mark; `st`: a snapshot of its bookkeeping
    (`LayerState`) at the mark, `seen` the original length in it. `scores`: a reference to the
    accumulated scores `[batch, kv_heads, stored]` (only for layers whose method rescores while
    decoding, H2O; else the rollback crops them). `kv`: (keys, values, positions) of the marked
    entries, copied by the first decode-time eviction after the mark (copy-on-write; None while the
    layer only appended, when a crop restores it). `res`: with packed quantized storage, the
    layer's residual keys, values and its positions at the mark, by reference (packed storage never
    writes into them: a flush, an append or a pruning builds new tensors), the packs being in `st`.
    """

    def __init__(self, layer: CompressibleLayer):
        self.owner = layer  # row views of padded batches (shallow copies) share the mark, never own it
        self.stored = layer.stored
        self.st = layer.st.snapshot()
        self.has_scores = layer.scores is not None
        self.scores = layer.scores if layer.decode_eviction else None
        self.kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.res = (layer._k, layer._v, layer.positions) if layer.packed else None

    @property
    def seen(self) -> int:
        return self.st.seen

    def held(self) -> list[torch.Tensor]:
        """The tensors this mark keeps alive."""
        tensors = [self.scores, *(self.kv or ()), *(self.res or ())]
        return [t for t in tensors if isinstance(t, torch.Tensor)] + self.st.tensors()


def _state_field(name: str) -> property:
    """`layer.<name>` for the field `name` of `layer.st`, read and written (the getter is a C-level
    `attrgetter`: the hooks read these on every layer of every decode step)."""

    def set_field(layer: CompressibleLayer, value) -> None:
        setattr(layer.st, name, value)

    return property(operator.attrgetter(f"st.{name}"), set_field, doc=f"`st.{name}` (`LayerState`)")


class CompressibleLayer(DynamicLayer):
    """Cache layer of one full-attention layer, compressible per KV head.

    Stores `keys` / `values` `[batch, kv_heads, stored, head_dim]` and, beside them,
    `positions` `[batch, kv_heads, stored]` (the original token position of every stored entry,
    int64) and an optional per-entry `scores` `[batch, kv_heads, stored]` (fp32) that methods which
    accumulate attention (H2O) keep aligned with the entries. Every head of a layer stores the same
    number of entries (a uniform per-head budget).

    `seen` counts the tokens that went through the layer (the original sequence length); it is what
    `get_seq_length()` returns. `next_position` is the position the next token gets: `seen` with
    original positions, the stored length with StreamingLLM's compacted positions.

    Left-padded batches (`model.generate(ids, attention_mask=...)`, see `snapkv.padding`): `pads`
    `[batch]` (int64, None without padding) counts the leading slots of each row that hold no real
    entry (the prompt's pads, later the filler that keeps rows of equal length after compression);
    they are masked in attention and never scored. `prompt_pads` `[batch]` is the row's pad count in
    the prompt: a row's real position = stored position - prompt_pads.

    `softcap` / `sinks`: the attention logit soft-capping (Gemma 2) and the per-head sink logits
    `[heads]` (gpt-oss `s_aux`) the model's attention applies in this layer, recorded by the hooks
    so that scores honour them. `decode_evicted`: entries per KV head evicted while decoding (mean
    over batch rows).

    These and the rest of the per-request bookkeeping live in `st` (a `LayerState`, which lists
    them), so that a checkpoint, a rollback and a reset each handle all of it at once; the layer
    exposes every field under its own name (`layer.seen`, `layer.pads = ...`).
    """

    is_compileable = False
    # Whether heads store different numbers of entries (`snapkv.headwise.HeadwiseLayer`, Ada-KV):
    # the attention wrapper then lets the layer attend over its own layout.
    per_head = False
    # Whether entries can be evicted again after a compression (per-head storage cannot).
    evicts_after_compression = True
    # Whether keys / values are the layer's own (False on a padded batch's row view,
    # `snapkv.padding.row_view`, whose tensors are slices of the batch's): `evict_in_place` only then.
    owns_buffers = True
    kv_quant: KVQuant | None = None  # (set per layer by CompressedCache)

    def __init__(self, index: int = 0, num_layers: int = 1, decode_eviction: bool = True, **kwargs):
        super().__init__()
        # Whether the method may rescore or evict this layer's entries while decoding (H2O,
        # StreamingLLM; `Method.cache_layer` says): a checkpoint then keeps the scores at the mark.
        self.decode_eviction = decode_eviction
        self._mark: LayerMark | None = None
        self.index, self.num_layers = index, num_layers  # for per-layer budgets (PyramidKV-style)
        # Ordinal among the model's compressible layers and their count (set by CompressedCache):
        # per-layer schedules count only these (hybrid models: the full-attention layers).
        self.rank, self.num_compressible = index, num_layers
        self.dims: tuple[int, int, int] | None = None  # (batch, kv_heads, head_dim), set on first update
        self.st = LayerState()
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        # State a method shares across the compressible layers of one cache (ChunkKV's layer-wise
        # index reuse: the first layer of a group leaves its selection for the next ones). One dict
        # per CompressedCache; a padded batch's row view gets that row's own dict inside it.
        self.shared: dict = {}
        # After the prefill, keys / values / positions are views `[:, :, :stored]` of buffers
        # with room for `APPEND_ROOM` more entries: a decode step writes its token into them (and
        # `evict_in_place` frees a slot) instead of copying the layer into a new tensor.
        self._kv_buf: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._kv_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        # How kept entries are stored (`snapkv.kv_quant`; None: at the cache's dtype), set by
        # CompressedCache; `_backend`: transformers' quanto / hqq layer that quantizes for it.
        self.kv_quant: KVQuant | None = None
        self._backend = None

    # ---- stored entries: `keys` / `values` read what attention reads --------------------------------
    # `_k` / `_v` are the layer's own tensors. Without packed storage they are `keys` / `values`;
    # with it (`KVQuant.packed`) they hold the full-precision residual after the packed entries
    # (`st.kpack` / `st.vpack`), and `keys` / `values` are built when read: the packed entries
    # dequantized, then the residual (a new tensor per read, dropped after the step's attention, so
    # the packed bytes are what the cache holds). Assigning `keys` / `values` stores the given
    # tensor whole (a pruning's kept entries, read back), and the packs are gone.
    @property
    def keys(self) -> torch.Tensor | None:
        pack = None if self.kv_quant is None else self.st.kpack  # (packs only with kv_quant)
        return self._k if pack is None else torch.cat([pack.dequantize(), self._k], dim=-2)

    @keys.setter
    def keys(self, value: torch.Tensor | None) -> None:
        self._k = value
        st = self.__dict__.get("st")  # (unset while the base classes initialise)
        if st is not None and st.kpack is not None:
            st.kpack, st.quant_keys = None, 0

    @property
    def values(self) -> torch.Tensor | None:
        pack = None if self.kv_quant is None else self.st.vpack
        return self._v if pack is None else torch.cat([pack.dequantize(), self._v], dim=-2)

    @values.setter
    def values(self, value: torch.Tensor | None) -> None:
        self._v = value
        st = self.__dict__.get("st")
        if st is not None and st.vpack is not None:
            st.vpack, st.quant_values = None, 0

    @property
    def packed(self) -> bool:
        """Whether the quantized entries are stored packed (`KVQuant.packed`)."""
        return self.kv_quant is not None and self.kv_quant.packed

    def _unpack(self) -> None:
        """Before an in-place pruning of packed storage: the entries as plain tensors of the layer's
        own (the values read back, then the residual; new tensors, so that a mark's references stay
        as they were); they are quantized again after the pruning (`_pruned`)."""
        keys, values = self.keys, self.values
        self._k = keys if self.st.kpack is not None else keys.clone()
        self._v = values if self.st.vpack is not None else values.clone()
        self.positions = self.positions.clone()
        self.kpack = self.vpack = None
        self.quant_keys = self.quant_values = 0
        self._kv_buf = self._kv_views = None

    def remember_queries(self, query: torch.Tensor, window: int) -> None:
        """Keep the latest `window` queries `[batch, heads, <=window, head_dim]` (a copy: a slice
        of a prefill chunk's queries would keep the whole chunk alive; a new tensor each time: a
        checkpoint may hold the previous one)."""
        old = self.window_queries
        queries = query if old is None else torch.cat([old, query], dim=2)
        self.window_queries = queries[:, :, -window:].clone()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self.dims = (b, h, d)
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        if self.state == "ready":  # decoding (or a later turn): append into the buffers
            if q > 1:
                # Several tokens at once after in-place evictions (a later turn's question): causal
                # masks inside the block and index-based protections need the entries in order.
                self.sort_by_position()
            if self.scores is not None:
                self.scores = torch.cat([self.scores, self.scores.new_zeros(b, h, q)], dim=-1)
            self.quantize_residual()
            self.seen += q
            return self._append(key_states, value_states)
        # Original token indices (with compacted positions the keys are rotated at their slot instead).
        new_pos = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        self.positions = torch.cat([self.positions, new_pos], dim=-1)
        if self.scores is not None:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(b, h, q)], dim=-1)
        self.seen += q
        return super().update(key_states, value_states)

    def _holds_buffer(self) -> bool:
        """Whether keys / values / positions are still the prefix views of `_kv_buf` that `_append`
        or `evict_in_place` made (any other assignment since, by a keep, a rollback or a reorder,
        replaces them with other objects and fails the check; identity is cheaper than comparing
        storage, and a decode step asks once per layer)."""
        views = self._kv_views
        return (
            views is not None
            and self.keys is views[0]
            and self.values is views[1]
            and self.positions is views[2]
        )

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Append `[batch, kv_heads, q, head_dim]` (the last `q` of the `seen` tokens) after the
        stored entries, in place: into the buffers' free slots, or into new buffers with
        `APPEND_ROOM` slots to spare (one copy of the layer per `APPEND_ROOM` decode steps instead
        of one per step). Positions go into a buffer of their own alongside."""
        n, q = self.stored, key_states.shape[-2]
        if self.packed:  # the residual grows by a copy (at most `residual` entries + the new ones)
            self._k = torch.cat([self._k, key_states], dim=-2)
            self._v = torch.cat([self._v, value_states], dim=-2)
            new = torch.arange(self.seen - q, self.seen, device=self.positions.device)
            self.positions = torch.cat([self.positions, new.expand(*self.positions.shape[:2], q)], dim=-1)
            return self.keys, self.values
        if not self._holds_buffer() or n + q > self._kv_buf[0].shape[-2]:
            bufs = []
            for old in (self.keys, self.values, self.positions):
                buf = old.new_empty(*old.shape[:2], n + q + APPEND_ROOM, *old.shape[3:])
                buf[:, :, :n].copy_(old)
                buf[:, :, n + q :].zero_()  # never-written slots: deterministic, not garbage
                bufs.append(buf)
            self._kv_buf = (bufs[0], bufs[1], bufs[2])
        keys, values, positions = self._kv_buf
        keys[:, :, n : n + q].copy_(key_states)
        values[:, :, n : n + q].copy_(value_states)
        if q == 1:
            positions[:, :, n].fill_(self.seen - 1)
        else:
            positions[:, :, n : n + q].copy_(torch.arange(self.seen - q, self.seen, device=positions.device))
        self._set_views(n + q)
        return self.keys, self.values

    def _set_views(self, stored: int) -> None:
        keys, values, positions = self._kv_buf
        self.keys, self.values = keys[:, :, :stored], values[:, :, :stored]
        self.positions = positions[:, :, :stored]
        self._kv_views = (self.keys, self.values, self.positions)

    def evict_in_place(self, victims: torch.Tensor | int) -> None:
        """Drop the entry `victims[b, h]` of every row and KV head (an int: the same slot in every
        row and head) without copying the layer: the last entry moves into the victim's slot and
        keys / values become views one slot shorter of the same buffers, whose freed slot the next
        token's `update` fills. The entries are then no longer in position order; a decode step's
        attention does not depend on their order (every stored entry precedes the query), and
        `positions` says where each one came from."""
        self._refuse_quantized_pruning()
        if self.packed:
            self._unpack()
        self._save_marked_entries()
        last = self.stored - 1
        if isinstance(victims, int):  # one slot everywhere: three slice copies, no index tensors
            if victims != last:  # (the newest entry itself: dropping the last slot is all)
                for t in (self.keys, self.values, self.positions):
                    t.select(2, victims).copy_(t.select(2, last))
            if self.scores is not None:  # a new tensor (a checkpoint may hold the old one)
                scores = self.scores[..., :last].clone()
                if victims != last:
                    scores[..., victims] = self.scores[..., last]
                self.scores = scores
        else:
            d = self.keys.shape[-1]
            idx = victims.unsqueeze(-1)  # [b, h, 1]
            kv_idx = idx.unsqueeze(-1).expand(-1, -1, 1, d)
            for t in (self.keys, self.values):
                t.scatter_(2, kv_idx, t[:, :, last:].clone())
            self.positions.scatter_(2, idx, self.positions[..., last:].clone())
            # scores: a new tensor (a checkpoint may hold the old one)
            if self.scores is not None:
                self.scores = self.scores.scatter(2, idx, self.scores[..., last:])[..., :last]
        if self._holds_buffer():
            self._set_views(last)
        else:
            self.keys, self.values = self.keys[:, :, :last], self.values[:, :, :last]
            self.positions = self.positions[..., :last]
        self._pruned()

    def quantize_residual(self) -> None:
        """Store as quantized what `kv_quant`'s residual rule says is due (`snapkv.kv_quant`): the
        prompt's kept entries when the prefill ends (`state` set to "ready", inside the prefill's
        last forward), then the residual as it fills, before each later forward reads the layer
        (and at `checkpoint()`, `kv_bytes()`); a no-op without `kv_quant`, before the prefill is
        done, or with nothing due. Packed storage (`KVQuant.packed`) moves them into new packs;
        with `packed=False` they are rewritten in place with the values read back."""
        cfg = self.kv_quant
        if cfg is None or self.state != "ready" or not self.is_initialized or self.stored == 0:
            return
        # the entries are rewritten in place, also when a checkpoint or `kv_bytes()` asks outside
        # the generation's inference mode (the cache's tensors are inference tensors then)
        with torch.inference_mode():
            self._quantize_due(cfg)

    def _quantize_due(self, cfg: KVQuant) -> None:
        if self.per_head:
            raise ValueError(f"kv_quant={cfg.kind} does not support per-head storage (layer {self.index})")
        if self.pads is not None:
            raise ValueError(
                f"kv_quant={cfg.kind} does not support left-padded batches (a row's pads would join "
                "its quantization groups)"
            )
        n, r, qk, qv = self.stored, cfg.residual, self.quant_keys, self.quant_values
        if cfg.kind == "kivi":
            # keys: whole residuals of `r` entries (groups never straddle the residual); values:
            # all but the newest `r`
            k_to, v_to = qk + (n - qk) // r * r, max(qv, n - r)
            if k_to == qk and v_to == qv:
                return
            if self.packed:
                self._pack_kivi(cfg, k_to - qk, v_to - qv)
                self.quant_keys, self.quant_values = k_to, v_to
                return
            self._save_marked_entries()  # the marked entries are rewritten: copy them first
            if k_to > qk:
                self.keys[:, :, qk:k_to].copy_(
                    kvq.kivi_keys(self.keys[:, :, qk:k_to], cfg.bits, cfg.group_size)
                )
            if v_to > qv:
                self.values[:, :, qv:v_to].copy_(
                    kvq.kivi_values(self.values[:, :, qv:v_to], cfg.bits, cfg.group_size)
                )
            self.quant_keys, self.quant_values = k_to, v_to
            return
        # transformers' QuantizedLayer: the whole prompt, then everything again once `r` are pending
        if qk == n or (qk > 0 and n - qk < r):
            return
        if self._backend is None:
            self._backend = cfg.backend(self.keys)
        self._save_marked_entries()
        backend = self._backend
        keys, values = self.keys, self.values  # (packed: the packed entries read back, the residual)
        qkeys = backend._quantize(keys.contiguous(), axis=backend.axis_key)
        qvalues = backend._quantize(values.contiguous(), axis=backend.axis_value)
        if self.packed:
            self.kpack = kvq.BackendPack(backend, qkeys, n, keys.dtype)
            self.vpack = kvq.BackendPack(backend, qvalues, n, values.dtype)
            self._k, self._v = keys[:, :, n:].clone(), values[:, :, n:].clone()  # empty residuals
        else:
            self.keys.copy_(backend._dequantize(qkeys))
            self.values.copy_(backend._dequantize(qvalues))
        self.quant_keys = self.quant_values = n
        self.quant_bytes = kvq.quantized_nbytes(qkeys) + kvq.quantized_nbytes(qvalues)

    def _pack_kivi(self, cfg: KVQuant, keys: int, values: int) -> None:
        """Move the oldest `keys` residual keys / `values` residual values into the packs (new
        packs: a mark keeps the old ones); the residual left is copied, so that the full-precision
        tensor it was cut from is freed."""
        if keys:
            new = kvq.KiviPack.quantize(self._k[:, :, :keys], cfg.bits, cfg.group_size, keys=True)
            self.kpack = new if self.kpack is None else self.kpack.cat(new)
            self._k = self._k[:, :, keys:].clone()
        if values:
            new = kvq.KiviPack.quantize(self._v[:, :, :values], cfg.bits, cfg.group_size, keys=False)
            self.vpack = new if self.vpack is None else self.vpack.cat(new)
            self._v = self._v[:, :, values:].clone()

    def before_compress(self) -> None:
        """The end of the prefill, before the method scores it: with `kv_quant` order
        dequant_prune_requant (kvpress' order with transformers' `QuantizedCache`) the prompt is
        stored quantized now, so that the method scores the values read back from it (the keys
        attention was given are this layer's `keys`, rewritten in place); then the pruning
        re-quantizes what it keeps (`_pruned`). A no-op otherwise."""
        cfg = self.kv_quant
        if cfg is None or cfg.order != "dequant_prune_requant" or not self.is_initialized or self.stored == 0:
            return
        keys, values = self._k, self._v  # the tensors the prefill's attention returned
        with torch.inference_mode():
            self._quantize_due(cfg)
            if self.packed:  # the method scores the keys attention was given: the values read back
                for full, pack in ((keys, self.kpack), (values, self.vpack)):
                    if pack is not None:
                        full[:, :, : pack.length].copy_(pack.dequantize())

    def _refuse_quantized_pruning(self) -> None:
        """ValueError for a pruning of entries already quantized under score_then_quantize
        (decode-time eviction or a decode schedule: `KVQuant.check_method` refuses them first),
        which prunes the prompt before quantizing it."""
        cfg = self.kv_quant
        if cfg is not None and cfg.order == "score_then_quantize" and (self.quant_keys or self.quant_values):
            raise ValueError(
                f"kv_quant={cfg.kind} order={cfg.order} prunes before quantizing: "
                "decode-time eviction and decode schedules are not supported with it"
            )

    def _pruned(self) -> None:
        """After a pruning under dequant_prune_requant: the kept entries (read-back values and
        residual alike) are quantized again, as one prompt, before the next forward reads them."""
        if self.kv_quant is not None:
            self.quant_keys = self.quant_values = self.quant_bytes = 0

    def stored_bytes(self) -> int:
        """Bytes of the stored entries: `keys` + `values` at the cache's dtype, or with `kv_quant`
        their quantized layout (codes, a scale and a zero point per group, the full-precision
        residual; `quantize_residual` first, so that nothing due is counted at full precision):
        packed, the bytes of the tensors held; with `packed=False`, computed from the layout."""
        cfg = self.kv_quant
        if cfg is None or self.dims is None:
            tensors = [t for t in (self.keys, self.values) if isinstance(t, torch.Tensor)]
            return sum(t.numel() * t.element_size() for t in tensors)
        self.quantize_residual()
        if self.packed:  # what is stored: the packs' tensors and the residual
            packs = (p.nbytes for p in (self.kpack, self.vpack) if p is not None)
            return self._k.nbytes + self._v.nbytes + sum(packs)
        (b, h, d), es = self.dims, self.keys.element_size()
        qk, qv = self.quant_keys, self.quant_values
        residual = (2 * self.stored - qk - qv) * b * h * d * es
        if cfg.kind == "kivi":
            return residual + kvq.kivi_bytes(self.dims, qk, qv, cfg, es)
        return residual + self.quant_bytes

    def sort_by_position(self) -> None:
        """Put the stored entries back in position order (after `evict_in_place`); a no-op when
        they are."""
        pos = self.positions
        if self.per_head or pos is None or pos.shape[-1] < 2 or bool((pos[..., 1:] >= pos[..., :-1]).all()):
            return
        order = pos.argsort(dim=-1, stable=True)
        self._save_marked_entries()
        last_kept = self.last_kept
        self.keep(order, self.pads)
        self.last_kept = last_kept  # a reordering, not a selection

    @property
    def stored(self) -> int:
        if self._k is None or not self.is_initialized:
            return 0
        pack = None if self.kv_quant is None else self.st.kpack
        return self._k.shape[-2] if pack is None else pack.length + self._k.shape[-2]

    @property
    def kept_per_head(self) -> float:
        """Mean stored real entries per KV head (pads not counted; per-head storage,
        `snapkv.headwise`, overrides it)."""
        pads = 0.0 if self.pads is None else float(self.pads.double().mean())
        return float(self.stored) - pads

    def entries_now(self) -> float | torch.Tensor:
        """`kept_per_head` without a device sync: a float, or a 0-d tensor on the layer's device
        where pads are counted (read after generation, `CompressedCache.decode_stats`)."""
        if self.pads is None:
            return float(self.stored)
        return self.stored - self.pads.double().mean()

    def row_entries(self) -> torch.Tensor:
        """Real entries per KV head in each batch row `[batch]` (int64)."""
        b = self.dims[0]
        n = torch.full((b,), self.stored, dtype=torch.long, device=self.positions.device)
        return n if self.pads is None else n - self.pads

    def logical_bytes(self) -> int:
        """Bytes of the K/V entries kept (equal to the allocated bytes for this uniform layout;
        with `kv_quant`, their quantized layout: `stored_bytes`)."""
        return self.stored_bytes()

    @property
    def next_position(self) -> int:
        return self.stored if self.compacted else self.seen

    def get_seq_length(self) -> int:
        return self.next_position

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The stored entries plus the incoming queries; the offset makes the incoming block causal
        # and every stored entry visible (their positions all precede the queries').
        query_length = compat.query_length(query_length)
        stored = self.stored
        return stored + query_length, self.next_position - stored

    def keep(self, indices: torch.Tensor, pads: torch.Tensor | None = None) -> None:
        """Keep only the entries at `indices` `[batch, kv_heads, k]` (indices into the stored axis);
        `pads` `[batch]`: the leading kept slots of each row that hold no real entry (padded
        batches, `snapkv.padding`)."""
        if self.pads is not None and pads is None:
            raise ValueError("keep() on a padded batch needs the kept rows' pads (snapkv.padding)")
        self._refuse_quantized_pruning()
        self._save_marked_entries()
        # gathered into new tensors: the old buffer is not the layer's any more
        self._kv_buf = self._kv_views = None
        self.pads = pads
        self.last_kept = indices
        idx = indices.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, idx).contiguous()
        self.values = self.values.gather(2, idx).contiguous()
        self.positions = self.positions.gather(2, indices)
        if self.scores is not None:
            self.scores = self.scores.gather(2, indices)
        self._pruned()

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "a compressed KV cache cannot be cropped (assisted decoding is not supported); to reuse "
            "a compressed cache for another question use CompressedCache.checkpoint() / rollback()"
        )

    # ---- checkpoint / rollback (compress once, ask many) ---------------------------------------
    def checkpoint(self) -> LayerMark:
        """Mark the current state (prefill done) for `rollback`; replaces an earlier mark. Holds
        nothing but bookkeeping (and H2O's scores) until a decode-time eviction copies the marked
        entries (`_save_marked_entries`)."""
        if self.state != "ready":
            raise ValueError(
                f"checkpoint() needs a prefilled (compressed) cache, layer {self.index} is in state "
                f"{self.state!r}"
            )
        self.quantize_residual()  # what is due now is marked quantized: no copy when it runs later
        self._mark = LayerMark(self)
        return self._mark

    def _save_marked_entries(self) -> None:
        """Copy-on-write before the first eviction after a mark: until then the layer only appended,
        so its first `mark.stored` entries are still exactly the marked ones."""
        mark = self._mark
        if mark is None or mark.owner is not self or mark.kv is not None or mark.res is not None:
            return
        s = mark.stored
        mark.kv = (
            self.keys[..., :s, :].clone(),
            self.values[..., :s, :].clone(),
            self.positions[..., :s].clone(),
        )

    def rollback(self, mark: LayerMark) -> None:
        """Return exactly to the state at `mark` (this layer's current mark)."""
        if mark is not self._mark:
            raise ValueError(f"stale checkpoint for layer {self.index}: it was replaced or reset since")
        if self.seen < mark.seen:
            raise ValueError(
                f"layer {self.index} holds {self.seen} tokens, fewer than its mark's {mark.seen}"
            )
        self._kv_buf = self._kv_views = None  # the buffers hold entries written after the mark
        if mark.res is not None:  # packed storage: its residual and positions (the packs are in `st`)
            self._k, self._v, self.positions = mark.res
        elif mark.kv is not None:  # the layer evicted since the mark: its copy-on-write entries
            self.keys, self.values, self.positions = mark.kv
        else:
            self._crop_to(mark)
        if mark.scores is not None:
            self.scores = mark.scores
        elif mark.has_scores:  # only zero-extended while decoding: the marked scores are a prefix
            self.scores = self.scores[..., : mark.stored]
        else:
            self.scores = None
        self.st = mark.st.snapshot()  # a copy again: the mark serves further rollbacks

    def _crop_to(self, mark: LayerMark) -> None:
        """Drop the entries appended since `mark` (nothing was evicted since)."""
        s = mark.stored
        self.keys, self.values = self.keys[..., :s, :], self.values[..., :s, :]
        self.positions = self.positions[..., :s]

    def mark_bytes(self) -> int:
        """Bytes the current mark keeps alive that the layer itself no longer holds (0 for a layer
        that only appended since)."""
        if self._mark is None:
            return 0
        return _held_bytes(self._mark.held(), [*vars(self).values(), *self.st.tensors()])

    def reset(self) -> None:
        super().reset()
        self._mark = None
        self._kv_buf = self._kv_views = None
        self.positions = self.scores = None
        self.st = LayerState()
        self.shared.clear()

    def _rows_of_packs(self, fn) -> bool:
        """A batch re-indexing `fn` (tensor -> tensor along dim 0) of packed storage: the packs and
        the residual re-indexed as they are (no quantization again); False when nothing is packed."""
        if self.kpack is None and self.vpack is None:
            return False
        kpack, vpack = (p if p is None else p.rows(fn) for p in (self.kpack, self.vpack))
        self._k, self._v = fn(self._k), fn(self._v)
        self.kpack, self.vpack = kpack, vpack
        return True

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self._rows_of_packs(lambda t: t.index_select(0, beam_idx.to(t.device))):
            super().reorder_cache(beam_idx)
        # the marked rows are not these rows any more
        self._mark = self._kv_buf = self._kv_views = None
        if self.pads is not None:  # padded batches: each beam keeps its row's pads
            self.pads = self.pads.index_select(0, beam_idx.to(self.pads.device))
            self.prompt_pads = self.prompt_pads.index_select(0, beam_idx.to(self.prompt_pads.device))
        self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
        if self.scores is not None:
            self.scores = self.scores.index_select(0, beam_idx.to(self.scores.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.pads is not None:
            raise ValueError("batch re-indexing is not supported on a padded batch")
        self._mark = self._kv_buf = self._kv_views = None
        if not self._rows_of_packs(lambda t: t.repeat_interleave(repeats, dim=0)):
            super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.pads is not None:
            raise ValueError("batch re-indexing is not supported on a padded batch")
        self._mark = self._kv_buf = self._kv_views = None
        if not self._rows_of_packs(lambda t: t[indices, ...]):
            super().batch_select_indices(indices)


# Every bookkeeping field under its own name on the layer (one loop: a new field is exposed too).
for _field in dataclasses.fields(LayerState):
    setattr(CompressibleLayer, _field.name, _state_field(_field.name))
del _field


def _set_state(layer: CompressibleLayer, value: str) -> None:
    layer.st.state = value
    if value == "ready":
        # The prefill is done (and compressed): quantized storage stores the kept entries now, so
        # that its time is the prefill's, as in KIVI, whose prefill forward quantizes the prompt.
        layer.quantize_residual()


CompressibleLayer.state = property(
    operator.attrgetter("st.state"), _set_state, doc="`st.state` (`LayerState`)"
)


def _held_bytes(held: list[torch.Tensor], own) -> int:
    """Bytes of the storages in `held` that the layer's own values `own` (tensors among them) do not
    share (each counted once)."""
    live = {t.untyped_storage().data_ptr() for t in own if isinstance(t, torch.Tensor)}
    seen, total = set(), 0
    for t in held:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in live or ptr in seen:
            continue
        seen.add(ptr)
        total += storage.nbytes()
    return total


class _PlainMark:
    """The state at a checkpoint of a layer that is never compressed (transformers' own layers:
    sliding window, linear attention state). A plain `DynamicLayer` only appends: its length
    suffices. Any other kind may drop or rewrite what it holds (a sliding window rolls), so every
    tensor it holds is copied (for Gemma 3's sliding layers: the window, `sliding_window - 1`
    entries)."""

    # Layers that replace their tensors on update and never write into them: the copy may become the
    # layer's own tensor after a rollback.
    _REPLACE_ONLY = (DynamicLayer, DynamicSlidingWindowLayer)

    def __init__(self, layer):
        self.crop_only = type(layer) is DynamicLayer
        state = vars(layer)
        if self.crop_only:
            self.length = layer.keys.shape[-2] if isinstance(layer.keys, torch.Tensor) else 0
            state = {k: v for k, v in state.items() if k not in ("keys", "values")}
        self.attrs = {
            k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in state.items()
        }

    def rollback(self, layer) -> None:
        if self.crop_only and isinstance(layer.keys, torch.Tensor):
            layer.keys = layer.keys[..., : self.length, :]
            layer.values = layer.values[..., : self.length, :]
        share = type(layer) in self._REPLACE_ONLY
        for k, v in self.attrs.items():
            if isinstance(v, torch.Tensor):
                setattr(layer, k, v if share else v.clone())
            else:
                setattr(layer, k, copy.deepcopy(v))

    def held_bytes(self, layer) -> int:
        return _held_bytes(
            [v for v in self.attrs.values() if isinstance(v, torch.Tensor)], vars(layer).values()
        )


class CacheMark:
    """Handle returned by `CompressedCache.checkpoint()`: valid for any number of `rollback`s until
    the next `checkpoint()`, `reset()` or batch re-indexing of that cache. `seq_length`: the
    cache's `get_seq_length()` at the mark (where the next question's positions start)."""

    def __init__(self, seq_length: int, layers: list):
        self.seq_length = seq_length
        self.layers = layers

    def __repr__(self) -> str:
        return f"CacheMark(seq_length={self.seq_length})"


def kv_tensors(layer) -> list[torch.Tensor]:
    """The K/V tensors a cache layer holds: transformers' attention layers (`CacheLayerMixin`)
    declare `keys` / `values`; other kinds (linear attention state) hold none."""
    if not isinstance(layer, CacheLayerMixin):
        return []
    return [t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]


def full_attention_layers(config) -> list[int]:
    """Indices of the full-attention layers (`config`: a model config), by transformers' own cache
    layer typing (`snapkv.compat.layer_types`: `config.layer_types`, else inferred from
    `sliding_window` / `attention_chunk_size`). Only these see every key, so only these are
    compressed (`CompressedCache`) or recorded (`snapkv.observe`)."""
    return [i for i, t in enumerate(compat.layer_types(config)) if t == "full_attention"]


class CompressedCache(DynamicCache):
    """`DynamicCache` with a `CompressibleLayer` for every full-attention layer.

    Other layer kinds (sliding window, chunked, linear) keep transformers' own cache layers and are
    never compressed (hybrid models such as Gemma 3). `layer_factory(index=, num_layers=)` builds the
    compressible layers (default `CompressibleLayer`; methods with per-head storage pass their own,
    see `Method.cache_layer`). `kv_quant`: how the compressible layers store their kept entries
    (`snapkv.kv_quant.KVQuant`; None: at the model's dtype); the other layers are not quantized.
    """

    def __init__(self, config, layer_factory=None, kv_quant: KVQuant | None = None, **kwargs):
        super().__init__(config=config, **kwargs)
        layer_factory = layer_factory or CompressibleLayer
        compressible = set(full_attention_layers(config))
        n = config.get_text_config(decoder=True).num_hidden_layers
        if not self.layers:  # config without layer types: DynamicCache replicates lazily
            self.layers = [DynamicLayer() for _ in range(n)]
            self.layer_class_to_replicate = None
        self.compressible = sorted(compressible)
        shared: dict = {}
        for rank, i in enumerate(self.compressible):
            self.layers[i] = layer_factory(index=i, num_layers=n)
            self.layers[i].rank, self.layers[i].num_compressible = rank, len(self.compressible)
            self.layers[i].shared = shared
            if kv_quant is not None:
                if not self.layers[i].evicts_after_compression:  # per-head storage (snapkv.headwise)
                    raise ValueError(
                        f"kv_quant={kv_quant.kind} does not support per-head storage "
                        f"({type(self.layers[i]).__name__}: Ada-KV and its relatives)"
                    )
                self.layers[i].kv_quant = kv_quant
        self.kv_quant = kv_quant
        self._mark: CacheMark | None = None
        # Bytes the last `rollback()` had kept alive beyond the cache (for result rows).
        self.rollback_bytes = 0
        # Seconds of the method's own pass after the prefill (`OwnPass.after_prefill`, KVzip).
        self.scoring_s = 0.0

    def protect(self, start: int, end: int) -> None:
        """Keep the entries at positions `[start, end)` (stored positions: a left-padded batch's
        pads included) of every compressible layer from eviction from now on (`Method.shield`):
        the end of the prompt about to be fed that the method's `protect` names. Replaces an earlier
        span (a checkpoint restores the one it marked); an empty range clears it."""
        span = (start, end) if end > start else None
        for _, layer in self.compressible_layers():
            layer.protected_span = span

    # ---- compress once, ask many -----------------------------------------------------------------
    def checkpoint(self) -> CacheMark:
        """Mark the cache's state (after prefill + compression) so that `rollback(mark)` returns to
        it exactly, e.g. before each question asked about one compressed document. Replaces an
        earlier mark (one mark per cache).

        What is kept, per layer kind (`mark_bytes()` counts it):
        - compressible layers (`CompressibleLayer`, per-layer budgets, `HeadwiseLayer` varlen and
          padded, left-padded batches): their lengths and bookkeeping only; the rollback crops
          the entries appended since. A decode-time eviction (H2O's original, StreamingLLM) first
          copies the layer's marked keys / values / positions (copy-on-write, once per mark);
          H2O's accumulated scores at the mark are kept by reference (they are rewritten every
          step); a method's per-layer state (`method_state`) is deep-copied.
        - transformers' own layers (hybrid models' sliding-window layers): a copy of their tensors
          (the window); plain `DynamicLayer`s only their length.

        ValueError when a compressible layer has not finished its prefill.
        """
        layers = [
            layer.checkpoint() if isinstance(layer, CompressibleLayer) else _PlainMark(layer)
            for layer in self.layers
        ]
        self._mark = CacheMark(self.get_seq_length(), layers)
        self.rollback_bytes = 0
        return self._mark

    def rollback(self, mark: CacheMark) -> int:
        """Return every layer exactly to its state at `mark` (the current mark of this cache; it
        stays valid). `get_seq_length()` is the marked value again, so the next question's positions
        start where they did. Returns (and stores in `rollback_bytes`) the bytes the mark had kept
        alive beyond the cache, measured before restoring. ValueError without a checkpoint or for a
        stale mark (replaced by a later `checkpoint()`, `reset()` or batch re-indexing, or another
        cache's)."""
        if not isinstance(mark, CacheMark):
            raise ValueError(f"rollback() takes the CacheMark of checkpoint(), got {type(mark).__name__}")
        if self._mark is None:
            raise ValueError("rollback() without a checkpoint: call cache.checkpoint() after compression")
        if mark is not self._mark:
            raise ValueError(f"stale checkpoint {mark!r}: this cache's current mark is {self._mark!r}")
        for layer, layer_mark in zip(self.layers, mark.layers):  # all checked before any is changed
            if isinstance(layer, CompressibleLayer) and layer._mark is not layer_mark:
                raise ValueError(f"stale checkpoint {mark!r}: layer {layer.index} was reset since")
        held = self.mark_bytes()
        for layer, layer_mark in zip(self.layers, mark.layers):
            if isinstance(layer, CompressibleLayer):
                layer.rollback(layer_mark)
            else:
                layer_mark.rollback(layer)
        self.rollback_bytes = held
        return held

    def release(self) -> None:
        """Drop the current mark (if any): nothing more is kept for a rollback, and a later eviction
        copies nothing (a method that checkpoints for its own pass, KVzip, releases before pruning)."""
        for layer in self.layers:
            if isinstance(layer, CompressibleLayer):
                layer._mark = None
        self._mark = None

    def mark_bytes(self) -> int:
        """Bytes the current mark keeps alive that the cache itself does not hold (0 without a mark;
        0 for a model whose layers only appended since the mark)."""
        if self._mark is None:
            return 0
        total = 0
        for layer, layer_mark in zip(self.layers, self._mark.layers):
            if isinstance(layer, CompressibleLayer):
                total += layer.mark_bytes()
            else:
                total += layer_mark.held_bytes(layer)
        return total

    def reset(self) -> None:
        super().reset()
        self._mark = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._mark = None

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self._mark = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._mark = None

    def compressible_layers(self) -> list[tuple[int, CompressibleLayer]]:
        return [(i, self.layers[i]) for i in self.compressible]

    def kv_bytes(self) -> int:
        """Bytes of the K/V tensors really stored, all layers (Σ numel · element_size); with
        `kv_quant`, the compressible layers' quantized layout (`CompressibleLayer.stored_bytes`)."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressibleLayer) and layer.kv_quant is not None:
                total += layer.stored_bytes()
                continue
            total += sum(t.numel() * t.element_size() for t in kv_tensors(layer))
        return total

    def kv_index_bytes(self) -> int:
        """Bytes of the kept-index bookkeeping: the `positions` (int64, one per stored entry and KV
        head) of every compressed layer, which a compressed cache holds beside its entries to keep
        each key's position (an uncompressed layer's entries are 0..seen-1: counted as none). Not
        in `kv_bytes`, which counts the K/V storage alone."""
        total = 0
        for _, layer in self.compressible_layers():
            if layer.compressed and isinstance(layer.positions, torch.Tensor):
                total += layer.positions.numel() * layer.positions.element_size()
        return total

    def kv_bytes_logical(self) -> int:
        """Bytes of the K/V entries really kept, all layers: equal to `kv_bytes` except for per-head
        layouts that allocate padding (`snapkv.headwise`, layout="padded")."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, CompressibleLayer):
                total += layer.logical_bytes()
                continue
            total += sum(t.numel() * t.element_size() for t in kv_tensors(layer))
        return total

    def kv_bytes_full(self) -> int:
        """Bytes the same cache would hold with nothing evicted (each compressible layer at `seen`)."""
        total = 0
        for layer in self.layers:
            # (a compressible layer's own tensor: `keys` would read packed storage back)
            tensors = [layer._k] if isinstance(layer, CompressibleLayer) else kv_tensors(layer)
            if not tensors or not isinstance(tensors[0], torch.Tensor):
                continue
            keys = tensors[0]
            if isinstance(layer, CompressibleLayer) and layer.dims is not None:
                (b, h, d), length = layer.dims, layer.seen  # keys may be a flat per-head layout
            elif keys.dim() == 4:
                b, h, length, d = keys.shape
            else:
                continue
            total += 2 * b * h * length * d * keys.element_size()
        return total

    def decode_stats(self) -> tuple[int, float | None, float | None]:
        """(scheduled compressions, peak, mean) of the forwards since the prefill: the number of
        scheduled steps (`Method.decode_schedule`) at which some layer was pruned, and the largest /
        mean number of entries per KV head a forward attended to (mean over the compressible
        layers; None without any forward after the prefill)."""
        layers = [layer for _, layer in self.compressible_layers()]
        steps = {seen for layer in layers for seen in layer.decode_compressions}
        per_step = [sum(map(float, v)) / len(v) for v in zip(*(layer.decode_entries for layer in layers))]
        if not per_step:
            return len(steps), None, None
        return len(steps), max(per_step), sum(per_step) / len(per_step)

    def kept_tokens(self) -> list[float]:
        """Entries kept per KV head in each compressible layer (the mean over heads and batch rows
        where heads keep different numbers, Ada-KV)."""
        return [layer.kept_per_head for _, layer in self.compressible_layers()]
