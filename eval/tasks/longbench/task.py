"""LongBench (Bai et al. 2023, https://arxiv.org/abs/2308.14508): the 16 English datasets SnapKV reports.

Prompt building follows LongBench's `pred.py` (THUDM, MIT) and SnapKV's
`experiments/LongBench/pred_snap.py` exactly:

    prompt = DATASET2PROMPT[dataset].format(**record)
    ids = tokenizer(prompt, truncation=False).input_ids        # default special tokens (BOS if any)
    if len(ids) > max_prompt_tokens:                            # truncate in the MIDDLE, by tokens
        half = int(max_prompt_tokens / 2)
        prompt = decode(ids[:half], skip_special_tokens=True) + decode(ids[-half:], skip_special_tokens=True)

The chat template is applied later by the generator (`Sample.chat_template` is False for trec,
triviaqa, samsum, lcc, repobench-p, as in LongBench). The prompt is then split into `context`
(up to and including the document) and `question` (the template's text after `{context}`, with
`{input}` filled in) so that the generator can also run the query-agnostic protocol.

Data: `<dataset>.jsonl` files in LongBench's format (keys input, context, answers, length, dataset,
language, all_classes, _id), looked up in this order: `data_dir`, `$LONGBENCH_DIR`, the extracted
Hub archive in `$SNAPKV_BENCH_CACHE/longbench/data/` (default `~/.cache/snapkv-bench`), and finally
the Hub itself (`THUDM/LongBench`, file `data.zip`, downloaded once and extracted into that cache).
`datasets` 5 refuses LongBench's Hub loading script, so the jsonl files are read with plain `json`.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import huggingface_hub

from eval.tasks.base import Sample, Task
from eval.tasks.jsonl import read_jsonl
from eval.tasks.longbench.prompts import (
    DATASET2MAXLEN,
    DATASET2PROMPT,
    DATASETS,
    NO_CHAT_TEMPLATE,
    model_max_length,
)
from eval.tasks.registry import register_task
from snapkv.errors import one_line
from snapkv_models.hub import hub_unavailable
from snapkv_models.paths import cache_root

logger = logging.getLogger(__name__)

__all__ = [
    "DATASETS",
    "HUB_FILENAME",
    "HUB_REPO_ID",
    "LongBenchTask",
    "build_prompt",
    "cache_dir",
    "find_data_file",
    "model_max_length",
    "question_suffix",
    "read_jsonl",
    "split_prompt",
    "truncate_middle",
]

HUB_REPO_ID = "THUDM/LongBench"
HUB_FILENAME = "data.zip"
ENV_DATA_DIR = "LONGBENCH_DIR"


def cache_dir() -> Path:
    """Where the Hub archive is extracted: `$SNAPKV_BENCH_CACHE/longbench` (default ~/.cache/snapkv-bench)."""
    return cache_root() / "longbench"


def _check_dataset(dataset: str) -> None:
    if dataset not in DATASET2PROMPT:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; known: {list(DATASETS)}")


def _in_dir(directory: Path, dataset: str) -> Path:
    """`<dir>/<dataset>.jsonl`, or `<dir>/data/<dataset>.jsonl` (the layout of the unzipped data.zip)."""
    direct = directory / f"{dataset}.jsonl"
    nested = directory / "data" / f"{dataset}.jsonl"
    if direct.is_file():
        return direct
    if nested.is_file():
        return nested
    raise FileNotFoundError(
        f"LongBench file not found: {direct} (nor {nested}); supply LongBench-format jsonl files "
        f"<dataset>.jsonl with task.data_dir=DIR or ${ENV_DATA_DIR}, or unset both to download {HUB_REPO_ID}'s {HUB_FILENAME}"
    )


def find_data_file(dataset: str, data_dir: str | os.PathLike | None = None) -> Path:
    """Locate `<dataset>.jsonl`: `data_dir`, else `$LONGBENCH_DIR`, else the cache (downloading from the Hub).

    An explicitly given directory that lacks the file is an error; it never falls through to the Hub.
    """
    _check_dataset(dataset)
    if data_dir is not None:
        return _in_dir(Path(data_dir).expanduser(), dataset)
    env_dir = os.environ.get(ENV_DATA_DIR)
    if env_dir:
        return _in_dir(Path(env_dir).expanduser(), dataset)
    cached = cache_dir() / "data" / f"{dataset}.jsonl"
    if not cached.is_file():
        _download_and_extract(cache_dir())
    if not cached.is_file():
        raise FileNotFoundError(
            f"LongBench file not found: {cached} (the Hub archive {HUB_REPO_ID}/{HUB_FILENAME} has no "
            f"{dataset}.jsonl); supply it with task.data_dir=... or {ENV_DATA_DIR}=..."
        )
    return cached


def _download_and_extract(target: Path) -> None:
    """Download `data.zip` from the Hub once and extract its `*.jsonl` files into `target/data/`."""
    unavailable = None
    try:
        # One probe of the endpoint first: when it does not answer, the Hugging Face cache only (an
        # archive downloaded before still works; a missing one fails at once, not after retries).
        unavailable = hub_unavailable()
        archive = huggingface_hub.hf_hub_download(
            repo_id=HUB_REPO_ID,
            filename=HUB_FILENAME,
            repo_type="dataset",
            local_files_only=bool(unavailable),
        )
    except Exception as err:  # no network, offline mode, auth, missing package: one actionable message
        detail = one_line(err)
        why = (
            f"{unavailable} and no copy is in the local Hugging Face cache"
            if unavailable
            else f"downloading it failed ({type(err).__name__}: {detail})"
        )
        raise FileNotFoundError(
            f"LongBench data not found: no data_dir given, ${ENV_DATA_DIR} unset, no cached copy in "
            f"{target / 'data'}, and {HUB_REPO_ID}/{HUB_FILENAME} (dataset): {why}; supply a directory "
            f"of <dataset>.jsonl files with task.data_dir=... or {ENV_DATA_DIR}=..."
        ) from err
    out = target / "data"
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(archive) as zf:
        for member in zf.infolist():
            name = Path(member.filename).name  # flatten (and never write outside `out`)
            if member.is_dir() or not name.endswith(".jsonl"):
                continue
            # Extract to a temporary file then rename, so an interrupted run leaves no partial file.
            with zf.open(member) as src, tempfile.NamedTemporaryFile("wb", dir=out, delete=False) as tmp:
                shutil.copyfileobj(src, tmp)
            os.replace(tmp.name, out / name)


def build_prompt(dataset: str, record: dict[str, Any]) -> str:
    """LongBench's prompt: the dataset's template formatted with the record's fields."""
    return DATASET2PROMPT[dataset].format(**record)


