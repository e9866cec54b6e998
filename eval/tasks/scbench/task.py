"""SCBench (Li et al. 2024, https://arxiv.org/abs/2412.10319; microsoft/SCBench on the Hub, MIT):
long contexts shared by several questions, the setting this project's `multi_request` and
`multi_turn` protocols implement (eval/protocols.py).

Each record of a config is one shared `context` and its `multi_turns` (`input`, `answer`, and
`options` for scbench_choice_eng). A record becomes one context (`context_id` ``<config>-<i>``, i
its index in the split) whose turns are its questions (`question_index` = the turn's index), so
SCBench runs under every protocol: `multi_request` and `multi_turn` (SCBench's two modes, one
compressed cache per context), `first_question`, and per question `query_aware` /
`context_only`. Prompts (`prompts.py`) and metrics (`metrics.py`) are SCBench's own, from
microsoft/MInference `scbench/` (MIT).

Prompt of turn t: ``context`` = the config's context part (its instruction, if any, and the
record's context; scbench_mf: "What is <target>?" of turn 0 first), ``question`` = ``"\\n\\n" +``
turn t's query. As a later chat turn (`first_question`, `multi_turn`) the query alone is the user
text (`Sample.turn`), as SCBench renders its follow-ups inside the chat template. Differences
from SCBench's code: (1) its multi-request mode appends the query right after the context with no
blank line; here every question has the blank line of its multi-turn mode's first turn; (2) in
multi-turn mode SCBench repeats no "What is <target>?" before scbench_mf's first question and
gives every later chat turn the LAST turn's one (a loop variable reused); here each query carries
its own, as SCBench's multi-request mode does; (3) the model's own earlier answers stay in the
conversation (SCBench's `disable_golden_context`), never the reference answers. As in SCBench,
scbench_summary's later chat turns open the answer with "This paper" (`Sample.turn`'s prefix; its
multi-request mode has none), and scbench_summary_with_needles takes each turn's generation length
and scorer from the turn's `task` (summary or passkey), its rows' `dataset` naming it
(``scbench_summary_with_needles:passkey``) as SCBench reports the two apart.

Truncation (SCBench's `truncate_input`, "middle"): the context part is cut in the middle by tokens
to ``max_prompt_tokens - max_new_tokens x turns`` tokens, SCBench's reserve for the turns' answers
(scbench_summary_with_needles: the sum of its two lengths x turns // 2). The tokenizer's default
special tokens count and the two halves are decoded without them
(`eval.tasks.longbench.task.truncate_middle`). The rows record the untruncated length
(`prompt_tokens`) and `truncated`.

Data: ``datasets.load_dataset(repo, config, split=split, revision=revision)`` (cached by
`datasets`), or local files given by `data_files`: a ``.jsonl`` or ``.parquet`` file (one config
selected), or a directory holding ``<config>.jsonl`` / ``<config>.parquet`` (SCBench's own data
folder layout) or ``<config>/*.parquet`` (the Hub repo's layout). The data is read before the
model loads; a missing file or an unreachable Hub is one error naming the config, the repository
and `task.data_files`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eval.tasks import hub_data
from eval.tasks.base import Sample, Task
from eval.tasks.hub_data import read_local
from eval.tasks.longbench.task import truncate_middle
from eval.tasks.registry import register_task
from eval.tasks.scbench import metrics, repoqa
from eval.tasks.scbench.prompts import (
    CONFIGS,
    CONTEXT_TEMPLATES,
    DEFAULT,
    MAX_NEW_TOKENS,
    NEEDS_REPOQA,
    QUERY_TEMPLATES,
    SEPARATOR,
    SUMMARY_PREFIX,
)
from snapkv.prompts import chat_templated

HUB_REPO_ID = "microsoft/SCBench"


def _default_configs() -> list[str]:
    return list(DEFAULT)


def check_config(config: str) -> None:
    """ValueError for an unknown config, or a RepoQA one without its scorer's grammars (naming it)."""
    if config not in CONFIGS:
        raise ValueError(f"unknown SCBench config {config!r}; known: {', '.join(CONFIGS)}")
    if config in NEEDS_REPOQA and not repoqa.available():
        raise ValueError(
            f"SCBench config {config!r} needs the tree-sitter grammars of RepoQA's scorer: "
            "pip install -e '.[repoqa]' (package tree-sitter-languages), or leave it out of task.configs"
        )


