"""The speed scripts, exercised on CPU at toy sizes (the numbers themselves are not asserted)."""

from __future__ import annotations

import csv
import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import random_ids, tiny_model

from eval import machine
from eval.bench import floor, pair
from eval.bench import run as bench
from eval.bench.clock import PhaseProbe, Reference, _Call
from eval.bench.report import (
    TARGETS,
    agreement,
    decode_step_ratios,
    default_clock,
    kept_rounds,
    prefill_ratios,
    ratio_spreads,
    round_ratios,
    rounds_needed,
    summarise_run,
    verdict,
)
from eval.bench.run import compose, plan, rotated
from eval.stats import Spread, timing_summary
from snapkv import build_method, generate_ids
from snapkv.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]


def _run(args, env=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, env=env, timeout=timeout)


TOY = ["model=random:llama-tiny", "budget=48", "window=8", "decode_tokens=4", "rounds=2"]


def test_phase_probe_splits_prefill_and_decode_forwards():
    model = tiny_model("llama")
    with PhaseProbe(model) as probe:
        generate_ids(model, random_ids(40), None, build_method("snapkv", budget=16, window=4),
                     max_new_tokens=5, stop_ids=set(), chunk_size=16)  # fmt: skip
    assert [c.tokens for c in probe.calls] == [16, 16, 8, 1, 1, 1, 1]  # three prefill chunks, 4 decode steps
    f = probe.fields()
    assert f["prefill_cpu_s"] == pytest.approx(sum(c.own for c in probe.calls[:3]))
    assert f["tpot_cpu_s"] == pytest.approx(sum(sorted(c.own for c in probe.calls[3:])[1:3]) / 2)
    assert f["prefill_other_cores"] >= 0 and f["decode_other_cores"] >= 0
    assert "tpot_ref" not in f  # no reference, no reference clock
    assert not model._forward_hooks and not model._forward_pre_hooks  # removed


@pytest.mark.parametrize("method", ["snapkv", "h2o", "streamingllm"])
def test_reference_forwards_change_nothing_the_generation_holds(method):
    """The reference runs inside the prefill (after every layer) and after every decode step; with
    methods that score and evict while decoding (h2o, streamingllm) too, the tokens, the kept
    entries and the cache's bookkeeping are those of a generation without it."""
    model = tiny_model("llama", layers=3)
    params = {"snapkv": dict(budget=16, window=4), "h2o": dict(budget=16), "streamingllm": dict(budget=16)}

    def run(prefill_reference=None, decode_reference=None):
        with PhaseProbe(model, prefill_reference, decode_reference) as probe:
            ids, res = generate_ids(model, random_ids(40), None, build_method(method, **params[method]),
                                    max_new_tokens=6, stop_ids=set(), chunk_size=16, keep_logits=True)  # fmt: skip
        return ids, res, probe

    ids0, res0, _ = run()
    ids1, res1, probe = run(Reference(model, vocab=128, tokens=7), Reference(model, vocab=128, tokens=5))
    assert ids1.tolist() == ids0.tolist()
    assert all(torch.equal(a, b) for a, b in zip(res0.logits, res1.logits, strict=True))
    assert res1.kv_tokens_per_layer == res0.kv_tokens_per_layer
    assert res1.kv_tokens_end_per_layer == res0.kv_tokens_end_per_layer
    assert res1.decode_evicted == res0.decode_evicted
    # one reference per decoder layer per prefill chunk, one per decode step
    assert [len(c.layers) for c in probe.calls] == [3, 3, 3, 0, 0, 0, 0, 0]
    assert all(c.ref_cpu > 0 for c in probe.calls[3:]) and all(c.ref_cpu is None for c in probe.calls[:3])
    f = probe.fields()
    assert (
        f["prefill_ref"] > 0
        and f["tpot_ref"] > 0
        and f["ref_prefill_cpu_s"] > 0
        and f["ref_decode_cpu_s"] > 0
    )
    assert (f["ref_prefill_tokens"], f["ref_decode_tokens"]) == (7, 5)
    # the reference's own time is off the probe's CPU and off the wall time the caller takes off
    assert len(probe.ref_wall("decode")) == 5 and probe.ref_wall("prefill") > 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())  # all removed


