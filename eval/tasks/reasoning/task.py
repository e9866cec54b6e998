"""Long generation: chain-of-thought problems whose answer comes after several hundred generated tokens.

With a short prompt and a long output, the cache is mostly what the model writes: the setting of
decode-time compression, where an evicted step of the model's own reasoning can change its answer
(and its length). Two sources:

- ``source: reasoning_gym`` (default): procedural problems from reasoning-gym
  (open-thought/reasoning-gym, Apache-2.0; the `reasoning` extra: ``pip install -e '.[reasoning]'``),
  generated offline from the seed, each scored by its dataset's own verifier
  (``dataset.score_answer(answer, entry)``; the row's ``score`` is 1 when it returns 1.0, its
  partial credit is kept as ``scores["rg_reward"]``). ``datasets`` maps each reasoning-gym dataset
  name to the overrides of its config; the defaults (``DEFAULT_DATASETS``: grade-school word problems
  and multi-step arithmetic sized so that Qwen2.5-Coder-0.5B-Instruct writes a few hundred tokens)
  follow. Problem ``i`` of dataset ``d`` is ``create_dataset(d, seed=seed, size=samples, **config)[i]``
  (reasoning-gym draws item i from ``Random(seed + i)``, so a larger ``samples`` extends a smaller one).
- ``source: jsonl``: a file of problems, ``path`` (AIME, MATH500, GSM8K exports): one JSON object per
  line with ``problem`` (or ``question``), ``answer`` (a string or number; GSM8K's "... #### 72":
  the text after ``####``) and optionally ``id`` (default: the 0-based line number among the
  problems) and ``source`` (the row's dataset; default: the file's stem). Scored by math-verify,
  or exactly as numbers where it is not installed (eval/tasks/reasoning/answers.py); every row names
  its ``verifier``. The file's sha256 is part of the config hash (its content, not its path).

Prompt: ``context`` is the problem; ``question`` is ``INSTRUCTION`` (think step by step, end with a
"Final answer: ..." line, which `answers.extract_answer` reads). Problems are interleaved across
datasets (problem 0 of each, then problem 1, ...), so ``limit`` keeps a mix.

Row columns: ``problem_index`` (within its dataset) and ``verifier`` (``reasoning_gym``,
``math_verify`` or ``numeric``); metrics: ``score`` (correct) and ``scores["format"]`` (a final
answer line was found). The report section (eval/tasks/reasoning/report.py): pass@1 with a bootstrap
interval over problems, output length and its ratio to the full cache on the same problems and
seeds, end-to-end time, and accuracy / length vs budget.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, ClassVar

from eval.tasks.base import Sample, Task
from eval.tasks.jsonl import numbered_records
from eval.tasks.reasoning import answers
from eval.tasks.registry import register_task

VERSION = "1"
INSTRUCTION = (
    "\n\nSolve the problem. Think step by step and show your reasoning. "
    "End with a last line of the form:\nFinal answer: <answer>"
)
INSTALL = "pip install -e '.[reasoning]' (or pip install reasoning-gym==0.1.25)"
SOURCES = ("reasoning_gym", "jsonl")
# reasoning-gym datasets and config overrides: word problems and arithmetic that a 0.5B instruct
# model works through in 200-500 tokens.
DEFAULT_DATASETS: dict[str, dict[str, Any]] = {
    "gsm_symbolic": {},
    "leg_counting": {"min_animals": 4, "max_animals": 8},
    "basic_arithmetic": {"min_terms": 4, "max_terms": 6, "min_digits": 2, "max_digits": 3},
    "chain_sum": {"min_terms": 5, "max_terms": 8, "min_digits": 2, "max_digits": 3},
}


def _reasoning_gym():
    try:
        import reasoning_gym  # lazy: optional, and it imports many puzzle packages
    except ImportError:
        raise ValueError(f"task=reasoning with source=reasoning_gym needs reasoning-gym: {INSTALL}") from None
    return reasoning_gym


@cache
def _rg_dataset(name: str, seed: int, size: int, config_json: str):
    return _reasoning_gym().create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def _positive_int(key: str, value: Any, allow_none: bool = False) -> int | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"reasoning {key} must be a positive integer, got {key}={value!r}")
    return value


def read_problems(path: Path) -> list[dict[str, str]]:
    """The problems of a JSONL file (module docstring) as {id, source, problem, answer}; ValueError
    naming the file and line for a malformed one."""
    if not path.is_file():
        raise FileNotFoundError(f"reasoning path not found: {path}")
    out: list[dict[str, str]] = []
    for lineno, obj in numbered_records(path):
        problem = obj.get("problem", obj.get("question"))
        answer = obj.get("answer")
        if not isinstance(problem, str) or not problem.strip() or answer is None or isinstance(answer, bool):
            raise ValueError(f"{path}:{lineno}: needs a non-empty `problem` (or `question`) and an `answer`")
        answer = str(answer)
        if "####" in answer:  # GSM8K: the worked solution, then "#### <number>"
            answer = answer.rsplit("####", 1)[1]
        out.append(
            {
                "id": str(obj.get("id", len(out))),
                "source": str(obj.get("source", path.stem)),
                "problem": problem,
                "answer": answer.strip(),
            }
        )
    if not out:
        raise ValueError(f"reasoning path {path} holds no problems")
    return out


@register_task
class ReasoningTask(Task):
    """Chain-of-thought problems with long outputs (module docstring).

    source: reasoning_gym | jsonl; datasets: {reasoning-gym name: config overrides} (reasoning_gym);
    samples: problems per dataset (reasoning_gym); path: the JSONL file (jsonl); limit: run only the
    first N problems of the interleaved list (null: all); seed: reasoning-gym's seed; max_new_tokens:
    the generation budget (reasoning outputs: several hundred tokens); chat_template: render with the
    tokenizer's chat template.
    """

    name: ClassVar[str] = "reasoning"
    version: ClassVar[str] = VERSION
    selection_keys: ClassVar[tuple[str, ...]] = ("samples", "limit")

    def __init__(
        self,
        source: str = "reasoning_gym",
        datasets: dict[str, dict[str, Any]] | None = None,
        samples: int = 10,
        path: str | None = None,
        limit: int | None = None,
        seed: int = 42,
        max_new_tokens: int = 512,
        chat_template: bool = True,
    ) -> None:
        if source not in SOURCES:
            raise ValueError(f"reasoning source must be one of {', '.join(SOURCES)}, got source={source!r}")
        self.source = source
        self.n_samples = _positive_int("samples", samples)
        self.limit = _positive_int("limit", limit, allow_none=True)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"reasoning seed must be an integer, got seed={seed!r}")
        if not isinstance(chat_template, bool):
            raise ValueError(
                f"reasoning chat_template must be true or false, got chat_template={chat_template!r}"
            )
        self.seed, self.chat_template = seed, chat_template
        datasets = DEFAULT_DATASETS if datasets is None else datasets
        if not isinstance(datasets, dict) or not datasets:
            raise ValueError(
                f"reasoning datasets must map reasoning-gym dataset names to config overrides, got datasets={datasets!r}"
            )
        self.datasets = {str(k): dict(v or {}) for k, v in datasets.items()}
        self.path = Path(path).expanduser() if path else None
        if source == "jsonl":
            if self.path is None:
                raise ValueError("reasoning source=jsonl needs task.path=<file.jsonl>, got path=None")
        else:
            known = _reasoning_gym().factory.DATASETS
            unknown = sorted(set(self.datasets) - set(known))
            if unknown:
                raise ValueError(
                    f"unknown reasoning-gym dataset(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
                )

    # ---- config hash: the data's content version
    def hash_params(self, config: dict[str, Any]) -> dict[str, Any]:
        params = super().hash_params(config)
        if self.source == "jsonl":
            params.pop("path", None)
            params.pop("datasets", None)
            params["content_sha256"] = hashlib.sha256(self.path.read_bytes()).hexdigest()
        else:
            params.pop("path", None)
            params["datasets"] = self.datasets
            try:
                params["reasoning_gym"] = version("reasoning-gym")
            except PackageNotFoundError:
                params["reasoning_gym"] = None
        return params

    # ---- data
    def _dataset(self, name: str):
        return _rg_dataset(name, self.seed, self.n_samples, json.dumps(self.datasets[name], sort_keys=True))

    def problems(self) -> list[dict[str, Any]]:
        """The problems to run, interleaved across datasets, cut to `limit`: {id, dataset, index,
        problem, answer, verifier}."""
        out: list[dict[str, Any]] = []
        if self.source == "jsonl":
            for i, p in enumerate(read_problems(self.path)):
                out.append(
                    {"id": f"{p['source']}/{p['id']}", "dataset": p["source"], "index": i, "problem": p["problem"],
                     "answer": p["answer"], "verifier": answers.VERIFIER}
                )  # fmt: skip
        else:
            for i in range(self.n_samples):
                for name in self.datasets:
                    entry = self._dataset(name)[i]
                    out.append(
                        {"id": f"{name}/{i}", "dataset": name, "index": i, "problem": entry["question"],
                         "answer": str(entry["answer"]), "verifier": "reasoning_gym"}
                    )  # fmt: skip
        ids = [p["id"] for p in out]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise ValueError(f"reasoning problems must have unique ids, got {dup!r} twice")
        return out[: self.limit] if self.limit else out

    def num_samples(self) -> int:
        return len(self.problems())

    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        templated = bool(self.chat_template and getattr(tokenizer, "chat_template", None))
        for p in self.problems():
            yield Sample(
                sample_id=p["id"],
                dataset=p["dataset"],
                context=p["problem"].rstrip(),
                question=INSTRUCTION,
                answers=[p["answer"]],
                max_new_tokens=self.max_new_tokens,
                chat_template=templated,
                extra={"problem_index": p["index"], "verifier": p["verifier"]},
            )

    # ---- scoring
    def _rg_reward(self, sample: Sample, answer: str | None) -> float:
        ds = self._dataset(sample.dataset)
        return float(ds.score_answer(answer, ds[sample.extra["problem_index"]]))

    def score(self, sample: Sample, prediction: str) -> float:
        answer = answers.extract_answer(prediction)
        verifier = sample.extra["verifier"]
        if verifier == "reasoning_gym":
            return float(self._rg_reward(sample, answer) == 1.0)
        return float(any(answers.verify_answer(gold, answer, verifier) for gold in sample.answers))

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        answer = answers.extract_answer(prediction)
        out = {"format": float(answer is not None)}
        if sample.extra["verifier"] == "reasoning_gym":
            out["rg_reward"] = self._rg_reward(sample, answer)
        return out
