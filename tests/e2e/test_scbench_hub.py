"""task=scbench's Hub path against the Hub look-alike (tests/hub_server.py): a dataset repo laid out
as microsoft/SCBench is (a README whose `configs` name each config's parquet files), loaded by
`datasets.load_dataset` in a child process whose `HF_ENDPOINT` points at the look-alike (the Hub
libraries read it at import), then from `datasets`' cache with the endpoint gone and offline mode
on; a revision pinned to the repo's commit, an unknown revision and a config missing from the repo.
"""

from __future__ import annotations

import pytest
from hub_server import HubServer, Repo
from hub_tasks import hub_child, loaded, parquet_bytes, refusal

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


@pytest.fixture(scope="module")
def repo() -> Repo:
    return Repo(
        {
            "README.md": README,
            "scbench_kv/test-00000-of-00001.parquet": parquet_bytes(KV),
            "scbench_vt/test-00000-of-00001.parquet": parquet_bytes(VT),
        }
    )


def test_loads_from_the_hub_then_from_the_cache(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        online = hub_child(CHILD, tmp_path, hub.url, False, configs=["scbench_kv", "scbench_vt"], limit=2)
        assert loaded(online) == {"scbench_kv": KV[:2], "scbench_vt": VT}
        assert not hub.unhandled, hub.unhandled
        pinned = hub_child(
            CHILD, tmp_path / "pinned", hub.url, False, configs=["scbench_vt"], revision=repo.commit
        )
        assert loaded(pinned) == {"scbench_vt": VT}
        wrong = hub_child(
            CHILD, tmp_path / "wrong", hub.url, False, configs=["scbench_vt"], revision="0" * 40
        )
        assert (
            f"scbench_vt could not be loaded from the Hub dataset microsoft/SCBench at revision {'0' * 40}"
            in refusal(wrong)
        )
        endpoint = hub.url
    # The endpoint is gone: offline mode reads the same records from `datasets`' cache.
    cached = hub_child(CHILD, tmp_path, endpoint, True, configs=["scbench_kv"])
    assert loaded(cached) == {"scbench_kv": KV}


def test_config_missing_from_the_repo_names_it(repo, tmp_path):
    with HubServer({REPO: repo}) as hub:
        out = hub_child(CHILD, tmp_path, hub.url, False, configs=["scbench_mf"])
    assert (
        "FileNotFoundError: SCBench config scbench_mf could not be loaded from the Hub dataset microsoft/SCBench"
        in refusal(out)
    )