def test_reference_units_cancel_a_machine_that_runs_slower():
    """A machine 1.4x slower (every forward and every reference beside it 1.4x longer) leaves the
    reference-clock fields as they were, while the raw CPU fields move 1.4x; the prefill sums each
    layer over its own reference and the rest of the forward over the median reference."""

    class Ref:
        tokens = 16

    def probe(k):
        p = PhaseProbe(None, Ref(), Ref())
        p.calls = [
            _Call(
                8192, 50 * k, 50 * k, 0.0, layers=[(20 * k, 0.1 * k), (25 * k, 0.125 * k)]
            ),  # 5 s outside layers
            *(
                _Call(1, t * k, t * k, 0.0, ref_cpu=r * k)
                for t, r in [(0.08, 0.1), (0.09, 0.1), (0.1, 0.125)]
            ),
        ]
        return p.fields()

    a, b = probe(1.0), probe(1.4)
    # layers 20/0.1 + 25/0.125 = 400 references; the 5 s outside over the median prefill reference
    assert a["prefill_ref"] == pytest.approx(400 + 5 / 0.1125)
    assert a["tpot_ref"] == pytest.approx(0.8)  # median of 0.8, 0.9, 0.8
    assert b["prefill_ref"] == pytest.approx(a["prefill_ref"]) and b["tpot_ref"] == pytest.approx(
        a["tpot_ref"]
    )
    assert b["prefill_cpu_s"] == pytest.approx(1.4 * a["prefill_cpu_s"])
    assert b["tpot_cpu_s"] == pytest.approx(1.4 * a["tpot_cpu_s"])


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_bench_speed_bad_input_is_one_line(tmp_path, capsys):
    proc = _run([sys.executable, "scripts/bench_speed.py", "methods=[full,pyramid]", f"out={tmp_path}/b.csv"])
    err = proc.stderr.strip()
    assert proc.returncode == 2 and err.splitlines() == [err] and "pyramid" in err and "Traceback" not in err
    for args, bad in [
        (["lenghts=[5]"], "lenghts"),
        (["snapkv.window=abc"], "abc"),
        (["snapkv.windw=4"], "windw"),
        (["model=bogus-model"], "bogus-model"),
        (["model=random:nope"], "nope"),
        (["rounds=0"], "rounds"),
        (["noise_threshold=-1"], "noise_threshold"),
        (["resume=maybe"], "resume"),
        (["clock=ref", "reference_tokens.decode=0"], "reference_tokens.decode"),
        (["reference_tokens=16"], "reference_tokens"),
        (["clock=sundial"], "sundial"),
        (["configs=[full@512,snapkv]"], "snapkv"),
        (["configs=[streamingllm@512]"], "streamingllm"),
        (["budget"], "budget"),
    ]:
        assert bench.main([*args, f"out={tmp_path}/b.csv"]) == 2, args
        err = capsys.readouterr().err.strip()
        assert err.splitlines() == [err] and err.startswith("error: ") and bad in err, (args, err)
    assert not (tmp_path / "b.csv").exists()  # nothing ran


