"""Per-head variable-length KV storage (Ada-KV): each KV head of a layer keeps its own number of entries.

`HeadwiseLayer` is a `CompressibleLayer` that behaves exactly like it (uniform `[batch, kv_heads,
stored, head_dim]` tensors) until a method calls `keep_per_head()`; from then on every (batch row,
KV head) keeps `lengths[b, h]` entries in one of two layouts, and the attention wrapper
(`snapkv.hooks`) hands the layer's attention to `attend()`:

- `padded` (the simple baseline): keys / values `[batch, kv_heads, max_len, head_dim]`, each head's
  kept entries first, then zero padding up to the longest head, then the tokens appended while
  decoding (every head gets every new token). A validity mask `valid` `[batch, kv_heads, slots]`
  becomes an explicit attention mask for the model's own sdpa / eager function. Allocated bytes =
  longest head x heads; padding is memory that is paid for but holds nothing.
- `varlen`: per layer ONE flat tensor `[total_kept, head_dim]` for K and one for V, the (batch row,
  KV head) segments one after the other (row-major), delimited by `cu_seqlens` `[batch*kv_heads + 1]`
  (int32, flash-attn's convention). Allocated bytes == logical bytes. Attention runs with
  flash-attn's `flash_attn_varlen_func` (each segment is one "sequence" whose query heads are the
  KV head's GQA group: no repeated K/V) when flash-attn is importable and the tensors are fp16/bf16
  on CUDA; elsewhere with a PyTorch fallback (`segment_attention`: per-entry logits against
  its own segment's queries, a segment-wise softmax by scatter max / sum; no padding; computed in
  fp32, so equal to the model's attention to fp32 rounding in fp32 and more precise than, not
  identical to, a bf16/fp16 attention).
  Appending decoded tokens re-packs the flat tensors (one copy per step and layer, as
  `DynamicLayer`'s `torch.cat` does).

Both layouts keep `positions` (the original token position of every entry; -1 on padding) so the
result can be checked against a masked full-cache reference. Not supported on per-head storage:
decode-time eviction (`keep`), beam search / batch re-indexing, attention sinks, StreamingLLM's
compacted positions. Left-padded batches are supported (`snapkv.padding`): each (row, head) segment
holds only the row's real entries.
"""

from __future__ import annotations

import math

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from snapkv.cache import CompressibleLayer

LAYOUTS = ("padded", "varlen")

try:  # optional: flash-attn (a CUDA build); the PyTorch fallback runs everywhere
    from flash_attn import flash_attn_varlen_func
except Exception:  # ImportError, or a broken CUDA build
    flash_attn_varlen_func = None


