"""Left-padded batches: every method runs on each row's real entries, as if the row were alone.

`with snapkv.apply(model, method): model.generate(ids, attention_mask=mask)` with a left-padded
batch (transformers' convention for decoder-only generation). Semantics:

- Pads are never scored or kept as entries: the hooks read the 2-D padding mask of each forward,
  and a compressible layer records `pads` `[batch]`, the leading slots of each row without a real
  entry. Method hooks (`observe`, `compress_prefill`, `compress_decode`) run once per row on a view of that
  row's real entries (`row_view`): positions start at the row's first real token, `seen` counts the
  row's real tokens, so StreamingLLM's sinks are the row's first real tokens, H2O's column sums and
  recent window and SnapKV's observation window cover real tokens only, and per-layer budgets
  (PyramidKV) are the ones the row would get alone. A row shorter than the budget is kept whole.
- Rows keep equal tensor shapes: a layer stores the longest row's kept entries; shorter rows are
  left-filled with masked slots (`pads` again). Per-head storage (Ada-KV) holds each (row, head)
  segment with its own length and no pads at all.
- The attention mask follows the kept entries: for a padded layer the hooks build the mask from
  `pads` (every real stored entry visible, causal inside the incoming block); transformers' 2-D
  padding mask does not map onto the kept slots after compression and is not used there.
- RoPE positions are those `generate()` derives from the padding mask (keys are cached post-RoPE).

A padded row therefore decodes as the same prompt alone (greedy tokens identical, logits equal to
fp32 rounding: tested to 1e-5 for every method). Refused with ValueError: right or inner padding,
padding in a forward after the prompt, beam search / batch re-indexing of a padded cache, and
StreamingLLM's compacted positions (refused in `model.generate` altogether).
"""

from __future__ import annotations

import copy

import torch

from snapkv.cache import CompressibleLayer
from snapkv.headwise import HeadwiseLayer


def left_pads(mask: torch.Tensor) -> torch.Tensor | None:
    """Pads per row `[batch]` of a 2-D left-padded attention mask `[batch, length]`, None when no
    row has any. ValueError for right / inner padding and for rows without any real token."""
    real = mask.bool()
    if bool((real[:, 1:] < real[:, :-1]).any()):
        rows = torch.nonzero((real[:, 1:] < real[:, :-1]).any(-1)).flatten().tolist()
        raise ValueError(
            f"only left-padded batches are supported (padding_side='left'), got a pad after a real "
            f"token in batch rows {rows}"
        )
    pads = (~real).sum(-1)
    if bool((pads == real.shape[-1]).any()):
        raise ValueError(
            f"a batch row without any real token: attention_mask row sums {real.sum(-1).tolist()}"
        )
    return pads if bool(pads.any()) else None


def attention_mask(layer: CompressibleLayer, query: torch.Tensor, impl: str) -> torch.Tensor:
    """The mask of a padded layer `[batch, 1, q, stored]` for the model's sdpa (bool) or eager
    (additive) attention: a row's real stored entries, causal inside the incoming block. A pad query
    that sees no real entry sees everything instead (its output is never used; an all-masked row
    would give NaN), as transformers' own sdpa mask does."""
    q, k = query.shape[2], layer.stored
    slot = torch.arange(k, device=query.device)
    causal = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)
    visible = (slot[None, :] >= layer.pads[:, None].to(query.device))[:, None, None, :] & causal
    visible = visible | ~visible.any(dim=-1, keepdim=True)
    if impl == "eager":
        add = torch.zeros(visible.shape, dtype=query.dtype, device=query.device)
        return add.masked_fill_(~visible, torch.finfo(query.dtype).min)
    return visible


def row_view(layer: CompressibleLayer, row: int) -> CompressibleLayer:
    """A layer holding only row `row`'s real entries `[1, kv_heads, n, head_dim]`, as the row alone
    would have them: positions from its first real token, `seen` = its real tokens (a shallow copy:
    the method's hooks may replace, never modify, its tensors)."""
    pad, off = int(layer.pads[row]), int(layer.prompt_pads[row])
    view = copy.copy(layer)
    # Its own bookkeeping object (the shallow copy would share the layer's): what the method sets on
    # the view must not reach the batched layer.
    view.st = copy.copy(layer.st)
    view.keys = layer.keys[row : row + 1, :, pad:]
    view.values = layer.values[row : row + 1, :, pad:]
    view.positions = layer.positions[row : row + 1, :, pad:] - off
    view.scores = None if layer.scores is None else layer.scores[row : row + 1, :, pad:]
    view.seen = layer.seen - off
    view.dims = (1,) + layer.dims[1:]
    view.pads = view.prompt_pads = None
    view.last_kept = None
    view.shared = layer.shared.setdefault(("row", row), {})  # the row's state across layers
    view.owns_buffers = False  # its tensors are slices of the batch's: no eviction in place
    return view


