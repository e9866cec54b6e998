"""The long-generation reasoning task: reasoning-gym problems (offline, seeded), the JSONL source,
answer extraction and verification, its rows and its report (pass@1 with an interval, output
length vs the full cache, the accuracy / length vs budget figure)."""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy.stats import bootstrap
from test_runner import make_cfg
from test_runner import tiny_dir as tiny_dir  # the saved tiny model (session fixture)

import eval.runner as runner
from eval.report import build_report
from eval.rescore import rescore_dir
from eval.spec import RunSpec
from eval.store import read_rows
from eval.tasks import build_task
from eval.tasks.reasoning import answers
from eval.tasks.reasoning import report as rreport
from eval.tasks.reasoning.task import INSTALL, read_problems

RG_MISSING = "reasoning-gym is not installed: pip install -e '.[reasoning]'"


def needs_rg():
    return pytest.importorskip("reasoning_gym", reason=RG_MISSING)


# ------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    "text,expected",
    [
        ("2 + 2 = 4\nFinal answer: 4", "4"),
        ("so 10.\n**Final Answer:** $\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
        ("Final answer: 12\nwait, recheck.\nFinal answer: 1,024.", "1,024"),
        ("The final answer is: 7 legs", "7 legs"),
        ("we get \\boxed{x^{2}+1} in the end", "x^{2}+1"),
        ("no answer stated, 42", None),
        ("Final answer:", None),
        ("the final answer is:\n\\[\n\\boxed{98}\n\\]", "98"),  # the value on the lines below
        ("So, the final answer is:\nFinal answer: 7851", "7851"),
        ("Final answer: <answer>126</answer>", "126"),
        ("Final answer: 5\nFinal answer:", "5"),
    ],
)
def test_extract_answer(text, expected):
    assert answers.extract_answer(text) == expected


@pytest.mark.parametrize(
    "gold,answer,equal",
    [("72", "72.0", True), ("0.5", "1/2", True), ("1024", "1,024", True), ("72", "73", False),
     ("5", "$5", True), ("x+1", "x + 1", True), ("x+1", "1+x", False)],
)  # fmt: skip
def test_numeric_fallback_compares_exact_numbers(gold, answer, equal):
    assert answers.verify_answer(gold, answer, "numeric") is equal


def test_math_verify_checks_symbolic_equivalence():
    pytest.importorskip("math_verify", reason="math-verify is not installed: pip install -e '.[reasoning]'")
    assert answers.verify_answer("\\frac{1}{2}", "0.5", "math_verify")
    assert answers.verify_answer("72", "72", "math_verify")
    assert not answers.verify_answer("72", "71", "math_verify")
    assert not answers.verify_answer("72", None, "math_verify")
    with pytest.raises(ValueError, match="bogus"):
        answers.verify_answer("1", "1", "bogus")


# ---------------------------------------------------------------------------------- reasoning-gym
def test_problems_are_seeded_deterministic_and_grow_with_samples():
    needs_rg()
    a = build_task("reasoning", samples=2).problems()
    assert a == build_task("reasoning", samples=2).problems()
    assert build_task("reasoning", samples=3).problems()[: len(a)] == a  # interleaved: 2 rounds first
    assert [p["id"] for p in a[:4]] == [
        f"{d}/0" for d in ("gsm_symbolic", "leg_counting", "basic_arithmetic", "chain_sum")
    ]
    assert build_task("reasoning", samples=2, seed=7).problems() != a
    assert len(build_task("reasoning", samples=2, limit=3).problems()) == 3


def test_problems_generate_without_the_network(monkeypatch):
    rg = needs_rg()

    def refuse(*args, **kwargs):
        raise OSError("network access in a test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    task = build_task("reasoning", samples=2, seed=123)
    problems = task.problems()
    assert len(problems) == 8 and all(p["problem"] and p["answer"] for p in problems)
    assert rg is not None


def test_reasoning_gym_verifier_scores_the_final_answer_line():
    needs_rg()
    task = build_task("reasoning", samples=1)
    for sample in task.samples(None):
        gold = sample.answers[0]
        assert task.score(sample, f"Let me think.\nFinal answer: {gold}") == 1.0
        assert task.score(sample, f"Final answer: {gold}1") == 0.0
        assert task.score(sample, f"the answer is {gold}") == 0.0  # no final answer line
        assert task.score_all(sample, f"the answer is {gold}")["format"] == 0.0
        assert task.score_all(sample, f"Final answer: {gold}") == {"format": 1.0, "rg_reward": 1.0}
        assert sample.extra["verifier"] == "reasoning_gym"
        assert sample.context and "Final answer: <answer>" in sample.question


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(datasets={"no_such_dataset": {}}), "no_such_dataset"),
        (dict(source="web"), "source"),
        (dict(samples=0), "samples"),
        (dict(limit=0), "limit"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(source="jsonl"), "task.path"),
    ],
)
def test_bad_task_config_raises_naming_it(kw, match):
    if kw.get("source") != "web":
        needs_rg()
    with pytest.raises(ValueError, match=match):
        build_task("reasoning", **kw)


