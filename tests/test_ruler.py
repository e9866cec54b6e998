"""RULER task: every generated task (determinism by seed, token lengths, answers in the prompt as
RULER places them, the metric on gold and wrong answers), chat-template placement of the answer
prefix, RULER's pre-generated files in both layouts, the config, the report, and a run end to end on
a tiny random model.

Offline: a byte-level BPE tokenizer trained in code (ChatML-like template), a text haystack written to
tmp_path (the Paul Graham essays are never fetched), tiny SQuAD / HotpotQA files.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from pathlib import Path

import pandas as pd
import pytest
from conftest import CHATML, byte_level_bpe, save_tiny_llama
from hydra import compose, initialize_config_dir

import eval.runner as runner
from eval.report import build_report, prepare
from eval.spec import RunSpec
from eval.store import ROW_FIELDS, ResultStore
from eval.tables import column_order
from eval.tasks import haystack as hs
from eval.tasks.ruler.config import (
    FAMILIES,
    RULER_COMMIT,
    TASKS,
    family_of,
    string_match_all,
    string_match_part,
)
from eval.tasks.ruler.generate import _zeta, common_words, cwe_words, essay_words, freq_words
from eval.tasks.ruler.report import (
    paired_differences,
    ruler_compare,
    ruler_compare_figure,
    ruler_means,
    ruler_tables,
)
from eval.tasks.ruler.task import (
    RulerTask,
    find_pregenerated,
    paper_steps,
    prompt_tokens,
    render,
    split_input,
)
from snapkv.prompts import encode_prompt

ROOT = Path(__file__).resolve().parents[1]
SYNTHETIC = [t for t in TASKS if not t.startswith("qa")]
LENGTH = 1024
PROSE = " ".join(
    f"Essay line {w} talks about {x} and ideas. It is short. People like {x} when it rains."
    for w in ("one", "two", "three", "four", "five", "six", "seven")
    for x in ("gardens", "startups", "rivers", "books", "cities", "music")
)


# ------------------------------------------------------------------------------------------ fixtures
def _train_tokenizer(bos: bool):
    corpus = [hs.NOISE_TEXT] * 10 + [PROSE] + [f.template + f.answer_prefix for f in FAMILIES.values()]
    corpus += [" ".join(cwe_words(0))]  # real tokenizers hold most of these words in one or two tokens
    return byte_level_bpe(
        corpus,
        2000,
        ["<s>", "<|im_start|>", "<|im_end|>"],
        bos="<s>" if bos else None,
        add_bos=bos,
        chat_template=("<s>" if bos else "") + CHATML,
    )


@pytest.fixture(scope="module")
def tok():
    return _train_tokenizer(bos=False)


@pytest.fixture(scope="module")
def bos_tok():
    return _train_tokenizer(bos=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """A text haystack dir and a data dir with tiny SQuAD (v2, one impossible question) / HotpotQA files."""
    root = tmp_path_factory.mktemp("ruler")
    (root / "essays").mkdir()
    (root / "essays" / "a.txt").write_text(PROSE, encoding="utf-8")
    qa = root / "qa"
    qa.mkdir()
    articles = []
    for a in range(3):
        paragraphs = []
        for p in range(2):
            ctx = f"Paragraph {a}-{p}: the river town grew Vel{a}{p} apples. It rained a lot there."
            qas = [
                {"question": f"What did town {a}-{p} grow?", "answers": [{"text": f"Vel{a}{p} apples"}],
                 "is_impossible": False},
                {"question": "Who ate them?", "answers": [], "is_impossible": True},
            ]  # fmt: skip
            paragraphs.append({"context": ctx, "qas": qas})
        articles.append({"title": f"T{a}", "paragraphs": paragraphs})
    (qa / "squad.json").write_text(json.dumps({"data": articles}), encoding="utf-8")
    hotpot = [
        {
            "question": f"Which city is home to team {i}?",
            "answer": f"City{i}",
            "context": [
                [f"Team {i}", [f"Team {i} plays in City{i}. ", "It was founded long ago."]],
                [f"Other {i}", ["Nothing to see here."]],
            ],
        }  # fmt: skip
        for i in range(4)
    ]
    (qa / "hotpotqa.json").write_text(json.dumps(hotpot), encoding="utf-8")
    return {"essays": root / "essays", "qa": qa}


def make_task(data, **kw) -> RulerTask:
    kw.setdefault("lengths", [LENGTH])
    kw.setdefault("samples", 2)
    kw.setdefault("haystack", f"dir:{data['essays']}")
    kw.setdefault("data_dir", str(data["qa"]))
    return RulerTask(**kw)


# ---------------------------------------------------------------------------------- generated tasks
def _budget(task: str, length: int) -> int:
    """RULER at RULER_COMMIT: every prompt (fwe's too) fits length - tokens_to_generate."""
    return length - family_of(task).tokens_to_generate


def _answers_as_ruler_places_them(task: str, sample) -> None:
    """Each answer in the prompt exactly as often as RULER's generator puts it there."""
    fam, ctx = family_of(task).name, sample.context
    if fam == "niah":
        for a in sample.answers:
            assert ctx.count(a) == 1, (a, ctx.count(a))
        assert len(sample.answers) == TASKS[task].args["num_needle_v"] * TASKS[task].args["num_needle_q"]
    elif fam == "variable_tracking":
        # VAR v0 = 12345 / VAR v1 = VAR v0 / ... / VAR v4 = VAR v3: each name twice, the last once
        assert [len(re.findall(rf"\b{v}\b", ctx)) for v in sample.answers] == [2, 2, 2, 2, 1]
        value = re.search(rf"VAR {sample.answers[0]} = (\d+)", ctx).group(1)
        assert f"assigned the value {value}" in sample.question
    elif fam == "common_words_extraction":
        main = ctx.rsplit("Memorize the ones that appear most often.\n", 1)[1]
        items = re.findall(r"\d+\. (\S+)", main)
        counts = {w: items.count(w) for w in set(items)}
        reps = 6 if LENGTH < 4096 else 30  # RULER: 6 / 1 repeats below 4096 tokens
        assert all(counts[w] == reps for w in sample.answers) and len(sample.answers) == 10
        assert all(c == 1 for w, c in counts.items() if w not in sample.answers)
    elif fam == "freq_words_extraction":
        coded = ctx.rsplit("coded words. ", 1)[1].split()
        n = sample.extra["haystack_units"]
        for k, w in enumerate(sample.answers, start=2):
            assert coded.count(w) == int(n * k**-2.0 / _zeta(2.0))
        others = {w: coded.count(w) for w in set(coded) - {"...", *sample.answers}}
        assert max(others.values(), default=0) < coded.count(sample.answers[-1])
    else:  # qa: the gold document(s) once each (the answer is only in them here)
        assert [ctx.count(a) for a in sample.answers] == [1] * len(sample.answers)
        assert ctx.count("Document 1:\n") == 1


@pytest.mark.parametrize("task", list(TASKS))
def test_generated_task(task, tok, data):
    samples = list(make_task(data, tasks=[task]).samples(tok))
    assert [s.sample_id for s in samples] == [f"{task}-{LENGTH}-0", f"{task}-{LENGTH}-1"]
    again = list(make_task(data, tasks=[task]).samples(tok))
    assert [(s.context, s.question, s.answers) for s in samples] == [
        (s.context, s.question, s.answers) for s in again
    ], "same seed, same samples"
    other = list(make_task(data, tasks=[task], seed=7).samples(tok))
    assert [s.prompt for s in other] != [s.prompt for s in samples], "another seed, other samples"
    assert samples[0].prompt != samples[1].prompt

    budget = _budget(task, LENGTH)
    fam = family_of(task)
    for s in samples:
        actual = s.extra["actual_tokens"]
        assert actual == prompt_tokens(tok, s.context, s.question)
        assert s.length == actual + fam.tokens_to_generate
        assert actual <= budget
        if fam.name != "qa":  # QA: the tiny corpus has fewer documents than the length holds
            assert budget - actual <= 64, (budget, actual)  # within one haystack unit here
            # the largest haystack that fits: one more unit (word, sentence, ...) overflows
            t = make_task(data, tasks=[task])
            t._templated = True
            make, _, hi = t._maker(tok, task, LENGTH, s.extra["ruler_index"], s.extra["task_seed"])
            n = s.extra["haystack_units"]
            assert prompt_tokens(tok, *render(tok, make(n), True)) == actual
            assert (hi is not None and n == hi) or prompt_tokens(
                tok, *render(tok, make(n + 1), True)
            ) > budget
        assert s.extra["ruler_task"] == task and s.extra["ruler_length"] == LENGTH
        assert s.max_new_tokens == fam.tokens_to_generate
        assert s.chat_template is False  # rendered by the task: the answer prefix ends the prompt
        end = fam.answer_prefix.rsplit("}", 1)[-1]  # the prefix's text after its last placeholder
        assert s.question.endswith((end, end.replace(" are", " is"))), s.question[-80:]
        _answers_as_ruler_places_them(task, s)

        t = make_task(data, tasks=[task])
        gold = " ".join(s.answers) if fam.metric == "all" else s.answers[0]
        assert t.score(s, gold) == 1.0
        assert t.score(s, "  I do not know.\x00") == 0.0
        assert t.score_all(s, gold) == {
            "string_match_all" if fam.metric == "all" else "string_match_part": 1.0
        }


def test_length_is_the_largest_haystack_that_fits(tok, data):
    """Bisection: one more haystack unit would overflow the budget (niah_single_1: noise paragraphs)."""
    t = make_task(data, tasks=["niah_single_1"], samples=1)
    (s,) = t.samples(tok)
    t._templated = True
    make, _, _ = t._maker(tok, "niah_single_1", LENGTH, 0, t.seed)
    n = s.extra["haystack_units"]
    over = prompt_tokens(tok, *render(tok, make(n + 1), True))
    assert over > _budget("niah_single_1", LENGTH) >= s.extra["actual_tokens"]


def test_lengths_scale_and_too_short_is_an_error(tok, data):
    t = make_task(data, tasks=["niah_single_1", "vt"], lengths=[900, 1800], samples=1)
    got = {(s.dataset, s.extra["ruler_length"]): s.extra["actual_tokens"] for s in t.samples(tok)}
    for (task, length), actual in got.items():
        assert _budget(task, length) - 64 <= actual <= _budget(task, length)
    with pytest.raises(ValueError, match="too small for niah_single_1"):
        list(make_task(data, tasks=["niah_single_1"], lengths=[150]).samples(tok))


def test_cwe_repeats_at_4096_and_above():
    p = common_words(TASKS["cwe"].args, random.Random(0), 50, seed=1, length=4096)
    items = re.findall(r"\d+\. (\S+)", p.head)
    assert all(items.count(w) == 30 for w in p.outputs)
    assert sorted({items.count(w) for w in set(items) - set(p.outputs)}) == [3]
    # the one-shot example: 40 words, 10 common ones x10, 30 x3, then its answers after the prefix
    example_items = re.findall(r"\d+\. (\S+)", p.shots[0][0])
    assert len(example_items) == 10 * 10 + 30 * 3
    assert p.shots[0][1].startswith(p.answer_prefix + " 1. ")  # RULER_COMMIT: a space before them


# ------------------------------------------------------------------------------------ chat template
def test_answer_prefix_follows_the_assistant_marker_and_bos_appears_once(bos_tok, data):
    (s,) = make_task(data, tasks=["niah_single_1"], samples=1).samples(bos_tok)
    ap = " The special magic number for "
    assert ap in s.question and s.question.index("<|im_start|>assistant\n") < s.question.index(ap)
    assert s.question.endswith("mentioned in the provided text is")
    assert not s.context.startswith("<s>")  # the tokenizer adds it

    head, tail = encode_prompt(bos_tok, s.context, s.question, chat_template=False)
    ids = head + tail
    assert ids.count(bos_tok.bos_token_id) == 1 and ids[0] == bos_tok.bos_token_id


def test_without_chat_template_the_prompt_is_rulers_base_text(tok, data):
    (s,) = make_task(data, tasks=["niah_single_1"], samples=1, chat_template=False).samples(tok)
    assert s.prompt.startswith("A special magic number is hidden within the following text.")
    assert s.question.startswith("\nWhat is the special magic number for ")
    assert re.search(r"\? The special magic number for [\w-]+ mentioned in the provided text is$", s.question)
    assert "<|im_start|>" not in s.prompt


def test_vt_in_context_example_comes_first_with_names_and_value_redrawn_per_sample(tok, data):
    samples = list(make_task(data, tasks=["vt"], samples=2, chat_template=False).samples(tok))
    names, values = [], []
    for s in samples:
        first = s.prompt.split("Memorize and track the chain(s)")[1]
        # RULER_COMMIT: the example's input (its prefix ends with a space), " ", its answers, "\n" + "\n"
        m = re.search(r"they are:  ((?:[A-Z]{3} ){4}[A-Z]{3})\n\n$", first)
        assert m, first[-80:]
        names.append(m.group(1).split())
        assert all(f"VAR {v} = " in first for v in names[-1])
        values.append(re.search(rf"VAR {names[-1][0]} = (\d+)", first).group(1))
        assert values[-1] != "12345" and f"assigned the value {values[-1]}" in first
        assert s.prompt.endswith("they are: ") and "5 variables" in s.question
    # RULER's randomize_icl: new names and a new value for every sample
    assert names[0] != names[1] and values[0] != values[1]


# --------------------------------------------------------------------------------- pre-generated files
def _record(i: int, task: str = "niah_single_1") -> dict:
    body = (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        f"I will quiz you about the number afterwards.\nThe grass is green. One of the special magic "
        f"numbers for key-{i} is: {1000000 + i}.\nWhat is the special magic number for key-{i} mentioned "
        "in the provided text?"
    )
    prefix = f" The special magic number for key-{i} mentioned in the provided text is"
    return {"index": i, "input": body + prefix, "outputs": [str(1000000 + i)], "length": 3000 + i}


def _write(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.mark.parametrize("layout", ["ruler", "flat"])
def test_pregenerated_files_run_as_is(layout, tok, tmp_path):
    records = [_record(i) for i in range(3)]
    if layout == "ruler":
        _write(tmp_path / "4096" / "data" / "niah_single_1" / "validation.jsonl", records)
        _write(tmp_path / "8192" / "data" / "niah_single_1" / "validation.jsonl", records[:1])
    else:
        _write(tmp_path / "niah_single_1.jsonl", records)
    t = RulerTask(data_dir=str(tmp_path), lengths=[4096], samples=2, chat_template=False)
    assert t.num_samples() == 2
    both = RulerTask(data_dir=str(tmp_path), lengths=[4096, 8192], samples=5)
    assert both.num_samples() == (3 + 1 if layout == "ruler" else 3)  # flat: lengths from the records
    samples = list(t.samples(tok))
    assert [s.prompt for s in samples] == [r["input"] for r in records[:2]]  # RULER's input, unchanged
    assert [s.answers for s in samples] == [r["outputs"] for r in records[:2]]
    assert all(s.question.endswith("mentioned in the provided text is") for s in samples)
    assert all(s.question.startswith("\nWhat is the special magic number") for s in samples)
    assert [s.extra["ruler_length"] for s in samples] == [4096, 4096]
    assert [s.length for s in samples] == [3000, 3001]  # the records' own length field
    assert all(re.fullmatch(r"niah_single_1-4096-\d-[0-9a-f]{8}", s.sample_id) for s in samples)
    assert t.score(samples[0], "It is 1000000.") == 1.0 and t.score(samples[0], "1000001") == 0.0

    # with a chat template the answer prefix moves after the assistant marker, the rest is the user turn
    (s, *_) = RulerTask(data_dir=str(tmp_path), lengths=[4096], samples=1).samples(tok)
    prefix = " The special magic number for key-0 mentioned in the provided text is"
    assert records[0]["input"].endswith(prefix)
    assert s.question.endswith("?<|im_end|>\n<|im_start|>assistant\n" + prefix)
    assert (
        s.prompt.replace("<|im_start|>user\n", "").replace("<|im_end|>\n<|im_start|>assistant\n", "")
        == (records[0]["input"])
    )


def test_pregenerated_layout_lengths_and_errors(tok, tmp_path):
    _write(tmp_path / "4096" / "data" / "niah_single_1" / "validation.jsonl", [_record(0)])
    _write(tmp_path / "8192" / "data" / "vt" / "validation.jsonl", [_record(0)])
    found = find_pregenerated(tmp_path)
    assert {t: sorted(v) for t, v in found.items()} == {"niah_single_1": [4096], "vt": [8192]}
    with pytest.raises(ValueError, match=r"vt.*no file for length\(s\) \[4096\]; it has lengths \[8192\]"):
        _ = RulerTask(data_dir=str(tmp_path), lengths=[4096]).plan
    with pytest.raises(ValueError, match="no file in data_dir"):
        _ = RulerTask(data_dir=str(tmp_path), tasks=["cwe"], lengths=[4096]).plan
    bad = tmp_path / "bad"
    _write(
        bad / "niah_single_1.jsonl", [{"index": 0, "input": "no prefix here", "outputs": ["1"], "length": 9}]
    )
    with pytest.raises(ValueError, match="answer prefix"):
        list(RulerTask(data_dir=str(bad)).samples(tok))
    _write(bad / "niah_single_1.jsonl", [{"index": 0, "outputs": ["1"]}])
    with pytest.raises(ValueError, match="niah_single_1.jsonl:1: not a RULER record"):
        RulerTask(data_dir=str(bad)).num_samples()


def test_split_input_uses_a_records_answer_prefix():
    fam = FAMILIES["qa"]
    p = split_input("Docs...\n\nAnswer the question based on the given documents. Q?", fam, " Answer:")
    assert (p.head, p.tail, p.answer_prefix) == (
        "Docs...",
        "\n\nAnswer the question based on the given documents. Q?",
        " Answer:",
    )


# ---------------------------------------------------------------------------------- metrics, config
def test_rulers_metrics():
    assert string_match_all("Answer: ABC and def", ["abc", "DEF", "x"]) == pytest.approx(2 / 3)
    assert string_match_part("It is Paris.", ["paris", "Lyon"]) == 1.0
    assert string_match_part("It is Rome.", ["paris", "Lyon"]) == 0.0


def test_qa_left_out_without_sources_with_one_line(caplog, tok):
    with caplog.at_level(logging.WARNING, logger="eval.tasks.ruler"):
        t = RulerTask(lengths=[LENGTH], samples=1, haystack="noise")
        tasks = {task for task, _, _ in t.plan}
    assert tasks == set(SYNTHETIC)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "qa_1, qa_2 left out" in lines[0]
    with pytest.raises(ValueError, match="qa_1.*squad.json"):
        _ = RulerTask(tasks=["qa_1"]).plan


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"samples": 0}, "samples must be a positive integer"),
        ({"lengths": [0]}, "lengths must be positive"),
        ({"tasks": ["niah_single_9x"]}, None),
        ({"tasks": ["bogus"]}, "unknown RULER task"),
        ({"haystack": "hay"}, "unknown haystack"),
    ],
)
def test_bad_arguments(kw, match):
    if match is None:  # a RULER variant name is accepted (its family is niah)
        RulerTask(**kw)
        return
    with pytest.raises(ValueError, match=match):
        RulerTask(**kw)


