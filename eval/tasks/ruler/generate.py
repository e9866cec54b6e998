"""RULER's generators, one function per family: niah, variable tracking, common / frequent words, QA.

Ported (definitions, not code) from RULER's `scripts/data/synthetic/{niah, variable_tracking,
common_words_extraction, freq_words_extraction, qa}.py` (NVIDIA/RULER, Apache-2.0, Copyright (c)
2024 NVIDIA CORPORATION; https://arxiv.org/abs/2404.06654) as they stand at `RULER_COMMIT`
(`eval.tasks.ruler.config`): variable-tracking statements on lines of their own, the in-context
example's value redrawn per sample, fwe's vocabulary sized from the prompt's target, a space before
cwe's example answers, the essay haystack repeated past its end.

Each generator maps ``(rng, n)`` to a `Prompt`, ``n`` being the haystack size in RULER's own unit
(essay words, noise / distractor sentences, list words, coded words, documents); `eval.tasks.ruler`
finds the largest ``n`` whose prompt fits the requested token length. ``rng`` (`random.Random`) is
RULER's global ``random`` state; where RULER draws from ``random.Random(random_seed)`` (a fixed
permutation for the whole run: needle order, word-list and document shuffles) the task seed is used
the same way. Word lists come from `wonderwords` as in RULER.

Where this port differs from RULER's scripts (all deliberate, none changes a task's definition):

- ``adj-noun`` keys are drawn as a random adjective and a random noun instead of picking from the
  6.2M-entry sorted list of all pairs (same distribution, no 6M-string list in memory).
- niah_multikey_2/3 distractor needles are redrawn when their key equals a real key or their value a
  real value (RULER leaves that to chance), so every answer is in the prompt exactly once.
- Sentences of the essay haystack are split with NLTK's Punkt algorithm without its pre-trained
  English abbreviation list (`PunktSentenceTokenizer()`): RULER's `sent_tokenize` needs the
  `punkt` data, which is not on PyPI. It only moves the candidate needle positions.
- cwe never runs past its vocabulary (nouns + adjectives + verbs of `wonderwords`), where RULER's
  script draws from a further English word list; qa_1/qa_2 never repeat documents past the source's
  last one, as RULER's script does. Both only bind at lengths far beyond the word lists / sources.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import torch
from wonderwords import random_word

from eval.tasks.ruler.config import DOCUMENT_PROMPT, FAMILIES, NIAH_NEEDLE, NOISE

# niah.py: needle depths, 40 points from 0 to 100 % (numpy's round-half-to-even, as RULER).
DEPTHS: list[int] = [int(d) for d in np.round(np.linspace(0, 100, num=40, endpoint=True))]


@dataclass
class Prompt:
    """One RULER prompt before any chat template.

    ``head`` + ``tail`` is the final user turn (``head`` ends with the haystack, ``tail`` is the
    question), ``answer_prefix`` follows the model's turn marker; ``shots`` are earlier (user,
    assistant) example turns (cwe's one-shot example). Without a chat template RULER's text is
    ``user + assistant + "\\n"`` per shot, then ``head + tail + answer_prefix``.
    """

    head: str
    tail: str
    answer_prefix: str
    outputs: list[str]
    shots: list[tuple[str, str]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


def _fill(template: str, **kw: Any) -> str:
    for k, v in kw.items():
        template = template.replace("{" + k + "}", str(v))
    return template


def _split(template: str, answer_prefix: str, **kw: Any) -> tuple[str, str, str]:
    """(head, tail, answer_prefix) of a filled template; head ends with the context."""
    before, after = template.split("{context}", 1)
    ctx = kw.pop("context")
    return _fill(before, **kw) + ctx, _fill(after, **kw), _fill(answer_prefix, **kw)


# ----------------------------------------------------------------------------------------- words
@cache
def wonder_words(kind: str) -> tuple[str, ...]:
    """A `wonderwords` list as RULER reads it: ``noun``, ``adjective`` or ``verb``."""
    return tuple(random_word._get_words_from_text_file(f"{kind}list.txt"))


@cache
def cwe_words(seed: int) -> tuple[str, ...]:
    """common_words_extraction.py's vocabulary: nouns + adjectives + verbs, deduplicated, sorted,
    shuffled once by the seed."""
    words = sorted(set(wonder_words("noun") + wonder_words("adjective") + wonder_words("verb")))
    random.Random(seed).shuffle(words)
    return tuple(words)


# ------------------------------------------------------------------------------------------ niah
def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":  # 7 digits
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":  # adj-noun
        return f"{rng.choice(wonder_words('adjective'))}-{rng.choice(wonder_words('noun'))}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; known: numbers, words, uuids")


def essay_words(text: str) -> list[str]:
    """niah.py's essay haystack: whitespace runs to one space, split on spaces."""
    return re.sub(r"\s+", " ", text).split(" ")


@cache
def _punkt():
    # Lazy: nltk takes seconds to import and only the essay haystack needs it.
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    return PunktSentenceTokenizer()


def niah(
    args: dict,
    rng: random.Random,
    n: int,
    *,
    seed: int,
    haystack: str,
    words: list[str] | None = None,
) -> Prompt:
    """niah.py: ``num_needle_k`` keys with ``num_needle_v`` values each become needle sentences
    ("One of the special magic numbers for KEY is: VALUE."); ``num_needle_q`` keys are asked.

    haystack ``repeat``: n copies of the noise paragraph joined by newlines, needles inserted at
    random paragraph indices; ``needle``: n distractor needles with random keys/values instead;
    ``essay``: the first n words of ``words``, needles inserted between sentences at depths drawn
    from `DEPTHS`. Answers: the values of the asked keys, in query order.
    """
    type_k, type_v = args["type_needle_k"], args["type_needle_v"]
    num_v, num_q = args["num_needle_v"], args["num_needle_q"]
    num_k = max(args["num_needle_k"], num_q)
    keys, values, needles = [], [], []
    for _ in range(num_k):
        keys.append(_random_value(rng, type_k))
        value = []
        for _ in range(num_v):
            value.append(_random_value(rng, type_v))
            needles.append(_fill(NIAH_NEEDLE, type_needle_v=type_v, key=keys[-1], value=value[-1]))
        values.append(value)
    random.Random(seed).shuffle(needles)

    if haystack == "essay":
        if not words:
            raise ValueError("the essay haystack is empty")
        reps = -(-n // len(words))
        text = " ".join((words * reps)[:n]) if reps > 1 else " ".join(words[:n])
        sents = _punkt().tokenize(text.strip())
        cuts = sorted(int(len(sents) * (d / 100)) for d in rng.sample(DEPTHS, len(needles)))
        cuts = [0] + cuts + [len(sents)]
        parts = []
        for i in range(1, len(cuts)):
            parts.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(parts)
    elif haystack in ("repeat", "needle"):
        if haystack == "repeat":
            sentences = [NOISE] * n
        else:
            real_values = {v for vs in values for v in vs}
            sentences = []
            while len(sentences) < n:
                k, v = _random_value(rng, type_k), _random_value(rng, type_v)
                if k not in keys and v not in real_values:  # collision guard (see module doc)
                    sentences.append(_fill(NIAH_NEEDLE, type_needle_v=type_v, key=k, value=v))
        for index, needle in zip(sorted(rng.sample(range(n), len(needles)), reverse=True), needles):
            sentences.insert(index, needle)
        context = "\n".join(sentences)
    else:
        raise ValueError(f"unknown niah haystack {haystack!r}; known: repeat, essay, needle")

    asked = rng.sample(range(num_k), num_q)
    queries = [keys[i] for i in asked]
    answers = [a for i in asked for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]

    fam = FAMILIES["niah"]
    template, prefix, type_v_text = fam.template, fam.answer_prefix, type_v
    if num_q * num_v == 1:  # RULER's singular wording
        template, prefix = (_singular(t) for t in (template, prefix))
        type_v_text = type_v[:-1]
    head, tail, ap = _split(template, prefix, type_needle_v=type_v_text, context=context, query=query)
    return Prompt(head, tail, ap, answers, info={"keys": queries, "needles": needles})


def separate_queries(prompt: Prompt, type_needle_v: str) -> list[Prompt]:
    """A niah prompt that asks several keys at once (niah_multiquery) as one prompt per key, in
    query order: the same head (instruction + haystack), the single-key question and answer prefix
    (RULER's singular wording), that key's value as the answer. Keys with several values
    (niah_multivalue) do not split: ValueError."""
    keys = prompt.info["keys"]
    if len(keys) != len(prompt.outputs):
        raise ValueError(
            f"cannot ask the keys one by one: {len(keys)} keys with {len(prompt.outputs)} values "
            "(only one value per key splits into one question per key)"
        )
    fam = FAMILIES["niah"]
    # _singular on the unfilled templates, so that a key's letters are never rewritten
    tail, prefix = _singular(fam.template.split("{context}", 1)[1]), _singular(fam.answer_prefix)
    type_v = type_needle_v[:-1]
    return [
        Prompt(
            prompt.head,
            _fill(tail, type_needle_v=type_v, query=key),
            _fill(prefix, type_needle_v=type_v, query=key),
            [value],
            info={**prompt.info, "keys": [key]},
        )
        for key, value in zip(keys, prompt.outputs)
    ]


def _singular(text: str) -> str:
    for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
        text = text.replace(a, b)
    return text


# ------------------------------------------------------------------------------ variable tracking
ICL_VALUE = "12345"  # variable_tracking.py: the example's value, redrawn per sample (randomize_icl)


def _chains(rng: random.Random, num_chains: int, num_hops: int, is_icl: bool) -> tuple[list, list]:
    k = 3 if is_icl else 5
    num_hops = min(10, num_hops) if is_icl else num_hops
    names = ["".join(rng.choices(string.ascii_uppercase, k=k)) for _ in range((num_hops + 1) * num_chains)]
    while len(set(names)) < num_chains * (num_hops + 1):
        names.append("".join(rng.choices(string.ascii_uppercase, k=k)))
    chain_vars, chains = [], []
    for i in range(0, len(names), num_hops + 1):
        v = names[i : i + num_hops + 1]
        chain_vars.append(v)
        # numpy randint(10000, 99999): high excluded
        chain = [f"VAR {v[0]} = {ICL_VALUE if is_icl else rng.randint(10000, 99998)}"]
        chain += [f"VAR {v[j + 1]} = VAR {v[j]} " for j in range(num_hops)]
        chains.append(chain)
    return chain_vars, chains


def vt_text(
    rng: random.Random, n: int, num_chains: int, num_hops: int, is_icl: bool
) -> tuple[str, str, str, list[str]]:
    """variable_tracking.py's generate_input_output (noise haystack): (head, tail, answer_prefix,
    answer variables).

    n noise paragraphs; the chains' assignments are inserted at random positions, in order; every
    paragraph and every assignment is a line of its own. The in-context example (``is_icl``) has
    3-letter names, at most 10 hops and the value `ICL_VALUE`.
    """
    chain_vars, chains = _chains(rng, num_chains, num_hops, is_icl)
    sentences = [NOISE] * n
    if len(sentences) <= len(chains[0]):  # too short: split the noise into its sentences
        sentences = [s + "." if s.strip() else s for s in (x for t in sentences for x in t.split("."))]
        if len(sentences) <= len(chains[0]):
            chains = [c[: len(sentences) - 1] for c in chains]
    for chain in chains:
        positions = sorted(rng.sample(range(len(sentences)), len(chain)))
        for j, pos in enumerate(positions):
            sentences.insert(pos + j, chain[j])
    context = "\n".join(sentences).replace(". \n", ".\n")
    fam = FAMILIES["variable_tracking"]
    value = chains[0][0].split("=")[-1].strip()
    num_v = num_hops + 1  # RULER: the requested hops, even where the example caps them at 10
    head, tail, ap = _split(fam.template, fam.answer_prefix, context=context, query=value, num_v=num_v)
    return head, tail, ap, chain_vars[0]


def variable_tracking(args: dict, rng: random.Random, n: int, *, icl: tuple[str, list[str]]) -> Prompt:
    """A VT prompt: the in-context example (`icl`: its text, ending with a newline, and its answer
    variables, generated once per seed) with its variable names and its value redrawn for this
    sample (RULER's randomize_icl), a newline, then the task."""
    head, tail, ap, answers = vt_text(rng, n, args["num_chains"], args["num_hops"], is_icl=False)
    example, example_vars = icl
    for name in example_vars:
        example = example.replace(name, "".join(rng.choices(string.ascii_uppercase, k=len(name))))
    example = example.replace(ICL_VALUE, str(rng.randint(10000, 99998)))
    return Prompt(example + "\n" + head, tail, ap, answers)


# --------------------------------------------------------------------------- common words (cwe)
def _cwe_example(
    rng: random.Random, words: tuple[str, ...], seed: int, num_words: int, rep_c: int, rep_u: int, num_c: int
):
    chosen = rng.sample(words, num_words)
    common, uncommon = chosen[:num_c], chosen[num_c:]
    word_list = common * rep_c + uncommon * rep_u
    random.Random(seed).shuffle(word_list)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(word_list)), common


def common_words(args: dict, rng: random.Random, n: int, *, seed: int, length: int) -> Prompt:
    """common_words_extraction.py: a numbered list of n distinct words, the first ``num_cw`` repeated
    ``freq_cw`` times, the others ``freq_ucw`` times, shuffled; a one-shot example (40 words,
    10 / 3 repeats) first. Below 4096 tokens RULER uses 6 / 1 repeats (example: 20 words, 3 / 1)."""
    words, num_c = cwe_words(seed), args["num_cw"]
    if length < 4096:
        ex_ctx, ex_ans = _cwe_example(rng, words, seed, 20, 3, 1, num_c)
        ctx, ans = _cwe_example(rng, words, seed, n, 6, 1, num_c)
    else:
        ex_ctx, ex_ans = _cwe_example(rng, words, seed, 40, 10, 3, num_c)
        ctx, ans = _cwe_example(rng, words, seed, n, args["freq_cw"], args["freq_ucw"], num_c)
    fam = FAMILIES["common_words_extraction"]
    ex_head, ex_tail, ex_ap = _split(fam.template, fam.answer_prefix, context=ex_ctx, query="")
    # RULER appends the example's answers after the prefix and a space: "...are: 1. word 2. ..."
    shot = (ex_head + ex_tail, ex_ap + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_ans)))
    head, tail, ap = _split(fam.template, fam.answer_prefix, context=ctx, query="")
    return Prompt(head, tail, ap, list(ans), shots=[shot])


