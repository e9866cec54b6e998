"""LongBench's metrics and scorers for its 16 English datasets, reproduced exactly.

Semantics follow `metrics.py` and `eval.py` of LongBench (THUDM/LongBench,
https://github.com/THUDM/LongBench, MIT licence, (c) THUDM / Bai et al. 2023). This is an independent
re-implementation, written to give the same numbers, including LongBench's quirks:

* `classification_score` removes elements from the list it is iterating over (so some partial matches
  survive), and its difflib fallback is dead code (`list != 0` is always true): a prediction that
  names no class scores 0.
* `rouge_score` uses the PyPI `rouge` package (==1.0.1) and scores 0.0 whenever it raises, which
  includes empty hypotheses and the RecursionError its recursive LCS reconstruction hits on long
  sentences (pinned to the stack headroom LongBench's eval.py has, see `rouge_score`).
* `code_sim_score` keeps the first line of the prediction that contains none of '`', '#', '//', then
  applies fuzzywuzzy's `fuzz.ratio` (GPL, so not a dependency here) re-implemented with fuzzywuzzy's
  semantics: an *integer* percentage, `int(round(100 * ratio))` (round half to even), 100 for equal
  strings (two empty ones included), 0 when exactly one is empty. `ratio` is that of
  `difflib.SequenceMatcher`, fuzzywuzzy's fallback when python-Levenshtein is not installed, which is
  the setup that reproduces LongBench reference results (e.g. shared/data/longbench_golden: lcc 58.65);
  the Levenshtein/Indel ratio (python-Levenshtein, rapidfuzz's `fuzz.ratio`) gives other numbers
  (60.87 there).
* for trec, triviaqa and samsum the prediction is cut to its first line before scoring.
"""

from __future__ import annotations

import math
import re
import string
import sys
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from difflib import SequenceMatcher

import numpy as np
from rouge import Rouge

__all__ = [
    "DATASET2CATEGORY",
    "DATASET2METRIC",
    "FIRST_LINE_DATASETS",
    "CATEGORIES",
    "normalize_answer",
    "qa_f1_score",
    "rouge_score",
    "classification_score",
    "retrieval_score",
    "count_score",
    "code_sim_score",
    "fuzz_ratio",
    "check_dataset",
    "score_sample",
    "scorer",
    "scorer_e",
    "summarize",
]

Metric = Callable[..., float]