def test_missing_reasoning_gym_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install"):
        build_task("reasoning")
    assert "reasoning-gym==0.1.25" in INSTALL


# ------------------------------------------------------------------------------------------ jsonl
def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_jsonl_source_reads_aime_math500_and_gsm8k_shapes(tmp_path, monkeypatch):
    f = write_jsonl(
        tmp_path / "mix.jsonl",
        [
            {"problem": "Find x.", "answer": "\\frac{1}{2}", "id": "math-1", "source": "math500"},
            {"question": "Tom has 3 apples...", "answer": "He has 3 + 4 = 7.\n#### 7"},
            {"problem": "AIME problem", "answer": 204},
        ],
    )
    problems = read_problems(f)
    assert [(p["id"], p["source"], p["answer"]) for p in problems] == [
        ("math-1", "math500", "\\frac{1}{2}"), ("1", "mix", "7"), ("2", "mix", "204"),
    ]  # fmt: skip
    monkeypatch.setattr(answers, "VERIFIER", "numeric")  # as without math-verify
    task = build_task("reasoning", source="jsonl", path=str(f))
    samples = list(task.samples(None))
    assert [s.sample_id for s in samples] == ["math500/math-1", "mix/1", "mix/2"]
    assert all(s.extra["verifier"] == "numeric" for s in samples)
    assert (
        task.score(samples[1], "Final answer: 7") == 1.0
        and task.score(samples[2], "Final answer: 205") == 0.0
    )


