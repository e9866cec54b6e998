"""task=longbench_v2: LongBench-v2's answer extraction and result.py's aggregation against the
original code's outputs, its prompt and middle truncation, local data files, the refusals, and a run
plus report on a tiny model. The Hub path runs against the Hub look-alike in
tests/e2e/test_longbench_v2_hub.py.

Offline: a byte-level BPE tokenizer trained in code with a ChatML-like template; data files are
written to tmp_path.
"""

from __future__ import annotations

import json
import re

import pandas as pd
import pytest
from conftest import CHATML, byte_level_bpe, save_tiny_llama
from hub_tasks import (
    assert_offline_refusal,
    compose_cfg,
    run_cli,
    write_jsonl,
    write_parquet,
)

from eval.spec import RunSpec
from eval.tasks import build_task
from eval.tasks.longbench_v2 import metrics
from eval.tasks.longbench_v2.report import LongBenchV2Report
from eval.tasks.longbench_v2.task import LongBenchV2Task, truncate_middle

WORDS = " ".join(f"line {i} of the book tells of gardens and rivers." for i in range(60))


def record(i: int, difficulty: str = "easy", length: str = "short", answer: str = "B", **kw) -> dict:
    return {
        "_id": f"id{i}",
        "domain": "Single-Document QA",
        "sub_domain": "Literary",
        "difficulty": difficulty,
        "length": length,
        "question": f" Where do the rivers of book {i} run? ",
        "choice_A": "gardens",
        "choice_B": " rivers ",
        "choice_C": "hills",
        "choice_D": "sea",
        "answer": answer,
        "context": f"\n{WORDS}\n",
        **kw,
    }


RECORDS = [
    record(0),
    record(1, "hard", "medium", "A"),
    record(2, "easy", "long", "D"),
    record(3, "hard", "short", "C"),
]


@pytest.fixture(scope="module")
def tok():
    corpus = [WORDS, json.dumps(RECORDS)] + ["The correct answer is (A). What is the correct answer"] * 3
    return byte_level_bpe(
        corpus, 600, ["<s>", "<|im_start|>", "<|im_end|>"], bos="<s>", add_bos=True, chat_template=CHATML
    )


# ------------------------------------------------------------------------------------------ metrics
# Each response with the letter LongBench-v2's pred.py `extract_answer` returns for it (run on the
# original code, THUDM/LongBench main).
EXTRACTED = [
    ("The correct answer is (B)", "B"),
    ("The correct answer is C.", "C"),
    ("**The correct answer is (D)**", "D"),
    ("The correct answer is **(A)**", "A"),
    ("The correct *answer* is (D)", "D"),
    ("the correct answer is (A)", None),
    ("The correct answer is (E)", None),
    ("The correct answer is (a)", None),
    ("The correct answer is B, not C. Wait: The correct answer is (C)", "C"),
    ("I think (A). The correct answer is (B).", "B"),
    ("The correct answer is Both", "B"),
    ("", None),
    ("The correct answer is: (A)", None),
    ("The correct answer is (A) or (B)", "A"),
    ("The correct answer is  (A)", None),
    ("The correct answer is (A", None),
    ("Answer: (C)", None),
]


@pytest.mark.parametrize("response, letter", EXTRACTED, ids=lambda v: repr(v)[:30])
def test_extract_answer_matches_pred_py(response, letter):
    assert metrics.extract_answer(response) == letter
    assert metrics.judge(response, "B") == (letter == "B")


