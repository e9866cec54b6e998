"""Paired comparisons (eval/stats.py, eval/report/paired.py): the tests against scipy and a hand computation, and the
report's "Paired comparisons" section, paired.csv and flips.csv built from stored rows."""

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import binomtest, bootstrap
from test_report import SNAP, base_row, write

from eval import stats
from eval.report import build_report
from eval.store import sample_keys, sha256_hex, target_sha


def test_mcnemar_is_scipys_binomial_test_of_the_discordant_pairs():
    baseline = np.array([1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1, 1])
    config = np.array([1, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1])  # broke 5, fixed 1, 12 pairs
    c = stats.mcnemar(config, baseline)
    ref = binomtest(1, 6, 0.5)
    assert c.n == 12 and c.test == "mcnemar"
    assert c.diff == pytest.approx(100 * (1 - 5) / 12)
    assert c.p == pytest.approx(ref.pvalue)
    ci = ref.proportion_ci(confidence_level=0.95, method="exact")
    assert (c.lo, c.hi) == pytest.approx((100 * (2 * ci.low - 1) * 6 / 12, 100 * (2 * ci.high - 1) * 6 / 12))
    assert c.lo <= c.diff <= c.hi
    same = stats.mcnemar(baseline, baseline)  # no discordant pair
    assert (same.diff, same.lo, same.hi, same.p) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError, match="n=0"):
        stats.mcnemar(np.array([]), np.array([]))


def test_bootstrap_of_one_stratum_agrees_with_scipys_paired_bootstrap():
    rng = np.random.default_rng(1)
    baseline = rng.uniform(0, 1, 40)
    config = np.clip(baseline - rng.normal(0.1, 0.2, 40), 0, 1)
    c = stats.stratified_bootstrap(100 * (config - baseline), resamples=20000)
    ref = bootstrap(
        (config, baseline),
        lambda a, b, axis: 100 * np.mean(a - b, axis=axis),
        paired=True,
        n_resamples=20000,
        method="percentile",
        random_state=0,
    )
    assert c.test == "bootstrap" and c.n == 40
    assert c.diff == pytest.approx(100 * np.mean(config - baseline))
    # Different random streams: the two percentile intervals agree to a fraction of their width.
    width = ref.confidence_interval.high - ref.confidence_interval.low
    assert abs(c.lo - ref.confidence_interval.low) < 0.05 * width
    assert abs(c.hi - ref.confidence_interval.high) < 0.05 * width
    assert 0 < c.p < 0.05 and not c.lo <= 0 <= c.hi  # p below 5% exactly when 0 is outside


def test_bootstrap_resamples_within_strata_and_weighs_strata_equally():
    # Constant differences inside each stratum: resampling within strata changes nothing.
    diffs = np.array([10.0, 10.0, 0, 0, 0, 0, 0, 0])
    strata = ["a", "a", "b", "b", "b", "b", "b", "b"]
    c = stats.stratified_bootstrap(diffs, strata)
    assert c.diff == pytest.approx(5.0)  # mean of the stratum means, not the 2.5 of the samples
    assert c.lo == pytest.approx(5.0) and c.hi == pytest.approx(5.0)
    unstratified = stats.stratified_bootstrap(diffs)
    assert unstratified.diff == pytest.approx(2.5) and unstratified.hi - unstratified.lo > 1
    with pytest.raises(ValueError, match="one label per difference"):
        stats.stratified_bootstrap(diffs, strata[:-1])


def test_holm_against_a_hand_computation():
    # m = 4 finite: sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 ->
    # running max 0.02, 0.03, 0.06, 0.06.
    got = stats.holm([0.01, 0.04, 0.03, math.nan, 0.005])
    np.testing.assert_allclose(got, [0.03, 0.06, 0.06, math.nan, 0.02])
    np.testing.assert_allclose(stats.holm([0.5, 0.9]), [1.0, 1.0])  # capped at 1
    assert stats.holm([]).size == 0


