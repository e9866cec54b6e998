"""Spreads of repeated measurements: median and interquartile range, the per-group timing summary
the benchmark and the report print beside every timing, and the split of a mean score's variance
into its generator-seed and sampling components (`seed_variance`)."""

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


@dataclass(frozen=True)
class SeedVariance:
    """The variance of a config's mean score over k generator seeds, split in two (`seed_variance`).

    mean: the mean of the k per-seed means; between: the part of Var(mean) that comes from the
    seeds, sigma_seed^2 / k; within: the part that comes from sampling inside each seed,
    sum_j s_j^2 / n_j / k^2. Both are variances of the mean, so they add up.
    """

    seeds: int
    n: int
    mean: float
    between: float
    within: float

    @property
    def seed_sd(self) -> float:
        """Standard deviation of the mean that the seeds contribute: sqrt(between)."""
        return math.sqrt(self.between)

    @property
    def sampling_sd(self) -> float:
        """Standard deviation of the mean that sampling within the seeds contributes: sqrt(within)."""
        return math.sqrt(self.within)

    def interval(self, z: float = 1.96) -> tuple[float, float]:
        """Normal-approximation interval of the mean, both components included (z=1.96: 95%)."""
        half = z * math.sqrt(self.between + self.within)
        return self.mean - half, self.mean + half


def seed_variance(scores: Iterable[float], seeds: Iterable) -> SeedVariance | None:
    """Split the variance of the mean of ``scores`` (one per sample; ``seeds``: each sample's
    generator seed) into its between-seed and within-seed components (one-way random effects,
    method of moments): with k seeds, seed j holding n_j samples of mean m_j and variance s_j^2
    (ddof=1),

        within  = sum_j (s_j^2 / n_j) / k^2                (sampling noise of the mean of the m_j)
        sigma^2 = max(0, var_j(m_j, ddof=1) - mean_j(s_j^2 / n_j))   (seed-to-seed spread beyond it)
        between = sigma^2 / k

    so that Var(mean_j m_j) = between + within. None unless there are at least two seeds, each
    with at least two finite scores.
    """
    frame = pd.DataFrame({"score": list(scores), "seed": list(seeds)})
    frame = frame[pd.to_numeric(frame["score"], errors="coerce").notna()].astype({"score": float})
    per_seed = frame.groupby("seed")["score"].agg(["mean", "var", "size"])
    if len(per_seed) < 2 or (per_seed["size"] < 2).any():
        return None
    k = len(per_seed)
    noise = per_seed["var"] / per_seed["size"]  # s_j^2 / n_j: sampling variance of each m_j
    sigma2 = max(0.0, float(per_seed["mean"].var(ddof=1)) - float(noise.mean()))
    return SeedVariance(
        seeds=k,
        n=int(per_seed["size"].sum()),
        mean=float(per_seed["mean"].mean()),
        between=sigma2 / k,
        within=float(noise.sum()) / k**2,
    )