def test_every_method_parameter_passes_through_from_conf_method():
    cfg = compose(["methods=[snapkv,h2o,streamingllm]", "budget=96", "snapkv.pooling=avg", "snapkv.window=16",
                   "h2o.recent=8", "h2o.normalize=true", "n_sink=2", "configs=[snapkv@512,h2o@512]"])  # fmt: skip
    assert cfg.method_params["snapkv"] == {"budget": 96, "window": 16, "kernel_size": 7, "pooling": "avg",
                                           "gqa_reduce": "mean", "gqa_order": "reduce_first",
                                           "span": None}  # fmt: skip
    assert cfg.method_params["h2o"]["recent"] == 8 and cfg.method_params["h2o"]["normalize"] is True
    assert cfg.method_params["h2o"]["block_size"] == 256  # the dataclass's, through conf/method/h2o.yaml
    assert cfg.method_params["streamingllm"]["n_sink"] == 2
    assert [(c.method, c.input_tokens) for c in plan(cfg)] == [("snapkv", 512), ("h2o", 512)]
    assert cfg.model.name == "smollm2-135m-instruct" and cfg.model.dtype == "float32"  # conf/model/
    cfg = compose(["model=random:llama-tiny", "dtype=bfloat16", "device=cpu"])
    assert (cfg.model.name, cfg.model.dtype) == ("random:llama-tiny", "bfloat16")


def _rows(times: dict[tuple[str, int], float], rounds: int, scale=lambda r: 1.0, noisy=lambda r: False):
    rows = []
    for r in range(rounds):
        for (method, length), t in times.items():
            rows.append(dict(round=r, method=method, input_tokens=length, batch_size=1, status="ok",
                             prefill_s=t * scale(r), tpot_s=t * scale(r) / 100, noisy=noisy(r),
                             other_cores=2.0 if noisy(r) else 0.0))  # fmt: skip
    return rows


def test_ratios_are_per_round_then_median_and_iqr_over_kept_rounds():
    times = {("full", 512): 1.0, ("full", 8192): 20.0, ("snapkv", 8192): 20.4, ("h2o", 8192): 22.0}
    # Round r runs everything (1 + r) times slower: pooled medians across rounds would be wrong,
    # per-round ratios are unaffected.
    rows = _rows(times, 5, scale=lambda r: 1 + r)
    rows = [x for x in rows if not (x["round"] == 4 and x["method"] == "snapkv")] + [
        dict(rows[0], round=4, method="snapkv", input_tokens=8192, prefill_s=5 * 20.4 * 1.5, tpot_s=5 * 0.204)
    ]  # one round where snapkv alone was hit by load
    per = round_ratios(rows)
    assert per["prefill snapkv/full(L)"][0] == pytest.approx(1.02)
    assert per["prefill snapkv/full(L)"][4] == pytest.approx(1.53)
    s = ratio_spreads(rows)
    assert ratio_spreads(rows, "cpu")["prefill snapkv/full(L)"] is None  # no CPU columns in these rows
    for x in rows:
        x["prefill_cpu_s"], x["tpot_cpu_s"] = 2 * x["prefill_s"], 3 * x["tpot_s"]
    assert ratio_spreads(rows, "cpu")["prefill h2o/full(L)"].median == pytest.approx(1.1)
    # the reference clock reads prefill_ref / tpot_ref; a saved run defaults to it when it has them
    assert default_clock(rows) == "cpu" and ratio_spreads(rows, "ref")["prefill h2o/full(L)"] is None
    for x in rows:
        x["prefill_ref"], x["tpot_ref"] = 7 * x["prefill_s"], 5 * x["tpot_s"]
    assert default_clock(rows) == "ref"
    assert ratio_spreads(rows, "ref")["tpot full(L)/snapkv(L)"].median == pytest.approx(20 / 20.4)
    with pytest.raises(ValueError, match="sundial"):
        round_ratios(rows, "sundial")
    assert s["prefill snapkv/full(L)"].median == pytest.approx(1.02)
    assert s["prefill snapkv/full(L)"].q3 == pytest.approx(1.02)  # 4 of 5 rounds at 1.02
    assert s["tpot full(L)/snapkv(L)"].median == pytest.approx(20 / 20.4)
    assert s["prefill h2o/full(L)"].median == pytest.approx(1.1) and s["prefill h2o/full(L)"].n == 5
    # a noisy round is left out; with every round noisy, all are used
    rows = _rows(times, 4, noisy=lambda r: r == 2)
    assert (
        kept_rounds(rows) == ([0, 1, 3], [0, 1, 2, 3]) and ratio_spreads(rows)["prefill h2o/full(L)"].n == 3
    )
    rows = _rows(times, 3, noisy=lambda r: True)
    assert kept_rounds(rows) == ([0, 1, 2], [0, 1, 2])
    # a round whose rows all failed has no timings: it is no round (the only quiet one here)
    rows = _rows(times, 3, noisy=lambda r: r != 0)
    rows = [dict(x, status="error") if x["round"] == 0 else x for x in rows]
    assert kept_rounds(rows) == ([1, 2], [1, 2]) and kept_rounds(rows, all_rounds=True) == ([1, 2], [1, 2])
    assert ratio_spreads(rows)["prefill h2o/full(L)"].n == 2


