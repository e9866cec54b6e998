"""The one sample record every task produces, and the task base class.

A task is data + prompt + metric (lm-eval-harness style): it yields `Sample`s whose prompt is split
into `context` (everything up to and including the long document) and `question` (the rest: the
instruction/question and any answer prefix). The split lets the generator run both protocols:
query-aware (context + question compressed together, SnapKV/LongBench) and query-agnostic (context
compressed alone, question fed after compression, kvpress default).

A task owns everything task-specific about running and scoring (lm-eval's `process_results`): the
metadata columns of its rows (`row_metadata`) and its metrics (`score`, `score_all`). What the
report does with a task's rows (the numeric types of its columns, its tables and plots, its paired
strata) is the task's `TaskReport`, in its own module (`eval/tasks/<benchmark>/report.py`) that no
task code imports: running a task never loads the report's plotting. The runner, the store and the
report only call these hooks; the `TaskReport` defaults give any new task a per-dataset score
table. Register both with `eval.tasks.register_task` / `register_report`.

Most tasks generate (lm-eval's `generate_until`): the runner generates each sample's answer and the
task scores the text. A task that measures something else on a model (lm-eval's loglikelihood
requests; here the fidelity of a compressed cache to the full one) sets `generates = False` and
runs each sample itself in `evaluate`, given the model, the method and where it may cache what
several runs share (`EvalContext`); it returns the row's score, metrics and measurements
(`Evaluation`). The runner still owns the rows, resume, failures and the timing of the machine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pandas as pd

from eval.tables import score_table

if TYPE_CHECKING:
    from snapkv import Method, ProgressCallback


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
    # Task metadata copied into the result row by the default `Task.row_metadata`
    # (needle: context_length, depth_percent, needle, ...).
    extra: dict[str, Any] = field(default_factory=dict)
    # Several questions about one context: the samples of a context share `context_id` (and the
    # same `context` text) and are numbered by `question_index` (0, 1, ...) in the order they are
    # asked; the multi-question protocols compress that context once. None: the sample's context is
    # its own (every single-question task).
    context_id: str | None = None
    question_index: int = 0
    # How the question is asked as a later turn of a conversation whose cache already holds the
    # context (`first_question`, `multi_turn`), for tasks that render their prompt with the chat
    # template themselves (`chat_template=False` while `question` holds the template's turn markers):
    # (user text, answer prefix); the protocol renders the turn with the tokenizer's template and
    # appends the prefix. None: `question` is the user text (a later turn renders it as it is).
    turn: tuple[str, str] | None = None

    @property
    def prompt(self) -> str:
        return self.context + self.question


@dataclass(frozen=True)
class EvalContext:
    """What a task that runs its own samples (`Task.evaluate`) is given besides the sample.

    model / tokenizer: the loaded model; method: the run's compression method; chunk_size: the run's
    prefill chunk (None: one forward); model_id: what identifies the loaded model across runs (its
    name, tokenizer, dtype, attention implementation and device: a result computed under one id is
    valid for every run with the same id); cache_dir: a folder of the results dir where such results
    may be kept between runs (created on first use); on_progress: the sample's progress callback.
    """

    model: Any
    tokenizer: Any
    method: Method
    chunk_size: int | None
    model_id: dict[str, Any]
    cache_dir: Path
    on_progress: ProgressCallback | None = None


@dataclass
class Evaluation:
    """One sample run by its task (`Task.evaluate`): `score` (the main metric in [0, 1]), `scores`
    (further metrics in [0, 1]), `fields` (the generic measurement columns of `eval.store.ROW_SCHEMA`
    it measured: input_tokens, kv_tokens, prefill_s, ...), `columns` (the task's own measured
    columns, beside its `row_metadata`) and `prediction` (the row's text, None when none)."""

    score: float
    scores: dict[str, float] = field(default_factory=dict)
    fields: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, Any] = field(default_factory=dict)
    prediction: str | None = None


@dataclass(frozen=True)
class ReportOptions:
    """What the report's caller decides for every task's tables and plots."""

    out: Path
    trained_context: int | None = None  # overrides the rows' own value (needle heatmaps' dashed line)


