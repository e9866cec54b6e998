import math
import re
import shutil
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

import eval.plots
from eval import labels
from eval.labels import budget_of, method_label, quiet_defaults
from eval.plots import needle_compare_figure, needle_heatmap, score_vs_budget, trained_context_position
from eval.report import build as report
from eval.report import main
from eval.store import DuplicateRowWarning, ResultStore, config_hash, result_path
from eval.tables import MIXED_NOTE, slug
from eval.tasks.needle.report import _score_metric
from snapkv import METHODS, Method, build_method
from snapkv.methods.adakv import AdaKV
from snapkv.methods.h2o import H2O
from snapkv.methods.pyramidkv import PyramidKV

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MODEL = "tiny/model"
SNAP = {"budget": 128, "window_size": 32, "kernel_size": 7, "pooling": "max"}


def base_row(sample_id, task, dataset, method, params, score, status="ok", **kw):
    r = {
        "sample_id": sample_id,
        "model": MODEL,
        "model_path": MODEL,  # today's row shape (old rows get the switches added since filled in)
        "task": task,
        "dataset": dataset,
        "method": method,
        "method_params": params,
        "method_hash": config_hash({"method": method, "method_params": params, "query_aware": True}),
        "query_aware": True,
        "input_tokens": 1000,
        "kv_tokens": 1000 if method == "full" else 128,
        "kv_bytes_full": 4000,
        "kv_bytes": 4000 if method == "full" else 1000,
        "compressed": method != "full",
        "prefill_s": 0.5,
        "ttft_s": 0.6,
        "tpot_s": 0.02,
        "peak_mem_bytes": 2**30,
        "attn_impl": "sdpa",
        "dtype": "float32",
        "device": "cpu",
        "prediction": "x" if status == "ok" else None,
        "answers": ["x"],
        "score": score if status == "ok" else None,
        "scores": {},
        "status": status,
        "error": None if status == "ok" else "RuntimeError: boom",
        "context_length": None,
        "depth_percent": None,
        "length": None,
        "versions": {"torch": "2", "transformers": "5", "snapkv_bench": "0.1.0"},
        "git_sha": "deadbeef",
        "seed": 0,
        "timestamp": "2025-01-01T00:00:00Z",
    }
    r.update(kw)
    return r


def write(results_dir, rows):
    for r in rows:
        ResultStore(result_path(results_dir, r["task"], r["model"], r["method"], r["method_hash"])).append(r)


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "results"
    rows = []
    # Needle: full scores 1 everywhere; snapkv b=128 scores depend on length; snapkv b=256 all 0.5.
    for method, params in (("full", {}), ("snapkv", SNAP), ("snapkv", {**SNAP, "budget": 256})):
        for length in (1000, 2000, 4000):
            for depth in (0, 50, 100):
                if method == "full":
                    score = 1.0
                elif params["budget"] == 128:
                    score = 1.0 if length == 1000 else (0.5 if depth == 50 else 0.0)
                else:
                    score = 0.5
                rows.append(
                    base_row(
                        f"needle-{length}-{depth}",
                        "needle",
                        "needle",
                        method,
                        params,
                        score,
                        context_length=length,
                        depth_percent=depth,
                        scores={"exact": score, "partial": min(1.0, score + 0.25)},
                    )
                )
    # LongBench: qasper scores 0.2, 0.4 + one error row; hotpotqa 0.9.
    for method, params in (("full", {}), ("snapkv", SNAP)):
        rows.append(base_row("qasper-0", "longbench", "qasper", method, params, 0.2, length=3000))
        rows.append(base_row("qasper-1", "longbench", "qasper", method, params, 0.4, length=5000))
        rows.append(base_row("qasper-2", "longbench", "qasper", method, params, None, status="error"))
        rows.append(base_row("hotpotqa-0", "longbench", "hotpotqa", method, params, 0.9, length=9000))
    write(d, rows)
    return d


@pytest.fixture
def fake_metrics(monkeypatch):
    mod = types.ModuleType("eval.tasks.longbench.metrics")
    mod.DATASET2CATEGORY = {"qasper": "Single-Doc QA", "hotpotqa": "Multi-Doc QA"}
    monkeypatch.setitem(sys.modules, "eval.tasks.longbench.metrics", mod)


