"""Summarise a results directory: `python scripts/report.py RESULTS_DIR [--out DIR] [--trained-context N]`,
or from code `write_report(results_dir)`.

Writes into `--out` (default: RESULTS_DIR):

- `summary.csv`: one row per task x dataset x model x method x method config label x query_aware with
  n, n_ok, n_error (status != ok, OOMs included), n_oom, score (mean x100 over ok rows), partial
  (mean `scores["partial"]` x100 where present), and means over ok rows of input_tokens, kv_tokens,
  kv_bytes_full, kv_bytes, compression (kv_bytes / kv_bytes_full per row), prefill_s, ttft_s, tpot_s,
  peak_mem_bytes.
- `report.md` (the CLI also prints it): each task's own tables (`TaskReport.tables`, grouped under
  the task's report `section`: e.g. LongBench's score table with category means, the needle
  accuracy per context length), a cost table (means of sizes and memory; MEDIANS of prefill / ttft
  / tpot with the median `other_cores` of the same rows beside them, and a line saying how loaded
  the machine was: those timings are bookkeeping), and the code versions the rows came from (a
  warning when they differ).
- `paired.csv`, `flips.csv` and report.md's "Paired comparisons" section (eval/report/paired.py): every
  compressed config minus the full cache and minus SnapKV at its budget on the samples both ran
  (matched by `prompt_sha` / `target_sha`, or by task, dataset and sample_id in rows without them),
  with n, a 95% interval, p and Holm's p (eval/stats.py's `compare`: resampling the units of
  independence, the exact sign-flip p beside the interval where they are few); the samples
  compression broke or fixed.
- each task's plots (`TaskReport.plots`, e.g. `needle_<model>_<label>.png`) and
  `score_vs_budget_<task>.png` for tasks run at more than one budget.
- where rows carry several question indices or protocols: a "Protocols" section and
  `protocols_<task>_<model>.png` (eval/report/protocols.py: score per question, reuse penalty,
  amortised cost).
- report.md's last section, "Figures", lists the plots this report drew. A rebuild deletes the
  figures the previous report.md listed and this one no longer draws (a config whose rows left the
  folder, a comparison grown past its panel limit), so a folder holds only figures of its rows;
  files the report did not list are never touched.

Nothing here knows a particular task: rows of an unregistered task get the generic score table.
Rows with status != ok are counted (n_error) but excluded from every mean. Exit code 2 (one line on
stderr) when there is nothing to report.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

import eval.report.paired as paired
import eval.report.protocols as protocol_report
from eval import protocols
from eval.labels import BUDGET_KEYS, budget_of, format_value, kv_quant_suffix, method_label
from eval.stats import spread, timing_summary
from eval.store import ResultStore
from eval.tables import cell as _cell
from eval.tables import md_table, seed_tables, slug
from eval.tasks import ReportOptions, TaskReport, task_report

logger = logging.getLogger(__name__)

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
# Harness bookkeeping of the machine's load while a sample ran (eval/store.py; None in old rows).
NOISE_COLUMNS = ("other_cores", "load_1m", "cpu_count")
COST_KEYS = ["task", "model", "config_label"]
DUPLICATES_LISTED = 6  # duplicated samples named in report.md (the warning gives the count)
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


# ---------------------------------------------------------------------------------------- preparation
# Row fields that change a config's output without being method parameters (they are in the
# config hash): rows that share a label but differ here are different experiments.
_RUN_FIELDS = {"dtype": "", "attn_impl": "", "prefill_chunk_size": "chunk="}
_DTYPE_SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _run_field_text(field: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        value = "none" if field == "prefill_chunk_size" else "?"
    if field == "dtype":
        return _DTYPE_SHORT.get(str(value), str(value))
    return f"{_RUN_FIELDS[field]}{format_value(value)}"


def _disambiguate_labels(df: pd.DataFrame) -> None:
    """In place: where rows of one (task, model, label) come from configs with different hashes,
    append to `label` and `config_label` what tells them apart, so no table or figure averages two
    experiments under one name. First the run fields that differ within the group (`bf16`,
    `eager`, `chunk=512`), else the config hash (`#1a2b3c4d`: e.g. task parameters or version)."""
    if "method_hash" not in df.columns or df.empty:
        return
    hashes = df["method_hash"].map(lambda h: h if isinstance(h, str) else "")
    for _, idx in df.groupby(["task", "model", "config_label"], sort=False).groups.items():
        if hashes.loc[idx].nunique() < 2:
            continue
        part = df.loc[idx]
        fields = [
            f
            for f in _RUN_FIELDS
            if f in part.columns and part[f].map(lambda v: format_value(v)).nunique() > 1
        ]
        if fields:
            suffix = pd.Series(
                [" ".join(_run_field_text(f, r[f]) for f in fields) for _, r in part.iterrows()], index=idx
            )
        else:
            suffix = "#" + hashes.loc[idx]
        df.loc[idx, "label"] = df.loc[idx, "label"] + " " + suffix
        df.loc[idx, "config_label"] = df.loc[idx, "config_label"] + " " + suffix


def prepare(df: pd.DataFrame) -> pd.DataFrame:
    """Add derived columns: protocol (`eval.protocols.row_protocol`: older rows from query_aware),
    label (+ the protocol for the shared protocols), config_label (label + the protocol's suffix:
    ` q-agnostic` for context_only; both extended where two configs would share them,
    `_disambiguate_labels`), params_json, budget,
    ok, partial, compression, numeric versions of the metric columns, and each task's own columns
    (`TaskReport.prepare_rows`)."""
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
    # Rows from before the protocol axis: query_aware true -> query_aware, false -> context_only.
    stored = df["protocol"] if "protocol" in df.columns else pd.Series(None, index=df.index, dtype=object)
    df["protocol"] = [protocols.row_protocol(p, q) for p, q in zip(stored, qa)]
    # The label names a shared protocol (two of them can share query_aware); config_label any.
    # quantized storage (`kv_quant`, only on rows that used one) is part of the config's name
    kv = df["kv_quant"] if "kv_quant" in df.columns else pd.Series(None, index=df.index, dtype=object)
    quant = [kv_quant_suffix(q) for q in kv]
    df["label"] = [
        method_label(m, p) + q + (protocols.label_suffix(pr) if pr in protocols.SHARED else "")
        for m, p, q, pr in zip(df["method"], params, quant, df["protocol"])
    ]
    df["config_label"] = [
        method_label(m, p) + q + protocols.label_suffix(pr)
        for m, p, q, pr in zip(df["method"], params, quant, df["protocol"])
    ]
    # Rows another engine ran (eval/engines/) say so in every label: its eviction is not the method's.
    if "engine" in df.columns:
        engine = df["engine"].map(lambda e: f" [{e}]" if isinstance(e, str) and e else "")
        df["label"] = df["label"] + engine
        df["config_label"] = df["config_label"] + engine
    _disambiguate_labels(df)
    df["params_json"] = params.map(lambda p: json.dumps(p, sort_keys=True, default=str))
    df["budget"] = pd.to_numeric(params.map(budget_of), errors="coerce")
    df["ok"] = df["status"].astype(object).eq("ok")
    df["partial"] = pd.to_numeric(
        df["scores"].map(lambda s: s.get("partial") if isinstance(s, dict) else None), errors="coerce"
    )
    for col in ("score", *_MEAN_COLUMNS, *NOISE_COLUMNS):
        if col != "compression":
            # Rows from before the noise columns existed have none: NaN, printed "n/a".
            df[col] = pd.to_numeric(df[col], errors="coerce") if col in df.columns else math.nan
    full = df["kv_bytes_full"].where(df["kv_bytes_full"] > 0)
    df["compression"] = df["kv_bytes"] / full
    parts = [task_report(task).prepare_rows(part) for task, part in df.groupby("task", sort=False)]
    return pd.concat(parts).loc[df.index] if parts else df


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
            logger.warning(
                "warning: %s merges %d configs (method_hash differs, e.g. task config); see `file` in the rows",
                dict(zip(SUMMARY_KEYS, keys)), group["method_hash"].nunique(),
            )  # fmt: skip
        records.append({**dict(zip(SUMMARY_KEYS, keys)), **_group_stats(group)})
    return pd.DataFrame.from_records(records, columns=SUMMARY_COLUMNS)


# ------------------------------------------------------------------------------------------ markdown
def cost_table(df: pd.DataFrame) -> str:
    """Per task x model x config: counts, means of sizes and memory over ok rows, and the MEDIANS of
    prefill_s / ttft_s / tpot_s with the median `other_cores` of those rows beside them ("n/a" when
    none of them recorded it: rows from before the field)."""
    timings = timing_summary(df, by=COST_KEYS).set_index(COST_KEYS) if df["ok"].any() else None
    rows = []
    for key, g in df.groupby(COST_KEYS, sort=True):
        ok = g[g["ok"]]

        def m(col: str, ok=ok) -> float:
            return ok[col].mean() if ok[col].notna().any() else float("nan")

        t = timings.loc[key] if timings is not None and key in timings.index else None

        def med(col: str, t=t) -> float:
            return float(t[f"{col}_median"]) if t is not None else float("nan")

        other = med("other_cores")
        rows.append(
            [
                *key,
                len(g),
                len(ok),
                len(g) - len(ok),
                _cell(m("input_tokens"), 0),
                _cell(m("kv_tokens"), 0),
                _cell(m("compression") * 100, 1),
                _cell(m("kv_bytes") / 2**20, 1),
                _cell(med("prefill_s"), 3),
                _cell(med("ttft_s"), 3),
                _cell(med("tpot_s") * 1000, 1),
                "n/a" if math.isnan(other) else _cell(other, 2),
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
        "other cores",
        "peak GiB",
    ]
    return md_table(headers, rows, text_columns=3)


def load_note(df: pd.DataFrame) -> str:
    """The sentence under the cost table: the timings are bookkeeping, and how loaded the machine
    was while the ok rows ran (their `other_cores`, `load_1m`, `cpu_count`)."""
    ok = df[df["ok"]]
    note = (
        "The timings are bookkeeping of one pass over the samples, not a benchmark (no interleaving, "
        "no repeats; samples differ in length): compare speed with `scripts/bench_speed.py`."
    )
    other = spread(ok["other_cores"])
    if other is None:
        return (
            note
            + " These rows predate the load record (`other_cores`): how loaded the machine was is unknown."
        )
    cores = ok["cpu_count"].dropna().unique()
    of = f" of its {int(cores[0])}" if len(cores) == 1 else ""
    load = spread(ok["load_1m"])
    note += (
        f" While they ran, other processes kept a median {other.median:.2f} cores busy{of} "
        f"(max {ok['other_cores'].max():.2f})"
    )
    if load is not None:
        note += f", 1-min load average median {load.median:.2f}"
    missing = len(ok) - other.n
    return note + (f"; {missing} of {len(ok)} ok rows predate that record." if missing else ".")


def _code_version(row: pd.Series) -> tuple[str, str, str]:
    """`(git commit, working tree, snapkv-bench version)` of one row; the working tree is "unknown"
    for rows written before the dirty flag was recorded (their checkout may have had changes)."""

    def text(v: Any) -> str:
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)

    dirty = row.get("git_dirty")
    state = (
        "unknown"
        if dirty is None or (isinstance(dirty, float) and math.isnan(dirty))
        else (f"dirty (diff {text(row.get('git_diff_sha'))})" if dirty else "clean")
    )
    versions = row.get("versions")
    own = versions.get("snapkv_bench") if isinstance(versions, dict) else None
    return text(row.get("git_sha"))[:12], state, text(own)


def code_versions(df: pd.DataFrame) -> tuple[str, bool]:
    """`(markdown table of the code versions the rows came from, whether there is more than one)`."""
    keys = [_code_version(r) for _, r in df.iterrows()]
    counts = pd.Series(keys, dtype=object).value_counts(sort=False)
    rows = [[sha, state, own, n] for (sha, state, own), n in sorted(counts.items())]
    table = md_table(["git commit", "working tree", "snapkv-bench", "rows"], rows, text_columns=3)
    return table, len(rows) > 1


def paired_reports(df: pd.DataFrame) -> list[paired.PairedReport]:
    """Per (task, model): the paired comparisons and flips of its configs (eval/report/paired.py), with
    the task's `paired_strata` and `flip_columns`."""
    out = []
    for (task, _), part in df.groupby(["task", "model"], sort=True):
        report = task_report(task)
        out.append(paired.task_model_report(part, report.paired_strata, report.flip_columns))
    return out


