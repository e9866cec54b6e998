"""`python run.py` end to end on a tiny model: rows, resume, shards, failures, LongBench, bad input, sweeps.

The tiny model is a real local model directory (random 2-layer Llama + a byte-level BPE tokenizer with
a ChatML template, both built in code and saved with `save_pretrained`), so `model.name=<dir>` runs
through the product's own loader in-process, in subprocesses and in joblib workers alike. Nothing
touches the Hub; only the `slow` test loads the real default model (cached).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import CHATML, byte_level_bpe, save_tiny_llama
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tqdm import tqdm

import eval.report.build
import eval.runner as runner
import run as run_module
from eval.callbacks import sweep_errors
from eval.conf import load_option, method_config, options
from eval.report import write_report
from eval.spec import RunSpec
from eval.store import ResultStore, fields_missing, read_rows, result_path
from eval.tasks import haystack as hs
from eval.tasks.needle.task import NEEDLES, NeedleTask
from snapkv.prompts import render_prompt

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
SHARED_MULTI_NEWS = ROOT.parent / "shared" / "data" / "longbench" / "multi_news.jsonl"
LENGTHS, DEPTHS = [150, 250], [0, 50, 100]
REAL_GENERATE = runner.generate  # before any test replaces it
REAL_LOAD_MODEL = runner.load_model
N_CELLS = len(LENGTHS) * len(DEPTHS)


# ------------------------------------------------------------------------------------------ fixtures
def save_tiny_model(out: Path) -> str:
    """Save a tiny model directory at `out`: random 2-layer Llama (GQA 4/2) + byte-level BPE with a
    ChatML chat template, trained on the noise haystack and the needles (the runner tests' model)."""
    corpus = [hs.NOISE_TEXT] * 10 + [s.instruction + s.needle + s.question for s in NEEDLES.values()]
    tokenizer = byte_level_bpe(corpus, 600, ["<|im_start|>", "<|im_end|>"], chat_template=CHATML)
    return save_tiny_llama(out, tokenizer, max_positions=4096)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama")


def tiny_overrides(tiny_dir: str, results: Path, task: str = "needle") -> list[str]:
    common = [
        f"model.name={tiny_dir}",
        "model.context=4096",
        "model.max_prompt_tokens=400",
        "budget=64",
        f"results_dir={results}",
        "progress=false",
        "report=false",
    ]
    if task != "needle":
        return common + [f"task={task}"]
    return common + [
        "task.haystack=noise",
        f"task.lengths=[{','.join(map(str, LENGTHS))}]",
        f"task.depths=[{','.join(map(str, DEPTHS))}]",
        "task.max_new_tokens=6",
    ]


def make_cfg(tiny_dir: str, results: Path, *overrides: str, task: str = "needle"):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=tiny_overrides(tiny_dir, results, task) + list(overrides))


def result_files(results: Path) -> list[Path]:
    return sorted(p for p in results.rglob("*.jsonl"))


class CountingGenerate:
    """Stands in for `eval.runner.generate`: records sample prompts, optionally fails some samples."""

    def __init__(self, fail: dict[str, Exception] | None = None):
        self.calls, self.fail = [], fail or {}

    def __call__(self, model, tokenizer, **kw):
        self.calls.append(kw["context"])
        for marker, err in self.fail.items():
            if marker in kw["context"]:
                raise err
        return REAL_GENERATE(model, tokenizer, **kw)


def needle_of(row: dict) -> str:
    return row["needle"]