def test_config_composes_and_builds():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["task=ruler", "task.lengths=[1024,2048]", "task.samples=3", "task.tasks=[vt,cwe]"],
        )
    spec = RunSpec.from_config(cfg)
    task = spec.task
    assert isinstance(task, RulerTask) and (spec.shard, spec.num_shards) == (0, 1)
    assert (task.tasks, task.lengths, task.n_samples, task.seed) == (["vt", "cwe"], [1024, 2048], 3, cfg.seed)
    assert task.haystack is None and task.data_dir is None and task.chat_template is True


# ---------------------------------------------------------------------------------- end to end, report
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-ruler", tok, max_positions=4096)


def test_run_end_to_end_rows_and_report(tiny_dir, data, tmp_path):
    results = tmp_path / "runs"
    overrides = [
        f"model.name={tiny_dir}",
        "budget=64",
        f"results_dir={results}",
        "progress=false",
        "report=false",
        "task=ruler",
        "task.tasks=[niah_single_1,niah_multikey_3,vt,fwe,qa_2]",
        "task.lengths=[1024]",
        "task.samples=1",
        f"task.data_dir={data['qa']}",
    ]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    runner.run(cfg)
    df = ResultStore.load_dir(results)
    assert sorted(df["ruler_task"]) == sorted(["niah_single_1", "niah_multikey_3", "vt", "fwe", "qa_2"])
    assert set(df["status"]) == {"ok"}, df["error"].tolist()
    assert set(df["ruler_length"]) == {1024} and set(df["task"]) == {"ruler"}
    assert (df["input_tokens"] == df["actual_tokens"]).all()  # the measured length is what ran
    assert (df["task_seed"] == df["seed"]).all()  # the generator seed (task.seed = ${seed}) is a row field
    assert set(df["dataset"]) == set(df["ruler_task"])

    assert build_report(results).plots
    report = (results / "report.md").read_text()
    assert "## RULER" in report and "suite average" in report and "| niah_single_1 |" in report
    assert list(results.glob("ruler_*.png"))


