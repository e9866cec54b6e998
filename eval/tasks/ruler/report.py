"""RULER's report: score per task x length, the suite average per length, a task x length heatmap
per (model, method config), and per model one task x method heatmap per length with the full cache
first (`ruler_compare_<model>.png`: every compressed config beside its baseline), built from the
result rows (`ruler_task`, `ruler_length`, `score`).

Suite average: for each length, the mean over tasks of the per-task means (RULER's "Avg."); marked
with † when a config lacks some task at that length (not comparable); its caption names how many of
RULER's 13 tasks it covers when fewer ran ("11 of 13 tasks (qa_1/qa_2 need SQuAD/HotpotQA in
task.data_dir)"). Scores x100, each cell with the ok samples it rests on; an "avg" over lengths
that rest on different numbers of samples is marked ‡ and the note says so.

Paired differences: every config against the full cache, then the compressed configs against
each other, on the samples both ran (the same generated sample ids), suite average minus the
other's with a 95% percentile interval and p from `eval.stats.compare_differences`: a bootstrap
that resamples the shared samples (the unit) within each task (the tasks stay fixed, as the suite
average weighs them equally); a fixed seed, so the report rebuilds byte-identical. The interval and
p are withheld ("n<5 per task") where a task has fewer than `eval.stats.MIN_N` shared samples.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from eval.plots import NEEDLE_CMAP, _save
from eval.stats import MIN_N, RESAMPLES, compare_differences, holm
from eval.tables import column_order, md_table, slug
from eval.tasks.base import ReportOptions, TaskReport
from eval.tasks.multi_question import question_tables
from eval.tasks.ruler.config import QA_TASKS, TASKS


def is_ruler(df: pd.DataFrame) -> pd.Series:
    """Rows of RULER samples (they carry `ruler_task` / `ruler_length`)."""
    if "ruler_task" not in df or "ruler_length" not in df:
        return pd.Series(False, index=df.index)
    return df["ruler_task"].notna() & pd.to_numeric(df["ruler_length"], errors="coerce").notna()


def _task_order(tasks) -> list[str]:
    order = {t: i for i, t in enumerate(TASKS)}
    return sorted(set(tasks), key=lambda t: (order.get(t, len(order)), t))


def ruler_means(df: pd.DataFrame) -> pd.DataFrame:
    """Mean score x100 per (model, config_label, ruler_task, ruler_length) over ok rows, with n."""
    ok = df[df["ok"] & is_ruler(df)].assign(
        ruler_length=lambda d: pd.to_numeric(d["ruler_length"]).astype(int)
    )
    keys = ["model", "config_label", "ruler_task", "ruler_length"]
    out = ok.groupby(keys)["score"].agg(["mean", "size"]).reset_index()
    return out.assign(score=out["mean"] * 100).rename(columns={"size": "n"}).drop(columns="mean")


def suite_average(means: pd.DataFrame) -> pd.DataFrame:
    """Per (model, config_label, ruler_length): the mean over tasks, whether every task that any
    config has at that (model, length) is present, and n (the ok samples over those tasks)."""
    tasks_at = means.groupby(["model", "ruler_length"])["ruler_task"].agg(lambda s: set(s))
    rows = []
    for (model, label, length), g in means.groupby(["model", "config_label", "ruler_length"]):
        complete = set(g["ruler_task"]) >= tasks_at[(model, length)]
        rows.append((model, label, length, g["score"].mean(), complete, int(g["n"].sum())))
    return pd.DataFrame(rows, columns=["model", "config_label", "ruler_length", "score", "complete", "n"])


def _with_n(score: float, n: int) -> str:
    return "" if np.isnan(score) else f"{score:.2f} ({n})"


UNEQUAL_N = (
    "‡ the unweighted mean of length columns that rest on different numbers of samples ({}): read "
    "the length columns."
)


def coverage_note(tasks) -> str:
    """How many of RULER's tasks a suite average covers, e.g. "11 of 13 tasks (qa_1/qa_2 need
    SQuAD/HotpotQA in task.data_dir)" when the QA tasks did not run; "" when it covers all 13."""
    have = set(tasks)
    if have >= set(TASKS):
        return ""
    missing = [t for t in TASKS if t not in have]
    qa = missing if set(missing) <= set(QA_TASKS) else []  # the reason only when nothing else is missing
    sources = {"squad": "SQuAD", "hotpotqa": "HotpotQA"}
    why = (
        f" ({'/'.join(qa)} {'need' if len(qa) > 1 else 'needs'} "
        f"{'/'.join(sources[TASKS[t].args['dataset']] for t in qa)} in task.data_dir)"
        if qa
        else ""
    )
    return f"{len(have & set(TASKS))} of {len(TASKS)} tasks{why}"


