"""LongBench metrics (eval.tasks.longbench.metrics) and the scorer CLI (eval.tasks.longbench.score).

The golden test re-scores real LongBench predictions of llama2-7b-chat-4k from
`<repo>/../shared/data/longbench_golden/` and must reproduce its result.json to the last digit.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from eval.tasks.longbench.metrics import (
    CATEGORIES,
    DATASET2CATEGORY,
    DATASET2METRIC,
    FIRST_LINE_DATASETS,
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    normalize_answer,
    qa_f1_score,
    retrieval_score,
    rouge_score,
    score_sample,
    scorer,
    scorer_e,
    summarize,
)
from eval.tasks.longbench.score import main

REPO = Path(__file__).resolve().parents[1]
GOLDEN = REPO.parent / "shared" / "data" / "longbench_golden" / "llama2-7b-chat-4k"

ENGLISH = [
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
]  # fmt: skip


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _cli(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "score_longbench.py"), *args],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


# --------------------------------------------------------------------------------------------------
# Golden: real predictions -> LongBench's result.json, exactly.
# --------------------------------------------------------------------------------------------------


# ROUGE-L in the `rouge` package is pure Python and slow on these two long files: the fast tier
# scores every other file in process, the slow tier these two in process and the others through the
# CLI (a fresh interpreter running scripts/score_longbench.py, the same `main`).
SLOW_GOLDEN = {"gov_report", "multi_news"}


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory):
    """Copies of the golden jsonl files but SLOW_GOLDEN, in a folder for the in-process run and one for
    the CLI's."""
    if not GOLDEN.is_dir():
        pytest.skip(f"golden LongBench predictions not found at {GOLDEN} (shared data not checked out)")
    expected = json.loads((GOLDEN / "result.json").read_text())
    in_dir = tmp_path_factory.mktemp("in_process")
    sub_dir = tmp_path_factory.mktemp("subprocess")
    for f in GOLDEN.glob("*.jsonl"):
        if f.stem not in SLOW_GOLDEN:
            shutil.copy(f, in_dir / f.name)
            shutil.copy(f, sub_dir / f.name)
    return expected, in_dir, sub_dir


def _compare(expected: dict, got: dict) -> None:
    assert sorted(got) == sorted(expected)
    diffs = {k: (expected[k], got[k]) for k in expected if got[k] != expected[k]}
    assert not diffs, f"dataset: (expected, got) {diffs}"


def _golden_in_process(expected: dict, d: Path, capsys) -> None:
    """Score the jsonl files in `d` in process: the scores are `expected`, and result.json is laid
    out as LongBench's eval.py writes it."""
    assert main([str(d)]) == 0
    got = json.loads((d / "result.json").read_text())
    _compare(expected, got)
    assert json.loads(capsys.readouterr().out) == got
    # Same layout as LongBench's eval.py: json.dump(..., ensure_ascii=False, indent=4).
    assert (d / "result.json").read_text() == json.dumps(got, ensure_ascii=False, indent=4)


def test_golden_in_process(golden, capsys):
    expected, d, _ = golden
    assert len(expected) == 8 and set(expected) <= set(DATASET2METRIC)
    assert SLOW_GOLDEN < set(expected)
    _golden_in_process({k: v for k, v in expected.items() if k not in SLOW_GOLDEN}, d, capsys)


@pytest.mark.slow
def test_golden_in_process_long_files(tmp_path, capsys):
    if not GOLDEN.is_dir():
        pytest.skip(f"golden LongBench predictions not found at {GOLDEN} (shared data not checked out)")
    for name in SLOW_GOLDEN:
        shutil.copy(GOLDEN / f"{name}.jsonl", tmp_path / f"{name}.jsonl")
    expected = json.loads((GOLDEN / "result.json").read_text())
    _golden_in_process({k: expected[k] for k in SLOW_GOLDEN}, tmp_path, capsys)


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_golden_subprocess(golden):
    expected, _, d = golden
    proc = _cli([str(d)])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    got = json.loads((d / "result.json").read_text())
    _compare({k: v for k, v in expected.items() if k not in SLOW_GOLDEN}, got)
    assert json.loads(out) == got