def _report_df(rows):
    """Result rows -> the prepared frame the report reads (every store field present)."""
    return prepare(pd.DataFrame([{**dict.fromkeys(ROW_FIELDS), **r} for r in rows]))


def _ruler_row(task, length, score, method="full", params=None, index=0):
    """One ok RULER result row of sample `index` of `task` at `length` (one hash per method)."""
    return {
        "sample_id": f"{task}-{length}-{index}", "task": "ruler", "dataset": task, "model": "m",
        "method": method, "method_params": params or {}, "query_aware": True, "status": "ok",
        "score": score, "scores": {}, "method_hash": method, "ruler_task": task,
        "ruler_length": length, "context_length": None, "depth_percent": None,
    }  # fmt: skip


def test_report_suite_average_and_dagger():
    row = _ruler_row

    rows = [
        row("niah_single_1", 4096, 1.0),
        row("vt", 4096, 0.5),
        row("niah_single_1", 8192, 0.0),
        row("vt", 8192, 0.5),
    ]
    rows += [row("niah_single_1", 4096, 0.2, "snapkv", {"budget": 128})]
    df = _report_df(rows)
    md = "\n\n".join(ruler_tables(df, column_order))
    assert "| full | 75.00 (2) | 25.00 (2) | 50.00 |" in md  # suite averages per length (n), their mean
    assert "| snapkv b=128 | 20.00† (1) |" in md  # vt missing at 4096
    assert "| **Average** | 75.00 (2) | 25.00 (2) | 50.00 |" in md
    assert "‡" not in md  # equal n at both lengths: the mean needs no warning

    # A third sample at 4096 only: the lengths rest on different n, and the avg says so.
    df = _report_df(rows + [row("vt", 4096, 1.0, index=1)])
    md = "\n\n".join(ruler_tables(df, column_order))
    assert "| full | 87.50 (3) | 25.00 (2) | 56.25‡ |" in md
    assert "| vt | 75.00 (2) | 50.00 (1) | 62.50‡ |" in md
    assert "different numbers of samples (3 at 4096, 2 at 8192)" in md