def test_the_interval_is_withheld_below_the_minimum_n():
    base = np.array([1.0, 1, 1, 1, 1, 1])
    conf = np.array([0.0, 0, 0, 1, 1, 1])
    at = stats.compare(conf[: stats.MIN_N], base[: stats.MIN_N])
    assert at.n == stats.MIN_N and math.isfinite(at.lo) and math.isfinite(at.p)
    below = stats.compare(conf[: stats.MIN_N - 1], base[: stats.MIN_N - 1])
    assert below.n == stats.MIN_N - 1 and math.isnan(below.lo) and math.isnan(below.hi)
    assert math.isnan(below.p) and below.diff == pytest.approx(-75.0)
    graded = stats.compare(np.array([0.5, 0.2, 0.1, 0.3, 0.4]), np.array([0.6, 0.4, 0.3, 0.3, 0.9]))
    assert graded.test == "bootstrap" and math.isfinite(graded.lo)


CELLS = [(1000, 0), (1000, 50), (2000, 0), (2000, 50), (4000, 0), (4000, 50)]


def needle_row(method, params, length, depth, score, prompt="", kv_bytes=None, **kw):
    sid = f"needle-{length}-{depth}"
    row = base_row(
        sid, "needle", "needle", method, params, score, context_length=length, depth_percent=depth, **kw
    )
    row["prompt_sha"] = sha256_hex(f"haystack {length} needle at {depth}{prompt}")
    row["target_sha"] = target_sha(row["answers"])
    if kv_bytes is not None:
        row["kv_bytes"] = kv_bytes
    return row


def report_of(tmp_path, rows):
    d = tmp_path / "r"
    write(d, rows)
    report = build_report(d, plots=False)
    assert report.paired_csv == d / "paired.csv" and report.flips_csv == d / "flips.csv"
    return report.markdown, pd.read_csv(d / "paired.csv"), pd.read_csv(d / "flips.csv")


def test_a_config_that_ran_fewer_prompts_is_paired_on_the_shared_ones(tmp_path):
    """full ran 6 needle prompts, snapkv 4: 3 of the same prompts and one whose prompt text differs
    (same sample id, another haystack): the paired row has n_shared = 3, the interval withheld."""
    rows = [needle_row("full", {}, n, d, 1.0) for n, d in CELLS]
    rows += [needle_row("snapkv", SNAP, n, d, 0.0 if n == 2000 else 1.0) for n, d in CELLS[:3]]
    rows.append(needle_row("snapkv", SNAP, *CELLS[3], 0.0, prompt=" (another haystack)"))
    md, table, _ = report_of(tmp_path, rows)
    assert list(table.columns[:12]) == [
        "task", "dataset", "model", "config", "baseline", "n_shared", "diff", "lo", "hi", "p", "p_holm", "test"
    ]  # fmt: skip
    (row,) = table.itertuples()
    assert (row.task, row.dataset, row.config, row.baseline) == (
        "needle",
        "needle",
        "snapkv b=128 w=32 k=7 max",
        "full",
    )
    assert row.n_shared == 3 and row.matched_by == "content" and row.test == "mcnemar"
    assert row.diff == pytest.approx(-100 / 3)
    assert math.isnan(row.lo) and math.isnan(row.hi) and math.isnan(row.p) and math.isnan(row.p_holm)
    assert "## Paired comparisons" in md
    assert "| needle | snapkv b=128 w=32 k=7 max | full | -33.3 (n=3) | n<5 | — | — | mcnemar |" in md


def test_rows_without_hashes_are_matched_by_sample_id(tmp_path):
    rows = [needle_row("full", {}, n, d, 1.0) for n, d in CELLS]
    rows += [needle_row("snapkv", SNAP, n, d, 0.0 if d == 50 else 1.0) for n, d in CELLS]
    for r in rows:
        r.pop("prompt_sha"), r.pop("target_sha")
    _, table, _ = report_of(tmp_path, rows)
    (row,) = table.itertuples()
    assert row.matched_by == "sample_id" and row.n_shared == 6
    assert row.diff == pytest.approx(-50.0) and row.p == pytest.approx(binomtest(0, 3, 0.5).pvalue)
    assert row.lo == pytest.approx(-50.0) and row.diff < row.hi  # every discordant pair broke


