"""task=infinitebench's Hub path against the Hub look-alike (tests/hub_server.py): a dataset repo laid
out as xinrongzhang2022/InfiniteBench is (one <task>.jsonl per task, a README whose one config
lists each file as a split), each task's file fetched alone with huggingface_hub in a child process
whose `HF_ENDPOINT` points at the look-alike (the Hub libraries read it at import), then read from
the Hugging Face cache with the endpoint gone and offline mode on, and again with the endpoint
gone but offline mode off; a revision pinned to the repo's commit, an unknown revision and a task
missing from the repo.
"""

from __future__ import annotations

import pytest
from hub_server import HubServer, Repo
from hub_tasks import hub_child, jsonl_bytes, loaded, refusal

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


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo(
        {
            "README.md": README,
            "passkey.jsonl": jsonl_bytes(PASSKEY),
            "code_debug.jsonl": jsonl_bytes(DEBUG),
            "math_calc.jsonl": jsonl_bytes(CALC),
        }
    )


def test_loads_from_the_hub_then_from_the_cache(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        online = hub_child(CHILD, tmp_path, hub.url, False, tasks=["passkey", "math_calc"], limit=2)
        assert loaded(online) == {"passkey": PASSKEY[:2], "math_calc": CALC}
        assert not hub.unhandled, hub.unhandled
        fetched = " ".join(hub.paths_requested("GET"))
        assert "passkey.jsonl" in fetched and "code_debug.jsonl" not in fetched  # only the asked tasks
        assert "README.md" not in fetched  # the card's one config (every file) is not prepared
        pinned = hub_child(
            CHILD, tmp_path / "pinned", hub.url, False, tasks=["code_debug"], revision=repo.commit
        )
        assert loaded(pinned) == {"code_debug": DEBUG}
        wrong = hub_child(CHILD, tmp_path / "wrong", hub.url, False, tasks=["code_debug"], revision="0" * 40)
        assert (
            "code_debug could not be loaded from the Hub dataset xinrongzhang2022/InfiniteBench "
            f"at revision {'0' * 40}" in refusal(wrong)
        )
        endpoint = hub.url
    # The endpoint is gone: offline mode reads the same records from the Hugging Face cache.
    cached = hub_child(CHILD, tmp_path, endpoint, True, tasks=["passkey"])
    assert loaded(cached) == {"passkey": PASSKEY}
    # Offline mode off, and nothing answers at the endpoint: the cache all the same.
    gone = hub_child(CHILD, tmp_path, endpoint, False, tasks=["passkey", "math_calc"])
    assert loaded(gone) == {"passkey": PASSKEY, "math_calc": CALC}
    pinned = hub_child(CHILD, tmp_path / "pinned", endpoint, True, tasks=["code_debug"], revision=repo.commit)
    assert loaded(pinned) == {"code_debug": DEBUG}
    # code_debug was never fetched at the default branch:
    missing = hub_child(CHILD, tmp_path, endpoint, True, tasks=["code_debug"])
    line = refusal(missing)
    assert "code_debug could not be loaded" in line and "no copy is in the Hugging Face cache" in line


def test_task_missing_from_the_repo_names_it(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        out = hub_child(CHILD, tmp_path, hub.url, False, tasks=["kv_retrieval"])
    assert (
        "FileNotFoundError: InfiniteBench task kv_retrieval could not be loaded from the Hub dataset "
        "xinrongzhang2022/InfiniteBench" in refusal(out)
    )