def _views(
    layer: CompressibleLayer, query: torch.Tensor | None
) -> list[tuple[CompressibleLayer, torch.Tensor | None]]:
    """(row view, the row's real queries `[1, heads, q_r, d]`, None without `query`) for every
    batch row."""
    if query is None:
        return [(row_view(layer, r), None) for r in range(layer.dims[0])]
    q, stored = query.shape[2], layer.stored
    out = []
    for r in range(layer.dims[0]):
        first = max(0, int(layer.pads[r]) - (stored - q))  # the incoming block's pads come first
        out.append((row_view(layer, r), query[r : r + 1, :, first:]))
    return out


def _write_scores(layer: CompressibleLayer, views) -> None:
    if all(v.scores is None for v, _ in views):
        return
    b, h, _ = layer.dims
    if layer.scores is None:
        layer.scores = torch.zeros(b, h, layer.stored, dtype=torch.float32, device=layer.keys.device)
    for r, (v, _) in enumerate(views):
        if v.scores is not None:
            layer.scores[r, :, int(layer.pads[r]) :] = v.scores[0]


def _merge(layer: CompressibleLayer, views) -> None:
    """Apply the rows' own selections (`view.last_kept`) to the batched layer."""
    if all(v.last_kept is None for v, _ in views):
        return
    h = layer.dims[1]
    dev = layer.keys.device
    rows = []  # per row: kept indices into the batched stored axis [kv_heads, k_r], lengths [kv_heads]
    for r, (v, _) in enumerate(views):
        pad = int(layer.pads[r])
        if v.last_kept is None:
            n = layer.stored - pad
            idx = torch.arange(n, device=dev).expand(h, n)
            lengths = torch.full((h,), n, dtype=torch.long, device=dev)
        else:
            idx = v.last_kept[0]
            per_head = isinstance(v, HeadwiseLayer) and v.per_head
            lengths = v.lengths[0] if per_head else torch.full((h,), idx.shape[-1], device=dev)
        rows.append((idx + pad, lengths.to(device=dev, dtype=torch.long)))
    layer.compressed = layer.compressed or any(v.compressed for v, _ in views)
    width = max(idx.shape[-1] for idx, _ in rows)
    if any(isinstance(v, HeadwiseLayer) and v.per_head for v, _ in views):
        # Per-head storage (snapkv.headwise): each (row, head) keeps its own segment, no pads.
        indices = torch.stack([torch.cat([i, i.new_zeros(h, width - i.shape[-1])], -1) for i, _ in rows])
        layer.pads = None
        layer.keep_per_head(indices, torch.stack([n for _, n in rows]))
        return
    # Uniform storage: shorter rows are left-filled with masked slots (gathered from slot 0).
    indices = torch.stack([torch.cat([i.new_zeros(h, width - i.shape[-1]), i], -1) for i, _ in rows])
    pads = torch.tensor([width - i.shape[-1] for i, _ in rows], device=dev)
    # Kept even when all zero: transformers' 2-D mask must not be used on the compressed slots.
    layer.keep(indices, pads=pads)


def keep_rows(layer: CompressibleLayer, rows: list[torch.Tensor]) -> None:
    """Keep, in each batch row r, the entries at `rows[r]` `[kv_heads, n_r]` (ascending indices into
    the stored axis), rows keeping different numbers (ChunkKV: a row that keeps the short trailing
    chunk keeps fewer). Shorter rows are left-filled with masked slots (`pads`, as a padded batch's
    are) that copy the row's first kept entry, so every slot's position is one the row keeps."""
    if layer.pads is not None:
        raise ValueError("keep_rows() needs a layer without pads (padded batches run per row: row_view)")
    width = max(r.shape[-1] for r in rows)
    if all(r.shape[-1] == width for r in rows):
        layer.keep(torch.stack(rows))
        return
    filled = [torch.cat([r[:, :1].expand(-1, width - r.shape[-1]), r], dim=-1) for r in rows]
    pads = torch.tensor([width - r.shape[-1] for r in rows], device=layer.keys.device)
    layer.keep(torch.stack(filled), pads=pads)
    layer.prompt_pads = torch.zeros_like(pads)  # no pad in the prompt: real position = stored position


def compress_prefill_rows(method, layer: CompressibleLayer, query: torch.Tensor, module) -> None:
    """`method.observe` + `method.compress_prefill` of a padded layer, row by row (see module doc)."""
    views = _views(layer, query)
    for v, q in views:
        method.observe(v, q, v.keys, module)
    _write_scores(layer, views)
    for v, q in views:
        method.compress_prefill(v, q, v.keys, module)
    _merge(layer, views)


def observe_rows(method, layer: CompressibleLayer, query: torch.Tensor, module) -> None:
    """`method.observe` of a padded layer's forward (a non-final prefill chunk, or a decode step
    under per-step eviction), row by row."""
    views = _views(layer, query)
    for v, q in views:
        method.observe(v, q, v.keys, module)
    _write_scores(layer, views)


def compress_decode_rows(method, layer: CompressibleLayer, query: torch.Tensor | None, module) -> bool:
    """A scheduled decode-time compression (`method.compress_decode`) of a padded layer, row by row;
    `query`: the window's queries (None on per-step eviction). Returns whether any row was pruned."""
    views = _views(layer, query)
    pruned = [method.compress_decode(v, q, module) for v, q in views]
    _merge(layer, views)
    return any(pruned)
