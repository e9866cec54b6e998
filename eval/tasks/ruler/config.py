"""RULER's task definitions: templates, answer prefixes, generation lengths, metrics, task configs.

Ported from RULER (Hsieh et al. 2024, https://arxiv.org/abs/2404.06654; NVIDIA/RULER, Apache-2.0,
Copyright (c) 2024 NVIDIA CORPORATION): `scripts/data/synthetic/constants.py` (templates, answer
prefixes, tokens_to_generate), `scripts/synthetic.yaml` (the 13 tasks' arguments) and
`scripts/eval/synthetic/constants.py` (string_match_all / string_match_part). The definitions are
restated here, not copied; see `eval/tasks/ruler/generate.py` for the generators.

One wording choice: RULER's variable-tracking answer prefix was first published with the typo
"assgined" and later corrected to "assigned"; the corrected text is used here (pre-generated files
run with whatever their `input` holds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eval.tasks.haystack import NOISE_TEXT

# The RULER commit whose generators (`scripts/data/synthetic/*.py`) and templates (`constants.py`)
# this port follows (NVIDIA/RULER, 2026-07-22).
RULER_COMMIT = "c3f5e3b4f87f97e048793bb510a3a6b19a46bf3a"
# The last commit of the paper-era sizing: every generator grew its haystack in fixed steps until the
# prompt no longer fit (from the first release, 4f6507e, to here; replaced by bisection in 2025).
RULER_PAPER_COMMIT = "c5341b44fe14a7fc14b8469af0fd2da1c5d5454a"

# RULER's noise haystack and its needle sentence (niah.py: type_haystack=repeat / needle).
NOISE = NOISE_TEXT
NIAH_NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# QA documents (qa.py).
DOCUMENT_PROMPT = "Document {i}:\n{document}"


@dataclass(frozen=True)
class Family:
    """A RULER generator (niah, variable_tracking, ...): its prompt and how it is scored.

    template: the task template with `{context}` (the haystack) and `{query}`; answer_prefix: the text
    RULER appends after the (model) template, so the answer starts right after it; tokens_to_generate:
    the generation length, also subtracted from the requested length when sizing the prompt.
    """

    name: str
    template: str
    answer_prefix: str
    tokens_to_generate: int
    metric: str  # "all" (string_match_all) | "part" (string_match_part)
    # The text that starts the question part of a template, used to split a pre-generated `input`
    # into context and question (query-agnostic protocol).
    question_markers: tuple[str, ...] = ()

    @property
    def context_prefix(self) -> str:
        """Template text before `{context}`."""
        return self.template.split("{context}")[0]

    @property
    def question_suffix(self) -> str:
        """Template text after `{context}`."""
        return self.template.split("{context}", 1)[1]


FAMILIES: dict[str, Family] = {
    "niah": Family(
        name="niah",
        template=(
            "Some special magic {type_needle_v} are hidden within the following text. Make sure to "
            "memorize it. I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
        ),
        answer_prefix=" The special magic {type_needle_v} for {query} mentioned in the provided text are",
        tokens_to_generate=128,
        metric="all",
        question_markers=("What are all the special magic", "What is the special magic"),
    ),
    "variable_tracking": Family(
        name="variable_tracking",
        template=(
            "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
            "{context}\nQuestion: Find all variables that are assigned the value {query} in the text above."
        ),
        answer_prefix=(
            " Answer: According to the chain(s) of variable assignment in the text above, {num_v} "
            "variables are assigned the value {query}, they are: "
        ),
        tokens_to_generate=30,
        metric="all",
        question_markers=("Question: Find all variables that are assigned the value",),
    ),
    "common_words_extraction": Family(
        name="common_words_extraction",
        template=(
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n{context}\n"
            "Question: What are the 10 most common words in the above list?"
        ),
        answer_prefix=" Answer: The top 10 words that appear most often in the list are:",
        tokens_to_generate=120,
        metric="all",
        question_markers=("Question: What are the 10 most common words in the above list?",),
    ),
    "freq_words_extraction": Family(
        name="freq_words_extraction",
        template=(
            "Read the following coded text and track the frequency of each coded word. Find the three "
            "most frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. "
            "Please ignore the dots '....'. What are the three most frequently appeared words in the "
            "above coded text?"
        ),
        answer_prefix=" Answer: According to the coded text above, the three most frequently appeared words are:",
        tokens_to_generate=50,
        metric="all",
        question_markers=("Question: Do not provide any explanation.",),
    ),
    "qa": Family(
        name="qa",
        template=(
            "Answer the question based on the given documents. Only give me the answer and do not output "
            "any other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question "
            "based on the given documents. Only give me the answer and do not output any other words."
            "\n\nQuestion: {query}"
        ),
        answer_prefix=" Answer:",
        tokens_to_generate=32,
        metric="part",
        question_markers=("Answer the question based on the given documents.",),
    ),
}


@dataclass(frozen=True)
class TaskSpec:
    """One of RULER's 13 tasks (synthetic.yaml): a family and its arguments."""

    name: str
    family: str
    args: dict[str, Any] = field(default_factory=dict)


