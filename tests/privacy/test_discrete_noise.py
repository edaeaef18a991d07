"""Exact discrete noise: the samplers' laws against exact pmfs, and their accounting.

Statistical checks use fixed seeds and 200,000 draws; a binomial or moment check allows 5
standard errors (false-alarm rate < 1e-6 per check), a chi-square check needs p > 1e-4. Each
chi-square check is shown to have power: the same draws against a slightly different law fail.
The accounting is compared with brute force: the privacy loss distribution of the exact pmfs
enumerated on a truncated support (mass outside < 1e-30), and its hockey-stick divergence.
"""

import math
from fractions import Fraction

import numpy as np
import pytest
from scipy import stats

from dpmix_jax.privacy import accounting
from dpmix_jax.privacy import discrete_noise as dn

N = 200_000
Z = 5.0

LAPLACE_SCALES = [Fraction(3, 2), 2 / 0.3, 5]
GAUSSIAN_SIGMA2 = [Fraction(1, 2), 4, 30]


def draw(kind, parameter, seed, size=N):
    rng = np.random.default_rng(seed)
    if kind == "laplace":
        return dn.discrete_laplace(size, parameter, rng)
    return dn.discrete_gaussian(size, parameter, rng)


def pmf(kind, parameter, x):
    if kind == "laplace":
        return dn.discrete_laplace_pmf(x, float(parameter))
    return dn.discrete_gaussian_pmf(x, float(parameter))


def chi_square_pvalue(samples, probabilities_of, width):
    """Chi-square p-value of integer samples against a law, bins -width..width plus two tails."""
    support = np.arange(-width, width + 1)
    inner = probabilities_of(support)
    tail = (1 - inner.sum()) / 2
    expected = np.concatenate([[tail], inner, [tail]]) * samples.size
    clipped = np.clip(samples, -width - 1, width + 1) + width + 1
    observed = np.bincount(clipped, minlength=2 * width + 3)
    return stats.chisquare(observed, expected).pvalue


CASES = [("laplace", s) for s in LAPLACE_SCALES] + [("gaussian", s) for s in GAUSSIAN_SIGMA2]


def _width(kind, parameter):
    spread = float(parameter) if kind == "laplace" else math.sqrt(float(parameter))
    return max(3, int(4 * spread))


@pytest.mark.parametrize("kind,parameter", CASES)
def test_pmf_chi_square_and_power(kind, parameter):
    samples = draw(kind, parameter, seed=1)
    assert samples.dtype == np.int64
    width = _width(kind, parameter)
    assert chi_square_pvalue(samples, lambda x: pmf(kind, parameter, x), width) > 1e-4
    # Power: a 10% larger parameter is rejected by the same test on the same draws.
    wrong = float(parameter) * 1.1
    assert chi_square_pvalue(samples, lambda x: pmf(kind, wrong, x), width) < 1e-6


