"""ChunkKV: "Semantic-Preserving KV Cache Compression for Efficient Long-Context LLM Inference"
(https://arxiv.org/abs/2502.00299).

SnapKV's scores (observation window, pooling, GQA reduction: `snapkv.methods.snapkv`) summed over
fixed chunks of `chunk_length` consecutive prefix positions; a layer keeps whole chunks plus the
window. The prefix `[0, L - window)` is cut into chunks from position 0, so the last chunk holds the
trailing `(L - window) % chunk_length` positions when that is not 0. A chunk's score is the sum of
its positions' scores over all KV heads (one kept set per layer, the same positions for every head),
and the layer keeps the window plus the `(budget - window) // chunk_length` best chunks. Entries of
the budget left unused: with m = budget - window, c = chunk_length and r = (L - window) % c, whole
chunks leave `m % c`, and a kept short trailing chunk (r > 0) takes a whole chunk's slot for r
entries, leaving `c - r` more: at most `2 (c - 1)` (kvpress' c = 20 at budget 512, window 32, r = 2:
18). A row that keeps the short chunk keeps fewer entries (rows of a batch that then differ are
left-filled with masked slots, `snapkv.padding.keep_rows`). Each batch row chooses its own chunks.
Prompts with L <= budget are not compressed; nothing is evicted while decoding.

The authors' code is kvpress' `ChunkKVPress` (NVIDIA/kvpress @
8bb29b9c3078452a86d692f29123fa6c793e2b05, `kvpress/presses/chunkkv_press.py`, around a
`SnapKVPress`). Differences, with their switches:

- SnapKV's scores take SnapKV's defaults here (window 32, max-pool 7, `gqa_order` reduce_first),
  as every SnapKV-family method of the package, so that ChunkKV differs from `snapkv` by its chunks
  alone. kvpress' registry entry wraps its `SnapKVPress` (window 64, kernel 5, average pooling per
  query head, then the group mean): `window=64 kernel_size=5 pooling=avg gqa_order=pool_first`.
- `chunk_length`: 10 (default, the paper's setting) | kvpress' default 20.
- `chunk_score`: `sum` (default, the paper's chunk sum) | `mean` (kvpress: a chunk's mean, which
  ranks full chunks the same and favours the short trailing chunk).
- `reuse_layers`: layer-wise index reuse (the paper's, not in kvpress): the compressible layers
  form groups of `reuse_layers` consecutive ones; the first of a group scores and chooses, the
  others keep the same positions without scoring. 1 (default) = every layer chooses its own.
- Not switches: kvpress chunks the whole sequence and keeps the window only through its high
  SnapKV score (the window's chunks nearly always win); here the window is always kept and only the
  prefix is chunked, as in the paper. kvpress keeps `int(chunks x (1 - ratio))` chunks; the budget
  here is an entry count. kvpress applies batch row 0's chunks to every row; here each row chooses.

Kept entries are stored in position order (kvpress sorts them too); attention does not depend on
the order of the keys, and ascending positions are what the rest of the cache expects.

A selection rule around any scorer (`snapkv.methods.compose`, kvpress' `ChunkKVPress(press)`):
`scorer` (default `snapkv`, the paper's) names the method whose per-entry scores the chunks sum,
e.g. `scorer="knorm"`; `window` above is then the scorer's protected entries (`protected()`:
trailing ones as the window, leading ones such as Expected Attention's sinks kept before the first
chunk, which starts after them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapkv.methods.checks import integer, one_of
from snapkv.methods.compose import ScorerWrapper
from snapkv.methods.registry import register
from snapkv.padding import keep_rows

CHUNK_SCORES = ("sum", "mean")


def chunk_selection(
    scores: torch.Tensor, window: int, chunk_length: int, n_chunks: int, how: str = "sum", first: int = 0
) -> list[torch.Tensor]:
    """ChunkKV's kept indices, one ascending `[n_r]` tensor per batch row.

    scores `[batch, kv_heads, L]` (the window's own entries last; `first`: leading protected
    entries, e.g. a scorer's sinks, kept like the window); the entries between them are cut into
    chunks of `chunk_length` from position `first` (the last one may be shorter), each scored by
    the sum (or mean) of its positions' scores over all heads; the `n_chunks` best (stable: ties to
    the earlier chunk), the first `first` entries and the window are kept.
    """
    b, _, length = scores.shape
    prefix = length - window - first
    per_pos = scores[..., first : length - window].float().sum(dim=1)  # [b, P]
    chunk_of = torch.arange(prefix, device=scores.device) // chunk_length  # [P]
    n_total = -(-prefix // chunk_length)
    chunk = per_pos.new_zeros(b, n_total).index_add_(1, chunk_of, per_pos)  # [b, C]
    if how == "mean":
        chunk = chunk / torch.bincount(chunk_of, minlength=n_total).to(chunk.dtype)
    best = chunk.sort(dim=-1, descending=True, stable=True).indices[:, :n_chunks]  # [b, n]
    chosen = torch.zeros(b, n_total, dtype=torch.bool, device=scores.device).scatter_(1, best, True)
    kept = torch.cat([chosen.new_ones(b, first), chosen[:, chunk_of], chosen.new_ones(b, window)], dim=-1)
    return [row.nonzero().flatten() for row in kept]


@register
@dataclass
class ChunkKV(ScorerWrapper):
    name = "chunkkv"

    budget: int | None = 1024  # entries per KV head per layer, window included; whole chunks are kept
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"  # max | avg | none
    gqa_reduce: str = "mean"  # mean | max | sum
    gqa_order: str = "reduce_first"  # reduce_first | pool_first (kvpress)
    chunk_length: int = 10  # positions per chunk (paper: 10; kvpress: 20)
    chunk_score: str = "sum"  # sum (paper) | mean (kvpress)
    reuse_layers: int = 1  # layer-wise index reuse: layers per group sharing the first one's chunks

    checks = {
        "budget": integer(needed=True),
        "chunk_length": integer(),
        "chunk_score": one_of(CHUNK_SCORES),
        "reuse_layers": integer(),
    }

    def validate(self) -> None:
        super().validate()
        c, (first, last) = self.chunk_length, self.protected()
        if self.budget - first - last < c:
            raise ValueError(
                f"the budget keeps no whole chunk beside the protected entries: need budget - "
                f"{first + last} >= chunk_length ({self.protected_entries()}), got budget={self.budget}, "
                f"chunk_length={c}"
            )

    def compress(self, layer, query, key, module, budget: int) -> None:
        group = ("chunkkv", layer.rank - layer.rank % self.reuse_layers)
        if layer.rank % self.reuse_layers:
            # The group's first layer chose for the same prompt, just before (layers run in order).
            rows = layer.shared.get(group)
            if rows is None or len(rows) != layer.dims[0] or int(max(r[-1] for r in rows)) >= layer.stored:
                raise RuntimeError(f"layer {layer.index}: no selection of its reuse group's first layer")
        else:
            scores = self.shield(layer, self.score(layer, query, key, module), budget)
            first, last = self.protected()
            rows = chunk_selection(
                scores, last, self.chunk_length, (budget - first - last) // self.chunk_length,
                self.chunk_score, first,
            )  # fmt: skip
            if self.reuse_layers > 1:
                layer.shared[group] = rows
        keep_rows(layer, [r.expand(layer.dims[1], -1) for r in rows])
