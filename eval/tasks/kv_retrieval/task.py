"""Key-value retrieval: a JSON object of random UUID pairs, several keys asked one by one.

The task of InfiniteBench (Zhang et al. 2024, https://arxiv.org/abs/2402.13718, `kv_retrieval`;
OpenBMB/InfiniteBench, MIT) as SCBench asks it (Li et al. 2024, https://arxiv.org/abs/2412.10319,
`scbench_kv`; microsoft/MInference, MIT): several questions about one shared context, the setting
where a compressed KV cache is reused across requests. The instruction, the question wording and
the string-match metric are theirs, restated; the data is generated here, offline, in the model's
own tokenizer, so any length can run.

Generation. For each requested length L and context index i < ``samples``, the content is drawn
from ``random.Random(f"kv_retrieval:{seed}:{L}:{i}")``: first the K = ``questions`` queried
(key, value) pairs, their places and the order they are asked in, then a stream of filler pairs.
Keys and values are UUIDs built from the generator's bits (``uuid.UUID(int=getrandbits(128),
version=4)``, not `uuid.uuid4`'s OS randomness), all distinct, so every value occurs once in the
prompt. The object holds n filler pairs with the K queried ones at spread places: the n + K entries
are cut into K equal bands, band k holds queried pair k at a drawn offset within it; the questions
ask the bands in a drawn order (`question_index` is the order of asking, not the place in the
object).

Sizing (RULER's, `eval.tasks.ruler.task.fit`): n is the largest count of filler pairs whose
prompt, for every one of the K questions, fits the requested length L, measured as the generator
encodes it (`snapkv.prompts.encode_prompt`: chat template, BOS); the filler stream only grows
with n, so a longer prompt extends a shorter one. Every sample records its own prompt length
(`actual_tokens`, <= L, within about one pair of it) and the object's size (`num_pairs`).

Prompt: ``context`` is the instruction and the JSON object (shared by the K samples of a context,
`context_id`); ``question`` is ``'\\n\\nKey: "<key>"\\nThe value associated with the specified key
is:'`` (InfiniteBench's input, without its trailing space).

Metrics: ``string_match`` (the main one: the value occurs in the prediction, case-insensitive, as
RULER's and SCBench's substring match) and ``partial`` (the longest prefix of the value found at
the start of a word of the prediction, over the value's length: what a cache that kept part of the
value still yields; a prediction holding other UUIDs matches a character or two by chance, about
0.03).
"""

from __future__ import annotations

import json
import random
import re
import uuid
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

from eval.tasks.base import Sample, Task
from eval.tasks.registry import register_task
from eval.tasks.ruler.task import fit
from eval.tasks.seeds import generator_seeds, seed_suffix
from snapkv.prompts import encode_prompt

INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
QUESTION = '\n\nKey: "{key}"\nThe value associated with the specified key is:'
VERSION = "1"


# ---------------------------------------------------------------------------------------- metrics
def string_match(prediction: str, value: str) -> float:
    """1.0 if the value occurs in the prediction (case-insensitive substring)."""
    return float(bool(value) and value.lower() in prediction.lower())


def partial_match(prediction: str, value: str) -> float:
    """Longest prefix of the value that starts a word of the prediction (words: runs of hex digits
    and dashes, case-insensitive), over the value's length."""
    value = value.lower()
    best = 0
    for word in re.findall(r"[0-9a-f-]+", prediction.lower()):
        n = 0
        for a, b in zip(word, value):
            if a != b:
                break
            n += 1
        best = max(best, n)
    return best / len(value) if value else 0.0


METRICS: dict[str, Callable[[str, str], float]] = {"string_match": string_match, "partial": partial_match}


