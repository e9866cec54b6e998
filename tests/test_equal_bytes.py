"""The equal-bytes report (eval/report/equal_bytes.py) on synthetic rows: configurations of the plain and
quantized caches paired where their stored bytes match within the tolerance, the intervals those of
eval.stats on the shared samples, the costs of 1/4 and 1/8 of the full cache's bytes, the figure
with the full cache drawn, and nothing rendered where there are no rows."""

import csv
import dataclasses
import importlib.util
import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_report import base_row, write

from eval.bench import run as bench
from eval.bench.report import decode_step_ratios, method_ratio_lines
from eval.report import equal_bytes as eb
from eval.report import leaderboard as lb
from eval.spec import RunSpec
from eval.stats import compare, holm
from eval.store import ResultStore, config_hash, sha256_hex, target_sha
from eval.tables import slug
from snapkv.kv_quant import KVQuant

FULL = 4000  # bytes of the full cache of every synthetic sample
KIVI4 = {"kind": "kivi", "bits": 4, "group_size": 32, "residual": 128, "order": "key_channel"}
KIVI2 = {**KIVI4, "bits": 2}
# (task, dataset, sample): a needle task and a task of two datasets (three strata), 14 samples.
SAMPLES = [("needle", "needle", i) for i in range(4)] + [
    ("toyqa", ds, i) for ds in ("single", "multikey") for i in range(5)
]


def scores(name: str) -> np.ndarray:
    """0/1 scores per sample of `SAMPLES`, drawn once per configuration."""
    if name == "full":
        return np.ones(len(SAMPLES))
    p = {"kivi4": 0.9, "kivi2": 0.6, "snap1024": 0.7, "snap512": 0.4, "combo": 0.5, "stream1024": 0.3}[name]
    seed = ["kivi4", "kivi2", "snap1024", "snap512", "combo", "stream1024"].index(name)
    return (np.random.default_rng(seed).random(len(SAMPLES)) < p).astype(float)


# name: (method, params, kv_quant, kv_bytes per sample)
CONFIGS = {
    "full": ("full", {}, None, FULL),
    "kivi4": ("full", {}, KIVI4, 1000),  # 1/4 of the bytes
    "kivi2": ("full", {}, KIVI2, 540),  # 1/8 + 8 %
    "snap1024": ("snapkv", {"budget": 1024, "window_size": 32}, None, 1040),  # within 4 % of kivi4
    "snap512": ("snapkv", {"budget": 512, "window_size": 32}, None, 500),  # 1/8
    "combo": ("snapkv", {"budget": 2048, "window_size": 32}, KIVI4, 520),  # 1/8 + 4 %
    "stream1024": ("streamingllm", {"budget": 1024}, None, 1300),  # 30 % above kivi4: no match at 10 %
}


def rows_of(name: str, drop: int = 0) -> list[dict]:
    method, params, quant, kv_bytes = CONFIGS[name]
    out = []
    for (task, dataset, i), score in list(zip(SAMPLES, scores(name)))[drop:]:
        r = base_row(f"{dataset}-{i}", task, dataset, method, params, float(score), context_length=4000,
                     depth_percent=10 * i, kv_bytes=kv_bytes, kv_bytes_full=FULL)  # fmt: skip
        if quant is not None:
            r["kv_quant"] = quant
            r["method_hash"] = config_hash({"method": method, "method_params": params, "kv_quant": quant})
        r["prompt_sha"], r["target_sha"] = sha256_hex(f"{task} {dataset} {i}"), target_sha(r["answers"])
        out.append(r)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("eb") / "equal_bytes"
    # snap512 ran every sample but the first: its pairs hold 13 shared samples
    write(d, [r for name in CONFIGS for r in rows_of(name, drop=1 if name == "snap512" else 0)])
    return d


@pytest.fixture(scope="module")
def analysis(folder):
    (a,) = eb.analyses(ResultStore.load_dir(folder))
    return a


def labelled(folder):
    rows = eb.label_rows(eb.prepare(ResultStore.load_dir(folder)))
    return rows[rows["ok"]]


def label(name: str) -> str:
    return {
        "full": "full", "kivi4": "full + kivi-4", "kivi2": "full + kivi-2", "snap1024": "snapkv b=1024 w=32",
        "snap512": "snapkv b=512 w=32", "combo": "snapkv b=2048 w=32 + kivi-4", "stream1024": "streamingllm b=1024",
    }[name]  # fmt: skip


