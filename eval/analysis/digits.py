"""Figures of the "digits as single tokens" analysis (never runs a model).

- `kept_positions_figure`: from `eval.analysis.kept_positions`' CSV/JSON: per SnapKV config, layers x token
  positions around the needle (and at the end of the prompt, where the observation window is), cell
  = share of the layer's KV heads that kept the position; the 7 digits and the window are marked.
- `digits_ablation_figure`: needle exact and partial credit (x100) per config and context length,
  from result rows (`python run.py -m experiment=digits_ablation`), the full cache beside them.
"""

from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from eval.plots import natural_sorted


def kept_positions_figure(df: pd.DataFrame, meta: dict) -> Figure:
    """df: `kept_positions.csv` rows (config, layer, region, position, offset, digit, fraction)."""
    configs = list(dict.fromkeys(df["config"]))
    n_layers = int(df["layer"].max()) + 1
    needle_w = df[df["region"] == "needle"]["position"].nunique()
    end_w = df[df["region"] == "end"]["position"].nunique()
    fig = Figure(figsize=(13, 2.0 * len(configs) + 1.2))
    grid = fig.add_gridspec(len(configs), 3, width_ratios=[needle_w, end_w, 2], wspace=0.08, hspace=0.5)
    length, (w0, _) = meta["prompt_tokens"], meta["window_positions"]
    digits, needle = meta["digit_positions"], meta["needle_positions"]
    image = None
    for r, config in enumerate(configs):
        for c, region in enumerate(("needle", "end")):
            ax = fig.add_subplot(grid[r, c])
            d = df[(df["config"] == config) & (df["region"] == region)]
            m = d.pivot(index="layer", columns="position", values="fraction").sort_index()
            cols = list(m.columns)
            image = ax.imshow(
                m.values,
                aspect="auto",
                cmap="viridis",
                vmin=0,
                vmax=1,
                interpolation="nearest",
                extent=(-0.5, len(cols) - 0.5, n_layers - 0.5, -0.5),
            )
            if region == "needle":
                lo, hi = cols.index(digits[0]), cols.index(digits[-1])
                ax.add_patch(Rectangle((lo - 0.5, -0.5), hi - lo + 1, n_layers, fill=False, ec="red", lw=1.5))
                s0, s1 = cols.index(needle[0]), cols.index(needle[-1])
                ax.axvspan(s0 - 0.5, s1 + 0.5, ymin=1.0, ymax=1.06, color="orange", clip_on=False)
                ticks = [i for i, p in enumerate(cols) if (p - digits[0]) % 8 == 0]
                ax.set_xticks(ticks, [str(cols[i] - digits[0]) for i in ticks])
                ax.set_ylabel(f"{config}\nlayer", fontsize=8)
                if r == len(configs) - 1:
                    ax.set_xlabel("position - first digit (red: the 7 digits; orange: needle sentence)")
            else:
                x = cols.index(w0)
                ax.axvline(x - 0.5, color="red", lw=1.5)
                ax.text(x + 1, -1.0, "window", color="red", fontsize=7, va="bottom")
                ticks = [i for i, p in enumerate(cols) if (length - p) % 16 == 0]
                ax.set_xticks(ticks, [str(cols[i] - length) for i in ticks])
                ax.set_yticks([])
                if r == len(configs) - 1:
                    ax.set_xlabel("position - prompt length")
            ax.tick_params(labelsize=7)
    cax = fig.add_subplot(grid[:, 2])
    fig.colorbar(image, cax=cax, label="share of the layer's KV heads that kept the position")
    fig.suptitle(
        f"SnapKV kept positions, {meta['model']}, {meta['sample_id']} ({length} tokens), budget "
        f"{meta['budget']}, window {w0 - length} .. -1, number {meta['number']}",
        fontsize=10,
    )
    return fig


def config_name(params: dict) -> str:
    if params.get("budget") is None:
        return "full cache"
    name = f"k={params.get('kernel_size')}"
    if params.get("span"):
        return f"{name} span={params['span']} (ours)"
    return name + (" (paper)" if params.get("kernel_size") == 7 else "")


def digits_ablation_figure(rows: pd.DataFrame, title: str) -> Figure:
    """rows: prepared result rows with `method_params`, `context_length`, `score`, `partial`."""
    d = rows.assign(config=rows["method_params"].map(config_name))
    order = ["full cache"] + natural_sorted([c for c in d["config"].unique() if c != "full cache"])
    order = [c for c in order if c in set(d["config"])]
    lengths = sorted(d["context_length"].unique())
    fig = Figure(figsize=(max(8, 1.3 * len(order) * len(lengths) / 2 + 3), 4.2))
    width = 0.8 / len(lengths)
    for i, (y, label) in enumerate((("score", "exact"), ("partial", "partial credit"))):
        ax = fig.add_subplot(1, 2, i + 1)
        means = d.groupby(["config", "context_length"])[y].mean().mul(100)
        counts = d.groupby(["config", "context_length"]).size()
        for j, n in enumerate(lengths):
            xs = [k + (j - (len(lengths) - 1) / 2) * width for k in range(len(order))]
            vals = [means.get((c, n), float("nan")) for c in order]
            bars = ax.bar(xs, vals, width, label=f"{int(n)} tokens")
            for b, c, v in zip(bars, order, vals):
                if v == v:
                    txt = f"{v:.0f}\nn={counts[(c, n)]}"
                    ax.annotate(txt, (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=6)
        ax.set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 118)
        ax.set_ylabel(f"needle {label} x100")
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