# ------------------------------------------------------------------------------------- generation
class Content:
    """The pairs of one context (module docstring): the K queried pairs with their band offsets and
    asking order, and the filler stream, grown on demand."""

    def __init__(self, rng: random.Random, questions: int) -> None:
        self.rng, self.seen = rng, set()
        self.queried = [(self._uuid(), self._uuid()) for _ in range(questions)]
        self.offsets = [rng.random() for _ in range(questions)]
        self.order = list(range(questions))  # order[q]: the band question q asks
        rng.shuffle(self.order)
        self.filler: list[tuple[str, str]] = []

    def _uuid(self) -> str:
        while True:
            u = str(uuid.UUID(int=self.rng.getrandbits(128), version=4))
            if u not in self.seen:
                self.seen.add(u)
                return u

    def places(self, n: int) -> list[int]:
        """Index of queried pair k among the n + K entries: band k = [kN/K, (k+1)N/K) (non-empty
        as N >= K), at its offset within the band."""
        k, total = len(self.queried), n + len(self.queried)
        starts = [i * total // k for i in range(k + 1)]
        return [starts[i] + int(self.offsets[i] * (starts[i + 1] - starts[i])) for i in range(k)]

    def entries(self, n: int) -> list[tuple[str, str]]:
        """The object's n + K (key, value) pairs in order."""
        while len(self.filler) < n:
            self.filler.append((self._uuid(), self._uuid()))
        places = dict(zip(self.places(n), self.queried))
        filler = iter(self.filler[:n])
        return [places[i] if i in places else next(filler) for i in range(n + len(self.queried))]


def render_context(entries: list[tuple[str, str]]) -> str:
    """Instruction + the JSON object, on one line (InfiniteBench's layout)."""
    return INSTRUCTION + json.dumps(dict(entries), ensure_ascii=False)


def prompt_tokens(tokenizer: Any, context: str, question: str, templated: bool) -> int:
    """Prompt length exactly as the generator encodes it (context and question parts)."""
    head, tail = encode_prompt(tokenizer, context, question, chat_template=templated)
    return len(head) + len(tail)


# ------------------------------------------------------------------------------------------- task
def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"kv_retrieval {key} must be a positive integer, got {key}={value!r}")
    return value


