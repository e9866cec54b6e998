"""InfiniteBench (Zhang et al. 2024, https://arxiv.org/abs/2402.13718; xinrongzhang2022/InfiniteBench
on the Hub, Apache-2.0; code OpenBMB/InfiniteBench, MIT): the 100K+ token tasks, with InfiniteBench's
prompts (`prompts.py`), truncation and scorers (`metrics.py`).

Tasks: passkey, number_string, kv_retrieval (Retrieve.*), longbook_sum_eng (En.Sum),
longbook_choice_eng (En.MC), longbook_qa_eng (En.QA), longbook_qa_chn (Zh.QA), longdialogue_qa_eng
(En.Dia), math_find, math_calc, code_run, code_debug. Each record is one sample: the template's
text up to ``{context}`` and the record's context are `Sample.context`, the rest (the question,
the options, the answer's opening words) `Sample.question`. Fields the templates take, as
InfiniteBench's `create_prompt` fills them: ``{input}`` / ``{question}`` the record's input,
``{OPTION_A..D}`` its options, math_find's ``{prefix}`` "What is <the target number> in the
following list?" (``The .+ of`` in the input, lower-cased, without " of"), code_run's ``{func}`` /
``{func_call}`` (the first ``func_<n>(<int>)`` of the input).

Truncation (InfiniteBench's `truncate_by_tokens` / `truncate_input`, "middle"): the whole prompt
is cut in the middle by tokens to `max_prompt_tokens` (the model's limit: InfiniteBench cuts to
128K for its open models, 128K - 1000 for GPT-4), keeping ``max_prompt_tokens // 2`` tokens of each
end, decoded without special tokens (`eval.tasks.longbench.task.truncate_middle`, which counts
the tokenizer's default special tokens, as `tok.encode` does). No room is reserved for the answer,
as in InfiniteBench. The rows record the untruncated length (`prompt_tokens`) and `truncated`.

Data: the Hub repository holds one JSONL file per task (its card lists them as the splits of one
`datasets` config); ``<task>.jsonl`` is fetched alone with huggingface_hub (`revision` pinnable,
kept in the Hugging Face cache and read from it offline) and read as InfiniteBench's `iter_jsonl`
reads it, each record's values as the file writes them. Not through `datasets.load_dataset`: its
default config prepares all twelve files (2.7 GB) under one schema the tasks do not share (math_calc's
answer is a list of lists of ints, the others' lists of strings or numbers), and a load of one
file by ``data_files`` is not found again in its cache offline (the cached config's id hashes the
files' resolved Hub URLs, which cannot be resolved offline). Or local files given by `data_files`: a ``.jsonl`` / ``.parquet`` file (one task selected) or a directory of
``<task>.jsonl`` / ``<task>.parquet`` (the layout OpenBMB/InfiniteBench's
`scripts/download_dataset.sh` writes). The data is read before the model loads; a missing file or
an unreachable Hub is one error naming the task, the repository and `task.data_files`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eval.tasks.base import Sample, Task
from eval.tasks.hub_data import load_hub_file, read_local
from eval.tasks.infinitebench import metrics
from eval.tasks.infinitebench.prompts import MAX_NEW_TOKENS, TASKS, TEMPLATES
from eval.tasks.longbench.task import split_prompt, truncate_middle
from eval.tasks.registry import register_task

HUB_REPO_ID = "xinrongzhang2022/InfiniteBench"
CHOICE_TASKS = ("longbook_choice_eng", "code_debug")


def _default_tasks() -> list[str]:
    return list(TASKS)


def math_find_prefix(text: str) -> str:
    """math_find's first line: "What is <target> in the following list?", <target> the first
    greedy match of ``The .+ of`` in the input, lower-cased, without its " of"."""
    found = re.findall(r"The .+ of", text)
    if not found:
        raise ValueError(f"math_find input has no 'The ... of' phrase to ask about: {text[:80]!r}")
    return f"What is {found[0].lower()[:-3]} in the following list?"


def template_fields(task: str, record: dict[str, Any]) -> dict[str, str]:
    """The template fields of one record but ``{context}`` (`create_prompt`)."""
    text = str(record.get("input", ""))
    out = {"input": text, "question": text}
    if task in CHOICE_TASKS:
        options = list(record.get("options") or [])
        if len(options) < 4:
            raise ValueError(f"{task} needs 4 options, got {options!r}")
        out.update(zip(("OPTION_A", "OPTION_B", "OPTION_C", "OPTION_D"), map(str, options[:4])))
    elif task == "math_find":
        out["prefix"] = math_find_prefix(text)
    elif task == "code_run":
        calls = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", text)
        if not calls:
            raise ValueError(f"code_run input has no call func_<n>(<int>): {text[:80]!r}")
        out.update(func_call=calls[0], func=calls[0].split("(")[0])
    return out


def prompt_parts(task: str, record: dict[str, Any], template: str = "yarn_mistral") -> tuple[str, str]:
    """(context part, question) of a record: the template split at ``{context}``, each side filled
    in; the record's context follows the first part as it is (braces in it stay as they are)."""
    head, tail = TEMPLATES[template][task].split("{context}")
    kw = template_fields(task, record)
    return head.format(**kw) + str(record["context"]), tail.format(**kw)