def test_flip_table_names_what_compression_broke_and_fixed(tmp_path):
    full = {(1000, 0): 1.0, (1000, 50): 0.0, (2000, 0): 1.0, (2000, 50): 1.0, (4000, 0): 1.0, (4000, 50): 0.0}
    snap = {(1000, 0): 1.0, (1000, 50): 1.0, (2000, 0): 0.0, (2000, 50): 1.0, (4000, 0): 0.0, (4000, 50): 0.0}
    rows = [needle_row("full", {}, n, d, full[n, d]) for n, d in CELLS]
    rows += [needle_row("snapkv", SNAP, n, d, snap[n, d]) for n, d in CELLS]
    md, _, flips = report_of(tmp_path, rows)
    got = {
        (r.change, r.context_length, r.depth_percent, r.baseline_score, r.score) for r in flips.itertuples()
    }
    assert got == {("broke", 2000, 0, 1.0, 0.0), ("broke", 4000, 0, 1.0, 0.0), ("fixed", 1000, 50, 0.0, 1.0)}
    assert set(flips["config"]) == {"snapkv b=128 w=32 k=7 max"} and set(flips["baseline"]) == {"full"}
    assert "### needle — tiny/model: flips against the full cache" in md
    assert "| snapkv b=128 w=32 k=7 max | 2 | 2000/0, 4000/0 | 1 | 1000/50 |" in md


def test_pairs_whose_realised_bytes_differ_are_flagged(tmp_path):
    """Against SnapKV at the same budget: 2% more realised KV bytes is flagged, 0.5% is not; the
    full cache's bytes differ by design and are never flagged."""
    h2o = {"budget": 128}
    streaming = {"budget": 128, "n_sink": 4}
    rows = [needle_row("full", {}, n, d, 1.0) for n, d in CELLS]
    rows += [needle_row("snapkv", SNAP, n, d, 1.0, kv_bytes=1000) for n, d in CELLS]
    rows += [needle_row("h2o", h2o, n, d, 1.0, kv_bytes=1020) for n, d in CELLS]
    rows += [needle_row("streamingllm", streaming, n, d, 1.0, kv_bytes=1005) for n, d in CELLS]
    md, table, _ = report_of(tmp_path, rows)
    flags = {(r.config, r.baseline): r.bytes_differ for r in table.itertuples()}
    assert flags == {
        ("h2o b=128", "full"): False,
        ("h2o b=128", "snapkv b=128 w=32 k=7 max"): True,
        ("snapkv b=128 w=32 k=7 max", "full"): False,
        ("streamingllm b=128 s=4", "full"): False,
        ("streamingllm b=128 s=4", "snapkv b=128 w=32 k=7 max"): False,
    }
    h = table[(table["config"] == "h2o b=128") & (table["baseline"] != "full")].iloc[0]
    assert (h["kv_bytes"], h["baseline_kv_bytes"]) == (1020, 1000)
    flagged = [ln for ln in md.splitlines() if ln.endswith("| bytes differ |")]
    assert len(flagged) == 1 and flagged[0].startswith("| needle | h2o b=128 | snapkv b=128 w=32 k=7 max |")
    # Holm over the table's 5 rows: every p is 1 (no discordant pair), so is every adjusted p.
    assert (table["p"] == 1.0).all() and (table["p_holm"] == 1.0).all()


def test_longbench_rows_get_a_row_per_dataset_and_a_stratified_all(tmp_path):
    rows = []
    for i in range(6):
        for ds, s in (("qasper", 0.4), ("hotpotqa", 0.9)):
            rows.append(base_row(f"{ds}-{i}", "longbench", ds, "full", {}, s))
            rows.append(base_row(f"{ds}-{i}", "longbench", ds, "snapkv", SNAP, s - 0.1 * (i % 2)))
    _, table, _ = report_of(tmp_path, rows)
    assert list(table["dataset"]) == ["hotpotqa", "qasper", "all"]
    assert (table["test"] == "bootstrap").all() and list(table["n_shared"]) == [6, 6, 12]
    assert table["diff"].tolist() == pytest.approx([-5.0, -5.0, -5.0])
    assert (table["lo"] < table["diff"]).all() and (table["diff"] < table["hi"]).all()


def test_sampled_rows_pair_on_their_seed():
    """Several samples of one prompt share its content hashes; each pairs with the same seed."""
    rows = pd.DataFrame(
        {
            "prompt_sha": ["p", "p", "p"],
            "target_sha": ["t", "t", "t"],
            "sample_seed": [11, 12, None],
            "task": ["reasoning"] * 3,
            "dataset": ["d"] * 3,
            "sample_id": ["a#0", "a#1", "a"],
        }
    )
    assert sample_keys(rows).tolist() == ["p:t:11", "p:t:12", "p:t"]
