"""Ada-KV: "Optimizing KV Cache Eviction by Adaptive Budget Allocation for Efficient LLM Inference"
(https://arxiv.org/abs/2407.11550).

A layer's budget is split across its KV heads instead of giving each head the same share. With
`P = layer budget - window` selectable entries per head and `h` KV heads, the layer selects
`h x P` entries per batch row: a global top-`h*P` over ALL heads' scores (SnapKV's pooled window
votes, GQA-reduced per KV head, `gqa_order` as SnapKV) counts `c_h` entries for head h, and head h
keeps its own top entries plus the whole window; nothing is evicted while decoding (new tokens
are appended to every head). `base`: `snapkv` (uniform layer budgets: Ada-SnapKV) or `pyramidkv`
(PyramidKV's layer schedule, `beta`, `schedule`, `short_prompt`: Ada-PyramidKV; `short_prompt`
defaults to `clip` here, as AdaKV's code has no uniform fallback). Defaults follow the Ada-KV
code: window 32, kernel 7, max-pool, alpha 0.2.

The two formulas, each a named switch (defaults: the Ada-KV code's, `FFY0/AdaKV`
`AdaptiveSnapKVCluster`):

- `allocation="adakv"`: floor `f = int(alpha * P)`, head h keeps `round(c_h * (1 - alpha) + f)`
  (`torch.round`: half to even) selected entries — the paper's `alpha*B + (1-alpha)*B_adaptive`.
  The heads' total can fall short of `h x P` (by `h x frac(alpha*P)` plus rounding: at P=32,
  alpha=0.2 about 0.4 entries per head). `allocation="exact"`: `f = ceil(alpha * P)`, head h keeps
  `f + (P - f) * c_h / P` rounded by largest remainder: the total is exactly `h x P`, each >= f.
  `allocation="kvpress"`: kvpress's `AdaKVPress` (its leaderboard entries): each head first keeps
  its own top `f` entries, then the rest of the layer's `h x P` go to the global top over all
  heads' remaining entries (the total is exactly `h x P`). kvpress counts the protected entries
  (window, sinks) inside its floor `int(alpha x budget)`, so here `f = max(int(alpha x budget) -
  protected, 0)`.
- `normalize=True`: AdaKV's normalisation, each head's scores MULTIPLIED by the share of its score
  mass in its own top-P (`sum(top-P scores) / sum(scores)`) before the global top-k.
  `normalize="sum"`: each head's scores DIVIDED by their sum (every head's scores sum to 1).
  `False`: raw scores.

Storage (`layout`) is per head, with real memory savings (`snapkv.headwise`): `varlen` (default)
keeps one flat `[total_kept, head_dim]` tensor per layer for K and V with `cu_seqlens` (attended
with flash-attn's varlen kernel on CUDA, an exact PyTorch fallback elsewhere): allocated bytes ==
logical bytes; `padded` pads each layer to its longest head with a validity mask (allocated =
longest head x heads). `GenerationResult.kv_bytes` is what is allocated, `kv_bytes_logical` what is
kept.

Supported: `snapkv.generate` / `generate_ids`, chunked prefill, query-aware and query-agnostic, and
`model.generate` inside `snapkv.apply` for greedy / sampling decoding (beam search and batch
re-indexing raise ValueError). The cache must come from `method.cache_layer`
(`CompressedCache(config, layer_factory=method.cache_layer)`; `apply` and `generate` do this).

A budget policy around any scorer (`snapkv.methods.compose`, kvpress' `AdaKVPress(press)`):
`scorer` (default `snapkv`) names the method whose scores the heads' allocation ranks, e.g.
`scorer="tova"` or `"expected_attention"` (`adakv_expected_attention` is that composition with its
own flat parameters and defaults); `window` above is then the scorer's protected entries
(`protected()`), which every head keeps and each head's budget counts. `base` chooses the layer
budgets the heads split: uniform (`snapkv`) or PyramidKV's (`pyramidkv`), whatever the scorer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from snapkv.headwise import LAYOUTS, HeadwiseLayer
from snapkv.methods.checks import number, one_of
from snapkv.methods.pyramidkv import LayerBudgets
from snapkv.methods.registry import register

BASES = ("snapkv", "pyramidkv")
ALLOCATIONS = ("adakv", "exact", "kvpress")
NORMALIZE = (False, True, "sum")


def head_budgets(
    scores: torch.Tensor,
    per_head: int,
    alpha: float,
    normalize: bool | str = False,
    allocation: str = "adakv",
    protected: int = 0,
) -> torch.Tensor:
    """Ada-KV's allocation: `[batch, kv_heads]` selectable entries per head.

    scores `[batch, kv_heads, n]` (n > per_head) of the selectable (non-window) entries; `normalize`
    and `allocation` as in the module docstring; `protected`: the entries each head keeps beside
    its selectable ones (only `allocation="kvpress"` counts them, in its floor). With
    `allocation="exact"` or `"kvpress"` the heads' budgets sum to `kv_heads * per_head` per batch
    row; `"exact"` gives each at least ceil(alpha * per_head).
    """
    b, h, n = scores.shape
    s = scores.float()
    tiny = torch.finfo(torch.float32).tiny
    # Protected entries (+inf, `Method.shield`) stay first; the normalisations weigh the others.
    mass = s.masked_fill(s == math.inf, 0)
    if normalize is True:
        top_mass = mass.sort(dim=-1, descending=True).values[..., :per_head].sum(dim=-1, keepdim=True)
        s = s * (top_mass / mass.sum(dim=-1, keepdim=True).clamp_min(tiny))
    elif normalize == "sum":
        s = s / mass.sum(dim=-1, keepdim=True).clamp_min(tiny)
    if allocation == "kvpress":
        # Each head's own top `floor` entries are in first (kvpress's safeguard), then the global top.
        floor = max(int((per_head + protected) * alpha) - protected, 0)
        own = s.sort(dim=-1, descending=True, stable=True).indices[..., :floor]
        s = s.scatter(-1, own, math.inf)
    # Global top-(h * P) over all heads of the row; stable sort: ties to the lower (head, position).
    top = s.reshape(b, h * n).sort(dim=-1, descending=True, stable=True).indices[:, : h * per_head]
    chosen = torch.zeros(b, h, dtype=torch.long, device=s.device)
    chosen.scatter_add_(1, top // n, torch.ones_like(top))
    if allocation == "kvpress":
        return chosen
    if allocation == "adakv":
        # The original's arithmetic: int floor, an fp32 product, torch.round (half to even).
        return torch.round(chosen * (1 - alpha) + int(per_head * alpha)).long()
    floor = min(per_head, math.ceil(round(alpha * per_head, 9)))
    # Exact integers: real budget = (floor * P + (P - floor) * c) / P; sum over heads = h * P.
    numer = floor * per_head + (per_head - floor) * chosen
    ints, rem = numer // per_head, numer % per_head
    left = h * per_head - ints.sum(dim=-1, keepdim=True)  # [b, 1], < h
    rank = rem.sort(dim=-1, descending=True, stable=True).indices.argsort(dim=-1)
    return ints + (rank < left).long()


def keep_top_per_head(layer, scores: torch.Tensor, counts: torch.Tensor) -> None:
    """Keep, per (batch row, KV head), its `counts[b, h]` top-scored entries on per-head storage.

    scores `[batch, kv_heads, stored]` (protected entries: +inf), counts `[batch, kv_heads]` (int64,
    protected entries included). Ties go to the earlier position (stable sort)."""
    if not isinstance(layer, HeadwiseLayer):
        raise ValueError(
            "per-head budgets need per-head storage: build the cache with "
            "CompressedCache(config, layer_factory=method.cache_layer) (snapkv.generate and "
            f"snapkv.apply do), got {type(layer).__name__}"
        )
    n, m = scores.shape[-1], int(counts.max())
    order = scores.float().sort(dim=-1, descending=True, stable=True).indices[..., :m]
    live = torch.arange(m, device=scores.device) < counts[..., None]
    # Kept entries first (ascending), then fill past each head's count (ignored by keep_per_head).
    indices = order.masked_fill(~live, n).sort(dim=-1).values.clamp(max=n - 1)
    layer.keep_per_head(indices, counts)


# The parameters of Ada-KV head budgets, for every method that takes them (`Method.checks`).
HEAD_ALLOCATION_CHECKS = {
    "alpha": number(0, 1),
    "allocation": one_of(ALLOCATIONS),
    "layout": one_of(LAYOUTS),
}


@register
@dataclass
class AdaKV(LayerBudgets):
    name = "adakv"

    budget: int | None = 1024  # mean entries per KV head per layer (x kv_heads = the layer's total)
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"  # max | avg | none
    gqa_reduce: str = "mean"  # mean | max | sum
    gqa_order: str = "reduce_first"  # reduce_first (AdaKV's gqa_support) | pool_first
    beta: float = 20  # base=pyramidkv only
    schedule: str = "exact"  # base=pyramidkv only: exact | floor
    short_prompt: str = "clip"  # base=pyramidkv only: clip (AdaKV) | uniform (KVCache-Factory)
    base: str = "snapkv"  # snapkv | pyramidkv: the layer budgets (uniform | PyramidKV's pyramid)
    alpha: float = 0.2  # floor share: each head keeps >= alpha * (layer budget - window) + window
    allocation: str = "adakv"  # adakv: int floor, per-head round | exact: ceil floor, exact total | kvpress
    normalize: bool | str = False  # True: AdaKV's top-P mass ratio | "sum": divide by the sum
    layout: str = "varlen"  # varlen | padded

    # Rows written before these switches existed: pool-then-reduce, the exact allocation (ceil floor,
    # largest remainder) and `normalize=True` meaning "divide by the head's sum" (today's "sum").
    legacy_params: ClassVar[dict[str, Any]] = {"gqa_order": "pool_first", "allocation": "exact"}

    @classmethod
    def upgrade_params(cls, params: dict[str, Any]) -> dict[str, Any]:
        if "allocation" not in params and params.get("normalize") is True:
            params = {**params, "normalize": "sum"}
        return super().upgrade_params(params)

    checks = {
        "base": one_of(BASES),
        **HEAD_ALLOCATION_CHECKS,
        "normalize": one_of(NORMALIZE),
    }

    @property
    def pyramid(self) -> bool:
        return self.base == "pyramidkv"

    def cache_layer(self, index: int, num_layers: int) -> HeadwiseLayer:
        return HeadwiseLayer(index=index, num_layers=num_layers, layout=self.layout)

    def prune(self, layer, scores: torch.Tensor, budget: int) -> None:
        # scores [b, kv, L]; the scorer's protected entries (SnapKV's window: the last `window`)
        # are kept by every head and counted in its budget, the rest is split across the heads.
        first, last = self.protected()
        selectable = scores[..., first : scores.shape[-1] - last]
        kept = first + last
        counts = head_budgets(selectable, budget - kept, self.alpha, self.normalize, self.allocation, kept)
        # Per head: its top counts[b, h] selectable entries, then the protected ones.
        keep_top_per_head(layer, protect(scores, first, last), counts + kept)


def protect(scores: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """`scores` `[..., n]` (as fp32) with the `first` leading and `last` trailing entries at +inf."""
    out = scores.float().clone()
    out[..., :first] = math.inf
    if last:
        out[..., out.shape[-1] - last :] = math.inf
    return out