class HeadwiseLayer(CompressibleLayer):
    """`CompressibleLayer` whose KV heads may keep different numbers of entries (see module doc).

    After `keep_per_head()`: `lengths` `[batch, kv_heads]` (int64) entries per head, appended
    tokens included; `padded`: `keys`/`values` `[batch, kv_heads, slots, head_dim]`, `valid` and
    `positions` `[batch, kv_heads, slots]`; `varlen`: `keys`/`values` `[total, head_dim]`,
    `positions` `[total]`, `cu_seqlens` `[batch*kv_heads + 1]` int32, `max_len`.
    """

    evicts_after_compression = False  # keep() refuses per-head storage

    def __init__(self, index: int = 0, num_layers: int = 1, layout: str = "varlen", **kwargs):
        super().__init__(index=index, num_layers=num_layers, **kwargs)
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got layout={layout!r}")
        self.layout = layout
        self._clear_per_head()

    def _clear_per_head(self) -> None:
        self.lengths: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None  # padded only
        self.cu_seqlens: torch.Tensor | None = None  # varlen only
        self.max_len = 0

    @property
    def per_head(self) -> bool:
        """True once heads keep different numbers of entries (the attention wrapper asks)."""
        return self.lengths is not None

    # ---- compression -----------------------------------------------------------------------
    def keep_per_head(self, indices: torch.Tensor, lengths: torch.Tensor) -> None:
        """Keep, for every (batch row, KV head), the first `lengths[b, h]` entries of
        `indices[b, h]` (`[batch, kv_heads, M]`, indices into the stored axis, ascending; the
        values past a head's length are ignored). Switches the layer to its per-head layout."""
        if self.per_head:
            raise ValueError("keep_per_head() runs once, on the uniform prefill cache")
        b, h, length, d = self.keys.shape
        lengths = lengths.to(device=self.keys.device, dtype=torch.long)
        m = int(lengths.max())
        indices = indices[..., :m]
        valid = torch.arange(m, device=self.keys.device) < lengths[..., None]  # [b, h, m]
        self.last_kept = indices
        if self.layout == "padded":
            idx = indices.masked_fill(~valid, 0)
            gather = idx[..., None].expand(-1, -1, -1, d)
            self.keys = self.keys.gather(2, gather).masked_fill_(~valid[..., None], 0).contiguous()
            self.values = self.values.gather(2, gather).masked_fill_(~valid[..., None], 0).contiguous()
            self.positions = self.positions.gather(2, idx).masked_fill_(~valid, -1)
            self.valid = valid
        else:
            # Row-major (b, h, m) order of the valid entries = the segments one after the other.
            rows = torch.arange(b * h, device=self.keys.device).view(b, h, 1).expand(b, h, m)[valid]
            cols = indices[valid]
            self.keys = self.keys.reshape(b * h, length, d)[rows, cols].contiguous()  # [total, d]
            self.values = self.values.reshape(b * h, length, d)[rows, cols].contiguous()
            self.positions = self.positions.reshape(b * h, length)[rows, cols]
        self.scores = None
        self._set_lengths(lengths)

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths
        self.max_len = int(lengths.max())
        if self.layout == "varlen":
            flat = lengths.reshape(-1)
            self.cu_seqlens = torch.cat([flat.new_zeros(1), flat.cumsum(0)]).to(torch.int32)

    # ---- cache protocol ----------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.per_head:
            return super().update(key_states, value_states, *args, **kwargs)
        b, h, q, d = key_states.shape
        dev = key_states.device
        new_pos = torch.arange(self.seen, self.seen + q, device=dev)
        if self.layout == "padded":
            # New tokens go after every head's slots (padding stays in the middle, masked).
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, new_pos.expand(b, h, q)], dim=-1)
            self.valid = torch.cat([self.valid, self.valid.new_ones(b, h, q)], dim=-1)
        else:
            # Re-pack: segment s grows by q at its end, so an old entry e of segment s moves to
            # e + s*q, and new token j of segment s lands at old_end[s] + s*q + j.
            n = b * h
            shift = torch.arange(n, device=dev) * q
            seg = torch.repeat_interleave(torch.arange(n, device=dev), self.lengths.reshape(-1))
            dst_old = torch.arange(seg.numel(), device=dev) + seg * q
            dst_new = (self.cu_seqlens[1:].long() + shift)[:, None] + torch.arange(q, device=dev)
            dst_new = dst_new.reshape(-1)
            total = seg.numel() + n * q
            self.keys = _scatter_rows(self.keys, key_states.reshape(n * q, d), dst_old, dst_new, total)
            self.values = _scatter_rows(self.values, value_states.reshape(n * q, d), dst_old, dst_new, total)
            self.positions = _scatter_rows(
                self.positions, new_pos.repeat(n), dst_old, dst_new, total
            )  # new_pos.repeat(n): [n*q], (segment, token) order
        self.seen += q
        self._set_lengths(self.lengths + q)
        return self.keys, self.values

    @property
    def stored(self) -> int:
        """Slots of the longest head (padded: the allocated slots; varlen: the longest segment)."""
        if not self.per_head:
            return super().stored
        return self.keys.shape[-2] if self.layout == "padded" else self.max_len

    @property
    def kept_per_head(self) -> float:
        if not self.per_head:
            return super().kept_per_head
        return float(self.lengths.double().mean())

    def entries_now(self) -> float | torch.Tensor:
        if not self.per_head:
            return super().entries_now()
        return self.lengths.double().mean()

    def logical_bytes(self) -> int:
        if not self.per_head:
            return super().logical_bytes()
        d = self.dims[2]
        return int(self.lengths.sum()) * d * (self.keys.element_size() + self.values.element_size())

    def head_positions(self, fill: int = -1) -> torch.Tensor:
        """Original positions kept per head, `[batch, kv_heads, max_len]`, in storage order, `fill`
        past a head's length (uniform layers: `positions` as is)."""
        if not self.per_head:
            return self.positions
        b, h, _ = self.dims
        if self.layout == "padded":
            out = self.positions.new_full((b, h, self.max_len), fill)
            order = (~self.valid).to(torch.int8).sort(dim=-1, stable=True).indices[..., : self.max_len]
            picked = self.positions.gather(2, order)
            live = torch.arange(self.max_len, device=out.device) < self.lengths[..., None]
            return torch.where(live, picked, out)
        seg = torch.repeat_interleave(
            torch.arange(b * h, device=self.positions.device), self.lengths.reshape(-1)
        )
        offset = torch.arange(seg.numel(), device=seg.device) - self.cu_seqlens[:-1].long()[seg]
        out = self.positions.new_full((b * h, self.max_len), fill)
        out[seg, offset] = self.positions
        return out.view(b, h, self.max_len)

    def _crop_to(self, mark) -> None:
        """Drop the tokens appended since `mark`: every head got each of them, at its end (varlen:
        the end of its segment; padded: the last slots), so the marked lengths are today's minus
        the appended count and nothing but the mark's `seen` is needed."""
        if not self.per_head:
            return super()._crop_to(mark)
        appended = self.seen - mark.seen
        if appended == 0:
            return
        lengths = self.lengths - appended
        if self.layout == "padded":
            slots = self.keys.shape[-2] - appended
            self.keys, self.values = self.keys[..., :slots, :], self.values[..., :slots, :]
            self.positions, self.valid = self.positions[..., :slots], self.valid[..., :slots]
        else:
            # Entry j of segment s (j < its marked length) sits at cu_seqlens[s] + j today.
            flat = lengths.reshape(-1)
            seg = torch.repeat_interleave(torch.arange(flat.numel(), device=flat.device), flat)
            start = torch.cat([flat.new_zeros(1), flat.cumsum(0)[:-1]])
            keep = (
                self.cu_seqlens[:-1].long()[seg] + torch.arange(seg.numel(), device=seg.device) - start[seg]
            )
            self.keys, self.values, self.positions = self.keys[keep], self.values[keep], self.positions[keep]
        self._set_lengths(lengths)

    def keep(self, indices: torch.Tensor) -> None:
        if self.per_head:
            raise ValueError("per-head storage does not support decode-time eviction (keep)")
        super().keep(indices)

    def reset(self) -> None:
        super().reset()
        self._clear_per_head()

    def _no_reindex(self, *args, **kwargs) -> None:
        raise ValueError("per-head (Ada-KV) storage does not support beam search / batch re-indexing")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.per_head:
            self._no_reindex()
        super().reorder_cache(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.per_head:
            self._no_reindex()
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.per_head:
            self._no_reindex()
        super().batch_select_indices(indices)

    # ---- attention -----------------------------------------------------------------------------
    def attend(self, module, query, key, value, fn, impl: str, *args, **kwargs):
        """The layer's attention over its per-head storage (called by the hooks' wrapper instead of
        the model's attention function). query `[batch, heads, q, head_dim]` (post-RoPE), key /
        value: what `update()` returned. Returns `(out [batch, q, heads, head_dim], None)`."""
        if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
            raise ValueError("per-head storage does not support attention sinks (s_aux)")
        if self.layout == "padded":
            mask = self.padded_mask(query.shape[2], query.shape[1])  # [b, heads, q, slots] bool
            if impl == "eager":
                add = torch.zeros(mask.shape, dtype=query.dtype, device=query.device)
                mask = add.masked_fill_(~mask, torch.finfo(query.dtype).min)
            elif impl != "sdpa":  # flash kernels take no arbitrary mask: the stock sdpa function does
                fn = sdpa_attention_forward
            return fn(module, query, key, value, mask, *args, **kwargs)
        scaling = kwargs.get("scaling")
        scaling = scaling if scaling is not None else module.scaling
        return varlen_attention(query, self, scaling, kwargs.get("softcap")), None

    def padded_mask(self, q: int, heads: int) -> torch.Tensor:
        """Boolean mask `[batch, heads, q, slots]`: a head's valid slots, causal inside the incoming
        block (the last q slots), repeated over each KV head's query-head group."""
        b, h, slots = self.valid.shape
        causal = torch.ones(q, q, dtype=torch.bool, device=self.valid.device).tril()
        mask = self.valid[:, :, None, :].expand(b, h, q, slots).clone()
        mask[..., slots - q :] &= causal
        return mask.repeat_interleave(heads // h, dim=1)


def _scatter_rows(old, new, dst_old, dst_new, total):
    out = old.new_empty((total,) + old.shape[1:])
    out.index_copy_(0, dst_old, old)
    out.index_copy_(0, dst_new, new.to(old.dtype))
    return out


def _use_flash(query: torch.Tensor, layer: HeadwiseLayer) -> bool:
    return (
        flash_attn_varlen_func is not None
        and query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and layer.keys.dtype == query.dtype
    )


def varlen_attention(query: torch.Tensor, layer: HeadwiseLayer, scaling: float, softcap=None) -> torch.Tensor:
    """Attention of `query` `[batch, heads, q, head_dim]` over a varlen layer (the last q entries of
    every segment are the queries' own tokens: causal, bottom-right aligned). Returns
    `[batch, q, heads, head_dim]`. flash-attn on CUDA (fp16/bf16) when installed, else
    `segment_attention`."""
    b, heads, q, d = query.shape
    h = layer.dims[1]
    g = heads // h
    n = b * h
    if not _use_flash(query, layer):
        return segment_attention(query, layer, scaling, softcap)
    # One "sequence" per (batch row, KV head): its q tokens carry the group's g query heads, its
    # keys the segment (nheads_k = 1: flash-attn's GQA, no repeated K/V).
    qf = query.reshape(b, h, g, q, d).permute(0, 1, 3, 2, 4).reshape(n * q, g, d)
    cu_q = torch.arange(0, n + 1, device=query.device, dtype=torch.int32) * q
    out = flash_attn_varlen_func(
        qf,
        layer.keys.view(-1, 1, d),
        layer.values.view(-1, 1, d),
        cu_q,
        layer.cu_seqlens,
        q,
        layer.max_len,
        softmax_scale=scaling,
        causal=True,  # flash-attn >= 2.1: bottom-right aligned, as needed
        softcap=float(softcap or 0.0),
    )  # [n*q, g, d]
    return out.view(b, h, q, g, d).permute(0, 2, 1, 3, 4).reshape(b, q, heads, d)


def segment_attention(
    query: torch.Tensor,
    layer: HeadwiseLayer,
    scaling: float,
    softcap=None,
    max_block_bytes: int = 256 * 2**20,
) -> torch.Tensor:
    """Exact attention over the flat varlen layout without padding (the PyTorch fallback).

    Each stored entry e (segment s = (batch row, KV head)) scores against its own segment's
    queries: logits `[total, group, q]`; a query sees the entries whose original position is <= its
    own; softmax per segment via scatter max / sum; fp32 (fp64 inputs stay fp64). Query blocks
    bound the `[total, group, q_block, head_dim]` temporaries by `max_block_bytes`.
    Returns `[batch, q, heads, head_dim]` in the query's dtype.
    """
    b, heads, q, d = query.shape
    h = layer.dims[1]
    g = heads // h
    n = b * h
    dev = query.device
    work = torch.float64 if query.dtype == torch.float64 else torch.float32
    seg = torch.repeat_interleave(torch.arange(n, device=dev), layer.lengths.reshape(-1))  # [T]
    total = seg.numel()
    k, v = layer.keys.to(work), layer.values.to(work)  # [T, d]
    qs = query.reshape(n, g, q, d).to(work)
    pos = layer.positions  # [T]
    out = torch.empty(n, g, q, d, dtype=work, device=dev)
    block = max(1, min(q, max_block_bytes // max(1, total * g * d * (4 if work == torch.float32 else 8))))
    for s in range(0, q, block):
        e = min(q, s + block)
        qpos = torch.arange(layer.seen - q + s, layer.seen - q + e, device=dev)
        logits = torch.einsum("tgqd,td->tgq", qs[seg, :, s:e], k) * scaling  # [T, g, qb]
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        visible = (pos[:, None] <= qpos[None, :])[:, None, :]  # [T, 1, qb]
        logits = logits.masked_fill(~visible, -math.inf)
        idx = seg.view(-1, 1, 1).expand_as(logits)
        peak = logits.new_full((n, g, e - s), -math.inf).scatter_reduce(0, idx, logits, "amax")
        w = (logits - peak[seg]).exp()  # masked entries: exp(-inf) = 0
        den = logits.new_zeros(n, g, e - s).index_add_(0, seg, w)
        num = logits.new_zeros(n, g, e - s, d).index_add_(0, seg, w[..., None] * v[:, None, None, :])
        out[:, :, s:e] = num / den[..., None]
    return out.view(b, h, g, q, d).reshape(b, heads, q, d).transpose(1, 2).to(query.dtype)
