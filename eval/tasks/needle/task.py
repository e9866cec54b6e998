"""Needle-in-a-Haystack (gkamradt / RULER single-needle style): data + prompt + metric.

One sample per (context length, depth) cell. A needle sentence is inserted into a haystack at a
depth percentage, on a sentence boundary, and the prompt (instruction + haystack + question, inside
the chat template when used) is sized in the model's own tokenizer to the requested length.

Sizing: the haystack is tokenized once per `samples()` call (with character offsets), each cell
takes a token budget of it, and the budget is corrected (a few short re-tokenizations of the final
prompt) until the full prompt measures the requested length; the measured length goes to
``extra["actual_tokens"]``. Prompts are counted as the model sees them
(`snapkv.prompts.prompt_token_ids`): through the chat template (user turn, generation prompt)
without extra special tokens when the sample uses it, else the raw text with the tokenizer's own.

Insertion (gkamradt convention): at token ``int(n * depth / 100)`` of the n haystack tokens, moved back
to the previous sentence end (a '.' followed by whitespace, an upper-case letter or the end). Depth 0
puts the needle first, depth 100 last (after the trimmed haystack, as gkamradt does).

Several needles (``needles=K``, K > 1): K keyed needles in one haystack, one question (Sample) per
needle; see `eval.tasks.needle.multi`. ``needles=1`` is the task above, unchanged.

Credits: the needle convention, the San Francisco needle and its question come from gkamradt's
LLMTest_NeedleInAHaystack (MIT, https://github.com/gkamradt/LLMTest_NeedleInAHaystack); the magic
number needle, its prompt wording and the substring match from RULER's niah task (Apache-2.0,
https://github.com/NVIDIA/RULER).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from eval.tasks.base import Sample, Task
from eval.tasks.haystack import check_haystack_name, load_haystack, repeat_text
from eval.tasks.needle import multi
from eval.tasks.registry import register_task
from eval.tasks.seeds import generator_seeds, seed_suffix
from snapkv.prompts import chat_templated, prompt_token_ids

# --------------------------------------------------------------------------------------------------
# Needles


@dataclass(frozen=True)
class NeedleSpec:
    """A needle kind: its sentence, the prompt around it, the expected answer, applicable metrics."""

    name: str
    instruction: str  # before the haystack
    needle: str  # may use {number}
    question: str  # after the haystack (starts with its own separator)
    answer_prefix: str  # appended to the question only without a chat template
    answer: str  # may use {number}
    metrics: tuple[str, ...]  # first one is the default main metric

    @property
    def uses_number(self) -> bool:
        return "{number}" in self.needle


NEEDLES: dict[str, NeedleSpec] = {
    # RULER niah_single style; the number is 7 digits, drawn per cell (or fixed by `number`).
    "magic_number": NeedleSpec(
        name="magic_number",
        instruction=(
            "A special magic number is hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the number afterwards.\n\n"
        ),
        needle="The special magic number is: {number}.",
        question="\n\nWhat is the special magic number mentioned in the provided text?",
        answer_prefix=" The special magic number mentioned in the provided text is",
        answer="{number}",
        metrics=("exact", "partial"),
    ),
    # gkamradt's original needle, scored by word recall of the answer part.
    "sf": NeedleSpec(
        name="sf",
        instruction=(
            "Read the following text and answer the question about it. "
            "Keep your response short and direct.\n\n"
        ),
        needle="The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
        question=(
            "\n\nWhat is the best thing to do in San Francisco? "
            "Don't give information outside the document or repeat your findings."
        ),
        answer_prefix=" The best thing to do in San Francisco is",
        answer="eat a sandwich and sit in Dolores Park on a sunny day",
        metrics=("word_recall", "exact"),
    ),
}

# --------------------------------------------------------------------------------------------------
# Metrics


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def exact_match(prediction: str, answer: str) -> float:
    """1.0 if the answer occurs in the prediction. Digit answers: plain substring (RULER's
    string_match); text answers: as a word sequence, lowercased, punctuation ignored."""
    if answer.isdigit():
        return float(answer in prediction)
    ans = " ".join(_words(answer))
    return float(bool(ans) and f" {ans} " in f" {' '.join(_words(prediction))} ")


def partial_match(prediction: str, answer: str) -> float:
    """Longest correct prefix of the answer's digit string, over its length, best over the digit
    runs of the prediction (answer 4829173, prediction "... 4821 ..." -> 3/7)."""
    digits = "".join(re.findall(r"\d", answer))
    if not digits:
        return 0.0
    best = 0
    for run in re.findall(r"\d+", prediction):
        n = 0
        for a, b in zip(run, digits):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best / len(digits)


def word_recall(prediction: str, answer: str) -> float:
    """Fraction of the answer's distinct words found in the prediction (lowercased, no punctuation)."""
    ans = set(_words(answer))
    if not ans:
        return 0.0
    pred = set(_words(prediction))
    return len(ans & pred) / len(ans)


