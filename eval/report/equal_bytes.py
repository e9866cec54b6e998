"""Eviction against quantization at equal bytes: the report of a results folder whose configs store
fewer KV bytes in different ways (`python -m eval.report.equal_bytes RESULTS_DIR [--out DIR]
[--tolerance 0.1]`; `scripts/make_figures.py` renders `results/equal_bytes/` when it holds rows).

A configuration is a method config (its label, `eval.labels.method_label`) on a KV storage: the
rows' `kv_quant` ({kind, bits, group_size, residual, order}, absent or None for the plain cache).
Its kind:

- `full`: the full cache in the model's dtype (the reference);
- `quantized`: the full cache, quantized (every entry kept, fewer bits each);
- `eviction`: a compression method in the model's dtype (fewer entries, every bit);
- `combined`: a compression method on quantized storage (fewer entries, fewer bits).

Bytes are what a user pays for the cache: the rows' `kv_bytes` (the K/V storage held: packed codes,
scales and zero points, the full-precision residual; `snapkv.kv_quant`) plus `kv_index_bytes` (the
kept-index bookkeeping of the compressed layers, their int64 positions; rows written before it
was recorded count none), in the report's `kv_bytes` column (`paid_bytes`), against
`kv_bytes_full` (the full cache at the same dtype, no bookkeeping): a configuration's byte fraction
is Σ kv_bytes / Σ kv_bytes_full over its samples.

What it writes (`render`), per model:

- `equal_bytes_<model>.png`: score x100 against mean KV MiB (log axis), every configuration, on
  the samples it shares with the full cache; the full cache a star with a dashed line at its score,
  dotted verticals at the `FRACTIONS` of its bytes; a line joins one method on one kind of storage
  across budgets and bit widths.
- `equal_bytes.md` and CSVs: `equal_bytes_pairs.csv`, every two configurations of different kinds
  whose mean bytes on their shared samples are within `TOLERANCE` of each other (|a / b - 1| <=
  tolerance), the first minus the second (kinds in `KINDS` order: quantized before combined before
  eviction); `equal_bytes_costs.csv`, every configuration whose byte fraction lies within
  `WINDOW` of one of `FRACTIONS` (relative: 1/4 takes 0.1875-0.3125) minus the full cache; and
  `equal_bytes_configs.csv`, each configuration's score, n and bytes.

Every difference comes from `eval.stats.compare` on the samples both sides ran (matched as the
report's paired comparisons match them, `eval.report.paired`): x100, the paired unit bootstrap's
95% interval resampling the units of independence (a context's questions together) within strata
(task / dataset, weighed equally), the exact sign-flip p below `FEW_UNITS` units, and Holm's
adjustment over each table of one model (its family). Below `MIN_N` units the interval and p are
withheld.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from eval import protocols
from eval.labels import BUDGET_KEYS, method_label
from eval.report import leaderboard
from eval.report.build import prepare
from eval.report.paired import units
from eval.report.wording import MARGIN, Line, diff_text, grouped, n_units_text, p_text, provenance
from eval.spec import RunSpec
from eval.stats import FEW_UNITS, MIN_N, RESAMPLES, Comparison, Equivalence, compare, holm, tost, units_of
from eval.store import ResultStore, shared_samples
from eval.tables import cell, md_table, slug

ROOT = Path(__file__).resolve().parents[2]
GRID = ROOT / "conf" / "experiment" / "equal_bytes.yaml"
TOLERANCE = 0.10
# How near a target fraction a configuration's realised bytes must lie to answer "what does 1/4 cost":
# wider than the pairs' tolerance because quantized storage lands where its bits, scales and residual
# put it, not on a target (KIVI-4 of a float32 cache, groups of 32: 1/8 in codes + 1/16 in scales and
# zero points + the residual); each row shows its own fraction.
WINDOW = 0.25
FRACTIONS = (1 / 4, 1 / 8)
KINDS = ("full", "quantized", "combined", "eviction")
FOLDER = "equal_bytes"  # the results folder scripts/make_figures.py renders
SPEED = "bench/kv_quant_8k"  # the speed bench's run on quantized storage, linked from the page
MARKDOWN = "equal_bytes.md"
QUANT_FIELDS = ("kind", "bits", "group_size", "residual", "order")

CONFIG_COLUMNS = ["model", "config", "kind", "series", "method", "budget", "kv_quant", "n", "n_units", "score",
                  "kv_bytes", "kv_bytes_full", "fraction", "vs_full", "rows_from"]  # fmt: skip
PAIR_COLUMNS = ["model", "config", "kind", "minus", "minus_kind", "n_shared", "n_units", "kv_bytes",
                "minus_kv_bytes", "bytes_ratio", "diff", "lo", "hi", "p", "p_exact", "p_holm", "test"]  # fmt: skip
COST_COLUMNS = ["model", "target", "config", "kind", "fraction", "n_shared", "n_units", "score", "full_score",
                "diff", "lo", "hi", "p", "p_exact", "p_holm", "test"]  # fmt: skip


# ------------------------------------------------------------------------------------------- the grid
@dataclass(frozen=True)
class Run:
    """One `run.py` config of the grid (conf/experiment/equal_bytes.yaml): `overrides` in full."""

    task: str
    method: str
    budget: int | None
    storage: str | None
    overrides: tuple[str, ...]
    reuse: str | None = None  # a results folder beside the grid's whose rows of this config count

    @property
    def name(self) -> str:
        at = "" if self.budget is None else f"@{self.budget}"
        return f"{self.task}/{self.method}{at}" + ("" if self.storage is None else f"+{self.storage}")


def load_plan(path: Path = GRID) -> list[Run]:
    """Every config of the grid file's `equal_bytes` node: per task, per entry of `runs`, its methods
    x budgets x storages (`methods: leaderboard`: every registered method but the full cache)."""
    node = OmegaConf.to_container(OmegaConf.load(path), resolve=True).get("equal_bytes") or {}
    tasks, storage = node.get("tasks") or {}, node.get("storage") or {}
    if not tasks or not node.get("runs"):
        raise ValueError(f"{path} must list equal_bytes.tasks and equal_bytes.runs")
    reuse = node.get("reuse") or {}
    stray = [t for t in reuse if t not in tasks]
    if stray:
        raise ValueError(f"reuse names unknown task {stray[0]!r} in {path}; known: {', '.join(tasks)}")
    plan = []
    for task, task_overrides in tasks.items():
        for entry in node["runs"]:
            names = entry.get("methods")
            names = (
                [m for m in leaderboard.methods() if m != leaderboard.BASELINE]
                if names == "leaderboard"
                else names
            )
            unknown = [s for s in entry.get("storage") or [] if s not in storage]
            if unknown:
                raise ValueError(f"unknown storage {unknown[0]!r} in {path}; known: {', '.join(storage)}")
            for method in names:
                for budget in entry.get("budgets") or [None]:
                    for store in entry.get("storage") or [None]:
                        overrides = [*node.get("common", []), *task_overrides, f"method={method}"]
                        overrides += [] if budget is None else [f"budget={budget}"]
                        overrides += [] if store is None else storage[store]
                        plan.append(Run(task, method, budget, store, tuple(overrides), reuse.get(task)))
    return plan


def keys(runs: Sequence[Run], conf_dir: Path = ROOT / "conf") -> dict[Run, tuple[str, str, str]]:
    """{run: (model key, task name, method hash)}: what names a run's rows, composed as `run.py`
    composes its overrides."""
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        specs = {r: RunSpec.from_config(compose("config", overrides=list(r.overrides))) for r in runs}
    return {r: (s.model.key, s.task.name, s.method_hash) for r, s in specs.items()}


def counts_what_the_grid_counts(rows: pd.DataFrame) -> bool:
    """Whether a config's rows count the bytes the grid's own rows count: every row records
    `kv_index_bytes` (rows written before the field existed count none), or the config is the plain
    full cache, which keeps no index (its rows' none is exact)."""
    if len(rows) == 0:
        return False
    if "kv_index_bytes" in rows.columns and bool(rows["kv_index_bytes"].notna().all()):
        return True
    quants = rows["kv_quant"].map(quant_of) if "kv_quant" in rows.columns else pd.Series([None] * len(rows))
    return bool(rows["method"].eq("full").all() and quants.isna().all())


def reused(plan: Sequence[Run], folder: Path, own: pd.DataFrame | None = None) -> dict[Run, pd.DataFrame]:
    """{run: rows} of the grid's configs that a task's `reuse` folder (beside `folder`, the grid's
    results folder) already holds: the same config (model, task, hash) whose rows
    `counts_what_the_grid_counts`. The leaderboard's RULER cell is one of the grid's configs, so it is read, not
    run again. A config that `folder` itself holds rows of is not reused (its own rows count);
    `own`: those rows where the caller has loaded them already."""
    root = folder.parent
    runs = [r for r in plan if r.reuse and (root / r.reuse).is_dir()]
    if not runs:
        return {}
    named = keys(runs)
    if own is None:
        own = ResultStore.load_dir(folder) if folder.is_dir() else pd.DataFrame()
    held = set() if own.empty else set(zip(own["model"], own["task"], own["method_hash"].astype(str)))
    out, folders = {}, {}
    for r in runs:
        if named[r] in held:
            continue
        if r.reuse not in folders:
            folders[r.reuse] = ResultStore.load_dir(root / r.reuse)
        rows = folders[r.reuse]
        if rows.empty:
            continue
        model, task, method_hash = named[r]
        mine = rows[
            rows["model"].eq(model) & rows["task"].eq(task) & rows["method_hash"].astype(str).eq(method_hash)
        ]
        if counts_what_the_grid_counts(mine):
            out[r] = mine
    return out


def load_rows(folder: Path, plan: Sequence[Run] = ()) -> pd.DataFrame:
    """The rows the equal-bytes report reads: `folder`'s, plus those of the plan's configs that
    `reused` takes from a task's `reuse` folder beside it, named in `rows_from` (no plan: the folder
    alone)."""
    own = ResultStore.load_dir(folder) if folder.is_dir() else pd.DataFrame()
    taken = [rows.assign(rows_from=r.reuse) for r, rows in reused(plan, folder, own).items()]
    return pd.concat([own, *taken], ignore_index=True) if taken else own


# ----------------------------------------------------------------------------------- configurations
def quant_of(value: Any) -> dict | None:
    """A row's `kv_quant` as a dict, None for the plain cache (absent, None, NaN or kind none)."""
    if isinstance(value, dict) and value.get("kind") not in (None, "none"):
        return value
    return None


def kind_of(method: str, quant: dict | None) -> str:
    """`full`, `quantized`, `eviction` or `combined` (module doc)."""
    if method == "full":
        return "full" if quant is None else "quantized"
    return "eviction" if quant is None else "combined"


def quant_texts(quants: Sequence[dict | None], bits: bool = True) -> dict[str, str]:
    """{repr(q): text} of the storages in `quants`: `kivi-4`, plus `field=value` for every other field
    that differs between them (so two storages never share a text); '' for the plain cache.
    bits=False: without the bits (`kivi`), the figure's line through one storage's bit widths."""
    present = [q for q in quants if q is not None]
    keys = sorted({k for q in present for k in q} - {"kind", "bits"})
    varying = [k for k in keys if len({repr(q.get(k)) for q in present}) > 1]
    texts = {repr(None): ""}
    for q in present:
        head = f"{q['kind']}-{q.get('bits')}" if bits else str(q["kind"])
        texts[repr(q)] = " ".join([head, *(f"{k}={q.get(k)}" for k in varying)])
    return texts


def paid_bytes(df: pd.DataFrame) -> pd.Series:
    """Bytes a row's cache costs: `kv_bytes` (the K/V storage) + `kv_index_bytes` (the kept-index
    bookkeeping; 0 where a row predates it or measured none)."""
    index = df["kv_index_bytes"] if "kv_index_bytes" in df.columns else pd.Series(0, index=df.index)
    return df["kv_bytes"] + pd.to_numeric(index, errors="coerce").fillna(0)


def label_rows(df: pd.DataFrame) -> pd.DataFrame:
    """`prepare`d rows with `quant` (dict or None), `kind`, `config` (the method config's label + its
    storage) and `series` (the same without the budget and the bits: one line of the figure). A config label
    that several config hashes share within one (model, task) gets `#hash8` appended. `kv_bytes`
    becomes the bytes paid (`paid_bytes`; the storage alone stays in `kv_storage_bytes`)."""
    none = pd.Series([None] * len(df), index=df.index, dtype=object)
    quants = df["kv_quant"].map(quant_of).astype(object) if "kv_quant" in df.columns else none
    texts, kinds = quant_texts(list(quants)), quant_texts(list(quants), bits=False)
    storage = quants.map(lambda q: texts[repr(q)])
    line = quants.map(lambda q: f" + {kinds[repr(q)]}" if q is not None else "")
    params = df["method_params"].map(lambda p: p if isinstance(p, dict) else {})
    suffix = df["protocol"].map(protocols.label_suffix)
    base = [method_label(m, p) for m, p in zip(df["method"], params)]
    bare = [
        method_label(m, {k: v for k, v in p.items() if k not in BUDGET_KEYS})
        for m, p in zip(df["method"], params)
    ]
    plus = storage.map(lambda s: f" + {s}" if s else "")
    out = df.assign(
        kv_storage_bytes=df["kv_bytes"],
        kv_bytes=paid_bytes(df),
        quant=quants.astype(object),
        kind=[kind_of(m, q) for m, q in zip(df["method"], quants)],
        config=[b + s + p for b, s, p in zip(base, suffix, plus)],
        series=[b + s + p for b, s, p in zip(bare, suffix, line)],
    )
    hashes = out["method_hash"].astype(str)
    for _, idx in out.groupby(["model", "task", "config"], sort=False).groups.items():
        if hashes.loc[idx].nunique() > 1:
            out.loc[idx, "config"] = out.loc[idx, "config"] + " #" + hashes.loc[idx].str[:8]
    return out


def _strata(rows: pd.DataFrame) -> np.ndarray | None:
    """task/dataset per row where the rows hold more than one (weighed equally), else None."""
    labels = rows["task"].astype(str) + "/" + rows["dataset"].astype(str)
    return labels.to_numpy() if labels.nunique() > 1 else None


def _score(rows: pd.DataFrame) -> tuple[float, int]:
    """(mean score x100 over strata, units) of aligned rows."""
    u = units_of(rows["score"].to_numpy(float), units(rows).to_numpy(), _strata(rows))
    return 100 * u.estimate(), u.n_units


def _compare(a: pd.DataFrame, b: pd.DataFrame):
    return compare(a["score"].to_numpy(float), b["score"].to_numpy(float), units(b).to_numpy(), _strata(b))


@dataclass
class Analysis:
    """One model's tables (`CONFIG_COLUMNS`, `PAIR_COLUMNS`, `COST_COLUMNS` frames)."""

    model: str
    configs: pd.DataFrame
    pairs: pd.DataFrame
    costs: pd.DataFrame
    fractions: tuple[float, ...]
    tolerance: float
    window: float = WINDOW


def full_config(rows: pd.DataFrame) -> str | None:
    """The full cache's config (the one with most rows where several are), None without one."""
    full = rows[rows["kind"] == "full"]
    return str(full["config"].value_counts().index[0]) if len(full) else None


def analyse(
    rows: pd.DataFrame,
    tolerance: float = TOLERANCE,
    fractions: Sequence[float] = FRACTIONS,
    window: float = WINDOW,
) -> Analysis:
    """The tables of one model's `label_rows` (ok, scored rows only): pairs within `tolerance` of
    each other's bytes, costs of configurations within `window` of a target fraction."""
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got tolerance={tolerance}")
    if not window >= 0:
        raise ValueError(f"window must be >= 0, got window={window}")
    bad = [f for f in fractions if not 0 < f <= 1]
    if bad:
        raise ValueError(f"fractions must lie in (0, 1], got fractions={list(fractions)}")
    rows = rows[rows["ok"] & rows["score"].notna()]
    model = str(rows["model"].iloc[0])
    order = sorted(
        rows["config"].unique(),
        key=lambda c: (KINDS.index(rows.loc[rows["config"] == c, "kind"].iloc[0]), -rows.loc[rows["config"] == c, "kv_bytes"].mean(), c),
    )  # fmt: skip
    by = {c: rows[rows["config"] == c] for c in order}
    full = full_config(rows)

    records = []
    for c in order:
        mine, vs_full = by[c], False
        if full is not None and c != full:
            a, _, _ = shared_samples(mine, by[full])
            if not a.empty:
                mine, vs_full = a, True
        elif c == full:
            mine = shared_samples(mine, mine)[0]
        score, n_units = _score(mine)
        first = mine.iloc[0]
        quant = first["quant"]
        records.append(
            [model, c, first["kind"], first["series"], first["method"], first["budget"],
             None if quant is None else {k: quant.get(k) for k in quant}, len(mine), n_units, score,
             mine["kv_bytes"].mean(), mine["kv_bytes_full"].mean(),
             mine["kv_bytes"].sum() / mine["kv_bytes_full"].sum(), vs_full,
             first["rows_from"] if "rows_from" in mine.columns and isinstance(first["rows_from"], str) else ""]
        )  # fmt: skip
    configs = pd.DataFrame(records, columns=CONFIG_COLUMNS)

    pair_records = []
    compressed = [c for c in order if c != full and by[c]["kind"].iloc[0] != "full"]
    for i, first in enumerate(compressed):
        for second in compressed[i + 1 :]:
            if by[first]["kind"].iloc[0] == by[second]["kind"].iloc[0]:
                continue  # same kind: the leaderboard's comparison, not this one
            a, b, _ = shared_samples(by[first], by[second])
            if a.empty or not b["kv_bytes"].mean() > 0:
                continue
            ratio = a["kv_bytes"].mean() / b["kv_bytes"].mean()
            if abs(ratio - 1) > tolerance:
                continue
            r = _compare(a, b)
            pair_records.append(
                [model, first, a["kind"].iloc[0], second, b["kind"].iloc[0], r.n, r.n_units, a["kv_bytes"].mean(),
                 b["kv_bytes"].mean(), ratio, r.diff, r.lo, r.hi, r.p, r.p_exact, math.nan, r.test]
            )  # fmt: skip
    pairs = _with_holm(pd.DataFrame(pair_records, columns=PAIR_COLUMNS))

    cost_records = []
    if full is not None:
        for target in fractions:
            for c in compressed:
                a, b, _ = shared_samples(by[c], by[full])
                if a.empty or not a["kv_bytes_full"].sum() > 0:
                    continue
                fraction = a["kv_bytes"].sum() / a["kv_bytes_full"].sum()
                if abs(fraction / target - 1) > window:
                    continue
                r = _compare(a, b)
                cost_records.append(
                    [model, target, c, a["kind"].iloc[0], fraction, r.n, r.n_units, _score(a)[0], _score(b)[0],
                     r.diff, r.lo, r.hi, r.p, r.p_exact, math.nan, r.test]
                )  # fmt: skip
    costs = _with_holm(pd.DataFrame(cost_records, columns=COST_COLUMNS))
    return Analysis(model, configs, pairs, costs, tuple(fractions), tolerance, window)


def _with_holm(table: pd.DataFrame) -> pd.DataFrame:
    """`p_holm`: Holm over the table (its family) of the p a statement rests on (exact where there is one)."""
    if len(table):
        read = table["p_exact"].where(table["p_exact"].notna(), table["p"])
        table["p_holm"] = holm(read.to_numpy(float))
    return table


def analyses(
    df: pd.DataFrame,
    tolerance: float = TOLERANCE,
    fractions: Sequence[float] = FRACTIONS,
    window: float = WINDOW,
) -> list[Analysis]:
    """`analyse` per model of raw rows (`ResultStore.load_dir`); [] without ok, scored rows."""
    if df.empty:
        return []
    rows = label_rows(prepare(df))
    rows = rows[rows["ok"] & rows["score"].notna()]
    return [analyse(part, tolerance, fractions, window) for _, part in rows.groupby("model", sort=True)]


# ------------------------------------------------------------------------------------------- figure
MARKERS = {"quantized": "s", "combined": "^", "eviction": "o"}
STYLES = {"quantized": "--", "combined": "-.", "eviction": "-"}


def fraction_text(f: float) -> str:
    """`1/4` for 0.25, else the number."""
    inverse = 1 / f
    return f"1/{round(inverse)}" if abs(inverse - round(inverse)) < 1e-9 else f"{f:.3g}"


def figure(a: Analysis):
    """Score x100 against mean KV MiB (log x axis) of every configuration of `a` (a `Figure`)."""
    from matplotlib.figure import Figure  # lazy: the tables need no plotting

    fig = Figure(figsize=(10, 5.5))
    ax = fig.add_subplot()
    # tab10, then ten darker colours none of tab10's: no two of twenty series share a colour
    palette = [f"C{i}" for i in range(10)] + ["#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#e6550d",
                                              "#31a354", "#756bb1", "#636363", "#3182bd"]  # fmt: skip
    c = a.configs
    lines = list(c[c["kind"] != "full"].groupby("series", sort=False))
    # a line is named by its method (+ storage) where that names it alone, else by its whole label
    short = {series: str(g["method"].iloc[0]) + (series[series.rfind(" + ") :] if " + " in series else "")
             for series, g in lines}  # fmt: skip
    unique = len(set(short.values())) == len(short)
    for i, (series, g) in enumerate(lines):
        g = g.sort_values("kv_bytes")
        kind = str(g["kind"].iloc[0])
        ax.plot(g["kv_bytes"] / 2**20, g["score"], marker=MARKERS[kind], linestyle=STYLES[kind],
                color=palette[i % len(palette)], label=f"{short[series] if unique else series} ({kind})")  # fmt: skip
    for _, r in c[c["kind"] == "full"].iterrows():
        mib = r["kv_bytes"] / 2**20
        ax.axhline(r["score"], color="black", linestyle="--", linewidth=0.8)
        ax.plot([mib], [r["score"]], marker="*", markersize=14, color="black", linestyle="",
                label=f"{r['config']} (full cache)")  # fmt: skip
        for f in a.fractions:
            ax.axvline(mib * f, color="grey", linestyle=":", linewidth=0.8)
            ax.annotate(f"{fraction_text(f)} of full", (mib * f, 1.0), xycoords=("data", "axes fraction"),
                        rotation=90, va="top", ha="right", fontsize=7, color="grey")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("KV cache MiB stored (mean over the samples shared with the full cache; log scale)")
    ax.set_ylabel("score x100")
    ax.set_title(f"Eviction against quantization at equal bytes ({a.model})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.subplots_adjust(left=0.07, right=0.72, bottom=0.1)
    return fig


# ----------------------------------------------------------------------------------------- markdown
def _interval(r: pd.Series) -> str:
    return f"n<{MIN_N}" if r["n_units"] < MIN_N else f"[{r['lo']:+.1f}, {r['hi']:+.1f}]"


def _n(r: pd.Series) -> str:
    n, u = int(r["n_shared"]), int(r["n_units"])
    return f"n={n}" if n == u else f"n={n}, {u} units"


def _difference(r: pd.Series) -> str:
    return f"{r['diff']:+.1f} {_interval(r)} ({_n(r)})"


def sentences(costs: pd.DataFrame) -> list[str]:
    """Per kind and target fraction, what that fraction of the full cache's bytes costs: the one
    configuration's difference from the full cache [95% interval] (n), or the range over several
    (lowest and highest difference)."""
    out = []
    for target in sorted(costs["target"].unique(), reverse=True):
        for kind in KINDS[1:]:
            g = costs[(costs["target"] == target) & (costs["kind"] == kind)].sort_values("diff")
            if g.empty:
                continue
            at = f"{kind} at {fraction_text(target)} of the full cache's bytes"
            lo, hi = g.iloc[0], g.iloc[-1]
            if len(g) == 1:
                out.append(f"{at} ({lo['config']}, {lo['fraction']:.3f}): {_difference(lo)}.")
            else:
                out.append(
                    f"{at}: {len(g)} configurations, from {lo['config']} ({lo['fraction']:.3f}) "
                    f"{_difference(lo)} to {hi['config']} ({hi['fraction']:.3f}) {_difference(hi)}."
                )
    return out


def markdown(items: Sequence[Analysis], figures: dict[str, str] | None = None) -> str:
    """equal_bytes.md: per model the figure, the cost sentences and table, the equal-bytes pairs and
    every configuration."""
    figures = figures or {}
    t = items[0].tolerance if items else TOLERANCE
    parts = [
        "# Eviction against quantization at equal bytes",
        "",
        "Written by `eval/report/equal_bytes.py` from the rows of this folder, and of the grid's configs "
        "that another folder already holds (`equal_bytes.reuse` in conf/experiment/equal_bytes.yaml; "
        "the configurations table names where each config's rows are). Bytes are what the "
        "cache costs: the rows' `kv_bytes` (the storage held: packed codes, scales and zero points, the "
        "full-precision residual) plus `kv_index_bytes` (the kept entries' int64 positions; none in rows "
        "written before it was recorded); a byte fraction is their Σ / Σ kv_bytes_full (the full cache "
        f"in the model's dtype) over the samples. Differences x100 on the samples both sides ran, with "
        f"the 95% interval of {RESAMPLES} paired bootstrap resamples of whole units (a context's "
        "questions together) within strata (task / dataset, weighed equally); p exact: the exact "
        f"sign-flip p over units, below {FEW_UNITS} units (read it there: a percentile interval over few "
        f"units is too narrow); below {MIN_N} units interval and p are withheld (n<{MIN_N}); p Holm: "
        "Holm's adjustment over the rows of one table.",
    ]
    for a in items:
        parts += ["", f"## {a.model}", ""]
        if a.model in figures:
            parts += [f"![score against KV bytes]({figures[a.model]})", ""]
        fr = " and ".join(fraction_text(f) for f in a.fractions)
        parts += [f"### What {fr} of the full cache's bytes cost", ""]
        if a.costs.empty:
            parts += [f"No configuration within ±{a.window:.0%} of {fr} of the full cache's bytes "
                      "with the full cache beside it.", ""]  # fmt: skip
        else:
            parts += [f"Configurations whose byte fraction lies within ±{a.window:.0%} of the target, "
                      "minus the full cache:", ""]  # fmt: skip
            parts += [f"- {s}" for s in sentences(a.costs)] + [""]
            rows = [[fraction_text(r["target"]), r["config"], r["kind"], f"{r['fraction']:.3f}", cell(r["score"], 1),
                     cell(r["full_score"], 1), f"{r['diff']:+.1f} ({_n(r)})", _interval(r), p_text(r["p"]),
                     p_text(r["p_exact"]), p_text(r["p_holm"])] for _, r in a.costs.iterrows()]  # fmt: skip
            parts += [md_table(["target", "config", "kind", "bytes / full", "score", "full", "difference x100 (n)",
                                "95% interval", "p", "p exact", "p Holm"], rows, text_columns=3), ""]  # fmt: skip
        parts += ["### Equal-bytes pairs", ""]
        if a.pairs.empty:
            parts += [f"No two configurations of different kinds within ±{t:.0%} of each other's bytes.", ""]
        else:
            parts += [f"Configurations of different kinds whose mean bytes on the shared samples lie within "
                      f"±{a.tolerance:.0%} of each other, the first minus the second:", ""]  # fmt: skip
            rows = [[r["config"], r["minus"], f"{r['kv_bytes'] / 2**20:.2f} / {r['minus_kv_bytes'] / 2**20:.2f}",
                     f"{r['diff']:+.1f} ({_n(r)})", _interval(r), p_text(r["p"]), p_text(r["p_exact"]), p_text(r["p_holm"]),
                     r["test"]] for _, r in a.pairs.iterrows()]  # fmt: skip
            parts += [md_table(["config", "minus", "KV MiB (config / minus)", "difference x100 (n)", "95% interval",
                                "p", "p exact", "p Holm", "test"], rows, text_columns=2), ""]  # fmt: skip
        parts += ["### Configurations", ""]
        rows = [[r["config"], r["kind"], f"{r['fraction']:.3f}", cell(r["kv_bytes"] / 2**20, 2), cell(r["score"], 1),
                 f"{int(r['n'])}" + ("" if r["vs_full"] or r["kind"] == "full" else " (own samples)"),
                 f"{r['rows_from']}/" if r["rows_from"] else "this folder"]
                for _, r in a.configs.iterrows()]  # fmt: skip
        parts += [
            md_table(
                ["config", "kind", "bytes / full", "KV MiB", "score x100", "n", "rows"], rows, text_columns=2
            ),
            "",
        ]
    return "\n".join(parts)


# ------------------------------------------------------------------------------------------- render
# ------------------------------------------------------------------------- the results page section
COMMAND = (
    "python scripts/equal_bytes.py run   # every config of conf/experiment/equal_bytes.yaml, into "
    "results/equal_bytes (`list` prints them)"
)


def _line_of(label: str, row: pd.Series, same: Equivalence | None = None) -> Line:
    """A `Line` whose comparison with the full cache is one row of a table of `analyse`
    (`p_holm`: the Holm p a statement rests on), so `grouped` words it as every other table's."""
    c = Comparison(int(row["n_shared"]), float(row["diff"]), float(row["lo"]), float(row["hi"]),
                   float(row["p"]), str(row["test"]), int(row["n_units"]), float(row["p_exact"]))  # fmt: skip
    return Line(label, "", c.n, math.nan, math.nan, vs_full=c, holm_full=float(row["p_holm"]), same_full=same)


def _cost_tost(rows: pd.DataFrame, config: str, full: str) -> Equivalence | None:
    """TOST at `MARGIN` of `config` minus the full cache on the samples both ran, over the units the
    report's comparison resamples (`eval.report.paired.units`); None below two units."""
    a, b, _ = shared_samples(rows[rows["config"] == config], rows[rows["config"] == full])
    unit = units(b).to_numpy()
    if len(set(unit)) < 2:
        return None
    return tost(100 * (a["score"].to_numpy(float) - b["score"].to_numpy(float)), MARGIN, unit)


def _model_section(a: Analysis, rows: pd.DataFrame, prepared: pd.DataFrame) -> list[str]:
    """One model's table and reading: per target fraction and kind, the configuration near the
    fraction that loses least against the full cache (`a.costs`, whose Holm p is over all of them)."""
    name, at_all = FOLDER, " and ".join(fraction_text(f) for f in a.fractions)
    full = full_config(rows)
    table_rows, lines, missing = [], [], []
    for target in a.fractions:
        at = fraction_text(target)
        for kind in KINDS[1:]:
            near = a.costs[(a.costs["target"] == target) & (a.costs["kind"] == kind)]
            if near.empty:
                missing.append(f"{kind} at {at}")
                continue
            best = near.sort_values(["diff", "fraction"], ascending=[False, True], kind="stable").iloc[0]
            same = _cost_tost(rows, best["config"], full) if full is not None else None
            line = _line_of(f"{kind} at {at} {best['config']}", best, same)
            lines.append(line)
            config = best["config"] + (f" (best of {len(near)})" if len(near) > 1 else "")
            table_rows.append([at, kind, config, f"{best['fraction']:.3f}", f"{best['score']:.1f}",
                               f"{best['full_score']:.1f}", diff_text(line.vs_full), n_units_text(line.vs_full),
                               p_text(line.holm_full)])  # fmt: skip
    figure = f"equal_bytes_{slug(a.model)}.png"  # eval.report.equal_bytes.render's name
    out = [
        f"{a.model}, {provenance(prepared)} ([how they ran]({name}/README.md), "
        f"figure: [{figure}]({name}/{figure})):",
        "",
    ]
    if not table_rows:
        out += [f"No configuration within ±{a.window:.0%} of {at_all} of the full cache's bytes with the "
                "full cache beside it.", ""]  # fmt: skip
    else:
        headers = ["bytes", "kind", "config", "bytes / full", "score x100", "full x100",
                   "minus full [95% CI]", "n", "Holm p"]  # fmt: skip
        out += [md_table(headers, table_rows, text_columns=3), ""]
    family = int(a.costs["p_holm"].notna().sum())
    said_full = grouped(lines, "full")
    if said_full:
        out.append(
            f"- Minus the full cache (Holm over the model's {family} configurations near a target, "
            f"[equal_bytes_costs.csv]({name}/equal_bytes_costs.csv)): " + "; ".join(said_full) + "."
        )
    if missing and table_rows:
        out.append(f"- No configuration within ±{a.window:.0%} of the target: {', '.join(missing)}.")
    if not a.pairs.empty:
        pairs = [_line_of(f"{r['config']} minus {r['minus']}", r) for _, r in a.pairs.iterrows()]
        said_pairs = grouped(pairs, "full")
        out.append(
            f"- Equal-bytes pairs, configurations of different kinds within ±{a.tolerance:.0%} of each "
            f"other's bytes, the first minus the second (Holm over the model's {len(pairs)} pairs): "
            + ("; ".join(said_pairs) if said_pairs else f"none with {MIN_N} units or more")
            + "."
        )
    return [*out, ""]


def section(root: Path) -> str:
    """The section "Eviction or quantization at equal bytes?" from results/equal_bytes/ through
    this module (its tables, its statistics): per model, at each of its `FRACTIONS` of
    the full cache's bytes, the configuration of each kind (quantized / combined / eviction) that
    loses least, its difference from the full cache with interval, n and Holm p, and the equal-bytes
    pairs; '' while the folder does not exist (the page is unchanged until the run)."""
    folder = root / FOLDER
    if not folder.is_dir():
        return ""
    name, at_all = FOLDER, " and ".join(fraction_text(f) for f in FRACTIONS)
    out = [
        "## Eviction or quantization at equal bytes?",
        "",
        f"```bash\n{COMMAND}\n```",
        "",
        "Each configuration stores fewer KV bytes than the full cache by quantizing it (`kv_quant`: every "
        "entry kept, fewer bits), by evicting (a method at a budget) or both; its bytes are what it stored "
        "(`kv_bytes`: values, scales, zero points, the residual), its fraction Σ kv_bytes / Σ kv_bytes_full. "
        f"Near {at_all} of the full cache's bytes (realised fraction within ±{WINDOW:.0%} of the target, shown "
        "beside it), the configuration of each kind that loses least, minus the full cache on the samples "
        f"both ran; pairs of different kinds within ±{TOLERANCE:.0%} of each other's bytes. Every configuration and pair: "
        f"[{name}/]({name}/{MARKDOWN}).",
        "",
    ]
    if (root / SPEED).is_dir():
        out += [
            f"What quantized storage costs a decode step and a prefill at 8K, with and without eviction: "
            f"[{SPEED}/]({SPEED}/README.md).",
            "",
        ]
    raw = load_rows(folder, load_plan())
    prepared = prepare(raw) if not raw.empty else raw
    items = analyses(raw) if not prepared.empty else []
    if not items:
        return "\n".join([*out, "No rows yet.", ""])
    rows = label_rows(prepared)
    rows = rows[rows["ok"] & rows["score"].notna()]
    for a in items:
        out += _model_section(a, rows[rows["model"] == a.model], prepared[prepared["model"] == a.model])
    return "\n".join(out)


def render(
    results_dir: str | Path,
    out: str | Path | None = None,
    tolerance: float = TOLERANCE,
    fractions: Sequence[float] = FRACTIONS,
    plan: Sequence[Run] = (),
    window: float = WINDOW,
) -> list[Path]:
    """Write the figure(s), equal_bytes.md and the CSVs of `results_dir` (with the rows `plan`'s
    configs reuse from beside it, `load_rows`) into `out` (default: the folder itself); [] and
    nothing written where the folder is missing or holds no ok, scored rows."""
    results_dir = Path(results_dir)
    if not results_dir.is_dir():
        return []
    items = analyses(load_rows(results_dir, plan), tolerance, fractions, window)
    if not items:
        return []
    out = Path(out) if out is not None else results_dir
    out.mkdir(parents=True, exist_ok=True)
    written, figures = [], {}
    for a in items:
        path = out / f"equal_bytes_{slug(a.model)}.png"
        figure(a).savefig(path, dpi=150, bbox_inches="tight")  # the legend sits beside the axes
        figures[a.model] = path.name
        written.append(path)
    for name, frames in (("configs", [a.configs for a in items]), ("pairs", [a.pairs for a in items]),
                         ("costs", [a.costs for a in items])):  # fmt: skip
        path = out / f"equal_bytes_{name}.csv"
        pd.concat(frames, ignore_index=True).to_csv(path, index=False, float_format="%.6g")
        written.append(path)
    md = out / MARKDOWN
    md.write_text(markdown(items, figures), encoding="utf-8")
    return [*written, md]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Eviction against quantization at equal bytes (eval/report/equal_bytes.py)"
    )
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: RESULTS_DIR)")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE, help="relative bytes tolerance of a pair")
    ap.add_argument("--window", type=float, default=WINDOW, help="relative distance from a target fraction")
    ap.add_argument("--grid", type=Path, default=None,
                    help="a grid file (conf/experiment/equal_bytes.yaml) whose reused configs' rows beside RESULTS_DIR count")  # fmt: skip
    args = ap.parse_args(argv)
    if not args.results_dir.is_dir():
        print(f"error: results dir not found: {args.results_dir}", file=sys.stderr)
        return 2
    try:
        plan = load_plan(args.grid) if args.grid is not None else ()
        written = render(args.results_dir, args.out, args.tolerance, plan=plan, window=args.window)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not written:
        print(f"error: no ok, scored result rows under {args.results_dir}", file=sys.stderr)
        return 2
    print("\n".join(f"wrote {p}" for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
