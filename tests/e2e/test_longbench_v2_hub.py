"""task=longbench_v2's Hub path against the Hub look-alike (tests/hub_server.py): a dataset repo laid
out as THUDM/LongBench-v2 is (a README and one `data.json`, a JSON list of records: split `train`),
loaded by `datasets.load_dataset` in a child process whose `HF_ENDPOINT` points at the look-alike
(the Hub libraries read it at import), then from `datasets`' cache with the endpoint gone and
offline mode on; a revision pinned to the repo's commit, an unknown revision, and a repository the
Hub does not hold.
"""

from __future__ import annotations

import json

import pytest
from hub_server import HubServer, Repo
from hub_tasks import hub_child, loaded, refusal

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


def test_loads_from_the_hub_then_from_the_cache(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        online = hub_child(CHILD, tmp_path, hub.url, False, lengths=["short", "long"])
        assert loaded(online) == [r for r in RECORDS if r["length"] != "medium"]
        assert not hub.unhandled, hub.unhandled
        pinned = hub_child(CHILD, tmp_path / "pinned", hub.url, False, revision=repo.commit, limit=2)
        assert loaded(pinned) == RECORDS[:2]
        wrong = hub_child(CHILD, tmp_path / "wrong", hub.url, False, revision="0" * 40)
        assert (
            f"LongBench-v2 could not be loaded from the Hub dataset THUDM/LongBench-v2 at revision {'0' * 40}"
            in refusal(wrong)
        )
        endpoint = hub.url
    # The endpoint is gone: offline mode reads the same records from `datasets`' cache.
    cached = hub_child(CHILD, tmp_path, endpoint, True)
    assert loaded(cached) == RECORDS


def test_repository_missing_from_the_hub_names_it(tmp_path):
    with HubServer({}) as hub:
        out = hub_child(CHILD, tmp_path, hub.url, False, repo="THUDM/LongBench-v3")
    assert (
        "FileNotFoundError: LongBench-v2 could not be loaded from the Hub dataset THUDM/LongBench-v3"
        in refusal(out)
    )
