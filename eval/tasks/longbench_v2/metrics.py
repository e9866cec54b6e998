"""LongBench-v2's answer extraction (`pred.py`) and aggregation (`result.py`).

Transcribed from THUDM/LongBench (branch main, MIT licence, Copyright (c) 2023 THU-KEG & Zhipu AI,
https://github.com/THUDM/LongBench; Bai et al. 2024, https://arxiv.org/abs/2412.15204).

`extract_answer`: asterisks removed (markdown bold), then the first "The correct answer is (X)",
else the first "The correct answer is X", X one of A-D, case-sensitive; None when neither occurs.
A prediction is right when the extracted letter equals the record's `answer` (`judge`).

`summarize`: result.py's table row: accuracy x100, rounded to one decimal, over all predictions and
by difficulty (`easy`; every other value counts as hard) and length (`short`, `medium`; every other
value counts as long). result.py's `compensated` switch (off in its code) scores a prediction with
no extractable answer 0.25, a guess among four.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# result.py's column order.
COLUMNS = ("Overall", "Easy", "Hard", "Short", "Medium", "Long")

_PARENTHESISED = re.compile(r"The correct answer is \(([A-D])\)")
_BARE = re.compile(r"The correct answer is ([A-D])")


def extract_answer(response: str) -> str | None:
    """The chosen letter of a response (pred.py's `extract_answer`), None when it names none."""
    response = response.replace("*", "")
    match = _PARENTHESISED.search(response) or _BARE.search(response)
    return match.group(1) if match else None


def judge(response: str, answer: str) -> bool:
    """pred.py's `judge`: the extracted letter is the record's answer."""
    return extract_answer(response) == answer


def accuracy(judged: bool, pred: str | None, compensated: bool = False) -> float:
    """One prediction's contribution to result.py's sums: 1 / 0, or 0.25 for no answer when
    `compensated`."""
    if compensated and pred is None:
        return 0.25
    return float(judged)


def summarize(rows: Iterable[tuple[str, str, float]]) -> dict[str, float | None]:
    """result.py's row from (difficulty, length, accuracy) per prediction: accuracy x100 rounded to
    one decimal per column of `COLUMNS`; None for a column without predictions (result.py divides
    by zero there)."""
    sums = dict.fromkeys(COLUMNS, 0.0)
    counts = dict.fromkeys(COLUMNS, 0)
    for difficulty, length, acc in rows:
        level = "Easy" if difficulty == "easy" else "Hard"
        size = "Short" if length == "short" else "Medium" if length == "medium" else "Long"
        for column in ("Overall", level, size):
            sums[column] += acc
            counts[column] += 1
    return {c: round(100 * sums[c] / counts[c], 1) if counts[c] else None for c in COLUMNS}
