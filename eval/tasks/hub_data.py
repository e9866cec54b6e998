"""Records of a Hub dataset or of local files, for the tasks that read their benchmark from the
Hub (SCBench, LongBench-v2, InfiniteBench).

Hub: a config's split through ``datasets.load_dataset(repo, config, split=split, revision=revision)``,
cached by `datasets` (offline mode reads the cache) (`load_hub`), or one file of the repository
through huggingface_hub (`load_hub_file`: kept in the Hugging Face cache and read from it offline,
for a repository whose files are no `datasets` config one can load alone). Local: a ``.jsonl``
file, a ``.json`` file holding a list of records (a Hub repo's ``data.json``), a ``.parquet`` file
or a directory of parquet shards. Either way a list of plain dicts; a failure to load from the Hub
is one FileNotFoundError line naming what was asked for, the repository and `task.data_files`,
which `run.py` turns into exit 2 before the model loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import huggingface_hub

from eval.tasks.jsonl import numbered_records
from snapkv.errors import one_line
from snapkv_models.hub import hub_unavailable


def _read_parquet(path: Path) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq  # a dependency of `datasets`; loaded only for local parquet files

    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def _read_json(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: malformed JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(f"{path}: expected a JSON list of objects (records), got {type(data).__name__}")
    return data


def read_local(path: Path) -> list[dict[str, Any]]:
    """The records of a local file (.jsonl, .json list, .parquet) or a folder of parquet shards."""
    if path.is_dir() or path.suffix == ".parquet":
        return _read_parquet(path)
    if path.suffix == ".json":
        return _read_json(path)
    return [record for _, record in numbered_records(path)]


def load_hub(
    what: str, repo: str, config: str | None, split: str, revision: str | None, local_hint: str
) -> list[dict[str, Any]]:
    """`datasets.load_dataset(repo, config, split=split, revision=revision)` as a list of records.

    FileNotFoundError, one line naming `what` (e.g. "SCBench config scbench_kv"), the repository,
    the revision and `task.data_files` (with `local_hint`: what the local path may be), when it
    cannot be loaded: offline without a cached copy, an unreachable Hub, a missing repo, config or
    revision.
    """
    try:
        import datasets  # lazy: the harness' `bench` extra, heavy to import

        data = datasets.load_dataset(repo, config, split=split, revision=revision)
    except Exception as err:  # offline, unreachable, missing repo/config/revision: one actionable line
        raise _not_loaded(what, repo, revision, one_line(err), local_hint) from None
    return [dict(row) for row in data]


def load_hub_file(
    what: str, repo: str, filename: str, revision: str | None, local_hint: str
) -> list[dict[str, Any]]:
    """The records of the file `filename` of the Hub dataset `repo` (`read_local`), fetched alone
    with huggingface_hub into its cache once and read from the cache offline.

    Where the Hub cannot be reached (`snapkv_models.hub.hub_unavailable`), the cache only: a file
    not in it fails at once, not after retries. FileNotFoundError, one line as `load_hub`'s, when
    it cannot be had.
    """
    unavailable = None
    try:
        unavailable = hub_unavailable()
        path = huggingface_hub.hf_hub_download(
            repo_id=repo,
            filename=filename,
            repo_type="dataset",
            revision=revision,
            local_files_only=bool(unavailable),
        )
    except Exception as err:  # offline, unreachable, missing repo/file/revision: one actionable line
        why = f"{unavailable} and no copy is in the Hugging Face cache" if unavailable else one_line(err)
        raise _not_loaded(what, repo, revision, why, local_hint) from None
    return read_local(Path(path))


def _not_loaded(what: str, repo: str, revision: str | None, why: str, local_hint: str) -> FileNotFoundError:
    at = f" at revision {revision}" if revision else ""
    return FileNotFoundError(
        f"{what} could not be loaded from the Hub dataset {repo}{at} ({why}); on a machine "
        f"without the Hub give local files with task.data_files=PATH ({local_hint})"
    )
