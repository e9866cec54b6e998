"""Spreads of repeated measurements: median and interquartile range, and the per-group timing
summary the benchmark and the report print beside every timing."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import pandas as pd


@dataclass(frozen=True)
class Spread:
    """Median and interquartile range of a sample (linear-interpolation quartiles, numpy's default)."""

    median: float
    q1: float
    q3: float
    n: int

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @property
    def rel_iqr(self) -> float:
        """IQR / median: the noise figure printed beside a median."""
        return self.iqr / self.median if self.median else math.nan

    def meets(self, target: float, direction: str) -> bool:
        """Whether the whole IQR lies on the right side of `target` (`direction` "<=" or ">=")."""
        if direction == "<=":
            return self.q3 <= target
        if direction == ">=":
            return self.q1 >= target
        raise ValueError(f"direction must be '<=' or '>=', got direction={direction!r}")


def _quantile(sorted_xs: Sequence[float], p: float) -> float:
    pos = p * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def spread(values: Iterable[float | None]) -> Spread | None:
    """Median and quartiles of the finite values (None when there are none)."""
    xs = sorted(float(v) for v in values if v is not None and math.isfinite(float(v)))
    if not xs:
        return None
    return Spread(_quantile(xs, 0.5), _quantile(xs, 0.25), _quantile(xs, 0.75), len(xs))


def timing_summary(rows, by: Sequence[str] = ("config_label",), columns: Sequence[str] | None = None):
    """Per-group medians of the timing columns of result rows, each with its noise figure beside it.

    rows: a pandas DataFrame of result rows (harness rows or benchmark rows). For every column in
    `columns` (default: those of prefill_s / ttft_s / tpot_s present) the table holds `<col>_median`
    and `<col>_iqr_pct` (IQR / median, %: how much the repeated measurements disagree), plus `n`
    (ok rows) and, where the rows carry it (benchmark rows; harness rows since the runner records
    it), `other_cores_median`: the cores other processes kept busy meanwhile (NaN when no row of the
    group has it). Timings in harness rows are bookkeeping: print them only with these figures
    beside them (eval/report.py's cost table does).
    """
    columns = [c for c in (columns or ("prefill_s", "ttft_s", "tpot_s")) if c in rows.columns]
    ok = rows[rows["status"] == "ok"] if "status" in rows.columns else rows
    out = []
    for key, g in ok.groupby(list(by), sort=True):
        rec = dict(zip(by, key if isinstance(key, tuple) else (key,)))
        rec["n"] = len(g)
        for c in columns:
            s = spread(g[c])
            rec[f"{c}_median"] = s.median if s else math.nan
            rec[f"{c}_iqr_pct"] = 100 * s.rel_iqr if s else math.nan
        if "other_cores" in g.columns:
            s = spread(g["other_cores"])
            rec["other_cores_median"] = s.median if s else math.nan
        out.append(rec)
    return pd.DataFrame(out)
