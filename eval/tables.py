"""Markdown tables and names shared by the generic report and the tasks' own report tables."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd

from eval.stats import seed_variance
from eval.store import sample_keys


def cell(v: Any, digits: int = 2) -> str:
    """A table cell: `—` for missing values, floats with `digits` decimals."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def md_table(headers: list[str], rows: list[list[Any]], text_columns: int = 1) -> str:
    """Markdown table; the first `text_columns` columns are left-aligned, the rest right-aligned."""

    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(str(h)) for h in headers) + " |"]
    lines.append("|" + "|".join("---" if i < text_columns else "---:" for i in range(len(headers))) + "|")
    for row in rows:
        lines.append("| " + " | ".join(esc(cell(v)) for v in row) + " |")
    return "\n".join(lines)


MIXED_NOTE = (
    "The configs in this table ran on different samples: each cell gives its n (ok samples); the "
    "Paired comparisons section compares them on the samples they share."
)


def samples_differ(part: pd.DataFrame, col: str = "config_label") -> bool:
    """Whether the configs (`col`) of `part` scored different sets of samples (ok rows; samples
    identified by `eval.store.sample_keys`)."""
    ok = part[part["ok"]]
    keys = ok.assign(_key=sample_keys(ok)).groupby(col)["_key"].agg(frozenset)
    return keys.nunique() > 1


def with_n(value: Any, n: int, digits: int = 2) -> str:
    """A score cell with its sample count beside it: `38.00 (n=5)`; `—` when missing."""
    text = cell(value, digits)
    return text if text == "—" else f"{text} (n={int(n)})"


def column_order(df: pd.DataFrame, col: str = "config_label") -> list[str]:
    """Method config columns: full first, then by method, budget, label."""
    keys = (
        df[[col, "method", "budget"]]
        .drop_duplicates(col)
        .assign(_full=lambda d: d["method"] != "full", _b=lambda d: d["budget"].fillna(float("inf")))
        .sort_values(["_full", "method", "_b", col])
    )
    return keys[col].tolist()


def slug(text: str) -> str:
    """File-name-safe version of a label / model id."""
    text = str(text).replace("/", "__")
    text = re.sub(r"\s+", "_", text.strip())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text) or "_"


def score_table(
    part: pd.DataFrame,
    title: str,
    datasets: list[str] | None = None,
    categories: dict[str, str | None] | None = None,
) -> str:
    """Rows = dataset, columns = config label, values = mean score x100 over the ok rows of `part`.

    `datasets`: row order (default: sorted). A "**Average**" row (mean over datasets) when there is
    more than one dataset, then one row per category of `categories` (dataset -> category, in the
    mapping's order; None: no category). A mean over only some datasets is marked with †.
    """
    cols = column_order(part)
    datasets = datasets if datasets is not None else sorted(part["dataset"].unique())
    ok = part[part["ok"]]
    means = ok.groupby(["dataset", "config_label"])["score"].mean().mul(100).unstack()
    means = means.reindex(index=datasets, columns=cols)
    mixed = samples_differ(part)
    counts = ok.groupby(["dataset", "config_label"]).size().unstack().reindex(index=datasets, columns=cols)
    rows: list[list[Any]] = [
        [ds] + [with_n(means.at[ds, c], counts.at[ds, c]) if mixed else means.at[ds, c] for c in cols]
        for ds in means.index
    ]
    incomplete = False

    def macro(sub: pd.DataFrame, c: str) -> Any:
        # Mean over datasets; marked with † when the config lacks some of them (not comparable).
        nonlocal incomplete
        values = sub[c]
        if values.isna().all() or values.notna().all():
            return values.mean()
        incomplete = True
        return f"{values.mean():.2f}†"

    if len(means.index) > 1:
        rows.append(["**Average**"] + [macro(means, c) for c in cols])
    if categories:
        cats = pd.Series({ds: categories.get(ds) for ds in means.index}, dtype=object)
        for cat in dict.fromkeys(v for v in categories.values() if v is not None):
            members = cats[cats == cat].index
            if len(members):
                rows.append([f"*{cat}*"] + [macro(means.loc[members], c) for c in cols])
    note = "\n\n† mean over only the datasets this config has scores for." if incomplete else ""
    if mixed:
        note += f"\n\n{MIXED_NOTE} The averages weigh every dataset equally, whatever its n."
    return (
        f"### {title}\n\nScore x100 (mean over ok samples).\n\n" + md_table(["dataset"] + cols, rows) + note
    )


def seed_tables(part: pd.DataFrame) -> list[str]:
    """Per (task, model), a table of the configs whose ok rows span two or more generator seeds
    (`task_seed`; rows written before the field count as the row's `seed`): the mean score x100
    (mean of the per-seed means), its 95% interval, and the two components of that interval apart
    (`eval.stats.seed_variance`): "seed sd", what the choice of generated contexts adds, and
    "sampling sd", what the samples within each seed add. None when no config spans two seeds."""
    if "task_seed" not in part or part["task_seed"].isna().all():
        return []
    ok = part[part["ok"]]
    seed = ok["task_seed"].fillna(ok["seed"]) if "seed" in ok else ok["task_seed"]
    out = []
    for (task, model), g in ok.assign(_seed=seed).groupby(["task", "model"], sort=True):
        rows = []
        for label in column_order(g):
            sub = g[g["config_label"] == label]
            split = seed_variance(sub["score"], sub["_seed"])
            if split is None:
                continue
            lo, hi = split.interval()
            rows.append(
                [label, split.seeds, split.n, 100 * split.mean, f"[{100 * lo:.2f}, {100 * hi:.2f}]",
                 100 * split.seed_sd, 100 * split.sampling_sd]
            )  # fmt: skip
        if rows:
            out.append(
                f"### {task} — {model}: generator seeds\n\nScore x100 over every generator seed (the mean "
                "of the per-seed means) with a 95% normal interval whose two parts are given apart: seed sd "
                "(the spread the generated contexts add) and sampling sd (the spread of the samples within "
                "each seed); interval half-width = 1.96 x sqrt(seed sd² + sampling sd²).\n\n"
                + md_table(["method", "seeds", "n", "score", "95% interval", "seed sd", "sampling sd"], rows)
            )
    return out