def test_method_label():
    assert method_label("full", {}) == "full"
    assert method_label("full", None) == "full"
    assert method_label("snapkv", {"pooling": "max", "kernel_size": 7, "window_size": 32, "budget": 512}) == (
        "snapkv b=512 w=32 k=7 max"
    )
    assert method_label("snapkv", {"max_capacity_prompt": 1024.0, "window_size": 32}) == "snapkv b=1024 w=32"
    assert method_label("h2o", {"budget": 256, "recent": 0.5, "unused": None}) == "h2o b=256 recent=0.5"
    assert method_label("snapkv", {"budget": 512}, query_aware=False) == "snapkv b=512 q-agnostic"
    assert method_label("snapkv", {"budget": 512}, query_aware=True) == "snapkv b=512"
    assert budget_of({"budget": 512}) == 512.0 and budget_of({}) is None
    # The params of the real method dataclasses: secondary ones at their defaults stay out of the label.
    snap = {
        "budget": 1024,
        "window": 32,
        "kernel_size": 7,
        "pooling": "max",
        "gqa_reduce": "mean",
        "gqa_order": "reduce_first",
    }
    assert method_label("snapkv", snap) == "snapkv b=1024 w=32 k=7 max"
    assert method_label("snapkv", {**snap, "gqa_reduce": "max", "pooling": "none"}) == (
        "snapkv b=1024 w=32 k=7 gqa_reduce=max pooling=none"
    )
    h2o = {
        "budget": 256,
        "recent": None,
        "recent_ratio": 0.5,
        "evict_during_decode": True,
        "normalize": False,
    }
    assert method_label("h2o", h2o) == "h2o b=256"
    assert method_label("h2o", {**h2o, "evict_during_decode": False}) == "h2o b=256 evict_during_decode=false"
    assert method_label("streamingllm", {"budget": 256, "n_sink": 4, "positions": "original"}) == (
        "streamingllm b=256 s=4"
    )
    assert method_label("full", {"budget": None}) == "full"
    assert slug("snapkv b=512 w=32 max") == "snapkv_b=512_w=32_max"
    assert slug("org/model") == "org__model"


