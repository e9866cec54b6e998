"""Key-value retrieval's report: string match per question, in the order the keys are asked, per
context length (the multi-question table); partial credit beside it against the budget."""

from __future__ import annotations

from typing import ClassVar

import pandas as pd

from eval.tasks.base import TaskReport
from eval.tasks.multi_question import question_tables


class KVRetrievalReport(TaskReport):
    section: ClassVar[str] = "Key-value retrieval"
    budget_values: ClassVar[dict[str, str]] = {"score": "string match", "partial": "partial credit"}
    paired_strata: ClassVar[tuple[str, ...]] = ("context_length",)
    flip_columns: ClassVar[tuple[str, ...]] = ("context_length", "question_index", "key_depth_percent")

    @classmethod
    def prepare_rows(cls, df: pd.DataFrame) -> pd.DataFrame:
        cols = ("context_length", "question_index", "key_depth_percent")
        return df.assign(**{c: pd.to_numeric(df[c], errors="coerce") for c in cols if c in df})

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        return question_tables(df, "context_length", title="string match")
