"""Smooth-sensitivity release of confident-GNMax's data-dependent ε, against direct computations.

The direct computation enumerates every histogram of n votes over V tokens, evaluates the same
data-dependent RDP R on each, takes the true local sensitivity LS(y) = max over the vote-move
neighbours y' of |R(y) - R(y')|, and the true smooth sensitivity
SS(x) = max_y e^{-β·d(x, y)}·LS(y) with d = the number of vote moves (half the L1 distance).
The library's bound must never be below it (that would break privacy) and stays within 3x of it
(the PATE 2018 bounds on how far one vote move takes q are worst cases over the other tokens).
"""

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant

from dpmix_jax.pate import accounting
from dpmix_jax.pate import smooth_sensitivity as ss
from tests.pate.test_aggregators import all_histograms, neighbours


def true_smooth_sensitivity(rdp_of, n, vocab, x, beta):
    table = {c: rdp_of(np.array(c, float)) for c in all_histograms(n, vocab)}
    local = {c: max(abs(table[c] - table[d]) for d in neighbours(c)) for c in table}
    return max(
        local[y] * math.exp(-beta * sum(abs(a - b) for a, b in zip(x, y, strict=True)) / 2)
        for y in table
    ), local[tuple(x)]


HISTOGRAMS = [(10, 0, 0), (9, 1, 0), (8, 1, 1), (7, 2, 1), (6, 3, 1), (4, 3, 3)]


@pytest.mark.parametrize("x", HISTOGRAMS)
@pytest.mark.parametrize(("sigma", "order"), [(1.0, 3.0), (0.7, 5.0)])
def test_gnmax_smooth_sensitivity_bounds_the_enumerated_one(x, sigma, order):
    n, vocab, beta = 10, 3, 0.49 / order

    def rdp_of(c):
        return ss._rdp_gnmax(accounting.gnmax_log_q(c, sigma), sigma, order)

    true_ss, true_ls = true_smooth_sensitivity(rdp_of, n, vocab, x, beta)
    ours = ss.gnmax_local_sensitivity(np.array(x, float), sigma, order)
    assert ours[0] >= true_ls - 1e-12
    got = ss.smooth_sensitivity(ours, beta)
    assert true_ss - 1e-12 <= got <= 3 * true_ss + 1e-9


def test_gnmax_rdp_of_the_analysis_is_the_accountants_rdp():
    # The released R must be the function whose sensitivity is bounded: the analysis' R equals
    # the accountant's data-dependent RDP (Theorem 6 with its checks) on every small histogram.
    sigma, order = 1.0, 3.0
    for c in all_histograms(10, 3):
        log_q = accounting.gnmax_log_q(np.array(c, float), sigma)
        expected = accounting.rdp_data_dependent_gaussian(log_q, sigma, np.array([order]))[0]
        assert ss._rdp_gnmax(log_q, sigma, order) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("sigma", "order"), [(1.0, 3.0), (0.7, 5.0), (4.0, 8.0)])
def test_released_rdp_above_q0_is_dp_accountings_rdp_of_the_gaussian(sigma, order):
    # Above q0 the analysis' R is the data-independent λ/σ²: dp_accounting's RDP at λ of GNMax's
    # Gaussian (L2 sensitivity √2, noise σ); compared through dp_accounting's conversion at λ.
    log_q0 = ss._log_q0(sigma, order)
    accountant = dp_accounting.rdp.RdpAccountant([order])
    accountant.compose(dp_accounting.GaussianDpEvent(sigma / math.sqrt(2)))
    for log_q in (log_q0, log_q0 / 2, math.log(0.5)):
        ours = ss._rdp_gnmax(log_q, sigma, order)
        converted, _ = rdp_privacy_accountant.compute_epsilon([order], [ours], 1e-5)
        assert converted == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    # Below q0 the data-dependent value is smaller.
    assert ss._rdp_gnmax(2 * log_q0, sigma, order) < order / sigma**2
    assert ss._data_dependent_bound(log_q0, sigma, order) <= order / sigma**2 * (1 + 1e-9)


@pytest.mark.parametrize("x", HISTOGRAMS)
def test_threshold_smooth_sensitivity_bounds_the_enumerated_one(x):
    n, vocab, threshold, sigma, order = 10, 3, 7.0, 1.5, 4.0
    beta = 0.49 / order

    def rdp_of(c):
        return ss._threshold_rdp(int(round(c.max())), threshold, sigma, order)

    true_ss, true_ls = true_smooth_sensitivity(rdp_of, n, vocab, x, beta)
    ours = ss.threshold_local_sensitivity(np.array(x, float), threshold, sigma, order)
    assert ours[0] >= true_ls - 1e-12
    got = ss.smooth_sensitivity(ours, beta)
    assert true_ss - 1e-12 <= got <= 3 * true_ss + 1e-9