# (difficulty, length, response, answer); result.py on these predictions (as pred.py writes them)
# prints 55.6 50.0 60.0 33.3 66.7 66.7, and 61.1 50.0 70.0 41.7 66.7 75.0 with compensated = True.
PREDICTIONS = [
    ("easy", "short", "The correct answer is (A)", "A"),
    ("easy", "short", "The correct answer is (B)", "A"),
    ("hard", "short", "nothing", "C"),
    ("hard", "medium", "The correct answer is D", "D"),
    ("easy", "medium", "The correct answer is (C)", "B"),
    ("hard", "long", "The correct answer is (B)", "B"),
    ("hard", "long", "no answer", "A"),
    ("easy", "long", "The correct answer is (A)", "A"),
    ("hard", "medium", "The correct answer is (A)", "A"),
]
RESULT_PY = dict(zip(metrics.COLUMNS, (55.6, 50.0, 60.0, 33.3, 66.7, 66.7), strict=True))
RESULT_PY_COMPENSATED = dict(zip(metrics.COLUMNS, (61.1, 50.0, 70.0, 41.7, 66.7, 75.0), strict=True))


def _scored(tok) -> list[tuple[str, str, float, dict]]:
    """The predictions scored through the task: (difficulty, length, score, scores)."""
    task = LongBenchV2Task(max_prompt_tokens=100000)
    out = []
    for i, (difficulty, length, response, answer) in enumerate(PREDICTIONS):
        sample = task.make_sample(record(i, difficulty, length, answer), tok)
        out.append((difficulty, length, task.score(sample, response), task.score_all(sample, response)))
    return out


def test_scores_aggregate_as_result_py(tok):
    scored = _scored(tok)
    assert metrics.summarize((d, n, s) for d, n, s, _ in scored) == RESULT_PY
    compensated = metrics.summarize((d, n, all_["compensated"]) for d, n, _, all_ in scored)
    assert compensated == RESULT_PY_COMPENSATED
    assert [all_["answered"] for *_, all_ in scored] == [1, 1, 0, 1, 1, 1, 0, 1, 1]


def test_summarize_counts_unknown_values_as_result_py_does():
    # result.py: every difficulty but "easy" is hard, every length but short / medium is long.
    summary = metrics.summarize([("easy", "short", 1.0), ("?", "?", 0.0)])
    assert summary == {
        "Overall": 50.0,
        "Easy": 100.0,
        "Hard": 0.0,
        "Short": 100.0,
        "Medium": None,
        "Long": 0.0,
    }


def test_report_table_is_result_py(tok):
    rows = []
    for label, method, budget in (("full", "full", None), ("snapkv b=64", "snapkv", 64)):
        for i, (difficulty, length, score, scores) in enumerate(_scored(tok)):
            rows.append(
                dict(task="longbench_v2", model="m", config_label=label, method=method, budget=budget,
                     ok=True, sample_id=f"id{i}", difficulty=difficulty, length=length,
                     score=score if method == "full" else 0.0, scores=scores)
            )  # fmt: skip
    (table,) = LongBenchV2Report.tables(pd.DataFrame(rows))
    lines = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in table.splitlines()[4:]
    }
    for column in metrics.COLUMNS:
        assert lines[column] == [f"{RESULT_PY[column]:.1f}", "0.0"], column
    assert lines["samples"] == ["9", "9"] and lines["answered (%)"] == ["77.8", "77.8"]
    assert table.startswith("### longbench_v2 — m")


# ------------------------------------------------------------------------------------------ prompt
def test_prompt_is_pred_py_0shot(tok):
    sample = LongBenchV2Task(max_prompt_tokens=100000).make_sample(RECORDS[1], tok)
    expected = (
        "Please read the following text and answer the question below.\n\n<text>\n"
        + WORDS
        + "\n</text>\n\nWhat is the correct answer to this question: Where do the rivers of book 1 run?\n"
        "Choices:\n(A) gardens\n(B) rivers\n(C) hills\n(D) sea\n\n"
        'Format your response as follows: "The correct answer is (insert answer here)".'
    )
    assert sample.prompt == expected
    assert sample.context.endswith(WORDS) and sample.question.startswith("\n</text>\n\nWhat is")
    assert sample.sample_id == "id1" and sample.answers == ["A"] and sample.max_new_tokens == 128
    assert sample.chat_template and sample.dataset == "longbench_v2"
    assert sample.extra == {
        "difficulty": "hard", "length": "medium", "domain": "Single-Document QA", "sub_domain": "Literary",
        "prompt_tokens": len(tok.encode(expected)), "truncated": False,
    }  # fmt: skip