def paired_differences(rows: pd.DataFrame, pairs: list[tuple[str, str]]) -> list[list]:
    """Per (config, baseline) pair and length: [config, baseline, length, shared samples, fewest
    shared samples of a task, suite avg difference config - baseline, "[lo, hi]", p (NaN where withheld)] over the ok
    samples both ran (a bootstrap of samples within task: module doc, `eval.stats.compare_differences`);
    the interval is withheld ("n<5 per task") when a task has fewer than `MIN_N` shared samples, as
    resampling 2 samples within a task gives a degenerate interval. `rows`: one model's RULER rows
    with `sample_id`, `ruler_task`, `ruler_length`, `score`, `ok`, `config_label`."""
    ok = rows[rows["ok"]].assign(ruler_length=lambda d: pd.to_numeric(d["ruler_length"]).astype(int))
    out = []
    for length in sorted(ok["ruler_length"].unique()):
        at = ok[ok["ruler_length"] == length]
        frames = {
            label: g.drop_duplicates("sample_id").set_index("sample_id")
            for label, g in at.groupby("config_label")
        }
        for label, baseline in pairs:
            if label not in frames or baseline not in frames:
                continue
            a, b = frames[label], frames[baseline]
            shared = b.index.intersection(a.index).sort_values()
            if shared.empty:
                continue
            diff = a.loc[shared, "score"].to_numpy(float) - b.loc[shared, "score"].to_numpy(float)
            strata = b.loc[shared, "ruler_task"]
            fewest = int(strata.value_counts().min())
            c = compare_differences(100 * diff, None, strata.to_numpy())
            withheld = fewest < MIN_N  # resampling fewer within a task gives a degenerate interval
            interval = f"n<{MIN_N} per task" if withheld else f"[{c.lo:+.1f}, {c.hi:+.1f}]"
            out.append(
                [
                    label,
                    baseline,
                    int(length),
                    len(shared),
                    fewest,
                    c.diff,
                    interval,
                    np.nan if withheld else c.p,
                ]
            )
    return out


def _p_cell(p: float) -> str:
    return "—" if np.isnan(p) else ("<0.001" if p < 0.001 else f"{p:.3f}")