def test_paired_differences_are_on_shared_samples_with_a_stratified_bootstrap():
    def row(task, i, score, method="full", params=None):
        return _ruler_row(task, 4096, score, method, params, index=i)

    full = {("niah_single_1", i): 1.0 for i in range(4)} | {
        ("vt", i): [0.0, 1.0, 0.5, 0.5][i] for i in range(4)
    }
    snap = {("niah_single_1", i): [1.0, 0.0, 1.0, 0.0][i] for i in range(4)} | {
        ("vt", i): 0.5 for i in range(3)
    }
    rows = [row(t, i, v) for (t, i), v in full.items()]
    rows += [row(t, i, v, "snapkv", {"budget": 64}) for (t, i), v in snap.items()]  # vt sample 3 missing
    rows += [row(t, i, v, "streamingllm", {"budget": 64}) for (t, i), v in full.items()]  # same as full
    df = _report_df(rows)
    labels = column_order(df)
    got = {(a, b): rest for a, b, *rest in paired_differences(df, [(x, labels[0]) for x in labels[1:]])}
    # snapkv - full on the 7 shared samples: niah 2/4 - 4/4 = -0.5; vt mean(0.5-0, 0.5-1, 0.5-0.5) = 0
    length, n, fewest, diff, interval, p = got[("snapkv b=64", "full")]
    assert (length, n, fewest) == (4096, 7, 3) and diff == pytest.approx(100 * (-0.5 + 0.0) / 2)
    # 3 vt samples: resampling within the task is degenerate
    assert interval == "n<5 per task" and math.isnan(p)
    assert got[("streamingllm b=64", "full")][1:5] == [8, 4, 0.0, "n<5 per task"]
    md = "\n\n".join(ruler_tables(df, column_order))
    assert (
        "paired differences" in md
        and "| snapkv b=64 | streamingllm b=64 | 4096 | 7 | 3 | -25.00 | n<5 per task | — | — |" in md
    )

    # Six samples per task: the interval is given, and the bootstrap's seed is fixed.
    more = [row(t, i, v) for (t, _), v in full.items() for i in range(4, 6)]
    more += [row(t, i, 1.0 - v, "snapkv", {"budget": 64}) for (t, _), v in full.items() for i in range(4, 6)]
    more += [row(t, i, v, "snapkv", {"budget": 64}) for (t, i), v in full.items() if (t, i) == ("vt", 3)]
    df = _report_df(rows + more)
    labels = column_order(df)
    got = {(a, b): rest for a, b, *rest in paired_differences(df, [(x, labels[0]) for x in labels[1:]])}
    length, n, fewest, diff, interval, p = got[("snapkv b=64", "full")]
    assert (n, fewest) == (12, 6)
    lo, hi = (float(x) for x in interval.strip("[]").split(","))
    assert lo <= diff <= hi and lo < hi
    assert 0 < p <= 1  # the bootstrap's p beside the interval
    assert got[("streamingllm b=64", "full")][1:5] == [8, 4, 0.0, "n<5 per task"]  # it ran 4 per task
    again = paired_differences(df, [("snapkv b=64", "full")])
    assert again[0][2:] == [4096, 12, 6, diff, interval, p]  # fixed seed: the report rebuilds the same