def _answers(answer: Any) -> list[str]:
    """`Sample.answers` (strings): the items of a list answer, or the answer itself."""
    return [str(a) for a in answer] if isinstance(answer, list) else [str(answer)]


# ------------------------------------------------------------------------------------------- data
def _local_file(task: str, data_files: Path, n_tasks: int) -> Path:
    if data_files.is_file():
        if n_tasks > 1:
            raise ValueError(
                f"task.data_files={data_files} is one file but {n_tasks} InfiniteBench tasks are selected; "
                "give a directory of <task>.jsonl / <task>.parquet files, or select one task"
            )
        return data_files
    if data_files.is_dir():
        for candidate in (data_files / f"{task}.jsonl", data_files / f"{task}.parquet"):
            if candidate.is_file():
                return candidate
    raise FileNotFoundError(
        f"InfiniteBench task {task} not found in task.data_files={data_files} (looked for {task}.jsonl and "
        f"{task}.parquet); unset task.data_files to load {HUB_REPO_ID} from the Hub"
    )


def _check_record(task: str, index: int, record: dict[str, Any]) -> None:
    missing = [k for k in ("context", "answer") if k not in record]
    if missing:
        raise ValueError(f"InfiniteBench {task} record {index}: no {missing}, got keys {sorted(record)}")