def ruler_tables(df: pd.DataFrame, column_order) -> list[str]:
    """The report's "RULER" tables (none without RULER rows): per model, the suite average (config x
    length) and per config the task x length table. ``column_order(part)``: config labels in order."""
    rows_df = df[is_ruler(df)]
    if rows_df.empty:
        return []
    means = ruler_means(rows_df)
    if means.empty:
        return []
    avg = suite_average(means)
    out = []
    for model, part in rows_df.groupby("model", sort=True):
        labels = [c for c in column_order(part) if c in set(means["config_label"])]
        lengths = sorted(means.loc[means["model"] == model, "ruler_length"].unique())
        a = avg[avg["model"] == model]
        table, dagger, unequal = [], False, []
        for label in labels:
            cells, scores, ns = [], [], []
            for length in lengths:
                hit = a[(a["config_label"] == label) & (a["ruler_length"] == length)]
                if hit.empty:
                    cells.append(float("nan"))
                    continue
                score, n = float(hit["score"].iloc[0]), int(hit["n"].iloc[0])
                scores.append(score)
                ns.append(n)
                if bool(hit["complete"].iloc[0]):
                    cells.append(_with_n(score, n))
                else:
                    dagger = True
                    cells.append(f"{score:.2f}† ({n})")
            mean = float(np.mean(scores)) if len(scores) == len(lengths) else float("nan")
            if len(set(ns)) > 1 and not np.isnan(mean):
                unequal.append((label, ", ".join(f"{x} at {length}" for x, length in zip(ns, lengths))))
                table.append([label] + cells + [f"{mean:.2f}‡"])
            else:
                table.append([label] + cells + [mean])
        note = "\n\n† mean over only the tasks this config has at that length." if dagger else ""
        if unequal:
            patterns = {pattern for _, pattern in unequal}
            which = (
                patterns.pop() if len(patterns) == 1 else "; ".join(f"{lab}: {pat}" for lab, pat in unequal)
            )
            note += "\n\n" + UNEQUAL_N.format(which)
        covered = coverage_note(means.loc[means["model"] == model, "ruler_task"])
        out.append(
            f"### ruler — {model}: suite average\n\nMean over tasks of the task score x100 "
            "(string_match_all; QA string_match_part), per length, with the ok samples it rests on in "
            "brackets"
            + (f", over {covered}" if covered else "")
            + ".\n\n"
            + md_table(["method"] + [str(x) for x in lengths] + ["avg"], table)
            + note
        )
        full = [c for c in labels if part.loc[part["config_label"] == c, "method"].iloc[0] == "full"]
        if full and len(labels) > 1 and "sample_id" in part:
            rest = [c for c in labels if c != full[0]]
            pairs = [(c, full[0]) for c in rest] + [(a, b) for i, a in enumerate(rest) for b in rest[i + 1 :]]
            paired = paired_differences(part, pairs)
            if paired:
                adjusted = holm([r[-1] for r in paired])  # the family: this table's rows
                paired = [[*r[:-1], _p_cell(r[-1]), _p_cell(a)] for r, a in zip(paired, adjusted)]
                out.append(
                    f"### ruler — {model}: paired differences\n\nSuite average x100 of a config minus "
                    "another's on the samples both ran (every config against the full cache, then the "
                    f"compressed configs against each other), with a 95% interval and p from {RESAMPLES} "
                    f"bootstrap resamples of the samples within each task, withheld where a task has fewer than "
                    f"{MIN_N} shared samples (fewest per task); p Holm: adjusted over the rows of the table.\n\n"
                    + md_table(
                        [
                            "method",
                            "minus",
                            "length",
                            "shared samples",
                            "fewest per task",
                            "difference",
                            "95% interval",
                            "p",
                            "p Holm",
                        ],
                        paired,
                    )  # fmt: skip
                )
        m = means[means["model"] == model]
        for label in labels:
            sub = m[m["config_label"] == label]
            grid = sub.pivot_table(index="ruler_task", columns="ruler_length", values="score", aggfunc="mean")
            grid = grid.reindex(index=_task_order(sub["ruler_task"]), columns=lengths)
            counts = sub.pivot_table(index="ruler_task", columns="ruler_length", values="n", aggfunc="sum")
            counts = counts.reindex(index=grid.index, columns=lengths).fillna(0).astype(int)
            n = int(sub["n"].sum())
            rows, unequal = [], False
            for t in grid.index:
                present = [int(counts.at[t, c]) for c in lengths if counts.at[t, c]]
                mean = grid.loc[t].mean()
                uneven = len(set(present)) > 1
                unequal |= uneven
                rows.append(
                    [t] + [_with_n(grid.at[t, c], int(counts.at[t, c])) for c in lengths]
                    + [f"{mean:.2f}‡" if uneven else mean]
                )  # fmt: skip
            per_length = [int(counts[c].sum()) for c in lengths]
            uneven = len({x for x in per_length if x}) > 1
            unequal |= uneven
            overall = grid.mean(axis=1).mean()
            rows.append(
                ["**Average**"] + [_with_n(grid[c].mean(), x) for c, x in zip(lengths, per_length)]
                + [f"{overall:.2f}‡" if uneven else overall]
            )  # fmt: skip
            note = "\n\n" + UNEQUAL_N.format("ok samples in brackets") if unequal else ""
            out.append(
                f"### ruler — {model} — {label}\n\nScore x100 per task and length, with the ok samples "
                f"of each cell in brackets ({n} ok samples).\n\n"
                + md_table(["task"] + [str(x) for x in lengths] + ["avg"], rows)
                + note
            )
    return out