def test_compare_figure_puts_every_config_beside_the_full_cache(tmp_path):
    def row(i, task, score, method, params):
        return {**dict.fromkeys(ROW_FIELDS), "sample_id": f"{task}-{i}", "task": "ruler", "dataset": task,
                "model": "m", "method": method, "method_params": params, "query_aware": True,
                "status": "ok", "score": score, "scores": {}, "method_hash": method,
                "ruler_task": task, "ruler_length": 4096}  # fmt: skip

    rows = [row(i, t, 1.0, "full", {}) for i in range(2) for t in ("niah_single_1", "vt")]
    rows += [row(i, "niah_single_1", 0.5 * i, "snapkv", {"budget": 128}) for i in range(2)]  # no vt
    rows += [row(0, t, 0.0, "h2o", {"budget": 128}) for t in ("niah_single_1", "vt")]
    df = prepare(pd.DataFrame(rows))
    labels = column_order(df)
    assert labels[0] == "full"
    fig = ruler_compare_figure(ruler_means(df), labels, "t")
    (ax,) = [a for a in fig.axes if a.get_title()]
    grid = ax.get_images()[0].get_array()
    assert [t.get_text() for t in ax.get_yticklabels()] == ["niah_single_1", "vt", "average"]
    assert [t.get_text().split("\n")[-1] for t in ax.get_xticklabels()] == ["(n=4)", "(n=2)", "(n=2)"]
    snap = labels.index("snapkv b=128")
    assert grid[0, 0] == 100 and grid[0, snap] == 25 and grid.mask[1, snap]  # missing cell grey
    assert grid.mask[2, snap] and grid[2, labels.index("h2o b=128")] == 0  # no average over a gap
    (path,) = ruler_compare(df, tmp_path, column_order)
    assert path.name == "ruler_compare_m.png" and path.read_bytes()[:4] == b"\x89PNG"
    assert ruler_compare(df[df["method"] == "full"], tmp_path, column_order) == []  # nothing beside it


