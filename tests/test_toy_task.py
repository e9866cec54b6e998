"""A task and its report defined entirely in this file run, store, resume and report through the
generic runner, store and report (none of which knows them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pandas as pd
import pytest
from omegaconf import OmegaConf, open_dict

import eval.runner as runner
from eval.report import main as report_main
from eval.store import read_rows
from eval.tasks import REPORTS, TASKS, ReportOptions, Sample, Task, TaskReport, register_report, register_task
from tests import test_runner
from tests.test_runner import CountingGenerate, make_cfg, result_files

tiny_dir = test_runner.tiny_dir  # the saved tiny model (session fixture)


@dataclass
class ToyTask(Task):
    """Repeat a word: three samples, a metadata column `parity`, its own table and plot."""

    name: ClassVar[str] = "toy"
    selection_keys: ClassVar[tuple[str, ...]] = ("n",)

    n: int = 3
    word: str = "apple"

    def samples(self, tokenizer):
        for i in range(self.n):
            yield Sample(
                sample_id=f"toy{i}",
                dataset="toy",
                context=f"The word is {self.word}. " * 10,
                question="What is the word?",
                answers=[self.word],
                max_new_tokens=4,
                extra={"parity": i % 2},
            )

    def score(self, sample, prediction):
        return float(self.word in prediction)

    def score_all(self, sample, prediction):
        return {"length": min(1.0, len(prediction) / 100)}


class ToyReport(TaskReport):
    """The toy task's own section, table and plot."""

    section: ClassVar[str] = "Toy"

    @classmethod
    def prepare_rows(cls, df):
        return df.assign(parity=pd.to_numeric(df["parity"], errors="coerce"))

    @classmethod
    def tables(cls, df):
        counts = df.groupby("parity")["sample_id"].count()
        return ["### toy parity\n\n" + "\n".join(f"parity {int(k)}: {v} rows" for k, v in counts.items())]

    @classmethod
    def plots(cls, df, options: ReportOptions):
        path = options.out / "toy_plot.txt"  # any file: the task decides what its plots are
        path.write_text(f"{len(df)} ok rows\n")
        return [path]


@pytest.fixture
def toy_registered():
    register_task(ToyTask)
    register_report("toy", ToyReport)
    yield
    TASKS.pop("toy")
    REPORTS.pop("toy")


def toy_cfg(tiny_dir, results, n=3):
    cfg = make_cfg(tiny_dir, results, "report=true")
    with open_dict(cfg):
        cfg.task = OmegaConf.create({"name": "toy", "n": n, "shard": 0, "num_shards": 1})
    return cfg


def test_a_toy_task_runs_stores_resumes_and_reports(toy_registered, tiny_dir, tmp_path, monkeypatch):
    results = tmp_path / "results"
    runner.run(toy_cfg(tiny_dir, results, n=2))
    (path,) = result_files(results)
    assert path.parent.parent.name == "toy"
    rows = read_rows(path)
    assert [r["parity"] for r in rows] == [0, 1] and all(r["status"] == "ok" for r in rows)
    assert all(set(r["scores"]) == {"length"} for r in rows)
    for generic_only in ("context_length", "depth_percent", "length"):  # no other task's columns
        assert generic_only not in rows[0]

    # Resume: growing n (a selection key) keeps the file; only the new sample runs.
    counting = CountingGenerate()
    monkeypatch.setattr(runner, "generate", counting)
    runner.run(toy_cfg(tiny_dir, results, n=3))
    assert len(counting.calls) == 1 and len(read_rows(path)) == 3
    runner.run(toy_cfg(tiny_dir, results, n=3))
    assert len(counting.calls) == 1  # all done

    report = (results / "report.md").read_text()
    assert "## Toy" in report and "parity 0: 2 rows" in report and "parity 1: 1 rows" in report
    assert (results / "toy_plot.txt").read_text() == "3 ok rows\n"
    summary = pd.read_csv(results / "summary.csv")
    assert summary["task"].tolist() == ["toy"] and summary["n"].tolist() == [3]


def test_rows_of_an_unregistered_task_get_the_generic_score_table(toy_registered, tiny_dir, tmp_path, capsys):
    results = tmp_path / "results"
    runner.run(toy_cfg(tiny_dir, results, n=2))
    TASKS.pop("toy")
    REPORTS.pop("toy")
    try:
        assert report_main([str(results), "--no-plots"]) == 0
    finally:
        register_task(ToyTask)
        register_report("toy", ToyReport)
    report = (results / "report.md").read_text()
    assert "## Scores" in report and "### toy — tiny-llama" in report and "| toy |" in report