def _niah(name: str, haystack: str, k: str, v: str, nk: int = 1, nv: int = 1, nq: int = 1) -> TaskSpec:
    args = dict(type_haystack=haystack, type_needle_k=k, type_needle_v=v)
    args.update(num_needle_k=nk, num_needle_v=nv, num_needle_q=nq)
    return TaskSpec(name, "niah", args)


# synthetic.yaml, in RULER's order.
TASKS: dict[str, TaskSpec] = {
    t.name: t
    for t in (
        _niah("niah_single_1", "repeat", "words", "numbers"),
        _niah("niah_single_2", "essay", "words", "numbers"),
        _niah("niah_single_3", "essay", "words", "uuids"),
        _niah("niah_multikey_1", "essay", "words", "numbers", nk=4),
        _niah("niah_multikey_2", "needle", "words", "numbers"),
        _niah("niah_multikey_3", "needle", "uuids", "uuids"),
        _niah("niah_multivalue", "essay", "words", "numbers", nv=4),
        _niah("niah_multiquery", "essay", "words", "numbers", nq=4),
        TaskSpec("vt", "variable_tracking", {"num_chains": 1, "num_hops": 4}),
        TaskSpec("cwe", "common_words_extraction", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
        TaskSpec("fwe", "freq_words_extraction", {"alpha": 2.0}),
        TaskSpec("qa_1", "qa", {"dataset": "squad"}),
        TaskSpec("qa_2", "qa", {"dataset": "hotpotqa"}),
    )
}
QA_TASKS = ("qa_1", "qa_2")
# RULER's QA sources (download_qa_dataset.sh): the SQuAD 2.0 dev set and HotpotQA's dev distractor
# set, saved as squad.json / hotpotqa.json; the original file names are accepted too.
QA_FILES: dict[str, tuple[str, ...]] = {
    "squad": ("squad.json", "dev-v2.0.json"),
    "hotpotqa": ("hotpotqa.json", "hotpot_dev_distractor_v1.json"),
}


PREFIXES = {
    "niah": "niah",
    "vt": "variable_tracking",
    "cwe": "common_words_extraction",
    "fwe": "freq_words_extraction",
    "qa": "qa",
}


def family_of(task: str) -> Family:
    """The family of a RULER task name: one of `TASKS`, or a name starting with a family's short
    name (RULER's own variants such as ``niah_multikey_l2``, ``vt_...``). ValueError otherwise."""
    if task in TASKS:
        return FAMILIES[TASKS[task].family]
    for prefix, fam in PREFIXES.items():
        if task.startswith(prefix):
            return FAMILIES[fam]
    raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")


# ------------------------------------------------------------------------------------------ metrics
def string_match_all(prediction: str, references: list[str]) -> float:
    """RULER's string_match_all for one sample: the fraction of references found (case-insensitive
    substring) in the prediction."""
    if not references:
        return 0.0
    pred = prediction.lower()
    return sum(float(r.lower() in pred) for r in references) / len(references)


def string_match_part(prediction: str, references: list[str]) -> float:
    """RULER's string_match_part for one sample (QA): 1 if any reference is found (case-insensitive
    substring) in the prediction."""
    pred = prediction.lower()
    return max((float(r.lower() in pred) for r in references), default=0.0)


METRICS = {"all": string_match_all, "part": string_match_part}
METRIC_NAMES = {"all": "string_match_all", "part": "string_match_part"}


def postprocess_pred(prediction: str) -> str:
    """RULER's evaluate.py clean-up: strip, control characters to newlines, strip again."""
    out = []
    for ch in prediction.strip():
        out.append("\n" if ord(ch) < 0x20 else ch)
    return "".join(out).strip()