def test_report_end_to_end(results_dir, tmp_path, capsys, fake_metrics):
    out = tmp_path / "out"
    assert main([str(results_dir), "--out", str(out), "--trained-context", "2000"]) == 0
    stdout = capsys.readouterr().out

    summary = pd.read_csv(out / "summary.csv")
    for col in (
        "task",
        "dataset",
        "model",
        "method",
        "label",
        "query_aware",
        "n",
        "n_ok",
        "n_error",
        "score",
        "partial",
        "input_tokens",
        "kv_tokens",
        "kv_bytes",
        "compression",
        "prefill_s",
        "tpot_s",
        "peak_mem_bytes",
    ):
        assert col in summary.columns, col
    # 3 needle configs + 2 longbench configs x 2 datasets.
    assert len(summary) == 3 + 4
    q = summary[(summary["dataset"] == "qasper") & (summary["label"] == "snapkv b=128 w=32 k=7 max")].iloc[0]
    assert (q["n"], q["n_ok"], q["n_error"]) == (3, 2, 1)
    assert q["score"] == pytest.approx(30.0)  # (0.2 + 0.4) / 2 * 100; the error row is excluded
    assert q["compression"] == pytest.approx(0.25)
    assert q["kv_tokens"] == pytest.approx(128)
    assert math.isnan(q["partial"])
    needle = summary[(summary["task"] == "needle") & (summary["label"] == "snapkv b=128 w=32 k=7 max")].iloc[
        0
    ]
    # 9 cells: length 1000 -> 1,1,1; 2000 and 4000 -> 0, 0.5, 0 each => 4/9.
    assert needle["score"] == pytest.approx(round(4 / 9 * 100, 2))
    # partial = min(1, score + .25): 1,1,1 + 2 x (.25, .75, .25) => 5.5/9.
    assert needle["partial"] == pytest.approx(round(5.5 / 9 * 100, 2))
    assert needle["n"] == 9 and needle["n_error"] == 0

    report = (out / "report.md").read_text()
    assert report.strip() == stdout.strip()
    # LongBench table: rows = dataset, columns = config labels, values = score x100.
    assert "| dataset | full | snapkv b=128 w=32 k=7 max |" in report
    assert "| qasper | 30.00 | 30.00 |" in report
    assert "| hotpotqa | 90.00 | 90.00 |" in report
    assert "| **Average** | 60.00 | 60.00 |" in report
    assert "| *Single-Doc QA* | 30.00 | 30.00 |" in report
    # Dataset and category rows follow DATASET2CATEGORY's order (LongBench's), not the alphabet.
    assert report.index("| qasper |") < report.index("| hotpotqa |")
    assert report.index("*Single-Doc QA*") < report.index("*Multi-Doc QA*")
    # Needle table: accuracy per config x context length (mean over depths) + avg.
    assert "| method | 1000 | 2000 | 4000 | avg |" in report
    assert "| snapkv b=128 w=32 k=7 max | 100.00 | 16.67 | 16.67 | 44.44 |" in report
    assert "| full | 100.00 | 100.00 | 100.00 | 100.00 |" in report
    assert "## Cost" in report and "peak GiB" in report
    assert "Partial credit x100" in report  # the graded needle score has its own table
    # LongBench-E buckets from the rows' `length` (3000 / 5000 / 9000 words in the fixture)
    assert "LongBench-E length buckets" in report
    assert (
        "| qasper 0-4k | 20.00 (1) | 20.00 (1) |" in report
        and "| qasper 4-8k | 40.00 (1) | 40.00 (1) |" in report
    )
    assert "| hotpotqa 8k+ | 90.00 (1) | 90.00 (1) |" in report  # each bucket's ok samples beside it

    for label in ("full", "snapkv_b=128_w=32_k=7_max", "snapkv_b=256_w=32_k=7_max"):
        for suffix in ("", "_partial"):  # exact containment, and partial credit beside it
            png = out / f"needle_tiny__model_{label}{suffix}.png"
            data = png.read_bytes()
            assert data[:8] == PNG_MAGIC and len(data) > 5000, png
    sv = (out / "score_vs_budget_needle.png").read_bytes()
    assert sv[:8] == PNG_MAGIC
    # the needle's budget_values: partial credit against the budget too (exact is flat on small models)
    assert (out / "score_vs_budget_needle_partial.png").read_bytes()[:8] == PNG_MAGIC
    # LongBench ran at a single budget: no score-vs-budget plot.
    assert not (out / "score_vs_budget_longbench.png").exists()


def test_report_without_metrics_module_omits_categories(results_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "eval.tasks.longbench.metrics", None)  # import fails
    out = tmp_path / "out"
    assert main([str(results_dir), "--out", str(out), "--no-plots"]) == 0
    report = (out / "report.md").read_text()
    assert "| **Average** | 60.00 | 60.00 |" in report
    assert "Single-Doc QA" not in report
    assert not list(out.glob("*.png"))


