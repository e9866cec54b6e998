"""Summarise a results directory: `python -m eval.report RESULTS_DIR [--out DIR] [--trained-context N]`.

Writes into `--out` (default: RESULTS_DIR):

- `summary.csv`: one row per task x dataset x model x method x method config label x query_aware with
  n, n_ok, n_error (status != ok, OOMs included), n_oom, score (mean x100 over ok rows), partial
  (mean `scores["partial"]` x100 where present), and means over ok rows of input_tokens, kv_tokens,
  kv_bytes_full, kv_bytes, compression (kv_bytes / kv_bytes_full per row), prefill_s, ttft_s, tpot_s,
  peak_mem_bytes.
- `report.md` (also printed to stdout): per (task, model) score tables (rows = dataset, columns =
  method config label, score x100, plus "Average" and LongBench category means), needle accuracy
  per method config x context length (mean over depths), and a cost table.
- `needle_<model>_<label>.png` per (model, method config) and `score_vs_budget_<task>.png` for tasks
  run at more than one budget.

Rows with status != ok are counted (n_error) but excluded from every mean. Exit code 2 (one line on
stderr) when there is nothing to report.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from eval.store import ResultStore

# Parameter name -> short label key, in label order. Several spellings map to one key.
_ABBREV: dict[str, str] = {
    "budget": "b",
    "max_capacity_prompt": "b",
    "kv_budget": "b",
    "compression_ratio": "r",
    "ratio": "r",
    "window_size": "w",
    "window": "w",
    "observation_window": "w",
    "kernel_size": "k",
    "sink_size": "s",
    "n_sink": "s",
    "num_sink_tokens": "s",
    "sink_tokens": "s",
}
_KEY_ORDER = ("b", "r", "w", "k", "s")
# Parameters shown by value only ("max" rather than "pooling=max") when the value is one of these.
_BARE = {"pooling": ("max", "avg", "mean")}
# Secondary parameters left out of the label at these values (the methods' defaults). Hiding one
# fixed value per parameter never gives two different configs the same label.
QUIET_DEFAULTS: dict[str, Any] = {
    "gqa_reduce": "mean",
    "recent_ratio": 0.5,
    "evict_during_decode": True,
    "normalize": False,
    "block_size": 256,
    "positions": "original",
}
BUDGET_KEYS = ("budget", "max_capacity_prompt", "kv_budget")
QUERY_AGNOSTIC_SUFFIX = " q-agnostic"

SUMMARY_KEYS = ["task", "dataset", "model", "method", "label", "query_aware"]
_MEAN_COLUMNS = [
    "input_tokens",
    "kv_tokens",
    "kv_bytes_full",
    "kv_bytes",
    "compression",
    "prefill_s",
    "ttft_s",
    "tpot_s",
    "peak_mem_bytes",
]
SUMMARY_COLUMNS = SUMMARY_KEYS + [
    "method_params",
    "n",
    "n_ok",
    "n_error",
    "n_oom",
    "score",
    "partial",
    *_MEAN_COLUMNS,
]


# ---------------------------------------------------------------------------------------------- labels
def _fmt_value(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() else f"{v:g}"
    if isinstance(v, (list, tuple)):
        return ",".join(_fmt_value(x) for x in v)
    if isinstance(v, dict):
        return json.dumps(v, sort_keys=True, separators=(",", ":"))
    return str(v)


def method_label(method: str | None, params: dict | None = None, query_aware: bool | None = None) -> str:
    """Short readable label of a method config, e.g. `snapkv b=512 w=32 k=7 max` or `full`.

    Known parameters get short keys in a fixed order (b=budget, r=ratio, w=window, k=kernel,
    s=sinks), other parameters follow as `name=value` (sorted), `pooling` is shown by value last
    (`max`/`avg`; `pooling=none` otherwise). None-valued parameters and secondary parameters at their
    default (`QUIET_DEFAULTS`, e.g. gqa_reduce=mean) are omitted. `query_aware=False` appends
    " q-agnostic" (None/True: nothing).
    """
    params = params if isinstance(params, dict) else {}
    known: dict[str, str] = {}
    other: list[str] = []
    bare: list[str] = []
    for name in sorted(params):
        value = params[name]
        if value is None or (name in QUIET_DEFAULTS and value == QUIET_DEFAULTS[name]):
            continue
        if name in _BARE and value in _BARE[name]:
            bare.append(_fmt_value(value))
        elif name in _ABBREV and _ABBREV[name] not in known:
            known[_ABBREV[name]] = f"{_ABBREV[name]}={_fmt_value(value)}"
        else:
            other.append(f"{name}={_fmt_value(value)}")
    parts = [str(method) if method not in (None, "") else "?"]
    parts += [known[k] for k in _KEY_ORDER if k in known] + other + bare
    label = " ".join(parts)
    if query_aware is False:
        label += QUERY_AGNOSTIC_SUFFIX
    return label


def budget_of(params: dict | None) -> float | None:
    """The token budget in `params` (first of BUDGET_KEYS present), else None."""
    if not isinstance(params, dict):
        return None
    for key in BUDGET_KEYS:
        v = params.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def slug(text: str) -> str:
    """File-name-safe version of a label / model id."""
    text = str(text).replace("/", "__")
    text = re.sub(r"\s+", "_", text.strip())
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", text) or "_"


# ---------------------------------------------------------------------------------------- preparation
def _is_false(v: Any) -> bool:
    return v is False or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    """Add derived columns: label, config_label (label + query-agnostic suffix), params_json, budget,
    ok, partial, compression, and numeric versions of the metric columns."""
    df = df.copy()
    for col in ("task", "dataset", "model", "method"):
        df[col] = df[col].map(
            lambda v: "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
        )
    params = df["method_params"].map(lambda p: p if isinstance(p, dict) else {})
    qa = df["query_aware"].map(
        lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else bool(v)
    )
    df["query_aware"] = qa.astype(object)
    df["label"] = [method_label(m, p) for m, p in zip(df["method"], params)]
    df["config_label"] = [
        method_label(m, p, False if _is_false(q) else None) for m, p, q in zip(df["method"], params, qa)
    ]
    df["params_json"] = params.map(lambda p: json.dumps(p, sort_keys=True, default=str))
    df["budget"] = pd.to_numeric(params.map(budget_of), errors="coerce")
    df["ok"] = df["status"].astype(object).eq("ok")
    df["partial"] = pd.to_numeric(
        df["scores"].map(lambda s: s.get("partial") if isinstance(s, dict) else None), errors="coerce"
    )
    for col in (
        "score",
        "input_tokens",
        "kv_tokens",
        "kv_bytes_full",
        "kv_bytes",
        "prefill_s",
        "ttft_s",
        "tpot_s",
        "peak_mem_bytes",
        "context_length",
        "depth_percent",
    ):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    full = df["kv_bytes_full"].where(df["kv_bytes_full"] > 0)
    df["compression"] = df["kv_bytes"] / full
    return df


def _group_stats(group: pd.DataFrame) -> dict[str, Any]:
    ok = group[group["ok"]]
    out: dict[str, Any] = {
        "method_params": group["params_json"].iloc[0],
        "n": len(group),
        "n_ok": len(ok),
        "n_error": int((~group["ok"]).sum()),
        "n_oom": int(group["status"].astype(object).eq("oom").sum()),
        "score": round(ok["score"].mean() * 100, 2) if ok["score"].notna().any() else float("nan"),
        "partial": round(ok["partial"].mean() * 100, 2) if ok["partial"].notna().any() else float("nan"),
    }
    for col in _MEAN_COLUMNS:
        out[col] = ok[col].mean() if ok[col].notna().any() else float("nan")
    return out


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """The summary.csv table from a `prepare`d frame."""
    records = []
    for keys, group in df.groupby(SUMMARY_KEYS, sort=True, dropna=False):
        if group["method_hash"].nunique(dropna=True) > 1:
            print(
                f"warning: {dict(zip(SUMMARY_KEYS, keys))} merges {group['method_hash'].nunique()} "
                "configs (method_hash differs, e.g. task config); see `file` in the rows",
                file=sys.stderr,
            )
        records.append({**dict(zip(SUMMARY_KEYS, keys)), **_group_stats(group)})
    return pd.DataFrame.from_records(records, columns=SUMMARY_COLUMNS)


# ------------------------------------------------------------------------------------------ markdown
def _cell(v: Any, digits: int = 2) -> str:
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
        lines.append("| " + " | ".join(esc(_cell(v)) for v in row) + " |")
    return "\n".join(lines)


def _column_order(df: pd.DataFrame, col: str = "config_label") -> list[str]:
    """Method config columns: full first, then by method, budget, label."""
    keys = (
        df[[col, "method", "budget"]]
        .drop_duplicates(col)
        .assign(_full=lambda d: d["method"] != "full", _b=lambda d: d["budget"].fillna(float("inf")))
        .sort_values(["_full", "method", "_b", col])
    )
    return keys[col].tolist()


def _categories() -> dict[str, str] | None:
    try:
        from eval.metrics import DATASET2CATEGORY  # lazy: optional, owned by the metrics module
    except Exception as e:  # noqa: BLE001 - any failure just drops the category rows
        print(f"note: LongBench category rows omitted ({type(e).__name__}: {e})", file=sys.stderr)
        return None
    return dict(DATASET2CATEGORY)


def _category_of(dataset: str, mapping: dict[str, str]) -> str | None:
    if dataset in mapping:
        return mapping[dataset]
    if dataset.endswith("_e") and dataset[:-2] in mapping:  # LongBench-E names
        return mapping[dataset[:-2]]
    return None


def is_needle(df: pd.DataFrame) -> pd.Series:
    return df["task"].str.contains("needle", case=False) | df["depth_percent"].notna()


def score_tables(df: pd.DataFrame) -> list[str]:
    """Per (task, model): rows = dataset, columns = config label, values = mean score x100 (ok rows)."""
    out = []
    mapping: dict[str, str] | None = None
    mapping_loaded = False
    for (task, model), part in df.groupby(["task", "model"], sort=True):
        cols = _column_order(part)
        is_longbench = "longbench" in task.lower()
        if is_longbench and not mapping_loaded:
            mapping, mapping_loaded = _categories(), True
        mapping_here = mapping if is_longbench else None
        datasets = sorted(part["dataset"].unique())
        if mapping_here:  # LongBench's own dataset order (the mapping's order), unknown datasets last
            order = {ds: i for i, ds in enumerate(mapping_here)}
            datasets.sort(key=lambda ds: order.get(ds, order.get(ds[:-2], len(order))))
        ok = part[part["ok"]]
        means = ok.groupby(["dataset", "config_label"])["score"].mean().mul(100).unstack()
        means = means.reindex(index=datasets, columns=cols)
        rows: list[list[Any]] = [[ds] + [means.at[ds, c] for c in cols] for ds in means.index]
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
        if mapping_here:
            cats = pd.Series({ds: _category_of(ds, mapping_here) for ds in means.index}, dtype=object)
            for cat in dict.fromkeys(mapping_here.values()):  # category order as in the mapping
                members = cats[cats == cat].index
                if len(members):
                    rows.append([f"*{cat}*"] + [macro(means.loc[members], c) for c in cols])
        note = "\n\n† mean over only the datasets this config has scores for." if incomplete else ""
        out.append(
            f"### {task} — {model}\n\nScore x100 (mean over ok samples).\n\n"
            + md_table(["dataset"] + cols, rows)
            + note
        )
        if is_longbench and "length" in ok and pd.to_numeric(ok["length"], errors="coerce").notna().any():
            out.append(longbench_e_table(ok, cols, datasets))
    return out


LONGBENCH_E_BUCKETS = ("0-4k", "4-8k", "8k+")


def longbench_e_bucket(length: float) -> str:
    """LongBench-E's buckets of the records' `length` field (eval.py's scorer_e: <4000, <8000, rest)."""
    return (
        LONGBENCH_E_BUCKETS[0]
        if length < 4000
        else LONGBENCH_E_BUCKETS[1]
        if length < 8000
        else LONGBENCH_E_BUCKETS[2]
    )


def longbench_e_table(ok: pd.DataFrame, cols: list[str], datasets: list[str]) -> str:
    """Score x100 per dataset x LongBench-E length bucket (rows) and config (columns)."""
    ok = ok.assign(length=pd.to_numeric(ok["length"], errors="coerce")).dropna(subset=["length"])
    ok = ok.assign(bucket=ok["length"].map(longbench_e_bucket))
    means = ok.groupby(["dataset", "bucket", "config_label"])["score"].mean().mul(100)
    rows = []
    for ds in datasets:
        for bucket in LONGBENCH_E_BUCKETS:
            if (ds, bucket) in means.index.droplevel(2):
                rows.append([f"{ds} {bucket}"] + [means.get((ds, bucket, c), float("nan")) for c in cols])
    return "LongBench-E length buckets (the records' `length`, words), score x100.\n\n" + md_table(
        ["dataset / length"] + cols, rows
    )


def needle_means(df: pd.DataFrame, value: str = "score") -> pd.DataFrame:
    """`value` x100 per (task, model, config_label, context_length): mean over depths of per-depth means."""
    ok = df[df["ok"] & df["context_length"].notna()]
    per_depth = ok.groupby(
        ["task", "model", "config_label", "context_length", "depth_percent"], dropna=False
    )[value].mean()
    return per_depth.groupby(level=[0, 1, 2, 3]).mean().mul(100).rename("score").reset_index()


NEEDLE_VALUES = {
    "score": "Needle accuracy x100 per context length (mean over depths).",
    "partial": "Partial credit x100 (longest correct prefix of the number / its length), mean over depths.",
}


def needle_tables(df: pd.DataFrame) -> list[str]:
    out = []
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
            labels = _column_order(part)
            table = table.reindex(index=labels, columns=lengths)
            headers = (
                ["method"] + [str(int(v)) if float(v).is_integer() else str(v) for v in lengths] + ["avg"]
            )
            rows = [[lab] + [table.at[lab, c] for c in lengths] + [table.loc[lab].mean()] for lab in labels]
            out.append(f"### {task} — {model}\n\n{caption}\n\n" + md_table(headers, rows))
    return out


def cost_table(df: pd.DataFrame) -> str:
    rows = []
    for (task, model, label), g in df.groupby(["task", "model", "config_label"], sort=True):
        ok = g[g["ok"]]

        def m(col: str, ok=ok) -> float:
            return ok[col].mean() if ok[col].notna().any() else float("nan")

        rows.append(
            [
                task,
                model,
                label,
                len(g),
                len(ok),
                len(g) - len(ok),
                _cell(m("input_tokens"), 0),
                _cell(m("kv_tokens"), 0),
                _cell(m("compression") * 100, 1),
                _cell(m("kv_bytes") / 2**20, 1),
                _cell(m("prefill_s"), 3),
                _cell(m("ttft_s"), 3),
                _cell(m("tpot_s") * 1000, 1),
                _cell(m("peak_mem_bytes") / 2**30, 2),
            ]
        )
    headers = [
        "task",
        "model",
        "method",
        "n",
        "ok",
        "err",
        "input tok",
        "kv tok",
        "kv %",
        "kv MiB",
        "prefill s",
        "ttft s",
        "tpot ms",
        "peak GiB",
    ]
    return md_table(headers, rows, text_columns=3)


def build_markdown(df: pd.DataFrame, results_dir: Path) -> str:
    needle = is_needle(df)
    n_bad = int((~df["ok"]).sum())
    parts = [
        "# snapkv-bench report",
        "",
        f"Results: `{results_dir}` — {len(df)} rows, {int(df['ok'].sum())} ok, {n_bad} not ok "
        "(error/oom rows are counted but excluded from score means).",
    ]
    if (~needle).any():
        parts += ["", "## Scores", ""] + ["\n\n".join(score_tables(df[~needle]))]
    if needle.any():
        parts += ["", "## Needle in a haystack", ""] + ["\n\n".join(needle_tables(df[needle]))]
    from eval.tasks.ruler_report import ruler_markdown  # RULER's own section (task x length)

    if ruler := ruler_markdown(df, _column_order):
        parts += ["", ruler]
    parts += [
        "",
        "## Cost",
        "",
        "Means over ok samples; kv % = kv_bytes / kv_bytes_full.",
        "",
        cost_table(df),
        "",
    ]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------- plots
def write_plots(df: pd.DataFrame, out: Path, trained_context: int | None = None) -> list[Path]:
    from eval.plots import needle_heatmap, score_vs_budget

    written: list[Path] = []
    ok = df[df["ok"]]
    needle = ok[is_needle(ok) & ok["context_length"].notna() & ok["depth_percent"].notna()]
    several_tasks = needle["task"].nunique() > 1
    for (task, model, label), g in needle.groupby(["task", "model", "config_label"], sort=True):
        tc = trained_context
        if (
            "trained_context" in g.columns
            and pd.to_numeric(g["trained_context"], errors="coerce").notna().any()
        ):
            tc = int(pd.to_numeric(g["trained_context"], errors="coerce").dropna().iloc[0])
        name = f"needle_{slug(task) + '_' if several_tasks else ''}{slug(model)}_{slug(label)}.png"
        title = f"{model}\n{label}" + (f" ({task})" if several_tasks else "")
        written.append(needle_heatmap(g, out / name, title=title, trained_context=tc))
        # Partial credit (longest correct prefix of the number) beside exact containment: on small
        # models a compressed cache often keeps only the first digits, which exact match hides.
        partial = pd.to_numeric(
            g["scores"].map(lambda s: s.get("partial") if isinstance(s, dict) else None), errors="coerce"
        )
        if partial.notna().any():
            written.append(
                needle_heatmap(
                    g.assign(partial=partial),
                    out / name.replace(".png", "_partial.png"),
                    title=f"{title} (partial credit)",
                    trained_context=tc,
                    value="partial",
                )
            )

    from eval.tasks.ruler_report import ruler_heatmaps

    written += ruler_heatmaps(df, out)
    for task, g in ok.groupby("task", sort=True):
        if g["budget"].dropna().nunique() < 2:
            continue
        several_models = g["model"].nunique() > 1
        line = [
            method_label(
                m,
                {k: v for k, v in (p or {}).items() if k not in BUDGET_KEYS},
                False if _is_false(q) else None,
            )
            for m, p, q in zip(g["method"], g["method_params"], g["query_aware"])
        ]
        g = g.assign(line=[f"{mo}: {li}" if several_models else li for mo, li in zip(g["model"], line)])
        # Macro average: mean per dataset first, then over datasets.
        per_ds = g.groupby(["line", "budget", "dataset"], dropna=False)["score"].mean().mul(100).reset_index()
        written.append(
            score_vs_budget(
                per_ds,
                out / f"score_vs_budget_{slug(task)}.png",
                title=f"{task}: score vs KV budget" + ("" if several_models else f" ({g['model'].iloc[0]})"),
                line="line",
                ylabel="score x100",
            )
        )
    return written


# ----------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.report", description=__doc__.split("\n")[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: RESULTS_DIR)")
    ap.add_argument("--trained-context", type=int, default=None, help="dashed line on needle heatmaps")
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)

    if not args.results_dir.is_dir():
        print(f"error: results dir not found: {args.results_dir}", file=sys.stderr)
        return 2
    try:
        raw = ResultStore.load_dir(args.results_dir)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if raw.empty:
        print(f"error: no result rows (*.jsonl) found under {args.results_dir}", file=sys.stderr)
        return 2

    out = args.out or args.results_dir
    out.mkdir(parents=True, exist_ok=True)
    df = prepare(raw)
    summarize(df).to_csv(out / "summary.csv", index=False)
    markdown = build_markdown(df, args.results_dir)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    if not args.no_plots:
        write_plots(df, out, trained_context=args.trained_context)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
