"""H2O: "Heavy-Hitter Oracle for Efficient Generative Inference" (https://arxiv.org/abs/2306.14048).

Each key's score is the attention it has accumulated: the column sums of the causal softmax over
every query so far (prefill queries, then each decoded token's row). A layer keeps the `recent`
last tokens plus the `budget - recent` heaviest. With `evict_during_decode` (the original) eviction
runs at every decoding step and evicted tokens never return; otherwise only once after prefill.
`normalize` divides a key's sum by the number of queries that could see it (column sums favour
early tokens). Scores are computed in query blocks against the causal prefix, never L x L, with
the module's logit soft-capping (Gemma 2) and attention sinks (gpt-oss) when it applies them.
GQA: the query heads' sums are reduced over the group (`gqa_reduce`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapkv.methods.base import (
    GQA_REDUCTIONS,
    Method,
    OwnAttention,
    attention_output,
    blockwise_attention,
    causal_column_sums,
    reduce_group,
    window_attention,
)
from snapkv.methods.checks import flag, integer, number, one_of
from snapkv.methods.registry import register


@register
@dataclass
class H2O(OwnAttention, Method):
    name = "h2o"
    schedulable = False  # see Method.schedulable

    budget: int | None = 1024  # heavy + recent
    recent: int | None = None  # recent tokens kept; None: recent_ratio * budget
    recent_ratio: float = 0.5
    evict_during_decode: bool = True
    normalize: bool = False
    gqa_reduce: str = "mean"
    block_size: int = 256  # queries per scoring block (bounded further by memory)
    # Prefill: compute the attention output and the column sums in one blockwise pass instead of
    # running the model's attention and then re-deriving the weights (~2x less prefill work). Used
    # only where the module's attention is plain scaled softmax (the hooks check: no logit
    # soft-capping, no attention sinks, no padding); elsewhere the model's own attention runs. It
    # computes in fp32: equal to the model's attention to fp32 rounding in fp32, and in bf16/fp16
    # more precise than (so not identical to) the model's own half-precision attention.
    fused: bool = True

    checks = {
        "budget": integer(needed=True),
        "recent_ratio": number(0, 1, high_open=True),
        "evict_during_decode": flag(),
        "normalize": flag(),
        "gqa_reduce": one_of(GQA_REDUCTIONS),
        "block_size": integer(rule="positive"),
        "fused": flag(),
    }

    def validate(self) -> None:
        super().validate()
        r = self.recent
        if r is not None and not (isinstance(r, int) and not isinstance(r, bool) and 0 <= r < self.budget):
            raise ValueError(f"recent must be in [0, budget), got recent={r!r}, budget={self.budget}")

    @property
    def n_recent(self) -> int:
        return self.recent if self.recent is not None else int(self.budget * self.recent_ratio)

    def protected(self) -> tuple[int, int]:
        return 0, self.n_recent

    def _accumulate(self, layer, sums: torch.Tensor) -> None:
        sums = reduce_group(sums, self.gqa_reduce)
        layer.scores = sums if layer.scores is None else layer.scores + sums

    def prefill_attention(self, layer, query, key, value, module):
        if not self.fused:
            return None
        q = query.shape[2]
        qpos = torch.arange(layer.seen - q, layer.seen, device=key.device)
        sums, out = blockwise_attention(
            query, key, qpos, layer.positions, module.scaling, value, self.block_size
        )
        self._accumulate(layer, sums)  # the hooks skip observe() for this chunk: counted once
        return out.transpose(1, 2).contiguous()

    def decode_attention(self, layer, query, key, value, module):
        if not (self.fused and self.evict_during_decode):
            return None
        probs = window_attention(query, key, 1, module.scaling, layer.softcap, layer.sinks)  # [b, kv, g, L]
        self._accumulate(layer, probs)  # the hooks skip observe() for this step: counted once
        return attention_output(probs, value, query.dtype)

    def observe(self, layer, query, key, module) -> None:
        # After the prefill the hooks call it only under per-step eviction (`EveryStep`).
        q = query.shape[2]
        if q == 1 and layer.state == "ready":
            # A decode step: every stored entry precedes the query, so the column sums are the one
            # query's softmax row (no causal mask, no blocks; any entry order).
            self._accumulate(
                layer, window_attention(query, key, 1, module.scaling, layer.softcap, layer.sinks)
            )
            return
        qpos = torch.arange(layer.seen - q, layer.seen, device=key.device)
        sums = causal_column_sums(
            query,
            key,
            qpos,
            layer.positions,
            module.scaling,
            self.block_size,
            None,
            layer.softcap,
            layer.sinks,
        )
        self._accumulate(layer, sums)

    def _scores(self, layer) -> torch.Tensor:
        if not self.normalize:
            return layer.scores
        # Queries that could see key j: those at positions >= its own.
        return layer.scores / (layer.seen - layer.positions).clamp(min=1)

    def score(self, layer, query, key, module) -> torch.Tensor:
        return self._scores(layer)

    def decode_score(self, layer) -> torch.Tensor:
        return self._scores(layer)