@pytest.mark.parametrize("kind,parameter", CASES)
def test_mean_variance_symmetry_and_tails(kind, parameter):
    samples = draw(kind, parameter, seed=2).astype(float)
    bound = int(80 * max(float(parameter), math.sqrt(float(parameter)))) + 80
    support = np.arange(-bound, bound + 1)
    law = pmf(kind, parameter, support)
    assert abs(law.sum() - 1) < 1e-12
    variance = float(np.sum(law * support**2))
    fourth = float(np.sum(law * support**4))
    if kind == "laplace":
        assert variance == pytest.approx(dn.discrete_laplace_variance(float(parameter)), 1e-10)
    else:
        # CKS 2020, Proposition 19: variance < σ² (by an amount below float resolution
        # once σ² >= 4).
        assert variance < float(parameter) * (1 + 1e-12)
        if float(parameter) < 1:
            assert variance < float(parameter) - 1e-4
    assert abs(samples.mean()) <= Z * math.sqrt(variance / N)
    assert abs(samples.var() - variance) <= Z * math.sqrt((fourth - variance**2) / N)
    positive, negative = int(np.sum(samples > 0)), int(np.sum(samples < 0))
    assert abs(positive - negative) <= Z * math.sqrt(positive + negative)
    for k in (1, 2, _width(kind, parameter) // 2, _width(kind, parameter)):
        exact = float(law[np.abs(support) >= k].sum())
        empirical = float(np.mean(np.abs(samples) >= k))
        assert abs(empirical - exact) <= Z * math.sqrt(exact * (1 - exact) / N) + 1e-12


@pytest.mark.parametrize(
    "gamma", [Fraction(0), Fraction(1, 3), Fraction(1), Fraction(3, 2), Fraction(7, 2), Fraction(5)]
)
def test_bernoulli_exp_probability(gamma):
    rng = np.random.default_rng(3)
    num = np.full(N, gamma.numerator)
    den = np.full(N, gamma.denominator)
    hits = dn.bernoulli_exp(num, den, rng)
    target = math.exp(-gamma)
    if gamma == 0:
        assert hits.all()
    assert abs(hits.mean() - target) <= Z * math.sqrt(target * (1 - target) / N) + 1e-12


def test_bernoulli_exp_mixed_parameters_in_one_call():
    rng = np.random.default_rng(4)
    gammas = [Fraction(1, 5), Fraction(9, 4), Fraction(2)]
    num = np.repeat([g.numerator for g in gammas], N // 4)
    den = np.repeat([g.denominator for g in gammas], N // 4)
    hits = dn.bernoulli_exp(num, den, rng).reshape(len(gammas), -1)
    for row, gamma in zip(hits, gammas, strict=True):
        target = math.exp(-gamma)
        assert abs(row.mean() - target) <= Z * math.sqrt(target * (1 - target) / row.size)


def test_reproducible_from_generator_and_secret_by_default():
    a = dn.discrete_gaussian((4, 5), 9, np.random.default_rng(7))
    b = dn.discrete_gaussian((4, 5), 9, np.random.default_rng(7))
    np.testing.assert_array_equal(a, b)
    assert a.shape == (4, 5)
    assert not np.array_equal(dn.discrete_laplace(1000, 50), dn.discrete_laplace(1000, 50))


def test_parameters_exact_fractions_and_clear_errors():
    assert dn.as_fraction(0.1, "scale") == Fraction(0.1)  # the float's exact binary value
    assert Fraction(0.1) != Fraction(1, 10)
    with pytest.raises(ValueError, match="scale = 1e-30 is the fraction"):
        dn.discrete_laplace(3, 1e-30)
    assert dn.as_fraction(Fraction(2, 3), "scale") == Fraction(2, 3)
    with pytest.raises(ValueError, match="sigma2"):
        dn.discrete_gaussian(3, 0.1)  # exact fraction 3602879701896397/2**55: too large
    with pytest.raises(ValueError, match="scale must be a finite number > 0"):
        dn.discrete_laplace(3, 0)
    with pytest.raises(ValueError, match="sigma2 must be"):
        dn.discrete_gaussian(3, float("nan"))
    with pytest.raises(ValueError, match="rng"):
        dn.discrete_laplace(3, 1, rng=0)
    with pytest.raises(ValueError, match="sensitivities"):
        dn.discrete_laplace_event(2, (0,))


# --------------------------------------------------------------------------------------------
# Accounting against brute force.
# --------------------------------------------------------------------------------------------


def loss_distribution(kind, parameter, sensitivity):
    """(numerators k, probabilities, unit): the loss ln P(x)/Q(x) = k·unit, x ~ P = noise,
    Q = noise + sensitivity, accumulated on its integer lattice."""
    bound = int(40 * max(float(parameter), math.sqrt(float(parameter)))) + 40
    x = np.arange(-bound, bound + 1)
    p = pmf(kind, parameter, x)
    if kind == "laplace":
        numerators, unit = np.abs(x - sensitivity) - np.abs(x), 1 / float(parameter)
    else:
        numerators, unit = (x - sensitivity) ** 2 - x**2, 1 / (2 * float(parameter))
    return numerators, p, unit


def composed(parts):
    """(losses, probabilities) of the sum of independent losses (convolution on the lattice)."""
    unit = parts[0][2]
    low = sum(int(k.min()) for k, _, _ in parts)
    probs = np.ones(1)
    for numerators, p, _ in parts:
        dense = np.bincount(numerators - numerators.min(), weights=p)
        probs = np.convolve(probs, dense)
    return (low + np.arange(probs.size)) * unit, probs


def brute_force_epsilon(losses, probs, delta):
    """The smallest ε with Σ p·max(0, 1 - e^(ε - loss)) <= delta (bisection)."""

    def hockey(eps):
        return float(np.sum(probs * np.maximum(0.0, -np.expm1(eps - losses))))

    lo, hi = 0.0, float(losses.max())
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if hockey(mid) <= delta else (mid, hi)
    return hi


@pytest.mark.parametrize("scale", [2.0, Fraction(5, 2), 10.0])
def test_discrete_laplace_event_matches_brute_force(scale):
    delta = 1e-5
    event = dn.discrete_laplace_event(scale, (1, 1))  # one vote moved: two coordinates by 1
    reported = accounting.epsilon(event, delta=delta)
    part = loss_distribution("laplace", scale, 1)
    exact = brute_force_epsilon(*composed([part, part]), delta)
    assert exact - 1e-9 <= reported <= exact + 2e-3
    assert reported <= 2 / float(scale) + 1e-9  # the pure-DP bound Δ₁/t


@pytest.mark.parametrize("sigma2", [4, Fraction(25, 2)])
def test_discrete_gaussian_epsilon_matches_brute_force(sigma2):
    delta = 1e-5
    reported = dn.discrete_gaussian_epsilon(sigma2, (1, 1), delta=delta)
    part = loss_distribution("gaussian", sigma2, 1)
    exact = brute_force_epsilon(*composed([part, part]), delta)
    assert exact - 1e-9 <= reported <= exact + 2e-3
    # Two calls: the self-composition.
    twice = dn.discrete_gaussian_epsilon(sigma2, (1, 1), count=2, delta=delta)
    exact_twice = brute_force_epsilon(*composed([part] * 4), delta)
    assert exact_twice - 1e-9 <= twice <= exact_twice + 4e-3


@pytest.mark.parametrize("sigma2", [Fraction(1, 2), 4, 30])
def test_discrete_gaussian_rho_bounds_exact_renyi_divergence(sigma2):
    rho = dn.discrete_gaussian_rho(sigma2, (1, 1))
    assert rho == pytest.approx(1 / float(sigma2))
    losses, probs = composed([loss_distribution("gaussian", sigma2, 1)])
    losses, probs = losses[probs > 0], probs[probs > 0]
    for order in (1.5, 2.0, 4.0, 16.0):
        # D_α(P‖Q) = ln E_P[e^((α-1)·loss)] / (α-1); two independent coordinates add.
        log_moment = np.logaddexp.reduce(np.log(probs) + (order - 1) * losses)
        per_coordinate = float(log_moment) / (order - 1)
        assert 2 * per_coordinate <= order * rho + 1e-12
        assert 2 * per_coordinate >= 0.5 * order * rho  # the bound is not loose by much


def test_python_integer_bernoulli_exp_of_the_overflow_path():
    # The discrete Gaussian's path for |Y| too large for int64 squares (astronomically rare).
    rng = np.random.default_rng(6)
    # num beyond int64, den below 2**63 as there (checked by `_sigma2_terms`); γ ≈ 1.5 and 2.
    for num, den in [(3, 2), (2**63 + 12345, 2**62 - 1)]:
        hits = np.array([dn._bernoulli_exp_python(rng, num, den) for _ in range(20_000)])
        target = math.exp(-num / den)
        assert abs(hits.mean() - target) <= Z * math.sqrt(target * (1 - target) / hits.size)
