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
| scbench_summary | `longbook_sum_eng`: ROUGE-Lsum F1 (`evaluate`'s rouge: Google's rouge_score, Apache-2.0, no stemmer; restated) | the answer |
| scbench_repoqa | RepoQA's: the most similar needle (BLEU) is the asked function, BLEU >= 0.8 (`repoqa.py`) | the function's name, language, the repository's needles |
| scbench_repoqa_and_kv | per turn `task`: RepoQA (scbench_repoqa) or `kv_retrieval` (scbench_kv) | as those |
| scbench_summary_with_needles | per turn `task`: ROUGE-Lsum (scbench_summary), `passkey` (the prediction's first digit run equals the label) | the answer |

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

from eval.tasks.scbench.repoqa import repoqa

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


def rouge_tokens(text: str) -> list[str]:
    """rouge_score's default tokenizer without stemming: lower-cased runs of [a-z0-9]."""
    return [
        t for t in re.split(r"\s+", re.sub(r"[^a-z0-9]+", " ", text.lower())) if re.fullmatch(r"[a-z0-9]+", t)
    ]


def _lcs_indices(ref: list[str], can: list[str]) -> list[int]:
    """Indices into `ref` of one longest common subsequence with `can` (rouge_score's DP table and
    its backtrack, which prefers moving along `ref` on ties)."""
    table = [[0] * (len(can) + 1) for _ in range(len(ref) + 1)]
    for i in range(1, len(ref) + 1):
        for j in range(1, len(can) + 1):
            if ref[i - 1] == can[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    i, j, out = len(ref), len(can), []
    while i > 0 and j > 0:
        if ref[i - 1] == can[j - 1]:
            out.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i][j - 1] > table[i - 1][j]:
            j -= 1
        else:
            i -= 1
    return out[::-1]


def _rouge_lsum_one(reference: str, prediction: str) -> float:
    """Summary-level LCS F1 (ROUGE paper section 3.2) over newline-separated sentences, each
    reference token counted at most as often as it occurs on both sides (rouge_score's
    `_summary_level_lcs`)."""
    ref = [rouge_tokens(s) for s in reference.split("\n") if s]
    can = [rouge_tokens(s) for s in prediction.split("\n") if s]
    m, n = sum(map(len, ref)), sum(map(len, can))
    if not ref or not can or not m or not n:
        return 0.0
    left_r = Counter(t for sent in ref for t in sent)
    left_c = Counter(t for sent in can for t in sent)
    hits = 0
    for sent in ref:
        union = sorted(set().union(*(_lcs_indices(sent, c) for c in can)))
        for t in (sent[i] for i in union):
            if left_c[t] > 0 and left_r[t] > 0:
                hits += 1
                left_c[t] -= 1
                left_r[t] -= 1
    recall, precision = hits / m, hits / n
    return 2 * precision * recall / (precision + recall) if precision + recall > 0 else 0.0


def rouge_lsum(prediction: str, label: str | Sequence[str]) -> float:
    """`get_score_one_longbook_sum_eng`: `evaluate.load("rouge").compute(predictions=[prediction],
    references=[label], use_aggregator=False)["rougeLsum"][0]`, i.e. Google's rouge_score
    ROUGE-Lsum F1 without stemming, restated here (`rouge_tokens`, `_rouge_lsum_one`); a list
    label: the best over its items (`score_multi`)."""
    if isinstance(label, str):
        return _rouge_lsum_one(label, prediction)
    return max((_rouge_lsum_one(ref, prediction) for ref in label), default=0.0)


def first_int(prediction: str) -> str:
    """`first_int_match`: the first run of digits of the prediction ("" if none)."""
    return next((item for item in re.split("[^0-9]", prediction) if item != ""), "")


def passkey(prediction: str, label: Any) -> float:
    """`get_score_one_passkey`: the label equals the prediction's first digit run (a string
    comparison: SCBench's labels are strings; the first item of a list label)."""
    if isinstance(label, list):
        label = label[0]
    return float(label == first_int(prediction))


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
    "scbench_summary": rouge_lsum,
    "scbench_passkey": passkey,
    "scbench_repoqa": repoqa,
}