# ------------------------------------------------------------------------------------------- needle
def test_needle_run_writes_complete_rows_and_report(tiny_dir, tmp_path):
    results = tmp_path / "results"
    cfg = make_cfg(tiny_dir, results, "report=true")
    assert runner.run(cfg) == results

    (path,) = result_files(results)
    assert path.parent == results / "needle" / "tiny-llama" and path.name.startswith("snapkv-")
    rows = read_rows(path)
    assert len(rows) == N_CELLS
    assert {r["sample_id"] for r in rows} == {f"len{n}_depth{d:g}" for n in LENGTHS for d in DEPTHS}
    for row in rows:
        assert fields_missing(row) == [], row["sample_id"]
        assert row["status"] == "ok" and row["error"] is None
        assert path.name == f"snapkv-{row['method_hash']}.jsonl"
        assert row["model"] == "tiny-llama" and row["model_path"] == tiny_dir  # short key, full path
        assert row["task"] == "needle" and row["dataset"] == "needle"
        assert row["method_params"] == {"budget": 64, "window": 32, "kernel_size": 7, "pooling": "max", "gqa_reduce": "mean", "gqa_order": "reduce_first", "span": None}  # fmt: skip
        assert row["query_aware"] is True and row["dtype"] == "float32" and row["device"] == "cpu"
        assert row["attn_impl"] == "sdpa" and row["seed"] == 42
        assert row["context_length"] in LENGTHS and row["depth_percent"] in DEPTHS and "length" not in row
        assert set(row["scores"]) == {"exact", "partial"} and 0.0 <= row["score"] <= 1.0
        assert isinstance(row["prediction"], str) and row["answers"] and row["answers"][0].isdigit()
        assert row["input_tokens"] == row["context_length"]  # the needle task sizes prompts exactly
        assert row["compressed"] is (row["input_tokens"] > 64)
        assert row["kv_tokens"] == min(row["input_tokens"], 64)
        assert row["kv_bytes"] <= row["kv_bytes_full"] and row["prefill_s"] > 0 and row["peak_mem_bytes"] > 0
        assert set(row["versions"]) == {"torch", "transformers", "snapkv_bench"}
        assert row["git_sha"] is None or re.fullmatch(r"[0-9a-f]{40}", row["git_sha"])
        assert row["git_dirty"] in (None, True, False)
        assert (row["git_diff_sha"] is not None) is bool(row["git_dirty"])
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row["timestamp"])
        assert row["trained_context"] == 4096 and row["haystack"] == "noise"

    assert (results / "report.md").is_file() and (results / "summary.csv").is_file()
    heatmaps = sorted(results.glob("needle_*.png"))  # exact, and partial credit beside it
    assert len(heatmaps) == 2 and all(h.stat().st_size > 1000 for h in heatmaps)
    assert heatmaps[1].name.endswith("_partial.png")
    assert "snapkv b=64 w=32 k=7 max" in (results / "report.md").read_text()


