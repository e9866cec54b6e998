"""The leaderboard (eval/report/leaderboard.py, scripts/leaderboard.py) on synthetic rows: rows chosen
by the config hash a cell composes to, entries from eval.stats with a context's questions resampled
together, n in the header, the best compressed method marked, '—' where a cell has not run. The
rebuild from the committed rows is tests/e2e/test_leaderboard.py."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
from test_report import base_row, write

from eval.report import leaderboard as lb
from eval.stats import compare, holm
from eval.store import sha256_hex, target_sha

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["full", "snapkv", "streamingllm"]
CELL = {
    "task": "needle", "model": "qwen2.5-coder-0.5b-instruct", "dtype": "float32", "protocol": "context_only",
    "budget": 512, "overrides": ["task.needles=4", "task.lengths=[2000]", "task.depths=[0,25,50,75]"],
}  # fmt: skip
CONTEXTS, QUESTIONS = 6, 4


def grid(tmp_path: Path) -> Path:
    """Two cells: `ran` (rows below) and `missing` (its folder holds none)."""
    cells = [
        {"name": "ran", "title": "needle b=512", "results_dir": "results/ran", **CELL},
        {"name": "missing", "title": "needle b=256", "results_dir": "results/missing", **CELL, "budget": 256},
    ]
    path = tmp_path / "leaderboard.yaml"
    path.write_text(json.dumps({"leaderboard": {"cells": cells}}), encoding="utf-8")  # JSON is YAML
    return path


def scores(method: str) -> np.ndarray:
    """[contexts, questions] 0/1 scores: full answers all; snapkv and streamingllm lose whole
    contexts (questions of one context fall together) and a few single questions."""
    rng = np.random.default_rng({"full": 0, "snapkv": 1, "streamingllm": 2}[method])
    if method == "full":
        return np.ones((CONTEXTS, QUESTIONS))
    keep = {"snapkv": [1, 1, 0, 1, 1, 0], "streamingllm": [1, 0, 0, 0, 1, 0]}[method]
    return np.array(keep)[:, None] * (rng.random((CONTEXTS, QUESTIONS)) < 0.9)


@pytest.fixture(scope="module")
def board(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("board")
    path = grid(tmp_path)
    (cell, _) = lb.load_grid(path)
    hashes = lb.config_hashes(cell, METHODS)
    rows = []
    for method in METHODS:
        for c, per_context in enumerate(scores(method)):
            for q, score in enumerate(per_context):
                r = base_row(f"ctx{c}/q{q}", "needle", "needle", method, {}, float(score))
                r.update(
                    method_hash=hashes[method], model=CELL["model"], context_id=f"ctx{c}", question_index=q
                )
                r["prompt_sha"], r["target_sha"] = (
                    sha256_hex(f"context {c} question {q}"),
                    target_sha(r["answers"]),
                )
                rows.append(r)
    # Rows of another config (another hash) or another model in the same folder never enter the cell.
    stray = base_row("ctx0/q0", "needle", "needle", "snapkv", {"budget": 7}, 1.0)
    stray.update(prompt_sha=sha256_hex("context 0 question 0"), target_sha=target_sha(stray["answers"]))
    other_model = {**rows[-1], "model": "smollm2-135m-instruct", "score": 1.0}
    write(tmp_path / "results" / "ran", [*rows, stray, other_model])
    cells, table = lb.build(tmp_path / "results", path, METHODS)
    return cells, table, hashes, lb.cell_rows(cell, lb.specs(cell, METHODS), tmp_path / "results")


def test_cell_rows_are_the_configs_the_cell_composes_to(board):
    _, table, hashes, rows = board
    ran = table[table["cell"] == "ran"].set_index("method")
    assert ran["method_hash"].to_dict() == hashes
    assert set(ran["n_shared"]) == {CONTEXTS * QUESTIONS}
    assert len(rows) == len(METHODS) * CONTEXTS * QUESTIONS  # neither the stray config nor the other model
    assert set(rows["model"]) == {CELL["model"]} and set(rows["method_hash"]) == set(hashes.values())


def test_difference_and_interval_resample_a_contexts_questions_together(board):
    _, table, _, _ = board
    row = table[(table["cell"] == "ran") & (table["method"] == "snapkv")].iloc[0]
    contexts = np.repeat([f"ctx{c}" for c in range(CONTEXTS)], QUESTIONS)
    expected = compare(
        scores("snapkv").ravel(), scores("full").ravel(), [f"context_id:{c}" for c in contexts]
    )
    assert row["n_units"] == CONTEXTS and row["n_shared"] == CONTEXTS * QUESTIONS
    assert (row["diff"], row["lo"], row["hi"], row["p"]) == pytest.approx(
        (expected.diff, expected.lo, expected.hi, expected.p)
    )
    assert row["p_exact"] == pytest.approx(expected.p_exact)  # exact sign flip over 6 contexts
    per_question = compare(scores("snapkv").ravel(), scores("full").ravel())
    assert (row["lo"], row["hi"]) != pytest.approx((per_question.lo, per_question.hi))
    assert row["score"] == pytest.approx(100 * scores("snapkv").mean())
    # Holm over the column's compressed methods, on the exact p where there is one.
    col = table[(table["cell"] == "ran") & (table["method"] != "full")]
    assert col["p_holm"].to_numpy(float) == pytest.approx(holm(col["p_exact"].to_numpy(float)))


def test_best_compressed_method_is_marked(board):
    _, table, _, _ = board
    ran = table[table["cell"] == "ran"].set_index("method")
    assert ran["score"]["snapkv"] > ran["score"]["streamingllm"]
    assert ran["best"].to_dict() == {"full": False, "snapkv": True, "streamingllm": False}


def test_markdown_has_n_in_the_header_a_dash_where_a_cell_has_not_run_and_the_best_in_bold(board):
    cells, table, _, _ = board
    lines = lb.markdown(cells, table, METHODS).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header == [
        "method",
        "[needle b=512](ran/report.md) n=24 (6 contexts)",
        "[needle b=256](missing/report.md)",
    ]
    body = {r[0]: r[1:] for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert list(body) == METHODS
    assert [v[1] for v in body.values()] == ["—"] * 3
    snap = table[(table["cell"] == "ran") & (table["method"] == "snapkv")].iloc[0]
    assert body["snapkv"][0] == (
        f"**{snap['score']:.1f}** {snap['diff']:+.1f} [{snap['lo']:+.1f}, {snap['hi']:+.1f}]"
    )
    assert body["streamingllm"][0].startswith(f"{100 * scores('streamingllm').mean():.1f} ")
    assert body["full"][0] == "100.0"


def test_grid_cells_compose_to_the_committed_rows_configs():
    """The committed rows the grid reuses are exactly its configs (their hashes, from the rows)."""
    cells = {c.name: c for c in lb.load_grid()}
    assert lb.config_hashes(cells["needle_mq_query_aware_512"], ["full", "snapkv"]) == {
        "full": "227801ab",
        "snapkv": "30b3ccfd",
    }
    assert lb.config_hashes(cells["fidelity_512"], ["full", "snapkv"]) == {
        "full": "d7b6435e",
        "snapkv": "3f93a0e9",
    }


def _script():
    spec = importlib.util.spec_from_file_location("leaderboard_script", ROOT / "scripts" / "leaderboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, says",
    [
        ([], "command must be one of run, status, got None"),
        (["plot"], "got 'plot'"),
        (["run", "cells=nope"], "unknown cell 'nope'; known: ruler_niah_1024"),
        (["status", "methods=snapkv,nope"], "unknown method 'nope'"),
        (["run", "budget=3"], "got 'budget=3'"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv, says, capsys):
    assert _script().main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and says in err


def test_a_method_that_ran_part_of_the_samples_is_never_marked_best(tmp_path):
    """StreamingLLM on the two contexts it keeps has the higher mean, over other samples: snapkv,
    which ran them all, is marked."""
    path = grid(tmp_path)
    (cell, _) = lb.load_grid(path)
    hashes = lb.config_hashes(cell, METHODS)
    rows = []
    for method in METHODS:
        for c, per_context in enumerate(scores(method)):
            if method == "streamingllm" and c not in (0, 4):
                continue
            for q, score in enumerate(per_context):
                r = base_row(f"ctx{c}/q{q}", "needle", "needle", method, {}, float(score))
                r.update(
                    method_hash=hashes[method], model=CELL["model"], context_id=f"ctx{c}", question_index=q
                )
                r["prompt_sha"], r["target_sha"] = (
                    sha256_hex(f"context {c} question {q}"),
                    target_sha(r["answers"]),
                )
                rows.append(r)
    write(tmp_path / "results" / "ran", rows)
    _, table = lb.build(tmp_path / "results", path, METHODS)
    ran = table[table["cell"] == "ran"].set_index("method")
    assert ran["n_shared"]["streamingllm"] < ran["n_shared"]["full"]
    assert ran["score"]["streamingllm"] > ran["score"]["snapkv"]
    assert ran["best"].to_dict() == {"full": False, "snapkv": True, "streamingllm": False}
