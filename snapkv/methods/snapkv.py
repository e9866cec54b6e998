"""SnapKV: "LLM Knows What You are Looking for Before Generation" (https://arxiv.org/abs/2404.14469).

Once per layer at the end of prefill, the last `window` prompt tokens (the observation window; with
LongBench prompts the question is inside it) vote for prefix positions: their fp32 softmax attention
over the full row is summed over the window, pooled along the sequence (`kernel_size`, max or avg),
and each KV head keeps the top `budget - window` prefix positions plus the whole window. Kept keys
keep their original positions; nothing is evicted while decoding. Paper settings: LongBench
window 32, kernel 7, max-pool, budget 1024/2048/4096; needle to 380K: window 16, kernel 5, budget 1024.

GQA: the original code repeats K/V to every query head before caching (each query head keeps its own
set: the group's memory times the group size). Here each query head votes, the votes are combined
over the group (`gqa_reduce`: mean | max | sum) and the cache stays at KV-head granularity.
`gqa_order` says where the pooling goes:

- `reduce_first` (default): reduce the group's votes, then pool once per KV head — the public GQA
  ports: KVCache-Factory's kv-head mode (`gqa_score_agg`) and AdaKV's `gqa_support` (mean).
- `pool_first`: pool each query head's votes, then reduce — kvpress's order (it average-pools).

With `pooling=avg` (or none) and `gqa_reduce` mean / sum the two orders give the same scores (both
steps are linear); with max-pooling they keep different entries.

`span` (OUR variant, not in the paper; default None = the paper): after pooling and the group
reduction, every prefix position's score becomes the max of the scores of the `span` positions
ending at it, `s'[i] = max(s[max(0, i - span + 1)], ..., s[i])` (prefix only; the window stays
protected). A voted position thereby lends its score to the `span - 1` positions after it, so a
vote for the start of a multi-token item (the first digit of a number that is tokenized one digit
per token) keeps the item's tail; max-pooling with kernel k only keeps k // 2 neighbours on each
side. Why forward and not symmetric: the window's votes land on the text that introduces an
item and on its first tokens (on SmolLM2's needle the first digit is kept by far more KV heads than
the last ones: results/README.md, "Digits as single tokens"), so widening backwards spends budget
on text before the item. The rule sees only the scores (no token ids, no tokenizer,
no position of a needle); the base class's top-k keeps exactly `budget` entries, so the budget is
never exceeded: a longer span buys whole runs for fewer voted positions.

While decoding (`decode_schedule`), a scheduled step votes with the schedule's queries
(`decode_schedule.window`, which may be fewer than `window`: 1 is the current token alone) and the
last `window` entries stay protected. `kept_order` says how kept entries are stored: `position`
(default: ascending positions, as every method) or `topk`, the layout of kvpress' `ScorerPress`
(one top-k over all entries, the protected ones scored at the highest prefix score, `F.pad(...,
value=scores.max())` over the whole batch; ties to the earlier slot, where torch's top-k leaves
their order open), so that later pooling runs over slot neighbours and the protected entries are
the last `window` slots, as there (a forward of several tokens after the prefill puts the entries
back in position order first, as `CompressibleLayer.update` does for every layer). `window=64, kernel_size=5, pooling=avg, gqa_order=pool_first,
kept_order=topk, decode_schedule={interval: 1, window: 1}` is the decode-time SnapKV of arXiv
2512.12008's authors (minghui-liu/kvpress, `SnapKVPress` under `ScorerPress.compress_decoding`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from snapkv.methods.base import (
    GQA_ORDERS,
    GQA_REDUCTIONS,
    KEPT_ORDERS,
    POOLINGS,
    KeptOrder,
    Method,
    pool,
    reduce_group,
    window_attention,
)
from snapkv.methods.checks import integer, one_of
from snapkv.methods.registry import register


@register
@dataclass
class SnapKV(KeptOrder, Method):
    name = "snapkv"
    observation_window = "window"  # the last prefill chunk holds the window's queries
    # Scheduled steps vote with the decode schedule's queries, down to the current token alone.
    decode_window_floor = False

    budget: int | None = 1024  # entries kept per KV head per layer, INCLUDING the window
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"  # max | avg | none
    gqa_reduce: str = "mean"  # mean | max | sum
    gqa_order: str = "reduce_first"  # reduce_first (KVCache-Factory, AdaKV) | pool_first (kvpress)
    # Rows written before `gqa_order` existed pooled per query head, then reduced.
    legacy_params: ClassVar[dict[str, Any]] = {"gqa_order": "pool_first"}

    span: int | None = None  # OUR variant: spread each score over the next span-1 positions (None: paper)
    kept_order: str = "position"  # position | topk (kvpress' storage order, see the module doc)
    left_out_at_default: ClassVar[tuple[str, ...]] = ("kept_order",)

    checks = {
        "window": integer(),
        "kernel_size": integer(),
        "pooling": one_of(POOLINGS),
        "gqa_reduce": one_of(GQA_REDUCTIONS),
        "gqa_order": one_of(GQA_ORDERS),
        "span": integer(none=True, rule="None or a positive integer"),
        "kept_order": one_of(KEPT_ORDERS),
    }

    def validate(self) -> None:
        super().validate()
        if self.budget is not None and self.window >= self.budget:
            raise ValueError(f"window must be < budget, got window={self.window}, budget={self.budget}")
        schedule = self.decode_schedule
        votes = min(schedule.window or self.window, self.window)
        if schedule.on and self.kept_order == "topk" and votes > schedule.interval:
            # Top-k order moves older entries into the last slots: only tokens appended since the
            # last compression are known to be the voting queries' own keys (causal inside them).
            raise ValueError(
                f"kept_order=topk votes at scheduled steps with at most decode_schedule.interval queries, "
                f"got {votes} queries (decode_schedule.window={schedule.window}, window={self.window}) "
                f"and interval={schedule.interval}"
            )

    def score(self, layer, query, key, module) -> torch.Tensor:
        # Scheduled steps (the layer is "ready") vote with the decode schedule's queries.
        n = min(self.window, query.shape[2]) if layer.state == "ready" else self.window
        if query.shape[2] < n:
            raise ValueError(
                f"the last prefill chunk must hold the observation window, got {query.shape[2]} tokens "
                f"< window={self.window}"
            )
        votes = window_attention(query, key, n, module.scaling, layer.softcap, layer.sinks)[
            ..., : -self.window
        ]  # [b, kv, g, L-w]
        if self.gqa_order == "reduce_first":
            prefix = pool(reduce_group(votes, self.gqa_reduce), self.kernel_size, self.pooling)
        else:
            prefix = reduce_group(pool(votes, self.kernel_size, self.pooling), self.gqa_reduce)
        prefix = spread_forward(prefix, self.span)  # OUR variant; None: the paper
        # [b, kv, L]: the window's own entries score 0 (they are protected)
        return F.pad(prefix, (0, self.window))

    def protected(self) -> tuple[int, int]:
        return 0, self.window

    def topk_order(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        # kvpress' layout: the protected slots at the highest prefix score of the batch, one top-k
        # over all slots, gathered in that order (a prefix entry tied at the top precedes them).
        n = scores.shape[-1]
        scores = scores.float().clone()
        scores[..., n - self.window :] = scores[..., : n - self.window].max()
        return scores.sort(dim=-1, descending=True, stable=True).indices[..., :budget]


def spread_forward(scores: torch.Tensor, span: int | None) -> torch.Tensor:
    """`out[..., i] = max(scores[..., max(0, i - span + 1) : i + 1])` along the last axis: a causal
    (trailing) running max over `span` positions; `span` None or 1 returns `scores` itself."""
    if span is None or span == 1:
        return scores
    shape = scores.shape
    x = F.pad(scores.reshape(-1, 1, shape[-1]), (span - 1, 0), value=-math.inf)
    return F.max_pool1d(x, span, stride=1).reshape(shape)