def truncate_middle(prompt: str, tokenizer: Any, max_tokens: int) -> tuple[str, int]:
    """Middle truncation by tokens, exactly as LongBench pred.py. Returns (prompt, untruncated token count).

    Tokens are counted with the tokenizer's default special tokens (a BOS counts); the kept halves are
    decoded with `skip_special_tokens=True`. An odd `max_tokens` keeps `2 * (max_tokens // 2)` tokens.
    """
    ids = tokenizer(prompt, truncation=False)["input_ids"]
    n = len(ids)
    if n > max_tokens:
        half = int(max_tokens / 2)
        prompt = tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
            ids[-half:], skip_special_tokens=True
        )
    return prompt, n


def question_suffix(dataset: str, record: dict[str, Any]) -> str:
    """The template's text after `{context}`, formatted (so `{input}` is filled in)."""
    return DATASET2PROMPT[dataset].split("{context}", 1)[1].format(**record)


def split_prompt(prompt: str, suffix: str) -> tuple[str, str]:
    """(context, question): `question` = `suffix` when the prompt still ends with it, else ("prompt", "")."""
    if suffix and prompt.endswith(suffix):
        return prompt[: -len(suffix)], suffix
    # Tiny max length: truncation cut into the question (or decoding did not round-trip it exactly).
    return prompt, ""


def _default_datasets() -> list[str]:
    return list(DATASETS)