def test_haystack_setting(tok, data):
    assert RulerTask()._niah_haystack("niah_single_1") == ("repeat", None)  # RULER: noise
    assert RulerTask()._niah_haystack("niah_single_2") == ("essay", "paul_graham")
    assert RulerTask()._niah_haystack("niah_multikey_2") == ("needle", None)
    assert RulerTask(haystack="noise")._niah_haystack("niah_multivalue") == ("repeat", None)
    assert RulerTask(haystack="noise")._niah_haystack("niah_multikey_3") == ("needle", None)  # its task
    essays = f"dir:{data['essays']}"
    assert RulerTask(haystack=essays)._niah_haystack("niah_single_1") == ("essay", essays)
    (s,) = RulerTask(tasks=["niah_single_2"], lengths=[LENGTH], samples=1, haystack="noise").samples(tok)
    lines = s.context.split("afterwards.\n", 1)[1].split("\n")  # RULER's repeat haystack: one per line
    needles = [x for x in lines if x.startswith("One of the special magic numbers for ")]
    assert len(needles) == 1 and set(lines) - set(needles) == {hs.NOISE_TEXT}
    assert s.extra["haystack"] == "noise"


@pytest.mark.parametrize("task", SYNTHETIC)
def test_query_agnostic_split_context_then_question(task, tok, data):
    """`context` ends with the haystack; `question` is the template's question, then the answer prefix."""
    (s,) = make_task(data, tasks=[task], samples=1, chat_template=False).samples(tok)
    fam = family_of(task)
    suffix = fam.question_suffix.split("{", 1)[0]
    assert s.question.startswith((suffix, suffix.replace(" are all", " is")))
    assert fam.question_markers[0].split()[0] not in s.context.rsplit("\n", 2)[-1]