# --------------------------------------------------------------------------------------------------
# Tables.
# --------------------------------------------------------------------------------------------------


def test_tables_cover_the_16_english_datasets():
    assert sorted(DATASET2METRIC) == sorted(ENGLISH)
    assert sorted(DATASET2CATEGORY) == sorted(ENGLISH)
    assert set(DATASET2CATEGORY.values()) == set(CATEGORIES) and len(CATEGORIES) == 6
    assert FIRST_LINE_DATASETS == {"trec", "triviaqa", "samsum"}
    assert DATASET2METRIC["lcc"] is code_sim_score and DATASET2METRIC["repobench-p"] is code_sim_score
    assert DATASET2METRIC["trec"] is classification_score
    assert DATASET2METRIC["triviaqa"] is qa_f1_score and DATASET2METRIC["samsum"] is rouge_score
    assert DATASET2CATEGORY["passage_count"] == "synthetic"
    assert DATASET2CATEGORY["2wikimqa"] == "multi-doc QA"


# --------------------------------------------------------------------------------------------------
# Metrics.
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, normalized",
    [
        ("The  Quick, brown fox!", "quick brown fox"),
        ("An apple a day", "apple day"),
        ("theater anthem", "theater anthem"),  # articles only as whole words
        ("the-end", "theend"),  # punctuation goes first, so no article is left to drop
        ("  Paris.\n", "paris"),
        ("café — ok", "café — ok"),  # only ASCII punctuation is removed
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_qa_f1_score():
    assert qa_f1_score("The Eiffel Tower.", "eiffel tower") == 1.0
    assert qa_f1_score("the cat sat", "cat sat on mat") == pytest.approx(2 / 3)  # P=1, R=1/2
    assert qa_f1_score("cat cat", "cat") == pytest.approx(2 / 3)  # multiset overlap: P=1/2, R=1
    assert qa_f1_score("dog", "cat") == 0.0
    assert qa_f1_score("...", "cat") == 0.0  # empty after normalisation


def test_rouge_score():
    assert rouge_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0, abs=1e-7)
    # ROUGE-L F over words (no normalisation): LCS "cat on mat" = 3 of 5 and 3 of 4 words.
    assert rouge_score("a cat on the mat", "cat sat on mat") == pytest.approx(2 * 0.6 * 0.75 / 1.35, abs=1e-7)
    assert rouge_score("", "cat") == 0.0  # the package raises on an empty hypothesis
    assert rouge_score("...", "cat") == 0.0  # ... and on one that is only sentence separators
    assert rouge_score("dog", "cat") == 0.0


def test_rouge_recursion_quirk_is_pinned_to_longbench_headroom():
    """rouge 1.0.1 recurses once per LCS step; LongBench scores the RecursionError 0.0. The cut-off
    must not depend on the caller's stack depth (pytest here is dozens of frames deep)."""

    def nested(n, f):
        return f() if n == 0 else nested(n - 1, f)

    limit = sys.getrecursionlimit()
    ok = " ".join(f"w{i}" for i in range(990))
    too_long = ok + " w990"
    assert rouge_score(ok, ok) == pytest.approx(1.0, abs=1e-7)
    assert nested(150, lambda: rouge_score(too_long, too_long)) == 0.0
    assert sys.getrecursionlimit() == limit


def test_classification_score():
    classes = ["Location", "Date", "Other location", "Food"]
    assert classification_score("Type: Location", "Location", all_classes=classes) == 1.0
    assert classification_score("Date or Location", "Location", all_classes=classes) == 0.5
    assert classification_score("Food", "Location", all_classes=classes) == 0.0
    assert classification_score("no idea", "Location", all_classes=classes) == 0.0  # no difflib fallback
    # Matching is case-sensitive: "Location" is not in "Other location".
    assert classification_score("Other location", "Other location", all_classes=classes) == 1.0
    # A class that is a strict substring of the ground truth is not counted against it.
    both = ["location", "Other location"]
    assert classification_score("Other location", "Other location", all_classes=both) == 1.0
    with pytest.raises(ValueError, match="all_classes"):
        classification_score("Food", "Food", all_classes=None)


