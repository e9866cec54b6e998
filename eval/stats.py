"""The project's statistics, in one place: spreads of repeated measurements (median and
interquartile range, the per-group timing summary the benchmark and the report print beside every
timing), the split of a mean score's variance into its generator-seed and sampling components
(`seed_variance`), and the paired tests behind every interval and p of the reports (exact McNemar,
stratified and clustered bootstraps, Holm's adjustment). Imports nothing else from `eval/`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import binomtest, bootstrap


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
    beside them (eval/report/build.py's cost table does).
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


# ------------------------------------------------------------------------------- paired comparisons
# The report's paired tests (eval/report/paired.py documents how it applies them). Two bootstrap
# engines live here: `stratified_bootstrap` (per-sample resampling within strata, RESAMPLES) for
# the paired tables, `paired_bootstrap` (whole clusters, scipy, CLUSTER_RESAMPLES) for the protocol
# and reasoning sections.
MIN_N = 5
RESAMPLES = 2000
CLUSTER_RESAMPLES = 9999
SEED = 0
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """One paired comparison: difference x100 with its interval and p (NaN where withheld)."""

    n: int
    diff: float
    lo: float
    hi: float
    p: float
    test: str


def mcnemar(config: np.ndarray, baseline: np.ndarray, confidence: float = CONFIDENCE) -> Comparison:
    """Exact McNemar test of paired 0/1 scores `config` [n] and `baseline` [n] (module doc)."""
    config, baseline = np.asarray(config, float), np.asarray(baseline, float)
    n = len(config)
    if n == 0:
        raise ValueError("mcnemar needs at least one pair, got n=0")
    fixed = int(((config == 1) & (baseline == 0)).sum())
    broke = int(((config == 0) & (baseline == 1)).sum())
    discordant = fixed + broke
    diff = 100 * (fixed - broke) / n
    if discordant == 0:
        return Comparison(n, diff, 0.0, 0.0, 1.0, "mcnemar")
    res = binomtest(fixed, discordant, 0.5)
    ci = res.proportion_ci(confidence_level=confidence, method="exact")
    # fixed / discordant = q  ->  (fixed - broke) / n = (2q - 1) * discordant / n
    lo, hi = (100 * (2 * q - 1) * discordant / n for q in (ci.low, ci.high))
    return Comparison(n, diff, lo, hi, float(res.pvalue), "mcnemar")


def _stratum_mean(values: np.ndarray, codes: np.ndarray, n_strata: int) -> np.ndarray:
    """Mean over strata of the per-stratum means of `values` [..., n] (`codes` [n]: 0..n_strata-1)."""
    return np.mean([values[..., codes == s].mean(axis=-1) for s in range(n_strata)], axis=0)


def stratified_bootstrap(
    diffs: np.ndarray,
    strata: Sequence | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> Comparison:
    """Percentile bootstrap of the mean over strata of the per-stratum mean of `diffs` [n] (paired
    differences, already x100 if wanted), resampling within each stratum (`strata` [n] labels; None:
    one stratum). Strata are visited in sorted order with one generator seeded `seed`."""
    diffs = np.asarray(diffs, float)
    n = len(diffs)
    if n == 0:
        raise ValueError("stratified_bootstrap needs at least one difference, got n=0")
    labels = np.zeros(n, dtype=int) if strata is None else np.asarray(pd.Series(list(strata)).astype(str))
    if len(labels) != n:
        raise ValueError(f"strata must have one label per difference, got {len(labels)} for n={n}")
    _, codes = np.unique(labels, return_inverse=True)
    k = int(codes.max()) + 1
    rng = np.random.default_rng(seed)
    idx = np.empty((resamples, n), dtype=int)
    for s in range(k):
        members = np.flatnonzero(codes == s)
        idx[:, members] = rng.choice(members, size=(resamples, len(members)))
    stats = _stratum_mean(diffs[idx], codes, k)
    alpha = 1 - confidence
    lo, hi = np.percentile(stats, [100 * alpha / 2, 100 * (1 - alpha / 2)])
    point = float(_stratum_mean(diffs, codes, k))
    tail = min(int((stats <= 0).sum()), int((stats >= 0).sum()))
    p = min(1.0, 2 * (tail + 1) / (resamples + 1))
    return Comparison(n, point, float(lo), float(hi), p, "bootstrap")


def holm(pvalues: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values (Holm 1979): sort the m p-values ascending, multiply the
    i-th smallest (1-based) by m - i + 1, carry the running maximum forward, cap at 1. NaN entries
    are left out of m and stay NaN."""
    p = np.asarray(pvalues, float)
    out = np.full(p.shape, np.nan)
    finite = np.flatnonzero(~np.isnan(p))
    m = len(finite)
    if m == 0:
        return out
    order = finite[np.argsort(p[finite], kind="stable")]
    adjusted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    out[order] = adjusted
    return out


def is_binary(*scores: np.ndarray) -> bool:
    """Whether every score is 0 or 1 (then the exact McNemar test applies)."""
    return all(np.isin(np.asarray(s, float), (0.0, 1.0)).all() for s in scores)


def compare(config: np.ndarray, baseline: np.ndarray, strata: Sequence | None = None) -> Comparison:
    """Config minus baseline x100 on paired scores in [0, 1] (`mcnemar` for 0/1 scores, else the
    `stratified_bootstrap`), the interval and p withheld (NaN) below `MIN_N` pairs."""
    config, baseline = np.asarray(config, float), np.asarray(baseline, float)
    if is_binary(config, baseline):
        c = mcnemar(config, baseline)
    else:
        c = stratified_bootstrap(100 * (config - baseline), strata)
    if c.n < MIN_N:
        return Comparison(c.n, c.diff, math.nan, math.nan, math.nan, c.test)
    return c


def paired_bootstrap(diffs: np.ndarray, clusters=None, seed: int = SEED) -> tuple[float, float]:
    """95% bootstrap interval of the mean of paired differences (percentile, `seed`); NaN for fewer
    than 2 clusters. `clusters` (one label per difference, e.g. the context): resample whole
    clusters and take the mean over their differences, as the questions of one context share its
    haystack and, under the shared protocols, one compressed cache (they are not independent);
    None: each difference its own cluster."""
    diffs = np.asarray(diffs, dtype=float)
    if clusters is None:
        clusters = np.arange(len(diffs))
    g = (
        pd.DataFrame({"d": diffs, "c": np.asarray(clusters)})
        .groupby("c", sort=True)["d"]
        .agg(["sum", "size"])
    )
    if len(g) < 2:
        return math.nan, math.nan
    if np.all(diffs == diffs[0]):  # every resample has the same mean
        return float(diffs[0]), float(diffs[0])
    sums, sizes = g["sum"].to_numpy(float), g["size"].to_numpy(float)

    def mean_of_clusters(s, n, axis=-1):
        return s.sum(axis=axis) / n.sum(axis=axis)

    res = bootstrap(
        (sums, sizes), mean_of_clusters, paired=True, vectorized=True, n_resamples=CLUSTER_RESAMPLES,
        confidence_level=CONFIDENCE, method="percentile", rng=np.random.default_rng(seed),
    )  # fmt: skip
    return float(res.confidence_interval.low), float(res.confidence_interval.high)
