"""The final answer of a chain-of-thought generation and its verification.

Extraction (`extract_answer`): the first non-empty line after the last "Final answer:" / "final
answer is:" (case-insensitive) that is more than display delimiters (`\\[`, `$$`, `**`,
`<answer>` tags), its `\\boxed{...}` content where it has one, a trailing period stripped (models write
"the final answer is:" then the value on the next lines, or a "Final answer:" line under it); else
the content of the last `\\boxed{...}`; else None (the row's `format` metric is 0; the answer then
scores 0).

Verification of a reference answer (`verify_answer`, the JSONL source): `math-verify`
(huggingface/Math-Verify, Apache-2.0: `verify(parse(gold), parse(answer))`, numeric and symbolic
equivalence: 1/2 = 0.5 = \\frac{1}{2}) where it is installed (the `reasoning` extra: `pip install -e '.[reasoning]'`);
else exact comparison of the two as numbers (`fractions.Fraction` of the decimal or a/b text, thousands
commas and a leading `$` dropped; exact string match, whitespace removed, when either is
not a number). `VERIFIER` names the one in use; each row records it.
"""

from __future__ import annotations

import importlib.util
import re
from fractions import Fraction

FINAL = re.compile(r"final answer\s*(?:is)?\s*[:：]", re.IGNORECASE)
# Display wrappers around a stated answer: LaTeX display/inline delimiters, bold, answer tags.
WRAPPERS = re.compile(r"\\\[|\\\]|\\\(|\\\)|</?answer>|\*\*", re.IGNORECASE)
VERIFIER = "math_verify" if importlib.util.find_spec("math_verify") is not None else "numeric"


def _boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (nested braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None


def _clean(answer: str) -> str:
    boxed = _boxed(answer)
    if boxed is not None:
        return boxed
    answer = WRAPPERS.sub("", answer).strip().strip("*$").strip()
    return answer[:-1].strip() if answer.endswith(".") else answer


def extract_answer(text: str) -> str | None:
    """The final answer of `text` (module docstring), or None when it states none."""
    text = text or ""
    ends = [m.end() for m in FINAL.finditer(text)]
    starts = [m.start() for m in FINAL.finditer(text)][1:] + [len(text)]
    for end, nxt in reversed(list(zip(ends, starts))):
        for line in text[end:nxt].splitlines():
            answer = _clean(line)
            if answer:
                return answer
    boxed = _boxed(text)
    return boxed if boxed else None


def as_number(text: str) -> Fraction | None:
    """`text` as an exact number (`12`, `-3.50`, `1,024`, `$7`, `3/4`), else None."""
    t = text.strip().replace(",", "").lstrip("$").strip()
    if not re.fullmatch(r"[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?", t):
        return None
    try:
        return Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None


def numeric_equal(gold: str, answer: str) -> bool:
    """Exact comparison as numbers, else of the strings without whitespace."""
    g, a = as_number(gold), as_number(answer)
    if g is not None and a is not None:
        return g == a
    return "".join(gold.split()) == "".join(answer.split())


def _math_parse(text: str):
    from math_verify import parse  # lazy: sympy and its parsers load on first use

    wrapped = text if "$" in text or "\\boxed" in text else f"${text}$"
    parsed = parse(wrapped)
    return parsed if parsed else parse(text)


def verify_answer(gold: str, answer: str | None, verifier: str = VERIFIER) -> bool:
    """Whether `answer` equals the reference `gold` under `verifier` (`math_verify` or `numeric`)."""
    if answer is None:
        return False
    if verifier == "numeric":
        return numeric_equal(gold, answer)
    if verifier != "math_verify":
        raise ValueError(f"unknown verifier {verifier!r}; known: math_verify, numeric")
    from math_verify import verify

    return bool(verify(_math_parse(gold), _math_parse(answer)))