def mf_prefix(text: str) -> str:
    """scbench_mf's "What is <target>?" from a turn's input ("... The <target> is ..."), as SCBench
    builds it: the first greedy match of ``The .+ is``, lower-cased, without its " is"."""
    found = re.findall(r"The .+ is", text)
    if not found:
        raise ValueError(f"scbench_mf input has no 'The ... is' phrase to ask about: {text[:80]!r}")
    return f"What is {found[0].lower()[:-3]}?"


def query(config: str, turn: dict[str, Any]) -> str:
    """One turn's query text (`prompts.QUERY_TEMPLATES`)."""
    text = turn["input"]
    if config in ("scbench_qa_eng", "scbench_qa_chn"):
        return QUERY_TEMPLATES[config].format(question=text)
    if config == "scbench_choice_eng":
        options = list(turn["options"])
        if len(options) < 4:
            raise ValueError(f"scbench_choice_eng needs 4 options, got {options!r}")
        a, b, c, d = options[:4]
        return QUERY_TEMPLATES[config].format(question=text, OPTION_A=a, OPTION_B=b, OPTION_C=c, OPTION_D=d)
    if config == "scbench_mf":
        return QUERY_TEMPLATES[config].format(prefix=mf_prefix(text), input=text)
    return QUERY_TEMPLATES[config].format(input=text)


def context_part(config: str, record: dict[str, Any]) -> str:
    """The context part of every prompt of a record (`prompts.CONTEXT_TEMPLATES`); a context stored
    as a list (scbench_mf's array) is written as Python's `str.format` writes it, as SCBench does."""
    turns = record["multi_turns"]
    prefix = mf_prefix(turns[0]["input"]) if config == "scbench_mf" else ""
    return CONTEXT_TEMPLATES[config].format(context=record["context"], prefix=prefix)


def subtask(config: str, turn: dict[str, Any]) -> str:
    """The SCBench task whose scorer and generation length a turn takes: the config itself, or for
    a config that mixes two (scbench_summary_with_needles) the turn's `task`."""
    lengths = MAX_NEW_TOKENS[config]
    if not isinstance(lengths, dict):
        return config
    task = turn.get("task")
    if task not in lengths:
        raise ValueError(f"{config} turn task must be one of {', '.join(lengths)}, got task={task!r}")
    return task


def max_new_tokens(config: str, turn: dict[str, Any]) -> int:
    """SCBench's generation length of one turn (`DATA_NAME_TO_MAX_NEW_TOKENS`)."""
    lengths = MAX_NEW_TOKENS[config]
    return lengths[subtask(config, turn)] if isinstance(lengths, dict) else lengths


def reserved(config: str, turns: int) -> int:
    """Tokens SCBench keeps free of the context for the answers of `turns` turns: max new tokens x
    turns, or for a mixed config the sum of its two lengths x turns // 2."""
    lengths = MAX_NEW_TOKENS[config]
    return sum(lengths.values()) * turns // 2 if isinstance(lengths, dict) else lengths * turns


def repo_needles(config: str, records: list[dict[str, Any]]) -> dict[str, list[list[str]]]:
    """RepoQA's needles per repository: [function name, reference code] of every RepoQA turn of
    `records` about it, in record and turn order (SCBench's `needle_by_repo`, built from the run's
    predictions)."""
    out: dict[str, list[list[str]]] = {}
    for record in records:
        for turn in record["multi_turns"]:
            if subtask(config, turn) == "scbench_repoqa":
                out.setdefault(record["repo"], []).append([turn["name"], turn["answer"]])
    return out


# ------------------------------------------------------------------------------------------- data
def _local_file(config: str, data_files: Path, n_configs: int) -> Path:
    if data_files.is_file():
        if n_configs > 1:
            raise ValueError(
                f"task.data_files={data_files} is one file but {n_configs} SCBench configs are selected; "
                "give a directory of <config>.jsonl / <config>.parquet files, or select one config"
            )
        return data_files
    if data_files.is_dir():
        for candidate in (data_files / f"{config}.jsonl", data_files / f"{config}.parquet"):
            if candidate.is_file():
                return candidate
        shards = sorted((data_files / config).glob("*.parquet")) if (data_files / config).is_dir() else []
        if shards:
            return data_files / config
    raise FileNotFoundError(
        f"SCBench config {config} not found in task.data_files={data_files} (looked for {config}.jsonl, "
        f"{config}.parquet and {config}/*.parquet); unset task.data_files to load {HUB_REPO_ID} from the Hub"
    )