@register_task
@dataclass
class LongBenchTask(Task):
    """LongBench task: data + LongBench's prompts + middle truncation + LongBench's metrics.

    Args:
        datasets: subset of the 16 English datasets (default: all, LongBench's order).
        data_dir: directory of `<dataset>.jsonl` files; None → `$LONGBENCH_DIR`, else the Hub (cached).
        limit: keep only the first N records of each dataset (None: all).
        max_prompt_tokens: prompts longer than this (tokens, BOS included) are truncated in the middle.
            SnapKV's values per model: `model_max_length(name)`; the 7500 default fits an 8K-context
            model (SmolLM2) with room for the longest generation (512 tokens).
    """

    name: ClassVar[str] = "longbench"
    # Bump when prompts, truncation or data handling change (result rows from different versions differ).
    version: ClassVar[int] = 1
    selection_keys: ClassVar[tuple[str, ...]] = ("datasets", "limit", "data_dir")

    datasets: list[str] = field(default_factory=_default_datasets)
    data_dir: str | None = None
    limit: int | None = None
    max_prompt_tokens: int = 7500

    def __post_init__(self) -> None:
        if isinstance(self.datasets, str):
            self.datasets = [self.datasets]
        self.datasets = [str(d) for d in self.datasets]  # also turns a Hydra ListConfig into a list
        if not self.datasets:
            raise ValueError(f"datasets must not be empty; known: {list(DATASETS)}")
        for d in self.datasets:
            _check_dataset(d)
        duplicates = sorted({d for d in self.datasets if self.datasets.count(d) > 1})
        if duplicates:
            raise ValueError(f"datasets listed twice: {duplicates}")
        if self.limit is not None and (isinstance(self.limit, bool) or int(self.limit) < 1):
            raise ValueError(f"limit must be a positive int or None, got limit={self.limit!r}")
        self.limit = None if self.limit is None else int(self.limit)
        if isinstance(self.max_prompt_tokens, bool) or int(self.max_prompt_tokens) < 2:
            # int(1 / 2) = 0 and ids[-0:] is the whole prompt: LongBench's formula needs >= 2.
            raise ValueError(f"max_prompt_tokens must be an int >= 2, got {self.max_prompt_tokens!r}")
        self.max_prompt_tokens = int(self.max_prompt_tokens)
        if self.data_dir is not None:
            self.data_dir = str(self.data_dir)

    def _records(self, dataset: str) -> Iterator[dict[str, Any]]:
        return read_jsonl(find_data_file(dataset, self.data_dir), self.limit)

    def num_samples(self) -> int:
        """Number of samples `samples()` will yield (reads the files; may download them once)."""
        return sum(sum(1 for _ in self._records(d)) for d in self.datasets)

    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        for dataset in self.datasets:
            path = find_data_file(dataset, self.data_dir)
            for index, record in enumerate(read_jsonl(path, self.limit)):
                yield self.make_sample(dataset, record, index, tokenizer)

    def make_sample(self, dataset: str, record: dict[str, Any], index: int, tokenizer: Any) -> Sample:
        """One LongBench record → `Sample` (prompt built, truncated for `tokenizer`, split)."""
        try:
            prompt = build_prompt(dataset, record)
            suffix = question_suffix(dataset, record)
        except KeyError as err:
            raise ValueError(
                f"{dataset} record {index} lacks the field {err.args[0]!r} its prompt template needs"
            ) from None
        prompt, n_tokens = truncate_middle(prompt, tokenizer, self.max_prompt_tokens)
        context, question = split_prompt(prompt, suffix)
        answers = record.get("answers") or []
        if isinstance(answers, str):
            answers = [answers]
        length = record.get("length")
        return Sample(
            sample_id=str(record.get("_id") or f"{dataset}-{index}"),
            dataset=dataset,
            context=context,
            question=question,
            answers=list(answers),
            max_new_tokens=DATASET2MAXLEN[dataset],
            chat_template=dataset not in NO_CHAT_TEMPLATE,
            all_classes=record.get("all_classes"),
            length=int(length) if length is not None else None,
            extra={"prompt_tokens": n_tokens, "truncated": n_tokens > self.max_prompt_tokens},
        )

    def score(self, sample: Sample, prediction: str) -> float:
        from eval.tasks.longbench.metrics import score_sample  # lazy: metrics pulls in rouge

        return score_sample(sample.dataset, prediction, sample.answers, sample.all_classes)

    def row_metadata(self, sample: Sample) -> dict[str, Any]:
        """Row columns: `length` (the record's, words; LongBench-E buckets), prompt_tokens, truncated."""
        return {**sample.extra, "length": sample.length}
