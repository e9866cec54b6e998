"""Paired comparisons of method configs on the samples both ran: the report's "Paired comparisons"
section, `paired.csv` and `flips.csv`.

Every compressed config of a (task, model) is compared with two baselines where they exist: the
full cache (`method == "full"`; the same protocol where there is one) and SnapKV at the same budget
and protocol (where several SnapKV configs share that budget: the one whose parameters differ least
from SnapKV's defaults). Only ok rows count, and only samples both configs ran
(`eval.store.shared_samples`): matched by content (`prompt_sha`, `target_sha`) when every row of
both carries the hashes, else by (task, dataset, sample_id) (rows written before the hashes existed). A row per dataset, and where
the pair shares more than one dataset a row `all` over every shared sample.

Every number comes from `eval.stats.compare`. The resampling unit is the unit of independence
(`units`): the context where several questions share one (`context_id`), the problem where it was
sampled several times (`prompt_id`), the sample otherwise. A row (`PAIRED_COLUMNS`): `n_shared`
(pairs), `n_units`, `diff` = config minus baseline x100 (the mean over strata of the per-stratum
mean differences: the task's `paired_strata`, e.g. context length, LongBench dataset, RULER task and
length, as the tables' averages weigh them), its 95% interval `lo` / `hi` (percentiles of
`RESAMPLES` bootstrap resamples of whole units within each stratum, seed `SEED`: the report rebuilds
byte-identical; never conditional on the discordant pairs), the two-sided `p`, `p_exact` (the
exact sign-flip p over units, below `FEW_UNITS` units: with few units the percentile interval is
too narrow, read this p), `p_holm` (Holm's step-down adjustment of `p_exact`, else `p`, over the
rows of one (task, model) table: the family) and `test`, what `p` is:

- `mcnemar`: every score of both sides is 0 or 1 and each unit holds one pair: the exact McNemar
  test, a two-sided binomial test of the discordant pairs (`fixed` among `broke + fixed`, p = 1/2;
  p = 1 with none).
- `bootstrap`: any other score, or several pairs per unit (McNemar assumes independent pairs):
  2 x the smaller fraction of resamples on either side of 0 (+1 / RESAMPLES + 1), capped at 1.

Below `MIN_N` units the interval and p are withheld (the report prints "n<5"). Where the report's
protocol section covers a task and model (several questions per context, or several protocols), a
config minus the full cache under the same protocol is its "Compression loss per protocol" table,
and is not repeated here.
`kv_bytes` / `baseline_kv_bytes`: mean realised KV bytes (the rows' `kv_bytes`) over the shared
samples; `bytes_differ` where they differ by more than `BYTES_TOLERANCE` between two compressed
configs (against the full cache they differ by design): the pair is then not budget-matched.

Flips (`flips`): per config against the full cache, the shared samples compression broke (the full
cache right, the config wrong) and those it fixed, "right" meaning score >= `CORRECT_AT`, with the
task's `flip_columns` (needle: length and depth; LongBench: dataset; RULER: task and length). A task
whose score is no right-or-wrong grade (`flip_columns` None: fidelity's top-1 agreement) has none.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

import eval.report.protocols as protocol_report
from eval.stats import FEW_UNITS, MIN_N, RESAMPLES, compare, holm
from eval.store import shared_samples
from eval.tables import cell, column_order, md_table

BYTES_TOLERANCE = 0.01
CORRECT_AT = 0.5
FLIPS_LISTED = 6  # samples named per config and direction in report.md (all of them in flips.csv)
ALL = "all"

PAIRED_COLUMNS = [
    "task",
    "dataset",
    "model",
    "config",
    "baseline",
    "n_shared",
    "n_units",
    "diff",
    "lo",
    "hi",
    "p",
    "p_exact",
    "p_holm",
    "test",
    "matched_by",
    "kv_bytes",
    "baseline_kv_bytes",
    "bytes_differ",
]
FLIP_COLUMNS = [
    "task",
    "model",
    "config",
    "baseline",
    "change",
    "dataset",
    "sample_id",
    "baseline_score",
    "score",
]


# ------------------------------------------------------------------------------------------ baselines
def _is_full(part: pd.DataFrame, label: str) -> bool:
    return str(part.loc[part["config_label"] == label, "method"].iloc[0]) == "full"


def _protocol(part: pd.DataFrame, label: str) -> str:
    return str(part.loc[part["config_label"] == label, "protocol"].iloc[0])


def _params(part: pd.DataFrame, label: str) -> dict:
    p = part.loc[part["config_label"] == label, "method_params"].iloc[0]
    return p if isinstance(p, dict) else {}


def _snapkv_defaults() -> dict:
    from snapkv import METHODS

    cls = METHODS["snapkv"]
    return {name: f.default for name, f in cls.__dataclass_fields__.items() if f.init}


def baselines(part: pd.DataFrame) -> list[tuple[str, str]]:
    """(config, baseline) label pairs of one (task, model)'s prepared rows: every config that is not
    the full cache against the full cache, and every config against SnapKV at its budget (module
    doc), in `column_order`."""
    labels = column_order(part)
    method = part.drop_duplicates("config_label").set_index("config_label")["method"]
    budget = part.drop_duplicates("config_label").set_index("config_label")["budget"]
    full = [c for c in labels if method[c] == "full"]
    snap = [c for c in labels if method[c] == "snapkv"]
    defaults = _snapkv_defaults()

    def distance(label: str) -> int:
        params = _params(part, label)
        return sum(params.get(k) != v for k, v in defaults.items() if k != "budget" and k in params)

    pairs = []
    for label in labels:
        if method[label] == "full":
            continue
        if full:
            same = [c for c in full if _protocol(part, c) == _protocol(part, label)]
            pairs.append((label, (same or full)[0]))
        at = [c for c in snap if budget[c] == budget[label] and _protocol(part, c) == _protocol(part, label)]
        if at:
            base = min(at, key=lambda c: (distance(c), at.index(c)))
            if base != label:
                pairs.append((label, base))
    return pairs


# -------------------------------------------------------------------------------------------- tables
def units(rows: pd.DataFrame) -> pd.Series:
    """Each row's unit of independence: its `context_id` (questions sharing a context), else its
    `prompt_id` (samples of one problem), else its index (the sample itself)."""
    unit = pd.Series(rows.index.astype(str), index=rows.index, dtype=object)
    for col in ("prompt_id", "context_id"):  # the later one wins where both are set
        if col in rows.columns:
            unit = rows[col].map(lambda v, c=col: f"{c}:{v}").where(rows[col].notna(), unit)
    return unit


def paired_rows(part: pd.DataFrame, strata: Sequence[str] = ("dataset",)) -> pd.DataFrame:
    """`PAIRED_COLUMNS` rows of one (task, model)'s prepared rows (`eval.report.prepare`), with
    Holm's adjustment over them. `strata`: the task's `paired_strata` (row columns)."""
    ok = part[part["ok"] & part["score"].notna()]
    task, model = str(part["task"].iloc[0]), str(part["model"].iloc[0])
    covered = protocol_report.applies(part)  # its compression-loss table holds config - full
    records = []
    for label, base in baselines(part):
        if covered and _is_full(part, base) and _protocol(part, base) == _protocol(part, label):
            continue
        a, b, matched = shared_samples(ok[ok["config_label"] == label], ok[ok["config_label"] == base])
        if a.empty:
            continue
        compressed_base = str(b["method"].iloc[0]) != "full"
        groups = [
            (str(ds), a.index[b["dataset"].astype(str) == ds])
            for ds in sorted(b["dataset"].astype(str).unique())
        ]
        if len(groups) > 1:
            groups.append((ALL, a.index))
        for dataset, keys in groups:
            ca, cb = a.loc[keys], b.loc[keys]
            cols = [c for c in strata if c in cb.columns and (dataset == ALL or c != "dataset")]
            labels = cb[cols].astype(str).agg("/".join, axis=1) if cols else None
            c = compare(
                ca["score"].to_numpy(float), cb["score"].to_numpy(float), units(cb).to_numpy(), labels
            )
            kv_a, kv_b = ca["kv_bytes"].mean(), cb["kv_bytes"].mean()
            differ = bool(compressed_base and kv_b > 0 and abs(kv_a / kv_b - 1) > BYTES_TOLERANCE)
            records.append(
                [task, dataset, model, label, base, c.n, c.n_units, c.diff, c.lo, c.hi, c.p, c.p_exact, math.nan,
                 c.test, matched,
                 kv_a, kv_b, differ]
            )  # fmt: skip
    out = pd.DataFrame(records, columns=PAIRED_COLUMNS)
    read = out["p_exact"].where(out["p_exact"].notna(), out["p"])  # the p a statement rests on
    out["p_holm"] = holm(read.to_numpy(float)) if len(out) else []
    return out


def flips(part: pd.DataFrame, columns: Sequence[str] = ("dataset",)) -> pd.DataFrame:
    """`FLIP_COLUMNS` + the task's `columns` (its `flip_columns`): per config against the full
    cache, the shared samples it broke (`change` "broke": full right, config wrong) or fixed."""
    ok = part[part["ok"] & part["score"].notna()]
    extra = [c for c in columns if c in part.columns and c != "dataset"]
    records = []
    for label, base in baselines(part):
        if str(ok.loc[ok["config_label"] == base, "method"].iloc[0]) != "full":
            continue
        a, b, _ = shared_samples(ok[ok["config_label"] == label], ok[ok["config_label"] == base])
        right_a, right_b = a["score"] >= CORRECT_AT, b["score"] >= CORRECT_AT
        for change, mask in (("broke", right_b & ~right_a), ("fixed", right_a & ~right_b)):
            for (_, ra), (_, rb) in zip(a[mask.to_numpy()].iterrows(), b[mask.to_numpy()].iterrows()):
                records.append(
                    [rb["task"], rb["model"], label, base, change, rb["dataset"], rb["sample_id"], rb["score"],
                     ra["score"]] + [rb[c] for c in extra]
                )  # fmt: skip
    return pd.DataFrame(records, columns=FLIP_COLUMNS + extra)


# ---------------------------------------------------------------------------------------- markdown
def interval_cell(row: pd.Series) -> str:
    """`[lo, hi]`, or `n<MIN_N` where the interval is withheld."""
    if row["n_units"] < MIN_N:
        return f"n<{MIN_N}"
    return f"[{row['lo']:+.1f}, {row['hi']:+.1f}]"


def _p_cell(p: float) -> str:
    if isinstance(p, float) and math.isnan(p):
        return "—"
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _difference_cell(row: pd.Series) -> str:
    n, u = int(row["n_shared"]), int(row["n_units"])
    return f"{row['diff']:+.1f} (n={n})" if n == u else f"{row['diff']:+.1f} (n={n}, {u} units)"


def paired_table(rows: pd.DataFrame) -> str:
    """The markdown table of one (task, model)'s `paired_rows`."""
    table = []
    for _, r in rows.iterrows():
        table.append(
            [
                r["dataset"],
                r["config"],
                r["baseline"],
                _difference_cell(r),
                interval_cell(r),
                _p_cell(r["p"]),
                _p_cell(r["p_exact"]),
                _p_cell(r["p_holm"]),
                r["test"],
                f"{cell(r['kv_bytes'] / 2**20, 2)} / {cell(r['baseline_kv_bytes'] / 2**20, 2)}",
                "bytes differ" if r["bytes_differ"] else "",
            ]
        )
    headers = ["dataset", "method", "minus", "difference x100 (n)", "95% interval", "p", "p exact", "p Holm", "test",
               "KV MiB (method / minus)", "budget check"]  # fmt: skip
    return md_table(headers, table, text_columns=3)


