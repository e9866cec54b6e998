"""The reasoning task's report: accuracy, output length and end-to-end time per method config.

Per (model, decoding) one table, a row per method config (ok rows only):

- pass@1 x100: the mean over problems of each problem's mean correctness over its samples (greedy:
  one sample, plain accuracy), with a 95% bootstrap interval over problems (the problem is the
  unit: its samples share its prompt; `eval.stats.unit_bootstrap` of the rows' scores grouped by
  problem, percentile, seeded; n/a below two problems);
- format %: outputs with a "Final answer:" line;
- tokens: mean generated tokens (`new_tokens`), and `vs full`: Σ tokens / Σ the full cache's tokens
  over the rows paired with a full-cache row of the same model, decoding, problem and sample seed
  (`sample_id` names the problem and sample index); n/a without full-cache rows;
- e2e s: mean end-to-end seconds per sample (`e2e_s`: prefill + compression + every decode step);
- KV peak / KV mean: `kv_entries_peak` / `kv_entries_mean` (entries per KV head the decode steps
  attended to), compressions: `decode_compressions` (scheduled compressions while decoding), means
  over samples;
- compressed %: samples whose cache lost entries at all (`was_compressed`): a sample whose prompt and
  output fit the budget, or ended before its first scheduled compression, ran on the full cache.

Figure `reasoning_vs_budget_<model>.png` (eval/plots.py): accuracy and mean output length vs KV
budget, a line per method, the full cache dashed, a point hollow where some of its samples were
never compressed; drawn when some config has a budget.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import pandas as pd

from eval.labels import BUDGET_KEYS, method_label
from eval.plots import reasoning_vs_budget
from eval.stats import unit_bootstrap
from eval.tables import cell, column_order, md_table, slug
from eval.tasks.base import ReportOptions, TaskReport

GREEDY = "greedy"
NUMERIC = (
    "new_tokens", "e2e_s", "sample_index", "temperature", "top_p",
    "decode_compressions", "kv_entries_peak", "kv_entries_mean",
)  # fmt: skip


def _decoding(t, p) -> str:
    if t is None or p is None or (isinstance(t, float) and math.isnan(t)):
        return GREEDY
    return f"sampled T={t:g} top_p={p:g}"


def prepare_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Numeric length / time / sampling columns, `prompt_key` (the problem: `prompt_id` of sampled
    rows, else `sample_id`), `pair_key` (problem, sample index and seed), `decoding` and `format`."""
    df = df.copy()
    for c in NUMERIC:
        df[c] = pd.to_numeric(df[c], errors="coerce") if c in df.columns else math.nan
    prompt = df["prompt_id"] if "prompt_id" in df.columns else pd.Series(None, index=df.index, dtype=object)
    df["prompt_key"] = prompt.where(prompt.notna(), df["sample_id"])
    seed = df["sample_seed"] if "sample_seed" in df.columns else pd.Series(None, index=df.index, dtype=object)
    df["pair_key"] = df["sample_id"].astype(str) + "|" + seed.map(lambda s: "" if pd.isna(s) else str(int(s)))
    df["decoding"] = [_decoding(t, p) for t, p in zip(df["temperature"], df["top_p"])]
    df["format"] = pd.to_numeric(
        df["scores"].map(lambda s: s.get("format") if isinstance(s, dict) else None), errors="coerce"
    )
    return df


def pass_at_1(rows: pd.DataFrame) -> tuple[float, float, float, int]:
    """(pass@1, low, high, problems): mean over problems of the per-problem mean `score`, with its
    95% bootstrap interval over problems."""
    per_problem = rows.groupby("prompt_key")["score"].mean()
    if per_problem.empty:
        return math.nan, math.nan, math.nan, 0
    # Each problem's mean as one value of its own unit: the mean over problems, whatever their samples.
    b = unit_bootstrap(per_problem.to_numpy(dtype=float))
    return b.estimate, b.lo, b.hi, b.n_units


def length_ratio(rows: pd.DataFrame, full: pd.DataFrame) -> float:
    """Σ new_tokens / Σ the full cache's new_tokens over the rows paired by `pair_key` (NaN: no pair)."""
    ref = full.groupby("pair_key")["new_tokens"].mean()
    paired = rows[rows["pair_key"].isin(ref.index)]
    if paired.empty:
        return math.nan
    denom = ref.loc[paired["pair_key"]].sum()
    return float(paired["new_tokens"].sum() / denom) if denom > 0 else math.nan


