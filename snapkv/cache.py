"""A transformers `DynamicCache` whose full-attention layers can be compressed per KV head.

Keys are cached after RoPE, so a kept key keeps its original position. What must change after
compression is the bookkeeping (DESIGN.md §2): `get_seq_length()` has to keep returning the number
of tokens *seen* (so that `position_ids`, `generate()`'s input slicing and the causal mask stay
right), while `get_mask_sizes()` has to describe what is really *stored*. transformers' own
`DynamicSlidingWindowLayer` does exactly this; `CompressibleLayer` does it for arbitrary per-head
selections.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicCache, DynamicLayer

from snapkv import compat


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
    """

    is_compileable = False
    # Whether heads store different numbers of entries (`snapkv.headwise.HeadwiseLayer`, Ada-KV):
    # the attention wrapper then lets the layer attend over its own layout.
    per_head = False

    def __init__(self, index: int = 0, num_layers: int = 1, **kwargs):
        super().__init__()
        self.index, self.num_layers = index, num_layers  # for per-layer budgets (PyramidKV-style)
        # Ordinal among the model's compressible layers and their count (set by CompressedCache):
        # per-layer schedules count only these (hybrid models: the full-attention layers).
        self.rank, self.num_compressible = index, num_layers
        self.dims: tuple[int, int, int] | None = None  # (batch, kv_heads, head_dim), set on first update
        self.seen = 0
        self.positions: torch.Tensor | None = None
        self.scores: torch.Tensor | None = None
        # "empty" -> "prefilling" (chunked prefill under way) -> "ready" (prefill done; decoding)
        self.state = "empty"
        self.compressed = False
        self.compacted = False
        # Per-layer state a method keeps beside its scores (an object of the method's own type,
        # e.g. H2O's `H2OLayerState`); None until the method sets it, cleared by reset().
        self.method_state: object | None = None
        self.last_kept: torch.Tensor | None = None  # indices of the last keep() (for re-rotation)
        self.pads: torch.Tensor | None = None  # [batch] leading slots without a real entry
        self.prompt_pads: torch.Tensor | None = None  # [batch] pads of the prompt
        self.softcap: float | None = None
        self.sinks: torch.Tensor | None = None
        self.decode_evicted = 0.0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, _, d = key_states.shape
        self.dims = (b, h, d)
        self.positions = torch.empty(b, h, 0, dtype=torch.long, device=key_states.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        # Original token indices (with compacted positions the keys are rotated at their slot instead).
        new_pos = torch.arange(self.seen, self.seen + q, device=key_states.device).expand(b, h, q)
        self.positions = torch.cat([self.positions, new_pos], dim=-1)
        if self.scores is not None:
            self.scores = torch.cat([self.scores, self.scores.new_zeros(b, h, q)], dim=-1)
        self.seen += q
        return super().update(key_states, value_states)

    @property
    def stored(self) -> int:
        return 0 if self.keys is None or not self.is_initialized else self.keys.shape[-2]

    @property
    def kept_per_head(self) -> float:
        """Mean stored real entries per KV head (pads not counted; per-head storage,
        `snapkv.headwise`, overrides it)."""
        pads = 0.0 if self.pads is None else float(self.pads.double().mean())
        return float(self.stored) - pads

    def row_entries(self) -> torch.Tensor:
        """Real entries per KV head in each batch row `[batch]` (int64)."""
        b = self.dims[0]
        n = torch.full((b,), self.stored, dtype=torch.long, device=self.positions.device)
        return n if self.pads is None else n - self.pads

    def logical_bytes(self) -> int:
        """Bytes of the K/V entries kept (equal to the allocated bytes for this uniform layout)."""
        return sum(
            t.numel() * t.element_size() for t in (self.keys, self.values) if isinstance(t, torch.Tensor)
        )

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
        self.pads = pads
        self.last_kept = indices
        idx = indices.unsqueeze(-1).expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, idx).contiguous()
        self.values = self.values.gather(2, idx).contiguous()
        self.positions = self.positions.gather(2, indices)
        if self.scores is not None:
            self.scores = self.scores.gather(2, indices)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a compressed KV cache cannot be cropped (assisted decoding is not supported)")

    def reset(self) -> None:
        super().reset()
        self.seen = 0
        self.positions = self.scores = None
        self.state = "empty"
        self.compressed = self.compacted = False
        self.pads = self.prompt_pads = None
        self.decode_evicted = 0.0
        self.method_state = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.pads is not None:  # padded batches: each beam keeps its row's pads
            self.pads = self.pads.index_select(0, beam_idx.to(self.pads.device))
            self.prompt_pads = self.prompt_pads.index_select(0, beam_idx.to(self.prompt_pads.device))
        self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))
        if self.scores is not None:
            self.scores = self.scores.index_select(0, beam_idx.to(self.scores.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.pads is not None:
            raise ValueError("batch re-indexing is not supported on a padded batch")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.pads is not None:
            raise ValueError("batch re-indexing is not supported on a padded batch")
        super().batch_select_indices(indices)


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
    see `Method.cache_layer`).
    """

    def __init__(self, config, layer_factory=None, **kwargs):
        super().__init__(config=config, **kwargs)
        layer_factory = layer_factory or CompressibleLayer
        compressible = set(full_attention_layers(config))
        n = config.get_text_config(decoder=True).num_hidden_layers
        if not self.layers:  # config without layer types: DynamicCache replicates lazily
            self.layers = [DynamicLayer() for _ in range(n)]
            self.layer_class_to_replicate = None
        self.compressible = sorted(compressible)
        for rank, i in enumerate(self.compressible):
            self.layers[i] = layer_factory(index=i, num_layers=n)
            self.layers[i].rank, self.layers[i].num_compressible = rank, len(self.compressible)

    def compressible_layers(self) -> list[tuple[int, CompressibleLayer]]:
        return [(i, self.layers[i]) for i in self.compressible]

    def kv_bytes(self) -> int:
        """Bytes of the K/V tensors really stored, all layers (Σ numel · element_size)."""
        total = 0
        for layer in self.layers:
            total += sum(t.numel() * t.element_size() for t in kv_tensors(layer))
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
            tensors = kv_tensors(layer)
            if not tensors:
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

    def kept_tokens(self) -> list[float]:
        """Entries kept per KV head in each compressible layer (the mean over heads and batch rows
        where heads keep different numbers, Ada-KV)."""
        return [layer.kept_per_head for _, layer in self.compressible_layers()]