def test_configurations_are_named_by_method_and_storage_and_sorted_by_kind(analysis):
    c = analysis.configs.set_index("config")
    assert set(c.index) == {label(n) for n in CONFIGS}
    assert c.loc["full", "kind"] == "full" and c.loc["full + kivi-4", "kind"] == "quantized"
    assert c.loc["snapkv b=2048 w=32 + kivi-4", "kind"] == "combined"
    assert c.loc["snapkv b=512 w=32", "kind"] == "eviction"
    assert list(analysis.configs["kind"]) == sorted(analysis.configs["kind"], key=eb.KINDS.index)
    assert c.loc["full + kivi-4", "fraction"] == pytest.approx(0.25)
    assert c.loc["snapkv b=512 w=32", "n"] == len(SAMPLES) - 1


def test_pairs_are_configurations_of_different_kinds_within_the_tolerance(analysis, folder):
    pairs = {(r.config, r.minus) for r in analysis.pairs.itertuples()}
    assert pairs == {
        (label("kivi4"), label("snap1024")),  # 1000 / 1040
        (label("kivi2"), label("combo")),  # 540 / 520
        (label("kivi2"), label("snap512")),  # 540 / 500
        (label("combo"), label("snap512")),  # 520 / 500
    }
    # streamingllm b=1024 stores 30 % more than KIVI-4: paired only under a wider tolerance
    wide = eb.analyse(labelled(folder), tolerance=0.35)
    assert (label("kivi4"), label("stream1024")) in {(r.config, r.minus) for r in wide.pairs.itertuples()}
    assert (label("kivi4"), label("stream1024")) not in pairs


def test_pair_intervals_are_the_paired_bootstrap_on_shared_samples_within_strata(analysis):
    """kivi-2 minus snap512 on the 13 samples both ran, strata = task/dataset (three), every number
    from eval.stats.compare; Holm over the table of the p a statement rests on."""
    row = analysis.pairs.set_index(["config", "minus"]).loc[(label("kivi2"), label("snap512"))]
    a, b = scores("kivi2")[1:], scores("snap512")[1:]
    strata = [f"{t}/{d}" for t, d, _ in SAMPLES[1:]]
    want = compare(a, b, None, strata)
    assert (row.n_shared, row.n_units) == (13, 13) and row.test == want.test
    assert (row["diff"], row.lo, row.hi, row.p) == pytest.approx((want.diff, want.lo, want.hi, want.p))
    assert row.p_exact == pytest.approx(want.p_exact) and not math.isnan(row.p_exact)  # 13 units < 20
    assert row.bytes_ratio == pytest.approx(540 / 500)
    read = analysis.pairs["p_exact"].where(analysis.pairs["p_exact"].notna(), analysis.pairs["p"])
    np.testing.assert_allclose(analysis.pairs["p_holm"], holm(read.to_numpy(float)))


def test_costs_of_a_quarter_and_an_eighth_of_the_full_bytes(analysis):
    costs = analysis.costs.set_index(["target", "config"])
    assert set(costs.index) == {
        (0.25, label("kivi4")), (0.25, label("snap1024")),
        (0.125, label("kivi2")), (0.125, label("snap512")), (0.125, label("combo")),
    }  # fmt: skip
    row = costs.loc[(0.125, label("snap512"))]
    strata = [f"{t}/{d}" for t, d, _ in SAMPLES[1:]]
    want = compare(scores("snap512")[1:], np.ones(len(SAMPLES) - 1), None, strata)
    assert (row["diff"], row.lo, row.hi) == pytest.approx((want.diff, want.lo, want.hi))
    assert row.full_score == pytest.approx(100.0) and row.n_shared == 13
    text = eb.sentences(analysis.costs)
    assert any(
        s.startswith("quantized at 1/4 of the full cache's bytes (full + kivi-4, 0.250): ") for s in text
    )
    assert any(s.startswith("eviction at 1/8") for s in text)


def test_rows_without_kv_quant_are_the_plain_cache(tmp_path):
    rows = rows_of("full") + rows_of("snap512")  # no row carries kv_quant: no such column at all
    write(tmp_path / "r", rows)
    (a,) = eb.analyses(ResultStore.load_dir(tmp_path / "r"))
    assert list(a.configs["kind"]) == ["full", "eviction"] and a.pairs.empty
    assert list(a.costs["config"]) == [label("snap512")]