def test_agreement_of_runs_is_the_spread_of_their_medians(capsys):
    times = {("full", 512): 1.0, ("full", 8192): 20.0, ("snapkv", 8192): 20.4, ("h2o", 8192): 22.0}
    a = summarise_run("a", _rows(times, 5), "wall")
    # Run b: h2o 8% slower; a machine 3x slower overall changes no ratio (they are per round).
    b = summarise_run("b", _rows({**times, ("h2o", 8192): 22.0 * 1.08}, 5, scale=lambda r: 3.0), "wall")
    text, agree = agreement([a, b])
    assert agree and "max/min - 1 = 8.0% (within 10%)" in text and "AGREE within 10%: yes" in text
    assert "| a | 20.400 [20.400, 20.400]" in text  # tpot snapkv(8K) / tpot full(512) = 0.204 / 0.01
    c = summarise_run("c", _rows({**times, ("snapkv", 8192): 20.4 * 1.2}, 5, noisy=lambda r: r == 0), "wall")
    text, agree = agreement([a, b, c])
    assert not agree and "NOT within 10%" in text and "4 of 5 (quiet)" in text and "5 of 5 (all)" in text
    assert "target <= 1.02: IQR on its side in 2 of 3 runs" in text
    assert "pooled median" in text and "rounds a run" in text
    # --all-rounds: the noisy round counts too
    c_all = summarise_run(
        "c", _rows({**times, ("snapkv", 8192): 20.4 * 1.2}, 5, noisy=lambda r: r == 0), "wall", True
    )
    assert (c_all.kept, c_all.rounds) == (5, 5) and len(c_all.per_round["prefill h2o/full(L)"]) == 5
    assert c.kept == 4 and len(c.per_round["prefill h2o/full(L)"]) == 4


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_agreement_script_prints_one_table_and_exits_2_for_a_missing_file(tmp_path):
    """scripts/bench_agreement.py: one table, exit 0 whether or not the runs agree; 2 for a missing
    file."""
    times = {("full", 512): 1.0, ("full", 8192): 20.0, ("snapkv", 8192): 20.4, ("h2o", 8192): 22.0}
    path = tmp_path / "run1.csv"
    rows = _rows(times, 3)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_agreement.py"
    out = subprocess.run([sys.executable, str(script), str(path), str(path), "--clock", "wall"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0 and "AGREE within 10%: yes (2 runs)" in out.stdout, out.stderr
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "nope.csv")], capture_output=True, text=True
    )
    assert out.returncode == 2 and "nope.csv" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_rounds_needed_from_the_per_round_spread():
    assert rounds_needed([1.0]) is None  # one round says nothing about the spread
    sd, n = rounds_needed([0.9, 1.1] * 5)  # sd 10% of the median
    assert sd == pytest.approx(0.10)
    assert n == 13  # (1.96 * sqrt(2) * 1.2533 * 0.10 / 0.10)^2 = 12.07 -> 13
    assert rounds_needed([0.9, 1.1] * 5, tolerance=0.20)[1] == 4
    assert rounds_needed([1.0, 1.0, 1.0])[1] == 1  # no spread: one round is enough