def test_report_marks_average_over_missing_datasets(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "eval.tasks.longbench.metrics", None)
    rows = [base_row("q0", "longbench", "qasper", "full", {}, 0.5)]
    rows += [base_row(f"{ds}0", "longbench", ds, "snapkv", SNAP, 0.25) for ds in ("qasper", "hotpotqa")]
    write(tmp_path / "r", rows)
    assert main([str(tmp_path / "r"), "--no-plots"]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    # The two configs ran different samples: every cell gives its n, and the text says so.
    assert "| qasper | 50.00 (n=1) | 25.00 (n=1) |" in report and "| hotpotqa | — | 25.00 (n=1) |" in report
    assert MIXED_NOTE in report
    assert "| **Average** | 50.00† | 25.00 |" in report
    assert "† mean over only the datasets" in report


def test_report_default_out_is_results_dir(results_dir, capsys):
    assert main([str(results_dir), "--no-plots"]) == 0
    assert (results_dir / "summary.csv").exists() and (results_dir / "report.md").exists()


def test_report_empty_dir_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no result rows") and err.count("\n") == 1
    assert main([str(tmp_path / "missing")]) == 2


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_report_cli_empty_dir(tmp_path):
    script = Path(__file__).resolve().parents[1] / "scripts" / "report.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.strip().startswith("error:")


def test_trained_context_position():
    lengths = [1000, 2000, 4000]
    assert trained_context_position(lengths, 2000) == 1.0
    assert trained_context_position(lengths, 3000) == pytest.approx(1.5)
    assert trained_context_position(lengths, 500) == -0.5
    assert trained_context_position(lengths, 8000) is None
    assert trained_context_position(lengths, None) is None


def test_plots_generic(tmp_path):
    df = pd.DataFrame(
        {
            "depth_percent": [0, 0, 100, 100, 100],
            "context_length": [4000, 1000, 4000, 1000, 1000],
            "acc": [1.0, 0.0, 0.5, 1.0, 0.0],
        }
    )
    p = needle_heatmap(df, tmp_path / "h.png", "t", trained_context=3000, value="acc")
    assert p.read_bytes()[:8] == PNG_MAGIC
    sv = pd.DataFrame(
        {"label": ["a", "a", "a", "full"], "budget": [64, 128, 256, None], "score": [10.0, 20.0, 30.0, 40.0]}
    )
    p = score_vs_budget(sv, tmp_path / "s.png", title="x")
    assert p.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError):
        needle_heatmap(df.iloc[0:0], tmp_path / "e.png", "t", value="acc")


def test_needle_compare_one_panel_per_config_one_scale():
    """The compare figure: a panel per label in the given order, one colour scale 0..100 for all,
    cells annotated x100, missing cells masked (grey), sample counts and means in the titles, one
    colour bar named for the metric."""
    df = pd.DataFrame(
        {
            "config_label": ["full"] * 4 + ["snapkv b=64"] * 3,
            "depth_percent": [0, 0, 100, 100, 0, 100, 100],
            "context_length": [1000, 2000, 1000, 2000, 1000, 1000, 2000],
            "partial": [1.0, 1.0, 1.0, 0.5, 0.25, 0.0, 1.0],
        }
    )
    fig = needle_compare_figure(
        df, labels=["full", "snapkv b=64"], title="t", value="partial", metric="partial credit"
    )
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title() for ax in panels] == ["full\nn=4, mean 88", "snapkv b=64\nn=3, mean 42"]
    assert {ax.get_images()[0].get_clim() for ax in panels} == {(0.0, 100.0)}
    snap = panels[1].get_images()[0].get_array()
    assert snap.mask.tolist() == [[False, True], [False, False]]  # no (depth 0, 2000) row: grey
    assert [t.get_text() for t in panels[1].texts] == ["25", "0", "100"]
    (cbar,) = [ax for ax in fig.axes if not ax.get_images()]
    assert cbar.get_ylabel() == "partial credit x100"
    with pytest.raises(ValueError):
        needle_compare_figure(df, labels=[], title="t", value="partial")


def test_compare_colour_bar_names_the_needle_metric():
    """The score's metric is the `scores` key equal to `score` on every row (sf needle: word_recall,
    although exact agrees wherever both are 0 or 1); undecided or absent: "score"."""
    g = pd.DataFrame(
        {
            "score": [0.0, 1.0, 0.5],
            "scores": [{"exact": 0.0, "word_recall": 0.0}, {"exact": 1.0, "word_recall": 1.0}, {"exact": 0.0, "word_recall": 0.5}],
        }
    )  # fmt: skip
    assert _score_metric(g) == "word_recall"
    assert _score_metric(g.iloc[:2]) == "exact"  # both agree: the first of exact, partial, word_recall
    assert _score_metric(g.drop(columns="scores")) == "score"


def _needle_rows(**kw):
    return [
        base_row(
            f"n-{length}-{depth}",
            "needle",
            "needle",
            "snapkv",
            SNAP,
            1.0,
            context_length=length,
            depth_percent=depth,
            **kw,
        )  # fmt: skip
        for length in (1000, 2000)
        for depth in (0, 100)
    ]


