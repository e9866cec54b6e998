"""LongBench-v2 (Bai et al. 2024, https://arxiv.org/abs/2412.15204; THUDM/LongBench-v2 on the Hub,
Apache-2.0): 503 four-choice questions over contexts of 8K to 2M words, scored as accuracy overall,
by difficulty (easy / hard) and by length (short / medium / long).

Prompt, truncation, generation length and answer extraction follow LongBench-v2's `pred.py`
(THUDM/LongBench, branch main, MIT) without CoT:

    prompt = 0shot.txt with $DOC$, $Q$, $C_A$..$C_D$ replaced by the stripped fields, in that order
    ids = tokenizer.encode(prompt)                              # default special tokens (BOS if any)
    if len(ids) > max_len:                                      # truncate in the MIDDLE, by tokens
        ids = ids[:max_len // 2] + ids[-max_len // 2:]          # max_len tokens exactly, odd or even
        prompt = tokenizer.decode(ids, skip_special_tokens=True)
    answer = the model's reply to prompt as one user turn, 128 new tokens at most
    pred = extract_answer(answer); right when pred == record["answer"]

The truncated prompt is split into `context` (up to and including the document) and `question` (the
template's text after ``$DOC$``, filled in) when it still ends with that text, so the query-agnostic
protocols can compress the document alone. Differences from pred.py: `max_prompt_tokens` is the
model's limit (`model.max_prompt_tokens`; pred.py's is 120000 for its 128K-context models, set
``task.max_prompt_tokens=120000`` for the same cut); decoding is the run's (greedy by default) where
pred.py samples at temperature 0.1 through an OpenAI-compatible server; the chat template is the
tokenizer's own, applied by the generator (`task.chat_template=false`: the raw prompt); pred.py's
CoT, no-context and RAG variants are not implemented.

Data: ``datasets.load_dataset(repo, split=split, revision=revision)`` (cached by `datasets`; the
Hub repo holds one `data.json`, split `train`), or local files given by `data_files`: the repo's
``data.json``, a ``.jsonl`` or ``.parquet`` file, or a directory holding ``data.json`` or parquet
shards. The data is read before the model loads; a missing file or an unreachable Hub is one error
naming the dataset, the repository and `task.data_files`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from eval.tasks import hub_data
from eval.tasks.base import Sample, Task
from eval.tasks.longbench.task import split_prompt
from eval.tasks.longbench_v2 import metrics
from eval.tasks.longbench_v2.prompts import CHOICES, DIFFICULTIES, LENGTHS, MAX_NEW_TOKENS, TEMPLATE_0SHOT
from eval.tasks.registry import register_task

HUB_REPO_ID = "THUDM/LongBench-v2"
DATASET = "longbench_v2"
# The fields pred.py reads from each record.
FIELDS = ("_id", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer", "context")
LOCAL_HINT = "THUDM/LongBench-v2's data.json, a .jsonl / .parquet file, or a directory of them"


def fill(template: str, record: dict[str, Any], context: str | None = None) -> str:
    """pred.py's prompt: each placeholder replaced in turn over the whole text, by the record's
    stripped field (`context` replaces the record's own document when given)."""
    document = record["context"] if context is None else context
    text = template.replace("$DOC$", document.strip()).replace("$Q$", record["question"].strip())
    for letter in CHOICES:
        text = text.replace(f"$C_{letter}$", record[f"choice_{letter}"].strip())
    return text


def truncate_middle(prompt: str, tokenizer: Any, max_tokens: int) -> tuple[str, int]:
    """LongBench-v2's middle truncation (pred.py's `query_llm`). Returns (prompt, untruncated count).

    Tokens are counted with the tokenizer's default special tokens; a longer prompt keeps its first
    ``max_tokens // 2`` and last ``-(-max_tokens // 2)`` tokens (Python's floor division on the
    negated length: `max_tokens` in all, the extra one at the end when odd), decoded together with
    `skip_special_tokens=True`. LongBench v1 (`eval.tasks.longbench.task.truncate_middle`) decodes
    the halves apart and keeps an even count.
    """
    ids = tokenizer.encode(prompt)
    n = len(ids)
    if n > max_tokens:
        ids = ids[: max_tokens // 2] + ids[-max_tokens // 2 :]
        prompt = tokenizer.decode(ids, skip_special_tokens=True)
    return prompt, n


def _local_path(data_files: Path) -> Path:
    if data_files.is_file():
        return data_files
    if data_files.is_dir():
        if (data_files / "data.json").is_file():
            return data_files / "data.json"
        if any(data_files.glob("*.parquet")):
            return data_files
        jsonl = sorted(data_files.glob("*.jsonl"))
        if len(jsonl) == 1:
            return jsonl[0]
    raise FileNotFoundError(
        f"LongBench-v2 data not found at task.data_files={data_files} (looked for the file itself, "
        f"or a directory holding data.json, *.parquet or one .jsonl); unset task.data_files to load "
        f"{HUB_REPO_ID} from the Hub"
    )


def _check_record(index: int, record: dict[str, Any]) -> None:
    missing = [k for k in FIELDS if not isinstance(record.get(k), str)]
    if missing:
        raise ValueError(
            f"LongBench-v2 record {index}: expected the string fields {', '.join(FIELDS)}; "
            f"missing or not a string: {', '.join(missing)}"
        )
    for key, known in (("difficulty", DIFFICULTIES), ("length", LENGTHS)):
        if record.get(key) not in known:  # the classes the report and the selection know
            raise ValueError(
                f"LongBench-v2 record {index} ({record['_id']}): {key} must be one of {', '.join(known)}, "
                f"got {key}={record.get(key)!r}"
            )
    if record["answer"] not in CHOICES:
        raise ValueError(
            f"LongBench-v2 record {index} ({record['_id']}): answer must be one of A, B, C, D, "
            f"got answer={record['answer']!r}"
        )


def _choices(key: str, value: Any, known: tuple[str, ...]) -> list[str]:
    values = [value] if isinstance(value, str) else [str(v) for v in value]  # a Hydra ListConfig too
    unknown = [v for v in values if v not in known]
    if not values or unknown:
        raise ValueError(
            f"longbench_v2 {key} must be a non-empty list of {', '.join(known)}, got {key}={values!r}"
        )
    return values


@register_task
@dataclass
class LongBenchV2Task(Task):
    """LongBench-v2: the records of the Hub dataset or a local file, pred.py's prompt and middle
    truncation, scored by its answer extraction (see the module docstring).

    Args:
        repo: the Hub dataset.
        revision: a Hub revision (commit, branch or tag) to pin; None: the default branch.
        split: the split to load (the dataset has one, `train`).
        data_files: local data instead of the Hub: the repo's data.json, a .jsonl / .parquet file,
            or a directory holding data.json or parquet shards.
        difficulties: the records' difficulties to run (easy, hard).
        lengths: the records' length classes to run (short, medium, long).
        limit: the first N of the selected records (None: all).
        max_prompt_tokens: the prompt limit in tokens (special tokens counted); a longer prompt is
            cut in the middle to it.
        chat_template: render the prompt as one user turn with the tokenizer's chat template (when
            it has one), as pred.py's chat API does.
    """

    name: ClassVar[str] = "longbench_v2"
    version: ClassVar[int] = 1
    # Which records run, and where the same data is read from.
    selection_keys: ClassVar[tuple[str, ...]] = ("difficulties", "lengths", "limit", "data_files", "revision")

    repo: str = HUB_REPO_ID
    revision: str | None = None
    split: str = "train"
    data_files: str | None = None
    difficulties: list[str] = field(default_factory=lambda: list(DIFFICULTIES))
    lengths: list[str] = field(default_factory=lambda: list(LENGTHS))
    limit: int | None = None
    max_prompt_tokens: int = 7500
    chat_template: bool = True

    def __post_init__(self) -> None:
        self.difficulties = _choices("difficulties", self.difficulties, DIFFICULTIES)
        self.lengths = _choices("lengths", self.lengths, LENGTHS)
        if self.limit is not None and (
            isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1
        ):
            raise ValueError(
                f"longbench_v2 limit must be a positive integer or null, got limit={self.limit!r}"
            )
        if (
            isinstance(self.max_prompt_tokens, bool)
            or not isinstance(self.max_prompt_tokens, int)
            or self.max_prompt_tokens < 2
        ):
            raise ValueError(
                "longbench_v2 max_prompt_tokens must be an integer >= 2, "
                f"got max_prompt_tokens={self.max_prompt_tokens!r}"
            )
        if not isinstance(self.chat_template, bool):
            raise ValueError(
                f"longbench_v2 chat_template must be true or false, got chat_template={self.chat_template!r}"
            )
        for key in ("repo", "split"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ValueError(
                    f"longbench_v2 {key} must be a non-empty string, got {key}={getattr(self, key)!r}"
                )
        if self.revision is not None:
            self.revision = str(self.revision)
        if self.data_files is not None:
            self.data_files = str(self.data_files)
        self._records: list[dict[str, Any]] | None = None

    # ---- data
    def records(self) -> list[dict[str, Any]]:
        """The selected records (difficulty and length, then the first `limit`), read once."""
        if self._records is None:
            if self.data_files is not None:
                rows = hub_data.read_local(_local_path(Path(self.data_files).expanduser()))
            else:
                rows = hub_data.load_hub(
                    "LongBench-v2", self.repo, None, self.split, self.revision, LOCAL_HINT
                )
            for i, record in enumerate(rows):
                _check_record(i, record)
            rows = [
                r
                for r in rows
                if r.get("difficulty") in self.difficulties and r.get("length") in self.lengths
            ]
            self._records = rows[: self.limit] if self.limit is not None else rows
        return self._records

    def num_samples(self) -> int:
        return len(self.records())

    # ---- samples
    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        for record in self.records():
            yield self.make_sample(record, tokenizer)

    def make_sample(self, record: dict[str, Any], tokenizer: Any) -> Sample:
        """One record -> `Sample` (prompt built, cut in the middle for `tokenizer`, split)."""
        prompt, n_tokens = truncate_middle(fill(TEMPLATE_0SHOT, record), tokenizer, self.max_prompt_tokens)
        # The template's text after the document, filled as pred.py fills it (the document left out).
        suffix = fill(TEMPLATE_0SHOT.split("$DOC$", 1)[1], record, context="")
        context, question = split_prompt(prompt, suffix)
        return Sample(
            sample_id=record["_id"],
            dataset=DATASET,
            context=context,
            question=question,
            answers=[record["answer"]],
            max_new_tokens=MAX_NEW_TOKENS,
            chat_template=self.chat_template,
            extra={
                "difficulty": record["difficulty"],
                "length": record["length"],
                "domain": record.get("domain"),
                "sub_domain": record.get("sub_domain"),
                "prompt_tokens": n_tokens,
                "truncated": n_tokens > self.max_prompt_tokens,
            },
        )

    # ---- scoring
    def score(self, sample: Sample, prediction: str) -> float:
        """1.0 when the extracted letter is the answer (pred.py's `judge`), else 0.0."""
        return float(metrics.judge(prediction, sample.answers[0]))

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        """`answered`: a letter could be extracted; `compensated`: result.py's compensated accuracy
        (0.25 for no extractable answer)."""
        pred = metrics.extract_answer(prediction)
        judged = pred == sample.answers[0]
        return {"answered": float(pred is not None), "compensated": metrics.accuracy(judged, pred, True)}
