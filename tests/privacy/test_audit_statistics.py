"""Tests of the one-run ε lower bounds and the attack statistics, each against an independent
computation: a loop transcription of the published algorithms, closed forms worked out by hand,
dp-accounting's Gaussian mechanism, and scikit-learn / scipy."""

import math

import dp_accounting
import numpy as np
import pytest
from scipy import stats
from sklearn import metrics

from dpmix_jax.privacy import audit


def appendix_p_value(m, r, v, eps, delta):
    """Steinke, Nasr, Jagielski (2023), Appendix D, transcribed loop by loop."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1.0)


def appendix_epsilon(m, r, v, delta, p):
    """Their bisection for the largest ε with p-value < p (run to 60 halvings)."""
    lo, hi = 0.0, 1.0
    while appendix_p_value(m, r, v, hi, delta) < p:
        hi += 1
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if appendix_p_value(m, r, v, mid, delta) < p else (lo, mid)
    return lo


@pytest.mark.parametrize(("m", "r", "v"), [(10, 4, 3), (200, 40, 33), (1000, 100, 90)])
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_steinke_p_value_matches_appendix(m, r, v, delta):
    for eps in (0.0, 0.5, 2.0, 6.0):
        got = audit.steinke_p_value(m, r, v, eps, delta)
        assert got == pytest.approx(appendix_p_value(m, r, v, eps, delta), rel=1e-10, abs=1e-14)


def test_steinke_two_guesses_by_hand():
    m, delta, eps = 50, 1e-4, 1.3
    q = math.exp(eps) / (1 + math.exp(eps))
    spread = max(2 * q * (1 - q), (2 * q * (1 - q) + (1 - q) ** 2) / 2)
    assert audit.steinke_p_value(m, 2, 2, eps, delta) == pytest.approx(
        q**2 + 2 * m * delta * spread, rel=1e-12
    )


def _canaries(rng, m, shift):
    included = rng.random(m) < 0.5
    return shift * included + rng.normal(size=m), included


def test_one_run_steinke_matches_appendix_bisection_and_perfect_guesses_by_hand():
    rng = np.random.default_rng(0)
    scores, included = _canaries(rng, 300, 2.0)
    for k, delta in [(10, 0.0), (40, 1e-5), (150, 1e-4)]:
        got = audit.one_run_epsilon_lower_bound(scores, included, delta=delta, num_guesses=k)
        order = np.argsort(-scores)
        v = int(included[order[:k]].sum() + (~included[order[-k:]]).sum())
        assert got.details["correct"] == v and got.details["guesses"] == 2 * k
        assert got.epsilon == pytest.approx(appendix_epsilon(300, 2 * k, v, delta, 0.05), abs=1e-9)
    # All r guesses right, δ = 0: P[B >= r] = q^r = α gives ε = ln(q / (1 - q)), q = α^(1/r).
    included = np.arange(100) % 2 == 0
    for k in (5, 25, 50):
        q = 0.05 ** (1 / (2 * k))
        got = audit.one_run_epsilon_lower_bound(
            included.astype(float), included, delta=0.0, num_guesses=k
        )
        assert got.epsilon == pytest.approx(math.log(q / (1 - q)), rel=1e-9)


def test_one_run_search_is_bonferroni_over_guess_counts():
    rng = np.random.default_rng(1)
    scores, included = _canaries(rng, 256, 1.5)
    searched = audit.one_run_epsilon_lower_bound(scores, included, delta=1e-5)
    counts = [1, 2, 4, 8, 16, 32, 64, 128]
    assert searched.details["level"] == pytest.approx(0.05 / len(counts))
    expected = max(
        audit.one_run_epsilon_lower_bound(
            scores, included, delta=1e-5, num_guesses=k, confidence=1 - 0.05 / len(counts)
        ).epsilon
        for k in counts
    )
    assert searched.epsilon == pytest.approx(expected)


def test_fdp_single_guess_recursion_is_exact_gdp_accuracy():
    # One canary, one guess: μ-GDP allows accuracy at most Φ(μ/2), so one correct guess
    # rejects μ-GDP at level α exactly when Φ(μ/2) < α, i.e. μ < 2 Φ⁻¹(α).
    for alpha in (0.7, 0.9, 0.99):
        edge = 2 * stats.norm.ppf(alpha)
        assert audit.fdp_rejects(1, 1, 1, edge - 1e-6, alpha)
        assert not audit.fdp_rejects(1, 1, 1, edge + 1e-6, alpha)


def test_gdp_epsilon_matches_dp_accounting_gaussian():
    for mu, delta in [(0.5, 1e-5), (1.0, 1e-5), (2.0, 1e-3)]:
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        accountant.compose(dp_accounting.GaussianDpEvent(1 / mu))
        assert audit.gdp_epsilon(mu, delta) == pytest.approx(accountant.get_epsilon(delta), 5e-3)


def test_one_run_bounds_are_valid_and_fdp_is_tighter_on_gaussian_canaries():
    # Scores N(μ, 1) for included canaries, N(0, 1) otherwise: each canary's score is μ-GDP.
    mu, delta, repeats = 2.0, 1e-5, 6
    true_eps = audit.gdp_epsilon(mu, delta)
    rng = np.random.default_rng(2)
    steinke, fdp = [], []
    for _ in range(repeats):
        scores, included = _canaries(rng, 1000, mu)
        steinke.append(audit.one_run_epsilon_lower_bound(scores, included, delta=delta).epsilon)
        bound = audit.one_run_epsilon_lower_bound(scores, included, delta=delta, method="fdp")
        assert bound.details["mu"] <= mu
        fdp.append(bound.epsilon)
    assert max(steinke) < true_eps and max(fdp) < true_eps
    assert np.mean(fdp) > np.mean(steinke) > 1.0


def test_one_run_without_signal_rarely_certifies_anything():
    rng = np.random.default_rng(3)
    positive = sum(
        audit.one_run_epsilon_lower_bound(
            rng.normal(size=200), rng.random(200) < 0.5, delta=0
        ).epsilon
        > 0
        for _ in range(100)
    )
    assert positive <= stats.binom.ppf(1 - 1e-4, 100, 0.05)


def test_one_run_rejects_bad_input():
    scores, included = np.arange(10.0), np.arange(10) % 2 == 0
    with pytest.raises(ValueError, match="included"):
        audit.one_run_epsilon_lower_bound(scores, included[:9], delta=1e-5)
    with pytest.raises(ValueError, match="included"):
        audit.one_run_epsilon_lower_bound(scores, included.astype(int), delta=1e-5)
    with pytest.raises(ValueError, match="num_guesses"):
        audit.one_run_epsilon_lower_bound(scores, included, delta=1e-5, num_guesses=6)
    with pytest.raises(ValueError, match="method"):
        audit.one_run_epsilon_lower_bound(scores, included, delta=1e-5, method="rdp")
    with pytest.raises(ValueError, match="delta"):
        audit.one_run_epsilon_lower_bound(scores, included, delta=1.0)


def test_auroc_and_tpr_at_fpr_match_sklearn_and_exact_binomial_interval():
    rng = np.random.default_rng(4)
    with_ = np.round(rng.normal(1, 1, 300), 1)  # ties
    without = np.round(rng.normal(0, 1, 400), 1)
    labels = np.r_[np.ones(300), np.zeros(400)]
    pooled = np.r_[with_, without]
    assert audit.auroc(with_, without) == pytest.approx(metrics.roc_auc_score(labels, pooled))
    fpr, tpr, _ = metrics.roc_curve(labels, pooled)
    for level in (0.0, 0.01, 0.1, 0.5):
        got = audit.tpr_at_fpr(with_, without, fpr_level=level)
        assert got.tpr == pytest.approx(tpr[fpr <= level].max()) and got.fpr <= level
        exact = stats.binomtest(round(got.tpr * 300), 300).proportion_ci(0.95, method="exact")
        assert (got.tpr_low, got.tpr_high) == pytest.approx((exact.low, exact.high), abs=1e-9)
    with pytest.raises(ValueError, match="fpr_level"):
        audit.tpr_at_fpr(with_, without, fpr_level=1.0)


def test_bootstrap_interval_matches_scipy_and_normal_theory():
    rng = np.random.default_rng(5)
    sample = rng.normal(3.0, 2.0, 500)
    low, high = audit.bootstrap_interval(np.mean, sample, resamples=4000)
    half = 1.96 * sample.std(ddof=1) / math.sqrt(500)
    assert low == pytest.approx(sample.mean() - half, abs=0.03)
    assert high == pytest.approx(sample.mean() + half, abs=0.03)
    reference = stats.bootstrap(
        (sample,), np.mean, n_resamples=4000, method="percentile", random_state=0
    ).confidence_interval
    assert (low, high) == pytest.approx((reference.low, reference.high), abs=0.03)
    # Two samples resampled independently: an interval for AUROC around the truth Φ(1/√2).
    with_, without = rng.normal(1, 1, 400), rng.normal(0, 1, 400)
    low, high = audit.bootstrap_interval(audit.auroc, with_, without, resamples=300)
    assert low < stats.norm.cdf(1 / math.sqrt(2)) < high and high - low < 0.1
    with pytest.raises(ValueError, match="resamples"):
        audit.bootstrap_interval(np.mean, sample, resamples=5)


def test_fixed_test_bound_by_hand():
    with_, without = np.arange(10) + 100.0, np.arange(10.0)
    got = audit.epsilon_lower_bound_at(
        with_, without, threshold=50.0, direction="greater", delta=1e-5
    )
    tpr_low = 0.025 ** (1 / 10)
    assert got.epsilon == pytest.approx(math.log((tpr_low - 1e-5) / (1 - tpr_low)))
    with pytest.raises(ValueError, match="direction"):
        audit.epsilon_lower_bound_at(with_, without, threshold=1.0, direction="up", delta=1e-5)
