"""Plots from tidy result DataFrames.

- `needle_heatmap`: gkamradt-style needle-in-a-haystack heatmap (depth % x context length).
- `needle_compare`: those heatmaps side by side, one panel per method config, one colour scale.
- `score_vs_budget`: score vs KV budget, one line per method config, uncompressed runs as horizontal lines.
- `reasoning_vs_budget`: accuracy and output length vs KV budget, side by side (the reasoning task).

Each has a `*_figure` twin that returns the `matplotlib.figure.Figure` without saving it. Figures are
built as plain `Figure` objects (not through pyplot), so importing this module never changes the
matplotlib backend: notebooks keep drawing inline, and no display is needed to save PNGs.
Scores are shown x100 (as in every table of the report): pass 0..1 values, or `scale=1` for data
already x100.
"""

from __future__ import annotations

import os
import re
import textwrap
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator

NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
DPI = 150
SCALE = 100.0  # scores are plotted x100, like the report's tables
UNCOMPRESSED = "not compressed (prompt <= budget)"  # legend of hollow points: the full cache ran
SOME_UNCOMPRESSED = "some samples never compressed (cache within budget)"  # ... for some samples


def _fmt_num(x: float) -> str:
    x = float(x)
    return str(int(x)) if x.is_integer() else f"{x:g}"


def natural_key(text: str) -> tuple:
    """Sort key that orders the numbers inside labels as numbers: `window=8` < `window=16` < `window=32`."""
    parts = re.split(r"(\d+(?:\.\d+)?)", str(text))
    return tuple((0, float(p), "") if i % 2 else (1, 0.0, p) for i, p in enumerate(parts) if p)


def natural_sorted(labels: Iterable[str]) -> list[str]:
    return sorted(labels, key=natural_key)


def score_limits(values: Iterable[float], top: float = SCALE) -> tuple[float, float]:
    """y-axis limits for scores: always from 0 to at least `top` (padded 4%), so flat data stays flat
    instead of being zoomed in to its own noise (e.g. 95-105 around a constant 100)."""
    v = [float(x) for x in values if pd.notna(x)]
    lo, hi = min([0.0, *v]), max([top, *v])
    pad = 0.04 * (hi - lo)
    return lo - pad, hi + pad


def trained_context_position(lengths, trained_context: float | None) -> float | None:
    """x position (column index units) of `trained_context` among sorted column `lengths`.

    Exact match -> that column's index; between two lengths -> linear interpolation between their
    indices; below all -> left edge (-0.5); beyond all (or None) -> None (no line).
    """
    if trained_context is None:
        return None
    lengths = [float(v) for v in lengths]
    t = float(trained_context)
    if not lengths or t > lengths[-1]:
        return None
    if t < lengths[0]:
        return -0.5
    for i, (lo, hi) in enumerate(zip(lengths, lengths[1:])):
        if lo <= t <= hi:
            return i + (t - lo) / (hi - lo) if hi > lo else float(i)
    return float(len(lengths) - 1)  # t == lengths[-1] with a single column


