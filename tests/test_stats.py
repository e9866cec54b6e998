"""The statistics engine (eval/stats.py) against brute force, scipy and hand computations: the
sign-flip p, the unit bootstrap (whole clusters, within strata), exact McNemar, Holm, TOST, and
`compare` on a small table where per-sample tests mislead."""

import itertools
import math

import numpy as np
import pytest
from scipy.stats import binomtest, bootstrap
from scipy.stats import t as student_t

from eval import stats


# ------------------------------------------------------------------------------------------ sign flip
def brute_force_sign_flip(values, weights):
    """The fraction of the 2^n sign assignments whose |Σ w s v| reaches the observed, one by one."""
    terms = np.asarray(values, float) * np.asarray(weights, float)
    observed = abs(terms.sum())
    hits = sum(
        abs(np.dot(signs, terms)) >= observed - 1e-12
        for signs in itertools.product((-1, 1), repeat=len(terms))
    )
    return hits / 2 ** len(terms)


@pytest.mark.parametrize("n", [1, 2, 5, 8, 11])
def test_sign_flip_p_equals_a_brute_force_enumeration(n):
    rng = np.random.default_rng(n)
    values = rng.normal(0.5, 1.0, n).round(1)  # rounded: ties between assignments happen
    weights = rng.integers(1, 4, n) / 10
    assert stats.sign_flip_p(values, weights) == pytest.approx(
        brute_force_sign_flip(values, weights), abs=1e-12
    )
    assert stats.sign_flip_p(values) == pytest.approx(brute_force_sign_flip(values, np.ones(n)), abs=1e-12)


def test_sign_flip_p_has_a_floor_of_two_over_two_to_the_n():
    assert stats.sign_flip_p(np.full(8, -25.0)) == pytest.approx(2 / 2**8)  # every unit one way
    assert stats.sign_flip_p(np.zeros(6)) == 1.0
    with pytest.raises(ValueError, match="n=0"):
        stats.sign_flip_p(np.array([]))


