"""The project's statistics, in one place: spreads of repeated measurements (median and
interquartile range, the per-group timing summary the benchmark and the report print beside every
timing), the split of a mean score's variance into its generator-seed and sampling components
(`seed_variance`), and the one engine behind every interval and p of the reports: `compare` (a
paired comparison over units of independence: a unit bootstrap interval, the exact McNemar or the
bootstrap p, the exact sign-flip p where units are few), `unit_bootstrap`, `sign_flip_p`,
`mcnemar_p`, `holm` and the `tost` equivalence test. On scipy; imports nothing else from `eval/`."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
from scipy.stats import binomtest, bootstrap, ttest_1samp


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
# Every interval and p of the reports (eval/report/paired.py, eval/report/protocols.py, the task
# reports) comes from `compare` / `compare_differences` below, or from `unit_bootstrap` for a lone
# mean. The resampling unit is the unit of independence: the context where several questions share
# one (under the shared protocols they also share one compressed cache), the problem where it was
# sampled several times, the sample otherwise; strata (context length, RULER task, LongBench
# dataset) are kept fixed and weighed equally, as the report's averages weigh them.
MIN_N = 5  # units below which the interval and p are withheld
FEW_UNITS = 20  # units below which the exact sign-flip p is reported beside the interval
SIGN_FLIP_EXACT_UP_TO = 20  # units up to which sign_flip_p enumerates all 2^n assignments
SIGN_FLIP_DRAWS = 100_000  # Monte Carlo sign assignments beyond that
RESAMPLES = 9999
SEED = 0
CONFIDENCE = 0.95
ALPHA = 0.05


@dataclass(frozen=True)
class Units:
    """Values (paired differences, or scores) summed per unit: `sums`, `sizes` and `strata` (the
    unit's stratum code, 0..k-1), each [units], in sorted (stratum, unit) order.

    The estimate is the mean over strata of each stratum's mean over its values, so unit u of
    stratum s weighs sizes[u] / (values in s) / k; without strata that is the plain mean of the
    values (a unit weighs as many values as it holds)."""

    sums: np.ndarray
    sizes: np.ndarray
    strata: np.ndarray

    @property
    def n_units(self) -> int:
        return len(self.sums)

    @property
    def n(self) -> int:
        return int(self.sizes.sum())

    @property
    def k(self) -> int:
        return int(self.strata.max()) + 1

    def means(self) -> np.ndarray:
        """Each unit's mean value [units]."""
        return self.sums / self.sizes

    def weights(self) -> np.ndarray:
        """Each unit's weight in the estimate [units] (they sum to 1)."""
        per_stratum = np.bincount(self.strata, weights=self.sizes)
        return self.sizes / per_stratum[self.strata] / self.k

    def estimate(self) -> float:
        """Mean over strata of Σ sums / Σ sizes (= Σ weights x means, without its rounding)."""
        per_stratum = np.bincount(self.strata, weights=self.sums) / np.bincount(
            self.strata, weights=self.sizes
        )
        return float(per_stratum.mean())


def units_of(values: np.ndarray, units: Sequence | None = None, strata: Sequence | None = None) -> Units:
    """`values` [n] grouped by `units` (one label per value; None: each value its own unit) inside
    `strata` (one label per value; None: one stratum). A unit is the pair (stratum, unit label): a
    label that occurs in two strata is two units."""
    values = np.asarray(values, float)
    n = len(values)
    if n == 0:
        raise ValueError("a paired comparison needs at least one value, got n=0")
    for name, labels in (("units", units), ("strata", strata)):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} must have one label per value, got {len(labels)} labels for n={n}")
    frame = pd.DataFrame(
        {
            "s": np.zeros(n, int) if strata is None else pd.Series(list(strata)).astype(str).to_numpy(),
            "u": np.arange(n) if units is None else pd.Series(list(units)).astype(str).to_numpy(),
            "v": values,
        }
    )
    g = frame.groupby(["s", "u"], sort=True)["v"].agg(["sum", "size"]).reset_index()
    _, codes = np.unique(g["s"].to_numpy(), return_inverse=True)
    return Units(g["sum"].to_numpy(float), g["size"].to_numpy(float), codes.astype(int))