def _save(fig: Figure, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    return path


def needle_heatmap(
    df: pd.DataFrame,
    path: str | os.PathLike,
    title: str,
    trained_context: int | None = None,
    value: str = "score",
    depth: str = "depth_percent",
    length: str = "context_length",
    scale: float = SCALE,
    metric: str | None = None,
) -> Path:
    """Heatmap of mean `value` per (depth %, context length), saved as PNG; see `needle_heatmap_figure`."""
    fig = needle_heatmap_figure(df, title, trained_context, value, depth, length, scale, metric)
    return _save(fig, path)


def needle_heatmap_figure(
    df: pd.DataFrame,
    title: str,
    trained_context: int | None = None,
    value: str = "score",
    depth: str = "depth_percent",
    length: str = "context_length",
    scale: float = SCALE,
    metric: str | None = None,
) -> Figure:
    """Heatmap of mean `value` per (depth %, context length); rows = depth, columns = sorted lengths.

    Cells are annotated (x`scale`, like the tables); missing cells are grey; `trained_context` draws a
    dashed vertical line at its column position (interpolated between columns; skipped when beyond
    all lengths). Values are expected in [0, 1]; the colour scale is 0..`scale` and the colour bar is
    named `metric` (default: `value`) x`scale`.
    """
    table = _depth_length_table(df, value, depth, length)
    fig_w = max(6.0, 0.75 * table.shape[1] + 3.0)
    fig_h = max(4.0, 0.42 * table.shape[0] + 2.0)
    fig = Figure(figsize=(fig_w, fig_h), layout="tight")
    ax = fig.subplots()
    im = _draw_heatmap(ax, table, scale, trained_context)
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Depth percent")
    tc_drawn = trained_context_position(list(table.columns), trained_context) is not None
    ax.set_title(title, pad=16 if tc_drawn else 6)
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label(_metric_label(metric or value, scale))
    return fig


def needle_compare(df: pd.DataFrame, path: str | os.PathLike, **kwargs) -> Path:
    """Side-by-side needle heatmaps, one panel per method config, saved as PNG; see `needle_compare_figure`."""
    return _save(needle_compare_figure(df, **kwargs), path)


def needle_compare_figure(
    df: pd.DataFrame,
    labels: list[str],
    title: str,
    value: str = "score",
    metric: str | None = None,
    label: str = "config_label",
    trained_context: int | None = None,
    depth: str = "depth_percent",
    length: str = "context_length",
    scale: float = SCALE,
    ncols: int = 4,
) -> Figure:
    """One needle heatmap per config in `labels` (in that order; the full cache first is the caller's
    choice), `ncols` panels a row, one colour scale (0..`scale`) and one colour bar named `metric`.

    Each panel's title is its label, the number of samples it holds and its mean (x`scale`); cells
    are annotated and missing cells grey, as in `needle_heatmap_figure`. The depth x length grid is
    the union over the panels, so a config that skipped a cell shows it grey, not shifted.
    """
    if not labels:
        raise ValueError("needle_compare: no config labels to draw")
    data = df[df[label].isin(labels)]
    full = _depth_length_table(data, value, depth, length)
    n = len(labels)
    cols = min(ncols, n)
    rows = -(-n // cols)
    panel_w = max(2.6, 0.55 * full.shape[1] + 1.6)
    panel_h = max(2.4, 0.32 * full.shape[0] + 1.5)
    fig = Figure(figsize=(panel_w * cols + 1.2, panel_h * rows + 0.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    im = None
    for i, lab in enumerate(labels):
        ax = axes[i]
        part = data[data[label] == lab]
        table = _depth_length_table(part, value, depth, length, like=full)
        im = _draw_heatmap(ax, table, scale, trained_context)
        vals = pd.to_numeric(part[value], errors="coerce").dropna()
        mean = f", mean {vals.mean() * scale:.0f}" if len(vals) else ""
        # Long config labels wrap at spaces to the panel's width (~14 characters an inch at 8 pt).
        wrapped = textwrap.fill(str(lab), width=max(20, int(panel_w * 14)))
        ax.set_title(f"{wrapped}\nn={len(vals)}{mean}", fontsize=8)
        if i % cols == 0:
            ax.set_ylabel("Depth percent")
        else:
            ax.set_yticklabels([])
        if i >= n - cols:
            ax.set_xlabel("Context length (tokens)")
    for ax in axes[n:]:
        ax.set_visible(False)
    cbar = fig.colorbar(im, ax=list(axes[:n]), shrink=0.9)
    cbar.set_label(_metric_label(metric or value, scale))
    fig.suptitle(title, fontsize=10)
    return fig


def _metric_label(metric: str, scale: float) -> str:
    return f"{metric}" + (f" x{_fmt_num(scale)}" if scale != 1 else "")


def _depth_length_table(
    df: pd.DataFrame, value: str, depth: str, length: str, like: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Mean `value` per (depth, length): rows = sorted depths, columns = sorted lengths (or `like`'s)."""
    data = df[[depth, length, value]].copy()
    for col in (depth, length, value):
        data[col] = pd.to_numeric(data[col], errors="coerce")
    data = data.dropna(subset=[depth, length])
    if data.empty and like is None:
        raise ValueError(f"needle_heatmap: no rows with {depth!r} and {length!r}")
    table = data.pivot_table(index=depth, columns=length, values=value, aggfunc="mean", dropna=False)
    if like is not None:
        return table.reindex(index=like.index, columns=like.columns)
    return table.sort_index(axis=0).sort_index(axis=1)


def _draw_heatmap(ax, table: pd.DataFrame, scale: float, trained_context: int | None):
    """Draw `table` (values in [0, 1]) x`scale` on `ax`: annotated cells, grey where missing, the
    trained-context line; returns the image (for a colour bar)."""
    depths, lengths = list(table.index), list(table.columns)
    values = np.ma.masked_invalid(table.to_numpy(dtype=float) * scale)
    cmap = NEEDLE_CMAP.with_extremes(bad="#D9D9D9")
    im = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=scale, aspect="auto", interpolation="nearest")
    fontsize = 8 if len(lengths) <= 12 else 6
    for i in range(len(depths)):
        for j in range(len(lengths)):
            v = values[i, j]
            if v is np.ma.masked:
                continue
            ax.text(j, i, f"{v:.0f}" if scale >= 100 else f"{v:.2f}", ha="center", va="center",
                    fontsize=fontsize, color="black")  # fmt: skip
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([_fmt_num(v) for v in lengths], rotation=45, ha="right")
    ax.set_yticks(range(len(depths)))
    ax.set_yticklabels([_fmt_num(v) for v in depths])
    x = trained_context_position(lengths, trained_context)
    if x is not None:
        ax.axvline(x, color="black", linestyle="--", linewidth=1.5)
        # Label just above the axes (x in data units, y in axes units); the title gets extra padding.
        ax.text(
            x,
            1.01,
            f"trained {_fmt_num(trained_context)}",
            ha="center",
            va="bottom",
            fontsize=8,
            transform=ax.get_xaxis_transform(),
            clip_on=False,
        )
    return im


def score_vs_budget(df: pd.DataFrame, path: str | os.PathLike, **options: Any) -> Path:
    """Mean `y` vs `x` (log2 axis), one line per value of `line`, saved as PNG; `options` are
    `score_vs_budget_figure`'s (title, x, y, line, labels, scale, compressed, y_top)."""
    return _save(score_vs_budget_figure(df, **options), path)


def score_vs_budget_figure(
    df: pd.DataFrame,
    title: str | None = None,
    x: str = "budget",
    y: str = "score",
    line: str = "label",
    xlabel: str = "KV budget (tokens)",
    ylabel: str = "score",
    scale: float = 1.0,
    compressed: str = "compressed",
    y_top: float = SCALE,
) -> Figure:
    """Mean `y` x `scale` vs `x` (log2 axis), one line per value of `line`, legend in natural order
    (numbers inside labels sorted as numbers).

    Rows whose `x` is NaN/None (e.g. the uncompressed "full" run) are drawn as dashed horizontal
    lines at their mean `y`. Where the frame has a boolean `compressed` column, a point any of whose
    rows was not compressed (prompt no longer than the budget: the full cache ran) is drawn hollow.
    The y-axis spans at least 0..`y_top` (x100 scores by default; see `score_limits`).
    """
    fig = Figure(figsize=(7, 4.5), layout="tight")
    draw_vs_budget(fig.subplots(), df, title, x, y, line, xlabel, ylabel, scale, compressed, y_top)
    return fig


def draw_vs_budget(
    ax,
    df: pd.DataFrame,
    title: str | None = None,
    x: str = "budget",
    y: str = "score",
    line: str = "label",
    xlabel: str = "KV budget (tokens)",
    ylabel: str = "score",
    scale: float = 1.0,
    compressed: str = "compressed",
    y_top: float = SCALE,
    hollow_label: str = UNCOMPRESSED,
) -> None:
    """Draw `score_vs_budget_figure`'s plot on the matplotlib axes `ax` (one panel of a larger figure);
    `hollow_label` is the legend entry of the hollow points."""
    cols = [x, y, line] + ([compressed] if compressed in df.columns else [])
    data = df[cols].copy()
    data[x] = pd.to_numeric(data[x], errors="coerce")
    data[y] = pd.to_numeric(data[y], errors="coerce") * scale
    data = data.dropna(subset=[y])
    data[line] = data[line].astype(str)
    if compressed in data.columns:
        data["_uncompressed"] = data[compressed].map(lambda c: c is False or c == 0)
    else:
        data["_uncompressed"] = False
    with_x = data[data[x].notna() & (data[x] > 0)]
    without_x = data[data[x].isna()]

    budgets: set[float] = set()
    plotted: list[float] = []
    any_hollow = False
    for k, name in enumerate(natural_sorted(with_x[line].unique())):
        group = with_x[with_x[line] == name]
        means = group.groupby(x)[y].mean().sort_index()
        hollow = group.groupby(x)["_uncompressed"].any().reindex(means.index)
        budgets.update(means.index.tolist())
        plotted += means.tolist()
        color = f"C{k % 10}"
        ax.plot(means.index, means.to_numpy(), marker="o", color=color, label=name)
        if hollow.any():
            any_hollow = True
            ax.plot(means.index[hollow.to_numpy()], means[hollow].to_numpy(), linestyle="none", marker="o",
                    markersize=8, markerfacecolor="white", markeredgecolor=color, markeredgewidth=1.5)  # fmt: skip
    for k, name in enumerate(natural_sorted(without_x[line].unique())):
        mean = without_x.loc[without_x[line] == name, y].mean()
        plotted.append(mean)
        ax.axhline(mean, linestyle="--", color=f"C{(k + 7) % 10}", linewidth=1.2, label=name)
    if budgets:
        ax.set_xscale("log", base=2)
        ticks = sorted(budgets)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([_fmt_num(t) for t in ticks])
        if len(ticks) == 1:
            ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    ax.set_ylim(*score_limits(plotted, top=y_top))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if any_hollow:
        handles.append(
            Line2D([], [], linestyle="none", marker="o", markerfacecolor="white", markeredgecolor="black")
        )
        labels.append(hollow_label)
    if handles:
        ax.legend(handles, labels, fontsize=8)


def reasoning_vs_budget_figure(df: pd.DataFrame, title: str | None = None, line: str = "line") -> Figure:
    """Two panels side by side from per-problem rows: accuracy x100 (`score`, the mean of the
    problem's samples) and mean generated tokens (`new_tokens`) vs KV budget, one line per value of
    `line`; rows without a budget (the full cache) as dashed horizontal lines; a point hollow where
    some row's `compressed` is false (a sample whose cache never outgrew the budget)."""
    fig = Figure(figsize=(12, 4.5), layout="tight")
    left, right = fig.subplots(1, 2)
    draw_vs_budget(left, df, "accuracy (pass@1)", y="score", line=line, ylabel="accuracy x100", scale=SCALE,
                   hollow_label=SOME_UNCOMPRESSED)  # fmt: skip
    draw_vs_budget(
        right, df, "output length", y="new_tokens", line=line, ylabel="generated tokens (mean)", y_top=0.0,
        hollow_label=SOME_UNCOMPRESSED,
    )  # fmt: skip
    if title:
        fig.suptitle(title)
    return fig


def reasoning_vs_budget(
    df: pd.DataFrame, path: str | os.PathLike, title: str | None = None, line: str = "line"
) -> Path:
    """`reasoning_vs_budget_figure` written to `path`."""
    return _save(reasoning_vs_budget_figure(df, title, line), path)