def test_classification_score_remove_while_iterating_quirk():
    # Matches, in class order: ["Other", "entity", "Other entity"]. LongBench drops "Other" (a strict
    # substring of the ground truth) and, because it mutates the list it iterates over, never looks at
    # "entity": 2 matches remain, score 1/2 (iterating over a copy would give 1.0).
    classes = ["Other", "entity", "Other entity"]
    assert classification_score("Other entity", "Other entity", all_classes=classes) == 0.5
    assert classification_score("Other entity", "Other entity", all_classes=["Other", "Other entity"]) == 1.0


def test_retrieval_score():
    assert retrieval_score("The abstract is from Paragraph 12.", "Paragraph 12") == 1.0
    assert retrieval_score("Paragraph 12 or Paragraph 3", "Paragraph 12") == 0.5
    assert retrieval_score("Paragraph 120", "Paragraph 12") == 0.0  # whole numbers only
    assert retrieval_score("I don't know", "Paragraph 12") == 0.0
    with pytest.raises(ValueError, match="Paragraph N"):
        retrieval_score("12", "12")


def test_count_score():
    assert count_score("There are 8 unique paragraphs.", "8") == 1.0
    assert count_score("Either 4 or 8", "8") == 0.5
    assert count_score("1\n2\n3\n8", "8") == 0.25
    assert count_score("eight", "8") == 0.0
    assert count_score("08", "8") == 0.0  # string comparison, as LongBench


def test_fuzz_ratio_semantics():
    assert fuzz_ratio("abc", "abc") == 100
    assert fuzz_ratio("", "") == 100  # fuzzywuzzy checks equality before emptiness
    assert fuzz_ratio("", "abc") == 0 and fuzz_ratio("abc", "") == 0
    assert isinstance(fuzz_ratio("abcd", "abce"), int)
    assert fuzz_ratio("abcd", "abce") == 75
    # Round half to even: ratios 2*1/16 and 2*3/16 give exactly 12.5 and 37.5.
    assert fuzz_ratio("abcdefgh", "aBCDEFGH") == 12
    assert fuzz_ratio("abcdefgh", "abcDEFGH") == 38
    # difflib's greedy matching blocks (fuzzywuzzy without python-Levenshtein), not the LCS/Indel
    # ratio: 2*2/7 -> 57, where python-Levenshtein / rapidfuzz give 2*3/7 -> 86.
    assert fuzz_ratio("aaa", "abaa") == 57


def test_code_sim_score_first_line_rule():
    gt = "        return x + 1"
    assert code_sim_score("\n\n        return x + 1\n    foo()", gt) == 1.0
    # Lines with a backtick, '#' or '//' are skipped; leading whitespace is kept.
    assert code_sim_score("```python\n# add one\n// c\n        return x + 1\n", gt) == 1.0
    assert code_sim_score("return x + 1", gt) == fuzz_ratio("return x + 1", gt) / 100 == 0.75
    assert code_sim_score("a = b / c", "a = b / c") == 1.0  # a single '/' is fine
    assert code_sim_score("# only\n// comments", gt) == 0.0  # nothing left: "" vs gt
    assert code_sim_score("    x = 1  # set x\n    y = 2", "    y = 2") == 1.0


def test_first_line_rule_for_trec_and_friends():
    classes = ["Location", "Date"]
    pred = "\n\nLocation\nQuestion: When was it?\nType: Date"
    assert score_sample("trec", pred, ["Location"], classes) == 1.0
    assert classification_score(pred, "Location", all_classes=classes) == 0.5  # without the rule
    assert score_sample("triviaqa", "Paris\nQuestion: capital of Italy? Answer: Rome", ["Paris"]) == 1.0
    assert score_sample("samsum", "\nTom is late.\nAnna waits.", ["Tom is late."]) == pytest.approx(1.0, 1e-7)
    # Other datasets see the whole prediction.
    assert score_sample("hotpotqa", "Paris\nRome", ["Paris"]) == pytest.approx(2 / 3)


def test_score_sample_is_max_over_answers():
    assert score_sample("narrativeqa", "the red house", ["blue car", "red house", "house"]) == 1.0
    assert score_sample("narrativeqa", "a dog", ["cat", "mouse"]) == 0.0
    assert score_sample("passage_retrieval_en", "Paragraph 3", ["Paragraph 4", "Paragraph 3"]) == 1.0


