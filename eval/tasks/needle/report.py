"""The needle's report: accuracy (and partial credit) per config x context length, the
question-order table of several keyed needles, a depth x length heatmap per config and the
side-by-side figure of every config of a (task, model) with the full cache first."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pandas as pd

from eval import plots as figures
from eval.tables import MIXED_NOTE, column_order, md_table, samples_differ, slug, with_n
from eval.tasks.base import ReportOptions, TaskReport
from eval.tasks.multi_question import question_tables


class NeedleReport(TaskReport):
    section: ClassVar[str] = "Needle in a haystack"
    budget_values: ClassVar[dict[str, str]] = {"score": "needle score", "partial": "partial credit"}
    paired_strata: ClassVar[tuple[str, ...]] = ("context_length",)
    flip_columns: ClassVar[tuple[str, ...]] = ("context_length", "depth_percent")

    @classmethod
    def prepare_rows(cls, df: pd.DataFrame) -> pd.DataFrame:
        return prepare_rows(df)

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        return accuracy_tables(df) + question_tables(df, "context_length")

    @classmethod
    def plots(cls, df: pd.DataFrame, options: ReportOptions) -> list[Path]:
        return heatmaps(df, options)


NEEDLE_VALUES = {
    "score": "Needle accuracy x100 per context length (mean over depths).",
    "partial": "Partial credit x100 (longest correct prefix of the number / its length), mean over depths.",
}


def needle_means(df: pd.DataFrame, value: str = "score") -> pd.DataFrame:
    """`value` x100 per (task, model, config_label, context_length): mean over depths of per-depth means."""
    ok = df[df["ok"] & df["context_length"].notna()]
    per_depth = ok.groupby(
        ["task", "model", "config_label", "context_length", "depth_percent"], dropna=False
    )[value].mean()
    return per_depth.groupby(level=[0, 1, 2, 3]).mean().mul(100).rename("score").reset_index()


def prepare_rows(df: pd.DataFrame) -> pd.DataFrame:
    return df.assign(
        **{c: pd.to_numeric(df[c], errors="coerce") for c in ("context_length", "depth_percent") if c in df}
    )


def accuracy_tables(df: pd.DataFrame) -> list[str]:
    out = []
    if "context_length" not in df or "depth_percent" not in df:
        return out
    for value, caption in NEEDLE_VALUES.items():
        if value not in df or df[value].isna().all():
            continue
        means = needle_means(df, value)
        for (task, model), part in df.groupby(["task", "model"], sort=True):
            sub = means[(means["task"] == task) & (means["model"] == model)]
            table = sub.pivot_table(
                index="config_label", columns="context_length", values="score", aggfunc="mean"
            )
            lengths = sorted(table.columns)
            labels = column_order(part)
            table = table.reindex(index=labels, columns=lengths)
            headers = (
                ["method"] + [str(int(v)) if float(v).is_integer() else str(v) for v in lengths] + ["avg"]
            )
            rows = [[lab] + [table.at[lab, c] for c in lengths] + [table.loc[lab].mean()] for lab in labels]
            note = ""
            if samples_differ(part):
                ok = part[part["ok"] & part[value].notna()]
                n = ok.groupby(["config_label", "context_length"]).size()
                rows = [
                    [r[0]] + [with_n(v, n.get((r[0], c), 0)) for v, c in zip(r[1:-1], lengths)] + [r[-1]]
                    for r in rows
                ]
                uneven = any(n[lab].nunique() > 1 for lab in labels if lab in n.index.get_level_values(0))
                note = f"\n\n{MIXED_NOTE}" + (" avg pools lengths with different n." if uneven else "")
            out.append(f"### {task} — {model}\n\n{caption}\n\n" + md_table(headers, rows) + note)
    return out


def heatmaps(df: pd.DataFrame, options: ReportOptions) -> list[Path]:
    """One heatmap (depth x context length) per (task, model, config), and its partial-credit twin.
    The dashed trained-context line: `options.trained_context` if given, else the rows' value."""
    written: list[Path] = []
    if "context_length" not in df or "depth_percent" not in df:
        return written
    needle = df[df["context_length"].notna() & df["depth_percent"].notna()]
    several_tasks = needle["task"].nunique() > 1
    for (task, model, label), g in needle.groupby(["task", "model", "config_label"], sort=True):
        tc = _trained_context(g, options)
        name = f"needle_{slug(task) + '_' if several_tasks else ''}{slug(model)}_{slug(label)}.png"
        title = f"{model}\n{label}" + (f" ({task})" if several_tasks else "")
        written.append(figures.needle_heatmap(g, options.out / name, title=title, trained_context=tc))
        # Partial credit (longest correct prefix of the number) beside exact containment: on small
        # models a compressed cache often keeps only the first digits, which exact match hides.
        if g["partial"].notna().any():
            written.append(
                figures.needle_heatmap(
                    g,
                    options.out / name.replace(".png", "_partial.png"),
                    title=f"{title} (partial credit)",
                    trained_context=tc,
                    value="partial",
                )
            )
    written += _compare_plots(needle, options, several_tasks)
    return written


