"""Small seams: registries refuse bad classes, one cache root, one first-line helper,
provenance of a dirty checkout, score_longbench never overwrites silently nor writes NaN."""

from __future__ import annotations

import json
import math
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

import snapkv_models.loading
from eval import provenance
from eval.tasks import (
    TASKS,
    Task,
    TaskReport,
    haystack,
    register_report,
    register_task,
    task_class,
    task_report,
)
from eval.tasks.longbench import task as longbench
from eval.tasks.longbench.score import main as score_main
from snapkv.errors import first_line, one_line
from snapkv.methods import METHODS, register
from snapkv.methods.snapkv import SnapKV
from snapkv_models.paths import cache_root


# ---------------------------------------------------------------------------------------- registries
def test_task_registry_refuses_a_duplicate_name_and_a_non_task():
    @dataclass
    class OtherNeedle(Task):
        name: ClassVar[str] = "needle"

    with pytest.raises(
        ValueError,
        match=r"'needle' is already registered by eval\.tasks\.needle\.task\.NeedleTask.*OtherNeedle",
    ):
        register_task(OtherNeedle)
    assert task_class("needle").__name__ == "NeedleTask"

    class NotATask:
        name = "not_a_task"

    with pytest.raises(ValueError, match="NotATask.*not a subclass of eval.tasks.base.Task"):
        register_task(NotATask)
    assert "not_a_task" not in TASKS


def test_task_registry_is_lazy_and_reports_are_registered_apart():
    class OtherReport(TaskReport):
        pass

    with pytest.raises(
        ValueError,
        match=r"report name 'needle' is already registered by eval\.tasks\.needle\.report\.NeedleReport",
    ):
        register_report("needle", OtherReport)
    assert task_report("needle").__name__ == "NeedleReport"
    assert task_report("no_such_task") is TaskReport  # rows of an unregistered task: generic tables
    with pytest.raises(ValueError, match="not a subclass of eval.tasks.base.TaskReport"):
        register_report("other", Task)
    with pytest.raises(
        ValueError,
        match="unknown task 'bogus'; known tasks: fidelity, infinitebench, kv_retrieval, longbench, "
        "longbench_v2, needle, reasoning, ruler, scbench$",
    ):
        task_class("bogus")


def test_method_registry_refuses_a_duplicate_name_and_a_non_method():
    @dataclass
    class OtherSnapKV(SnapKV):
        name: ClassVar[str] = "snapkv"

    with pytest.raises(
        ValueError, match=r"'snapkv' is already registered by snapkv\.methods\.snapkv\.SnapKV.*OtherSnapKV"
    ):
        register(OtherSnapKV)
    assert METHODS["snapkv"] is SnapKV

    class NotAMethod:
        name = "not_a_method"

    with pytest.raises(ValueError, match="NotAMethod.*not a subclass of snapkv.methods.base.Method"):
        register(NotAMethod)
    assert "not_a_method" not in METHODS
    assert register(SnapKV) is SnapKV  # re-registering the same class (a module reload) is fine


# ------------------------------------------------------------------------------------------- helpers
def test_one_cache_root(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for value, expected in (
        (None, tmp_path / "home" / ".cache" / "snapkv-bench"),
        ("", tmp_path / "home" / ".cache" / "snapkv-bench"),  # empty: the default, not the cwd
        ("~/c", tmp_path / "home" / "c"),  # ~ expanded
        (str(tmp_path / "x"), tmp_path / "x"),
    ):
        if value is None:
            monkeypatch.delenv("SNAPKV_BENCH_CACHE", raising=False)
        else:
            monkeypatch.setenv("SNAPKV_BENCH_CACHE", value)
        assert cache_root() == expected
        assert haystack.paul_graham_dir() == expected / "haystacks" / "paul_graham"
        assert longbench.cache_dir() == expected / "longbench"

    assert snapkv_models.loading.cache_root is cache_root  # the model cache uses the same lookup


def test_first_line():
    assert first_line(RuntimeError("\n  boom  \nsecond")) == "boom"
    assert first_line(RuntimeError()) == "RuntimeError"
    assert first_line(KeyError("model.name")) == "model.name"  # not "'model.name'"
    assert one_line(ValueError("bad\nmore")) == "ValueError: bad"
    assert one_line(MemoryError()) == "MemoryError"


# ---------------------------------------------------------------------------------------- provenance
def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_rows_record_a_dirty_checkout_and_its_diff(monkeypatch, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    _git(repo, "add", "a.py")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "init")
    monkeypatch.setattr(provenance, "REPO_ROOT", repo)

    def state():
        provenance.git_state.cache_clear()
        return provenance.git_state()

    clean = state()
    assert clean["git_dirty"] is False and clean["git_diff_sha"] is None and len(clean["git_sha"]) == 40
    (repo / "a.py").write_text("x = 2\n")
    one = state()
    assert one["git_sha"] == clean["git_sha"] and one["git_dirty"] is True and len(one["git_diff_sha"]) == 12
    (repo / "a.py").write_text("x = 3\n")
    assert state()["git_diff_sha"] != one["git_diff_sha"]  # another diff, another hash
    (repo / "a.py").write_text("x = 1\n")
    (repo / "new.py").write_text("y = 1\n")  # an untracked file counts as a change
    assert state()["git_dirty"] is True
    (repo / "new.py").unlink()
    # What runs write under results/ (new rows, a changed committed report) is not code.
    (repo / "results").mkdir()
    (repo / "results" / "README.md").write_text("page\n")
    _git(repo, "add", "results/README.md")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "page")
    (repo / "results" / "run").mkdir()
    (repo / "results" / "run" / "full-0123abcd.jsonl").write_text("{}\n")
    (repo / "results" / "README.md").write_text("page, regenerated\n")
    after = state()
    assert after["git_dirty"] is False and after["git_diff_sha"] is None
    (repo / "a.py").write_text("x = 4\n")  # code beside them still counts
    assert state()["git_dirty"] is True
    provenance.git_state.cache_clear()


# ------------------------------------------------------------------------------------ score_longbench
def _write(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_score_longbench_never_overwrites_silently_and_writes_strict_json(tmp_path, capsys):
    _write(
        tmp_path / "passage_count.jsonl",
        [{"pred": "8", "answers": ["8"], "all_classes": None, "length": 500}],
    )
    assert score_main([str(tmp_path), "--e"]) == 0
    text = (tmp_path / "result.json").read_text()
    assert "NaN" not in text
    got = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert got == {"passage_count": {"0-4k": 100.0, "4-8k": None, "8k+": None}}  # empty buckets: null
    capsys.readouterr()

    (tmp_path / "result.json").write_text('{"mine": 1}')
    assert score_main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "result.json exists; pass --force" in err[0]
    assert json.loads((tmp_path / "result.json").read_text()) == {"mine": 1}  # untouched
    assert score_main([str(tmp_path), "--force"]) == 0
    assert json.loads((tmp_path / "result.json").read_text()) == {"passage_count": 100.0}
    assert not any(isinstance(v, float) and math.isnan(v) for v in got["passage_count"].values() if v)
