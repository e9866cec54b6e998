"""RULER (Hsieh et al. 2024, https://arxiv.org/abs/2404.06654) as a task: 13 synthetic long-context
tasks generated at any length in the model's own tokenizer, or RULER's own pre-generated files.

Credits: templates, answer prefixes, task arguments, generation lengths and metrics are RULER's
(NVIDIA/RULER, Apache-2.0, Copyright (c) 2024 NVIDIA CORPORATION), restated in
`eval/tasks/ruler/config.py` and `eval/tasks/ruler/generate.py` (which lists the few deliberate
differences from RULER's scripts).

Generated samples follow RULER's scripts at `RULER_COMMIT` (`eval.tasks.ruler.config`; what that
means per generator: `eval.tasks.ruler.generate`). For each requested length L, task, index
i < ``samples`` and generator seed s (``seeds``, default ``[seed]``; `eval.tasks.seeds`), the
content is drawn from ``random.Random(f"ruler:{s}:{task}:{L}:{i}")`` (QA: question i, as RULER), so a
sample never depends on which other samples run; samples of a seed other than ``seed`` carry
``-seed<s>`` in their id. RULER's length counts the prompt plus the task's ``tokens_to_generate``
(fwe too, since RULER sized fwe's prompt to L - tokens_to_generate in June 2025).

Haystack growth (``haystack_growth``). ``fill`` (default, RULER at `RULER_COMMIT`): the largest
haystack (in RULER's unit: words, sentences, documents) whose prompt fits is found by bisection, so
prompts land within one haystack unit below the target. ``paper``: the sizing of the paper-era
scripts (up to `RULER_PAPER_COMMIT`), for comparison with published RULER numbers: the haystack
grows from one step in fixed steps while the prompt fits (niah: 500 essay words, 25 noise /
distractor lines, 5 below 4096 tokens; vt, cwe, qa: 10; fwe: from L // 6 coded words in steps of
L // 32, sized to L itself with a vocabulary of L // 50; the essay haystack never repeated), so
prompts stop up to one step short of the target. The content generators are RULER_COMMIT's in
both. The prompt is measured as the model sees it -- chat template, BOS and the answer prefix
included -- and stored (`actual_tokens`; `length` = actual_tokens + tokens_to_generate, RULER's
record field).

Chat template (``chat_template``, from the model config). RULER puts its answer prefix AFTER the
model template, as the start of the assistant's turn; so does this task: the prompt is rendered with
the tokenizer's chat template (user turn, generation prompt) and the answer prefix appended, then
handed to the generator as plain text (``Sample.chat_template=False``). The template's own BOS text is
dropped when the tokenizer adds a BOS itself, so the model sees one. cwe's one-shot example becomes an
earlier user/assistant exchange (RULER concatenates it as an earlier templated turn). Without a chat
template the prompt is RULER's "base" text. ``context`` ends with the haystack, ``question`` holds
the question, the turn markers and the answer prefix (query-agnostic runs feed it after compression).

Pre-generated files (``data_dir``): RULER's output, records ``{"index", "input", "outputs",
"length"}``, in RULER's layout ``DIR/<length>/data/<task>/validation.jsonl`` (the lengths in
``lengths`` are read) or flat ``DIR/<task>.jsonl`` (each record's length is its `length` field; its
report column is the smallest power of two >= it, RULER's 4K..128K grid). RULER's ``input`` ends with
the answer prefix (or a record carries it as ``answer_prefix``); it is kept at the end of the prompt,
after the chat template's assistant marker when the model uses one. Generate the files with RULER's
``model_template_type=base`` so that the model template is not applied twice. The first ``samples``
records of each file run; their sample ids carry a digest of the record, so results of different
files never mix.

QA (qa_1 SQuAD, qa_2 HotpotQA): generated from ``data_dir``'s ``squad.json`` / ``hotpotqa.json``
(RULER's names; ``dev-v2.0.json`` / ``hotpot_dev_distractor_v1.json`` also found); without them the
two tasks are left out of the default task list with one logged line.

Separate questions (``separate_questions``, default false): niah_multiquery asks its four keys
one by one instead of in one question, one sample per key (``<task>-<length>-<index>/q<k>``, in
RULER's query order), sharing ``context_id`` and the same ``context``; the question and answer
prefix take RULER's single-key wording ("What is the special magic number for KEY ..."), the answer
is that key's value, and the haystack is sized so that the longest of the four prompts fits. The
other tasks are unchanged: niah_multivalue asks for the four values of ONE key, which are not four
questions (nothing tells them apart but their order in the text), so it stays one question; the
single / multikey tasks ask one key already. Pre-generated niah_multiquery files hold the joined
question and are refused with it. Default false: today's samples, ids and config hash.

Haystack (``haystack``): null keeps RULER's per-task choice (niah_single_1: the noise paragraph;
niah_single_2/3, multikey_1, multivalue, multiquery: Paul Graham essays; multikey_2/3: distractor
needles; vt: noise). ``noise``, ``paul_graham`` or ``dir:PATH`` replaces the noise / essay haystack of
the niah tasks (the distractor-needle haystacks of multikey_2/3 are their task).
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar

from eval.tasks.base import Sample, Task
from eval.tasks.haystack import check_haystack_name, load_haystack
from eval.tasks.jsonl import numbered_records
from eval.tasks.registry import register_task
from eval.tasks.ruler.config import (
    FAMILIES,
    METRIC_NAMES,
    METRICS,
    QA_FILES,
    QA_TASKS,
    TASKS,
    Family,
    family_of,
    postprocess_pred,
)
from eval.tasks.ruler.generate import (
    Prompt,
    QASource,
    _zeta,
    common_words,
    cwe_words,
    essay_words,
    freq_words,
    niah,
    qa,
    read_hotpotqa,
    read_squad,
    separate_queries,
    variable_tracking,
    vt_text,
    wonder_words,
)
from eval.tasks.seeds import generator_seeds, seed_suffix
from snapkv.prompts import chat_templated, encode_prompt, render_prompt

logger = logging.getLogger(__name__)

__all__ = ["RulerTask", "render", "prompt_tokens", "read_records", "find_pregenerated"]

# 2: the generators follow RULER_COMMIT (vt layout and example, fwe sizing, cwe example spacing).
VERSION = "2"
ICL_MAX_LENGTH = 500  # variable_tracking.py: the in-context example is a VT sample of at most 500 tokens
ICL_MIN_UNITS = 5
HAYSTACK_GROWTH = ("fill", "paper")


# ------------------------------------------------------------------------------------------ rendering
def _adds_bos(tokenizer: Any) -> bool:
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    return bool(ids) and ids[0] == bos


def render(tokenizer: Any, prompt: Prompt, templated: bool) -> tuple[str, str]:
    """``(context, question)`` text of a prompt as the model sees it (see the module docstring)."""
    if not templated:
        shots = "".join(user + assistant + "\n" for user, assistant in prompt.shots)
        return shots + prompt.head, prompt.tail + prompt.answer_prefix
    user = prompt.head + prompt.tail
    text = render_prompt(tokenizer, user, history=prompt.shots)
    start, head = text.rfind(user), prompt.head
    if start < 0:  # templates that trim the content
        user, head = user.strip(), prompt.head.lstrip()
        start = text.rfind(user)
    if start < 0:
        raise ValueError("the chat template changed the RULER prompt text; cannot place the answer prefix")
    split = start + len(head)
    context, question = text[:split], text[split:] + prompt.answer_prefix
    bos = getattr(tokenizer, "bos_token", None)
    if bos and context.startswith(bos) and _adds_bos(tokenizer):
        context = context[len(bos) :]
    return context, question


def prompt_tokens(tokenizer: Any, context: str, question: str) -> int:
    """Prompt length exactly as the generator encodes it (`snapkv.prompts.encode_prompt`)."""
    head, tail = encode_prompt(tokenizer, context, question, chat_template=False)
    return len(head) + len(tail)


# ------------------------------------------------------------------------------------ pre-generated
def read_records(path: Path) -> list[dict]:
    """RULER JSONL records (index, input, outputs, length); ValueError naming file and line."""
    records = []
    for lineno, rec in numbered_records(path):
        outputs = rec.get("outputs")
        if isinstance(outputs, str):
            outputs = [outputs]
        if (
            not isinstance(rec.get("input"), str)
            or not isinstance(outputs, list)
            or not all(isinstance(o, str) for o in outputs)
        ):
            raise ValueError(
                f"{path}:{lineno}: not a RULER record (needs 'input': str and 'outputs': list of str)"
            )
        length = rec.get("length")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)):
            raise ValueError(f"{path}:{lineno}: 'length' must be an integer, got {length!r}")
        records.append({**rec, "outputs": outputs, "_line": lineno})
    if not records:
        raise ValueError(f"{path}: no RULER records")
    return records


def find_pregenerated(data_dir: Path) -> dict[str, dict[int | None, Path]]:
    """``{task: {length: file}}`` of the RULER files under data_dir (length None: flat layout)."""
    found: dict[str, dict[int | None, Path]] = {}
    for p in sorted(data_dir.glob("*/data/*/validation.jsonl")):
        length_dir = p.parents[2].name
        if length_dir.isdigit():
            found.setdefault(p.parent.name, {})[int(length_dir)] = p
    for p in sorted(data_dir.glob("*.jsonl")):
        found.setdefault(p.stem, {})[None] = p
    return found


def _bucket(length: int) -> int:
    """Report column of a flat-layout record: the smallest power of two >= its length."""
    return 1 << max(0, int(length) - 1).bit_length()


def split_input(text: str, fam: Family, answer_prefix: str | None = None) -> Prompt:
    """A pre-generated RULER ``input`` as a Prompt: its answer prefix (the record's ``answer_prefix``
    when given and not already at the end, else the family's prefix found from its first 10
    characters, as RULER itself locates it) and the question (from the family's question marker)."""
    if answer_prefix:
        body, prefix = (
            (text[: -len(answer_prefix)], answer_prefix)
            if text.endswith(answer_prefix)
            else (text, answer_prefix)
        )
    else:
        at = text.rfind(fam.answer_prefix[:10])
        if at < 0:
            raise ValueError(
                f"the input does not end with RULER's {fam.name} answer prefix {fam.answer_prefix[:10]!r}..."
            )
        body, prefix = text[:at], text[at:]
    q = max(body.rfind(m) for m in fam.question_markers) if fam.question_markers else -1
    if q < 0:
        return Prompt(body, "", prefix, [])
    while q > 0 and body[q - 1].isspace():
        q -= 1
    return Prompt(body[:q], body[q:], prefix, [])


# ------------------------------------------------------------------------------------------- sizing
def fit(make: Callable[[int], tuple[Any, int]], budget: int, lo: int, hi: int | None, hint: int | None):
    """Largest n in [lo, hi] with ``make(n)[1] <= budget`` (make: n -> (value, tokens)), by galloping
    from ``hint`` (default lo) then bisection; returns ``(n, value, tokens)``, or None when even ``lo``
    is too long. The token count need not be monotonic in n: the n returned always fits."""
    cache: dict[int, tuple[Any, int]] = {}

    def fits(n: int) -> bool:
        if n not in cache:
            cache[n] = make(n)
        return cache[n][1] <= budget

    n = max(lo, hint or lo)
    if hi is not None:
        n = min(n, hi)
    step = max(1, n // 64)
    if fits(n):
        good, bad = n, None
        while hi is None or good < hi:
            m = good + step if hi is None else min(hi, good + step)
            if not fits(m):
                bad = m
                break
            good, step = m, step * 2
    else:
        good, bad = None, n
        while bad > lo:
            m = max(lo, bad - step)
            if fits(m):
                good = m
                break
            bad, step = m, step * 2
        if good is None:
            return None
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    value, tokens = cache[good]
    return good, value, tokens


def grow(make: Callable[[int], tuple[Any, int]], budget: int, start: int, step: int, hi: int | None):
    """RULER's paper-era sizing: n = start, start + step, ... (capped at ``hi``) while
    ``make(n)[1] <= budget``; returns ``(n, value, tokens)`` of the last n that fits, or None when
    ``start`` is already too long."""
    n = start if hi is None else min(start, hi)
    value, tokens = make(n)
    if tokens > budget:
        return None
    while hi is None or n < hi:
        m = n + step if hi is None else min(hi, n + step)
        v, t = make(m)
        if t > budget:
            break
        n, value, tokens = m, v, t
    return n, value, tokens


def paper_steps(family: str, haystack: str | None, length: int) -> tuple[int, int]:
    """(first size, step) of the paper-era scripts' haystack growth for a family at length L
    (``haystack``: niah's type, ``repeat`` / ``needle`` / ``essay``)."""
    if family == "niah":
        step = 500 if haystack == "essay" else (5 if length < 4096 else 25)
        return step, step
    if family == "freq_words_extraction":
        return length // 6, max(1, length // 32)
    return 10, 10


# --------------------------------------------------------------------------------------------- task
@register_task
class RulerTask(Task):
    """RULER's 13 tasks at the requested lengths (see the module docstring).

    tasks: RULER task names (None: every task that can run); lengths: prompt + generation lengths
    in tokens; samples: samples per task and length (kept as ``n_samples``: ``samples()`` is the
    task protocol's method); seed: the generation seed; seeds: generator seeds to run (None:
    ``[seed]``); data_dir: RULER files (either layout) or the QA sources; haystack: None (RULER's) |
    noise | paul_graham | dir:PATH; chat_template: render with the tokenizer's chat template (when it
    has one); separate_questions: niah_multiquery asks its keys one sample each; haystack_growth:
    fill | paper (module docstring).

    Row columns: ruler_task, ruler_family, ruler_length, ruler_index, actual_tokens, haystack,
    source, task_seed (generated samples: their generator seed); with separate_questions,
    niah_multiquery rows add ruler_query, context_id,
    question_index. Report: suite average per length and a task x length table per config (section
    "RULER"), and a task x length heatmap per config (`eval.tasks.ruler.report`).
    """

    name: ClassVar[str] = "ruler"
    # Which tasks / lengths / how many samples run, and where pre-generated files are read from,
    # choose samples (each sample id carries its record's hash), not one sample's output.
    selection_keys: ClassVar[tuple[str, ...]] = ("lengths", "tasks", "samples", "data_dir", "seeds")
    # Joined questions are RULER's task as it was before the switch existed: same hash and file.
    hash_defaults: ClassVar[dict[str, Any]] = {"separate_questions": False}

    def __init__(
        self,
        tasks: list[str] | None = None,
        lengths: list[int] | int = 4096,
        samples: int = 20,
        seed: int = 42,
        data_dir: str | None = None,
        haystack: str | None = None,
        chat_template: bool = True,
        separate_questions: bool = False,
        seeds: list[int] | None = None,
        haystack_growth: str = "fill",
    ) -> None:
        self.tasks, self.lengths, self.n_samples, self.seed = tasks, lengths, samples, seed
        self.data_dir, self.haystack, self.chat_template = data_dir, haystack, chat_template
        self.separate_questions, self.haystack_growth = separate_questions, haystack_growth
        self.generator_seeds = generator_seeds("RULER", seed, seeds)
        self._templated = False
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.lengths, (int, str)):
            self.lengths = [self.lengths]
        lengths = []
        for x in self.lengths:
            if isinstance(x, bool) or not isinstance(x, int) or x <= 0:
                raise ValueError(f"RULER lengths must be positive integers, got {x!r}")
            if x not in lengths:
                lengths.append(x)
        if not lengths:
            raise ValueError("RULER lengths is empty")
        self.lengths = lengths
        if isinstance(self.n_samples, bool) or not isinstance(self.n_samples, int) or self.n_samples < 1:
            raise ValueError(f"RULER samples must be a positive integer, got samples={self.n_samples!r}")
        if isinstance(self.tasks, str):
            self.tasks = [self.tasks]
        if self.tasks is not None:
            if not self.tasks:
                raise ValueError("RULER tasks is empty (null runs every task that can run)")
            self.tasks = list(dict.fromkeys(self.tasks))
            for t in self.tasks:
                family_of(t)  # ValueError for unknown names
        if not isinstance(self.separate_questions, bool):
            raise ValueError(
                f"RULER separate_questions must be true or false, got separate_questions={self.separate_questions!r}"
            )
        if self.haystack_growth not in HAYSTACK_GROWTH:
            raise ValueError(
                f"unknown RULER haystack_growth {self.haystack_growth!r}; known: {', '.join(HAYSTACK_GROWTH)}"
            )
        if self.haystack is not None:
            check_haystack_name(self.haystack)
        if self.data_dir is not None and not Path(self.data_dir).expanduser().is_dir():
            raise FileNotFoundError(f"RULER data_dir not found: {self.data_dir!r}")

    # ---- what runs
    @property
    def version(self) -> str:
        """Task version for the config hash: changes with the generators or the wonderwords lists."""
        words = "\n".join(wonder_words("noun") + wonder_words("adjective") + wonder_words("verb"))
        return f"{VERSION}+words.{hashlib.sha256(words.encode()).hexdigest()[:8]}"

    @cached_property
    def _pregenerated(self) -> dict[str, dict[int | None, Path]]:
        return find_pregenerated(Path(self.data_dir).expanduser()) if self.data_dir else {}

    @cached_property
    def _qa_sources(self) -> dict[str, Path]:
        found = {}
        if self.data_dir:
            root = Path(self.data_dir).expanduser()
            for dataset, names in QA_FILES.items():
                for name in names:
                    if (root / name).is_file():
                        found[dataset] = root / name
                        break
        return found

    @cached_property
    def plan(self) -> list[tuple[str, int, Path | None]]:
        """``[(task, length, file or None)]`` in run order (file None: generated; length None for a
        flat file, whose records carry their lengths)."""
        pre = self._pregenerated
        if pre:
            tasks = self.tasks or list(pre)
            for t in tasks:
                family_of(t)  # a file named after no RULER task: ValueError naming it
            missing = [t for t in tasks if t not in pre]
            if missing:
                raise ValueError(
                    f"RULER task(s) {', '.join(missing)} have no file in data_dir={self.data_dir!r}; "
                    f"it holds {', '.join(pre)}"
                )
            plan = []
            for t in tasks:
                files = pre[t]
                if None in files:  # flat layout: the records carry their lengths
                    plan.append((t, None, files[None]))
                    continue
                absent = [x for x in self.lengths if x not in files]
                if absent:
                    raise ValueError(
                        f"RULER task {t!r}: data_dir={self.data_dir!r} has no file for length(s) "
                        f"{absent}; it has lengths {sorted(files)}"
                    )
                plan += [(t, x, files[x]) for x in self.lengths]
            return sorted(plan, key=lambda x: (x[1] or 0, tasks.index(x[0])))
        unknown = [t for t in self.tasks or [] if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown RULER task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
        qa_ok = {t for t in QA_TASKS if TASKS[t].args["dataset"] in self._qa_sources}
        if self.tasks is None:
            tasks = [t for t in TASKS if t not in QA_TASKS or t in qa_ok]
            left_out = [t for t in QA_TASKS if t not in qa_ok]
            if left_out:
                logger.warning(
                    "RULER: %s left out: they need SQuAD / HotpotQA (squad.json / hotpotqa.json in "
                    "task.data_dir, data_dir=%s)",
                    ", ".join(left_out),
                    self.data_dir,
                )
        else:
            tasks = self.tasks
            for t in tasks:
                if t in QA_TASKS and t not in qa_ok:
                    names = " or ".join(QA_FILES[TASKS[t].args["dataset"]])
                    raise ValueError(
                        f"RULER task {t!r} needs {names} in task.data_dir (data_dir={self.data_dir!r})"
                    )
        return [(t, length, None) for length in self.lengths for t in tasks]

    def _separate(self, task: str) -> bool:
        """Whether `task`'s keys are asked one sample each: ``separate_questions`` and a niah task
        that asks several keys with one value each (RULER's niah_multiquery)."""
        spec = TASKS.get(task)
        return bool(
            self.separate_questions
            and spec is not None
            and spec.family == "niah"
            and spec.args["num_needle_q"] > 1
            and spec.args["num_needle_v"] == 1
        )

    def multi_question(self) -> bool:
        return any(self._separate(task) for task, _, path in self.plan if path is None)

    def num_samples(self) -> int:
        """Check everything that can be checked without a tokenizer (files, QA sources, haystack) and
        return the number of samples; the runner calls it before loading the model."""
        n = 0
        for task, _, path in self.plan:
            if path is not None and self._separate(task):
                raise ValueError(
                    f"RULER separate_questions=true needs generated {task} samples: {path} holds "
                    "RULER's joined question (leave data_dir unset for this task)"
                )
            if path is not None:
                n += min(self.n_samples, len(self._records(path)))
            else:
                per_context = TASKS[task].args["num_needle_q"] if self._separate(task) else 1
                n += self.n_samples * len(self.generator_seeds) * per_context
                if TASKS[task].family == "qa":
                    self._qa(TASKS[task].args["dataset"])
                elif TASKS[task].family == "niah" and self._niah_haystack(task)[0] == "essay":
                    self._essay(self._niah_haystack(task)[1])
        return n

    # ---- data
    def _records(self, path: Path) -> list[dict]:
        cache = self.__dict__.setdefault("_record_cache", {})
        if path not in cache:
            cache[path] = read_records(path)
        return cache[path]

    def _qa(self, dataset: str) -> QASource:
        cache = self.__dict__.setdefault("_qa_cache", {})
        if dataset not in cache:
            path = self._qa_sources[dataset]
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
                cache[dataset] = read_squad(data) if dataset == "squad" else read_hotpotqa(data)
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}: not a {dataset} file ({type(e).__name__}: {e})") from None
            if len(cache[dataset].qas) < self.n_samples:
                raise ValueError(
                    f"{path}: {len(cache[dataset].qas)} questions, fewer than samples={self.n_samples}"
                )
        return cache[dataset]

    def _essay(self, name: str) -> list[str]:
        cache = self.__dict__.setdefault("_essay_cache", {})
        if name not in cache:
            text, _ = load_haystack(name)
            cache[name] = essay_words(text.strip())
        return cache[name]

    def _niah_haystack(self, task: str) -> tuple[str, str | None]:
        """(niah haystack type, essay source) of a task under the ``haystack`` setting."""
        kind = TASKS[task].args["type_haystack"]
        if kind == "needle" or self.haystack is None:
            return kind, ("paul_graham" if kind == "essay" else None)
        if self.haystack == "noise":
            return "repeat", None
        return "essay", self.haystack

    def _vt_icl(self, tokenizer: Any, args: dict, seed: int) -> tuple[str, list[str]]:
        """variable_tracking.py's in-context example: one VT sample (3-letter names, value
        `ICL_VALUE`) with the most noise paragraphs (at least 5) whose text takes at most 500 tokens
        (no generation allowance, as RULER sizes it), generated once per seed; the text ends with
        its answer and a newline."""
        cache = self.__dict__.setdefault("_icl_cache", {})
        key = (id(tokenizer), seed, args["num_chains"], args["num_hops"])
        if key not in cache:

            def measure(n: int) -> tuple[tuple[str, list[str]], int]:
                rng = random.Random(f"ruler:{seed}:vt:icl")
                head, tail, ap, names = vt_text(rng, n, args["num_chains"], args["num_hops"], is_icl=True)
                text = head + tail + ap
                return (text, names), len(tokenizer(text, add_special_tokens=False)["input_ids"])

            found = fit(measure, ICL_MAX_LENGTH, ICL_MIN_UNITS, None, None)
            if found is None:
                raise ValueError("the variable-tracking example does not fit 500 tokens")
            _, (text, names), _ = found
            cache[key] = (text + " " + " ".join(names) + "\n", names)
        return cache[key]

    # ---- samples
    def samples(self, tokenizer: Any) -> Iterator[Sample]:
        self._templated = chat_templated(tokenizer, self.chat_template)
        self.num_samples()
        return self._iter(tokenizer)

    def _iter(self, tokenizer: Any) -> Iterator[Sample]:
        for task, length, path in self.plan:
            if path is not None:
                yield from self._from_file(tokenizer, task, length, path)
            else:
                yield from self._generated(tokenizer, task, length)

    def _sample(
        self,
        task: str,
        nominal: int,
        index: int,
        outputs: list[str],
        text: tuple[str, str],
        sid: str,
        extra: dict,
    ) -> Sample:
        fam = family_of(task)
        return Sample(
            sample_id=sid,
            dataset=task,
            context=text[0],
            question=text[1],
            answers=list(outputs),
            max_new_tokens=fam.tokens_to_generate,
            chat_template=False,  # already rendered
            length=extra.pop("length"),
            extra={
                "ruler_task": task,
                "ruler_family": fam.name,
                "ruler_length": nominal,
                "ruler_index": index,
                "ruler_metric": METRIC_NAMES[fam.metric],
                "chat_template_applied": self._templated,
                **extra,
            },
        )

    def _from_file(self, tokenizer: Any, task: str, length: int | None, path: Path) -> Iterator[Sample]:
        fam = family_of(task)
        for i, rec in enumerate(self._records(path)[: self.n_samples]):
            try:
                prompt = split_input(rec["input"], fam, rec.get("answer_prefix"))
            except ValueError as e:
                raise ValueError(f"{path}:{rec['_line']}: {e}") from None
            prompt.outputs = rec["outputs"]
            digest = hashlib.sha256(
                json.dumps([rec["input"], rec["outputs"]], ensure_ascii=False).encode()
            ).hexdigest()[:8]
            index = rec.get("index", i)
            rec_len = rec.get("length")
            nominal = length if length is not None else (_bucket(rec_len) if rec_len else None)
            if nominal is None:
                raise ValueError(f"{path}:{rec['_line']}: a flat-layout record needs its 'length'")
            text = render(tokenizer, prompt, self._templated)
            yield self._sample(
                task,
                nominal,
                index,
                prompt.outputs,
                text,
                f"{task}-{nominal}-{index}-{digest}",
                {"length": rec_len, "actual_tokens": prompt_tokens(tokenizer, *text), "source": str(path)},
            )

    def _budget(self, task: str, length: int) -> int:
        """Prompt tokens a sample of ``task`` at length L may take: L - tokens_to_generate (paper-era
        fwe: L itself)."""
        fam = FAMILIES[TASKS[task].family]
        if self.haystack_growth == "paper" and fam.name == "freq_words_extraction":
            return length
        return length - fam.tokens_to_generate

    def _size(self, measure: Callable, task: str, length: int, lo: int, hi: int | None, hint: int | None):
        """`fit` (``haystack_growth=fill``) or `grow` from the paper-era steps (``paper``)."""
        budget = self._budget(task, length)
        if self.haystack_growth == "fill":
            return fit(measure, budget, lo, hi, hint)
        family = TASKS[task].family
        kind, source = self._niah_haystack(task) if family == "niah" else (None, None)
        if kind == "essay":  # the paper-era script never repeated the essays
            hi = len(self._essay(source))
        start, step = paper_steps(family, kind, length)
        return grow(measure, budget, max(start, lo), step, hi)

    def _maker(
        self, tokenizer: Any, task: str, length: int, index: int, seed: int
    ) -> tuple[Callable[[int], Prompt], int, int | None]:
        """(n -> Prompt, smallest n, largest n or None) for a generated task."""
        spec = TASKS[task]
        args, fam = spec.args, FAMILIES[spec.family]
        key = f"ruler:{seed}:{task}:{length}:{index}"

        def rng() -> random.Random:
            return random.Random(key)

        if fam.name == "niah":
            kind, source = self._niah_haystack(task)
            words = self._essay(source) if kind == "essay" else None
            lo = (
                1
                if kind == "essay"
                else max(args["num_needle_k"], args["num_needle_q"]) * args["num_needle_v"]
            )
            return (lambda n: niah(args, rng(), n, seed=seed, haystack=kind, words=words)), lo, None
        if fam.name == "variable_tracking":
            icl = self._vt_icl(tokenizer, args, seed)
            return (lambda n: variable_tracking(args, rng(), n, icl=icl)), 1, None
        if fam.name == "common_words_extraction":
            hi = len(cwe_words(seed))
            return (lambda n: common_words(args, rng(), n, seed=seed, length=length)), args["num_cw"], hi
        if fam.name == "freq_words_extraction":
            alpha = float(args["alpha"])
            lo = int(4**alpha * _zeta(alpha)) + 1  # rank 4 (the last answer) occurs at least once
            target = self._budget(task, length)  # the vocabulary is target // 50 words
            return (lambda n: freq_words(args, rng(), n, seed=seed, length=target)), lo, None
        src = self._qa(args["dataset"])
        return (lambda n: qa(src, rng(), n, index=index, seed=seed)), 1, len(src.docs)

    def _generated(self, tokenizer: Any, task: str, length: int) -> Iterator[Sample]:
        if self._separate(task):
            yield from self._generated_separate(tokenizer, task, length)
            return
        fam = FAMILIES[TASKS[task].family]
        budget = self._budget(task, length)
        hint = None
        for index, seed in self._contexts():
            make, lo, hi = self._maker(tokenizer, task, length, index, seed)

            def measure(n: int, make=make) -> tuple[tuple[Prompt, str, str], int]:
                prompt = make(n)
                context, question = render(tokenizer, prompt, self._templated)
                return (prompt, context, question), prompt_tokens(tokenizer, context, question)

            found = self._size(measure, task, length, lo, hi, hint)
            if found is None:
                raise ValueError(
                    f"RULER length {length} is too small for {task}: the shortest prompt takes "
                    f"{measure(lo)[1]} tokens, more than {budget}"
                    + ("" if budget == length else f" (= {length} - {fam.tokens_to_generate} generated)")
                )
            n, (prompt, *text), actual = found
            hint = n
            yield self._sample(
                task,
                length,
                index,
                prompt.outputs,
                tuple(text),
                f"{task}-{length}-{index}{seed_suffix(seed, self.seed)}",
                {
                    "length": actual + fam.tokens_to_generate,
                    "actual_tokens": actual,
                    "haystack_units": n,
                    "haystack": self._haystack_name(task),
                    "source": "generated",
                    "task_seed": seed,
                },
            )

    def _generated_separate(self, tokenizer: Any, task: str, length: int) -> Iterator[Sample]:
        """`_generated` for a task whose keys are asked one by one (`separate_queries`): the largest
        haystack whose every single-key prompt fits, one sample per key sharing the context."""
        fam = FAMILIES["niah"]
        budget = self._budget(task, length)
        type_v = TASKS[task].args["type_needle_v"]
        hint = None
        for index, seed in self._contexts():
            make, lo, hi = self._maker(tokenizer, task, length, index, seed)

            def measure(n: int, make=make) -> tuple[tuple[list[Prompt], list[tuple[str, str]]], int]:
                prompts = separate_queries(make(n), type_v)
                texts = [render(tokenizer, p, self._templated) for p in prompts]
                if len({context for context, _ in texts}) != 1:
                    raise ValueError(
                        f"RULER {task}: the chat template renders the shared context differently per "
                        "question; the keys cannot be asked separately with it"
                    )
                return (prompts, texts), max(prompt_tokens(tokenizer, *text) for text in texts)

            found = self._size(measure, task, length, lo, hi, hint)
            if found is None:
                raise ValueError(
                    f"RULER length {length} is too small for {task}: the shortest prompt takes "
                    f"{measure(lo)[1]} tokens, more than {budget} (= {length} - {fam.tokens_to_generate} generated)"
                )
            n, (prompts, texts), _ = found
            hint = n
            context_id = f"{task}-{length}-{index}{seed_suffix(seed, self.seed)}"
            for k, (prompt, text) in enumerate(zip(prompts, texts)):
                actual = prompt_tokens(tokenizer, *text)
                sample = self._sample(
                    task,
                    length,
                    index,
                    prompt.outputs,
                    text,
                    f"{context_id}/q{k}",
                    {
                        "length": actual + fam.tokens_to_generate,
                        "actual_tokens": actual,
                        "haystack_units": n,
                        "haystack": self._haystack_name(task),
                        "source": "generated",
                        "ruler_query": prompt.info["keys"][0],
                        "context_id": context_id,
                        "question_index": k,
                        "task_seed": seed,
                    },
                )
                sample.context_id, sample.question_index = context_id, k
                if self._templated:  # a later turn: the question alone as the user's text
                    sample.turn = (prompt.tail.strip(), prompt.answer_prefix)
                yield sample

    def _contexts(self) -> list[tuple[int, int]]:
        """(index, generator seed) of every generated context of a (task, length), in run order."""
        return [(i, s) for i in range(self.n_samples) for s in self.generator_seeds]

    def _haystack_name(self, task: str) -> str | None:
        family = TASKS[task].family
        if family == "variable_tracking":
            return "noise"
        if family != "niah":
            return None
        kind, source = self._niah_haystack(task)
        return source or {"repeat": "noise", "needle": "needles"}[kind]

    # ---- scoring
    def score(self, sample: Sample, prediction: str) -> float:
        """RULER's metric of the task's family (string_match_all; QA: string_match_part)."""
        fam = family_of(sample.dataset)
        return METRICS[fam.metric](postprocess_pred(prediction), list(sample.answers))

    def score_all(self, sample: Sample, prediction: str) -> dict[str, float]:
        fam = family_of(sample.dataset)
        return {METRIC_NAMES[fam.metric]: self.score(sample, prediction)}
