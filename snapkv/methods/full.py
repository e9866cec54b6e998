"""The full cache: the baseline. Runs through the same code path as every method, evicts nothing."""

from __future__ import annotations

from dataclasses import dataclass

from snapkv.methods.base import Method
from snapkv.methods.registry import register


@register
@dataclass
class Full(Method):
    name = "full"
    schedulable = False  # see Method.schedulable

    budget: int | None = None

    checks = {"budget": None}  # refused below with its own message: the full cache takes no budget

    def validate(self) -> None:
        if self.budget is not None:
            raise ValueError(
                f"method 'full' keeps every token and takes no budget, got budget={self.budget!r}"
            )