def test_resume_skips_done_samples_and_recomputes_a_truncated_row(tiny_dir, tmp_path, monkeypatch):
    results = tmp_path / "results"
    cfg = make_cfg(tiny_dir, results)
    runner.run(cfg)
    (path,) = result_files(results)

    counting = CountingGenerate()
    monkeypatch.setattr(runner, "generate", counting)
    runner.run(cfg)  # everything is done: nothing is computed, nothing appended
    assert counting.calls == [] and len(read_rows(path)) == N_CELLS

    # A process killed mid-write leaves half a line: exactly that sample is recomputed.
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    lost = json.loads(data[last_start:])
    path.write_bytes(data[: last_start + (len(data) - last_start) // 2])
    with pytest.warns(UserWarning, match="incomplete last line"):
        runner.run(cfg)
    assert len(counting.calls) == 1 and lost["needle"] in counting.calls[0]
    rows = read_rows(path)
    assert len(rows) == N_CELLS and len({r["sample_id"] for r in rows}) == N_CELLS
    assert rows[-1]["sample_id"] == lost["sample_id"] and rows[-1]["status"] == "ok"


def test_config_changes_get_their_own_file(tiny_dir, tmp_path):
    """query_aware, prefill chunking and the method's parameters are part of the file's hash."""
    results = tmp_path / "results"
    one_cell = ["task.lengths=[150]", "task.depths=[50]"]
    runner.run(make_cfg(tiny_dir, results, *one_cell))
    runner.run(make_cfg(tiny_dir, results, *one_cell, "query_aware=false", "prefill.chunk_size=64"))
    runner.run(make_cfg(tiny_dir, results, *one_cell, "method=full"))
    files = result_files(results)
    assert len(files) == 3 and sum(f.name.startswith("full-") for f in files) == 1
    rows = [r for f in files for r in read_rows(f)]
    assert sorted(r["query_aware"] for r in rows) == [False, True, True]
    agnostic = next(r for r in rows if r["query_aware"] is False)
    assert agnostic["prefill_chunk_size"] == 64 and agnostic["status"] == "ok"
    full = next(r for r in rows if r["method"] == "full")
    assert full["method_params"] == {"budget": None} and full["kv_bytes"] == full["kv_bytes_full"]
    # Growing the grid keeps the file (lengths/depths only select samples): only new cells run.
    runner.run(make_cfg(tiny_dir, results, "task.lengths=[150]", "task.depths=[50,100]", "method=full"))
    assert len(result_files(results)) == 3
    assert len(read_rows(next(f for f in result_files(results) if f.name.startswith("full-")))) == 2


def test_shards_cover_every_sample_once(tiny_dir, tmp_path):
    results = tmp_path / "results"
    for i in (0, 1):
        runner.run(make_cfg(tiny_dir, results, "task.num_shards=2", f"task.shard={i}"))
    files = result_files(results)
    assert [f.name.split(".", 1)[1] for f in files] == ["shard0of2.jsonl", "shard1of2.jsonl"]
    ids = [[r["sample_id"] for r in read_rows(f)] for f in files]
    assert not set(ids[0]) & set(ids[1]) and len(ids[0]) + len(ids[1]) == N_CELLS
    merged = ResultStore.load_dir(results)
    assert len(merged) == N_CELLS and not merged["sample_id"].duplicated().any()

    assert write_report(results).report_md == results / "report.md"

    summary = pd.read_csv(results / "summary.csv")
    assert summary["n"].sum() == N_CELLS and summary["n_ok"].sum() == N_CELLS


def test_failing_samples_are_recorded_and_the_run_goes_on(tiny_dir, tmp_path, monkeypatch):
    results = tmp_path / "results"
    cfg = make_cfg(tiny_dir, results)
    # Which sample fails is decided by its needle sentence (its magic number differs per cell).
    task = NeedleTask(haystack="noise", lengths=LENGTHS, depths=DEPTHS, seed=42)
    bad = {
        f"The special magic number is: {task.cell_number(150, 50)}.": RuntimeError("boom\nsecond line"),
        f"The special magic number is: {task.cell_number(250, 0)}.": RuntimeError(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ),
    }
    failing = CountingGenerate(fail=bad)
    monkeypatch.setattr(runner, "generate", failing)
    runner.run(cfg)
    assert len(failing.calls) == N_CELLS
    (path,) = result_files(results)
    rows = {r["sample_id"]: r for r in read_rows(path)}
    assert len(rows) == N_CELLS and all(fields_missing(r) == [] for r in rows.values())
    assert rows["len150_depth50"]["status"] == "error"
    assert rows["len150_depth50"]["error"] == "RuntimeError: boom"
    assert rows["len250_depth0"]["status"] == "oom" and "out of memory" in rows["len250_depth0"]["error"]
    for sid in ("len150_depth50", "len250_depth0"):
        assert rows[sid]["prediction"] is None and rows[sid]["score"] is None
        assert rows[sid]["context_length"] in LENGTHS and rows[sid]["method_hash"]
    assert sum(r["status"] == "ok" for r in rows.values()) == N_CELLS - 2

    # The next run retries exactly the failed samples; their ok rows win.
    retry = CountingGenerate()
    monkeypatch.setattr(runner, "generate", retry)
    runner.run(cfg)
    assert len(retry.calls) == 2
    latest = ResultStore(path).latest()
    assert len(latest) == N_CELLS and all(r["status"] == "ok" for r in latest.values())


# ----------------------------------------------------------------------------------------- longbench
def _record(dataset: str, i: int, **extra) -> dict:
    text = " ".join(f"Paragraph {k}: the {dataset} record {i} mentions item {k * 7 + i}." for k in range(40))
    return {
        "input": f"What does record {i} mention?",
        "context": text,
        "answers": [f"item {i}"],
        "length": 400 + i,
        "dataset": dataset,
        "language": "en",
        "all_classes": None,
        "_id": f"{dataset}-synthetic-{i}",
        **extra,
    }


def write_longbench_dir(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "hotpotqa.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps(_record("hotpotqa", i)) + "\n")
    with open(root / "trec.jsonl", "w") as f:
        for i in range(2):
            f.write(
                json.dumps(_record("trec", i, all_classes=["Location", "Number"], answers=["Number"])) + "\n"
            )
    return root


def test_longbench_run(tiny_dir, tmp_path):
    data = write_longbench_dir(tmp_path / "longbench")
    datasets = ["hotpotqa", "trec"]
    if SHARED_MULTI_NEWS.is_file():  # one real LongBench record (512 new tokens: the slowest sample)
        with open(SHARED_MULTI_NEWS) as src, open(data / "multi_news.jsonl", "w") as dst:
            dst.write(src.readline())
        datasets.append("multi_news")
    results = tmp_path / "results"
    cfg = make_cfg(
        tiny_dir, results, f"task.data_dir={data}", f"task.datasets=[{','.join(datasets)}]",
        "task.limit=2", "model.max_prompt_tokens=300", task="longbench",
    )  # fmt: skip
    runner.run(cfg)
    (path,) = result_files(results)
    assert path.parent.parent.name == "longbench"
    rows = read_rows(path)
    expected = 2 + 2 + (1 if "multi_news" in datasets else 0)
    assert len(rows) == expected
    for row in rows:
        assert fields_missing(row) == [] and row["status"] == "ok", row.get("error")
        assert row["task"] == "longbench" and row["dataset"] in datasets
        assert isinstance(row["length"], int) and "context_length" not in row
        assert 0.0 <= row["score"] <= 1.0 and row["scores"] == {}
        assert row["input_tokens"] <= 300 + 16  # middle-truncated (+ the chat template's tokens)
        assert row["compressed"] is (row["input_tokens"] > 64)
    assert {r["sample_id"] for r in rows if r["dataset"] == "hotpotqa"} == {
        "hotpotqa-synthetic-0",
        "hotpotqa-synthetic-1",
    }
    if "multi_news" in datasets:
        news = next(r for r in rows if r["dataset"] == "multi_news")
        assert news["truncated"] is True and news["prompt_tokens"] > 300


# ----------------------------------------------------------------------------------------- bad input
# In-process runs leave the test process's logging alone (Hydra would reconfigure the root logger).
QUIET_HYDRA = ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]


def run_cli_in_process(monkeypatch, tmp_path, *args: str) -> int:
    """`python run.py ARGS` in this process (through hydra.main); returns the exit code."""
    monkeypatch.setattr(
        sys,
        "argv",
        ["run.py", f"hydra.run.dir={tmp_path}/hydra", "hydra.output_subdir=null", *QUIET_HYDRA, *args],
    )
    with pytest.raises(SystemExit) as exc:
        run_module.cli()
    return exc.value.code


BAD_INPUT = {
    "unknown method": (["method.name=nope"], "unknown method 'nope'"),
    "budget < window": (["method.budget=16"], "window=32, budget=16"),
    "depth > 100": (["task.depths=[150]"], "150"),
    "negative length": (["task.lengths=[-5]"], "-5"),
    "unknown task": (["task.name=nope"], "unknown task 'nope'"),
    "unknown dataset": (["task=longbench", "task.datasets=[nope]"], "'nope'"),
    "missing data dir": (
        ["task=longbench", "task.datasets=[hotpotqa]", "task.data_dir={tmp}/missing"],
        "{tmp}/missing/hotpotqa.jsonl",
    ),
    "malformed jsonl": (
        ["task=longbench", "task.datasets=[hotpotqa]", "task.data_dir={tmp}/bad"],
        "hotpotqa.jsonl:2",
    ),
    "model not found": (["model.name={tmp}/no-such-model"], "{tmp}/no-such-model"),
    "missing model path": (["model=gemma3-270m"], "model.name"),
    "bad shard": (["task.num_shards=2", "task.shard=2"], "shard=2"),
    # Config errors caught before the first sample (not an error row per sample and exit 0):
    "negative chunk size": (["prefill.chunk_size=-5"], "prefill.chunk_size=-5"),
    "chunk size not a number": (["prefill.chunk_size=abc"], "prefill.chunk_size='abc'"),
    "zero chunk size": (["prefill.chunk_size=0"], "prefill.chunk_size=0"),
    # Unknown config group options: one line naming the value and the known ones (not Hydra's 12).
    "unknown method group option": (
        ["method=bogus"],
        "unknown method 'bogus'; known: adakv, adakv_expected_attention, chunkkv",
    ),
    "unknown model group option": (["model=bogus"], "unknown model 'bogus'; known: gemma3-270m"),
    "unknown option in a sweep": (["-m", "method=full,bogus"], "unknown method 'bogus'"),
    # results_dir checked before the model loads, not after the first sample.
    "results_dir is a file": (["results_dir={tmp}/afile/sub"], "afile' is a file"),
    "results_dir not writable": (["results_dir={readonly}/results"], "is not writable"),
    "bad query_aware": (["query_aware=maybe"], "query_aware='maybe'"),
    "bad dtype": (["model.dtype=float8"], "model.dtype='float8'"),
    "unknown compare method": (["compare=[full,bogus]"], "unknown compare method 'bogus'; known: adakv"),
    "compare not a list": (["compare=full"], "compare must be a list of method names"),
    "compare method config invalid": (
        ["compare=[snapkv]", "method=full", "budget=16"],
        "window=32, budget=16",
    ),
    "unknown method key": (
        ["method.nope=1"],
        "unknown config key 'method.nope'; known keys of method: "
        + ", ".join(sorted(method_config("snapkv"))),
    ),
    "unknown task key": (
        ["task.nope=1"],
        "unknown config key 'task.nope'; known keys of task: "
        + ", ".join(sorted(load_option("task", "needle"))),
    ),
    "unknown top-level key": (
        ["nope=1"],
        "unknown config key 'nope'; known top-level keys: budget, compare,",
    ),
    "unknown nested key": (["method.decode_schedule.nope=1"], "'method.decode_schedule.nope'; known keys of"),
    "unknown key at one sweep point": (
        ["-m", "method=snapkv,full", "method.window=8"],
        "unknown config key 'method.window' (with method=full); known keys of method: "
        + ", ".join(sorted(method_config("full"))),
    ),
}


def _no_model_load(*args, **kwargs):
    raise AssertionError("the model was loaded although the config is invalid")


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_one_line_and_exit_2(case, monkeypatch, tmp_path, capsys):
    args, expected = BAD_INPUT[case]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "hotpotqa.jsonl").write_text(json.dumps(_record("hotpotqa", 0)) + "\n{not json\n")
    (tmp_path / "afile").write_text("not a directory")
    readonly = tmp_path / "readonly"
    readonly.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes into mode-555 directories; /sys refuses even root
        readonly = Path("/sys")
    args = [a.format(tmp=tmp_path, readonly=readonly) for a in args]
    if case != "model not found":  # that case fails inside the loader, by design
        monkeypatch.setattr(runner, "load_model", _no_model_load)
    code = run_cli_in_process(monkeypatch, tmp_path, f"results_dir={tmp_path}/results", *args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert expected.format(tmp=tmp_path, readonly=readonly) in err[0]
    assert not list((tmp_path / "results").rglob("*.jsonl"))  # no row written
    if case != "model not found":  # failed before the results dir was even created
        assert not (tmp_path / "results").exists()


def _cli(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    # Launcher workers (joblib, submitit) unpickle the job by module name: make them import THIS
    # checkout, not whatever copy of the project is pip-installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, str(ROOT / "run.py"), *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.slow  # a fresh interpreter (subprocess): the e2e tier
def test_cli_errors_in_a_subprocess(tmp_path):
    proc = _cli(tmp_path, "method.budget=16", f"hydra.run.dir={tmp_path}/h")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["error: window must be < budget, got window=32, budget=16"]
    # An unknown group option: exit 2 and one line naming it and the known options.
    proc = _cli(tmp_path, "method=nope")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown method 'nope'; known: " + ", ".join(options("method"))
    ]
    # A typo in a key: exit 2 and one line naming it and the keys of its node.
    proc = _cli(tmp_path, "method.budgt=5")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: unknown config key 'method.budgt'; known keys of method: "
        + ", ".join(sorted(method_config("snapkv")))
    ]


# ---------------------------------------------------------------------------------------------- sweeps


def test_sequential_sweep_loads_the_model_once_and_reports_once(tiny_dir, tmp_path, monkeypatch, capsys):
    """`python run.py -m method=full,snapkv,streamingllm` with the default (in-process) launcher."""
    loads = []

    def counting_load(*args, **kwargs):
        loads.append(args[0])
        return REAL_LOAD_MODEL(*args, **kwargs)

    reports = []
    real_build = eval.report.build.build_report

    def counting_build(results_dir, **kwargs):
        reports.append(results_dir)
        return real_build(results_dir, **kwargs)

    monkeypatch.setattr(runner, "load_model", counting_load)
    monkeypatch.setattr(runner, "_LOADED", {})
    monkeypatch.setattr(eval.report.build, "build_report", counting_build)
    results = tmp_path / "results"
    args = [a for a in tiny_overrides(tiny_dir, results) if not a.startswith(("task.lengths", "report"))]
    monkeypatch.setattr(
        sys,
        "argv",
        ["run.py", "-m", *QUIET_HYDRA, f"hydra.sweep.dir={tmp_path}/multirun", "method=full,snapkv,streamingllm",
         "task.lengths=[150]", *args],
    )  # fmt: skip
    run_module.main()
    assert loads == [tiny_dir]
    assert sorted(f.name.split("-")[0] for f in result_files(results)) == ["full", "snapkv", "streamingllm"]
    assert reports == [str(results)]  # once, by ReportCallback, after the last job
    assert "streamingllm b=64" in (results / "report.md").read_text()


def test_a_sweep_over_results_dirs_reports_each(tiny_dir, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    drop = ("task.lengths", "task.depths", "results_dir", "report")
    args = [o for o in tiny_overrides(tiny_dir, a) if not o.startswith(drop)]
    monkeypatch.setattr(
        sys,
        "argv",
        ["run.py", "-m", *QUIET_HYDRA, f"hydra.sweep.dir={tmp_path}/multirun", "method=full", "task.lengths=[150]",
         "task.depths=[50]", f"results_dir={a},{b}", *args],
    )  # fmt: skip
    run_module.main()
    assert (a / "report.md").is_file() and (b / "report.md").is_file()


def test_random_weight_models_need_a_fitting_tokenizer(tiny_dir):
    class Small:
        class config:  # noqa: N801 - stands in for a model's config
            vocab_size = 100

    with pytest.raises(
        ValueError, match=r"tokenizer .* has \d+ tokens, more than the model's vocab_size=100"
    ):
        runner.load_tokenizer(tiny_dir, Small())
    assert runner.load_tokenizer(tiny_dir).chat_template == CHATML
    with pytest.raises(FileNotFoundError, match="no-such-tokenizer"):
        runner.load_tokenizer("/no-such-tokenizer")


# ------------------------------------------------------------------------------------------------ slow


# ------------------------------------------------------------------------- fail early, fail loudly
def test_a_run_whose_samples_all_failed_does_not_exit_0(tiny_dir, tmp_path, monkeypatch, capsys):
    def failing(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(runner, "generate", failing)
    results = tmp_path / "results"
    with pytest.raises(runner.AllSamplesFailed, match=f"all {N_CELLS} samples failed"):
        runner.run(make_cfg(tiny_dir, results))
    rows = read_rows(result_files(results)[0])
    assert len(rows) == N_CELLS and {r["status"] for r in rows} == {"error"}  # the rows are kept
    code = run_cli_in_process(monkeypatch, tmp_path, *tiny_overrides(tiny_dir, results))
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.startswith("error")]
    assert code == 1 and len(err) == 1 and err[0].startswith(f"error: all {N_CELLS} samples failed"), err


def test_a_sweep_with_a_bad_point_records_it_goes_on_and_reports(tiny_dir, tmp_path, monkeypatch):
    """`-m budget=64,16,128`: 16 < window is invalid; 64 and 128 still run and the report is written."""
    results = tmp_path / "results"
    args = [
        a for a in tiny_overrides(tiny_dir, results) if not a.startswith(("task.lengths", "report", "budget"))
    ]
    monkeypatch.setattr(
        sys,
        "argv",
        ["run.py", "-m", *QUIET_HYDRA, f"hydra.sweep.dir={tmp_path}/multirun", "budget=64,16,128",
         "task.lengths=[150]", *args],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        run_module.cli()
    assert exc.value.code == 2
    budgets = sorted(read_rows(f)[0]["method_params"]["budget"] for f in result_files(results))
    assert budgets == [64, 128]
    report = (results / "report.md").read_text()
    assert "snapkv b=64" in report and "snapkv b=128" in report
    (error,) = (tmp_path / "multirun").glob("*/error.txt")
    assert "window=32, budget=16" in error.read_text()

    cfg = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(tmp_path / "multirun")}, "output_subdir": ".hydra"}}
    )
    ((point, message),) = sweep_errors(cfg)
    assert "budget=16" in point and "window=32, budget=16" in message


