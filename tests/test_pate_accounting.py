"""PATE accounting: event normalisation, and the PATE 2018 data-dependent analysis."""

import math

import dp_accounting
import numpy as np
import pytest

from dpmix_jax.pate import accounting
from dpmix_jax.privacy.accounting import PrivacyLedger, epsilon

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