def test_a_cost_counts_configurations_within_the_window_of_a_target(folder):
    """Quantized storage lands where its bits, scales and residual put it: the costs table takes a
    configuration whose realised fraction lies within `WINDOW` (25 %) of a target, not only 10 %."""
    rows = labelled(folder)
    near = eb.analyse(rows, window=0.25).costs
    assert "streamingllm b=1024" not in set(near["config"])  # 1300 / 4000 = 0.325: 30 % above 1/4
    wide = eb.analyse(rows, window=0.35).costs
    (stream,) = wide[wide["config"] == "streamingllm b=1024"].itertuples()
    assert stream.target == 0.25 and stream.fraction == pytest.approx(0.325)
    strict = eb.analyse(rows, window=0.0).costs
    assert set(strict["config"]) == {"full + kivi-4", "snapkv b=512 w=32"}  # exactly 1/4 and 1/8
    with pytest.raises(ValueError, match=r"window must be >= 0, got window=-1"):
        eb.analyse(rows, window=-1)


def test_bad_tolerance_is_refused(folder):
    with pytest.raises(ValueError, match=r"tolerance must be >= 0, got tolerance=-0.1"):
        eb.analyse(labelled(folder), tolerance=-0.1)


def test_the_figure_draws_the_full_cache(analysis):
    fig = eb.figure(analysis)
    (ax,) = fig.axes
    assert ax.get_xscale() == "log"
    (star,) = [ln for ln in ax.get_lines() if ln.get_label() == "full (full cache)"]
    assert star.get_marker() == "*"
    assert list(star.get_xdata()) == pytest.approx([FULL / 2**20]) and list(star.get_ydata()) == [100.0]
    flat = [ln for ln in ax.get_lines() if list(ln.get_ydata()) == [100.0, 100.0]]
    assert flat, "a horizontal line at the full cache's score"
    labels = {ln.get_label() for ln in ax.get_lines()}
    (quantized,) = [ln for ln in ax.get_lines() if ln.get_label() == "full + kivi (quantized)"]
    assert list(quantized.get_xdata()) == pytest.approx([540 / 2**20, 1000 / 2**20])  # 2 then 4 bits
    # a line is named by its method (+ storage) while that names it alone
    assert {"full + kivi (quantized)", "snapkv (eviction)", "snapkv + kivi (combined)"} <= labels
    c = analysis.configs
    other = c[c["config"] == "snapkv b=1024 w=32"].assign(series="snapkv w=8", config="snapkv b=1024 w=8")
    two = dataclasses.replace(analysis, configs=pd.concat([analysis.configs, other], ignore_index=True))
    labels = {ln.get_label() for ln in eb.figure(two).axes[0].get_lines()}
    assert {"snapkv w=32 (eviction)", "snapkv w=8 (eviction)", "snapkv w=32 + kivi (combined)"} <= labels


def test_render_writes_the_figure_tables_and_markdown(folder, tmp_path):
    written = eb.render(folder, tmp_path / "out")
    names = sorted(p.name for p in written)
    assert names == sorted([f"equal_bytes_{slug('tiny/model')}.png", "equal_bytes_configs.csv", "equal_bytes_pairs.csv",
                            "equal_bytes_costs.csv", "equal_bytes.md"])  # fmt: skip
    md = (tmp_path / "out" / "equal_bytes.md").read_text()
    assert "### Equal-bytes pairs" in md and "full + kivi-2" in md
    pairs = pd.read_csv(tmp_path / "out" / "equal_bytes_pairs.csv")
    assert len(pairs) == 4 and list(pairs.columns) == eb.PAIR_COLUMNS


def test_bytes_are_the_storage_plus_the_kept_index_bookkeeping(tmp_path):
    """A row's `kv_index_bytes` (the kept entries' positions) is paid beside its `kv_bytes`: with
    it, snapkv b=1024 (1040 + 300 bytes) is no longer within 10 % of kivi-4 (1000 + 0); rows without
    the field count the storage alone."""
    d = tmp_path / "equal_bytes"
    snap = [dict(r, kv_index_bytes=300) for r in rows_of("snap1024")]
    write(d, [*rows_of("full"), *rows_of("kivi4"), *snap])
    (a,) = eb.analyses(ResultStore.load_dir(d))
    c = a.configs.set_index("config")
    assert c.loc["snapkv b=1024 w=32", "kv_bytes"] == 1340 and c.loc["full + kivi-4", "kv_bytes"] == 1000
    assert c.loc["snapkv b=1024 w=32", "fraction"] == pytest.approx(1340 / FULL)
    assert a.pairs.empty
    rows = eb.label_rows(eb.prepare(ResultStore.load_dir(d)))
    assert set(rows["kv_storage_bytes"]) == {FULL, 1000, 1040}


