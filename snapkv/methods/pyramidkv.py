"""PyramidKV: "Dynamic KV Cache Compression based on Pyramidal Information Funneling"
(https://arxiv.org/abs/2406.02069).

SnapKV's scores (observation window, pooling, GQA reduction: see `snapkv.methods.snapkv`) with a
budget per layer that shrinks linearly with depth: attention is spread widely in the lower layers
and concentrated in the upper ones. With `P = budget - window` selectable entries per head, the
schedule (PyramidKV paper / KVCache-Factory) runs linearly from `2P - P/beta` entries in the first
compressible layer to `P/beta` in the last, so that its mean is `P`; every layer also keeps the
window. When the first layer would keep more than the prompt's prefix (`2P - P/beta > L - window`)
the top is clipped to `L - window` and the bottom raised to `2P - (L - window)`, mean unchanged.

Budgets here are integers whose MEAN over the compressible layers is exactly `budget`: the
real-valued schedule is rounded by largest remainder (ties to the lower layer), so the integer
budgets sum to `budget x n_layers` and each differs from its real value by less than one entry.
KVCache-Factory instead floors the per-layer step (`(max - min) // (n_layers - 1)`), which
overspends at small budgets: budget 64, window 8, 32 layers gives prefix budgets 110 - 3i, a mean
of 63.5 instead of 56 selectable entries (+13%; 71.5 instead of 64 in total, +12%). Its fallback
to uniform SnapKV budgets for prompts shorter than 2P is not reproduced (the clipped pyramid runs).
Hybrid models: only the compressible (full-attention) layers are counted and ranked.

Hyper-parameters: `budget` (mean entries per KV head per layer, window included), `beta` (pyramid
steepness: the last layer keeps P/beta selectable entries; paper/code default 20; 1 = uniform) and
SnapKV's `window`, `kernel_size`, `pooling`, `gqa_reduce`. `budget - window >= beta` is required so
that every layer keeps at least one entry beyond the window. Prompts with L <= budget are not
compressed. The realised per-layer budgets are `GenerationResult.kv_tokens_per_layer`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction

from snapkv.methods.registry import register
from snapkv.methods.snapkv import SnapKV


def _largest_remainder(reals: list[Fraction], total: int) -> list[int]:
    """Integers summing to `total` (= sum(reals)), each floor or ceil of its real value; the
    remainder goes to the largest fractional parts, ties to the lower index."""
    ints = [r.numerator // r.denominator for r in reals]
    left = total - sum(ints)
    order = sorted(range(len(reals)), key=lambda i: (-(reals[i] - ints[i]), i))
    for i in order[:left]:
        ints[i] += 1
    return ints


@functools.lru_cache(maxsize=256)
def pyramid_budgets(
    budget: int, window: int, n_layers: int, beta: float = 20, length: int | None = None
) -> tuple[int, ...]:
    """Per-layer budgets (window included), first compressible layer first, summing to
    `budget * n_layers` exactly. `length`: the prompt length (clips the top of the pyramid to it)."""
    p = budget - window
    if n_layers == 1:
        return (budget,)
    lo = Fraction(p) / Fraction(beta)
    hi = 2 * p - lo
    if length is not None and hi > length - window:
        hi = Fraction(length - window)
        lo = 2 * p - hi
    step = (hi - lo) / (n_layers - 1)
    prefix = _largest_remainder([hi - i * step for i in range(n_layers)], p * n_layers)
    return tuple(k + window for k in prefix)


@register
@dataclass
class PyramidKV(SnapKV):
    name = "pyramidkv"

    budget: int | None = 1024  # MEAN entries per KV head over the compressible layers, window included
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"  # max | avg | none
    gqa_reduce: str = "mean"  # mean | max | sum
    beta: float = 20  # the last layer keeps (budget - window) / beta selectable entries

    @property
    def pyramid(self) -> bool:
        """Whether layer budgets follow the pyramid (Ada-KV's base=snapkv: uniform)."""
        return True

    def validate(self) -> None:
        super().validate()
        if self.budget is None:
            raise ValueError(f"{self.name} needs a budget, got budget=None")
        if not self.pyramid:
            return
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not self.beta >= 1:
            raise ValueError(f"beta must be a number >= 1, got beta={self.beta!r}")
        if self.budget - self.window < self.beta:
            raise ValueError(
                f"budget too small for the window across the pyramid: the last layer would keep "
                f"(budget - window) / beta = ({self.budget} - {self.window}) / {self.beta} < 1 entry "
                f"beyond the window; need budget >= window + beta, got budget={self.budget}, "
                f"window={self.window}, beta={self.beta}"
            )

    def layer_budget(self, layer) -> int | None:
        if not self.pyramid or layer.seen <= self.budget:
            return self.budget  # short prompts stay uncompressed, as with SnapKV
        return pyramid_budgets(self.budget, self.window, layer.num_compressible, self.beta, layer.seen)[
            layer.rank
        ]