def _describe(row: pd.Series, columns: Sequence[str]) -> str:
    def text(v) -> str:
        if isinstance(v, float) and v.is_integer():
            return str(int(v))
        return str(v)

    return "/".join(text(row[c]) for c in columns) if columns else str(row["sample_id"])


def flip_table(rows: pd.DataFrame, configs: Sequence[str], columns: Sequence[str]) -> str:
    """The markdown flip table of one (task, model)'s `flips`: per config of `configs` (those
    compared with the full cache), the counts broke / fixed and the first `FLIPS_LISTED` samples of
    each, described by `columns`."""
    table = []
    for label in configs:
        g = rows[rows["config"] == label]
        row: list = [label]
        for change in ("broke", "fixed"):
            sub = g[g["change"] == change]
            named = ", ".join(_describe(r, columns) for _, r in sub.head(FLIPS_LISTED).iterrows())
            more = f" (+{len(sub) - FLIPS_LISTED} more)" if len(sub) > FLIPS_LISTED else ""
            row += [len(sub), named + more]
        table.append(row)
    what = " / ".join(columns) if columns else "sample id"
    return md_table(["method", "broke", f"broke ({what})", "fixed", f"fixed ({what})"], table)


INTRO = (
    "Each compressed config minus the full cache, and minus SnapKV at the same budget, on the samples "
    "both ran (ok rows only; matched by the rows' prompt and answer hashes, or by task, dataset and "
    "sample id for rows written before the hashes existed: the `matched_by` column of `paired.csv`). "
    "n: shared samples; units: the units of independence where fewer (the contexts whose questions "
    "share them, the problems whose samples share them). 95% interval: percentiles of "
    f"{RESAMPLES} paired bootstrap resamples of whole units within each stratum. p: `mcnemar` the exact "
    "McNemar test (0/1 scores, one pair per unit), `bootstrap` the bootstrap's. p exact: the exact "
    f"sign-flip p over units, below {FEW_UNITS} units (with few units the percentile interval is too "
    f"narrow: read this p). Below {MIN_N} units the interval and p are withheld (n<{MIN_N}). p Holm: "
    "p exact, else p, adjusted over the rows of the table. Where the Protocols section covers a task "
    "and model, a config minus the full cache under the same protocol is in its compression-loss "
    'table, not here. budget check: "bytes differ" where the two compressed configs\' mean '
    f"realised KV bytes on these samples differ by more than {BYTES_TOLERANCE:.0%} (not budget-matched). "
    "Every row is in `paired.csv`; every flipped sample in `flips.csv`."
)
FLIPS_INTRO = (
    f"Per config against the full cache: shared samples it broke (full cache right, config wrong; right "
    f"= score >= {CORRECT_AT}) and fixed."
)


