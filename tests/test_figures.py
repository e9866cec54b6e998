"""scripts/make_figures.py rebuilds tables and figures from results only (synthetic rows here; the
committed results/ are rebuilt in the slow test)."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_report import PNG_MAGIC, SNAP, base_row, write

ROOT = Path(__file__).resolve().parents[1]


def _make(args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, "scripts/make_figures.py", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )


def needle_rows(folder_params, scores):
    rows = []
    for params in folder_params:
        for length in (1000, 2000):
            for depth in (10, 90):
                method = "full" if not params else "snapkv"
                s = scores(params, length, depth)
                rows.append(base_row(f"len{length}_depth{depth}", "needle", "needle", method, params, s,
                                     context_length=length, depth_percent=depth,
                                     scores={"exact": s, "partial": min(1.0, s + 0.5)}))  # fmt: skip
    return rows


def test_make_figures_from_synthetic_results(tmp_path):
    root = tmp_path / "results"
    write(root / "needle_methods", needle_rows([{}, SNAP], lambda p, n, d: 1.0 if not p else 0.0))
    pools = [{**SNAP, "pooling": pool, "budget": b} for pool in ("max", "avg", "none") for b in (128, 256)]
    write(root / "pooling_ablation", needle_rows(pools, lambda p, n, d: p["budget"] / 256))
    windows = [{**SNAP, "window": w, "budget": b} for w in (8, 32) for b in (128, 256)]
    write(root / "sweep_window_budget", needle_rows(windows, lambda p, n, d: 0.5))
    lb = [base_row(f"mn-{i}", "longbench", "multi_news", m, p, 0.2 + 0.1 * (m == "full"), length=3000)
          for i in range(3) for m, p in (("full", {}), ("snapkv", SNAP))]  # fmt: skip
    write(root / "longbench_multinews", lb)
    (root / "bench").mkdir()
    with open(root / "bench" / "cpu.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["method", "budget", "batch_size", "input_tokens", "tpot_s", "peak_mem_bytes",
                               "prefill_s", "status", "model", "dtype", "device"])  # fmt: skip
        w.writeheader()
        for m in ("full", "snapkv"):
            for n in (512, 8192):
                w.writerow(dict(method=m, budget=512, batch_size=1, input_tokens=n, tpot_s=0.05, peak_mem_bytes=2**30,
                                prefill_s=1.0, status="ok", model="tiny", dtype="float32", device="cpu"))  # fmt: skip
    out = tmp_path / "figures"
    proc = _make([f"results={root}", f"out={out}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = (out / "table1_longbench.md").read_text()
    assert "| multi_news |" in table and "30.00" in table and "20.00" in table and "Average" in table
    assert "\\begin{tabular}" in (out / "table1_longbench.tex").read_text()
    for name in ("pooling_ablation.png", "pooling_ablation_partial.png", "sweep_window_budget.png",
                 "sweep_window_budget_partial.png", "cpu_tpot.png", "cpu_peak_mem.png", "cpu_longest.png"):  # fmt: skip
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    for sub in ("needle_methods", "pooling_ablation", "sweep_window_budget", "longbench_multinews"):
        assert (root / sub / "report.md").is_file() and (root / sub / "summary.csv").is_file()
    assert list((root / "needle_methods").glob("needle_*_partial.png"))


def test_make_figures_missing_inputs_are_skipped_with_a_note(tmp_path):
    (tmp_path / "results").mkdir()
    proc = _make([f"results={tmp_path / 'results'}", f"out={tmp_path / 'f'}"])
    assert proc.returncode == 0
    proc = _make([f"results={tmp_path / 'nope'}"])
    assert proc.returncode == 2 and "nope" in proc.stderr


@pytest.mark.slow
def test_make_figures_rebuilds_the_committed_results(tmp_path):
    """Every committed figure is one command away: rebuild a copy of results/ from its rows."""
    if not (ROOT / "results" / "needle_methods").is_dir():
        pytest.skip("no committed results")
    copy = tmp_path / "results"
    shutil.copytree(ROOT / "results", copy)
    proc = _make([f"results={copy}", f"out={copy / 'figures'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    committed = {p.relative_to(ROOT / "results") for p in (ROOT / "results").rglob("*.png")}
    rebuilt = {p.relative_to(copy) for p in copy.rglob("*.png")}
    assert committed <= rebuilt
