"""InfiniteBench's scorers, transcribed from OpenBMB/InfiniteBench `src/compute_scores.py`
(`get_score_one`) and the labels of `src/eval_utils.py` (`get_answer`) (Copyright (c) 2023
OpenBMB, MIT License). Those SCBench shares with InfiniteBench come from `eval.tasks.scbench.metrics`.

| task | scorer | label |
|---|---|---|
| passkey, number_string | the prediction's first run of digits equals the label | the answer's first item |
| kv_retrieval | the label is one of the prediction's words (split at whitespace and `\\n:"'.,?!{}`) | the answer |
| longbook_sum_eng | ROUGE-Lsum F1 (`evaluate`'s rouge: Google's rouge_score, no stemmer), best over the answers | the answers |
| longbook_choice_eng, code_debug | the option's letter or text, found as the original looks for it | [answer, its letter] |
| longbook_qa_eng | the best token F1 (SQuAD normalisation) over the answers | the answers |
| longbook_qa_chn | the best character F1 (punctuation and spaces removed) over the answers | the answers |
| longdialogue_qa_eng | the first answer is one of the prediction's upper-cased words | the answers |
| math_find | the prediction's first number equals the label | the answer's first item |
| math_calc | the share of the label's values the prediction's numbers match, from the start until the first miss | the answer |
| code_run | the last word of the prediction is the label's integer | the answer's first item |

Fidelity: (1) math_calc: the original drops the first number of GPT-4's predictions (its GPT-4
prompt makes the model repeat the expression's first number); here no number is dropped, whatever
the template. (2) math_find with an int label and a decimal first number: the original's
``int("5.5")`` raises; here the number is truncated (SCBench's reading). (3) kv_retrieval and
code_run take a list label's first item and code_run an integer written as a string, where the
original would compare the list or the string and score 0. (4) `score` of a record whose answer
is not in its options raises ValueError (the original's ``list.index``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from eval.tasks.longbench.metrics import normalize_answer
from eval.tasks.scbench.metrics import LETTERS, f1, longbook_choice, math_find, passkey, qa_f1_zh, rouge_lsum

# Characters the original turns into spaces before splitting a prediction into words.
RETRIEVAL_SEPARATORS = ("\n", ":", '"', "'", ".", ",", "?", "!", "{", "}")


def _first(label: Any) -> Any:
    return label[0] if isinstance(label, list) else label


def _words(prediction: str, separators: Sequence[str]) -> list[str]:
    for c in separators:
        prediction = prediction.replace(c, " ")
    return prediction.split()


def kv_retrieval(prediction: str, label: Any) -> float:
    """`get_score_one_kv_retrieval`: the label is a whole word of the prediction."""
    return float(_first(label) in _words(prediction, RETRIEVAL_SEPARATORS))


def code_run(prediction: str, label: Any) -> float:
    """`get_score_one_code_run`: the prediction's last word (after `\\n.`'":` become spaces) is the
    label's integer."""
    label = _first(label)
    if isinstance(label, str) and re.fullmatch(r"-?\d+", label.strip()):
        label = int(label)
    words = _words(prediction.strip(), ("\n", ".", "`", "'", '"', ":"))
    if not words:
        return 0.0
    try:
        return float(label == int(words[-1]))
    except ValueError:
        return 0.0


def code_debug(prediction: str, label: Sequence[str]) -> float:
    """`get_score_one_code_debug`, `label` = [function name, its letter]: the prediction opens with
    "<letter>." / "<letter>:", or the text after its first answer prefix ("answer is:", "is:",
    "answer:", "correct option is:", in that order) starts with the letter or the name."""
    pred = prediction.strip()
    fn_name, letter = label[0], label[1]
    if pred[:2] in (f"{letter}.", f"{letter}:"):
        return 1.0
    for c in ["\n", "`", "'", '"', "-", "*", "Option", "option"]:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    for prefix in ["answer is:", "is:", "answer:", "correct option is:"]:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:  # the prediction ends with the prefix
            return 0.0
        after = pred[idx + len(prefix) + 1 :]
        return float(after.startswith(letter) or after.startswith(fn_name))
    return 0.0


def longdialogue_qa(prediction: str, label: Any) -> float:
    """`get_score_one_longdialogue_qa_eng`: the first answer is one of the prediction's words,
    upper-cased (the answers are the upper-case names the script uses)."""
    words = [w.upper() for w in _words(prediction.strip(), RETRIEVAL_SEPARATORS)]
    return float(_first(label) in words)


def qa_f1(prediction: str, labels: Sequence[str] | str) -> float:
    """`qa_f1_score`: the best token F1 of the normalised prediction over the normalised answers."""
    labels = [labels] if isinstance(labels, str) else labels
    pred = normalize_answer(prediction).split()
    return max((f1(pred, normalize_answer(label).split()) for label in labels), default=0.0)


def math_calc(prediction: str, label: Sequence[Any]) -> float:
    """`get_score_one_math_calc`: the prediction's runs of digits, as integers, against the label's
    values in order; the share matched before the first mismatch (no sign: "-3" reads 3)."""
    if label and isinstance(label[0], list):
        label = label[0]
    numbers = [int(item) for item in re.split("[^0-9]", prediction) if item != ""]
    count = 0
    for want, got in zip(label, numbers):
        if want != got:
            break
        count += 1
    return count / len(label)


def math_find_one(prediction: str, label: Any) -> float:
    """`get_score_one_math_find`: the first number of the prediction equals the label's first item."""
    return math_find(prediction, _first(label))


def answer_label(task: str, record: dict[str, Any]) -> Any:
    """The label InfiniteBench scores a record against (`get_answer`): [answer, its letter] for the
    choice tasks, else the answer as it is."""
    answer = record["answer"]
    if task not in ("code_debug", "longbook_choice_eng"):
        return answer
    options = list(record.get("options") or [])
    if isinstance(answer, list) and len(answer) == 2 and answer[1] in LETTERS:
        return list(answer)
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    if not isinstance(answer, str) or answer not in options:
        raise ValueError(f"{task} answer {answer!r} is not one of its options {options!r}")
    return [answer, LETTERS[options.index(answer)]]


SCORERS: dict[str, Callable[[str, Any], float]] = {
    "passkey": passkey,
    "number_string": passkey,
    "kv_retrieval": kv_retrieval,
    "longbook_sum_eng": rouge_lsum,
    "longbook_choice_eng": longbook_choice,
    "longbook_qa_eng": qa_f1,
    "longbook_qa_chn": qa_f1_zh,
    "longdialogue_qa_eng": longdialogue_qa,
    "math_find": math_find_one,
    "math_calc": math_calc,
    "code_run": code_run,
    "code_debug": code_debug,
}


def score(task: str, prediction: str, label: Any) -> float:
    """One prediction's score under `task`'s scorer (`get_score_one`), in [0, 1]."""
    return float(SCORERS[task](prediction, label))