def test_needle_compare_is_drawn_only_beside_the_full_cache(tmp_path, monkeypatch, capsys):
    """Two compressed configs alone get their own heatmaps but no side-by-side figure; with the full
    cache among them the figure holds it first."""
    drawn = []

    def fake_compare(df, path, labels, **kw):
        drawn.append(labels)
        return Path(path)

    monkeypatch.setattr(eval.plots, "needle_compare", fake_compare)
    d = tmp_path / "r"
    other = {**SNAP, "budget": 256}
    rows = _needle_rows() + [{**r, "method_params": other, "method_hash": "b" * 16} for r in _needle_rows()]
    write(d, rows)
    assert main([str(d)]) == 0
    assert drawn == []
    full = [{**r, "method": "full", "method_params": {}, "method_hash": "f" * 16} for r in _needle_rows()]
    write(d, full)
    assert main([str(d)]) == 0
    assert len(drawn) == 1 and drawn[0][0] == "full" and len(drawn[0]) == 3


def test_a_rebuild_deletes_the_figures_it_no_longer_draws(tmp_path, capsys):
    """report.md lists the figures it drew; the next build deletes those it does not draw again (a
    config whose rows left the folder) and never a file it did not list."""
    d = tmp_path / "r"
    other = {**SNAP, "budget": 256}
    write(
        d, _needle_rows() + [{**r, "method_params": other, "method_hash": "b" * 16} for r in _needle_rows()]
    )
    (d / "mine.png").write_bytes(b"not the report's")
    assert main([str(d)]) == 0
    first = report.listed_figures(d / "report.md")
    # the b=256 heatmaps, and score vs budget, drawn only for a task run at two budgets or more
    gone = [n for n in first if "b=256" in n or n.startswith("score_vs_budget")]
    assert gone and len(gone) < len(first) and "mine.png" not in first
    assert all((d / n).is_file() for n in first)
    (other_file,) = [f for f in d.rglob("*.jsonl") if "b" * 16 in f.name]
    other_file.unlink()
    assert main([str(d), "--no-plots"]) == 0  # without plots nothing is drawn or deleted
    assert report.listed_figures(d / "report.md") == first and all((d / n).is_file() for n in gone)
    assert main([str(d)]) == 0
    now = report.listed_figures(d / "report.md")
    assert sorted(now) == sorted(set(first) - set(gone))
    assert not any((d / n).exists() for n in gone) and all((d / n).is_file() for n in now)
    assert (d / "mine.png").read_bytes() == b"not the report's"
    text = (d / "report.md").read_text()
    assert text.rstrip().endswith(f"- [{sorted(now)[-1]}](<{sorted(now)[-1]}>)")


def test_trained_context_flag_wins_over_the_rows(tmp_path, monkeypatch, capsys):
    seen = []

    def fake_heatmap(df, path, title="", trained_context=None, value="score"):
        seen.append(trained_context)
        return path

    monkeypatch.setattr(eval.plots, "needle_heatmap", fake_heatmap)
    d = tmp_path / "r"
    write(d, _needle_rows(trained_context=8000))
    assert main([str(d)]) == 0
    assert seen and set(seen) == {8000}  # default: the rows' own value
    seen.clear()
    assert main([str(d), "--trained-context", "2000"]) == 0
    assert seen and set(seen) == {2000}  # the option wins over the rows' value


def test_report_lists_code_versions_and_warns_when_they_differ(tmp_path, capsys):
    d = tmp_path / "r"
    write(d, _needle_rows(git_sha="a" * 40, git_dirty=False, git_diff_sha=None))
    assert main([str(d), "--no-plots"]) == 0
    report = (d / "report.md").read_text()
    assert "## Code versions" in report and "| aaaaaaaaaaaa | clean | 0.1.0 | 4 |" in report
    assert "more than one version" not in report
    rows = [r for r in _needle_rows(git_sha="a" * 40, git_dirty=True, git_diff_sha="0123456789ab")]
    for r in rows:
        r["sample_id"] += "-dirty"
    write(d, rows)
    assert main([str(d), "--no-plots"]) == 0
    report = (d / "report.md").read_text()
    assert "| aaaaaaaaaaaa | dirty (diff 0123456789ab) | 0.1.0 | 4 |" in report
    assert "**Warning: these rows come from more than one version of the code.**" in report


