"""Provenance recorded in every result row: library versions, the harness commit and whether the
checkout had uncommitted changes (with a hash of them), the SLURM job that ran the row, and the time."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Mapping
from datetime import datetime, timezone
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import transformers

REPO_ROOT = Path(__file__).resolve().parents[1]


@cache
def versions() -> dict[str, str | None]:
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "snapkv_bench": _own_version(),
    }


def _own_version() -> str | None:
    try:
        return version("snapkv-bench")
    except PackageNotFoundError:  # running from a checkout that is not pip-installed
        pyproject = REPO_ROOT / "pyproject.toml"
        m = (
            re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.M)
            if pyproject.is_file()
            else None
        )
        return m.group(1) if m else None


def _git(*args: str) -> bytes | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


# Pathspecs left out of the code state: the committed results tree, which runs write into.
NOT_CODE = (":(exclude)results",)


@cache
def git_state() -> dict[str, str | bool | None]:
    """`{"git_sha", "git_dirty", "git_diff_sha"}` of the harness checkout (all None outside git).

    git_dirty: tracked files differ from HEAD, or untracked files that git does not ignore exist,
    outside `results/` (rows and reports are what runs write, not code: a run from a clean checkout
    stays clean while its own rows accumulate there).
    git_diff_sha: 12 hex digits of the sha256 of `git diff HEAD --binary` plus each untracked file's
    path and content (outside `results/`), so two rows with the same sha and diff hash ran the same
    code; None when clean. Computed once per process.
    """
    sha = (_git("rev-parse", "HEAD") or b"").decode().strip()
    if not re.fullmatch(r"[0-9a-f]{40}", sha):
        return {"git_sha": None, "git_dirty": None, "git_diff_sha": None}
    diff = _git("diff", "HEAD", "--binary", "--", ".", *NOT_CODE)
    untracked = _git("ls-files", "--others", "--exclude-standard", "-z", "--", ".", *NOT_CODE)
    if diff is None or untracked is None:
        return {"git_sha": sha, "git_dirty": None, "git_diff_sha": None}
    h = hashlib.sha256(diff)
    names = sorted(n for n in untracked.split(b"\0") if n)
    for name in names:
        h.update(b"\0untracked\0" + name + b"\0")
        try:
            h.update((REPO_ROOT / name.decode()).read_bytes())
        except OSError:
            pass
    dirty = bool(diff) or bool(names)
    return {"git_sha": sha, "git_dirty": dirty, "git_diff_sha": h.hexdigest()[:12] if dirty else None}


# Row column -> the environment variable SLURM sets in a job (sbatch(1), "OUTPUT ENVIRONMENT VARIABLES").
SLURM_FIELDS: dict[str, str] = {
    "slurm_job_id": "SLURM_JOB_ID",  # this job; in an array, the task's own id
    "slurm_array_job_id": "SLURM_ARRAY_JOB_ID",  # the array's id (the first task's job id)
    "slurm_array_task_id": "SLURM_ARRAY_TASK_ID",  # the task's index in the array
    "slurm_restart_count": "SLURM_RESTART_COUNT",  # times the job was requeued (absent before the first)
}


def slurm_ids(environ: Mapping[str, str] | None = None) -> dict[str, int | str | None]:
    """The SLURM job that runs this process: `{"slurm_job_id", "slurm_array_job_id",
    "slurm_array_task_id", "slurm_restart_count"}`, ints (a value SLURM spells otherwise stays a
    string), None where unset: outside SLURM every value is None, a plain job has no array ids, and
    a job never requeued has no restart count. Not cached: a requeued job is a new process with the
    same ids and a higher restart count."""
    env = os.environ if environ is None else environ
    out: dict[str, int | str | None] = {}
    for field, var in SLURM_FIELDS.items():
        value = (env.get(var) or "").strip()
        out[field] = int(value) if value.isdigit() else (value or None)
    return out


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