class Task:
    """Base class of the tasks: subclass it (usually as a dataclass whose fields are the task's
    config keys, `conf/task/<name>.yaml`) and implement `samples` and `score`.

    Class attributes: `name` (registry key, `task.name`), `version` (bump when prompts or data
    handling change; part of the results file's hash), `selection_keys` (config keys that only choose
    WHICH samples run, left out of the hash so a grid can grow without recomputing stored samples),
    `hash_defaults` (config keys added after results were stored, each with its default: left out
    of the hash while they hold it, so the results of every earlier config keep their file),
    `generates` (False: the task runs each sample itself in `evaluate` instead of the runner
    generating an answer for `score`).
    """

    name: ClassVar[str] = ""
    version: ClassVar[int | None] = None
    selection_keys: ClassVar[tuple[str, ...]] = ()
    hash_defaults: ClassVar[dict[str, Any]] = {}
    generates: ClassVar[bool] = True

    def hash_params(self, config: dict[str, Any]) -> dict[str, Any]:
        """The task config as it enters the config hash: minus `selection_keys`, and minus each
        `hash_defaults` key that holds its default."""
        return {
            k: v
            for k, v in config.items()
            if k not in self.selection_keys and not (k in self.hash_defaults and v == self.hash_defaults[k])
        }

    # ---- running
    def samples(self, tokenizer: Any) -> Iterable[Sample]:
        """The task's samples, prompts already sized for `tokenizer` (truncation, lengths)."""
        raise NotImplementedError

    def num_samples(self) -> int | None:
        """Called before the model loads: read the data so a missing/malformed file fails early.
        The number of samples, or None when it is only known with the tokenizer."""
        return None

    def multi_question(self) -> bool:
        """Whether the task, as configured, asks several questions about each context (samples
        sharing a `context_id`): the multi-question protocols need it (checked before the model loads)."""
        return False

    def score(self, sample: Sample, prediction: str) -> float:
        """The main metric of one prediction, in [0, 1] (the row's `score`)."""
        raise NotImplementedError

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Every metric of one prediction, in [0, 1] (the row's `scores`); default: none besides `score`."""
        return {}

    def evaluate(self, sample: Sample, context: EvalContext) -> Evaluation:
        """Run one sample on the model and measure it (tasks with `generates = False`); raising
        marks the sample's row as failed, as a failing generation does."""
        raise NotImplementedError(f"task {self.name!r} generates: the runner generates its samples")

    def row_metadata(self, sample: Sample) -> dict[str, Any]:
        """Task columns of the sample's row (default: `sample.extra`); generic columns win on a clash,
        except `eval.store.TASK_FIELDS` (a generated sample's `task_seed`), which the task fills."""
        return dict(sample.extra)


class TaskReport:
    """What the report does with one task's stored rows (class methods: a report is built from rows,
    without the task's config). Subclass it in `eval/tasks/<benchmark>/report.py` and register it
    under the task's name (`eval.tasks.register_report`); rows of a task without one get these
    defaults.

    Class attributes: `section` (heading of the report section holding `tables`), `budget_values`
    (row columns the report draws against the KV budget, each with its axis name: `score` always;
    a task adds a graded column, e.g. the needle's partial credit, where the main score is flat),
    `paired_strata` (row columns within whose values the report's paired bootstrap resamples the
    shared samples' units of independence, and whose per-value means its pooled differences weigh equally, as the task's
    own averages do: eval/report/paired.py) and `flip_columns` (row columns naming a sample in the
    flip tables: what compression broke or fixed; None where the score is no right-or-wrong grade,
    a fraction or a mean, and the report lists no flips).
    """

    section: ClassVar[str] = "Scores"
    budget_values: ClassVar[dict[str, str]] = {"score": "score"}
    paired_strata: ClassVar[tuple[str, ...]] = ("dataset",)
    flip_columns: ClassVar[tuple[str, ...] | None] = ("dataset",)

    @classmethod
    def prepare_rows(cls, df: pd.DataFrame) -> pd.DataFrame:
        """Derived / numeric task columns of this task's rows (a `eval.report.prepare`d frame)."""
        return df

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        """Markdown tables for this task's rows (all models); default: one score table per model."""
        return [
            score_table(part, f"{task} — {model}")
            for (task, model), part in df.groupby(["task", "model"], sort=True)
        ]

    @classmethod
    def plots(cls, df: pd.DataFrame, options: ReportOptions) -> list[Path]:
        """Plots of this task's ok rows written into `options.out`; default: none."""
        return []
