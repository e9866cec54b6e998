"""scripts/make_figures.py rebuilds tables and figures from results only (synthetic rows here; the
committed results/ are rebuilt from their rows in the slow test), and what the plots show."""

from __future__ import annotations

import csv
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from test_report import MODEL, PNG_MAGIC, SNAP, base_row, write

from eval.plots import (
    SOME_UNCOMPRESSED,
    UNCOMPRESSED,
    natural_sorted,
    needle_heatmap_figure,
    reasoning_vs_budget,
    reasoning_vs_budget_figure,
    score_limits,
    score_vs_budget_figure,
)
from eval.report.page import GENERATED
from eval.tables import slug

ROOT = Path(__file__).resolve().parents[2]


def _make(args, cwd=ROOT):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_figures.py"), *args],
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
    lb += [base_row(f"mn-{i}", "longbench", "multi_news", m, p, 0.5, length=3000, model="qwen-tiny")
           for i in range(2) for m, p in (("full", {}), ("snapkv", SNAP))]  # fmt: skip
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
    # one table per model: the second model's 50.00 is never averaged into the first's
    sections = {s.split("\n")[0]: s for s in table.split("## ")[1:]}
    first, second = sections[MODEL], sections["qwen-tiny"]
    assert "30.00" in first and "50.00" not in first and "50.00" in second and "30.00" not in second
    assert "samples per config: full: 2, snapkv" in second
    assert "\\begin{tabular}" in (out / "table1_longbench.tex").read_text()
    m = slug(MODEL)  # one sweep figure per model
    for name in (f"pooling_ablation_{m}.png", f"pooling_ablation_{m}_partial.png", f"sweep_window_budget_{m}.png",
                 f"sweep_window_budget_{m}_partial.png", "cpu_tpot.png", "cpu_peak_mem.png", "cpu_longest.png"):  # fmt: skip
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


# Files that scripts/make_figures.py writes (everything else under results/ is its input: result rows,
# benchmark CSVs, observation CSVs, hand-written READMEs).
def _derived(path: Path) -> bool:
    return (
        path.suffix == ".png"
        or path.name in ("report.md", "summary.csv")
        or path.parts[0] == "figures"
        or path == Path("leaderboard.csv")
        or (path.name == "README.md" and GENERATED in (ROOT / "results" / path).read_text(encoding="utf-8"))
    )


