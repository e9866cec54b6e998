"""What the tests of the three Hub benchmark tasks share (SCBench, LongBench-v2, InfiniteBench:
tests/test_<task>.py, and their Hub paths against the Hub look-alike in tests/e2e/test_<task>_hub.py):
local data files, `run.py`'s refusals before the model loads, and a child interpreter whose Hub
libraries point at the look-alike (tests/hub_server.py). The tiny model a run saves with its
tokenizer is `conftest.save_tiny_llama`."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]


def compose_cfg(overrides: list[str]):
    """`conf/config.yaml` with `overrides`, as `run.py` composes it."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


# ------------------------------------------------------------------------------------------ data
def write_jsonl(path: Path, records: list[dict]) -> Path:
    """`records` as a JSONL file at `path` (its folder created), one record a line, non-ASCII kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def parquet_bytes(records: list[dict]) -> bytes:
    """`records` as one parquet file (a Hub repo's shard)."""
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(records), buf)
    return buf.getvalue()


def write_parquet(path: Path, records: list[dict]) -> Path:
    """`records` as a parquet file at `path` (its folder created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(parquet_bytes(records))
    return path


def jsonl_bytes(records: list[dict]) -> bytes:
    """`records` as the bytes of a JSONL file (a Hub repo's file)."""
    return "".join(json.dumps(r) + "\n" for r in records).encode()


# ------------------------------------------------------------------------------------------ run.py
def run_cli(monkeypatch, tmp_path: Path, capsys, task: str, *overrides: str) -> tuple[int, list[str]]:
    """`python run.py task=TASK OVERRIDES` in this process, results into tmp_path/results, failing
    the test if the model loads: (exit code, stderr lines)."""
    import eval.runner as runner
    import run as run_module

    def no_model(*a, **k):
        raise AssertionError("the model was loaded although the data is missing")

    monkeypatch.setattr(runner, "load_model", no_model)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "run.py", f"hydra.run.dir={tmp_path}/hydra", "hydra.output_subdir=null",
            "hydra/job_logging=disabled", "hydra/hydra_logging=disabled",
            f"results_dir={tmp_path}/results", f"task={task}", *overrides,
        ],
    )  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        run_module.cli()
    return exc.value.code, capsys.readouterr().err.strip().splitlines()


def assert_offline_refusal(
    monkeypatch, tmp_path: Path, capsys, task: str, overrides: list[str], named: list[str]
):
    """Offline, with empty Hugging Face caches and no `task.data_files`: `run.py` exits 2 before the
    model loads, with one `error:` line holding each of `named`, and writes no results."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    code, err = run_cli(monkeypatch, tmp_path, capsys, task, *overrides)
    assert code == 2 and len(err) == 1, err
    for part in ("error: ", "task.data_files=", *named):
        assert part in err[0], err
    assert not (tmp_path / "results").exists()


# ------------------------------------------------------------------------------------------ Hub look-alike
def hub_child(script: str, tmp_path: Path, endpoint: str, offline: bool, **kw) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter (argv[1]: `kw` as JSON) whose Hub libraries read `endpoint`
    at import, with empty caches under tmp_path/hf, no token, and `HF_HUB_OFFLINE=1` where `offline`."""
    drop = (
        "HF_HUB_OFFLINE",
        "HF_DATASETS_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(
        HF_ENDPOINT=endpoint,
        HF_HOME=str(tmp_path / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_DATASETS_DISABLE_PROGRESS_BARS="1",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
    )
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run(
        [sys.executable, "-c", script, json.dumps(kw)], env=env, capture_output=True, text=True, timeout=300
    )


def loaded(proc: subprocess.CompletedProcess):
    """The JSON a `hub_child` printed, once it succeeded."""
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def refusal(proc: subprocess.CompletedProcess) -> str:
    """The last stderr line of a `hub_child` that failed, which names `task.data_files`."""
    assert proc.returncode != 0, proc.stdout
    line = proc.stderr.strip().splitlines()[-1]
    assert "task.data_files=PATH" in line, line
    return line
