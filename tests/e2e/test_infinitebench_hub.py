"""task=infinitebench's Hub path against the Hub look-alike (tests/hub_server.py): a dataset repo laid
out as xinrongzhang2022/InfiniteBench is (one <task>.jsonl per task, a README whose one config
lists each file as a split), each task's file fetched alone with huggingface_hub in a child process
whose `HF_ENDPOINT` points at the look-alike (the Hub libraries read it at import), then read from
the Hugging Face cache with the endpoint gone and offline mode on, and again with the endpoint
gone but offline mode off; a revision pinned to the repo's commit, an unknown revision and a task
missing from the repo.
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
REPO = ("dataset", "xinrongzhang2022/InfiniteBench")
README = b"""---
configs:
- config_name: default
  data_files:
  - split: passkey
    path: passkey.jsonl
  - split: code_debug
    path: code_debug.jsonl
  - split: math_calc
    path: math_calc.jsonl
license: apache-2.0
---
"""
PASSKEY = [
    {"id": i, "context": f"noise {i} The pass key is {i}7. noise", "input": "What is the pass key?",
     "answer": [f"{i}7"], "options": []}
    for i in range(3)
]  # fmt: skip
DEBUG = [{"id": 0, "context": "def a(): pass", "input": "", "answer": ["b"], "options": ["a", "b", "c", "d"]}]
# Another schema in the same repo (a list of lists of ints): each task's file is loaded alone.
CALC = [{"id": 0, "context": "1 + 2 - 4", "input": "", "answer": [[1, 3, -1]], "options": []}]
# Run in the child: the records of each task as JSON.
CHILD = """
import json, sys
from eval.tasks.infinitebench.task import InfiniteBenchTask
task = InfiniteBenchTask(**json.loads(sys.argv[1]))
print(json.dumps({t: task.records(t) for t in task.tasks}))
"""


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo(
        {
            "README.md": README,
            "passkey.jsonl": jsonl(PASSKEY),
            "code_debug.jsonl": jsonl(DEBUG),
            "math_calc.jsonl": jsonl(CALC),
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
        online = child(tmp_path, hub.url, False, tasks=["passkey", "math_calc"], limit=2)
        assert online.returncode == 0, online.stderr
        assert json.loads(online.stdout) == {"passkey": PASSKEY[:2], "math_calc": CALC}
        assert not hub.unhandled, hub.unhandled
        fetched = " ".join(hub.paths_requested("GET"))
        assert "passkey.jsonl" in fetched and "code_debug.jsonl" not in fetched  # only the asked tasks
        assert "README.md" not in fetched  # the card's one config (every file) is not prepared
        pinned = child(tmp_path / "pinned", hub.url, False, tasks=["code_debug"], revision=repo.commit)
        assert pinned.returncode == 0 and json.loads(pinned.stdout) == {"code_debug": DEBUG}, pinned.stderr
        wrong = child(tmp_path / "wrong", hub.url, False, tasks=["code_debug"], revision="0" * 40)
        assert wrong.returncode != 0
        line = wrong.stderr.strip().splitlines()[-1]
        assert (
            "code_debug could not be loaded from the Hub dataset xinrongzhang2022/InfiniteBench "
            f"at revision {'0' * 40}" in line
        )
        assert "task.data_files=PATH" in line
        endpoint = hub.url
    # The endpoint is gone: offline mode reads the same records from `datasets`' cache.
    cached = child(tmp_path, endpoint, True, tasks=["passkey"])
    assert cached.returncode == 0 and json.loads(cached.stdout) == {"passkey": PASSKEY}, cached.stderr
    gone = child(tmp_path, endpoint, False, tasks=["passkey", "math_calc"])  # nothing answers there
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout) == {"passkey": PASSKEY, "math_calc": CALC}
    pinned = child(tmp_path / "pinned", endpoint, True, tasks=["code_debug"], revision=repo.commit)
    assert pinned.returncode == 0 and json.loads(pinned.stdout) == {"code_debug": DEBUG}, pinned.stderr
    missing = child(tmp_path, endpoint, True, tasks=["code_debug"])  # never fetched at the default branch
    assert missing.returncode != 0
    line = missing.stderr.strip().splitlines()[-1]
    assert "code_debug could not be loaded" in line and "no copy is in the Hugging Face cache" in line


def test_task_missing_from_the_repo_names_it(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        out = child(tmp_path, hub.url, False, tasks=["kv_retrieval"])
    assert out.returncode != 0
    line = out.stderr.strip().splitlines()[-1]
    assert (
        "FileNotFoundError: InfiniteBench task kv_retrieval could not be loaded from the Hub dataset "
        "xinrongzhang2022/InfiniteBench" in line
    )
    assert "task.data_files=PATH" in line