# ------------------------------------------------------------------------------------------- task
@register_task
@dataclass
class InfiniteBenchTask(Task):
    """InfiniteBench: the records of `tasks`, each one sample (see the module docstring).

    Args:
        tasks: InfiniteBench tasks to run (default: all twelve, `prompts.TASKS`).
        template: the template family, ``yarn_mistral`` (InfiniteBench's open models; default) or
            ``gpt4``.
        repo: the Hub dataset.
        revision: a Hub revision (commit, branch or tag) to pin; None: the default branch.
        data_files: local data instead of the Hub: a .jsonl / .parquet file (one task) or a
            directory of ``<task>.jsonl`` / ``<task>.parquet``.
        limit: the first N records of each task (None: all).
        max_prompt_tokens: the model's prompt limit; longer prompts are cut in the middle to it.
        chat_template: render with the tokenizer's chat template (when it has one).
    """

    name: ClassVar[str] = "infinitebench"
    version: ClassVar[int] = 1
    selection_keys: ClassVar[tuple[str, ...]] = ("tasks", "limit", "data_files", "revision")

    tasks: list[str] = field(default_factory=_default_tasks)
    template: str = "yarn_mistral"
    repo: str = HUB_REPO_ID
    revision: str | None = None
    data_files: str | None = None
    limit: int | None = None
    max_prompt_tokens: int = 7500
    chat_template: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.tasks, str):
            self.tasks = [self.tasks]
        self.tasks = [str(t) for t in self.tasks]  # a Hydra ListConfig too
        if not self.tasks:
            raise ValueError(f"infinitebench tasks must not be empty; known: {', '.join(TASKS)}")
        for t in self.tasks:
            if t not in TASKS:
                raise ValueError(f"unknown InfiniteBench task {t!r}; known: {', '.join(TASKS)}")
        duplicates = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if duplicates:
            raise ValueError(f"infinitebench tasks listed twice: {duplicates}")
        if self.template not in TEMPLATES:
            raise ValueError(
                f"infinitebench template must be one of {', '.join(TEMPLATES)}, got template={self.template!r}"
            )
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ValueError(
                f"infinitebench limit must be a positive integer or null, got limit={self.limit!r}"
            )
        if (
            isinstance(self.max_prompt_tokens, bool)
            or not isinstance(self.max_prompt_tokens, int)
            or self.max_prompt_tokens < 2
        ):
            raise ValueError(
                "infinitebench max_prompt_tokens must be an integer >= 2, "
                f"got max_prompt_tokens={self.max_prompt_tokens!r}"
            )
        if not isinstance(self.chat_template, bool):
            raise ValueError(
                f"infinitebench chat_template must be true or false, got chat_template={self.chat_template!r}"
            )
        for key in ("repo",):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(
                    f"infinitebench {key} must be a non-empty string, got {key}={getattr(self, key)!r}"
                )
        if self.revision is not None:
            self.revision = str(self.revision)
        if self.data_files is not None:
            self.data_files = str(self.data_files)
        self._cache: dict[str, list[dict[str, Any]]] = {}

    # ---- data
    def records(self, task: str) -> list[dict[str, Any]]:
        """The task's records (the first `limit`), read once."""
        if task not in self._cache:
            if self.data_files is not None:
                rows = read_local(_local_file(task, Path(self.data_files).expanduser(), len(self.tasks)))
            else:
                rows = load_hub_file(
                    f"InfiniteBench task {task}",
                    self.repo,
                    f"{task}.jsonl",
                    self.revision,
                    "a directory of <task>.jsonl files",
                )
            rows = rows[: self.limit] if self.limit is not None else rows
            for i, record in enumerate(rows):
                _check_record(task, i, record)
            self._cache[task] = rows
        return self._cache[task]

    def num_samples(self) -> int:
        return sum(len(self.records(t)) for t in self.tasks)

    # ---- samples
    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        for task in self.tasks:
            for index, record in enumerate(self.records(task)):
                yield self.make_sample(task, index, record, tokenizer)

    def make_sample(self, task: str, index: int, record: dict[str, Any], tokenizer: Any) -> Sample:
        """One record → `Sample` (prompt built, truncated for `tokenizer`, split at the question)."""
        context, question = prompt_parts(task, record, self.template)
        prompt, n_tokens = truncate_middle(context + question, tokenizer, self.max_prompt_tokens)
        context, question = split_prompt(prompt, question)
        record_id = record.get("id")
        return Sample(
            sample_id=f"{task}-{record_id if record_id is not None else index}",
            dataset=task,
            context=context,
            question=question,
            answers=_answers(record["answer"]),
            max_new_tokens=MAX_NEW_TOKENS[task],
            chat_template=self.chat_template,
            extra={
                "label": metrics.answer_label(task, record),  # what the scorer takes (not a row column)
                "prompt_tokens": n_tokens,
                "truncated": n_tokens > self.max_prompt_tokens,
                "record_id": record_id,
            },
        )

    # ---- scoring
    def score(self, sample: Sample, prediction: str) -> float:
        return metrics.score(sample.dataset, prediction, sample.extra["label"])

    def row_metadata(self, sample: Sample) -> dict[str, Any]:
        """`extra` but the label (the rows hold `answers` and `dataset`)."""
        return {k: v for k, v in sample.extra.items() if k != "label"}