def test_a_second_identical_run_waits_and_never_duplicates_a_sample(tiny_dir, tmp_path, monkeypatch):
    """Two identical runs into one results dir (a re-submitted job): the second waits for the first's
    lock, then finds every sample done. Before the lock, both computed every sample (2 rows each)."""
    results = tmp_path / "results"
    cfg = make_cfg(tiny_dir, results)
    store = ResultStore(RunSpec.from_config(cfg).result_path)
    counting = CountingGenerate()
    monkeypatch.setattr(runner, "generate", counting)
    with store.exclusive():  # "the first run" holds the file
        second = threading.Thread(target=runner.run, args=(cfg,))
        second.start()
        second.join(timeout=5)
        assert second.is_alive() and counting.calls == []  # waiting, computing nothing
        ids = [f"len{n}_depth{d:g}" for n in LENGTHS for d in DEPTHS]
        for sid in ids:  # the first run finishes every sample
            store.append({"sample_id": sid, "status": "ok", "task": "needle"})
    second.join(timeout=120)
    assert not second.is_alive()
    assert counting.calls == []  # all done by the first run: nothing recomputed
    rows = read_rows(store.path)
    assert sorted(r["sample_id"] for r in rows) == sorted(ids)


def test_all_samples_already_done_says_so(tiny_dir, tmp_path, caplog):
    logging.getLogger("eval.runner").disabled = False  # an in-process Hydra run may have disabled it
    results = tmp_path / "results"
    cfg = make_cfg(tiny_dir, results, "task.lengths=[150]")
    runner.run(cfg)
    with caplog.at_level("INFO", logger="eval.runner"):
        runner.run(cfg)
    messages = [r.getMessage() for r in caplog.records if r.name == "eval.runner"]
    assert any(f"all {len(DEPTHS)} samples already done" in m for m in messages), messages
    assert not any("0 ok" in m for m in messages)