# ------------------------------------------------------------------------ seeds, RULER_COMMIT, growth
def test_seeds_one_context_per_index_and_seed(tok, data):
    default = list(make_task(data, tasks=["niah_single_1", "vt"], samples=1).samples(tok))
    task = make_task(data, tasks=["niah_single_1", "vt"], samples=1, seeds=[42, 7])
    assert task.num_samples() == 4
    both = list(task.samples(tok))
    assert [s.sample_id for s in both] == [
        f"niah_single_1-{LENGTH}-0",
        f"niah_single_1-{LENGTH}-0-seed7",
        f"vt-{LENGTH}-0",
        f"vt-{LENGTH}-0-seed7",
    ]
    assert [s.extra["task_seed"] for s in both] == [42, 7, 42, 7]
    assert [(s.sample_id, s.prompt, s.answers) for s in both[::2]] == [
        (s.sample_id, s.prompt, s.answers) for s in default
    ]
    alone7 = list(make_task(data, tasks=["niah_single_1", "vt"], samples=1, seed=7).samples(tok))
    assert [(s.prompt, s.answers) for s in both[1::2]] == [(s.prompt, s.answers) for s in alone7]
    assert all(a.prompt != b.prompt for a, b in zip(both[::2], both[1::2]))


def test_vt_statements_and_noise_on_lines_of_their_own(tok, data):
    """RULER_COMMIT's variable_tracking.py: the haystack is the noise paragraphs and the assignments,
    joined by newlines."""
    (s,) = make_task(data, tasks=["vt"], samples=1, chat_template=False).samples(tok)
    haystack = s.context.rsplit("hidden in the following text.\n\n", 1)[1].rstrip("\n")
    lines = haystack.split("\n")
    statements = [x for x in lines if x != hs.NOISE_TEXT]
    assert len(statements) == 5 and len(lines) == s.extra["haystack_units"] + 5
    assert re.fullmatch(r"VAR [A-Z]{5} = \d{5}", statements[0])
    assert all(re.fullmatch(r"VAR [A-Z]{5} = VAR [A-Z]{5} ", x) for x in statements[1:])


def test_fwe_is_sized_to_length_minus_generation(tok, data):
    """RULER_COMMIT's freq_words_extraction.py sizes the prompt to L - tokens_to_generate (and its
    vocabulary to (L - tokens_to_generate) // 50); the paper-era script to L."""
    ttg = FAMILIES["freq_words_extraction"].tokens_to_generate
    assert make_task(data)._budget("fwe", LENGTH) == LENGTH - ttg
    assert make_task(data, haystack_growth="paper")._budget("fwe", LENGTH) == LENGTH
    (s,) = make_task(data, tasks=["fwe"], samples=1).samples(tok)
    assert s.extra["actual_tokens"] + ttg == s.length <= LENGTH
    assert LENGTH - ttg - s.extra["actual_tokens"] <= 64  # filled to L - ttg, not short of it

    # the vocabulary: (L - ttg) // 50 = 19 words at 1024 tokens, L // 50 = 20 in the paper era
    def vocabulary(target: int) -> int:  # every rank occurs at 20000 words; rank 1 is "..."
        p = freq_words(TASKS["fwe"].args, random.Random(0), 20000, seed=1, length=target)
        return len(set(p.head.rsplit("coded words. ", 1)[1].split()))

    assert vocabulary(LENGTH - ttg) == (LENGTH - ttg) // 50 == 19 and vocabulary(LENGTH) == 20


