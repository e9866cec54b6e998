"""The kvpress side-by-side benchmark's arithmetic and its exits, without kvpress or a model."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eval.bench import kvpress as bench

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("prompt", [513, 1000, 3999, 4096, 4097, 8192, 32768, 131071])
@pytest.mark.parametrize("budget", [1, 64, 128, 512])
def test_compression_ratio_keeps_exactly_the_budget(prompt, budget):
    ratio = bench.compression_ratio(prompt, budget)
    assert 0 <= ratio < 1
    assert bench.kvpress_kept(prompt, ratio) == budget
    # kvpress' StreamingLLMPress zeroes prompt - int(prompt * (1 - ratio)) entries: the same count kept
    assert prompt - (prompt - int(prompt * (1 - ratio))) == budget


@pytest.mark.parametrize("prompt,budget", [(512, 512), (512, 600), (512, 0), (512, -1), (512, 2.5)])
def test_compression_ratio_refuses_a_budget_outside_the_prompt(prompt, budget):
    with pytest.raises(ValueError, match=f"budget={budget!r}"):
        bench.compression_ratio(prompt, budget)


def test_kvpress_kept_mirrors_compute_n_kept():
    assert bench.kvpress_kept(100, 1.0) == 0
    assert bench.kvpress_kept(100, 0.999) == 1  # clamped to one entry below 1.0
    assert bench.kvpress_kept(100, 0.75) == 25


def test_blocks_are_abba():
    assert bench.block_order("ours", "kvpress") == ["ours", "kvpress", "kvpress", "ours"]


def test_round_ratio_from_medians_and_means():
    r = bench.round_ratio([0.1, 0.3, 0.2], [0.1, 0.1, 0.2])
    assert r["ours_ms"] == pytest.approx(200) and r["kvpress_ms"] == pytest.approx(100)
    assert r["ratio"] == pytest.approx(2.0)
    assert r["ratio_mean"] == pytest.approx(0.2 / (0.4 / 3))
    with pytest.raises(ValueError, match="kvpress step times"):
        bench.round_ratio([0.1], [])
    with pytest.raises(ValueError, match="ours step times"):
        bench.round_ratio([0.1, 0.0], [0.1])


def _rows():
    rows = []
    for i, (a, b) in enumerate([(1.0, 1.1), (1.2, 0.9), (1.4, 1.0), (1.1, 1.05), (1.3, 1.2)]):
        rows.append(dict(round=i + 1, pair="snapkv", ours_ms=60 * a, kvpress_ms=60.0, ratio=a, ratio_mean=a,
                         ours_mean_ms=60 * a, kvpress_mean_ms=60.0, other_cores=0.5))  # fmt: skip
        rows.append(dict(round=i + 1, pair="full", ours_ms=100 * b, kvpress_ms=100.0, ratio=b, ratio_mean=b,
                         ours_mean_ms=100 * b, kvpress_mean_ms=100.0, other_cores=0.5))  # fmt: skip
    return rows


def test_summary_is_median_and_quartiles_of_the_round_ratios():
    s = bench.summarise(_rows())
    assert list(s) == ["snapkv", "full"]
    assert (s["snapkv"].median, s["snapkv"].q1, s["snapkv"].q3, s["snapkv"].n) == pytest.approx(
        (1.2, 1.1, 1.3, 5)
    )
    assert (s["full"].median, s["full"].q1, s["full"].q3) == pytest.approx((1.05, 1.0, 1.1))
    table = bench.summary_table(_rows())
    assert "1.200 [1.100, 1.300]" in table and "1.050 [1.000, 1.100]" in table
    assert bench.summarise([]) == {}


def test_csv_holds_one_row_per_round_and_pair(tmp_path):
    path = tmp_path / "sub" / "r.csv"
    bench.write_csv(_rows(), path)
    with path.open() as f:
        got = list(csv.DictReader(f))
    assert len(got) == 10 and list(got[0]) == bench.CSV_COLUMNS
    assert [float(r["ratio"]) for r in got if r["pair"] == "snapkv"] == [1.0, 1.2, 1.4, 1.1, 1.3]


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--budget", "4096"], "budget=4096"),
        (["--rounds", "0"], "rounds=0"),
        (["--n-sink", "512"], "n_sink=512"),
        (["--profile-steps", "-1"], "profile_steps=-1"),
    ],
)
def test_bad_arguments_exit_2_naming_the_value(argv, needle, capsys):
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err


def test_missing_kvpress_skips_with_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "kvpress", None)  # import kvpress -> ImportError
    assert bench.kvpress_version() is None
    assert bench.main([]) == bench.SKIP_EXIT == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("skipped: kvpress is not importable")


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_script_exits_2_without_kvpress():
    code = (
        "import sys, runpy; sys.modules['kvpress'] = None; sys.argv = ['bench_kvpress.py']; "
        "runpy.run_path('scripts/bench_kvpress.py', run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().startswith("skipped: kvpress is not importable") and not p.stdout