# ------------------------------------------------------------------------- frequent words (fwe)
def _zeta(alpha: float) -> float:
    a = torch.tensor(alpha, dtype=torch.float64)
    return float(torch.special.zeta(a, torch.ones_like(a)))


def freq_words(args: dict, rng: random.Random, n: int, *, seed: int, length: int) -> Prompt:
    """freq_words_extraction.py: a vocabulary of ``length // 50`` random 6-letter coded words (the
    top-ranked one replaced by "..."), word of rank k repeated ``int(n * k**-alpha / zeta(alpha))``
    times, shuffled; the answers are ranks 2-4. ``length``: the prompt's target in tokens (RULER at
    `RULER_COMMIT`: the requested length minus tokens_to_generate; the paper-era script: the
    requested length)."""
    alpha, wordlen = float(args["alpha"]), int(args.get("coded_wordlen", 6))
    vocab_size = int(args.get("vocab_size", -1))
    vocab_size = length // 50 if vocab_size == -1 else vocab_size
    vocab = ["".join(rng.choices(string.ascii_lowercase, k=wordlen)) for _ in range(vocab_size)]
    while len(set(vocab)) < vocab_size:
        vocab.append("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    vocab = sorted(set(vocab))
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."  # the top-ranked word is noise
    k = np.arange(1, len(vocab) + 1)
    counts = (n * (k**-alpha) / _zeta(alpha)).astype(int)
    sampled = [w for w, c in zip(vocab, counts) for _ in range(int(c))]
    random.Random(seed).shuffle(sampled)
    fam = FAMILIES["freq_words_extraction"]
    head, tail, ap = _split(fam.template, fam.answer_prefix, context=" ".join(sampled), query="")
    return Prompt(head, tail, ap, vocab[1:4], info={"counts": dict(zip(vocab[:4], map(int, counts[:4])))})


# -------------------------------------------------------------------------------------------- qa
@dataclass
class QASource:
    """qa.py's read_squad / read_hotpotqa: questions with their gold document ids, and all documents."""

    qas: list[dict]
    docs: list[str]


def read_squad(data: dict) -> QASource:
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    ids = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [ids[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa.get("is_impossible", False):
                    own = ids[p["context"]]
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [a["text"] for a in qa["answers"]],
                            "context": [own],
                            "more_context": [i for i in more if i != own],
                        }
                    )
    return QASource(qas, docs)


def read_hotpotqa(data: list) -> QASource:
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    ids = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [ids[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
        }
        for d in data
    ]
    return QASource(qas, docs)


def qa(src: QASource, rng: random.Random, n: int, *, index: int, seed: int) -> Prompt:
    """qa.py: question ``index`` with its gold documents, the same article's other paragraphs
    (SQuAD), then random other documents, n documents in all, shuffled by the seed."""
    item = src.qas[index]
    gold, more = item["context"], item.get("more_context", [])
    if n < len(src.docs):
        if n - len(gold) > len(more):
            taken = set(gold + more)
            others = [i for i in range(len(src.docs)) if i not in taken]
            chosen = gold + more + rng.sample(others, max(0, n - len(gold) - len(more)))
        else:
            chosen = gold + rng.sample(more, max(0, n - len(gold)))
        docs = [src.docs[i] for i in chosen]
    else:
        docs = list(src.docs)
    random.Random(seed).shuffle(docs)
    context = "\n\n".join(DOCUMENT_PROMPT.format(i=i + 1, document=d) for i, d in enumerate(docs))
    fam = FAMILIES["qa"]
    head, tail, ap = _split(fam.template, fam.answer_prefix, context=context, query=item["query"])
    return Prompt(head, tail, ap, list(item["outputs"]), info={"num_docs": len(docs)})
