"""PATE accounting: event normalisation, and the PATE 2018 data-dependent analysis."""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import integrate, special, stats

from dpmix_jax.pate import accounting
from dpmix_jax.privacy.accounting import PrivacyLedger, epsilon
from tests.pate.test_aggregators import all_histograms, neighbours

ORDERS = accounting.DEFAULT_ORDERS


def test_laplace_event_is_epsilon_per_call():
    assert accounting.epsilon_of_steps(
        accounting.dpargmax_laplace_event(0.7), steps=1, delta=1e-9
    ) == pytest.approx(0.7, abs=2e-3)
    # Adaptive composition of 20 calls is at most 20·ε (basic composition) and much less at δ > 0.
    many = accounting.epsilon_of_steps(
        accounting.dpargmax_laplace_event(0.1), steps=400, delta=1e-6
    )
    assert many < 0.5 * 400 * 0.1


def test_confident_gnmax_event_is_one_gaussian_of_combined_sensitivity():
    s1, s2 = 3.0, 2.0
    # μ² adds up: (1/σ1)² + (√2/σ2)², so the pair is one Gaussian with 1/σ² = 1/σ1² + 2/σ2².
    combined = 1 / math.sqrt(1 / s1**2 + 2 / s2**2)
    ours = accounting.epsilon_of_steps(
        accounting.confident_gnmax_event(s1, s2), steps=5, delta=1e-5
    )
    ref = epsilon(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(combined), 5), delta=1e-5
    )
    assert ours == pytest.approx(ref, rel=2e-3)


def test_pate_ledger_adds_per_call_delta_and_round_trips():
    ledger = accounting.PateLedger()
    ledger.record(accounting.dpws_event(0.5), 3, delta=1e-7)
    ledger.record(accounting.dpargmax_laplace_event(0.2))
    budget = ledger.budget(1e-6)
    assert budget.delta == pytest.approx(1e-6 + 3e-7)
    assert budget.epsilon <= 3 * 0.5 + 0.2 + 1e-3  # at most basic composition
    laplace_only = PrivacyLedger()
    laplace_only.record(dp_accounting.LaplaceDpEvent(2.0), 3)
    laplace_only.record(dp_accounting.LaplaceDpEvent(5.0))
    assert budget.epsilon == pytest.approx(laplace_only.epsilon(1e-6))
    restored = accounting.PateLedger.from_state_dict(ledger.state_dict())
    assert restored.budget(1e-6) == budget and restored.count == 4
    with pytest.raises(ValueError, match="delta"):
        ledger.record(accounting.dpws_event(1.0), delta=-1.0)


def test_gnmax_log_q_is_proposition_7():
    sigma = 2.0
    counts = np.array([10, 4, 0])
    expected = 0.5 * math.erfc(6 / (2 * sigma)) + 0.5 * math.erfc(10 / (2 * sigma))
    assert math.exp(accounting.gnmax_log_q(counts, sigma)) == pytest.approx(expected, rel=1e-9)
    # Capped at 1 - 1/V.
    assert accounting.gnmax_log_q(np.array([1, 1, 1]), 5.0) == pytest.approx(math.log(2 / 3))


def test_log_pr_answered_is_gaussian_tail_of_rounded_max():
    counts = np.array([3.4, 7.6, 1.0])
    expected = 0.5 * math.erfc((10 - 8) / (4.0 * math.sqrt(2)))
    assert math.exp(accounting.log_pr_answered(counts, 10, 4.0)) == pytest.approx(expected)


def theorem6_by_hand(q, sigma, order):
    """Theorem 6 of Papernot et al. (2018) in plain arithmetic (no logs)."""
    mu2 = math.sqrt(sigma**2 * math.log(1 / q))
    mu1 = mu2 + 1
    eps1, eps2 = mu1 / sigma**2, mu2 / sigma**2
    a = (1 - q) / (1 - (math.exp(eps2) * q) ** ((mu2 - 1) / mu2))
    b = math.exp(eps1) / q ** (1 / (mu1 - 1))
    bound = math.log((1 - q) * a ** (order - 1) + q * b ** (order - 1)) / (order - 1)
    return min(order / sigma**2, bound)


@pytest.mark.parametrize("order", [2.0, 5.0, 10.0])
def test_data_dependent_rdp_matches_theorem_6_by_hand(order):
    sigma = 40.0
    log_q = accounting.gnmax_log_q(np.array([200, 30, 20]), sigma)
    q = math.exp(log_q)
    got = accounting.rdp_data_dependent_gaussian(log_q, sigma, np.array([order]))[0]
    assert got == pytest.approx(theorem6_by_hand(q, sigma, order), rel=1e-9)
    assert got < order / sigma**2  # peaked histogram: cheaper than data-independent