def test_old_rows_in_the_old_model_folder_are_resumed(tiny_dir, tmp_path, monkeypatch):
    """Rows written before the short model key (folder = the full path, no model_path field) count
    as done, and the report merges them with the new rows under the short key."""
    results = tmp_path / "results"
    cfg = make_cfg(tiny_dir, results, "task.lengths=[150]")
    runner.run(cfg)
    (new,) = result_files(results)
    spec = RunSpec.from_config(cfg)
    old = result_path(results, "needle", tiny_dir, "snapkv", spec.method_hash)  # the old layout
    old.parent.mkdir(parents=True)
    with open(old, "w") as f:
        for row in read_rows(new)[:2]:  # two samples done by an old version
            row = {k: v for k, v in row.items() if k not in ("model_path", "git_dirty", "git_diff_sha")}
            f.write(json.dumps({**row, "model": tiny_dir, "length": None}) + "\n")
    new.unlink()
    counting = CountingGenerate()
    monkeypatch.setattr(runner, "generate", counting)
    runner.run(make_cfg(tiny_dir, results, "task.lengths=[150]", "report=true"))
    assert len(counting.calls) == len(DEPTHS) - 2  # only the sample the old rows lack
    merged = ResultStore.load_dir(results)
    assert len(merged) == len(DEPTHS) and set(merged["model"]) == {"tiny-llama"}
    assert set(merged["model_path"]) == {tiny_dir}
    assert "| needle | tiny-llama |" in (results / "report.md").read_text()


