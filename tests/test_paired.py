"""The report's "Paired comparisons" section, paired.csv and flips.csv (eval/report/paired.py) built from
stored rows; the statistics themselves are tested in tests/test_stats.py."""

import math

import pandas as pd
import pytest
from scipy.stats import binomtest
from test_report import SNAP, base_row, write

from eval.report import build_report
from eval.store import sample_keys, sha256_hex, shared_samples, target_sha

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
    assert list(table.columns[:14]) == [
        "task", "dataset", "model", "config", "baseline", "n_shared", "n_units", "diff", "lo", "hi", "p", "p_exact",
        "p_holm", "test",
    ]  # fmt: skip
    (row,) = table.itertuples()
    assert (row.task, row.dataset, row.config, row.baseline) == (
        "needle",
        "needle",
        "snapkv b=128 w=32 k=7 max",
        "full",
    )
    assert row.n_shared == 3 and row.matched_by == "content" and row.test == "mcnemar"
    # Strata weigh equally, as in the tables' averages: 1000 (two kept) 0, 2000 (one broke) -100.
    assert row.diff == pytest.approx(-50.0)
    assert math.isnan(row.lo) and math.isnan(row.hi) and math.isnan(row.p) and math.isnan(row.p_holm)
    assert math.isnan(row.p_exact)
    assert "## Paired comparisons" in md
    assert "| needle | snapkv b=128 w=32 k=7 max | full | -50.0 (n=3) | n<5 | — | — | — | mcnemar |" in md


def test_rows_without_hashes_are_matched_by_sample_id(tmp_path):
    rows = [needle_row("full", {}, n, d, 1.0) for n, d in CELLS]
    rows += [needle_row("snapkv", SNAP, n, d, 0.0 if d == 50 else 1.0) for n, d in CELLS]
    for r in rows:
        r.pop("prompt_sha"), r.pop("target_sha")
    _, table, _ = report_of(tmp_path, rows)
    (row,) = table.itertuples()
    assert row.matched_by == "sample_id" and row.n_shared == 6
    assert row.diff == pytest.approx(-50.0) and row.p == pytest.approx(binomtest(0, 3, 0.5).pvalue)
    # The interval resamples the 6 samples within the 3 context lengths (one broke, one kept in
    # each): never conditional on the discordant pairs, so not pinned to the difference.
    assert row.n_units == 6 and row.lo < row.diff < row.hi <= 0
    # 6 units: the exact sign-flip p over the three -100 differences beside them, 2 / 2^3.
    assert row.p_exact == pytest.approx(0.25) and row.p_holm == pytest.approx(0.25)


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
    assert (table["p"] == 1.0).all() and (table["p_exact"] == 1.0).all() and (table["p_holm"] == 1.0).all()


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


def test_shared_samples_are_aligned_in_the_baselines_order_by_content_or_else_by_id():
    """Content hashes match a sample whatever its id; one row without them falls back to ids for
    both sides; a duplicated sample counts once (its first row)."""
    full = [needle_row("full", {}, n, d, 1.0) for n, d in CELLS]
    snap = [needle_row("snapkv", SNAP, n, d, 0.5) for n, d in reversed(CELLS[1:4])]
    snap[0]["sample_id"] = "renamed"  # CELLS[3]: the same content under another id
    snap.append(dict(snap[1], score=0.0))  # a second row of CELLS[2]
    a, b, matched = shared_samples(pd.DataFrame(snap), pd.DataFrame(full))
    assert matched == "content"
    assert b["depth_percent"].tolist() == [d for _, d in CELLS[1:4]]  # the baseline's order
    assert a["score"].tolist() == [0.5, 0.5, 0.5] and a.index.tolist() == b.index.tolist()
    snap[2]["prompt_sha"] = None  # rows written before the hashes existed: matched by sample id
    a, b, matched = shared_samples(pd.DataFrame(snap), pd.DataFrame(full))
    assert matched == "sample_id"
    assert b["sample_id"].tolist() == ["needle-1000-50", "needle-2000-0"]
    assert a["sample_id"].tolist() == b["sample_id"].tolist()


def multi_question_row(method, params, context, question, score, protocol="multi_request", **kw):
    row = needle_row(method, params, 1000, 10 * context + question, score, prompt=f" q{question}", **kw)
    row.update(
        context_id=f"ctx-{context}", question_index=question, questions_in_context=4, protocol=protocol
    )
    return row


def test_questions_of_one_context_are_one_unit_and_the_protocol_section_owns_loss_vs_full(tmp_path):
    """Six contexts of 4 questions under multi_request: SnapKV minus H2O is compared over the 6
    contexts (the bootstrap's p, the sign-flip p beside it, not McNemar over 24 questions); SnapKV
    and H2O minus the full cache are the Protocols section's compression loss, not repeated here."""
    h2o = {"budget": 128}
    rows = []
    for c in range(6):
        for q in range(4):
            rows.append(multi_question_row("full", {}, c, q, 1.0))
            rows.append(multi_question_row("snapkv", SNAP, c, q, 1.0 if c < 4 else 0.0))
            rows.append(multi_question_row("h2o", h2o, c, q, 1.0 if c < 2 else 0.0))
    md, table, _ = report_of(tmp_path, rows)
    assert set(table["baseline"].str.startswith("full")) == {False}
    (row,) = table.itertuples()
    assert row.config.startswith("h2o b=128") and row.baseline.startswith("snapkv")
    assert (row.n_shared, row.n_units, row.test) == (24, 6, "bootstrap")
    assert row.diff == pytest.approx(-100 / 3)
    assert row.p_exact == pytest.approx(2 / 2**2)  # two contexts differ, both the same way
    assert "(n=24, 6 units)" in md and "### Compression loss per protocol" in md