def was_compressed(df: pd.DataFrame) -> pd.Series:
    """Per row: the cache was compressed at prefill, evicted entries while decoding, or compressed on
    its decode schedule (missing columns and values count as not)."""

    def flag(col: str) -> pd.Series:
        if col not in df.columns:
            return pd.Series(False, index=df.index)
        return df[col].astype("boolean").fillna(False).astype(bool)

    scheduled = pd.to_numeric(df.get("decode_compressions", pd.Series(0, index=df.index)), errors="coerce")
    return flag("compressed") | flag("evicted_during_decode") | (scheduled.fillna(0) > 0)


def tables(df: pd.DataFrame) -> list[str]:
    ok = df[df["ok"]]
    out = []
    for (model, decoding), part in ok.groupby(["model", "decoding"], sort=True):
        full = part[part["method"] == "full"]
        rows = []
        for label in column_order(part):
            g = part[part["config_label"] == label]
            acc, lo, hi, n = pass_at_1(g)
            k = int(g.groupby("prompt_key").size().max())
            ratio = length_ratio(g, full) if not full.empty else math.nan
            rows.append(
                [
                    label, n, k, cell(100 * acc, 1),
                    f"[{cell(100 * lo, 1)}, {cell(100 * hi, 1)}]" if not math.isnan(lo) else "n/a",
                    cell(100 * g["format"].mean(), 1), cell(g["new_tokens"].mean(), 1),
                    cell(ratio, 3) if not math.isnan(ratio) else "n/a", cell(g["e2e_s"].mean(), 2),
                    cell(g["kv_entries_peak"].mean(), 1), cell(g["kv_entries_mean"].mean(), 1),
                    cell(g["decode_compressions"].mean(), 1), cell(100 * was_compressed(g).mean(), 1),
                ]
            )  # fmt: skip
        headers = [
            "method",
            "problems",
            "samples",
            "pass@1",
            "95% CI",
            "format %",
            "tokens",
            "vs full",
            "e2e s",
            "KV peak",
            "KV mean",
            "compressions",
            "compressed %",
        ]
        out.append(
            f"### {model} — {decoding}\n\npass@1 x100: mean over problems of the mean correctness of each "
            "problem's samples, 95% bootstrap interval over problems; tokens: mean generated tokens; vs "
            "full: Σ tokens / Σ the full cache's tokens on the same problems and sample seeds; e2e s: mean "
            "seconds per sample, prefill + compression + decode; KV peak / mean: entries per KV head the "
            "decode steps attended to (largest / mean over steps, mean over samples); compressions: "
            "scheduled compressions while decoding per sample; compressed %: samples whose cache lost "
            "entries (at prefill or while decoding; the others fit the budget and ran on the full cache)."
            "\n\n" + md_table(headers, rows)
        )
    return out


def per_problem(df: pd.DataFrame) -> pd.DataFrame:
    """One row per (model, decoding, config, problem): mean score and tokens over its samples, the
    budget, and `compressed` (every sample's cache lost entries: `was_compressed`)."""
    df = df.assign(compressed=was_compressed(df))
    keys = ["model", "decoding", "config_label", "method", "prompt_key"]
    return (
        df.groupby(keys, dropna=False)
        .agg(
            score=("score", "mean"),
            new_tokens=("new_tokens", "mean"),
            budget=("budget", "first"),
            compressed=("compressed", "all"),
            method_params=("method_params", "first"),
        )  # fmt: skip
        .reset_index()
    )


def plots(df: pd.DataFrame, out: Path) -> list[Path]:
    if df.empty or df["budget"].dropna().empty:
        return []
    problems = per_problem(df)
    problems["line"] = [
        method_label(m, {k: v for k, v in (p or {}).items() if k not in BUDGET_KEYS})
        for m, p in zip(problems["method"], problems["method_params"])
    ]
    written = []
    for (model, decoding), part in problems.groupby(["model", "decoding"], sort=True):
        suffix = "" if decoding == GREEDY else f"_{slug(decoding)}"
        path = out / f"reasoning_vs_budget_{slug(model)}{suffix}.png"
        written.append(reasoning_vs_budget(part, path, title=f"reasoning: {model}, {decoding}"))
    return written


class ReasoningReport(TaskReport):
    section: ClassVar[str] = "Reasoning (long generation)"
    budget_values: ClassVar[dict[str, str]] = {"score": "accuracy"}

    @classmethod
    def prepare_rows(cls, df: pd.DataFrame) -> pd.DataFrame:
        return prepare_rows(df)

    @classmethod
    def tables(cls, df: pd.DataFrame) -> list[str]:
        return tables(df)

    @classmethod
    def plots(cls, df: pd.DataFrame, options: ReportOptions) -> list[Path]:
        return plots(df, options.out)