# --------------------------------------------------------------------------------------------------
# Text normalisation and metrics (per prediction / ground-truth pair, each in [0, 1]).
# --------------------------------------------------------------------------------------------------

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def normalize_answer(s: str) -> str:
    """SQuAD-style normalisation: lower-case, drop ASCII punctuation, drop a/an/the, squash spaces."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCTUATION)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def _token_f1(prediction_tokens: Sequence[str], ground_truth_tokens: Sequence[str]) -> float:
    """Bag-of-tokens F1 (multiset overlap)."""
    overlap = sum((Counter(prediction_tokens) & Counter(ground_truth_tokens)).values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(prediction_tokens)
    recall = overlap / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """Token F1 between the normalised prediction and ground truth."""
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


# `rouge` 1.0.1 rebuilds the ROUGE-L LCS recursively (one call per step), so a long sentence (text
# between two '.') makes it raise RecursionError, and LongBench scores the sample 0.0. Where that
# happens depends on how much recursion headroom the caller has left (frames, and in CPython 3.11 some
# C-level calls, count). To make it independent of the caller (CLI, pytest, a runner), each call is
# given the headroom `rouge_score` has in LongBench's eval.py run as a script under CPython 3.11 with
# the default limit 1000 (<module> -> scorer -> rouge_score): `_headroom()` there returns 996.
# Consequence: identical texts of 990 words with no '.' score 1.0, of 991 words 0.0.
_LONGBENCH_HEADROOM = 996
_recursion_limit_lock = threading.Lock()


def _headroom() -> int:
    """How many more nested Python calls the caller could make before RecursionError."""
    depth = 0

    def down() -> None:
        nonlocal depth
        depth += 1
        down()

    try:
        down()
    except RecursionError:
        pass
    return depth


def rouge_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """ROUGE-L F from the `rouge` package; 0.0 if it raises (as LongBench's bare `except`)."""
    with _recursion_limit_lock:
        saved = sys.getrecursionlimit()
        sys.setrecursionlimit(saved + _LONGBENCH_HEADROOM - _headroom())
        try:
            scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
        except Exception:  # empty hypothesis/reference, RecursionError on long sentences, ...
            return 0.0
        finally:
            sys.setrecursionlimit(saved)
    return scores["rouge-l"]["f"]


def classification_score(
    prediction: str, ground_truth: str, *, all_classes: Sequence[str] | None = None, **kwargs: object
) -> float:
    """1/k if the ground truth is among the k class names found in the prediction, else 0.

    Class names that are a strict substring of the ground truth are discarded first, with
    LongBench's remove-while-iterating behaviour (after a removal the next element is skipped).
    """
    if all_classes is None:
        raise ValueError("classification_score needs all_classes (got None)")
    matches = [name for name in all_classes if name in prediction]
    # Deliberately mutates `matches` while iterating over it: that is what LongBench does, and
    # iterating over a copy would change scores.
    for name in matches:
        if name in ground_truth and name != ground_truth:
            matches.remove(name)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _share_equal(numbers: list[str], target: str) -> float:
    """Fraction of the numbers that equal `target` (0.0 when there are none)."""
    if not numbers:
        return 0.0
    return float(sum(1 for n in numbers if n == target) / len(numbers))


def retrieval_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """Share of the integers in the prediction equal to N of the ground truth's 'Paragraph N'."""
    found = _PARAGRAPH.findall(ground_truth)
    if not found:
        raise ValueError(f"retrieval ground truth has no 'Paragraph N': {ground_truth!r}")
    return _share_equal(_NUMBER.findall(prediction), found[0])


def count_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """Share of the integers in the prediction equal to the ground-truth count."""
    return _share_equal(_NUMBER.findall(prediction), str(ground_truth))


def fuzz_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy's `fuzz.ratio` as LongBench ran it (no python-Levenshtein): integer in 0..100.

    100 if the strings are equal (two empty ones included), 0 if exactly one is empty, else
    `int(round(100 * difflib.SequenceMatcher(None, s1, s2).ratio()))` (round half to even).
    """
    if s1 == s2:
        return 100
    if not s1 or not s2:
        return 0
    return int(round(100 * SequenceMatcher(None, s1, s2).ratio()))


def code_sim_score(prediction: str, ground_truth: str, **kwargs: object) -> float:
    """fuzz.ratio/100 between the first non-comment, non-fence prediction line and the ground truth."""
    first = ""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            first = line
            break
    return fuzz_ratio(first, ground_truth) / 100


# --------------------------------------------------------------------------------------------------
# Dataset tables.
# --------------------------------------------------------------------------------------------------

DATASET2METRIC: dict[str, Metric] = {
    "narrativeqa": qa_f1_score,
    "qasper": qa_f1_score,
    "multifieldqa_en": qa_f1_score,
    "hotpotqa": qa_f1_score,
    "2wikimqa": qa_f1_score,
    "musique": qa_f1_score,
    "gov_report": rouge_score,
    "qmsum": rouge_score,
    "multi_news": rouge_score,
    "trec": classification_score,
    "triviaqa": qa_f1_score,
    "samsum": rouge_score,
    "passage_count": count_score,
    "passage_retrieval_en": retrieval_score,
    "lcc": code_sim_score,
    "repobench-p": code_sim_score,
}

CATEGORIES: tuple[str, ...] = (
    "single-doc QA",
    "multi-doc QA",
    "summarization",
    "few-shot learning",
    "synthetic",
    "code",
)

DATASET2CATEGORY: dict[str, str] = {
    "narrativeqa": "single-doc QA",
    "qasper": "single-doc QA",
    "multifieldqa_en": "single-doc QA",
    "hotpotqa": "multi-doc QA",
    "2wikimqa": "multi-doc QA",
    "musique": "multi-doc QA",
    "gov_report": "summarization",
    "qmsum": "summarization",
    "multi_news": "summarization",
    "trec": "few-shot learning",
    "triviaqa": "few-shot learning",
    "samsum": "few-shot learning",
    "passage_count": "synthetic",
    "passage_retrieval_en": "synthetic",
    "lcc": "code",
    "repobench-p": "code",
}

# LongBench eval.py cuts these predictions to their first line (lsht too, a Chinese dataset).
FIRST_LINE_DATASETS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum"})


def check_dataset(dataset: str) -> None:
    """Raise ValueError naming `dataset` and the known ones if it is not a LongBench English dataset."""
    if dataset not in DATASET2METRIC:
        raise ValueError(f"unknown LongBench dataset {dataset!r}; known: {', '.join(DATASET2METRIC)}")


# --------------------------------------------------------------------------------------------------
# Scorers (LongBench eval.py).
# --------------------------------------------------------------------------------------------------


def score_sample(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench's per-sample score in [0, 1]: first-line rule, then max over the ground truths."""
    check_dataset(dataset)
    if dataset in FIRST_LINE_DATASETS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    metric = DATASET2METRIC[dataset]
    score = 0.0
    for ground_truth in answers:
        score = max(score, metric(prediction, ground_truth, all_classes=all_classes))
    return score


def scorer(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    all_classes: Sequence[str] | None = None,
) -> float:
    """Mean per-sample score x100, rounded to 2 decimals (LongBench `scorer`)."""
    check_dataset(dataset)
    if len(predictions) != len(answers):
        raise ValueError(f"{len(predictions)} predictions but {len(answers)} answer lists")
    if not predictions:
        raise ValueError(f"no predictions to score for {dataset!r}")
    total = 0.0
    for prediction, ground_truths in zip(predictions, answers):
        total += score_sample(dataset, prediction, ground_truths, all_classes)
    return round(100 * total / len(predictions), 2)


def scorer_e(
    dataset: str,
    predictions: Sequence[str],
    answers: Sequence[Sequence[str]],
    lengths: Sequence[int],
    all_classes: Sequence[str] | None = None,
) -> dict[str, float]:
    """LongBench-E: mean score x100 (2 decimals) per `length` bucket "0-4k" / "4-8k" / "8k+".

    An empty bucket gives NaN, as numpy's mean of nothing does in LongBench.
    """
    check_dataset(dataset)
    if not len(predictions) == len(answers) == len(lengths):
        raise ValueError(
            f"{len(predictions)} predictions, {len(answers)} answer lists and {len(lengths)} lengths"
        )
    buckets: dict[str, list[float]] = {"0-4k": [], "4-8k": [], "8k+": []}
    for prediction, ground_truths, length in zip(predictions, answers, lengths):
        score = score_sample(dataset, prediction, ground_truths, all_classes)
        key = "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
        buckets[key].append(score)
    # Round the numpy float64 as LongBench does: numpy's round-half-even on the scaled value, which
    # can differ from Python's correctly rounded `round(float, 2)` in the last digit.
    return {
        key: float(round(100 * np.mean(values), 2)) if values else math.nan for key, values in buckets.items()
    }


def summarize(per_dataset: Mapping[str, float]) -> dict[str, object]:
    """Mean over the given datasets and per LongBench category (only categories present), 2 decimals.

    Returns {"average": float, "categories": {category: float}, "n_datasets": int}.
    """
    if not per_dataset:
        raise ValueError("summarize needs at least one dataset score")
    for dataset in per_dataset:
        check_dataset(dataset)
    by_category: dict[str, list[float]] = {}
    for dataset, value in per_dataset.items():
        by_category.setdefault(DATASET2CATEGORY[dataset], []).append(float(value))
    values = [float(v) for v in per_dataset.values()]
    return {
        "average": round(sum(values) / len(values), 2),
        "categories": {
            c: round(sum(by_category[c]) / len(by_category[c]), 2) for c in CATEGORIES if c in by_category
        },
        "n_datasets": len(values),
    }
