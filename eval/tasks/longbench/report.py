"""LongBench's report: score per dataset in LongBench's order with its Average and category means,
and the LongBench-E length buckets where the rows carry `length`."""

from __future__ import annotations

import logging
from typing import ClassVar

import pandas as pd

from eval.tables import column_order, md_table, score_table
from eval.tasks.base import TaskReport

logger = logging.getLogger(__name__)


class LongBenchReport(TaskReport):
    flip_columns: ClassVar[tuple[str, ...]] = ("dataset", "length")

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        """Per model: score per dataset (LongBench's order), Average, category means; and the
        LongBench-E length buckets when the rows carry `length`."""
        out = []
        mapping = _categories()
        for (task, model), part in df.groupby(["task", "model"], sort=True):
            datasets = sorted(part["dataset"].unique())
            categories = None
            if mapping:  # LongBench's own dataset order (the mapping's order), unknown datasets last
                order = {ds: i for i, ds in enumerate(mapping)}
                datasets.sort(key=lambda ds: order.get(ds, order.get(ds[:-2], len(order))))
                categories = {**mapping, **{ds: _category_of(ds, mapping) for ds in datasets}}
            out.append(score_table(part, f"{task} — {model}", datasets, categories))
            ok = part[part["ok"]]
            if "length" in ok and pd.to_numeric(ok["length"], errors="coerce").notna().any():
                out.append(longbench_e_table(ok, column_order(part), datasets))
        return out


def _categories() -> dict[str, str] | None:
    try:
        from eval.tasks.longbench.metrics import (
            DATASET2CATEGORY,  # lazy: optional, owned by the metrics module
        )
    except Exception as e:  # noqa: BLE001 - any failure just drops the category rows
        logger.warning("note: LongBench category rows omitted (%s: %s)", type(e).__name__, e)
        return None
    return dict(DATASET2CATEGORY)


def _category_of(dataset: str, mapping: dict[str, str]) -> str | None:
    if dataset in mapping:
        return mapping[dataset]
    if dataset.endswith("_e") and dataset[:-2] in mapping:  # LongBench-E names
        return mapping[dataset[:-2]]
    return None


LONGBENCH_E_BUCKETS = ("0-4k", "4-8k", "8k+")


def longbench_e_bucket(length: float) -> str:
    """LongBench-E's buckets of the records' `length` field (eval.py's scorer_e: <4000, <8000, rest)."""
    return (
        LONGBENCH_E_BUCKETS[0]
        if length < 4000
        else LONGBENCH_E_BUCKETS[1]
        if length < 8000
        else LONGBENCH_E_BUCKETS[2]
    )


def longbench_e_table(ok: pd.DataFrame, cols: list[str], datasets: list[str]) -> str:
    """Score x100 per dataset x LongBench-E length bucket (rows) and config (columns), each cell
    with the ok samples it rests on (buckets split a config's samples unevenly)."""
    ok = ok.assign(length=pd.to_numeric(ok["length"], errors="coerce")).dropna(subset=["length"])
    ok = ok.assign(bucket=ok["length"].map(longbench_e_bucket))
    stats = ok.groupby(["dataset", "bucket", "config_label"])["score"].agg(["mean", "size"])
    rows = []
    for ds in datasets:
        for bucket in LONGBENCH_E_BUCKETS:
            if (ds, bucket) in stats.index.droplevel(2):
                cells = []
                for c in cols:
                    hit = stats.loc[(ds, bucket, c)] if (ds, bucket, c) in stats.index else None
                    cells.append("" if hit is None else f"{100 * hit['mean']:.2f} ({int(hit['size'])})")
                rows.append([f"{ds} {bucket}"] + cells)
    return (
        "LongBench-E length buckets (the records' `length`, words), score x100, with the ok samples of "
        "each cell in brackets.\n\n" + md_table(["dataset / length"] + cols, rows)
    )