def test_verdict_needs_the_whole_iqr_on_the_target_side():
    le, ge = TARGETS[0], TARGETS[1]  # <= 1.05, >= 2.0
    assert verdict(le, Spread(1.00, 0.99, 1.04, 5)) == "MET"
    assert verdict(le, Spread(1.00, 0.99, 1.06, 5)).startswith("MEDIAN ONLY")
    assert verdict(le, Spread(1.10, 1.06, 1.12, 5)) == "NOT MET"
    assert verdict(ge, Spread(2.1, 2.01, 2.2, 5)) == "MET" and verdict(ge, Spread(2.1, 1.9, 2.2, 5)) != "MET"
    assert verdict(le, None) == "n/a"


def test_rotation_gives_every_configuration_every_slot():
    cs = list("abcd")
    orders = [rotated(cs, r) for r in range(4)]
    assert orders[0] == cs and orders[1] == list("bcda")
    assert all(sorted(o[i] for o in orders) == cs for i in range(4))


def test_cpu_noise_subtracts_own_cpu_from_machine_busy(monkeypatch):
    busy, own, clock = iter([100.0, 103.5]), iter([10.0, 11.5]), iter([50.0, 52.0])
    monkeypatch.setattr(machine, "busy_s", lambda: next(busy))
    monkeypatch.setattr(machine, "_own_cpu_s", lambda proc: next(own))
    monkeypatch.setattr(machine.time, "perf_counter", lambda: next(clock))
    with machine.CpuNoise() as n:
        pass
    # 3.5 s of machine busy time in 2 s, 1.5 s of it ours: others kept 1 core busy
    assert (n.wall_s, n.own_cpu_s, n.other_cpu_s, n.other_cores) == (2.0, 1.5, 2.0, 1.0)


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_cpu_noise_sees_a_busy_process():
    """Measured in a fresh interpreter: the test process itself may hold spinning OpenMP workers
    (OMP_WAIT_POLICY=ACTIVE after earlier torch tests), which would count as its own CPU."""
    code = (
        "import time\n"
        "from eval.machine import CpuNoise\n"
        "with CpuNoise() as n:\n"
        "    time.sleep(1.0)\n"
        "print(n.own_cpu_s, n.other_cores)\n"
    )
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
        ).stdout
    finally:
        hog.kill()
        hog.wait()
    own_cpu_s, other_cores = map(float, out.split())
    assert own_cpu_s < 0.2  # sleeping
    assert other_cores > 0.5  # the hog (plus whatever else runs) used most of a core


def test_timing_summary_gives_medians_with_noise_figures():
    df = pd.DataFrame(dict(config_label=["a"] * 4 + ["b"] * 2, status=["ok"] * 5 + ["error"],
                           prefill_s=[1.0, 2.0, 3.0, 4.0, 5.0, None], tpot_s=[0.1] * 5 + [None]))  # fmt: skip
    t = timing_summary(df).set_index("config_label")
    assert t.loc["a", "prefill_s_median"] == 2.5 and t.loc["a", "prefill_s_iqr_pct"] == pytest.approx(60.0)
    assert t.loc["a", "tpot_s_iqr_pct"] == 0.0 and t.loc["b", "n"] == 1 and "ttft_s_median" not in t


