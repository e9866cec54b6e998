"""The one sample record every task produces, and the task protocol.

A task is data + prompt + metric (lm-eval-harness style): it yields `Sample`s whose prompt is split
into `context` (everything up to and including the long document) and `question` (the rest: the
instruction/question and any answer prefix). The split lets the generator run both protocols:
query-aware (context + question compressed together, SnapKV/LongBench) and query-agnostic (context
compressed alone, question fed after compression, kvpress default).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Sample:
    sample_id: str
    dataset: str
    context: str
    question: str
    answers: list[str]
    max_new_tokens: int
    chat_template: bool = True
    all_classes: list[str] | None = None
    # LongBench's `length` field (words), used for the LongBench-E buckets.
    length: int | None = None
    # Task-specific fields copied into the result row (needle: context_length, depth_percent, needle).
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return self.context + self.question


class Task(Protocol):
    name: str

    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        """Yield the task's samples, prompts already sized for `tokenizer` (truncation, lengths)."""
        ...

    def score(self, sample: Sample, prediction: str) -> float:
        """Score one prediction in [0, 1]."""
        ...