# ---------------------------------------------------------------------------------- progress, noise
class Recording:
    def __init__(self):
        self.events: list[tuple[str, int, int]] = []

    def __call__(self, stage: str, done: int, total: int) -> None:
        self.events.append((stage, done, total))


def test_run_sample_reports_progress_and_records_the_noise(tiny_dir, tmp_path):
    """run_sample hands its callback to generate: prefill, then decode, with the sample's totals;
    and the row records the machine's noise and thread settings while the sample ran."""
    spec = RunSpec.from_config(make_cfg(tiny_dir, tmp_path / "r", "prefill.chunk_size=100"))
    model, tokenizer, info = runner.get_model(spec)
    sample = next(s for s in spec.task.samples(tokenizer) if s.sample_id == "len250_depth50")
    rec = Recording()
    row = runner.run_sample(sample, spec.task, model, tokenizer, spec, runner._base_fields(spec, info), rec)
    assert row["status"] == "ok", row["error"]
    n, new = row["input_tokens"], sample.max_new_tokens
    prefill = [e for e in rec.events if e[0] == "prefill"]
    decode = [e for e in rec.events if e[0] == "decode"]
    assert rec.events == prefill + decode  # prefill first, then decode
    assert n == 250 and prefill == [("prefill", d, n) for d in (0, 100, 200, n)]  # chunks of 100
    assert decode == [("decode", k, new) for k in range(1, row["new_tokens"] + 1)]
    assert row["other_cores"] >= 0 and row["load_1m"] >= 0
    assert row["torch_threads"] == torch.get_num_threads() and row["cpu_count"] == os.cpu_count()
    assert row["cpu_kernels"].split()[0] == torch.backends.cpu.get_cpu_capability()
    assert row["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "")
    assert row["omp_num_threads"] == os.environ.get("OMP_NUM_THREADS", "")
    # The content hashes the report pairs samples by: the prompt as rendered for the model, the answers.
    rendered = render_prompt(
        tokenizer, sample.context + sample.question, sample.chat_template and spec.model.chat_template
    )
    assert row["prompt_sha"] == hashlib.sha256(rendered.encode("utf-8")).hexdigest()
    assert (
        row["target_sha"]
        == hashlib.sha256(json.dumps(sample.answers, separators=(",", ":")).encode()).hexdigest()
    )


def test_a_failed_sample_records_the_noise_too(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "generate", CountingGenerate({"": RuntimeError("boom")}))
    results = tmp_path / "results"
    with pytest.raises(runner.AllSamplesFailed):
        runner.run(make_cfg(tiny_dir, results, "task.lengths=[150]", "task.depths=[0]"))
    (row,) = read_rows(result_files(results)[0])
    assert row["status"] == "error" and row["other_cores"] >= 0 and row["torch_threads"] >= 1


def test_the_bar_shows_the_stage_and_progress_false_prints_nothing_extra(tiny_dir, tmp_path, capsys, caplog):
    logging.getLogger("eval.runner").disabled = False  # an in-process Hydra run may have disabled it
    one = ("task.lengths=[250]", "task.depths=[50]")
    runner.run(make_cfg(tiny_dir, tmp_path / "a", *one, "progress=true"))
    bar = capsys.readouterr().err
    assert re.search(r"prefill \d+ tok", bar), bar  # the postfix while the prompt is prefilled
    with caplog.at_level("INFO", logger="eval.runner"):
        runner.run(make_cfg(tiny_dir, tmp_path / "b", *one))  # progress=false (tiny_overrides)
    quiet = capsys.readouterr()
    assert "prefill" not in quiet.err + quiet.out and "\r" not in quiet.err
    messages = [r.getMessage() for r in caplog.records if r.name == "eval.runner"]
    assert len(messages) == 2 and not any("into the sample" in m for m in messages), messages  # to run, done


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FakeBar:
    def __init__(self):
        self.drawn: list[str] = []

    def set_postfix_str(self, s: str) -> None:
        self.drawn.append(s)


def test_the_bar_is_redrawn_at_most_every_half_second_and_at_each_prefill_start():
    clock, bar = FakeClock(), FakeBar()
    p = runner.SampleProgress("s0", bar, "ok=3", clock=clock)
    p("prefill", 0, 2374)
    clock.t = 40.0  # a long prefill
    p("prefill", 2374, 2374)
    for k in range(1, 513):  # a fast decode: 1,000 tokens per second
        clock.t += 0.001
        p("decode", k, 512)
    assert bar.drawn[:2] == ["ok=3, prefill 2374 tok", "ok=3, prefilled 2374 tok"]
    assert len(bar.drawn) == 3 and bar.drawn[2].startswith("ok=3, decode ")  # 0.512 s of decode
    nxt = runner.SampleProgress("s1", bar, "", clock=clock)
    nxt("prefill", 0, 100)  # drawn at once even 0 s after the last draw: no stale stage
    assert bar.drawn[-1] == "prefill 100 tok"


def test_without_a_bar_only_a_long_sample_logs_one_line_per_stage(caplog):
    logging.getLogger("eval.runner").disabled = False
    clock = FakeClock()
    with caplog.at_level("INFO", logger="eval.runner"):
        quick = runner.SampleProgress("quick", None, clock=clock)
        quick("prefill", 0, 50)
        clock.t = 5.0
        quick("prefill", 50, 50)
        for k in range(1, 100):
            clock.t += 0.1
            quick("decode", k, 512)
        assert not caplog.records  # a 15 s sample says nothing
        slow = runner.SampleProgress("slow", None, clock=clock)
        start = clock.t
        slow("prefill", 0, 8000)
        for done in (2048, 4096, 6144, 8000):  # chunked, 20 s per chunk
            clock.t += 20.0
            slow("prefill", done, 8000)
        for k in range(1, 513):
            clock.t += 0.2
            slow("decode", k, 512)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == [
        "slow: prefill 4096/8000 tok, 40 s into the sample",  # first event past 30 s
        "slow: decode 1/512, 80 s into the sample",  # the next stage, >= 30 s after that line
    ]
    assert clock.t - start > 100


def test_the_bar_clock_moves_through_a_long_forward():
    out = io.StringIO()
    bar = tqdm(total=3, file=out, mininterval=0, ascii=True)
    before = out.getvalue().count("\r")
    with runner.BarClock(bar, interval=0.05):
        time.sleep(0.5)  # a prefill: no events, no redraws but the clock's
    redraws = out.getvalue().count("\r") - before
    bar.close()
    assert redraws >= 3, out.getvalue()


def test_the_bar_clock_ticks_only_on_a_terminal():
    """In a log file (nohup, SLURM) every redraw would be a line: the clock ticks on terminals only."""

    class Tty(io.StringIO):
        def isatty(self):
            return True

    closed = io.StringIO()
    closed.close()
    assert runner._is_terminal(Tty()) and not runner._is_terminal(io.StringIO())
    assert not runner._is_terminal(closed) and not runner._is_terminal(object())


# ------------------------------------------------------------------------------------------ warm-up
def test_one_untimed_warm_up_runs_before_the_first_sample_and_rows_record_it(tiny_dir, tmp_path, monkeypatch):
    events = []
    real_ids = runner.generate_ids

    def warm(model, ids, question, method, **kw):
        events.append(("warm-up", ids.shape[1], method is not cfg_method[0], kw["max_new_tokens"]))
        return real_ids(model, ids, question, method, **kw)

    def sample(model, tokenizer, **kw):
        events.append(("sample",))
        return REAL_GENERATE(model, tokenizer, **kw)

    monkeypatch.setattr(runner, "generate_ids", warm)
    monkeypatch.setattr(runner, "generate", sample)
    results = tmp_path / "results"
    spec = RunSpec.from_config(make_cfg(tiny_dir, results, "task.lengths=[150]"))
    cfg_method = [spec.method]
    runner.run(spec)
    # once, first, on a copy of the run's method (nothing it keeps on itself leaks into the samples)
    assert events == [("warm-up", runner.WARMUP_TOKENS, True, 2)] + [("sample",)] * len(DEPTHS)
    rows = read_rows(result_files(results)[0])
    assert len({r["warmup_s"] for r in rows}) == 1 and rows[0]["warmup_s"] > 0
    events.clear()
    runner.run(spec)  # nothing left to run: no warm-up
    assert events == []


def test_a_failed_warm_up_is_logged_and_the_samples_still_run(tiny_dir, tmp_path, monkeypatch, caplog):
    logging.getLogger("eval.runner").disabled = False  # an in-process Hydra run may have disabled it

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this\nsecond line")

    monkeypatch.setattr(runner, "generate_ids", broken)
    results = tmp_path / "results"
    with caplog.at_level("WARNING", logger="eval.runner"):
        runner.run(make_cfg(tiny_dir, results, "task.lengths=[150]"))
    assert any(
        "warm-up failed" in r.getMessage() and "no kernel for this" in r.getMessage() for r in caplog.records
    )
    rows = read_rows(result_files(results)[0])
    assert len(rows) == len(DEPTHS) and all(r["status"] == "ok" and r["warmup_s"] is None for r in rows)
