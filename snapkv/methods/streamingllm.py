"""StreamingLLM: "Efficient Streaming Language Models with Attention Sinks" (https://arxiv.org/abs/2309.17453).

Keeps the first `n_sink` tokens (attention sinks) and the most recent `budget - n_sink`, rolling
while decoding. `positions="original"` (default, what harnesses usually do) keeps each key at its
original position; `positions="compacted"` re-rotates the kept keys to their slot in the cache, as
the paper does (it caches keys before RoPE) — this matches the paper only in that mode, needs a
standard rotate-half RoPE, and only works in `snapkv.generate` (not `model.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from snapkv.methods.base import GenerateCheck, Method
from snapkv.methods.checks import integer, one_of
from snapkv.methods.registry import register
from snapkv.rope import compact, rope_inv_freq


@register
@dataclass
class StreamingLLM(GenerateCheck, Method):
    name = "streamingllm"
    evict_during_decode = True  # a rolling cache: always (not a field, so not a switch)
    schedulable = False  # see Method.schedulable

    budget: int | None = 1024
    n_sink: int = 4
    positions: str = "original"  # original | compacted

    checks = {
        "budget": integer(needed=True),
        "n_sink": integer(0, rule="a non-negative integer"),
        "positions": one_of(("original", "compacted"), rule="'original' or 'compacted'"),
    }

    def validate(self) -> None:
        super().validate()
        if self.protect != "none":  # sinks + the most recent tokens are the whole budget
            raise ValueError(
                f"{self.name} keeps exactly its sinks and most recent tokens (its budget): protect must "
                f"be none, got protect={self.protect!r}"
            )
        if self.n_sink >= self.budget:
            raise ValueError(f"n_sink must be < budget, got n_sink={self.n_sink}, budget={self.budget}")

    @property
    def evicts_in_place(self) -> bool:  # type: ignore[override]
        # The rolling buffer: the oldest non-sink entry's slot takes the new token. Compacted
        # positions re-rotate every kept key to its slot, which needs the ordered path.
        return self.positions == "original"

    def victims(self, layer) -> int:
        # Sinks and recent tokens fill the budget: the one entry left is the oldest non-sink. The
        # in-place path has no pads, so every row and head holds the same positions: one slot
        # (read off row 0, head 0) serves them all. The sinks sit in the first `n_sink` slots
        # (kept in position order, never a victim, never the moved last entry), so the oldest of
        # the rest is an argmin over the slots after them. The base class's rule gives the same.
        return self.n_sink + int(layer.positions[0, 0, self.n_sink :].argmin())

    def protected(self) -> tuple[int, int]:
        # Together exactly the budget: sinks + the most recent tokens; scores are not needed.
        return self.n_sink, self.budget - self.n_sink

    # Compacted positions: the model's RoPE frequencies (not a field: not a hyper-parameter).
    _inv_freq = None

    def post_init_from_model(self, model) -> None:
        self._inv_freq = rope_inv_freq(model) if self.positions == "compacted" else None

    def check_model_generate(self) -> None:
        if self.positions == "compacted":
            raise ValueError("positions='compacted' is only supported by snapkv.generate, not model.generate")

    def prune(self, layer, scores: torch.Tensor, budget: int) -> None:
        super().prune(layer, scores, budget)
        if self.positions == "compacted":
            compact(layer, self._inv_freq)  # the kept key at slot i is re-rotated to position i