def test_data_dependent_rdp_never_exceeds_data_independent():
    rng = np.random.default_rng(0)
    for _ in range(200):
        sigma = rng.uniform(0.5, 100)
        log_q = -rng.exponential(5.0)
        rdp = accounting.rdp_data_dependent_gaussian(log_q, sigma, ORDERS)
        assert np.all(rdp <= ORDERS / sigma**2 + 1e-12) and np.all(rdp >= 0)
    np.testing.assert_allclose(  # q = 1/2: no saving possible
        accounting.rdp_data_dependent_gaussian(math.log(0.5), 5.0, ORDERS), ORDERS / 25.0
    )


def test_report_unanswered_pay_only_threshold_and_peaked_pay_little():
    n, threshold, s1, s2, delta = 250, 200, 150.0, 40.0, 1e-5
    peaked = np.tile([n, 0, 0, 0], (100, 1))
    all_answered = accounting.confident_gnmax_report(
        peaked, np.ones(100, bool), threshold=threshold, sigma1=s1, sigma2=s2, delta=delta
    )
    assert all_answered.epsilon_data_dependent < 0.5 * all_answered.epsilon_data_independent_rdp
    assert all_answered.epsilon_data_independent <= all_answered.epsilon_data_independent_rdp

    flat = np.tile([63, 63, 62, 62], (100, 1))
    unanswered = accounting.confident_gnmax_report(
        flat, np.zeros(100, bool), threshold=threshold, sigma1=s1, sigma2=s2, delta=delta
    )
    answered = accounting.confident_gnmax_report(
        flat, np.ones(100, bool), threshold=threshold, sigma1=s1, sigma2=s2, delta=delta
    )
    # Unanswered: only the threshold check's RDP, computed by hand here (data-independent part).
    rdp_check = np.zeros_like(ORDERS)
    log_pr = accounting.log_pr_answered(flat[0], threshold, s1)
    log_q = min(log_pr, math.log(-math.expm1(log_pr)))
    rdp_check = 100 * accounting.rdp_data_dependent_gaussian(log_q, math.sqrt(2) * s1, ORDERS)
    expected = accounting.rdp_to_epsilon(rdp_check, ORDERS, delta)[0]
    assert unanswered.epsilon_data_dependent == pytest.approx(expected)
    assert unanswered.epsilon_data_dependent < answered.epsilon_data_dependent
    for report in (all_answered, unanswered, answered):
        assert report.epsilon_data_dependent <= report.epsilon_data_independent_rdp + 1e-12
    assert unanswered.num_answered == 0 and answered.num_answered == 100


def test_report_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="answered"):
        accounting.confident_gnmax_report(
            np.ones((3, 4)), np.ones(2, bool), threshold=1, sigma1=1, sigma2=1, delta=1e-5
        )


def renyi_divergence(p, q, order):
    """D_λ(P || Q) of two distributions on the same finite outcomes."""
    return special.logsumexp(order * np.log(p) + (1 - order) * np.log(q)) / (order - 1)


def gnmax_output_probabilities(counts, sigma):
    """Pr[argmax_j (c_j + N(0, σ²)) = j] for every j, by numerical integration over the
    winner's noise: ∫ φ_σ(z) Π_{k≠j} Φ((c_j + z - c_k)/σ) dz."""
    counts = np.asarray(counts, float)
    probs = []
    for j, own in enumerate(counts):
        others = np.delete(counts, j)
        centre = others.max() - own  # where the integrand's mass is for a losing token

        def density(z, own=own, others=others):
            return stats.norm.pdf(z, scale=sigma) * np.prod(
                stats.norm.cdf((own + z - others) / sigma)
            )

        value, _ = integrate.quad(
            density,
            centre - 12 * sigma - 20,
            centre + 12 * sigma + 20,
            points=[centre],
            limit=500,
            epsabs=0,
            epsrel=1e-10,
        )
        probs.append(value)
    return np.array(probs)


@pytest.mark.parametrize(
    ("sigma", "n", "vocab", "order"),
    [(1.0, 10, 2, 3.0), (0.7, 10, 3, 2.0), (0.7, 10, 3, 5.0), (1.5, 12, 3, 3.0)],
)
def test_data_dependent_gnmax_rdp_bounds_the_exact_divergence_of_every_neighbour(
    sigma, n, vocab, order
):
    # Every histogram of n votes over V tokens: the exact Rényi divergence of GNMax's output
    # distribution to that of each one-vote-move neighbour never exceeds Theorem 6's bound.
    probs = {c: gnmax_output_probabilities(c, sigma) for c in all_histograms(n, vocab)}
    cheaper = 0
    for counts, p in probs.items():
        log_q = accounting.gnmax_log_q(np.array(counts, float), sigma)
        bound = accounting.rdp_data_dependent_gaussian(log_q, sigma, np.array([order]))[0]
        exact = max(renyi_divergence(p, probs[other], order) for other in neighbours(counts))
        assert exact <= bound * (1 + 1e-6) + 1e-12, counts
        cheaper += bound < order / sigma**2 - 1e-9
    assert cheaper >= 4  # the data-dependent branch is exercised, not only λ/σ²