def test_gnss_rdp_is_theorem_23_by_hand():
    beta, sigma, order = 0.05, 2.0, 4.0
    expected = 4 * math.exp(0.1) / 4 + (0.2 - 0.5 * math.log(1 - 0.4)) / 3
    assert ss.gnss_rdp(beta, sigma, order) == pytest.approx(expected)
    with pytest.raises(ValueError, match="beta"):
        ss.gnss_rdp(0.2, sigma, order)  # β >= 1/(2λ)


def test_release_is_the_data_dependent_rdp_plus_its_cost_plus_gaussian_noise():
    hist = np.array([[9, 1, 0], [4, 3, 3], [10, 0, 0]])
    answered = np.array([True, False, True])
    kwargs = dict(threshold=7.0, sigma1=1.5, sigma2=1.0, order=3.0, noise_multiplier=0.5)
    releases = [
        ss.release_data_dependent_epsilon(hist, answered, delta=1e-5, seed=s, **kwargs)
        for s in range(400)
    ]
    first = releases[0]
    # Noise-free value: R at λ (threshold part for every query, GNMax part for answered ones)
    # + the release's RDP + the RDP-to-DP conversion term.
    r = sum(ss._threshold_rdp(int(c.max()), 7.0, 1.5, 3.0) for c in hist) + sum(
        ss._rdp_gnmax(accounting.gnmax_log_q(c, 1.0), 1.0, 3.0) for c in hist[[0, 2]]
    )
    cost = ss.gnss_rdp(0.49 / 3, 0.5, 3.0)
    assert first.release_rdp == pytest.approx(cost)
    assert first.epsilon_noise_free == pytest.approx(r + cost + math.log(1e5) / 2)
    ls = sum(ss.threshold_local_sensitivity(c, 7.0, 1.5, 3.0) for c in hist) + sum(
        ss.gnmax_local_sensitivity(c, 1.0, 3.0) for c in hist[[0, 2]]
    )
    assert first.smooth_sensitivity == pytest.approx(ss.smooth_sensitivity(ls, 0.49 / 3))
    assert first.noise_std == pytest.approx(0.5 * first.smooth_sensitivity)
    noise = np.array([r.epsilon - r.epsilon_noise_free for r in releases])
    assert abs(noise.mean()) < 4 * first.noise_std / math.sqrt(len(noise))
    assert noise.std() == pytest.approx(first.noise_std, rel=0.15)
    assert all(r.seeded for r in releases)
    assert not ss.release_data_dependent_epsilon(hist, answered, delta=1e-5, **kwargs).seeded


def test_release_rejects_bad_inputs():
    with pytest.raises(ValueError, match="histograms"):
        ss.release_data_dependent_epsilon(
            np.zeros((2, 3)), np.zeros(3, bool), threshold=1, sigma1=1, sigma2=1, order=3.0,
            noise_multiplier=1.0, delta=1e-5,
        )  # fmt: skip
    with pytest.raises(ValueError, match="noise_multiplier"):
        ss.release_data_dependent_epsilon(
            np.ones((1, 3)), np.ones(1, bool), threshold=1, sigma1=1, sigma2=1, order=3.0,
            noise_multiplier=0.0, delta=1e-5,
        )  # fmt: skip


def test_chosen_release_minimises_the_published_epsilon_of_the_public_hypothetical():
    public = dict(threshold=20.0, sigma1=4.0, sigma2=2.0)
    n, classes, queries, delta = 40, 10, 3, 1e-5
    choice = ss.choose_release(
        num_queries=queries, num_teachers=n, num_classes=classes, delta=delta, **public
    )
    hist = np.zeros((queries, classes))
    hist[:, 0], hist[:, 1] = 30, 10  # agreement 0.75: 30 of 40 votes on one token

    def objective(order, beta, noise_multiplier):
        release = ss.release_data_dependent_epsilon(
            hist, np.ones(queries, bool), order=order, beta=beta, delta=delta,
            noise_multiplier=noise_multiplier, seed=0, **public,
        )  # fmt: skip
        return release.epsilon_noise_free + 2 * release.noise_std

    # The prediction is the direct release computation on the stacked hypothetical queries.
    assert choice.predicted_epsilon == pytest.approx(
        objective(choice.order, choice.beta, choice.noise_multiplier), rel=1e-9
    )
    assert 0 < choice.beta < 1 / (2 * choice.order)
    # ... and beats the fixed choice λ = 8, σ_s = 2, β = 0.49/λ.
    assert choice.predicted_epsilon <= objective(8.0, 0.49 / 8, 2.0)