def test_paper_growth_steps_and_stops_short(tok, data):
    """Paper-era sizing: from one step up in RULER's steps (noise lines: 5 below 4096 tokens, else 25;
    essay words: 500; vt: 10; fwe: L // 6 coded words in steps of L // 32) while the prompt fits."""
    assert paper_steps("niah", "repeat", 4096) == (25, 25) and paper_steps("niah", "needle", 2048) == (5, 5)
    assert paper_steps("niah", "essay", 1024) == (500, 500) and paper_steps("qa", None, 8192) == (10, 10)
    kw = dict(tasks=["niah_single_1", "vt", "fwe"], samples=1, haystack="noise")
    fill = {s.dataset: s for s in make_task(data, **kw).samples(tok)}
    paper = make_task(data, **kw, haystack_growth="paper")
    paper._templated = True
    got = {s.dataset: s for s in paper.samples(tok)}
    fwe_start, fwe_step = LENGTH // 6, LENGTH // 32
    for task, (start, step) in {
        "niah_single_1": (5, 5),
        "vt": (10, 10),
        "fwe": (fwe_start, fwe_step),
    }.items():
        s, n = got[task], got[task].extra["haystack_units"]
        assert (n - start) % step == 0 and n >= start, (task, n)
        make, _, _ = paper._maker(tok, task, LENGTH, 0, 42)
        assert prompt_tokens(tok, *render(tok, make(n), True)) == s.extra["actual_tokens"]
        # the next step overflows; fill packs at least as much into the same budget (fwe's differs)
        assert prompt_tokens(tok, *render(tok, make(n + step), True)) > paper._budget(task, LENGTH)
        assert task == "fwe" or fill[task].extra["haystack_units"] >= n
    assert got["fwe"].extra["actual_tokens"] > LENGTH - FAMILIES["freq_words_extraction"].tokens_to_generate
    with pytest.raises(ValueError, match="unknown RULER haystack_growth 'steps'; known: fill, paper"):
        RulerTask(haystack_growth="steps")


def test_paper_growth_never_repeats_the_essay(tok, data):
    words = len(essay_words(PROSE))
    kw = dict(tasks=["niah_single_2"], lengths=[2048], samples=1)
    (paper,) = make_task(data, **kw, haystack_growth="paper").samples(tok)
    (fill,) = make_task(data, **kw).samples(tok)
    assert paper.extra["haystack_units"] == words < fill.extra["haystack_units"]  # RULER now repeats it


def test_generator_version_and_growth_enter_the_hash():
    def spec(*overrides):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return RunSpec.from_config(
                compose("config", overrides=["model.name=/tmp/tiny", "task=ruler", *overrides])
            )

    default = spec()
    assert default.method_hash != "5a724f25"  # the default config under the generator before RULER_COMMIT
    assert spec("task.haystack_growth=paper").method_hash != default.method_hash
    assert spec("task.seeds=[42,1]").method_hash == default.method_hash
    assert (
        re.fullmatch(r"[0-9a-f]{40}", RULER_COMMIT)
        and RULER_COMMIT in (ROOT / "docs" / "tasks.md").read_text()
    )


def test_suite_average_names_the_tasks_it_covers():
    qa_less = [t for t in TASKS if t not in ("qa_1", "qa_2")]
    md = "\n\n".join(ruler_tables(_report_df([_ruler_row(t, 4096, 1.0) for t in qa_less]), column_order))
    assert "in brackets, over 11 of 13 tasks (qa_1/qa_2 need SQuAD/HotpotQA in task.data_dir)." in md
    md = "\n\n".join(
        ruler_tables(_report_df([_ruler_row(t, 4096, 1.0) for t in [*qa_less, "qa_2"]]), column_order)
    )
    assert "over 12 of 13 tasks (qa_1 needs SQuAD in task.data_dir)." in md
    md = "\n\n".join(
        ruler_tables(_report_df([_ruler_row(t, 4096, 1.0) for t in ("vt", "cwe")]), column_order)
    )
    assert "over 2 of 13 tasks." in md  # not only the QA tasks missing: no reason given
    md = "\n\n".join(ruler_tables(_report_df([_ruler_row(t, 4096, 1.0) for t in TASKS]), column_order))
    assert "of 13 tasks" not in md
