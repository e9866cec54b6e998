"""The report's protocol section on hand-made rows: score per question index, reuse penalty with its
paired bootstrap interval, amortised cost, the figure; older rows read as a protocol."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from scipy.stats import bootstrap

from eval import stats
from eval.report import build_report, prepare
from eval.report import protocols as protocol_report
from eval.store import ROW_FIELDS, ResultStore, config_hash, result_path

MiB = 2**20
SNAP = {"budget": 64}
PARAMS = {"full": {}, "snapkv": SNAP}
# (method, protocol) -> score of c{c}_q{q} at [c][q]
SCORES = {
    ("full", "query_aware"): [[1, 1, 1], [1, 1, 1]],
    ("full", "multi_request"): [[1, 1, 1], [1, 1, 1]],
    ("snapkv", "query_aware"): [[1, 1, 1], [1, 1, 1]],
    ("snapkv", "multi_request"): [[1, 0, 0], [1, 1, 0]],
    ("snapkv", "first_question"): [[1, 1, 1], [1, 1, 0]],
    ("snapkv", "multi_turn"): [[1, 0, 0], [0, 0, 0]],
}
SHARED_PREFILL = {"c0": 3.0, "c1": 6.0}  # one compression per context, three questions each
TPOT = [0.01, 0.02, 0.03]


def row(method, params, protocol, c, q, score, **kw):
    shared = protocol in ("first_question", "multi_request", "multi_turn")
    r = {
        **dict.fromkeys(ROW_FIELDS),
        "sample_id": f"c{c}_q{q}",
        "model": "m",
        "model_path": "m",
        "task": "askmany",
        "dataset": "askmany",
        "method": method,
        "method_params": params,
        "method_hash": config_hash({"method": method, "params": params, "protocol": protocol}),
        "query_aware": protocol in ("query_aware", "first_question"),
        "protocol": protocol,
        "context_id": f"c{c}",
        "question_index": q,
        "questions_in_context": 3,
        "kv_bytes": 3 * MiB,
        "kv_bytes_full": 9 * MiB,
        "prefill_s": SHARED_PREFILL.get(f"c{c}", 3.0) if shared else 3.0,
        "context_prefill_s": SHARED_PREFILL.get(f"c{c}", 3.0) if shared else 3.0,
        "ttft_s": 0.1,
        "tpot_s": TPOT[q],
        "rollback_bytes": (c * MiB) if protocol in ("multi_request", "first_question") else None,
        "score": float(score),
        "scores": {},
        "status": "ok",
        "answers": ["x"],
        "prediction": "x",
    }
    r.update(kw)
    return r


def hand_rows() -> list[dict]:
    return [
        row(m, PARAMS[m], protocol, c, q, s)
        for (m, protocol), grid in SCORES.items()
        for c, scores in enumerate(grid)
        for q, s in enumerate(scores)
    ]


@pytest.fixture
def part() -> pd.DataFrame:
    return protocol_report.frame(prepare(pd.DataFrame(hand_rows())))


def test_score_per_question_index(part):
    table = protocol_report.decay(part)
    assert list(table.index) == [
        ("full", "query_aware"),
        ("full", "multi_request"),
        ("snapkv b=64", "query_aware"),
        ("snapkv b=64", "first_question"),
        ("snapkv b=64", "multi_request"),
        ("snapkv b=64", "multi_turn"),
    ]  # the full cache first; protocols in their documented order
    assert table.loc[("snapkv b=64", "multi_request"), [1, 2, 3]].tolist() == [100.0, 50.0, 0.0]
    assert table.loc[("snapkv b=64", "first_question"), [1, 2, 3]].tolist() == [100.0, 100.0, 50.0]
    assert table.loc[("snapkv b=64", "multi_turn"), [1, 2, 3]].tolist() == [50.0, 0.0, 0.0]
    assert table.loc[("snapkv b=64", "multi_request"), "all"] == 50.0
    assert table.loc[("full", "multi_request"), "n"] == 6
    md = protocol_report.decay_table(part, "askmany — m")
    assert "| snapkv b=64 | multi_request | 6 | 100.00 | 50.00 | 0.00 | 50.00 |" in md
    assert "| full | multi_request | 6 | 100.00 | 100.00 | 100.00 | 100.00 |" in md
    assert "(2)" not in md and "brackets" not in md  # every question on 2 contexts: no cell n needed

    # A run not finished: the last context's third question missing; its row gives each cell's n.
    rows = [r for r in hand_rows() if not (r["method"] == "snapkv" and r["protocol"] == "multi_request"
                                           and r["context_id"] == "c1" and r["question_index"] == 2)]  # fmt: skip
    md = protocol_report.decay_table(protocol_report.frame(prepare(pd.DataFrame(rows))), "askmany — m")
    assert "| snapkv b=64 | multi_request | 5 | 100.00 (2) | 50.00 (2) | 0.00 (1) | 60.00 |" in md
    assert "| full | multi_request | 6 | 100.00 | 100.00 | 100.00 | 100.00 |" in md
    assert "each cell gives its n in brackets" in md


def test_reuse_penalty_is_paired_by_sample_with_a_seeded_bootstrap(part):
    table = protocol_report.reuse_penalty(part).set_index(["method_key", "protocol"])
    mr = table.loc[("snapkv b=64", "multi_request")]
    # Differences to query_aware (all 1): c0: 0, -100, -100; c1: 0, 0, -100.
    assert (mr["n"], mr["penalty"], mr["n_later"], mr["penalty_later"]) == (6, -50.0, 4, -75.0)
    # Two contexts (the unit): below stats.MIN_N, the interval and p are withheld.
    assert (mr["contexts"], mr["contexts_later"]) == (2, 2)
    assert math.isnan(mr["low"]) and math.isnan(mr["high"]) and math.isnan(mr["p"])
    fq = table.loc[("snapkv b=64", "first_question")]
    assert fq["penalty"] == pytest.approx(-100 / 6) and fq["penalty_later"] == -25.0
    assert table.loc[("full", "multi_request"), "penalty"] == 0.0
    assert ("snapkv b=64", "query_aware") not in table.index
    md = protocol_report.penalty_table(part, "askmany — m")
    assert "| snapkv b=64 | multi_request | 6 (2) | -50.00 | — | — | 4 (2) | -75.00 | — | — |" in md

    # Pairs only where both sides have an ok row: a failed query_aware row drops its pair.
    rows = hand_rows()
    for r in rows:
        if (r["method"], r["protocol"], r["sample_id"]) == ("snapkv", "query_aware", "c0_q1"):
            r.update(status="error", score=None)
    again = protocol_report.reuse_penalty(protocol_report.frame(prepare(pd.DataFrame(rows))))
    again = again.set_index(["method_key", "protocol"]).loc[("snapkv b=64", "multi_request")]
    assert (again["n"], again["penalty"]) == (5, -40.0)


def test_compression_loss_is_paired_against_the_full_cache_under_the_same_protocol(part):
    table = protocol_report.compression_penalty(part).set_index(["method_key", "protocol"])
    # no full-cache rows under first_question / multi_turn: nothing to pair with
    assert list(table.index) == [("snapkv b=64", "query_aware"), ("snapkv b=64", "multi_request")]
    qa, mr = table.loc[("snapkv b=64", "query_aware")], table.loc[("snapkv b=64", "multi_request")]
    assert (qa["n"], qa["loss"], qa["n_shift"]) == (6, 0.0, 0) and math.isnan(qa["shift"])
    # multi_request minus full multi_request: 0, -100, -100, 0, 0, -100; query_aware's loss is 0
    assert (mr["n"], mr["loss"], mr["n_shift"], mr["shift"]) == (6, -50.0, 6, -50.0)
    assert mr["contexts"] == 2 and math.isnan(mr["low"])  # two contexts: withheld
    md = protocol_report.compression_table(part, "askmany — m")
    assert (
        "| snapkv b=64 | multi_request | 6 (2) | -50.00 | — | — | 6 (2) | -50.00 | — | — |" in md
        and "| snapkv b=64 | query_aware | 6 (2) | +0.00 |" in md
    )
    # the full cache failing one multi_request question drops that pair from the loss and the shift
    rows = hand_rows()
    for r in rows:
        if (r["method"], r["protocol"], r["sample_id"]) == ("full", "multi_request", "c0_q1"):
            r.update(status="error", score=None)
    again = protocol_report.compression_penalty(protocol_report.frame(prepare(pd.DataFrame(rows))))
    again = again.set_index(["method_key", "protocol"]).loc[("snapkv b=64", "multi_request")]
    assert (again["n"], again["loss"], again["n_shift"], again["shift"]) == (5, -40.0, 5, -40.0)
    assert protocol_report.compression_penalty(part[part["method"] != "full"]).empty


def test_intervals_resample_contexts_and_few_contexts_give_the_exact_sign_flip_p():
    """Eight contexts of three questions: the loss's interval is the unit bootstrap over the eight
    contexts and its p the exact sign-flip p over them (8 < stats.FEW_UNITS), not a test of 24
    independent questions."""
    lost = {0: [0, 0, 1], 1: [0, 1, 1], 2: [1, 1, 1], 3: [0, 0, 0], 4: [1, 1, 1], 5: [0, 1, 1], 6: [1, 1, 1],
            7: [1, 0, 1]}  # fmt: skip
    rows = [
        row(m, PARAMS[m], protocol, c, q, 1.0 if m == "full" or protocol == "query_aware" else lost[c][q])
        for m in ("full", "snapkv")
        for protocol in ("query_aware", "multi_request")
        for c in range(8)
        for q in range(3)
    ]
    part = protocol_report.frame(prepare(pd.DataFrame(rows)))
    mr = protocol_report.compression_penalty(part).set_index(["method_key", "protocol"])
    mr = mr.loc[("snapkv b=64", "multi_request")]
    diffs = np.array([100.0 * (lost[c][q] - 1) for c in range(8) for q in range(3)])
    contexts = np.repeat([f"c{c}" for c in range(8)], 3)
    want = stats.compare_differences(diffs, contexts)
    assert (mr["n"], mr["contexts"], mr["loss"]) == (24, 8, pytest.approx(diffs.mean()))
    assert (mr["low"], mr["high"]) == (want.lo, want.hi)
    per_context = diffs.reshape(8, 3).mean(axis=1)  # five contexts lost something, all the same way
    assert mr["p"] == pytest.approx(stats.sign_flip_p(per_context)) == pytest.approx(2 / 2**5)
    assert mr["p"] > want.p  # the percentile bootstrap over 8 clusters reads narrower


def test_the_bootstrap_of_one_stratum_is_scipys_and_resamples_contexts_not_questions():
    """Without clusters it is scipy's bootstrap of the mean (the same seeded draws); with them,
    questions that move together within a context widen the interval to what the contexts support."""
    diffs = np.array([0.0, 0.0, 0.0, 0.0, -100.0, -100.0, -100.0, -100.0])
    want = bootstrap(
        (diffs,), np.mean, n_resamples=stats.RESAMPLES, confidence_level=0.95, method="percentile",
        rng=np.random.default_rng(stats.SEED),
    ).confidence_interval  # fmt: skip
    b = stats.unit_bootstrap(diffs)
    assert (b.lo, b.hi) == pytest.approx((want.low, want.high))
    clustered = stats.unit_bootstrap(diffs, ["a"] * 4 + ["b"] * 4)
    assert (clustered.lo, clustered.hi) == pytest.approx((-100.0, 0.0))  # two contexts: nothing narrower
    assert clustered.lo < want.low and want.high < clustered.hi


def test_amortised_cost(part):
    table = protocol_report.amortised(part).set_index(["method_key", "protocol"])
    mr = table.loc[("snapkv b=64", "multi_request")]
    assert mr["contexts"] == 2 and mr["N"] == 3
    assert mr["prefill_per_question_s"] == 1.5  # median of 3/3 (x3) and 6/3 (x3)
    assert mr["tpot_s"] == 0.02 and mr["ttft_s"] == 0.1
    assert mr["kv_bytes_per_question"] == 1 * MiB  # one 3 MiB cache serves 3 questions
    assert mr["rollback_bytes"] == 0.5 * MiB
    qa = table.loc[("snapkv b=64", "query_aware")]
    assert qa["prefill_per_question_s"] == 3.0 and qa["kv_bytes_per_question"] == 3 * MiB
    assert math.isnan(qa["rollback_bytes"]) and math.isnan(
        table.loc[("snapkv b=64", "multi_turn"), "rollback_bytes"]
    )
    md = protocol_report.cost_table(part, "askmany — m")
    assert "| snapkv b=64 | multi_request | 2 | 3.0 | 1.5000 | 0.1000 | 20.00 | 1.000 | 0.500 |" in md
    assert "| snapkv b=64 | multi_turn | 2 | 3.0 | 1.5000 | 0.1000 | 20.00 | 1.000 | — |" in md


def test_older_rows_read_as_a_protocol_and_labels_keep_protocols_apart():
    old = [row("snapkv", SNAP, "query_aware", 0, 0, 1, query_aware=qa) for qa in (True, False)]
    old[1]["sample_id"] = "other"
    for r in old:  # written before these columns existed
        for k in ("protocol", "context_id", "question_index", "questions_in_context", "context_prefill_s"):
            del r[k]
    df = prepare(pd.DataFrame(old + hand_rows()))
    by = df.drop_duplicates(["protocol", "method"]).set_index(["protocol", "method"])
    assert df.loc[df["sample_id"] == "other", "protocol"].tolist() == ["context_only"]
    assert by.loc[("context_only", "snapkv"), "config_label"] == "snapkv b=64 q-agnostic"
    assert by.loc[("query_aware", "snapkv"), "config_label"] == "snapkv b=64"
    assert by.loc[("multi_turn", "snapkv"), "config_label"] == "snapkv b=64 (multi_turn)"
    assert by.loc[("multi_turn", "snapkv"), "label"] == "snapkv b=64 (multi_turn)"
    assert by.loc[("context_only", "snapkv"), "label"] == "snapkv b=64"  # summary keys split on query_aware
    assert protocol_report.frame(df).loc[
        lambda d: d["sample_id"] == "other", "context_prefill_s"
    ].tolist() == [3.0]


def test_single_protocol_single_question_rows_get_no_section():
    rows = [row("snapkv", SNAP, "query_aware", c, 0, 1) for c in range(3)]
    assert protocol_report.sections(prepare(pd.DataFrame(rows))) == []


def test_report_writes_the_section_and_the_figure(tmp_path):
    d = tmp_path / "results"
    for r in hand_rows():
        ResultStore(result_path(d, r["task"], r["model"], r["method"], r["method_hash"])).append(r)
    report = build_report(d)
    text = report.report_md.read_text()
    assert "## Protocols" in text and "### Score per question — askmany — m" in text
    assert "### Reuse penalty — askmany — m" in text and "### Amortised cost — askmany — m" in text
    figure = d / "protocols_askmany_m.png"
    assert figure in report.plots and figure.stat().st_size > 1000
    summary = pd.read_csv(report.summary_csv)  # multi_request / multi_turn stay apart
    assert {"snapkv b=64 (multi_request)", "snapkv b=64 (multi_turn)", "snapkv b=64"} <= set(summary["label"])