def load_hub(config: str, repo: str, split: str, revision: str | None) -> list[dict[str, Any]]:
    """One config's records from the Hub (`eval.tasks.hub_data.load_hub`: one error line naming the
    config, the repository and `task.data_files` when it cannot be loaded)."""
    return hub_data.load_hub(
        f"SCBench config {config}",
        repo,
        config,
        split,
        revision,
        "a directory of <config>.jsonl / <config>.parquet files",
    )


def _check_record(config: str, index: int, record: dict[str, Any]) -> None:
    turns = record.get("multi_turns")
    if "context" not in record or not isinstance(turns, list) or not turns:
        raise ValueError(
            f"{config} record {index}: expected a 'context' and a non-empty list 'multi_turns', "
            f"got keys {sorted(record)}"
        )
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict) or "input" not in turn or "answer" not in turn:
            raise ValueError(f"{config} record {index} turn {t}: expected 'input' and 'answer'")


def _answers(label: Any) -> list[str]:
    """`Sample.answers` (strings) of SCBench's label: its items, or the label itself."""
    return [str(a) for a in label] if isinstance(label, list) else [str(label)]


# ------------------------------------------------------------------------------------------- task
@register_task
@dataclass
class SCBenchTask(Task):
    """SCBench: the records of `configs`, each a context whose turns are its questions (see the
    module docstring).

    Args:
        configs: SCBench configs to run (default: all but the RepoQA ones, `prompts.DEFAULT`;
            scbench_repoqa and scbench_repoqa_and_kv need the `repoqa` extra).
        repo: the Hub dataset.
        revision: a Hub revision (commit, branch or tag) to pin; None: the default branch.
        split: the split to load.
        data_files: local data instead of the Hub: a .jsonl / .parquet file (one config) or a
            directory of ``<config>.jsonl`` / ``<config>.parquet`` / ``<config>/*.parquet``.
        limit: the first N records of each config (None: all).
        max_prompt_tokens: the model's prompt limit; the context part is truncated in the middle to
            it minus the config's max new tokens x the record's turns.
        chat_template: render with the tokenizer's chat template (when it has one).
    """

    name: ClassVar[str] = "scbench"
    version: ClassVar[int] = 1
    # Which records run, and where the same data is read from.
    selection_keys: ClassVar[tuple[str, ...]] = ("configs", "limit", "data_files", "revision")

    configs: list[str] = field(default_factory=_default_configs)
    repo: str = HUB_REPO_ID
    revision: str | None = None
    split: str = "test"
    data_files: str | None = None
    limit: int | None = None
    max_prompt_tokens: int = 7500
    chat_template: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.configs, str):
            self.configs = [self.configs]
        self.configs = [str(c) for c in self.configs]  # a Hydra ListConfig too
        if not self.configs:
            raise ValueError(f"scbench configs must not be empty; known: {', '.join(CONFIGS)}")
        for c in self.configs:
            check_config(c)
        duplicates = sorted({c for c in self.configs if self.configs.count(c) > 1})
        if duplicates:
            raise ValueError(f"scbench configs listed twice: {duplicates}")
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ValueError(f"scbench limit must be a positive integer or null, got limit={self.limit!r}")
        if (
            isinstance(self.max_prompt_tokens, bool)
            or not isinstance(self.max_prompt_tokens, int)
            or self.max_prompt_tokens < 2
        ):
            raise ValueError(
                f"scbench max_prompt_tokens must be an integer >= 2, got max_prompt_tokens={self.max_prompt_tokens!r}"
            )
        if not isinstance(self.chat_template, bool):
            raise ValueError(
                f"scbench chat_template must be true or false, got chat_template={self.chat_template!r}"
            )
        for key in ("repo", "split"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(
                    f"scbench {key} must be a non-empty string, got {key}={getattr(self, key)!r}"
                )
        if self.revision is not None:
            self.revision = str(self.revision)
        if self.data_files is not None:
            self.data_files = str(self.data_files)
        self._cache: dict[str, list[dict[str, Any]]] = {}

    # ---- data
    def records(self, config: str) -> list[dict[str, Any]]:
        """The config's records (the first `limit`), read once."""
        if config not in self._cache:
            if self.data_files is not None:
                path = _local_file(config, Path(self.data_files).expanduser(), len(self.configs))
                rows = read_local(path)
            else:
                rows = load_hub(config, self.repo, self.split, self.revision)
            rows = rows[: self.limit] if self.limit is not None else rows
            for i, record in enumerate(rows):
                _check_record(config, i, record)
            self._cache[config] = rows
        return self._cache[config]

    def num_samples(self) -> int:
        return sum(len(r["multi_turns"]) for c in self.configs for r in self.records(c))

    def multi_question(self) -> bool:
        return True

    # ---- samples
    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        templated = chat_templated(tokenizer, self.chat_template)
        for config in self.configs:
            records = self.records(config)
            needles = repo_needles(config, records) if config in NEEDS_REPOQA else None
            for index, record in enumerate(records):
                yield from self.record_samples(config, index, record, tokenizer, templated, needles)

    def record_samples(
        self,
        config: str,
        index: int,
        record: dict[str, Any],
        tokenizer: Any,
        templated: bool,
        needles: dict[str, list[list[str]]] | None = None,
    ) -> list[Sample]:
        """The samples of one record: one per turn, sharing the (truncated) context part.
        `needles`: RepoQA's needles per repository (`repo_needles`; None: this record's own)."""
        turns = record["multi_turns"]
        if config in NEEDS_REPOQA and needles is None:
            needles = repo_needles(config, [record])
        budget = self.max_prompt_tokens - reserved(config, len(turns))
        if budget < 2:
            raise ValueError(
                f"scbench max_prompt_tokens={self.max_prompt_tokens} leaves no room for {config} record "
                f"{index}'s context: {reserved(config, len(turns))} tokens are reserved for its "
                f"{len(turns)} answers"
            )
        context, n_tokens = truncate_middle(context_part(config, record), tokenizer, budget)
        context_id = f"{config}-{index}"
        out = []
        for t, turn in enumerate(turns):
            text = query(config, turn)
            answer, scorer = metrics.label(config, turn), subtask(config, turn)
            label = answer
            if scorer == "scbench_repoqa":  # the asked function among its repository's needles
                label = {"name": turn["name"], "lang": record["lang"], "needles": needles[record["repo"]]}
            extra = {
                # SCBench's label as its scorer takes it, and the scorer (not row columns)
                "label": label,
                "scorer": scorer,
                "prompt_tokens": n_tokens,
                "truncated": n_tokens > budget,
                "record_id": record.get("id"),
                "turns": len(turns),
            }
            if (
                "task" in turn or "task" in record
            ):  # scbench_many_shot's source task, a mixed config's turn task
                extra["subtask"] = turn.get("task", record.get("task"))
            if scorer == "scbench_repoqa":
                extra.update(function=turn["name"], lang=record["lang"], repo=record["repo"])
            # A mixed config's turns are reported per task, as SCBench scores them.
            dataset = config if scorer == config else f"{config}:{scorer.removeprefix('scbench_')}"
            prefix = SUMMARY_PREFIX if config == "scbench_summary" and t > 0 else ""
            out.append(
                Sample(
                    sample_id=f"{context_id}/q{t}",
                    dataset=dataset,
                    context=context,
                    question=SEPARATOR + text,
                    answers=_answers(answer),
                    max_new_tokens=max_new_tokens(config, turn),
                    chat_template=self.chat_template,
                    extra=extra,
                    context_id=context_id,
                    question_index=t,
                    turn=(text, prefix) if templated else None,
                )
            )
        return out

    # ---- scoring
    def score(self, sample: Sample, prediction: str) -> float:
        return metrics.SCORERS[sample.extra["scorer"]](prediction, sample.extra["label"])

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        """scbench_many_shot and scbench_qa_chn: the metric over the whole answer as well, where
        SCBench's scorer loops over a string label's characters (`metrics` docstring)."""
        label, scorer = sample.extra["label"], sample.extra["scorer"]
        if not isinstance(label, str):
            return {}
        if scorer == "scbench_many_shot":
            return {"answer_in_prediction": metrics.longdialogue_qa(prediction, [label])}
        if scorer == "scbench_qa_chn":
            return {"f1_whole_answer": metrics.qa_f1_zh(prediction, [label])}
        return {}

    def row_metadata(self, sample: Sample) -> dict[str, Any]:
        """`extra` but the label and the scorer (the rows hold `answers` and `dataset`)."""
        return {k: v for k, v in sample.extra.items() if k not in ("label", "scorer")}