@pytest.mark.parametrize("call", [
    lambda: score_sample("nope", "a", ["a"]),
    lambda: scorer("nope", ["a"], [["a"]]),
    lambda: scorer_e("nope", ["a"], [["a"]], [1]),
    lambda: summarize({"nope": 1.0}),
])  # fmt: skip
def test_unknown_dataset_is_a_value_error(call):
    with pytest.raises(ValueError, match=r"unknown LongBench dataset 'nope'.*narrativeqa.*repobench-p"):
        call()


# --------------------------------------------------------------------------------------------------
# Scorers.
# --------------------------------------------------------------------------------------------------


def test_scorer_mean_times_100_two_decimals():
    assert scorer("passage_count", ["8", "3", "no"], [["8"], ["8"], ["8"]], None) == 33.33
    assert scorer("hotpotqa", ["a b", "c"], [["a b"], ["c"]]) == 100.0
    with pytest.raises(ValueError, match="no predictions"):
        scorer("hotpotqa", [], [])


def test_scorer_e_buckets():
    lengths = [100, 3999, 4000, 7999, 8000, 20000]
    preds = ["8", "1", "8", "8", "1", "1"]
    got = scorer_e("passage_count", preds, [["8"]] * 6, lengths, None)
    assert got == {"0-4k": 50.0, "4-8k": 100.0, "8k+": 0.0}
    assert list(got) == ["0-4k", "4-8k", "8k+"]
    empty = scorer_e("passage_count", ["8"], [["8"]], [5000], None)
    assert math.isnan(empty["0-4k"]) and empty["4-8k"] == 100.0 and math.isnan(empty["8k+"])


def test_scorer_and_scorer_e_round_like_longbench():
    # 23 right out of 160: LongBench's scorer computes round(100 * 23 / 160, 2) = round(14.375, 2) = 14.38,
    # its scorer_e round(100 * np.mean(...), 2) on 14.374999999999998 = 14.37. Both are kept.
    preds = ["8"] * 23 + ["1"] * 137
    answers = [["8"]] * 160
    assert scorer("passage_count", preds, answers, None) == 14.38
    assert scorer_e("passage_count", preds, answers, [9000] * 160, None)["8k+"] == 14.37
    # One sample scoring 107/4000 = 0.02675: Python's round(2.675, 2) gives 2.67 (2.675 is stored just
    # below), LongBench's scorer_e rounds a numpy float64 (x*100, then rint) and gets 2.68.
    pred = " ".join(["8"] * 107 + ["1"] * 3893)
    assert scorer("passage_count", [pred], [["8"]], None) == 2.67
    assert scorer_e("passage_count", [pred], [["8"]], [100], None)["0-4k"] == 2.68


def test_summarize():
    per = {"narrativeqa": 20.0, "qasper": 30.0, "hotpotqa": 40.0, "lcc": 55.55}
    got = summarize(per)
    assert got["average"] == round((20 + 30 + 40 + 55.55) / 4, 2) == 36.39
    assert got["categories"] == {"single-doc QA": 25.0, "multi-doc QA": 40.0, "code": 55.55}
    assert got["n_datasets"] == 4
    with pytest.raises(ValueError):
        summarize({})


# --------------------------------------------------------------------------------------------------
# CLI.
# --------------------------------------------------------------------------------------------------


def _write_jsonl(path: Path, records: list) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def _rec(pred: str, answers: list[str], length: int = 1000, classes: list[str] | None = None) -> dict:
    return {"pred": pred, "answers": answers, "all_classes": classes, "length": length}


def test_cli_scores_and_skips_unknown_files(tmp_path, capsys):
    _write_jsonl(tmp_path / "passage_count.jsonl", [_rec("8", ["8"]), _rec("3", ["8"])])
    classes = ["Location", "Date"]
    _write_jsonl(tmp_path / "trec.jsonl", [_rec("Date\nLocation", ["Date"], classes=classes)])
    _write_jsonl(tmp_path / "my_notes.jsonl", ["this is not even json"])
    (tmp_path / "readme.txt").write_text("ignored")
    assert main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert json.loads((tmp_path / "result.json").read_text()) == {"passage_count": 50.0, "trec": 100.0}
    assert json.loads(captured.out) == {"passage_count": 50.0, "trec": 100.0}
    assert "skipping my_notes.jsonl" in captured.err


