"""PyramidKV: "Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(https://arxiv.org/abs/2406.02069).

SnapKV's scores (observation window, pooling, GQA reduction: see `snapkv.methods.snapkv`) with a
budget per layer that shrinks linearly with depth: attention is spread widely in the lower layers
and concentrated in the upper ones. With `P = budget - window` selectable entries per head, the
schedule (PyramidKV paper / KVCache-Factory) runs linearly from `2P - P/beta` entries in the first
compressible layer to `P/beta` in the last, so that its mean is `P`; every layer also keeps the
window. When the first layer would keep more than the prompt's prefix (`2P - P/beta > L - window`)
the top is clipped to `L - window` and the bottom raised to `2P - (L - window)`, mean unchanged.

Two switches cover what KVCache-Factory (the PyramidKV authors' code) does differently:

- `schedule`: `exact` (default) rounds the real-valued schedule by largest remainder (ties to the
  lower layer), so the integer budgets sum to `budget x n_layers` and each is within one entry of
  its real value. `floor` is KVCache-Factory's integer schedule: `lo = P // beta`, `hi = 2P - lo`,
  step `(hi - lo) // (n_layers - 1)`, layer i keeps `hi - i x step`; it overspends at small
  budgets (budget 64, window 8, 32 layers: prefix budgets 110 - 3i, a mean of 63.5 instead of 56
  selectable entries, +13%), which is why it is not the default.
- `short_prompt`: what happens when the prompt is longer than the budget but shorter than
  `2 x (budget - window)`. `uniform` (default, KVCache-Factory): every layer keeps `budget`, as
  SnapKV. `clip`: the clipped pyramid above runs (AdaKV's own pyramid code has no such fallback;
  Ada-KV's default here).

Hybrid models: only the compressible (full-attention) layers are counted and ranked.

Hyper-parameters: `budget` (mean entries per KV head per layer, window included), `beta` (pyramid
steepness: the last layer keeps P/beta selectable entries; paper/code default 20; 1 = uniform),
`schedule`, `short_prompt` and SnapKV's `window`, `kernel_size`, `pooling`, `gqa_reduce`,
`gqa_order`. `budget - window >= beta` is required so that every layer keeps at least one entry
beyond the window. Prompts with L <= budget are not compressed. The realised per-layer budgets are `GenerationResult.kv_tokens_per_layer`.

A budget policy around any scorer (`snapkv.methods.compose`): `scorer` (default `snapkv`, the
paper's) names the method whose scores each layer's top-k ranks, e.g. `scorer="tova"`; `window`
above is then the scorer's protected entries (`protected()`: none for TOVA, Expected Attention's
sinks), which every layer keeps and each budget counts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ClassVar

from snapkv.methods.checks import integer, one_of
from snapkv.methods.compose import ScorerWrapper
from snapkv.methods.registry import register


def _largest_remainder(reals: list[Fraction], total: int) -> list[int]:
    """Integers summing to `total` (= sum(reals)), each floor or ceil of its real value; the
    remainder goes to the largest fractional parts, ties to the lower index."""
    ints = [r.numerator // r.denominator for r in reals]
    left = total - sum(ints)
    order = sorted(range(len(reals)), key=lambda i: (-(reals[i] - ints[i]), i))
    for i in order[:left]:
        ints[i] += 1
    return ints


SCHEDULES = ("exact", "floor")
SHORT_PROMPTS = ("uniform", "clip")


@functools.lru_cache(maxsize=256)
def pyramid_budgets(
    budget: int,
    window: int,
    n_layers: int,
    beta: float = 20,
    length: int | None = None,
    schedule: str = "exact",
) -> tuple[int, ...]:
    """Per-layer budgets (window included), first compressible layer first. `length`: the prompt
    length (clips the top of the pyramid to it). `schedule="exact"`: they sum to `budget * n_layers`
    exactly; `"floor"`: KVCache-Factory's floored integer schedule (may overspend)."""
    p = budget - window
    if n_layers == 1:
        return (budget,)
    if schedule == "floor":
        lo_int = int(p // beta)
        hi_int = 2 * p - lo_int
        if length is not None and hi_int >= length - window:
            hi_int = length - window
            lo_int = 2 * p - hi_int
        step_int = (hi_int - lo_int) // (n_layers - 1)
        return tuple(hi_int - i * step_int + window for i in range(n_layers))
    lo = Fraction(p) / Fraction(beta)
    hi = 2 * p - lo
    if length is not None and hi > length - window:
        hi = Fraction(length - window)
        lo = 2 * p - hi
    step = (hi - lo) / (n_layers - 1)
    prefix = _largest_remainder([hi - i * step for i in range(n_layers)], p * n_layers)
    return tuple(k + window for k in prefix)


# The parameters of PyramidKV's layer budgets, for every method that takes them (`Method.checks`).
PYRAMID_CHECKS = {
    "budget": integer(needed=True),
    "schedule": one_of(SCHEDULES),
    "short_prompt": one_of(SHORT_PROMPTS),
}


@dataclass
class LayerBudgets(ScorerWrapper):
    """The layer-budget policy around a scorer: PyramidKV's pyramid where `pyramid` says so (here:
    always; Ada-KV and CriticalKV: their `base` switch), else every layer keeps `budget`. The
    scorer's protected entries (`protected()`: SnapKV's window) are kept in every layer and
    counted in each budget, as the window is in the paper's."""

    beta: float = 20  # the last layer keeps (budget - window) / beta selectable entries
    schedule: str = "exact"  # exact (mean == budget) | floor (KVCache-Factory's, overspends)
    short_prompt: str = "uniform"  # budget < L < 2(budget - window): uniform (KVCache-Factory) | clip

    checks = PYRAMID_CHECKS

    @property
    def pyramid(self) -> bool:
        """Whether layer budgets follow the pyramid (Ada-KV's and CriticalKV's `base`)."""
        return True

    def validate(self) -> None:
        super().validate()
        # `beta` only matters (and is only checked) where the layer budgets follow the pyramid.
        if not self.pyramid:
            return
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not self.beta >= 1:
            raise ValueError(f"beta must be a number >= 1, got beta={self.beta!r}")
        kept = sum(self.protected())
        if self.budget - kept < self.beta:
            raise ValueError(
                f"budget too small for the protected entries across the pyramid: the last layer would "
                f"keep (budget - {kept}) / beta = ({self.budget} - {kept}) / {self.beta} < 1 entry beyond "
                f"them ({self.protected_entries()}); need budget >= {kept} + beta, got "
                f"budget={self.budget}, beta={self.beta}"
            )

    def layer_budget(self, layer) -> int | None:
        if not self.pyramid or layer.seen <= self.budget:
            return self.budget  # short prompts stay uncompressed, as with SnapKV
        kept = sum(self.protected())
        if self.short_prompt == "uniform" and layer.seen < 2 * (self.budget - kept):
            return self.budget  # KVCache-Factory's fallback: SnapKV's uniform budgets
        budgets = pyramid_budgets(
            self.budget, kept, layer.num_compressible, self.beta, layer.seen, self.schedule
        )
        return budgets[layer.rank]


@register
@dataclass
class PyramidKV(LayerBudgets):
    name = "pyramidkv"

    budget: int | None = 1024  # MEAN entries per KV head over the compressible layers, window included
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"  # max | avg | none
    gqa_reduce: str = "mean"  # mean | max | sum
    gqa_order: str = "reduce_first"  # reduce_first | pool_first
    beta: float = 20  # the last layer keeps (budget - window) / beta selectable entries
    schedule: str = "exact"  # exact (mean == budget) | floor (KVCache-Factory's, overspends)
    short_prompt: str = "uniform"  # budget < L < 2(budget - window): uniform (KVCache-Factory) | clip

    # Rows written before these switches existed: pool-then-reduce, and a clipped pyramid on short prompts.
    legacy_params: ClassVar[dict[str, Any]] = {"gqa_order": "pool_first", "short_prompt": "clip"}