def test_nothing_renders_without_rows(tmp_path):
    assert eb.render(tmp_path / "absent") == []
    empty = tmp_path / "equal_bytes"
    empty.mkdir()
    assert eb.render(empty) == [] and list(empty.iterdir()) == []
    failed = [dict(r, status="error", score=None) for r in rows_of("full")]
    write(empty, failed)
    before = sorted(p.relative_to(empty) for p in empty.rglob("*"))
    assert eb.render(empty) == [] and sorted(p.relative_to(empty) for p in empty.rglob("*")) == before
    assert eb.main([str(tmp_path / "absent")]) == 2


# ------------------------------------------------------------------------------------------ the grid
ROOT = Path(__file__).resolve().parents[1]


def compose_spec(overrides) -> RunSpec:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return RunSpec.from_config(compose("config", overrides=list(overrides)))


def test_the_grid_runs_every_leaderboard_method_at_both_budgets_beside_quantized_caches():
    plan = eb.load_plan()
    assert len({r.overrides for r in plan}) == len(plan)
    for task in ("ruler_niah_4k", "needle_4k"):
        mine = [r for r in plan if r.task == task]
        evicting = {(r.method, r.budget) for r in mine if r.storage is None and r.method != "full"}
        assert {(m, b) for m in lb.methods() if m != "full" for b in (512, 1024)} <= evicting
        assert ("full", None, None) in {(r.method, r.budget, r.storage) for r in mine}
        assert {(r.method, r.budget, r.storage) for r in mine if r.storage} == {
            ("full", None, "kivi4"), ("full", None, "kivi2"), ("snapkv", 2048, "kivi4"), ("snapkv", 2048, "kivi2"),
        }  # fmt: skip


def test_the_experiment_alone_is_the_grids_first_config():
    plan = eb.load_plan()
    assert plan[0].name == "ruler_niah_4k/full"
    assert compose_spec(["experiment=equal_bytes"]).method_hash == compose_spec(plan[0].overrides).method_hash


@pytest.mark.parametrize("storage", [False, True], ids=["plain", "quantized"])
def test_the_grid_composes(storage):
    """One config per task, method kind and storage composes and builds as run.py builds it; the
    quantized ones through conf/kv_quant/ (the quantized storage)."""
    picked = {}
    for r in eb.load_plan():
        if (r.storage is not None) == storage:
            picked.setdefault((r.task, r.method == "full", r.method == "snapkv", r.storage), r)
    assert len(picked) >= 4
    for r in picked.values():
        spec = compose_spec(r.overrides)
        assert spec.method.name == r.method and spec.task.name in ("ruler", "needle")
        assert r.budget is None or spec.method.params()["budget"] == r.budget


def test_a_config_the_reuse_folder_holds_is_read_from_there_when_its_rows_count_index_bytes(tmp_path):
    plan = [
        r
        for r in eb.load_plan()
        if r.task == "ruler_niah_4k" and r.storage is None and r.budget in (None, 1024)
    ]
    snap, h2o, full = (next(r for r in plan if r.method == m) for m in ("snapkv", "h2o", "full"))
    assert snap.reuse == "leaderboard_ruler"
    named = eb.keys([snap, h2o, full])
    reuse, own = tmp_path / snap.reuse, tmp_path / eb.FOLDER

    def rows(run, index_bytes):
        model, task, method_hash = named[run]
        out = []
        for i, b in enumerate(index_bytes):
            r = base_row(
                f"s-{i}", task, "niah_single_2", run.method, {}, 1.0, kv_bytes=1000, kv_bytes_full=FULL
            )
            r.update(model=model, method_hash=method_hash, **({} if b is None else {"kv_index_bytes": b}))
            out.append(r)
        return out

    write(reuse, rows(snap, [80, 80, 80]) + rows(h2o, [80, None, 80]))  # h2o: one row predates the field
    write(own, rows(full, [0, 0, 0]))
    taken = eb.reused([snap, h2o, full], own)
    assert list(taken) == [snap] and len(taken[snap]) == 3
    loaded = eb.load_rows(own, [snap, h2o, full])
    assert sorted(loaded["method"]) == ["full"] * 3 + ["snapkv"] * 3
    (a,) = eb.analyses(loaded)
    assert dict(zip(a.configs["method"], a.configs["rows_from"])) == {
        "full": "",
        "snapkv": "leaderboard_ruler",
    }
    assert "| leaderboard_ruler/ |" in eb.markdown([a])
    assert len(eb.load_rows(own)) == 3  # no plan: the folder alone
    write(own, rows(snap, [80, 80, 80]))  # the grid's own rows of a config win
    assert eb.reused([snap, h2o, full], own) == {}
    # the plain full cache keeps no index: its rows count what the grid counts without the field
    elsewhere = tmp_path / "b"
    write(elsewhere / snap.reuse, rows(full, [None, None, None]))
    assert list(eb.reused([full], elsewhere / eb.FOLDER)) == [full]
    assert eb.reused([snap], tmp_path / "elsewhere" / eb.FOLDER) == {}  # no reuse folder beside it