def test_jsonl_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        read_problems(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": 1}\n{"problem": "b"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_problems(bad)


def test_jsonl_content_not_path_is_hashed(tmp_path):
    rows = [{"problem": "1+1?", "answer": 2}]
    a, b = write_jsonl(tmp_path / "a.jsonl", rows), write_jsonl(tmp_path / "b.jsonl", rows)
    cfg = {"source": "jsonl", "path": str(a), "limit": None, "samples": 10}
    hash_a = build_task("reasoning", source="jsonl", path=str(a)).hash_params(cfg)
    assert hash_a == build_task("reasoning", source="jsonl", path=str(b)).hash_params({**cfg, "path": str(b)})
    write_jsonl(b, [{"problem": "1+1?", "answer": 3}])
    assert hash_a != build_task("reasoning", source="jsonl", path=str(b)).hash_params({**cfg, "path": str(b)})


# ----------------------------------------------------------------------------------------- report
def frame(rows: list[dict]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    df["scores"] = [{"format": 1.0}] * len(df)
    return rreport.prepare_rows(df)


def test_pass_at_1_is_the_mean_of_per_problem_means_with_a_bootstrap_interval():
    scores = {"p0": [1, 1, 0, 1], "p1": [0, 0, 0, 0], "p2": [1, 0, 1, 1], "p3": [1, 1, 1, 1]}
    df = frame(
        [
            {"sample_id": f"{p}#{i}", "prompt_id": p, "sample_index": i, "sample_seed": 10 + i, "score": s,
             "temperature": 0.6, "top_p": 0.95, "new_tokens": 100}
            for p, ss in scores.items() for i, s in enumerate(ss)
        ]
    )  # fmt: skip
    acc, lo, hi, n = rreport.pass_at_1(df)
    means = np.array([np.mean(v) for v in scores.values()])
    assert n == 4 and acc == pytest.approx(means.mean())
    ref = bootstrap((means,), np.mean, n_resamples=2000, confidence_level=0.95, method="percentile",
                    rng=np.random.default_rng(0)).confidence_interval  # fmt: skip
    assert lo <= acc <= hi and (lo, hi) != (acc, acc)
    assert abs(lo - ref.low) < 0.1 and abs(hi - ref.high) < 0.1  # another resampling, same interval
    one = rreport.pass_at_1(df[df["prompt_id"] == "p0"])
    assert one[0] == 0.75 and math.isnan(one[1])


def test_length_ratio_pairs_rows_by_problem_and_seed():
    base = {"temperature": 0.6, "top_p": 0.95, "score": 1}
    full = frame([
        {**base, "sample_id": "a#0", "sample_seed": 1, "new_tokens": 20},
        {**base, "sample_id": "b#0", "sample_seed": 2, "new_tokens": 20},
    ])  # fmt: skip
    other = frame([
        {**base, "sample_id": "a#0", "sample_seed": 1, "new_tokens": 10},
        {**base, "sample_id": "b#0", "sample_seed": 2, "new_tokens": 30},
        {**base, "sample_id": "c#0", "sample_seed": 3, "new_tokens": 500},  # no full row: left out
        {**base, "sample_id": "a#0", "sample_seed": 9, "new_tokens": 500},  # another seed: left out
    ])  # fmt: skip
    assert rreport.length_ratio(other, full) == pytest.approx(40 / 40)
    assert math.isnan(rreport.length_ratio(other[other["sample_id"] == "c#0"], full))


def test_a_sample_counts_as_compressed_when_its_cache_lost_entries_at_any_point():
    df = pd.DataFrame({
        "compressed": [True, False, False, False, None],
        "evicted_during_decode": [False, True, False, False, None],
        "decode_compressions": [0, 0, 2, 0, None],
    })  # fmt: skip
    assert rreport.was_compressed(df).tolist() == [True, True, True, False, False]
    # Rows written before the decode-time columns existed: prefill compression alone decides.
    assert rreport.was_compressed(df[["compressed"]]).tolist() == [True, False, False, False, False]
    # A problem is drawn filled only when every one of its samples was compressed.
    rows = df.assign(model="m", decoding="d", config_label="c", method="x", prompt_key=list("aabbc"),
                     score=1.0, new_tokens=1, budget=8, method_params=None)  # fmt: skip
    assert rreport.per_problem(rows)["compressed"].tolist() == [True, False, False]


# ----------------------------------------------------------------------------------------- runner
def test_runs_and_reports_with_tiny_model_across_budgets(tiny_dir, tmp_path):
    needs_rg()
    common = ("task.limit=2", "task.samples=1", "task.max_new_tokens=10", "task.chat_template=false")
    sample_cfg = (
        "generation.do_sample=true",
        "generation.samples_per_prompt=2",
        "generation.temperature=1.5",
    )
    scheduled = (
        "method=snapkv budget=16 method.window=4 method.kernel_size=3 method.decode_schedule.interval=4"
    )
    for method in (
        "method=full",
        "method=streamingllm budget=16",
        "method=streamingllm budget=32",
        scheduled,
    ):
        cfg = make_cfg(tiny_dir, tmp_path, *method.split(), *common, *sample_cfg, task="reasoning")
        assert RunSpec.from_config(cfg).task.name == "reasoning"
        runner.run(cfg, write_report=False)
    rows = [r for p in sorted(tmp_path.rglob("*.jsonl")) for r in read_rows(p)]
    assert len(rows) == 4 * 2 * 2 and all(r["status"] == "ok" for r in rows)
    snap = [r for r in rows if r["method"] == "snapkv"]
    assert all(r["decode_compressions"] >= 1 and r["kv_entries_peak"] <= 16 + 4 for r in snap)
    assert {r["verifier"] for r in rows} == {"reasoning_gym"} and all(r["new_tokens"] >= 1 for r in rows)
    assert all(r["e2e_s"] >= r["ttft_s"] for r in rows)
    by_method = {}
    for r in rows:
        by_method.setdefault(r["method_params"].get("budget"), {})[r["sample_id"]] = r["sample_seed"]
    assert len({tuple(sorted(v.items())) for v in by_method.values()}) == 1  # same seeds everywhere

    rep = build_report(tmp_path)
    assert "## Reasoning (long generation)" in rep.markdown and "pass@1" in rep.markdown
    section = rep.markdown.split("## Reasoning (long generation)", 1)[1].split("\n## ", 1)[0]
    full_line = next(line for line in section.splitlines() if line.startswith("| full"))
    assert "| 1.000 |" in full_line  # the full cache against itself
    assert "| KV peak | KV mean | compressions | compressed % |" in section
    snap_line = next(line for line in section.splitlines() if line.startswith("| snapkv"))
    mean_compressions = sum(r["decode_compressions"] for r in snap) / len(snap)
    assert snap_line.rstrip(" |").endswith(f"| {mean_compressions:.1f} | 100.0")
    assert full_line.rstrip(" |").endswith("| 0.0 | 0.0")
    names = {p.name for p in rep.plots}
    assert any(n.startswith("reasoning_vs_budget_") for n in names), names


def test_rescore_restores_scores_from_predictions_and_refuses_other_runs(tiny_dir, tmp_path):
    needs_rg()
    common = ("task.limit=2", "task.samples=1", "task.max_new_tokens=10", "task.chat_template=false")
    cfg = make_cfg(tiny_dir, tmp_path, "method=full", *common, "generation.do_sample=true",
                   "generation.samples_per_prompt=2", task="reasoning")  # fmt: skip
    runner.run(cfg, write_report=False)
    (path,) = sorted(tmp_path.rglob("*.jsonl"))
    rows = read_rows(path)
    # Stand in for a scorer that was wrong when the rows were written: a flipped score, no metrics.
    rows[1]["score"], rows[1]["scores"] = 1.0 - rows[1]["score"], {}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task_overrides = ["task.limit=2", "task.samples=1", "task.chat_template=false"]

    done = rescore_dir(tmp_path, task_overrides)
    assert done == {path: (4, 1)}
    after = read_rows(path)
    assert [r["sample_id"] for r in after] == [r["sample_id"] for r in rows]
    assert after[1]["score"] == 1.0 - rows[1]["score"] and set(after[1]["scores"]) == {"format", "rg_reward"}
    assert after[1]["rescored"]["score_before"] == rows[1]["score"]
    assert all(r["rescored"] is None for i, r in enumerate(after) if i != 1)
    assert rescore_dir(tmp_path, task_overrides) == {path: (4, 0)}  # idempotent
    with pytest.raises(ValueError, match="(prompt|target)_sha of .* differs|not in the rebuilt task"):
        rescore_dir(tmp_path, [*task_overrides, "task.seed=7"])  # other problems: refused
    with pytest.raises(ValueError, match="overrides only, got 'budget=1'"):
        rescore_dir(tmp_path, ["budget=1"])