METRICS = {"exact": exact_match, "partial": partial_match, "word_recall": word_recall}

# --------------------------------------------------------------------------------------------------
# Haystack tokens and insertion


def _is_sentence_end(text: str, c: int) -> bool:
    """True if char position ``c`` follows a sentence end: a '.' (then maybe whitespace), itself
    followed by whitespace, an upper-case letter or the end of the text (so not '3.5', 'a.com')."""
    i = c - 1
    while i >= 0 and text[i].isspace():
        i -= 1
    if i < 0 or text[i] != ".":
        return False
    if i < c - 1:
        return True
    return c >= len(text) or text[c].isspace() or text[c].isupper()


@dataclass
class _HaystackTokens:
    text: str
    ends: list[int]  # ends[k]: char offset just after token k

    def __len__(self) -> int:
        return len(self.ends)

    def char_at(self, n_tokens: int) -> int:
        return self.ends[n_tokens - 1] if n_tokens > 0 else 0

    def insertion_token(self, n: int, depth: float) -> int:
        """Token index (0..n) where the needle goes in the first n tokens."""
        if depth >= 100:
            return n
        p = int(n * depth / 100)
        while p > 0 and not _is_sentence_end(self.text, self.ends[p - 1]):
            p -= 1
        return p


def _tokenize_haystack(tokenizer: Any, base: str, sep: str, need: int) -> _HaystackTokens:
    """Tokenize (once) enough of the repeated haystack for ``need`` tokens, keeping char offsets."""
    chars = need * 5 + 1024
    while True:
        text = repeat_text(base, sep, chars)
        try:
            enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        except NotImplementedError as e:  # slow (python) tokenizers have no offsets
            raise TypeError("the needle task needs a fast tokenizer (return_offsets_mapping)") from e
        ends = [int(e) for _, e in enc["offset_mapping"]]
        # keep a margin: the last tokens may be cut mid-word by the char limit
        if len(ends) >= need + 8:
            return _HaystackTokens(text, ends[:-4])
        chars = int(chars * max(2.0, 1.2 * (need + 8) / max(len(ends), 1)))


def _fit(
    tokenizer: Any,
    hay: _HaystackTokens,
    length: int,
    overhead: int,
    question: str,
    templated: bool,
    build: Callable[[int], tuple[str, Any]],
) -> tuple[str, int, int, Any]:
    """The haystack budget (tokens) whose prompt measures `length` tokens: up to 8 tries, each
    corrected by the measured error; the closest one wins (not longer on a tie). `build(budget)`:
    (context, insertion info); returns (context, actual tokens, budget, info)."""
    budget = length - overhead
    best = None  # (key, context, actual, budget, info)
    tried = set()
    for _ in range(8):
        budget = max(1, min(budget, len(hay)))
        if budget in tried:
            break
        tried.add(budget)
        context, info = build(budget)
        actual = len(prompt_token_ids(tokenizer, context + question, templated))
        key = (abs(actual - length), actual > length)
        if best is None or key < best[0]:
            best = (key, context, actual, budget, info)
        if actual == length:
            break
        budget += length - actual
    return best[1:]