def test_code_versions_say_unknown_for_rows_without_a_dirty_flag(tmp_path):
    """Rows written before the dirty flag existed (no `git_dirty` key) and rows with a null flag
    are "unknown", never "clean"; a recorded flag still reads clean / dirty."""
    d = tmp_path / "r"
    old = _needle_rows(git_sha="b" * 40)  # no git_dirty key at all
    assert all("git_dirty" not in r for r in old)
    null = _needle_rows(git_sha="c" * 40, git_dirty=None)
    clean = _needle_rows(git_sha="a" * 40, git_dirty=False, git_diff_sha=None)
    for tag, rows in (("null", null), ("clean", clean)):
        for r in rows:
            r["sample_id"] += f"-{tag}"
    write(d, old + null + clean)
    table, differ = report.code_versions(ResultStore.load_dir(d))
    assert "| bbbbbbbbbbbb | unknown | 0.1.0 | 4 |" in table
    assert "| cccccccccccc | unknown | 0.1.0 | 4 |" in table
    assert "| aaaaaaaaaaaa | clean | 0.1.0 | 4 |" in table
    assert differ


def test_committed_results_still_report_the_same_tables(tmp_path, capsys):
    """Old rows (the committed results/, written before the schema change) read and report as before."""
    src = Path(__file__).resolve().parents[1] / "results" / "needle_methods"
    d = tmp_path / "needle_methods"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("*.png", "report.md", "summary.csv"))
    assert main([str(d), "--no-plots"]) == 0
    new = (d / "report.md").read_text()
    old = (src / "report.md").read_text()
    body = old.split("\n", 3)[3]  # after the header line naming the results dir

    def without_cost(text: str) -> tuple[str, str, str]:
        head, rest = text.split("## Cost", 1)
        head = (
            head.split("\n## Paired comparisons", 1)[0].rstrip() + "\n\n"
        )  # added since: tests/test_paired.py
        cost, versions = rest.split("## Code versions", 1)
        return head, cost, versions.split(f"\n{report.FIGURES_HEADING}\n", 1)[0]

    # Every table as committed except the cost table (medians + other cores since the noise record)
    # and the code versions, whose rows without a dirty flag now read "unknown" (committed: "—").
    body, _, old_versions = without_cost(body)
    new_rest, cost, new_versions = without_cost(new)
    # Tables whose configs ran on different samples give each cell its n and say so (added since;
    # tested on synthetic rows above): stripped here, whichever tables have it today.
    new_rest, body = (re.sub(r" \(n=\d+\)", "", t) for t in (new_rest, body))
    new_rest, body = (re.sub(rf"\n\n{re.escape(MIXED_NOTE)}[^\n]*", "", t) for t in (new_rest, body))
    assert body.strip() in new_rest
    assert new_versions.strip() == old_versions.replace("| — |", "| unknown |").strip()
    assert "| unknown |" in new_versions
    lines = [ln for ln in cost.splitlines() if ln.startswith("| needle |")]
    configs = pd.read_csv(src / "summary.csv")[["model", "label"]].drop_duplicates()
    # Configs none of whose rows record the load say n/a; those with rows run since give a median.
    rows = ResultStore.load_dir(d)
    has_load = rows["other_cores"].notna() if "other_cores" in rows else pd.Series(False, index=rows.index)
    by_config = has_load.groupby([rows["model"], rows["method"], rows["method_hash"]]).any()
    assert len(lines) == len(configs)
    old_models_methods = {
        (model, method) for (model, method, _), any_load in by_config.items() if not any_load
    }
    old_lines = [
        ln for ln in lines if (ln.split(" | ")[1], ln.split(" | ")[2].split(" ")[0]) in old_models_methods
    ]
    assert old_lines and all(ln.split(" | ")[13] == "n/a" for ln in old_lines)
    assert len(old_lines) < len(lines)
    assert re.search(r"predate (the load|that) record", cost)
    old_summary = pd.read_csv(src / "summary.csv")
    new_summary = pd.read_csv(d / "summary.csv")
    pd.testing.assert_frame_equal(old_summary, new_summary)