@dataclass
class PairedReport:
    """One (task, model)'s paired rows, flips and markdown (`markdown`: [] without any pair)."""

    rows: pd.DataFrame
    flips: pd.DataFrame
    markdown: list[str]


def task_model_report(
    part: pd.DataFrame,
    strata: Sequence[str] = ("dataset",),
    flip_columns: Sequence[str] | None = ("dataset",),
) -> PairedReport:
    """`paired_rows`, `flips` and the markdown tables of one (task, model)'s prepared rows.
    `flip_columns` None: the task's score is no right-or-wrong grade, so nothing flips (no flip
    table, no flipped samples)."""
    rows = paired_rows(part, strata)
    flipped = pd.DataFrame(columns=FLIP_COLUMNS) if flip_columns is None else flips(part, flip_columns)
    if rows.empty:
        return PairedReport(rows, flipped, [])
    task, model = str(part["task"].iloc[0]), str(part["model"].iloc[0])
    md = [f"### {task} — {model}: paired differences", "", paired_table(rows), ""]
    method = part.drop_duplicates("config_label").set_index("config_label")["method"]
    vs_full = list(dict.fromkeys(rows.loc[rows["baseline"].map(method) == "full", "config"]))
    if vs_full and flip_columns is not None:
        cols = [c for c in flip_columns if c in part.columns]
        md += [f"### {task} — {model}: flips against the full cache", "", FLIPS_INTRO, "",
               flip_table(flipped, vs_full, cols), ""]  # fmt: skip
    return PairedReport(rows, flipped, md)


def section(reports: Sequence[PairedReport]) -> list[str]:
    """The report's "Paired comparisons" section (empty when no report has a pair)."""
    body = [line for r in reports for line in r.markdown]
    return ["", "## Paired comparisons", "", INTRO, "", *body] if body else []