@dataclass(frozen=True)
class Bootstrap:
    """A percentile bootstrap over units: the `estimate`, its interval `lo` / `hi` and the two-sided
    `p` (2 x the smaller fraction of resamples on either side of 0, +1 / resamples + 1, capped at 1:
    the level at which the percentile interval would just reach 0); NaN below two units."""

    estimate: float
    lo: float
    hi: float
    p: float
    n_units: int
    n: int


def unit_bootstrap(
    values: np.ndarray,
    units: Sequence | None = None,
    strata: Sequence | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    confidence: float = CONFIDENCE,
) -> Bootstrap:
    """Percentile bootstrap of the estimate of `units_of(values, units, strata)` that resamples whole
    units, independently within each stratum (`scipy.stats.bootstrap`, seeded: the same rows give
    the same interval).

    scipy resamples observations, not clusters, and has no strata; it does resample several samples
    independently (`paired=False`). So each stratum is handed to it as one sample of unit indices,
    and the statistic maps a resample of indices onto the units' sums and sizes: every resample
    draws whole units within each stratum. A stratum of one unit is constant under resampling."""
    u = units_of(values, units, strata)
    estimate = u.estimate()
    if u.n_units < 2:
        return Bootstrap(estimate, math.nan, math.nan, math.nan, u.n_units, u.n)
    groups = [np.flatnonzero(u.strata == s) for s in range(u.k)]
    free = [g for g in groups if len(g) > 1]
    fixed = sum(u.sums[g].sum() / u.sizes[g].sum() for g in groups if len(g) == 1)
    means = u.means()
    if not free or np.all(means == means[0]):  # every resample gives the estimate
        p = 1.0 if estimate == 0 else min(1.0, 2 / (resamples + 1))
        return Bootstrap(estimate, estimate, estimate, p, u.n_units, u.n)

    def statistic(*picks, axis=-1):  # picks: [..., units of the stratum] positions within it
        total = fixed
        for g, pick in zip(free, picks):
            chosen = g[pick.astype(int)]
            total = total + u.sums[chosen].sum(axis=-1) / u.sizes[chosen].sum(axis=-1)
        return total / u.k

    res = bootstrap(
        tuple(np.arange(len(g), dtype=float) for g in free), statistic, paired=False, vectorized=True,
        n_resamples=resamples, confidence_level=confidence, method="percentile",
        rng=np.random.default_rng(seed),
    )  # fmt: skip
    dist = res.bootstrap_distribution
    tail = min(int((dist <= 0).sum()), int((dist >= 0).sum()))
    p = min(1.0, 2 * (tail + 1) / (resamples + 1))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    return Bootstrap(estimate, lo, hi, p, u.n_units, u.n)


def _signed_sums(x: np.ndarray) -> np.ndarray:
    """Σ ±x_i over all 2^len(x) sign assignments [2^len(x)]."""
    sums = np.zeros(1)
    for v in x:
        sums = np.concatenate([sums + v, sums - v])
    return sums