def test_cost_table_prints_timing_medians_with_the_noise_beside_them(tmp_path, capsys):
    """Medians (not means) of prefill / ttft / tpot per config, the median other_cores of the same ok
    rows beside them, "n/a" for rows from before the noise record, and the load sentence below."""
    noise = [(1.0, 0.01, 0.5, 2.0), (2.0, 0.02, 1.5, 3.0), (9.0, 0.09, 1.0, 4.0)]
    rows = [
        base_row(f"f{i}", "longbench", "qasper", "full", {}, 0.5, prefill_s=p, ttft_s=p + 0.1, tpot_s=t,
                 other_cores=o, load_1m=load, cpu_count=2, torch_threads=1)
        for i, (p, t, o, load) in enumerate(noise)
    ]  # fmt: skip
    rows.append(
        base_row("f3", "longbench", "qasper", "full", {}, 0.5, status="error", prefill_s=99.0, other_cores=2)
    )
    rows += [
        base_row(f"s{i}", "longbench", "qasper", "snapkv", SNAP, 0.5, prefill_s=0.5 + i) for i in range(2)
    ]
    write(tmp_path / "r", rows)
    assert main([str(tmp_path / "r"), "--no-plots"]) == 0
    report = (tmp_path / "r" / "report.md").read_text()
    header = "| task | model | method | n | ok | err | input tok | kv tok | kv % | kv MiB | prefill s | ttft s | tpot ms | other cores | peak GiB |"
    assert header in report
    # full: 4 rows, 3 ok; medians 2 s / 2.1 s / 20 ms (the means would be 4 s, 4.1 s, 40 ms).
    assert (
        "| longbench | tiny/model | full | 4 | 3 | 1 | 1000 | 1000 | 100.0 | 0.0 | 2.000 | 2.100 | 20.0 | 1.00 | 1.00 |"
        in report
    )
    # snapkv rows carry no noise fields (written before them): median timing, n/a beside it.
    assert "| 1.000 | 0.600 | 20.0 | n/a | 1.00 |" in report
    assert "bookkeeping" in report
    assert (
        "other processes kept a median 1.00 cores busy of its 2 (max 1.50), 1-min load average median 3.00"
        in report
    )
    assert "2 of 5 ok rows predate that record." in report


def test_quiet_defaults_are_the_declared_method_defaults(monkeypatch):
    # Ada-KV redeclares PyramidKV's short_prompt with another default: its value stays in the label.
    assert (
        quiet_defaults("adakv")["short_prompt"] == PyramidKV.short_prompt == "uniform" != AdaKV.short_prompt
    )
    assert quiet_defaults("h2o")["block_size"] == H2O.block_size
    assert (
        quiet_defaults("knorm")["evict_during_decode"] is False
        and quiet_defaults("h2o")["evict_during_decode"]
    )
    assert "short_prompt=clip" in method_label("adakv", build_method("adakv").params())
    assert "short_prompt" not in method_label("pyramidkv", build_method("pyramidkv").params())
    assert "evict_during_decode" not in method_label("knorm", build_method("knorm").params())
    assert "evict_during_decode=true" in method_label(
        "knorm", build_method("knorm", evict_during_decode=True).params()
    )

    @dataclass
    class Other(Method):
        block_size: int = 64

    monkeypatch.setitem(METHODS, "other", Other)
    assert "block_size" not in method_label("other", {"block_size": 64})
    assert "block_size=64" in method_label("h2o", {"block_size": 64})
    monkeypatch.setattr(labels, "QUIET_PARAMS", ("no_such_param",))
    with pytest.raises(ValueError, match="'no_such_param'"):
        quiet_defaults("h2o")