def test_placeholders_are_replaced_in_turn_over_the_whole_text(tok):
    # pred.py replaces $DOC$ first, then $Q$ everywhere: a document quoting "$Q$" gets the question.
    rec = record(0, context="see $Q$ here")
    sample = LongBenchV2Task(max_prompt_tokens=100000).make_sample(rec, tok)
    assert "see Where do the rivers of book 0 run? here" in sample.context


@pytest.mark.parametrize("budget", [41, 301, 400])
def test_middle_truncation_as_pred_py(tok, budget):
    task = LongBenchV2Task(max_prompt_tokens=budget)
    sample = task.make_sample(RECORDS[0], tok)
    ids = tok.encode(LongBenchV2Task(max_prompt_tokens=100000).make_sample(RECORDS[0], tok).prompt)
    assert ids[0] == tok.bos_token_id
    assert sample.extra["prompt_tokens"] == len(ids) > budget and sample.extra["truncated"]
    head, tail = budget // 2, budget - budget // 2  # pred.py: ids[:n//2] + ids[-n//2:], n tokens in all
    kept = ids[:head] + ids[len(ids) - tail :]
    assert len(kept) == budget
    assert sample.prompt == tok.decode(kept, skip_special_tokens=True)
    assert sample.prompt == truncate_middle(tok.decode(ids[1:]), tok, budget)[0]
    assert sample.context + sample.question == sample.prompt
    if budget > 300:  # the cut leaves the question whole: it stays apart from the document
        assert sample.question.startswith("\n</text>\n\nWhat is") and sample.context.startswith("Please")
    else:  # the cut went into the question: the whole prompt is the context
        assert sample.question == ""


