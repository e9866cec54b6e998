"""Report table shared by the tasks that ask several questions about one context (samples sharing a
`context_id`, numbered by `question_index`): the needle with ``needles > 1``, kv_retrieval, RULER's
niah_multiquery with ``separate_questions``."""

from __future__ import annotations

from typing import Any

import pandas as pd

from eval.tables import column_order, md_table

CAPTION = (
    "Score x100 per question, in the order they are asked (q0 first), mean over the ok samples of "
    "each context length; all: every question."
)


def _fmt(v: Any) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def question_tables(df: pd.DataFrame, length: str, title: str = "per question") -> list[str]:
    """One table per (task, model) over the rows of multi-question samples (a `context_id` and a
    `question_index`): a row per method config and `length` value, a column per question index."""
    if df.empty or not {"context_id", "question_index", length} <= set(df.columns):
        return []
    rows = df[df["ok"] & df["context_id"].notna() & df["question_index"].notna() & df[length].notna()]
    out = []
    for (task, model), part in rows.groupby(["task", "model"], sort=True):
        part = part.assign(
            _q=pd.to_numeric(part["question_index"]).astype(int), _len=pd.to_numeric(part[length])
        )
        means = part.groupby(["config_label", "_len", "_q"])["score"].mean().mul(100)
        overall = part.groupby(["config_label", "_len"])["score"].mean().mul(100)
        questions = sorted(part["_q"].unique())
        table = []
        for label in column_order(part):
            for n in sorted(part.loc[part["config_label"] == label, "_len"].unique()):
                table.append(
                    [label, _fmt(n)]
                    + [means.get((label, n, q), float("nan")) for q in questions]
                    + [overall[(label, n)]]
                )
        headers = ["method", length] + [f"q{q}" for q in questions] + ["all"]
        out.append(
            f"### {task} — {model}: {title}\n\n{CAPTION}\n\n" + md_table(headers, table, text_columns=2)
        )
    return out