def _trained_context(g: pd.DataFrame, options: ReportOptions) -> int | None:
    """The dashed trained-context line: `options.trained_context` if given, else the rows' value."""
    if options.trained_context is not None:
        return options.trained_context
    rows = pd.to_numeric(g["trained_context"], errors="coerce").dropna() if "trained_context" in g else []
    return int(rows.iloc[0]) if len(rows) else None


# Names of the needle's score columns in the compare figure's colour bar.
METRIC_NAMES = {"exact": "exact match", "partial": "partial credit", "word_recall": "word recall"}
MAX_COMPARE_PANELS = 16  # a 4 x 4 grid: the whole catalogue beside the full cache


def _compare_plots(needle: pd.DataFrame, options: ReportOptions, several_tasks: bool) -> list[Path]:
    """`needle_compare_<model>.png` (and `_partial`): every config of a (task, model) side by side, the
    full cache first, one colour scale: what compression costs, in one picture. Skipped without a
    full-cache config (a compressed method is drawn beside its baseline or not at all), for a single
    config, and above MAX_COMPARE_PANELS configs (a sweep: its score-vs-budget plot reads better)."""
    written: list[Path] = []
    for (task, model), g in needle.groupby(["task", "model"], sort=True):
        labels = column_order(g)
        if not 2 <= len(labels) <= MAX_COMPARE_PANELS or not (g["method"] == "full").any():
            continue
        tc = _trained_context(g, options)
        stem = f"needle_compare_{slug(task) + '_' if several_tasks else ''}{slug(model)}"
        for value, suffix in (("score", ""), ("partial", "_partial")):
            if value not in g or g[value].isna().all():
                continue
            metric = METRIC_NAMES.get(_score_metric(g) if value == "score" else value, value)
            written.append(
                figures.needle_compare(
                    g,
                    options.out / f"{stem}{suffix}.png",
                    labels=labels,
                    title=f"{task} — {model}: {metric} x100 per depth and length, {len(labels)} configs",
                    value=value,
                    metric=metric,
                    trained_context=tc,
                )
            )
    return written


def _score_metric(g: pd.DataFrame) -> str:
    """Which of the needle's metrics the rows' `score` is (the task's `metric`: the key of `scores`
    equal to `score` on every row), for the colour bar; "score" when the rows leave it open."""
    common: set[str] | None = None
    for score, scores in zip(g["score"], g["scores"] if "scores" in g else [None] * len(g)):
        if isinstance(scores, dict) and pd.notna(score):
            same = {k for k in METRIC_NAMES if scores.get(k) == score}
            common = same if common is None else common & same
    return next((k for k in METRIC_NAMES if common and k in common), "score")