def _draw_grid(ax, grid: pd.DataFrame):
    """Draw a tasks (rows, the last one the average) x columns grid of score x100 on `ax`: one colour
    scale 0-100, cells annotated, missing cells grey, a rule above the average row; the task names
    as y ticks. Returns the image (for a colour bar)."""
    values = np.ma.masked_invalid(grid.to_numpy(dtype=float))
    im = ax.imshow(values, cmap=NEEDLE_CMAP.with_extremes(bad="#D9D9D9"), vmin=0, vmax=100,
                   aspect="auto", interpolation="nearest")  # fmt: skip
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            if values[i, j] is not np.ma.masked:
                ax.text(j, i, f"{values[i, j]:.0f}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(grid.shape[0]), list(grid.index))
    ax.axhline(grid.shape[0] - 1.5, color="black", linewidth=1)
    return im


def ruler_heatmap(sub: pd.DataFrame, path: Path, title: str) -> Path:
    """Task (rows, RULER order, then the suite average) x length (columns) heatmap of score x100."""
    grid = sub.pivot_table(index="ruler_task", columns="ruler_length", values="score", aggfunc="mean")
    grid = grid.reindex(index=_task_order(sub["ruler_task"]), columns=sorted(grid.columns))
    grid.loc["average"] = grid.mean(axis=0)
    fig = Figure(figsize=(max(5.0, 0.9 * grid.shape[1] + 3.5), max(4.0, 0.38 * grid.shape[0] + 1.6)))
    ax = fig.subplots()
    im = _draw_grid(ax, grid)
    ax.set_xticks(range(grid.shape[1]), [str(int(c)) for c in grid.columns])
    ax.set_xlabel("Length (tokens, prompt + generation)")
    ax.set_title(title)
    fig.colorbar(im, ax=ax).set_label("score x100")
    return _save(fig, path)


def ruler_heatmaps(df: pd.DataFrame, out: Path) -> list[Path]:
    """`ruler_<model>_<label>.png` per (model, method config) with RULER rows."""
    rows_df = df[is_ruler(df)]
    if rows_df.empty:
        return []
    means = ruler_means(rows_df)
    written = []
    for (model, label), sub in means.groupby(["model", "config_label"], sort=True):
        path = out / f"ruler_{slug(model)}_{slug(label)}.png"
        written.append(ruler_heatmap(sub, path, f"RULER — {model}\n{label}"))
    return written


def ruler_compare_figure(means: pd.DataFrame, labels: list[str], title: str):
    """One panel per length: tasks (rows, RULER order, then the suite average) x configs (columns, in
    `labels` order: the full cache first is the caller's choice), score x100, one colour scale,
    cells annotated, missing cells grey; each column's label carries its number of ok samples."""
    if not labels:
        raise ValueError("ruler_compare: no config labels to draw")
    lengths = sorted(means["ruler_length"].unique())
    tasks = _task_order(means["ruler_task"])
    ncol = len(labels)
    fig = Figure(
        figsize=(len(lengths) * max(3.5, 1.15 * ncol + 1.8) + 1.0, max(4.0, 0.38 * (len(tasks) + 1) + 2.4)),
        layout="constrained",
    )
    axes = np.atleast_1d(fig.subplots(1, len(lengths), squeeze=False)).ravel()
    im = None
    for ax, length in zip(axes, lengths):
        at = means[means["ruler_length"] == length]
        grid = at.pivot_table(index="ruler_task", columns="config_label", values="score", aggfunc="mean")
        grid = grid.reindex(index=tasks, columns=labels)
        # The suite average only where a config has every task of this length (else grey, as the table's †).
        complete = grid.notna().all(axis=0) | grid.isna().all(axis=0)
        grid.loc["average"] = grid.mean(axis=0).where(complete)
        im = _draw_grid(ax, grid)
        n = at.groupby("config_label")["n"].sum()
        ticks = [f"{textwrap.fill(lab, 14)}\n(n={int(n.get(lab, 0))})" for lab in labels]
        ax.set_xticks(range(ncol), ticks, fontsize=7)
        ax.set_title(f"{int(length)} tokens")
    fig.suptitle(title)
    fig.colorbar(im, ax=list(axes)).set_label("score x100")
    return fig


def ruler_compare(df: pd.DataFrame, out: Path, column_order) -> list[Path]:
    """`ruler_compare_<model>.png` per model with RULER rows of two or more configs (full first)."""
    rows_df = df[is_ruler(df)]
    if rows_df.empty:
        return []
    means = ruler_means(rows_df)
    written = []
    for model, part in rows_df.groupby("model", sort=True):
        m = means[means["model"] == model]
        labels = [c for c in column_order(part) if c in set(m["config_label"])]
        if len(labels) < 2:
            continue
        fig = ruler_compare_figure(m, labels, f"RULER — {model}: every config beside the full cache")
        written.append(_save(fig, out / f"ruler_compare_{slug(model)}.png"))
    return written


class RulerReport(TaskReport):
    section: ClassVar[str] = "RULER"
    paired_strata: ClassVar[tuple[str, ...]] = ("ruler_task", "ruler_length")
    flip_columns: ClassVar[tuple[str, ...]] = ("ruler_task", "ruler_length")

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        tables = ruler_tables(df, column_order)
        return tables + question_tables(df, "ruler_length", title="separate questions")

    @classmethod
    def plots(cls, df: pd.DataFrame, options: ReportOptions) -> list[Path]:
        return ruler_heatmaps(df, options.out) + ruler_compare(df, options.out, column_order)
