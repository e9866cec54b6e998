"""task=longbench_v2's Hub path against the Hub look-alike (tests/hub_server.py): a dataset repo laid
out as THUDM/LongBench-v2 is (a README and one `data.json`, a JSON list of records: split `train`),
loaded by `datasets.load_dataset` in a child process whose `HF_ENDPOINT` points at the look-alike
(the Hub libraries read it at import), then from `datasets`' cache with the endpoint gone and
offline mode on; a revision pinned to the repo's commit, an unknown revision, and a repository the
Hub does not hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hub_server import HubServer, Repo

ROOT = Path(__file__).resolve().parents[2]
REPO = ("dataset", "THUDM/LongBench-v2")
README = b"""---
license: apache-2.0
task_categories:
- multiple-choice
---
"""
RECORDS = [
    {
        "_id": f"id{i}", "domain": "Code Repository Understanding", "sub_domain": "Code repo QA",
        "difficulty": ("easy", "hard")[i % 2], "length": ("short", "medium", "long")[i % 3],
        "question": f"Which function is called {i}?", "choice_A": "f", "choice_B": "g", "choice_C": "h",
        "choice_D": "k", "answer": "ABCD"[i % 4], "context": f"def f(): return {i}",
    }
    for i in range(5)
]  # fmt: skip
# Run in the child: the records the task read, as JSON.
CHILD = """
import json, sys
from eval.tasks.longbench_v2.task import LongBenchV2Task
print(json.dumps(LongBenchV2Task(**json.loads(sys.argv[1])).records()))
"""


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo({"README.md": README, "data.json": json.dumps(RECORDS).encode()})


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
        online = child(tmp_path, hub.url, False, lengths=["short", "long"])
        assert online.returncode == 0, online.stderr
        assert json.loads(online.stdout) == [r for r in RECORDS if r["length"] != "medium"]
        assert not hub.unhandled, hub.unhandled
        pinned = child(tmp_path / "pinned", hub.url, False, revision=repo.commit, limit=2)
        assert pinned.returncode == 0 and json.loads(pinned.stdout) == RECORDS[:2], pinned.stderr
        wrong = child(tmp_path / "wrong", hub.url, False, revision="0" * 40)
        assert wrong.returncode != 0
        line = wrong.stderr.strip().splitlines()[-1]
        assert (
            f"LongBench-v2 could not be loaded from the Hub dataset THUDM/LongBench-v2 at revision {'0' * 40}"
            in line
        )
        assert "task.data_files=PATH" in line
        endpoint = hub.url
    # The endpoint is gone: offline mode reads the same records from `datasets`' cache.
    cached = child(tmp_path, endpoint, True)
    assert cached.returncode == 0 and json.loads(cached.stdout) == RECORDS, cached.stderr


def test_repository_missing_from_the_hub_names_it(tmp_path):
    with HubServer({}) as hub:
        out = child(tmp_path, hub.url, False, repo="THUDM/LongBench-v3")
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert (
        "FileNotFoundError: LongBench-v2 could not be loaded from the Hub dataset THUDM/LongBench-v3" in line
    )
    assert "task.data_files=PATH" in line
