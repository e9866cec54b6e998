"""LongBench-v2's report: result.py's table per model (accuracy overall, by difficulty and by
length), one column per method config."""

from __future__ import annotations

from typing import ClassVar

import pandas as pd

from eval.tables import column_order, md_table
from eval.tasks.base import TaskReport
from eval.tasks.longbench_v2.metrics import COLUMNS, summarize


class LongBenchV2Report(TaskReport):
    section: ClassVar[str] = "LongBench-v2"
    flip_columns: ClassVar[tuple[str, ...]] = ("dataset", "difficulty", "length")

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        """Per model: result.py's six columns as rows (accuracy x100, one decimal), then the
        samples each config rests on and the share of answers a letter could be extracted from."""
        out = []
        for (task, model), part in df.groupby(["task", "model"], sort=True):
            cols = column_order(part)
            ok = part[part["ok"]]
            rows = {c: [] for c in COLUMNS}
            samples, answered = [], []
            for c in cols:
                mine = ok[ok["config_label"] == c]
                summary = summarize(zip(mine["difficulty"], mine["length"], mine["score"], strict=True))
                for column in COLUMNS:
                    rows[column].append("—" if summary[column] is None else f"{summary[column]:.1f}")
                samples.append(len(mine))
                share = [s.get("answered") for s in mine["scores"] if isinstance(s, dict)]
                answered.append(f"{100 * sum(share) / len(share):.1f}" if share else "—")
            table = [[column] + values for column, values in rows.items()]
            table += [["samples"] + samples, ["answered (%)"] + answered]
            out.append(
                f"### {task} — {model}\n\nAccuracy x100 as LongBench-v2's result.py computes it "
                "(difficulty easy / hard, length short / medium / long); `answered`: a letter could be "
                "extracted from the answer.\n\n" + md_table(["", *cols], table)
            )
        return out