# ------------------------------------------------------------------------------------------ data
def test_local_layouts_and_selection(tmp_path, tok):
    (tmp_path / "hub").mkdir()
    (tmp_path / "hub" / "data.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    write_jsonl(tmp_path / "records.jsonl", RECORDS)
    write_parquet(tmp_path / "shards" / "train-0.parquet", RECORDS[:2])
    write_parquet(tmp_path / "shards" / "train-1.parquet", RECORDS[2:])
    write_parquet(tmp_path / "one.parquet", RECORDS)
    for path in ("hub", "hub/data.json", "records.jsonl", "shards", "one.parquet"):
        task = LongBenchV2Task(data_files=str(tmp_path / path))
        assert task.records() == RECORDS and task.num_samples() == 4, path
    hard = LongBenchV2Task(data_files=str(tmp_path / "hub"), difficulties=["hard"])
    assert [s.sample_id for s in hard.samples(tok)] == ["id1", "id3"]
    short = LongBenchV2Task(data_files=str(tmp_path / "hub"), lengths="short", limit=1)
    assert [r["_id"] for r in short.records()] == ["id0"]


def test_local_data_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"task.data_files=.*nowhere.*THUDM/LongBench-v2"):
        LongBenchV2Task(data_files=str(tmp_path / "nowhere")).num_samples()
    bad = write_jsonl(tmp_path / "bad.jsonl", [record(0, answer="E")])
    with pytest.raises(
        ValueError, match=r"record 0 \(id0\): answer must be one of A, B, C, D, got answer='E'"
    ):
        LongBenchV2Task(data_files=str(bad)).num_samples()
    odd = write_jsonl(tmp_path / "odd.jsonl", [record(0, length="huge")])
    with pytest.raises(ValueError, match="length must be one of short, medium, long, got length='huge'"):
        LongBenchV2Task(data_files=str(odd)).num_samples()
    partial = {k: v for k, v in record(0).items() if k != "choice_C"}
    with pytest.raises(ValueError, match="missing or not a string: choice_C"):
        LongBenchV2Task(data_files=str(write_jsonl(tmp_path / "p.jsonl", [partial]))).num_samples()
    (tmp_path / "x.json").write_text('{"a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="expected a JSON list of objects"):
        LongBenchV2Task(data_files=str(tmp_path / "x.json")).num_samples()


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"difficulties": ["medium"]}, "difficulties must be a non-empty list of easy, hard, got difficulties=['medium']"),
        ({"lengths": []}, "lengths=[]"),
        ({"limit": 0}, "limit=0"),
        ({"max_prompt_tokens": 1}, "max_prompt_tokens=1"),
        ({"chat_template": "yes"}, "chat_template='yes'"),
        ({"split": ""}, "split=''"),
    ],
)  # fmt: skip
def test_bad_values(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        LongBenchV2Task(**kw)


# ------------------------------------------------------------------------------------------ config, CLI
def test_config_builds_the_task_and_selection_keeps_the_hash():
    spec = RunSpec.from_config(compose_cfg(["task=longbench_v2"]))
    assert isinstance(spec.task, LongBenchV2Task) and spec.task.repo == "THUDM/LongBench-v2"
    fewer = RunSpec.from_config(
        compose_cfg(["task=longbench_v2", "task.lengths=[short]", "task.difficulties=[hard]", "task.limit=2"])
    )
    assert fewer.task.lengths == ["short"] and fewer.method_hash == spec.method_hash
    assert build_task("longbench_v2", lengths="long").lengths == ["long"]


def test_offline_without_data_files_exits_2_before_the_model_loads(monkeypatch, tmp_path, capsys):
    assert_offline_refusal(
        monkeypatch,
        tmp_path,
        capsys,
        "longbench_v2",
        [],
        ["LongBench-v2 could not be loaded", "THUDM/LongBench-v2"],
    )


def test_missing_local_file_and_bad_value_exit_2(monkeypatch, tmp_path, capsys):
    code, err = run_cli(
        monkeypatch, tmp_path, capsys, "longbench_v2", f"task.data_files={tmp_path / 'nowhere.json'}"
    )
    assert code == 2 and len(err) == 1 and "task.data_files=" in err[0], err
    code, err = run_cli(monkeypatch, tmp_path, capsys, "longbench_v2", "task.lengths=[huge]")
    assert code == 2 and len(err) == 1 and "lengths=['huge']" in err[0], err


# ------------------------------------------------------------------------------------------ run
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tok) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-lbv2", tok)


def test_runs_and_reports(tiny_dir, tmp_path):
    import eval.runner as runner
    from eval.report import build_report
    from eval.store import ResultStore

    data = tmp_path / "data.json"
    data.write_text(json.dumps(RECORDS[:2]), encoding="utf-8")
    results = tmp_path / "runs"
    common = [
        f"model.name={tiny_dir}", "budget=64", f"results_dir={results}", "progress=false", "report=false",
        "task=longbench_v2", f"task.data_files={data}", "task.max_prompt_tokens=300",
    ]  # fmt: skip
    for overrides in (["protocol=query_aware"], ["protocol=context_only"], ["method=full"]):
        runner.run(compose_cfg(common + overrides))
    df = ResultStore.load_dir(results)
    assert set(df["status"]) == {"ok"}, df["error"].tolist()
    assert len(df) == 6 and set(df["sample_id"]) == {"id0", "id1"}
    assert set(df["difficulty"]) == {"easy", "hard"} and set(df["length"]) == {"short", "medium"}
    assert df["truncated"].all() and (df["prompt_tokens"] > 300).all()
    for _, row in df.iterrows():  # the row's score is the extraction's verdict on its own prediction
        assert row["score"] == float(metrics.extract_answer(row["prediction"]) == row["answers"][0])
    build_report(results)
    report = (results / "report.md").read_text()
    assert "## LongBench-v2" in report and "### longbench_v2 — tiny-llama-lbv2" in report
    table = report.split("### longbench_v2 — tiny-llama-lbv2", 1)[1]
    assert "| samples | 2 | 2 | 2 |" in table.replace("  ", " ")
