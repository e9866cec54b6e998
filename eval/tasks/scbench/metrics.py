"""SCBench's scorers, transcribed from microsoft/MInference `scbench/compute_scores.py` and the labels
of `scbench/eval_utils.py` `get_ground_truth` (Copyright (c) Microsoft Corporation, MIT License).

SCBench scores most configs with InfiniteBench's scorers (`Multiturnbench_to_Infinitebench`):

| config | SCBench's scorer | label |
|---|---|---|
| scbench_kv, scbench_prefix_suffix | `kv_retrieval`: the label is a substring of the prediction (case-sensitive) | the answer |
| scbench_vt | `string_match_all`: share of the labels contained (case-insensitive), rounded to 2 decimals | the answer list |
| scbench_qa_eng | `longdialogue_qa_eng`: 1 if any label, upper-cased, is in the upper-cased prediction | [answer] |
| scbench_qa_chn | `longbook_qa_chn`: the best character F1 (lower-cased, punctuation and spaces removed) over the labels | the answer as it is |
| scbench_choice_eng | `longbook_choice_eng`: the first letter, else an answer prefix, else the first A-D word | [answer, its letter] |
| scbench_many_shot | `longdialogue_qa_eng` | the answer as it is |
| scbench_mf | `math_find`: the first number of the prediction equals the label | the answer (int or float) |

Fidelity: scbench_many_shot and scbench_qa_chn pass a string answer itself where the scorer loops
over a list of labels, so SCBench scores each character of the answer as a label of its own: a
many-shot prediction that contains any one character of the answer (upper-cased) counts as right,
and a Chinese answer scores the best F1 of the prediction against one of its characters. `score`
reproduces that, to compare with SCBench's numbers; `SCBenchTask.score_all` adds the metric over
the whole answer (`answer_in_prediction`, `f1_whole_answer`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

LETTERS = "ABCD"


def kv_retrieval(prediction: str, label: str) -> float:
    """`get_score_one_kv_retrieval`."""
    return float(label in prediction)


def string_match_all(prediction: str, labels: Sequence[str]) -> float:
    """`string_match_all`: the share of the labels found in the prediction, case-insensitive,
    rounded to 2 decimals as SCBench does."""
    score = sum(1.0 if r.lower() in prediction.lower() else 0.0 for r in labels) / len(labels)
    return round(score, 2)


def longdialogue_qa(prediction: str, labels: Sequence[str] | str) -> float:
    """`get_score_one_longdialogue_qa_eng`: 1 if any item of `labels`, upper-cased, occurs in the
    stripped upper-cased prediction (a string label is looped over character by character)."""
    prediction = prediction.strip().upper()
    return float(any(item.upper() in prediction for item in labels))


def longbook_choice(prediction: str, labels: Sequence[str]) -> float:
    """`get_score_one_longbook_choice_eng`, `labels` = [answer text, its letter]."""
    pred = prediction.strip()
    if pred == "":
        return 0.0
    if pred[0] in LETTERS:
        return float(pred[0] in labels)
    if pred in labels:
        return 1.0
    for c in ["\n", '"', "'", ".", ",", "?", "!", "{", "}"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "answer:", "answer is", "option is"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:  # the prediction ends with the prefix
            return 0.0
        after = pred[idx + len(prefix) + 1 :]
        return float(any(after.startswith(s) for s in labels))
    for word in pred.split():
        # SCBench tests `word in "ABCD"`: a substring test, so "AB" or "BCD" count as letters too.
        if word in LETTERS:
            return float(word in labels)
    return 0.0


def math_find(prediction: str, label: int | float) -> float:
    """`get_score_one_math_find`: the prediction's first number (`\\d+\\.\\d+|\\d+`, no sign) equals
    the label: truncated to an int for an int label, as a float for a float label."""
    first = re.search(r"\d+\.\d+|\d+", prediction)
    if first is None:
        return 0.0
    number = first.group(0).strip()
    if isinstance(label, bool) or not isinstance(label, (int, float)):
        raise TypeError(f"math_find needs an int or float label, got {label!r}")
    if isinstance(label, int):
        return float(int(float(number)) == label)
    return float(float(number) == label)


# normalize_zh_answer's punctuation: ASCII and Chinese.
CN_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
ZH_PUNCTUATION = frozenset(string.punctuation + CN_PUNCTUATION)


def normalize_zh(text: str) -> str:
    """`normalize_zh_answer`: lower-cased, punctuation removed, every whitespace removed."""
    return "".join("".join(ch for ch in text.lower() if ch not in ZH_PUNCTUATION).split())


def f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """Token F1 of two token lists (`f1_score`'s first value)."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1_zh(prediction: str, labels: Sequence[str] | str) -> float:
    """`qa_f1_score_zh`: the best character F1 of the normalised prediction over the normalised
    items of `labels` (a string label is looped over character by character)."""
    pred = list(normalize_zh(prediction))
    return max((f1(pred, list(normalize_zh(item))) for item in labels), default=0.0)


def label(config: str, turn: dict[str, Any]) -> Any:
    """SCBench's label of one turn (`get_ground_truth`)."""
    answer = turn["answer"]
    if config == "scbench_choice_eng":
        options = list(turn["options"])
        if answer not in options:
            raise ValueError(f"scbench_choice_eng answer {answer!r} is not one of its options {options!r}")
        return [answer, LETTERS[options.index(answer)]]
    if config == "scbench_qa_eng":
        return [answer]
    return answer


SCORERS: dict[str, Callable[[str, Any], float]] = {
    "scbench_kv": kv_retrieval,
    "scbench_prefix_suffix": kv_retrieval,
    "scbench_vt": string_match_all,
    "scbench_qa_eng": longdialogue_qa,
    "scbench_qa_chn": qa_f1_zh,
    "scbench_choice_eng": longbook_choice,
    "scbench_many_shot": longdialogue_qa,
    "scbench_mf": math_find,
}