def test_cli_e_buckets(tmp_path, capsys):
    records = [_rec("8", ["8"], 500), _rec("1", ["8"], 1500), _rec("8", ["8"], 5000), _rec("8", ["8"], 9000)]
    _write_jsonl(tmp_path / "passage_count.jsonl", records)
    assert main([str(tmp_path), "--e"]) == 0
    expected = {"passage_count": {"0-4k": 50.0, "4-8k": 100.0, "8k+": 100.0}}
    assert json.loads((tmp_path / "result.json").read_text()) == expected
    assert json.loads(capsys.readouterr().out) == expected


def _run_bad(tmp_path: Path, capsys, args: list[str] | None = None) -> str:
    assert main(args if args is not None else [str(tmp_path)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert not (tmp_path / "result.json").exists()
    return lines[0]


def test_cli_missing_dir(tmp_path, capsys):
    missing = tmp_path / "nope"
    msg = _run_bad(tmp_path, capsys, [str(missing)])
    assert str(missing) in msg and "does not exist" in msg


def test_cli_malformed_line_names_file_and_line(tmp_path, capsys):
    _write_jsonl(
        tmp_path / "hotpotqa.jsonl", [_rec("a", ["a"]), _rec("b", ["b"]), '{"pred": "c", "answers": [']
    )
    msg = _run_bad(tmp_path, capsys)
    assert "hotpotqa.jsonl:3:" in msg and "malformed JSON" in msg


def test_cli_missing_key_names_key_and_line(tmp_path, capsys):
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [_rec("a", ["a"]), {"pred": "b", "all_classes": None}])
    msg = _run_bad(tmp_path, capsys)
    assert "hotpotqa.jsonl:2:" in msg and "'answers'" in msg


def test_cli_e_needs_length(tmp_path, capsys):
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [{"pred": "a", "answers": ["a"], "all_classes": None}])
    assert main([str(tmp_path)]) == 0  # length is only needed for --e
    (tmp_path / "result.json").unlink()
    capsys.readouterr()
    msg = _run_bad(tmp_path, capsys, [str(tmp_path), "--e"])
    assert "hotpotqa.jsonl:1:" in msg and "'length'" in msg


@pytest.mark.parametrize(
    "record, fragment",
    [
        ('["a list"]', "expected a JSON object"),
        ({"pred": 3, "answers": ["a"], "all_classes": None}, "'pred' must be a string"),
        ({"pred": "a", "answers": "a", "all_classes": None}, "'answers' must be a list of strings"),
    ],
)
def test_cli_bad_types(tmp_path, capsys, record, fragment):
    _write_jsonl(tmp_path / "hotpotqa.jsonl", [record])
    msg = _run_bad(tmp_path, capsys)
    assert "hotpotqa.jsonl:1:" in msg and fragment in msg


def test_cli_metric_errors_name_the_file(tmp_path, capsys):
    _write_jsonl(tmp_path / "trec.jsonl", [_rec("Date", ["Date"], classes=None)])
    msg = _run_bad(tmp_path, capsys)
    assert "trec.jsonl" in msg and "all_classes" in msg


def test_cli_empty_inputs(tmp_path, capsys):
    msg = _run_bad(tmp_path, capsys)
    assert "no LongBench" in msg
    (tmp_path / "lcc.jsonl").write_text("\n")
    msg = _run_bad(tmp_path, capsys)
    assert "lcc.jsonl" in msg and "no predictions" in msg


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_cli_subprocess_bad_input_exit_code(tmp_path):
    _write_jsonl(tmp_path / "trec.jsonl", [_rec("a", ["a"], classes=["a"]), "{oops"])
    proc = _cli([str(tmp_path)])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert out == ""
    assert err.count("\n") == 1 and "trec.jsonl:2:" in err and "Traceback" not in err