def test_oom_in_a_worker_becomes_a_row(monkeypatch):
    def fake_run(cmd, **kw):
        return subprocess.CompletedProcess(cmd, -9, "", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    spec = bench.spec_of(bench.compose([]), bench.Config("full", (), 1 << 20, 1))
    row = bench.run_subprocess(spec, 10)
    assert row["status"] == "oom" and row["input_tokens"] == 1 << 20


def test_h2o_floor_measurement_runs_at_toy_size():
    line = floor.main(64, heads=4, kv=2, d=16)
    assert line.startswith("L=64: sdpa") and line.count("x") >= 3


def test_bench_pair_alternates_in_one_process(capsys):
    out = pair.main("random:llama-tiny", short=48, long=96, pairs=2, decode=4)
    assert len(out["ratios"]) == 2 and all(r > 0 for r in out["ratios"])
    printed = capsys.readouterr().out
    assert printed.count("pair ") == 2 and "PAIRED TPOT snapkv(b=48)@96 / full@48: median" in printed
    with pytest.raises(ValueError, match="short=96, long=32"):
        pair.main("random:llama-tiny", short=96, long=32)


def test_every_catalogue_method_plans_a_json_spec():
    """A worker receives its configuration as JSON: list-valued parameters (knorm's skip_layers)
    must arrive as plain lists."""
    names = sorted(METHODS)
    cfg = bench.compose([f"methods=[{','.join(names)}]", "lengths=[64]", "skip_layers=[0,1]"])
    specs = [bench.spec_of(cfg, c) for c in bench.plan(cfg)]
    assert sorted(s["method"] for s in specs) == names
    knorm = next(s for s in specs if s["method"] == "knorm")
    assert json.loads(json.dumps(knorm))["params"]["skip_layers"] == [0, 1]


def _timed_row(column: str, rnd: int, method: str, n: int, value: float, noisy: bool = False) -> dict:
    return {"round": rnd, "method": method, "input_tokens": n, "batch_size": 1, "status": "ok",
            column: value, "noisy": noisy}  # fmt: skip


def test_decode_step_ratios_pair_each_method_with_the_full_cache_of_its_own_round():
    row = functools.partial(_timed_row, "tpot_ref")

    rows = [row(0, "full", 512, 1.0), row(0, "h2o", 2048, 1.2), row(0, "streamingllm", 2048, 1.02)]
    rows += [row(1, "full", 512, 2.0), row(1, "h2o", 2048, 2.2), row(1, "streamingllm", 2048, 2.0)]
    rows += [
        row(2, "full", 512, 1.0, noisy=True),
        row(2, "h2o", 2048, 9.9, noisy=True),
    ]  # a noisy round: left out
    got = decode_step_ratios(rows)
    assert set(got) == {"h2o", "streamingllm"}  # the long input's methods, not the full cache
    assert got["h2o"].n == 2 and got["h2o"].median == pytest.approx((1.2 + 1.1) / 2)
    assert got["streamingllm"].median == pytest.approx((1.02 + 1.0) / 2)
    assert decode_step_ratios(rows, all_rounds=True)["h2o"].n == 3
    with pytest.raises(ValueError, match="clock must be one of"):
        decode_step_ratios(rows, clock="bogus")
    # The mean step (a schedule's compressions amortised): its own column.
    for r in rows:
        r["tpot_mean_ref"] = r["tpot_ref"] * (1.5 if r["method"] == "h2o" else 1.0)
    assert decode_step_ratios(rows, mean=True)["h2o"].median == pytest.approx(1.5 * (1.2 + 1.1) / 2)
    with pytest.raises(ValueError, match="mean step is recorded for clock cpu or ref"):
        decode_step_ratios(rows, clock="wall", mean=True)


def test_prefill_ratios_pair_each_method_with_the_full_cache_at_its_length_in_its_round():
    row = functools.partial(_timed_row, "prefill_ref")

    rows = [row(0, "full", 512, 9.0), row(0, "full", 8192, 100.0), row(0, "kvzip", 8192, 400.0)]
    rows += [row(1, "full", 8192, 120.0), row(1, "kvzip", 8192, 420.0), row(1, "tova", 8192, 121.2)]
    rows += [row(2, "full", 8192, 100.0, noisy=True), row(2, "kvzip", 8192, 900.0, noisy=True)]
    got = prefill_ratios(rows)
    assert set(got) == {"kvzip", "tova"}  # the long input's methods, over the full cache at 8192
    assert got["kvzip"].n == 2 and got["kvzip"].median == pytest.approx((4.0 + 3.5) / 2)
    assert got["tova"].n == 1 and got["tova"].median == pytest.approx(1.01)  # round 1's only
    assert prefill_ratios(rows, all_rounds=True)["kvzip"].n == 3
    with pytest.raises(ValueError, match="clock must be one of"):
        prefill_ratios(rows, clock="bogus")


def test_resume_measures_only_the_cells_a_cut_short_run_lacks(tmp_path, monkeypatch, capsys):
    """A run stopped inside its second round, resumed with resume=true and more rounds: the rows
    already written stay as they are (the cut-short round's too) and only the missing
    (round, configuration) cells are measured, each once; a resume whose plan differs from the
    rows' exits 2 with one line before anything runs and leaves the file as it was."""
    out = tmp_path / "b.csv"
    args = [*TOY, "methods=[full,knorm]", "configs=[full@64,knorm@64]", "subprocess=false", "plots=false",
            f"out={out}"]  # fmt: skip
    real, calls = bench.measure.measure, []

    def cut_short(model, vocab, spec):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append((spec["method"], spec["input_tokens"]))
        return real(model, vocab, spec)

    monkeypatch.setattr(bench.measure, "measure", cut_short)
    with pytest.raises(KeyboardInterrupt):
        bench.run(compose(args))
    with out.open(newline="") as f:
        first = list(csv.DictReader(f))
    assert [(r["round"], r["method"]) for r in first] == [("0", "full"), ("0", "knorm"), ("1", "knorm")]

    calls.clear()
    monkeypatch.setattr(bench.measure, "measure", lambda *a: calls.append(a[2]["method"]) or real(*a))
    rows = bench.run(compose([*args, "rounds=3", "resume=true"]))
    assert calls == ["full", "full", "knorm"]  # round 1's full, then round 2 (rotated: full first)
    with out.open(newline="") as f:
        now = list(csv.DictReader(f))
    cells = [(r["round"], r["method"]) for r in now]
    assert sorted(cells) == sorted({(str(r), m) for r in range(3) for m in ("full", "knorm")})
    kept = {(r["round"], r["method"]): r for r in now}
    for r in first:  # unchanged, noisy now set for the rounds that completed
        assert {k: v for k, v in kept[r["round"], r["method"]].items() if k != "noisy"} == {
            k: v for k, v in r.items() if k != "noisy"
        }
    assert all(r["noisy"] in ("True", "False") for r in now) and len(rows) == 6

    before = out.read_text()
    assert bench.main([*args, "rounds=4", "resume=true", "knorm.skip_layers=[0]"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "other parameters" in err and "knorm@64" in err
    assert bench.main([*args, "configs=[full@32]", "resume=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and "full@64" in err and "not in this run" in err
    assert out.read_text() == before


@pytest.mark.parametrize(
    ("cpuinfo", "flags"),
    [
        (
            "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16 sse\n",
            ["avx512_bf16", "amx_tile", "amx_bf16"],
        ),
        (
            "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_fp16\n",
            ["avx512_bf16", "avx512_fp16"],
        ),
        ("processor\t: 0\n", []),
        (None, []),  # no /proc/cpuinfo: the dispatch level alone
    ],
)
def test_cpu_kernels_name_the_dispatch_level_and_the_matmul_flags(tmp_path, monkeypatch, cpuinfo, flags):
    path = tmp_path / "cpuinfo"
    if cpuinfo is not None:
        path.write_text(cpuinfo)
    monkeypatch.setattr(machine, "CPUINFO", str(path))
    got = machine.cpu_kernels.__wrapped__()
    assert got.split() == [torch.backends.cpu.get_cpu_capability(), *flags]
