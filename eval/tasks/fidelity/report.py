"""The fidelity task's report: per model, one line per method config with its mean per-token
KL(full ‖ method), top-1 agreement, and the continuation's perplexity under the full cache and the
method, over the passages it ran (eval/tasks/fidelity/task.py defines each metric)."""

from __future__ import annotations

import math
from typing import ClassVar

import pandas as pd

from eval.tables import MIXED_NOTE, column_order, md_table, samples_differ
from eval.tasks.base import TaskReport

METRICS = (
    "kl",
    "kl_max",
    "top1_agreement",
    "nll_full",
    "nll_method",
    "ppl_full",
    "ppl_method",
    "delta_log_ppl",
)
COLUMNS = ("passage_index", "context_tokens", "continuation_tokens", *METRICS)


class FidelityReport(TaskReport):
    section: ClassVar[str] = "Fidelity to the full cache"
    budget_values: ClassVar[dict[str, str]] = {"score": "top-1 agreement with the full cache"}
    paired_strata: ClassVar[tuple[str, ...]] = ("context_tokens",)
    # Top-1 agreement is a fraction of positions, not a right-or-wrong answer: "broke" at < 0.5 would
    # name no passage of a method that agrees on 90% of them, and the paired rows already give the
    # per-config difference from the full cache with its interval. No flips.
    flip_columns: ClassVar[tuple[str, ...] | None] = None

    @classmethod
    def prepare_rows(cls, df: pd.DataFrame) -> pd.DataFrame:
        return df.assign(**{c: pd.to_numeric(df[c], errors="coerce") for c in COLUMNS if c in df})

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        return fidelity_tables(df)


def fidelity_tables(df: pd.DataFrame) -> list[str]:
    """Per (model, context x continuation length): one row per config, full cache first."""
    out = []
    if not set(METRICS) <= set(df.columns):
        return out
    for (model, ctx, cont), part in df.groupby(["model", "context_tokens", "continuation_tokens"], sort=True):
        ok = part[part["ok"]]
        rows = []
        for label in column_order(part):
            sub = ok[ok["config_label"] == label]
            if sub.empty:
                continue
            # KL spans orders of magnitude across budgets: significant digits, not fixed decimals.
            rows.append(
                [label, len(sub), 100 * sub["top1_agreement"].mean(), f"{sub['kl'].mean():.4g}",
                 f"{sub['kl_max'].mean():.4g}", math.exp(sub["nll_full"].mean()),
                 math.exp(sub["nll_method"].mean()), f"{sub['delta_log_ppl'].mean():.4g}",
                 sub["kv_tokens"].mean()]
            )  # fmt: skip
        if not rows:
            continue
        note = f"\n\n{MIXED_NOTE}" if samples_differ(part) else ""
        out.append(
            f"### fidelity — {model}: {int(ctx)}-token context, {int(cont)} continuation tokens\n\n"
            "Teacher-forced continuation after the compressed context, against the full cache's "
            "distributions on the same passages: top-1 agreement x100, mean per-token KL(full ‖ method) "
            "in nats (and the mean over passages of the worst position's), perplexity of the real "
            "continuation (exp of the mean NLL over passages) under each, and Δ log-ppl = NLL(method) - "
            "NLL(full).\n\n"
            + md_table(
                [
                    "method",
                    "n",
                    "top-1 %",
                    "KL",
                    "KL max",
                    "ppl full",
                    "ppl method",
                    "Δ log-ppl",
                    "kv tokens",
                ],
                rows,
            )
            + note
        )
    return out