def _join(before: str, needle: str, after: str) -> str:
    out = before
    if out and not out[-1].isspace():
        out += " "
    out += needle
    if after and not after[0].isspace():
        out += " "
    return out + after


def _fmt_depth(depth: float) -> str:
    return f"{float(depth):g}"


# --------------------------------------------------------------------------------------------------
# The task


@register_task
@dataclass
class NeedleTask(Task):
    """Needle-in-a-Haystack over a ``lengths`` x ``depths`` grid.

    haystack: ``paul_graham`` (downloaded once via pip), ``noise`` (offline) or ``dir:PATH``.
    needle: ``magic_number`` (7-digit number, metrics exact/partial) or ``sf`` (gkamradt's San
    Francisco sentence, metrics word_recall/exact). metric: main metric returned by `score`
    (default: the needle's first). number: fix the magic number (default: drawn per cell from
    (seed, length, depth)). seeds: generator seeds to run, one context per (cell, seed) (None: ``[seed]``;
    `eval.tasks.seeds`). needles: K > 1 hides K keyed magic numbers per cell and asks for each
    in its own sample (`eval.tasks.needle.multi`; needle=magic_number, number unset).

    Row columns (`extra`): context_length, depth_percent (the grid cell), needle, actual_tokens,
    actual_depth_percent, haystack, task_seed (the generator seed); with needles > 1 also needles,
    needle_key, needle_depth_percent, context_id, question_index (the asked needle's). Report: accuracy (and partial credit) per config x context
    length, mean over depths, and one heatmap per config.
    """

    name: ClassVar[str] = "needle"
    selection_keys: ClassVar[tuple[str, ...]] = ("lengths", "depths", "seeds")
    # Exact match is flat at small budgets on models that tokenize digits one by one (the needle's
    # number survives in part): partial credit shows what each budget buys.
    # One needle is the task as it was before `needles` existed: same hash, same results file.
    hash_defaults: ClassVar[dict[str, Any]] = {"needles": 1}

    haystack: str = "paul_graham"
    lengths: list[int] = field(default_factory=lambda: [1000, 2000, 4000])
    depths: list[float] = field(default_factory=lambda: [10.0, 50.0, 90.0])
    needle: str = "magic_number"
    metric: str | None = None
    max_new_tokens: int = 32
    chat_template: bool = True
    seed: int = 42
    number: int | None = None
    needles: int = 1
    seeds: list[int] | None = None

    def __post_init__(self) -> None:
        if self.needle not in NEEDLES:
            raise ValueError(f"unknown needle {self.needle!r}; known: {', '.join(NEEDLES)}")
        spec = NEEDLES[self.needle]
        if self.metric is None:
            self.metric = spec.metrics[0]
        if self.metric not in spec.metrics:
            raise ValueError(
                f"metric {self.metric!r} does not apply to needle {self.needle!r}; "
                f"choose one of {', '.join(spec.metrics)}"
            )
        if isinstance(self.needles, bool) or not isinstance(self.needles, int) or self.needles < 1:
            raise ValueError(f"needles must be a positive integer, got needles={self.needles!r}")
        if self.needles > 1 and self.needle != "magic_number":
            raise ValueError(
                f"needles={self.needles} needs needle=magic_number (keyed numbers), got needle={self.needle!r}"
            )
        if self.needles > 1 and self.number is not None:
            raise ValueError(
                f"number={self.number!r} fixes one needle's number; needles={self.needles} draws "
                "distinct numbers (leave number unset)"
            )
        check_haystack_name(self.haystack)
        self.generator_seeds = generator_seeds("needle", self.seed, self.seeds)
        self.lengths = _dedup([_check_length(x) for x in self.lengths])
        self.depths = _dedup([_check_depth(x) for x in self.depths])
        if not self.lengths:
            raise ValueError("lengths is empty")
        if not self.depths:
            raise ValueError("depths is empty")
        if self.number is not None and (int(self.number) != self.number or self.number < 0):
            raise ValueError(f"number must be a non-negative integer, got {self.number!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens!r}")

    @property
    def spec(self) -> NeedleSpec:
        return NEEDLES[self.needle]

    @property
    def version(self) -> str | None:
        """None for one needle (as before `needles` existed); several: the multi-needle layout and
        the word lists its keys come from."""
        return None if self.needles == 1 else multi.words_version()

    def multi_question(self) -> bool:
        return self.needles > 1

    def cell_number(self, length: int, depth: float, seed: int | None = None) -> str:
        """The magic number of a cell: fixed by ``number`` or drawn from (seed, length, depth);
        ``seed`` defaults to the task's ``seed``."""
        if self.number is not None:
            return str(int(self.number))
        seed = self.seed if seed is None else seed
        rng = random.Random(f"needle:{seed}:{length}:{_fmt_depth(depth)}")
        return str(rng.randint(1_000_000, 9_999_999))

    def sample_id(self, length: int, depth: float, seed: int | None = None) -> str:
        """``len<L>_depth<D>``, with ``-seed<N>`` for a generator seed other than ``seed``."""
        suffix = seed_suffix(self.seed if seed is None else seed, self.seed)
        return f"len{length}_depth{_fmt_depth(depth)}{suffix}"

    def _cells(self) -> list[tuple[int, float, int]]:
        """(length, depth, generator seed) of every context, in run order."""
        return [(x, d, s) for x in self.lengths for d in self.depths for s in self.generator_seeds]

    # ---- prompt pieces

    def _pieces(self, length: int, depth: float, templated: bool, seed: int) -> tuple[str, str, str]:
        spec = self.spec
        number = self.cell_number(length, depth, seed) if spec.uses_number else ""
        needle = spec.needle.format(number=number)
        answer = spec.answer.format(number=number)
        question = spec.question + ("" if templated else spec.answer_prefix)
        return needle, answer, question

    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        """Validate every length against the prompt overhead (ValueError naming a length too small
        to hold the prompt), tokenize the haystack once, and return an iterator over the samples."""
        templated = chat_templated(tokenizer, self.chat_template)
        if self.needles > 1:
            return self._samples_multi(tokenizer, templated)
        overheads = {}
        for length, depth, seed in self._cells():
            needle, _, question = self._pieces(length, depth, templated, seed)
            prompt = self.spec.instruction + needle + question
            overhead = len(prompt_token_ids(tokenizer, prompt, templated))
            if overhead >= length:
                raise ValueError(
                    f"context length {length} is too small: the prompt without haystack already "
                    f"takes {overhead} tokens"
                )
            overheads[length, depth, seed] = overhead
        base, sep = load_haystack(self.haystack)
        hay = _tokenize_haystack(tokenizer, base, sep, max(self.lengths) + 64)
        return self._generate(tokenizer, hay, overheads, templated)

    def _generate(
        self, tokenizer: Any, hay: _HaystackTokens, overheads: dict, templated: bool
    ) -> Iterator[Sample]:
        spec = self.spec
        for length, depth, seed in self._cells():
            needle, answer, question = self._pieces(length, depth, templated, seed)

            def build(budget: int, needle=needle, depth=depth) -> tuple[str, int]:
                p = hay.insertion_token(budget, depth)
                before = hay.text[: hay.char_at(p)]
                after = hay.text[hay.char_at(p) : hay.char_at(budget)]
                return spec.instruction + _join(before, needle, after), p

            context, actual, budget, p = _fit(
                tokenizer, hay, length, overheads[length, depth, seed], question, templated, build
            )
            yield Sample(
                sample_id=self.sample_id(length, depth, seed),
                dataset=self.name,
                context=context,
                question=question,
                answers=[answer],
                max_new_tokens=self.max_new_tokens,
                chat_template=templated,
                extra={
                    "context_length": length,
                    "depth_percent": depth,
                    "needle": needle,
                    "actual_tokens": actual,
                    "actual_depth_percent": round(100.0 * p / budget, 2),
                    "haystack": self.haystack,
                    "task_seed": seed,
                },
            )

    def _samples_multi(self, tokenizer: Any, templated: bool) -> Iterator[Sample]:
        """`samples` for K > 1 needles: the K needles of every cell, each length checked against the
        prompt without haystack, then the haystack tokenized once."""
        cells = {}
        for length, depth, seed in self._cells():
            needles = multi.draw_needles(seed, length, _fmt_depth(depth), self.needles)
            prompt = (
                multi.INSTRUCTION + " ".join(n.sentence for n in needles) + needles[0].question(templated)
            )
            overhead = len(prompt_token_ids(tokenizer, prompt, templated))
            if overhead >= length:
                raise ValueError(
                    f"context length {length} is too small: the prompt without haystack already "
                    f"takes {overhead} tokens with needles={self.needles}"
                )
            cells[length, depth, seed] = needles, overhead
        base, sep = load_haystack(self.haystack)
        hay = _tokenize_haystack(tokenizer, base, sep, max(self.lengths) + 64)
        return self._generate_multi(tokenizer, hay, cells, templated)

    def _generate_multi(
        self, tokenizer: Any, hay: _HaystackTokens, cells: dict, templated: bool
    ) -> Iterator[Sample]:
        # Sized like the single needle (`_fit`), measured with question 0.
        for (length, depth, seed), (needles, overhead) in cells.items():

            def build(budget: int, needles=needles) -> tuple[str, list[int]]:
                text, points = multi.insert_needles(hay, budget, needles)
                return multi.INSTRUCTION + text, points

            first = needles[0].question(templated)
            context, _, budget, points = _fit(tokenizer, hay, length, overhead, first, templated, build)
            context_id = self.sample_id(length, depth, seed)
            for k, needle in enumerate(needles):
                question = needle.question(templated)
                yield Sample(
                    sample_id=f"{context_id}/q{k}",
                    dataset=self.name,
                    context=context,
                    question=question,
                    answers=[needle.number],
                    max_new_tokens=self.max_new_tokens,
                    chat_template=templated,
                    context_id=context_id,
                    question_index=k,
                    extra={
                        "context_length": length,
                        "depth_percent": depth,
                        "needle": needle.sentence,
                        "actual_tokens": len(prompt_token_ids(tokenizer, context + question, templated)),
                        "actual_depth_percent": round(100.0 * points[k] / budget, 2),
                        "haystack": self.haystack,
                        "needles": self.needles,
                        "needle_key": needle.key,
                        "needle_depth_percent": needle.depth,
                        "context_id": context_id,
                        "question_index": k,
                        "task_seed": seed,
                    },
                )

    # ---- scoring

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        """Every metric that applies to this needle (best over the sample's answers)."""
        return {
            m: max((METRICS[m](prediction, a) for a in sample.answers), default=0.0)
            for m in self.spec.metrics
        }

    def score(self, sample: Sample, prediction: str) -> float:
        """The main metric (``metric``)."""
        return max((METRICS[self.metric](prediction, a) for a in sample.answers), default=0.0)


def _check_length(x: Any) -> int:
    try:
        ok = not isinstance(x, bool) and int(x) == x and int(x) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"context length must be a positive integer, got {x!r}")
    return int(x)


def _check_depth(x: Any) -> float:
    try:
        d = float(x)
    except (TypeError, ValueError):
        d = float("nan")
    if isinstance(x, bool) or not 0.0 <= d <= 100.0:
        raise ValueError(f"depth percent must be within 0..100, got {x!r}")
    return d


def _dedup(xs: list) -> list:
    return list(dict.fromkeys(xs))
