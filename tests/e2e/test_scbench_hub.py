"""task=scbench's Hub path against the Hub look-alike (tests/hub_server.py): a dataset repo laid out
as microsoft/SCBench is (a README whose `configs` name each config's parquet files), loaded by
`datasets.load_dataset` in a child process whose `HF_ENDPOINT` points at the look-alike (the Hub
libraries read it at import), then from `datasets`' cache with the endpoint gone and offline mode
on; a revision pinned to the repo's commit, an unknown revision and a config missing from the repo.
"""

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
from hub_server import HubServer, Repo

ROOT = Path(__file__).resolve().parents[2]
REPO = ("dataset", "microsoft/SCBench")
README = b"""---
license: mit
configs:
- config_name: scbench_kv
  data_files:
  - split: test
    path: scbench_kv/test-00000-of-00001.parquet
- config_name: scbench_vt
  data_files:
  - split: test
    path: scbench_vt/test-00000-of-00001.parquet
---
"""
KV = [
    {
        "id": i,
        "context": f'{{"k{i}": "v{i}"}}',
        "multi_turns": [{"input": f'Key: "k{i}"', "answer": f"v{i}"}] * 2,
    }
    for i in range(3)
]
VT = [{"id": 0, "context": "VAR A = 1", "multi_turns": [{"input": "Which equal 1?", "answer": ["A"]}]}]
# Run in the child: the records' count, the first sample of each config as JSON.
CHILD = """
import json, sys
from eval.tasks.scbench.task import SCBenchTask
task = SCBenchTask(**json.loads(sys.argv[1]))
print(json.dumps({c: task.records(c) for c in task.configs}))
"""


def parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo(
        {
            "README.md": README,
            "scbench_kv/test-00000-of-00001.parquet": parquet(KV),
            "scbench_vt/test-00000-of-00001.parquet": parquet(VT),
        }
    )


def child(tmp_path: Path, endpoint: str, offline: bool, **kw) -> subprocess.CompletedProcess:
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
        [sys.executable, "-c", CHILD, json.dumps(kw)], env=env, capture_output=True, text=True, timeout=300
    )


def test_loads_from_the_hub_then_from_the_cache(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        online = child(tmp_path, hub.url, False, configs=["scbench_kv", "scbench_vt"], limit=2)
        assert online.returncode == 0, online.stderr
        assert json.loads(online.stdout) == {"scbench_kv": KV[:2], "scbench_vt": VT}
        assert not hub.unhandled, hub.unhandled
        pinned = child(tmp_path / "pinned", hub.url, False, configs=["scbench_vt"], revision=repo.commit)
        assert pinned.returncode == 0 and json.loads(pinned.stdout) == {"scbench_vt": VT}, pinned.stderr
        wrong = child(tmp_path / "wrong", hub.url, False, configs=["scbench_vt"], revision="0" * 40)
        assert wrong.returncode != 0
        line = wrong.stderr.strip().splitlines()[-1]
        assert (
            f"scbench_vt could not be loaded from the Hub dataset microsoft/SCBench at revision {'0' * 40}"
            in line
        )
        assert "task.data_files=PATH" in line
        endpoint = hub.url
    # The endpoint is gone: offline mode reads the same records from `datasets`' cache.
    cached = child(tmp_path, endpoint, True, configs=["scbench_kv"])
    assert cached.returncode == 0 and json.loads(cached.stdout) == {"scbench_kv": KV}, cached.stderr


def test_config_missing_from_the_repo_names_it(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        out = child(tmp_path, hub.url, False, configs=["scbench_mf"])
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert (
        "FileNotFoundError: SCBench config scbench_mf could not be loaded from the Hub dataset microsoft/SCBench"
        in line
    )
    assert "task.data_files=PATH" in line