def test_the_grid_reuses_the_leaderboards_ruler_cell_and_the_script_runs_it_there(capsys):
    s = script()
    assert s.main(["list", "only=ruler_niah_4k/snapkv@1024"]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    assert line.endswith("method=snapkv budget=1024 results_dir=results/leaderboard_ruler")
    assert line.count("results_dir=") == 1


def script():
    spec = importlib.util.spec_from_file_location("equal_bytes_script", ROOT / "scripts" / "equal_bytes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_lists_the_grid_and_refuses_bad_input(capsys):
    s = script()
    assert s.main(["list", "only=needle_4k/snapkv@"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 8 and all(
        line.startswith("python run.py ") and "task=needle" in line for line in lines
    )
    assert any("budget=2048 kv_quant=kivi kv_quant.bits=4" in line for line in lines)
    for argv, says in (
        (["go"], "command must be one of list, run, got 'go'"),
        (["list", "x=1"], "only=SUBSTRING"),
    ):
        assert s.main(argv) == 2
        assert says in capsys.readouterr().err


# ------------------------------------------------------------------------------ bench_speed's storage
KIVI_FILE = {"kind": "kivi", "bits": 2, "group_size": 32, "residual": 128}  # a conf/kv_quant/kivi.yaml


def test_bench_speed_passes_quantized_storage_through_to_each_configuration(tmp_path, monkeypatch):
    """`kv_quants.<name>={kind,...}` over conf/kv_quant/<kind>.yaml, `method+name@length` configs:
    each worker gets the method and its storage, each row is named `method+name` and records the
    storage, the ratios pair it with the plain full cache, and a resume on other storage is refused."""
    monkeypatch.setattr(
        bench, "load_option", lambda group, name: OmegaConf.create({**KIVI_FILE, "kind": name})
    )
    specs = []

    def fake_run(cmd, **kw):  # a worker: the row measure.measure would print, timed by the storage
        spec = json.loads(cmd[-1])
        specs.append(spec)
        quant = spec["kv_quant"]
        tpot = (
            1.0
            if spec["input_tokens"] == 512
            else (0.5 if quant else 2.0) * (0.5 if spec["method"] == "snapkv" else 1)
        )
        row = {"method": spec["label"], "budget": spec["params"].get("budget"), "batch_size": 1,
               "input_tokens": spec["input_tokens"], "status": "ok", "tpot_ref": tpot, "prefill_ref": 10.0,
               "tpot_s": tpot, "prefill_s": 1.0, "method_params": json.dumps(spec["params"], sort_keys=True),
               "kv_quant": json.dumps(quant, sort_keys=True) if quant else None, "model": spec["model"]["name"],
               "dtype": spec["model"]["dtype"], "other_cores": 0.0}  # fmt: skip
        return subprocess.CompletedProcess(cmd, 0, "ROW " + json.dumps(row) + "\n", "")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    out = tmp_path / "b.csv"
    args = ["model=random:llama-tiny", "methods=[full,snapkv]", "kv_quants.kivi4={kind:kivi,bits:4}",
            "configs=[full@512,full@8192,full+kivi4@8192,snapkv@8192,snapkv+kivi4@8192]", "rounds=2",
            "subprocess=true", "plots=false", f"out={out}"]  # fmt: skip
    cfg = bench.compose(args)
    assert dict(cfg.kv_quants["kivi4"]) == {**KIVI_FILE, "bits": 4}
    rows = bench.run(cfg)
    first = specs[:5]
    assert [(s["label"], s["method"], s["input_tokens"]) for s in first] == [
        ("full", "full", 512), ("full", "full", 8192), ("full+kivi4", "full", 8192), ("snapkv", "snapkv", 8192),
        ("snapkv+kivi4", "snapkv", 8192),
    ]  # fmt: skip
    assert [s["kv_quant"] for s in first] == [
        None,
        None,
        {**KIVI_FILE, "bits": 4},
        None,
        {**KIVI_FILE, "bits": 4},
    ]
    assert len(rows) == 10
    ratios = decode_step_ratios(rows)
    assert ratios["full+kivi4"].median == pytest.approx(0.5) and ratios[
        "snapkv+kivi4"
    ].median == pytest.approx(0.25)
    assert set(ratios) == {"full+kivi4", "snapkv", "snapkv+kivi4"} and ratios[
        "snapkv"
    ].median == pytest.approx(1.0)
    header, *lines = method_ratio_lines(rows, "ref")
    assert "decode step / full's at 8192, / full's at 512; prefill / full's at 8192" in header
    assert [line.split() for line in lines] == [
        [m, "step", f"{same:.3f}", f"[{same:.3f},", f"{same:.3f}]", "step", f"{short:.3f}", f"[{short:.3f},",
         f"{short:.3f}]", "prefill", "1.000", "[1.000,", "1.000]"]
        for m, same, short in (("full+kivi4", 0.25, 0.5), ("snapkv", 0.5, 1.0), ("snapkv+kivi4", 0.125, 0.25))
    ]  # fmt: skip
    assert method_ratio_lines([r for r in rows if r["method"] != "full" or r["input_tokens"] != 8192]) == []
    with out.open(newline="") as f:
        stored = {r["method"]: r["kv_quant"] for r in csv.DictReader(f)}
    assert json.loads(stored["snapkv+kivi4"])["bits"] == 4 and stored["snapkv"] == ""
    # a resume whose storage of the same name differs is refused before anything runs
    other = [a.replace("bits:4", "bits:2") for a in args] + ["resume=true"]
    with pytest.raises(ValueError, match=r"full\+kivi4@8192 batch 1 ran on other storage"):
        bench.compose(other)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["configs=[full+kivi9@512]"], "storage 'kivi9' is not in kv_quants (known: none)"),
        (["kv_quants.q=3"], "kv_quants.q must be {kind: <conf/kv_quant name>, ...}, got kv_quants.q=3"),
    ],
)
def test_bench_speed_refuses_unknown_storage(argv, says, capsys):
    assert bench.main(["model=random:llama-tiny", "methods=[full]", *argv]) == 2
    assert says in capsys.readouterr().err


def test_bench_speed_names_the_known_kv_quant_kinds(capsys):
    assert bench.main(["model=random:llama-tiny", "methods=[full]", "kv_quants.q={kind:nope}"]) == 2
    assert "unknown kv_quant 'nope'; known:" in capsys.readouterr().err


def test_a_worker_hands_the_storage_to_generation_and_records_it(monkeypatch):
    """eval.bench.measure: the spec's kv_quant reaches generation as its `kv_quant` option, a
    `KVQuant` of those fields (the plain cache passes none), and the row is named by the
    configuration's label."""
    from eval.bench import measure

    seen, real = [], measure.generate_ids

    def spy(*args, **kw):
        seen.append(kw.get("kv_quant"))  # passed on: generation runs on that storage
        return real(*args, **kw)

    monkeypatch.setattr(measure, "generate_ids", spy)
    cfg = bench.compose(["model=random:llama-tiny", "methods=[full]", "decode_tokens=2", "lengths=[16]"])
    model, vocab = measure.load(OmegaConf.to_container(cfg.model, resolve=True), 0)
    quant = {**KIVI_FILE, "bits": 4}
    for c in (
        bench.Config("full", (), 16, 1),
        bench.Config("full", (), 16, 1, "kivi4", tuple(sorted(quant.items()))),
    ):
        row = measure.measure(model, vocab, {**bench.spec_of(cfg, c), "reference_tokens": {}})
        assert row["status"] == "ok" and row["method"] == c.label
        assert row["kv_quant"] == (json.dumps(quant, sort_keys=True) if c.storage else None)
    assert seen == [None, KVQuant(**quant)]