def _files(root: Path) -> set[Path]:
    return {p.relative_to(root) for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_make_figures_rebuilds_the_committed_results(tmp_path):
    """Every committed figure and table is one command away: rebuild a copy of results/ that holds
    the inputs only (no PNG, report or table), then compare the set of files and the tables' text."""
    committed = ROOT / "results"
    if not (committed / "needle_methods").is_dir():
        pytest.skip("no committed results")
    copy = tmp_path / "results"
    inputs = [p for p in _files(committed) if not _derived(p)]
    assert any(p.suffix == ".jsonl" for p in inputs)
    for rel in inputs:
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(committed / rel, copy / rel)
    proc = _make(["results=results", "out=results/figures"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rebuilt = _files(copy)
    assert sorted(map(str, rebuilt - _files(committed))) == []  # nothing new that is not committed
    assert sorted(map(str, _files(committed) - rebuilt)) == []  # every committed file rebuilt
    tables = sorted(p for p in rebuilt if _derived(p) and p.suffix in (".md", ".csv", ".tex"))
    assert len(tables) >= 10
    for rel in tables:
        assert (copy / rel).read_text() == (committed / rel).read_text(), f"{rel} differs from its rebuild"


# ---------------------------------------------------------------------------------- plot behaviour
def test_legend_sorted_as_numbers():
    assert natural_sorted(["window=16", "window=32", "window=8"]) == ["window=8", "window=16", "window=32"]
    assert natural_sorted(["b=1024", "b=128", "full", "b=256"]) == ["b=128", "b=256", "b=1024", "full"]
    df = pd.DataFrame(
        [dict(line=f"window={w}", budget=b, score=0.5) for w in (16, 32, 8) for b in (128, 256)]
        + [dict(line="full", budget=None, score=1.0)]
    )
    fig = score_vs_budget_figure(df, line="line", scale=100)
    labels = fig.axes[0].get_legend().get_texts()
    assert [t.get_text() for t in labels] == ["window=8", "window=16", "window=32", "full"]


def test_flat_scores_keep_a_full_y_axis():
    """Constant 100 (x100) must not be zoomed in to 95-105: the axis shows 0..100."""
    df = pd.DataFrame([dict(label="snapkv", budget=b, score=1.0) for b in (128, 256, 512)])
    lo, hi = score_vs_budget_figure(df, scale=100).axes[0].get_ylim()
    assert lo <= 0 and 100 <= hi <= 105
    lo, hi = score_vs_budget_figure(df.assign(score=0.0), scale=100).axes[0].get_ylim()
    assert lo <= 0 and hi >= 100
    assert score_limits([40.0, 60.0]) == pytest.approx((-4.0, 104.0))


def test_uncompressed_points_are_marked():
    """Budget 1024 on 1000-token prompts: the full cache ran; that point is hollow and the legend says so."""
    df = pd.DataFrame(
        [
            dict(label="snapkv", budget=b, score=0.2 * i, compressed=b < 1000)
            for i, b in enumerate((256, 512, 1024))
        ]
    )
    ax = score_vs_budget_figure(df, scale=100).axes[0]
    hollow = [ln for ln in ax.get_lines() if ln.get_markerfacecolor() == "white"]
    assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [1024]
    assert UNCOMPRESSED in [t.get_text() for t in ax.get_legend().get_texts()]
    ax = score_vs_budget_figure(df.assign(compressed=True), scale=100).axes[0]
    assert not [ln for ln in ax.get_lines() if ln.get_markerfacecolor() == "white"]


def test_reasoning_points_with_an_uncompressed_sample_are_hollow_and_labelled_so(tmp_path):
    """Decode-time methods compress only samples whose cache outgrew the budget: a point is hollow
    when some of its problems' samples never were, and the legend says that, not 'prompt <= budget'."""
    df = pd.DataFrame(
        [
            dict(line="h2o", budget=128, score=0.5, new_tokens=300, compressed=True),
            dict(line="h2o", budget=256, score=0.5, new_tokens=300, compressed=True),
            dict(line="h2o", budget=256, score=1.0, new_tokens=100, compressed=False),
            dict(line="full", budget=None, score=0.5, new_tokens=300, compressed=False),
        ]
    )
    for ax in reasoning_vs_budget_figure(df, title="t").axes:
        hollow = [ln for ln in ax.get_lines() if ln.get_markerfacecolor() == "white"]
        assert len(hollow) == 1 and list(hollow[0].get_xdata()) == [256]
        texts = [t.get_text() for t in ax.get_legend().get_texts()]
        assert SOME_UNCOMPRESSED in texts and UNCOMPRESSED not in texts
    assert reasoning_vs_budget(df, tmp_path / "r.png").read_bytes()[:8] == PNG_MAGIC


def test_heatmap_is_x100_like_the_tables():
    df = pd.DataFrame(dict(depth_percent=[10, 50], context_length=[1000, 1000], score=[1.0, 0.25]))
    fig = needle_heatmap_figure(df, "t", metric="exact")
    ax, cbar_ax = fig.axes
    assert sorted(t.get_text() for t in ax.texts) == ["100", "25"]
    assert ax.images[0].get_clim() == (0.0, 100.0)
    assert cbar_ax.get_ylabel() == "exact x100"


def test_plots_do_not_change_the_matplotlib_backend():
    """Importing eval.plots must not force Agg (the notebook draws inline)."""
    code = (
        "import matplotlib; matplotlib.use('svg'); import eval.plots, matplotlib.pyplot as plt; "
        "print(matplotlib.get_backend())"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "svg", proc.stderr[-2000:]


def test_sweep_lines_split_on_any_other_varying_parameter():
    spec = importlib.util.spec_from_file_location("make_figures", ROOT / "scripts" / "make_figures.py")
    make_figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_figures)

    params = pd.Series([{"window": 8, "budget": 128, "gqa_order": "pool_first", "pooling": "max"},
                        {"window": 8, "budget": 256, "gqa_order": "reduce_first", "pooling": "max"},
                        {"window": 16, "budget": 128, "gqa_order": "reduce_first", "pooling": "max"}])  # fmt: skip
    assert make_figures.sweep_lines(params, "window").tolist() == [
        "window=8 gqa_order=pool_first",
        "window=8 gqa_order=reduce_first",
        "window=16 gqa_order=reduce_first",
    ]
    assert make_figures.sweep_lines(params.iloc[1:], "window").tolist() == ["window=8", "window=16"]
