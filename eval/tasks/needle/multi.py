"""Several needles in one haystack, one question per needle (``task.needles=K``, K > 1).

RULER's niah multi-key layout (https://github.com/NVIDIA/RULER, Apache-2.0): K needle sentences
"One of the special magic numbers for <key> is: <number>." with K distinct keys (adjective-noun,
drawn from RULER's `wonderwords` lists) and K distinct 7-digit numbers, in one haystack sized like
the single needle's (`eval.tasks.needle.task`). Unlike RULER, which asks for all keys at once, each
key is asked by its own question, one `Sample` per question: the samples of a cell share
``context_id`` and the same ``context`` (instruction + haystack with every needle), and ``question``
holds only that question (plus the answer prefix without a chat template).

Depths: needle k sits at depth ``depth + 100 * k / K`` of the haystack (wrapped past 100), i.e. the
K needles are evenly spread over the haystack, the first at the cell's depth; each is moved back to
a sentence boundary like the single needle. Question k asks for needle k (question 0: the needle at
the cell's depth), so ``question_index`` is the order of asking, not the order in the text.

Sizing: the single needle's loop, measured with question 0; every sample's ``actual_tokens`` is
its own prompt (context + its question), which differs from question 0's by the key's tokens.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from eval.tasks.ruler.generate import wonder_words

# RULER niah wording (config.py's niah template, singular question), number-valued needles.
INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards.\n\n"
)
NEEDLE = "One of the special magic numbers for {key} is: {number}."
QUESTION = "\n\nWhat is the special magic number for {key} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic number for {key} mentioned in the provided text is"
VERSION = "1"


def words_version() -> str:
    """Version of the multi-needle content: the layout and the word lists the keys come from."""
    words = "\n".join(wonder_words("adjective") + wonder_words("noun"))
    return f"multi{VERSION}+words.{hashlib.sha256(words.encode()).hexdigest()[:8]}"


@dataclass(frozen=True)
class Needle:
    key: str
    number: str
    depth: float  # requested depth percent

    @property
    def sentence(self) -> str:
        return NEEDLE.format(key=self.key, number=self.number)

    def question(self, templated: bool) -> str:
        return QUESTION.format(key=self.key) + ("" if templated else ANSWER_PREFIX.format(key=self.key))


def needle_depths(depth: float, k: int) -> list[float]:
    """The K depths of a cell: evenly spread, the first at ``depth`` (module docstring)."""
    out = []
    for i in range(k):
        d = depth + 100.0 * i / k
        out.append(d - 100.0 if d > 100.0 else d)
    return out


def draw_needles(seed: int, length: int, depth: str, k: int) -> list[Needle]:
    """K needles with distinct keys and distinct numbers, drawn from (seed, length, depth, K)."""
    rng = random.Random(f"needle:{seed}:{length}:{depth}:k{k}")
    adjectives, nouns = wonder_words("adjective"), wonder_words("noun")
    keys: list[str] = []
    numbers: list[str] = []
    while len(keys) < k:
        key = f"{rng.choice(adjectives)}-{rng.choice(nouns)}"
        if key not in keys:
            keys.append(key)
    while len(numbers) < k:
        number = str(rng.randint(1_000_000, 9_999_999))
        if number not in numbers:
            numbers.append(number)
    return [Needle(key, n, d) for key, n, d in zip(keys, numbers, needle_depths(float(depth), k))]


def insert_needles(hay: Any, budget: int, needles: list[Needle]) -> tuple[str, list[int]]:
    """The first ``budget`` haystack tokens with every needle at its depth (on a sentence boundary;
    needles that land on the same boundary follow each other in needle order); returns the text and
    each needle's insertion token."""
    points = [hay.insertion_token(budget, n.depth) for n in needles]
    parts: list[tuple[str, bool]] = []  # (text, is a needle)
    at = 0
    for i in sorted(range(len(needles)), key=lambda i: (points[i], i)):
        c = hay.char_at(points[i])
        parts += [(hay.text[at:c], False), (needles[i].sentence, True)]
        at = c
    parts.append((hay.text[at : hay.char_at(budget)], False))
    out, prev_needle = "", False
    for text, is_needle in parts:
        if not text:
            continue
        # a space where a needle meets text (or another needle) without whitespace, as `_join` does
        if out and (is_needle or prev_needle) and not out[-1].isspace() and not text[0].isspace():
            out += " "
        out += text
        prev_needle = is_needle
    return out, points
