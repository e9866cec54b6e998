"""Plots from tidy result DataFrames (matplotlib, Agg backend: no display needed).

- `needle_heatmap`: gkamradt-style needle-in-a-haystack heatmap (depth % x context length).
- `score_vs_budget`: score vs KV budget, one line per method config, uncompressed runs as horizontal lines.
"""

from __future__ import annotations

import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.colors import LinearSegmentedColormap  # noqa: E402
from matplotlib.ticker import FixedLocator, NullLocator  # noqa: E402

NEEDLE_CMAP = LinearSegmentedColormap.from_list("needle", ["#F0496E", "#EBB839", "#0CD79F"])
DPI = 150


def _fmt_num(x: float) -> str:
    x = float(x)
    return str(int(x)) if x.is_integer() else f"{x:g}"


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


def _save(fig, path: str | os.PathLike) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, format="png")
    plt.close(fig)
    return path


def needle_heatmap(
    df: pd.DataFrame,
    path: str | os.PathLike,
    title: str,
    trained_context: int | None = None,
    value: str = "score",
    depth: str = "depth_percent",
    length: str = "context_length",
) -> Path:
    """Heatmap of mean `value` per (depth %, context length); rows = depth, columns = sorted lengths.

    Cells are annotated; missing cells are grey; `trained_context` draws a dashed vertical line at its
    column position (interpolated between columns; skipped when beyond all lengths).
    Values are expected in [0, 1] (vmin 0, vmax 1). Returns the PNG path.
    """
    data = df[[depth, length, value]].copy()
    for col in (depth, length, value):
        data[col] = pd.to_numeric(data[col], errors="coerce")
    data = data.dropna(subset=[depth, length])
    if data.empty:
        raise ValueError(f"needle_heatmap: no rows with {depth!r} and {length!r}")
    table = data.pivot_table(index=depth, columns=length, values=value, aggfunc="mean", dropna=False)
    table = table.sort_index(axis=0).sort_index(axis=1)
    depths, lengths = list(table.index), list(table.columns)
    values = np.ma.masked_invalid(table.to_numpy(dtype=float))

    cmap = NEEDLE_CMAP.with_extremes(bad="#D9D9D9")
    fig_w = max(6.0, 0.75 * len(lengths) + 3.0)
    fig_h = max(4.0, 0.42 * len(depths) + 2.0)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h))
    im = ax.imshow(values, cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto", interpolation="nearest")
    fontsize = 8 if len(lengths) <= 12 else 6
    for i in range(len(depths)):
        for j in range(len(lengths)):
            v = values[i, j]
            if v is np.ma.masked:
                continue
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=fontsize, color="black")
    ax.set_xticks(range(len(lengths)))
    ax.set_xticklabels([_fmt_num(v) for v in lengths], rotation=45, ha="right")
    ax.set_yticks(range(len(depths)))
    ax.set_yticklabels([_fmt_num(v) for v in depths])
    ax.set_xlabel("Context length (tokens)")
    ax.set_ylabel("Depth percent")
    ax.set_title(title, pad=16 if trained_context_position(lengths, trained_context) is not None else 6)
    cbar = fig.colorbar(im, ax=ax)
    cbar.set_label(value)
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
    return _save(fig, path)


def score_vs_budget(
    df: pd.DataFrame,
    path: str | os.PathLike,
    title: str | None = None,
    x: str = "budget",
    y: str = "score",
    line: str = "label",
    xlabel: str = "KV budget (tokens)",
    ylabel: str = "score",
) -> Path:
    """Mean `y` vs `x` (log2 axis), one line per value of `line`.

    Rows whose `x` is NaN/None (e.g. the uncompressed "full" run) are drawn as dashed horizontal
    lines at their mean `y`. Returns the PNG path.
    """
    data = df[[x, y, line]].copy()
    data[x] = pd.to_numeric(data[x], errors="coerce")
    data[y] = pd.to_numeric(data[y], errors="coerce")
    data = data.dropna(subset=[y])
    data[line] = data[line].astype(str)
    with_x = data[data[x].notna() & (data[x] > 0)]
    without_x = data[data[x].isna()]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets: set[float] = set()
    for name, group in with_x.groupby(line, sort=True):
        means = group.groupby(x)[y].mean().sort_index()
        budgets.update(means.index.tolist())
        ax.plot(means.index, means.to_numpy(), marker="o", label=name)
    for k, (name, group) in enumerate(without_x.groupby(line, sort=True)):
        ax.axhline(group[y].mean(), linestyle="--", color=f"C{(k + 7) % 10}", linewidth=1.2, label=name)
    if budgets:
        ax.set_xscale("log", base=2)
        ticks = sorted(budgets)
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([_fmt_num(t) for t in ticks])
        if len(ticks) == 1:
            ax.set_xlim(ticks[0] / 2, ticks[0] * 2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, path)