@pytest.mark.parametrize(("threshold", "sigma"), [(7.0, 1.5), (9.0, 1.0), (5.0, 2.0)])
@pytest.mark.parametrize("order", [2.0, 3.0, 4.0])
def test_data_dependent_threshold_rdp_bounds_the_exact_divergence(threshold, sigma, order):
    # The check's output is answered or not, Bernoulli(Pr[max c + N(0, σ1²) >= T]); one vote
    # move changes max c by at most 1 (n = 10 votes over V = 3 tokens: max c in [4, 10]).
    def answered(top):
        return float(stats.norm.sf(threshold - top, scale=sigma))

    cheaper = 0
    for top in range(4, 11):
        counts = np.array([top, 10 - top, 0], float)
        log_pr = accounting.log_pr_answered(counts, threshold, sigma)
        log_q = min(log_pr, math.log(-math.expm1(log_pr)))
        bound = accounting.rdp_data_dependent_gaussian(
            log_q, math.sqrt(2) * sigma, np.array([order])
        )[0]
        here = [answered(top), 1 - answered(top)]
        for other in (top - 1, top + 1):
            if 4 <= other <= 10:
                there = [answered(other), 1 - answered(other)]
                assert renyi_divergence(here, there, order) <= bound * (1 + 1e-6) + 1e-12
        cheaper += bound < order / (2 * sigma**2) - 1e-9
    assert cheaper >= 1


@pytest.mark.parametrize(("sigma1", "sigma2", "queries"), [(150.0, 40.0, 100), (4.0, 2.0, 3)])
def test_data_independent_rdp_is_dp_accountings_rdp_of_the_gaussians(sigma1, sigma2, queries):
    # The report's data-independent RDP curve is dp_accounting's RDP of the composed Gaussian
    # events: converted by dp_accounting's own conversion it gives the RDP accountant's ε.
    delta = 1e-5
    flat = np.tile([3, 3, 2, 2], (queries, 1))
    report = accounting.confident_gnmax_report(
        flat, np.ones(queries, bool), threshold=3, sigma1=sigma1, sigma2=sigma2, delta=delta
    )
    curve = queries * (ORDERS / (2 * sigma1**2) + ORDERS / sigma2**2)
    rdp = dp_accounting.rdp.RdpAccountant(list(ORDERS))
    rdp.compose(accounting.confident_gnmax_event(sigma1, sigma2), queries)
    converted, _ = rdp_privacy_accountant.compute_epsilon(ORDERS, curve, delta)
    assert converted == pytest.approx(rdp.get_epsilon(delta), rel=1e-9)
    # Our conversion is the classic one, ε = min_λ R(λ) + ln(1/δ)/(λ - 1), which is
    # dp_accounting's without its improvement log(1 - 1/λ) - ln(λ)/(λ - 1) < 0: never below it.
    classic = min(curve + math.log(1 / delta) / (ORDERS - 1))
    assert report.epsilon_data_independent_rdp == pytest.approx(classic, rel=1e-12)
    assert report.epsilon_data_independent_rdp >= converted
    # A tie at the threshold and between the top tokens: the data-dependent analysis saves
    # nothing, and its ε is the same classic conversion of the same curve.
    assert report.epsilon_data_dependent == pytest.approx(classic, rel=1e-9)
    assert report.epsilon_data_independent <= converted  # PLD is tighter than RDP


def test_rdp_to_epsilon_is_the_classic_conversion_and_not_below_dp_accountings():
    rng = np.random.default_rng(1)
    for _ in range(50):
        curve = ORDERS * rng.uniform(1e-4, 0.5) + rng.uniform(0, 0.1)
        delta = 10.0 ** rng.uniform(-10, -3)
        eps, order = accounting.rdp_to_epsilon(curve, ORDERS, delta)
        by_hand = [r + math.log(1 / delta) / (a - 1) for r, a in zip(curve, ORDERS, strict=True)]
        assert eps == pytest.approx(min(by_hand), rel=1e-12)
        assert order == ORDERS[int(np.argmin(by_hand))]
        improved, _ = rdp_privacy_accountant.compute_epsilon(ORDERS, curve, delta)
        assert improved <= eps