def sign_flip_p(
    values: np.ndarray, weights: np.ndarray | None = None, draws: int = SIGN_FLIP_DRAWS, seed: int = SEED
) -> float:
    """Two-sided sign-flip permutation p of Σ weights x values (`values` [units]: per-unit mean
    differences; `weights` [units]: each unit's weight in the estimate, None: equal), under the
    null that each unit's difference is symmetric about 0: the fraction of the 2^n sign
    assignments whose |Σ w s v| reaches the observed one. Exact for n <= `SIGN_FLIP_EXACT_UP_TO`
    (the signed sums of the two halves, added pairwise: 2^(n/2) + 2^(n/2) terms, not 2^n x n);
    beyond, `draws` random assignments (seeded), p = (hits + 1) / (draws + 1). The smallest exact
    p is 2 / 2^n: 8 units cannot give p below 0.008, whatever the data."""
    terms = np.asarray(values, float) * (1.0 if weights is None else np.asarray(weights, float))
    n = len(terms)
    if n == 0:
        raise ValueError("sign_flip_p needs at least one unit, got n=0")
    observed = abs(terms.sum()) - 1e-9 * max(1.0, float(np.abs(terms).sum()))  # ties count as hits
    if n <= SIGN_FLIP_EXACT_UP_TO:
        left, right = _signed_sums(terms[: n // 2]), _signed_sums(terms[n // 2 :])
        hits = sum(int(np.count_nonzero(np.abs(a + right) >= observed)) for a in left)
        return hits / 2**n
    rng = np.random.default_rng(seed)
    hits, done = 0, 0
    while done < draws:  # chunks of 10,000 assignments keep memory flat
        size = min(10_000, draws - done)
        signs = rng.choice(np.array([-1.0, 1.0]), size=(size, n))
        hits += int(np.count_nonzero(np.abs(signs @ terms) >= observed))
        done += size
    return (hits + 1) / (draws + 1)


def mcnemar_p(config: np.ndarray, baseline: np.ndarray) -> float:
    """Exact McNemar p of paired 0/1 scores `config` [n] and `baseline` [n]: the two-sided binomial
    test of the discordant pairs (fixed among fixed + broke, p = 1/2); 1 with none."""
    config, baseline = np.asarray(config, float), np.asarray(baseline, float)
    if len(config) == 0:
        raise ValueError("mcnemar_p needs at least one pair, got n=0")
    fixed = int(((config == 1) & (baseline == 0)).sum())
    broke = int(((config == 0) & (baseline == 1)).sum())
    if fixed + broke == 0:
        return 1.0
    return float(binomtest(fixed, fixed + broke, 0.5).pvalue)


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


@dataclass(frozen=True)
class Equivalence:
    """A TOST equivalence test (`tost`): `p` the larger of the two one-sided p's; `equivalent` when
    p < alpha, i.e. the difference lies within +-`margin` at that level."""

    margin: float
    diff: float
    p: float
    n_units: int
    alpha: float = ALPHA

    @property
    def equivalent(self) -> bool:
        return bool(self.p < self.alpha)

    def text(self) -> str:
        """'within ±m (TOST p = …, n = …)' or 'not shown within ±m (…)'."""
        what = "within" if self.equivalent else "not shown within"
        return f"{what} ±{self.margin:g} (TOST p = {_p_text(self.p)}, n = {self.n_units})"


def tost(
    values: np.ndarray, margin: float, units: Sequence | None = None, alpha: float = ALPHA
) -> Equivalence:
    """Paired two one-sided tests (Schuirmann 1987) over units: with d_u the units' mean differences
    (`units_of(values, units)`, each unit counted once), one-sample t-tests of H0: mean(d) <= -margin
    (against greater) and H0: mean(d) >= +margin (against less), n_units - 1 degrees of freedom;
    p = the larger of the two. `margin` (> 0) is in the units of `values` (x100 differences: points);
    a 'no loss' statement needs p < alpha with its margin stated. NaN below two units; with no
    spread between units, p = 0 inside the margin, 1 outside."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got margin={margin}")
    d = units_of(values, units).means()
    mean = float(d.mean())
    if len(d) < 2:
        return Equivalence(margin, mean, math.nan, len(d), alpha)
    if np.all(d == d[0]):
        return Equivalence(margin, mean, 0.0 if abs(mean) < margin else 1.0, len(d), alpha)
    lower = ttest_1samp(d, -margin, alternative="greater").pvalue
    upper = ttest_1samp(d, margin, alternative="less").pvalue
    return Equivalence(margin, mean, float(max(lower, upper)), len(d), alpha)


@dataclass(frozen=True)
class Comparison:
    """One paired comparison (`compare`): `diff` (x100 where the scores were in [0, 1]) with its
    interval `lo` / `hi` and `p`, over `n_units` units holding `n` pairs.

    test: what `p` is, `mcnemar` (exact, 0/1 scores with one pair per unit) or `bootstrap` (the
    unit bootstrap's). p_exact: the exact sign-flip p over units where there are fewer than
    `FEW_UNITS` (NaN otherwise), the one to read with few units: a percentile bootstrap over few
    clusters is too narrow. interval: how the interval was drawn. Interval and p's are NaN below
    `MIN_N` units."""

    n: int
    diff: float
    lo: float
    hi: float
    p: float
    test: str
    n_units: int = 0
    p_exact: float = math.nan
    interval: str = ""

    @property
    def p_read(self) -> float:
        """The p a statement rests on: `p_exact` where there is one, else `p`."""
        return self.p if math.isnan(self.p_exact) else self.p_exact


def _compare(values: np.ndarray, units, strata, p_mcnemar: float | None) -> Comparison:
    u = units_of(values, units, strata)
    how = "unit bootstrap" + (" within strata" if u.k > 1 else "")
    if u.n_units < MIN_N:
        return Comparison(u.n, u.estimate(), math.nan, math.nan, math.nan, "mcnemar" if p_mcnemar is not None
                          else "bootstrap", u.n_units, math.nan, how)  # fmt: skip
    b = unit_bootstrap(values, units, strata)
    p_exact = sign_flip_p(u.means(), u.weights()) if u.n_units < FEW_UNITS else math.nan
    if p_mcnemar is not None:
        return Comparison(u.n, b.estimate, b.lo, b.hi, p_mcnemar, "mcnemar", u.n_units, p_exact, how)
    return Comparison(u.n, b.estimate, b.lo, b.hi, b.p, "bootstrap", u.n_units, p_exact, how)


def compare(
    config: np.ndarray, baseline: np.ndarray, units: Sequence | None = None, strata: Sequence | None = None
) -> Comparison:
    """Config minus baseline x100 on paired scores in [0, 1] (`config`, `baseline` [n]; `units`,
    `strata`: one label per pair, `units_of`): the estimate and its interval from `unit_bootstrap`
    (never conditional on the discordant pairs), p the exact McNemar test where every score is 0 or
    1 and every unit holds one pair (else the bootstrap's: McNemar assumes independent pairs), and
    the exact sign-flip p beside it below `FEW_UNITS` units (`Comparison`)."""
    config, baseline = np.asarray(config, float), np.asarray(baseline, float)
    if len(config) != len(baseline):
        raise ValueError(f"config and baseline must be paired, got {len(config)} and {len(baseline)} scores")
    single = units is None or pd.Series(list(units)).astype(str).is_unique
    p_mcnemar = (
        mcnemar_p(config, baseline) if len(config) and single and is_binary(config, baseline) else None
    )
    return _compare(100 * (config - baseline), units, strata, p_mcnemar)


def compare_differences(
    diffs: np.ndarray, units: Sequence | None = None, strata: Sequence | None = None
) -> Comparison:
    """`compare` of differences already formed (`diffs` [n], e.g. a difference of differences): the
    unit bootstrap's interval and p, the sign-flip p below `FEW_UNITS` units."""
    return _compare(np.asarray(diffs, float), units, strata, None)


def _p_text(p: float) -> str:
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def verdict(c: Comparison, equivalence: Equivalence | None = None, alpha: float = ALPHA) -> str:
    """What a page may say of `c`: 'above zero' / 'below zero' where `p_read` < alpha; 'same within
    ±m (TOST p = …, n = …)' where a TOST at margin m shows equivalence; else 'no difference
    detected (p = …, n = …)'. A 'no loss' statement needs the TOST."""
    if math.isnan(c.p_read):
        return f"not tested (n = {c.n_units} < {MIN_N})"
    if c.p_read < alpha:
        return "above zero" if c.diff > 0 else "below zero"
    if equivalence is not None and equivalence.equivalent:
        return "same " + equivalence.text()
    return f"no difference detected (p = {_p_text(c.p_read)}, n = {c.n_units})"