def test_configs_that_share_a_label_are_told_apart(tmp_path):
    """Rows of the same method and parameters from different configs (another dtype, or task
    parameters: another hash) must never be averaged under one label."""
    d = tmp_path / "results"
    rows = []
    for i in range(2):
        rows.append(base_row(f"a{i}", "longbench", "qasper", "full", {}, 1.0))
        bf = base_row(f"a{i}", "longbench", "qasper", "full", {}, 0.0, dtype="bfloat16")
        bf["method_hash"] = config_hash({"method": "full", "dtype": "bfloat16"})
        rows.append(bf)
        other = base_row(f"a{i}", "longbench", "qasper", "snapkv", SNAP, 0.5)
        rows.append(other)
        other2 = base_row(f"a{i}", "longbench", "qasper", "snapkv", SNAP, 0.25)
        other2["method_hash"] = "0123abcd"  # same dtype etc.: only the hash says they differ
        rows.append(other2)
    write(d, rows)
    out = tmp_path / "report"
    assert main([str(d), "--out", str(out)]) == 0
    summary = pd.read_csv(out / "summary.csv").set_index("label")
    snap = method_label("snapkv", SNAP)
    h1 = rows[2]["method_hash"]
    assert sorted(summary.index) == sorted(["full fp32", "full bf16", f"{snap} #{h1}", f"{snap} #0123abcd"])
    assert summary.loc["full fp32", "score"] == pytest.approx(100.0)
    assert summary.loc["full bf16", "score"] == pytest.approx(0.0)
    assert summary.loc[f"{snap} #0123abcd", "score"] == pytest.approx(25.0)
    # One config alone keeps its plain label.
    d2 = tmp_path / "one"
    write(d2, rows[:1])
    assert main([str(d2), "--out", str(tmp_path / "r2")]) == 0
    assert list(pd.read_csv(tmp_path / "r2" / "summary.csv")["label"]) == ["full"]


def test_method_label_leaves_tova_knorm_chunkkv_switches_at_their_defaults_out():
    from snapkv import build_method

    def label(name, **params):
        return method_label(name, build_method(name, budget=128, **params).params())

    assert label("tova") == "tova b=128"
    assert label("tova", keep_last=True, evict_during_decode=False) == (
        "tova b=128 evict_during_decode=false keep_last=true"
    )
    # evict_during_decode at its own default (false), not H2O's and TOVA's (true); `protect` at
    # its default shown: rows from before the switch (nothing protected) are another config.
    assert label("knorm") == "knorm b=128 protect=generation_prompt"
    assert label("knorm", protect="none") == "knorm b=128"
    assert label("knorm", skip_layers=[0, 1], prune_after=2048, evict_during_decode=True) == (
        "knorm b=128 evict_during_decode=true protect=generation_prompt prune_after=2048 skip_layers=0,1"
    )
    assert label("chunkkv") == "chunkkv b=128 w=32 k=7 chunk_length=10 max"
    assert label("chunkkv", chunk_score="mean", reuse_layers=4) == (
        "chunkkv b=128 w=32 k=7 chunk_length=10 chunk_score=mean reuse_layers=4 max"
    )


def test_method_label_writes_a_decode_schedule_compactly():
    from snapkv import build_method

    def label(name, **schedule):
        return method_label(name, build_method(name, budget=128, decode_schedule=schedule).params())

    assert label("snapkv") == "snapkv b=128 w=32 k=7 max"  # off: not in params, not in the label
    assert label("snapkv", interval=64) == "snapkv b=128 w=32 k=7 decode=64 max"
    assert label("knorm", interval=16, target=64, buffer=8) == (
        "knorm b=128 decode=16,buffer=8,target=64 protect=generation_prompt"
    )


def test_report_names_samples_stored_in_two_shard_files(tmp_path, caplog):
    """A sample written by two overlapping shard runs is read once, and the report says so."""
    d = tmp_path / "results"
    rows = [base_row(f"s{i}", "needle", "needle", "snapkv", SNAP, 1.0) for i in range(3)]
    h = rows[0]["method_hash"]
    for shard, part in ((0, rows[:2]), (1, rows[1:])):  # s1 in both files
        store = ResultStore(result_path(d, "needle", MODEL, "snapkv", h, shard, 2))
        for r in part:
            store.append(r)
    with pytest.warns(DuplicateRowWarning, match="1 samples"):
        built = report.build_report(d, plots=False)
    assert "**1 samples are stored in more than one results file**" in built.markdown
    assert "s1 (tiny/model, config " in built.markdown
    assert "samples are stored in more than one results file" in caplog.text
    clean = tmp_path / "clean"
    write(clean, rows)
    assert "more than one results file" not in report.build_report(clean, plots=False).markdown