def duplicates_note(duplicates: Sequence[Sequence[Any]]) -> str:
    """The report's line on samples stored in more than one results file (`eval.store.duplicate_rows`
    records); "" when there are none."""
    if not duplicates:
        return ""
    named = "; ".join(f"{r[3]} ({r[1]}, config {r[2]}: {r[4]})" for r in duplicates[:DUPLICATES_LISTED])
    more = f"; +{len(duplicates) - DUPLICATES_LISTED} more" if len(duplicates) > DUPLICATES_LISTED else ""
    return (
        f"**{len(duplicates)} samples are stored in more than one results file** (each is counted once: "
        f"its last ok row): {named}{more}."
    )


def build_markdown(
    df: pd.DataFrame,
    results_dir: Path,
    pairs: list[paired.PairedReport] | None = None,
    duplicates: Sequence[Sequence[Any]] = (),
) -> str:
    n_bad = int((~df["ok"]).sum())
    parts = [
        "# snapkv-bench report",
        "",
        f"Results: `{results_dir}` — {len(df)} rows, {int(df['ok'].sum())} ok, {n_bad} not ok "
        "(error/oom rows are counted but excluded from score means).",
    ]
    if duplicates:
        parts += ["", duplicates_note(duplicates)]
    sections: dict[str, list[str]] = {TaskReport.section: []}  # the generic "Scores" first
    for task, part in df.groupby("task", sort=True):
        report = task_report(task)
        sections.setdefault(report.section, []).extend(report.tables(part) + seed_tables(part))
    for heading, tables in sections.items():
        if tables:
            parts += ["", f"## {heading}", ""] + ["\n\n".join(tables)]
    parts += paired.section(paired_reports(df) if pairs is None else pairs)
    parts += protocol_report.sections(df)
    parts += [
        "",
        "## Cost",
        "",
        "Means over ok samples, except prefill s / ttft s / tpot ms: medians, with beside them the median "
        "number of cores other processes kept busy while those samples ran (other cores; n/a: rows from "
        "before it was recorded). kv % = kv_bytes / kv_bytes_full.",
        "",
        cost_table(df),
        "",
        load_note(df),
        "",
    ]
    versions, differ = code_versions(df)
    parts += ["## Code versions", ""]
    if differ:
        parts += ["**Warning: these rows come from more than one version of the code.**", ""]
    parts += [versions, ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------- plots
def write_plots(df: pd.DataFrame, out: Path, trained_context: int | None = None) -> list[Path]:
    """Each task's plots (`TaskReport.plots`, ok rows) and score-vs-budget per task run at >1 budget."""
    from eval.plots import score_vs_budget  # lazy: matplotlib; the runner imports this module

    written: list[Path] = []
    ok = df[df["ok"]]
    options = ReportOptions(out=out, trained_context=trained_context)
    for task, part in ok.groupby("task", sort=True):
        written += task_report(task).plots(part, options)
    written += protocol_report.plots(ok, out)

    for task, g in ok.groupby("task", sort=True):
        if g["budget"].dropna().nunique() < 2:
            continue
        several_models = g["model"].nunique() > 1
        line = [
            method_label(m, {k: v for k, v in (p or {}).items() if k not in BUDGET_KEYS})
            + protocols.label_suffix(pr)
            for m, p, pr in zip(g["method"], g["method_params"], g["protocol"])
        ]
        g = g.assign(line=[f"{mo}: {li}" if several_models else li for mo, li in zip(g["model"], line)])
        model = "" if several_models else f" ({g['model'].iloc[0]})"
        for i, (value, name) in enumerate(task_report(task).budget_values.items()):
            if value not in g or g[value].isna().all():
                continue
            # Macro average: mean per dataset first, then over datasets.
            per_ds = (
                g.groupby(["line", "budget", "dataset"], dropna=False)[value].mean().mul(100).rename("score")
            ).reset_index()
            suffix = "" if i == 0 else f"_{slug(value)}"
            written.append(
                score_vs_budget(
                    per_ds,
                    out / f"score_vs_budget_{slug(task)}{suffix}.png",
                    title=f"{task}: {name} vs KV budget{model}",
                    line="line",
                    ylabel=f"{name} x100",
                )
            )
    return written


FIGURES_HEADING = "## Figures"
_FIGURE_LINE = re.compile(r"^- \[([^\]/\\]+\.png)\]\(<\1>\)$", re.M)


def listed_figures(report_md: Path) -> list[str]:
    """The figure file names (in report_md's folder) that report.md lists under FIGURES_HEADING."""
    if not report_md.is_file():
        return []
    _, found, tail = report_md.read_text(encoding="utf-8").partition(f"\n{FIGURES_HEADING}\n")
    return _FIGURE_LINE.findall(tail) if found else []


def figures_section(names: list[str]) -> str:
    """report.md's last section: one link per figure drawn next to it."""
    lines = "\n".join(f"- [{n}](<{n}>)" for n in sorted(names))
    return f"{FIGURES_HEADING}\n\nDrawn from these rows, next to this file:\n\n{lines}\n"


def _replace_figures(out: Path, before: list[str], written: list[Path]) -> list[str]:
    """Delete the figures listed `before` that were not drawn again; the names now in `out`."""
    now = [p.name for p in written if p.parent.resolve() == out.resolve()]
    for name in sorted(set(before) - set(now)):
        (out / name).unlink(missing_ok=True)
        logger.info("deleted %s: the report no longer draws it", out / name)
    return now


# ----------------------------------------------------------------------------------------- library
class NothingToReport(ValueError):
    """The results dir does not exist, holds no result rows, or a results file is malformed."""


@dataclass
class Report:
    markdown: str
    report_md: Path
    summary_csv: Path
    plots: list[Path] = field(default_factory=list)
    paired_csv: Path | None = None
    flips_csv: Path | None = None


def build_report(
    results_dir: str | Path,
    out: str | Path | None = None,
    trained_context: int | None = None,
    plots: bool = True,
) -> Report:
    """Write summary.csv, report.md and the plots of `results_dir` into `out` (default: results_dir).

    `trained_context`: the needle heatmaps' dashed line (default: each row's own value).
    NothingToReport (a ValueError) when there is nothing to report.
    """
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        raise NothingToReport(f"results dir not found: {results_dir}")
    try:
        raw = ResultStore.load_dir(results_dir)
    except ValueError as e:
        raise NothingToReport(str(e)) from None
    if raw.empty:
        raise NothingToReport(f"no result rows (*.jsonl) found under {results_dir}")
    out = Path(out) if out is not None else results_dir
    out.mkdir(parents=True, exist_ok=True)
    duplicates = raw.attrs.get("duplicates", ())
    if duplicates:
        logger.warning("warning: %s", duplicates_note(duplicates))
    df = prepare(raw)
    summarize(df).to_csv(out / "summary.csv", index=False)
    pairs = paired_reports(df)
    rows = [p.rows for p in pairs if not p.rows.empty]
    (pd.concat(rows) if rows else pd.DataFrame(columns=paired.PAIRED_COLUMNS)).to_csv(
        out / "paired.csv", index=False
    )
    flipped = [p.flips for p in pairs if not p.flips.empty]
    (pd.concat(flipped) if flipped else pd.DataFrame(columns=paired.FLIP_COLUMNS)).to_csv(
        out / "flips.csv", index=False
    )
    before = listed_figures(out / "report.md")
    if plots:
        written = write_plots(df, out, trained_context=trained_context)
        names = _replace_figures(out, before, written)
    else:  # figures left as they are: keep listing those still there
        written, names = [], [n for n in before if (out / n).is_file()]
    markdown = build_markdown(df, results_dir, pairs, duplicates)
    if names:
        markdown = f"{markdown.rstrip()}\n\n{figures_section(names)}"
    (out / "report.md").write_text(markdown, encoding="utf-8")
    return Report(
        markdown, out / "report.md", out / "summary.csv", written, out / "paired.csv", out / "flips.csv"
    )


def write_report(results_dir: str | Path, **kwargs: Any) -> Report | None:
    """`build_report` for the runner: logs where the report is (or why there is none); never raises
    for a missing or empty results dir."""
    try:
        report = build_report(results_dir, **kwargs)
    except NothingToReport as e:
        logger.warning("no report: %s", e)
        return None
    logger.info("%s", report.markdown)
    logger.info("report: %s  table: %s", report.report_md, report.summary_csv)
    if report.plots:
        logger.info(
            "plots in %s: %s", report.report_md.parent, ", ".join(sorted(p.name for p in report.plots))
        )
    return report


# ----------------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])  # prog: the command or script run
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: RESULTS_DIR)")
    ap.add_argument(
        "--trained-context",
        type=int,
        default=None,
        help="dashed line on needle heatmaps (default: the rows')",
    )
    ap.add_argument("--no-plots", action="store_true")
    args = ap.parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(message)s", stream=sys.stderr)
    try:
        report = build_report(args.results_dir, args.out, args.trained_context, plots=not args.no_plots)
    except NothingToReport as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(report.markdown)
    return 0
