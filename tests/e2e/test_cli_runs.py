"""End-to-end: run.py as a subprocess (comparisons, joblib and submitit-local sweeps, two identical
processes, the run log) and the debug experiment on the real default model."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_runner import DEPTHS, N_CELLS, ROOT, _cli, result_files, tiny_dir, tiny_overrides  # noqa: F401  (fixtures and helpers)

from eval.store import ROW_FIELDS, fields_missing, read_rows


def test_single_run_compares_with_full_and_a_baseline(tiny_dir, tmp_path):
    """`python run.py` (default `compare: [full, streamingllm]`): the method, then the full cache and
    StreamingLLM on the same grid and budget, each in its own results file; one report with the
    three side by side; a rerun resumes all three; `compare=[]` runs the method alone."""
    results = tmp_path / "results"
    args = [a for a in tiny_overrides(tiny_dir, results) if a != "report=false"] + [
        f"hydra.run.dir={tmp_path}/h"
    ]
    proc = _cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = result_files(results)
    assert sorted(f.name.split("-")[0] for f in files) == ["full", "snapkv", "streamingllm"]
    assert all(len(read_rows(f)) == N_CELLS for f in files)
    rows = {f.name.split("-")[0]: read_rows(f)[0] for f in files}
    assert rows["streamingllm"]["method_params"]["budget"] == 64  # the run's budget, shared
    assert rows["full"]["method_params"].get("budget") is None
    report = (results / "report.md").read_text()
    assert "| full |" in report and "snapkv b=64" in report and "streamingllm b=64" in report
    compare = sorted(results.glob("needle_compare_*.png"))
    assert [p.name for p in compare] == [
        "needle_compare_tiny-llama.png",
        "needle_compare_tiny-llama_partial.png",
    ]
    assert "compare: snapkv, then full, streamingllm" in proc.stderr

    again = _cli(tmp_path, *args)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("already done") == 3
    assert all(len(read_rows(f)) == N_CELLS for f in result_files(results))

    alone = tmp_path / "alone"
    args = [a.replace(str(results), str(alone)) for a in args] + ["compare=[]"]
    proc = _cli(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [f.name.split("-")[0] for f in result_files(alone)] == ["snapkv"]
    assert not list(alone.glob("needle_compare_*.png"))


def test_multirun_with_the_joblib_launcher(tiny_dir, tmp_path):
    results = tmp_path / "results"
    args = [a for a in tiny_overrides(tiny_dir, results) if not a.startswith(("task.lengths", "report"))]
    proc = _cli(
        tmp_path, "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}/multirun",
        "method=full,snapkv", "task.lengths=[150]", *args,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Joblib" in proc.stdout + proc.stderr
    files = result_files(results)
    assert sorted(f.name.split("-")[0] for f in files) == ["full", "snapkv"]
    assert all(len(read_rows(f)) == len(DEPTHS) for f in files)
    # One report, written after both jobs (ReportCallback), holding both configs.
    report = (results / "report.md").read_text()
    assert "| full |" in report and "snapkv b=64 w=32" in report
    # exact + partial credit, per config, and the two configs side by side (exact, partial)
    assert len(list(results.glob("needle_*.png"))) == 6
    assert len(list(results.glob("needle_compare_*.png"))) == 2
    assert (tmp_path / "multirun" / "multirun.yaml").is_file()


def test_multirun_with_the_submitit_local_launcher(tiny_dir, tmp_path):
    """The SLURM launcher's local twin (same plugin, jobs as local processes via submitit)."""
    results = tmp_path / "results"
    args = [a for a in tiny_overrides(tiny_dir, results) if not a.startswith(("task.lengths", "report"))]
    proc = _cli(
        tmp_path, "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=5",
        f"hydra.sweep.dir={tmp_path}/multirun", "method=full,streamingllm", "task.lengths=[150]", *args,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    files = result_files(results)
    assert sorted(f.name.split("-")[0] for f in files) == ["full", "streamingllm"]
    assert all(len(read_rows(f)) == len(DEPTHS) for f in files)
    assert list((tmp_path / "multirun").rglob("*submitted.pkl"))  # really went through submitit
    assert "streamingllm b=64" in (results / "report.md").read_text()


@pytest.mark.slow
def test_debug_experiment_on_the_default_model(tmp_path):
    """`python run.py experiment=debug` on the real SmolLM2 (cached): rows, report and heatmap."""
    results = tmp_path / "results"
    proc = _cli(
        tmp_path, "experiment=debug", f"results_dir={results}", f"hydra.run.dir={tmp_path}/h", timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = result_files(results)
    (row,) = read_rows(path)
    assert fields_missing(row) == [] and row["status"] == "ok" and row["model"] == "smollm2-135m-instruct"
    assert row["compressed"] is True and row["kv_tokens"] == 128 and row["trained_context"] == 8192
    assert (results / "report.md").is_file() and list(results.glob("needle_*.png"))
    assert "report.md" in proc.stderr
    assert set(ROW_FIELDS) <= set(row)


def test_fidelity_on_the_default_model(tmp_path):
    """`python run.py task=fidelity` on the real SmolLM2 (cached; the offline noise haystack): the
    method and the full cache in one run sharing one stored reference; KL exactly 0 for the full
    cache, above 0 where SnapKV compressed; the report's fidelity table."""
    results = tmp_path / "results"
    proc = _cli(
        tmp_path, "task=fidelity", "task.haystack=noise", "task.num_samples=1", "task.context_tokens=512",
        "task.continuation_tokens=32", "method=snapkv", "budget=128", "compare=[full]",
        f"results_dir={results}", f"hydra.run.dir={tmp_path}/h", timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["method"]: r for p in result_files(results) for r in read_rows(p)}
    assert set(rows) == {"snapkv", "full"} and all(fields_missing(r) == [] for r in rows.values())
    assert rows["full"]["kl"] == 0.0 and rows["full"]["score"] == 1.0
    snap = rows["snapkv"]
    assert snap["compressed"] is True and snap["kv_tokens"] == 128 and snap["kl"] > 0
    assert snap["ppl_full"] == rows["full"]["ppl_full"]
    assert len(list((results / ".cache" / "fidelity").rglob("*.pt"))) == 1
    assert "## Fidelity to the full cache" in (results / "report.md").read_text()


def test_two_identical_processes_write_one_row_per_sample(tiny_dir, tmp_path):
    results = tmp_path / "results"
    args = [*tiny_overrides(tiny_dir, results), "task.lengths=[150,250,350]", "compare=[]"]
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "run.py"), *args, f"hydra.run.dir={tmp_path}/h{i}"],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        )  # fmt: skip
        for i in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
    (path,) = result_files(results)
    ids = [r["sample_id"] for r in read_rows(path)]
    assert len(ids) == 3 * len(DEPTHS) == len(set(ids))


def test_the_run_log_holds_the_run(tiny_dir, tmp_path):
    """Python logging, not prints: Hydra's {run dir}/run.log records the run (and stderr shows it)."""
    results = tmp_path / "results"
    args = [a for a in tiny_overrides(tiny_dir, results) if not a.startswith("task.lengths")]
    proc = _cli(tmp_path, *args, "task.lengths=[150]", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (tmp_path / "run" / "run.log").read_text()
    assert f"{len(DEPTHS)} to run" in log and "done in" in log and "[INFO]" in log
    assert "[snapkv-bench] done in" in proc.stderr