def test_sign_flip_p_beyond_the_exact_limit_is_monte_carlo_and_seeded():
    n = stats.SIGN_FLIP_EXACT_UP_TO + 4
    values = np.r_[np.full(n // 2, 1.0), np.full(n - n // 2, -0.2)]
    p = stats.sign_flip_p(values, draws=20_000)
    assert p == stats.sign_flip_p(values, draws=20_000)
    # The exact p of this symmetric-sum problem, by counting: |(#plus - #minus among the +1s) -
    # 0.2 (#plus - #minus among the -0.2s)| >= observed, over binomial counts.
    from math import comb

    a, b = n // 2, n - n // 2
    observed = abs(a - 0.2 * b)
    exact = (
        sum(
            comb(a, i) * comb(b, j)
            for i in range(a + 1)
            for j in range(b + 1)
            if abs((2 * i - a) - 0.2 * (2 * j - b)) >= observed - 1e-9
        )
        / 2**n
    )
    assert p == pytest.approx(exact, abs=0.005)


# ------------------------------------------------------------------------------------------ bootstrap
def test_the_unit_bootstrap_resamples_clusters_not_rows():
    """Six contexts of 40 questions each, every question of a context alike: resampling contexts
    spreads the mean over what six contexts support; resampling the 240 rows as if independent
    would give an interval a sixth as wide (sd sqrt(0.25 / 240) against sqrt(0.25 / 6))."""
    values = np.repeat([0.0, 0.0, 0.0, 1.0, 1.0, 1.0], 40)
    contexts = np.repeat(np.arange(6), 40)
    clustered = stats.unit_bootstrap(values, contexts)
    rows = stats.unit_bootstrap(values)
    assert clustered.estimate == rows.estimate == 0.5
    assert (clustered.n_units, clustered.n, rows.n_units) == (6, 240, 240)
    assert clustered.hi - clustered.lo > 0.5  # rows would give ~0.12
    assert rows.hi - rows.lo < 0.2
    # Every resample of whole contexts is a mean of six 0/1 context means: a multiple of 1/6.
    assert clustered.lo * 6 == pytest.approx(round(clustered.lo * 6))
    assert clustered.hi * 6 == pytest.approx(round(clustered.hi * 6))


def test_the_unit_bootstrap_of_one_stratum_agrees_with_scipys_paired_bootstrap():
    rng = np.random.default_rng(1)
    baseline = rng.uniform(0, 1, 40)
    config = np.clip(baseline - rng.normal(0.1, 0.2, 40), 0, 1)
    b = stats.unit_bootstrap(100 * (config - baseline), resamples=20000)
    ref = bootstrap(
        (config, baseline), lambda a, c, axis: 100 * np.mean(a - c, axis=axis), paired=True,
        n_resamples=20000, method="percentile", rng=np.random.default_rng(5),
    ).confidence_interval  # fmt: skip
    assert b.estimate == pytest.approx(100 * np.mean(config - baseline))
    width = ref.high - ref.low  # different random streams: they agree to a fraction of the width
    assert abs(b.lo - ref.low) < 0.05 * width and abs(b.hi - ref.high) < 0.05 * width
    assert 0 < b.p < 0.05 and not b.lo <= 0 <= b.hi  # p below 5% exactly when 0 is outside


def test_the_unit_bootstrap_resamples_within_strata_and_weighs_strata_equally():
    # Constant differences inside each stratum: resampling within strata changes nothing.
    diffs = np.array([10.0, 10.0, 0, 0, 0, 0, 0, 0])
    strata = ["a", "a", "b", "b", "b", "b", "b", "b"]
    b = stats.unit_bootstrap(diffs, strata=strata)
    assert b.estimate == pytest.approx(5.0)  # mean of the stratum means, not the 2.5 of the samples
    assert b.lo == pytest.approx(5.0) and b.hi == pytest.approx(5.0)
    unstratified = stats.unit_bootstrap(diffs)
    assert unstratified.estimate == pytest.approx(2.5) and unstratified.hi - unstratified.lo > 1
    one = stats.unit_bootstrap(np.array([7.0, 1.0, 2.0, 3.0]), strata=["x", "y", "y", "y"])  # x: one unit
    assert one.estimate == pytest.approx((7.0 + 2.0) / 2) and one.lo >= (7 + 1) / 2 and one.hi <= (7 + 3) / 2
    with pytest.raises(ValueError, match="one label per value"):
        stats.unit_bootstrap(diffs, strata=strata[:-1])


def test_unit_bootstrap_edge_cases():
    b = stats.unit_bootstrap(np.array([-20.0, -20.0, -20.0]))
    assert (b.lo, b.hi) == (-20.0, -20.0)
    assert math.isnan(stats.unit_bootstrap(np.array([5.0])).lo)
    assert math.isnan(stats.unit_bootstrap(np.array([5.0, 0.0]), ["c", "c"]).hi)  # one context
    d = np.array([0.0, -100.0, 0.0, -100.0, 100.0])
    assert stats.unit_bootstrap(d) == stats.unit_bootstrap(d)  # seeded
    with pytest.raises(ValueError, match="n=0"):
        stats.unit_bootstrap(np.array([]))


# ------------------------------------------------------------------------------------ McNemar, Holm
def test_mcnemar_p_is_the_exact_binomial_test_of_the_discordant_pairs():
    baseline = np.array([1, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1, 1])
    config = np.array([1, 0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 1])  # broke 5, fixed 1
    assert stats.mcnemar_p(config, baseline) == pytest.approx(binomtest(1, 6, 0.5).pvalue)
    # By hand: P(X <= 1) for X ~ Bin(6, 1/2) = 7/64, two-sided 14/64.
    assert stats.mcnemar_p(config, baseline) == pytest.approx(14 / 64)
    assert stats.mcnemar_p(baseline, baseline) == 1.0
    with pytest.raises(ValueError, match="n=0"):
        stats.mcnemar_p(np.array([]), np.array([]))


def test_holm_against_a_hand_computation():
    # m = 4 finite: sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 ->
    # running max 0.02, 0.03, 0.06, 0.06.
    got = stats.holm([0.01, 0.04, 0.03, math.nan, 0.005])
    np.testing.assert_allclose(got, [0.03, 0.06, 0.06, math.nan, 0.02])
    np.testing.assert_allclose(stats.holm([0.5, 0.9]), [1.0, 1.0])  # capped at 1
    # m = 3: 0.001 x3 = 0.003; 0.02 x2 = 0.04; 0.04 x1 = 0.04.
    np.testing.assert_allclose(stats.holm([0.04, 0.001, 0.02]), [0.04, 0.003, 0.04])
    assert stats.holm([]).size == 0


# ----------------------------------------------------------------------------------------------- TOST
def test_tost_against_a_hand_computation():
    d = np.array([1.0, -2.0, 3.0, 0.0, 2.0])  # mean 0.8
    # By hand: sum of squares about the mean 0.04 + 7.84 + 4.84 + 0.64 + 1.44 = 14.8, sd = sqrt(3.7),
    # se = sqrt(3.7 / 5); t_lower = (0.8 + 5) / se, t_upper = (0.8 - 5) / se, 4 degrees of freedom.
    se = math.sqrt(3.7 / 5)
    p_lower = student_t.sf((0.8 + 5) / se, 4)
    p_upper = student_t.cdf((0.8 - 5) / se, 4)
    e = stats.tost(d, margin=5)
    assert e.p == pytest.approx(max(p_lower, p_upper)) and e.diff == pytest.approx(0.8)
    assert e.n_units == 5 and e.equivalent and "within ±5" in e.text()
    narrow = stats.tost(d, margin=1)
    assert narrow.p == pytest.approx(max(student_t.sf(1.8 / se, 4), student_t.cdf(-0.2 / se, 4)))
    assert not narrow.equivalent and "not shown within ±1" in narrow.text()


def test_tost_is_over_units():
    """Four questions each of two contexts: two units, whatever the rows."""
    d = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    by_context = stats.tost(d, 2, units=[0] * 4 + [1] * 4)
    assert by_context.n_units == 2
    # Unit means 0 and 1: mean 0.5, se = 0.5, 1 degree of freedom.
    assert by_context.p == pytest.approx(max(student_t.sf(2.5 / 0.5, 1), student_t.cdf(-1.5 / 0.5, 1)))
    assert stats.tost(np.zeros(4), 1).p == 0.0 and stats.tost(np.full(4, 3.0), 1).p == 1.0
    with pytest.raises(ValueError, match="margin=0"):
        stats.tost(d, 0)


# -------------------------------------------------------------------------------------------- compare
def test_compare_over_problems_not_samples():
    """A small long-generation table: 16 problems, 2 sampled answers each, the full cache right on
    all 32 and the method wrong on one answer of 4 problems (-12.5). Per sample, McNemar's exact
    interval conditional on the 4 discordant pairs reaches +2.6; the bootstrap over the 16 problems
    gives [-25.0, -3.1], and the exact sign-flip p over the 4 problems that differ is 2/16."""
    full = np.ones(32)
    tova = np.ones(32)
    tova[[0, 2, 4, 6]] = 0  # one answer of problems 0..3
    problems = np.repeat(np.arange(16), 2)
    ci = binomtest(0, 4, 0.5).proportion_ci(confidence_level=0.95, method="exact")
    conditional_high = 100 * (2 * ci.high - 1) * 4 / 32
    assert conditional_high == pytest.approx(2.55, abs=0.01)  # what a conditional interval printed
    c = stats.compare(tova, full, problems)
    assert (c.n, c.n_units, c.diff) == (32, 16, -12.5)
    assert (round(c.lo, 1), round(c.hi, 1)) == (-25.0, -3.1)
    assert c.test == "bootstrap"  # two answers per problem: McNemar's pairs are not independent
    assert c.p_exact == pytest.approx(2 / 2**4) and c.p_read == c.p_exact
    assert stats.verdict(c) == "no difference detected (p = 0.125, n = 16)"
    per_sample = stats.compare(tova, full)  # each answer its own unit: McNemar's p
    assert per_sample.test == "mcnemar" and per_sample.p == pytest.approx(binomtest(0, 4, 0.5).pvalue)
    assert per_sample.lo <= per_sample.diff <= per_sample.hi < 0  # the bootstrap's, never conditional


def test_compare_withholds_below_the_minimum_units_and_gives_the_exact_p_below_few_units():
    base = np.ones(6)
    conf = np.array([0.0, 0, 0, 1, 1, 1])
    at = stats.compare(conf[: stats.MIN_N], base[: stats.MIN_N])
    assert at.n_units == stats.MIN_N and math.isfinite(at.lo) and math.isfinite(at.p)
    assert at.p_exact == pytest.approx(stats.sign_flip_p(np.array([-100.0] * 3 + [0.0] * 2)))
    below = stats.compare(conf[: stats.MIN_N - 1], base[: stats.MIN_N - 1])
    assert below.n_units == stats.MIN_N - 1 and math.isnan(below.lo) and math.isnan(below.hi)
    assert math.isnan(below.p) and math.isnan(below.p_exact) and below.diff == pytest.approx(-75.0)
    clustered = stats.compare(conf, base, units=[0, 0, 1, 1, 2, 2])  # 3 contexts: withheld
    assert clustered.n_units == 3 and math.isnan(clustered.lo)
    many = stats.compare(np.zeros(stats.FEW_UNITS), np.r_[np.ones(5), np.zeros(stats.FEW_UNITS - 5)])
    assert many.n_units == stats.FEW_UNITS and math.isnan(many.p_exact) and many.p_read == many.p
    graded = stats.compare_differences(np.array([-10.0, -20.0, -20.0, 0.0, -50.0]))
    assert graded.test == "bootstrap" and math.isfinite(graded.lo) and graded.interval == "unit bootstrap"
    with pytest.raises(ValueError, match="paired"):
        stats.compare(np.ones(3), np.ones(4))


def test_verdict_needs_a_tost_for_sameness():
    same = stats.compare_differences(np.array([0.5, -0.5, 0.0, 0.5, -0.5, 0.0, 0.5, -0.5]))
    assert stats.verdict(same).startswith("no difference detected (p = ")
    e = stats.tost(np.array([0.5, -0.5, 0.0, 0.5, -0.5, 0.0, 0.5, -0.5]), margin=2)
    assert stats.verdict(same, e).startswith("same within ±2 (TOST p = ")
    lower = stats.compare_differences(np.full(10, -5.0) + np.arange(10) * 0.1)
    assert stats.verdict(lower) == "below zero"