@register_task
class KVRetrievalTask(Task):
    """Key-value retrieval over ``lengths`` x ``samples`` contexts, ``questions`` keys asked per
    context, one sample per question (see the module docstring).

    lengths: prompt lengths in tokens (context + one question, chat template included); samples:
    contexts per length (kept as ``n_samples``: ``samples()`` is the task protocol's method);
    questions: keys asked per context (K); seed: the generation seed; seeds: generator seeds to run,
    one context per (length, index, seed) (None: ``[seed]``; `eval.tasks.seeds`); max_new_tokens: generation
    length (a UUID is 25-35 tokens, and chat models restate the question's "The value associated
    with the specified key is" before it); chat_template: render with the tokenizer's chat template (when
    it has one).

    Row columns (`extra`): context_length (requested), actual_tokens (this question's prompt),
    num_pairs, key_depth_percent (place of the asked pair in the object), kv_index (context index),
    questions, context_id, question_index, task_seed (the generator seed). Report: score per method
    config x length x question.
    """

    name: ClassVar[str] = "kv_retrieval"
    version: ClassVar[str] = VERSION
    # Which lengths, how many contexts and which generator seeds run: every context is drawn from
    # (seed, length, index).
    selection_keys: ClassVar[tuple[str, ...]] = ("lengths", "samples", "seeds")

    def __init__(
        self,
        lengths: list[int] | int = 4096,
        samples: int = 5,
        questions: int = 4,
        seed: int = 42,
        max_new_tokens: int = 64,
        chat_template: bool = True,
        seeds: list[int] | None = None,
    ) -> None:
        if isinstance(lengths, int) and not isinstance(lengths, bool):
            lengths = [lengths]
        if not isinstance(lengths, (list, tuple)) or not lengths:
            raise ValueError(
                f"kv_retrieval lengths must be a non-empty list of integers, got lengths={lengths!r}"
            )
        self.lengths = list(dict.fromkeys(_positive_int("lengths", x) for x in lengths))
        self.n_samples = _positive_int("samples", samples)
        self.questions = _positive_int("questions", questions)
        self.max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
        self.generator_seeds = generator_seeds("kv_retrieval", seed, seeds)
        if not isinstance(chat_template, bool):
            raise ValueError(
                f"kv_retrieval chat_template must be true or false, got chat_template={chat_template!r}"
            )
        self.seed, self.chat_template = seed, chat_template

    def multi_question(self) -> bool:
        return self.questions > 1

    def num_samples(self) -> int:
        return len(self.lengths) * self.n_samples * len(self.generator_seeds) * self.questions

    def context_id(self, length: int, index: int, seed: int | None = None) -> str:
        """``kv-<L>-<i>``, with ``-seed<N>`` for a generator seed other than ``seed``."""
        return f"kv-{length}-{index}{seed_suffix(self.seed if seed is None else seed, self.seed)}"

    def content(self, length: int, index: int, seed: int | None = None) -> Content:
        seed = self.seed if seed is None else seed
        return Content(random.Random(f"kv_retrieval:{seed}:{length}:{index}"), self.questions)

    # ---- samples
    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        templated = bool(self.chat_template and getattr(tokenizer, "chat_template", None))
        return self._generate(tokenizer, templated)

    def _questions(self, content: Content) -> list[str]:
        return [QUESTION.format(key=content.queried[band][0]) for band in content.order]

    def _fit(
        self,
        tokenizer: Any,
        templated: bool,
        length: int,
        content: Content,
        questions: list[str],
        hint: int | None,
    ) -> tuple[int, str, list[int]]:
        """(filler pairs n, context, each question's prompt length) of the largest n whose prompts
        all fit ``length``. The generator encodes the context and the question apart, so the
        question with the longest encoding is the longest prompt at every n: the search measures
        that one, and all K are measured once at the end (the search repeats over all K should an
        encoder ever tokenize them together)."""

        def lengths(context: str, asked: list[str]) -> list[int]:
            return [prompt_tokens(tokenizer, context, q, templated) for q in asked]

        shortest = render_context(content.entries(0))
        probe = lengths(shortest, questions)

        def search(asked: list[str]) -> tuple[int, str]:
            def measure(n: int) -> tuple[str, int]:
                context = render_context(content.entries(n))
                return context, max(lengths(context, asked))

            found = fit(measure, length, 0, None, hint)
            if found is None:
                raise ValueError(
                    f"kv_retrieval length {length} is too small: the prompt with only the "
                    f"{self.questions} queried pairs takes {max(probe)} tokens"
                )
            return found[0], found[1]

        n, context = search([questions[probe.index(max(probe))]])
        actual = lengths(context, questions)
        if max(actual) > length:  # an encoder that tokenizes context and question together
            n, context = search(questions)
            actual = lengths(context, questions)
        return n, context, actual

    def _generate(self, tokenizer: Any, templated: bool) -> Iterator[Sample]:
        for length in self.lengths:
            hint = None
            for index, seed in ((i, s) for i in range(self.n_samples) for s in self.generator_seeds):
                content = self.content(length, index, seed)
                questions = self._questions(content)
                n, context, actual = self._fit(tokenizer, templated, length, content, questions, hint)
                hint = n
                places = content.places(n)
                total = n + self.questions
                context_id = self.context_id(length, index, seed)
                for q, (band, question) in enumerate(zip(content.order, questions)):
                    yield Sample(
                        sample_id=f"{context_id}/q{q}",
                        dataset=self.name,
                        context=context,
                        question=question,
                        answers=[content.queried[band][1]],
                        max_new_tokens=self.max_new_tokens,
                        chat_template=templated,
                        context_id=context_id,
                        question_index=q,
                        extra={
                            "context_length": length,
                            "actual_tokens": actual[q],
                            "num_pairs": total,
                            "key_depth_percent": round(100.0 * places[band] / max(total - 1, 1), 2),
                            "kv_index": index,
                            "questions": self.questions,
                            "context_id": context_id,
                            "question_index": q,
                            "task_seed": seed,
                        },
                    )

    # ---- scoring
    def score(self, sample: Sample, prediction: str) -> float:
        return max((string_match(prediction, a) for a in sample.answers), default=0.0)

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        return {m: max((f(prediction, a) for a in sample.answers), default=0.0) for m, f in METRICS.items()}
