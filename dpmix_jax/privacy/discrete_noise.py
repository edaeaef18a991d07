"""Exact discrete noise for integer statistics: Bernoulli(exp(-γ)), discrete Laplace and Gaussian.

The samplers of Canonne, Kamath and Steinke 2020 ("The Discrete Gaussian for Differential
Privacy", Algorithms 1-3), vectorised over numpy arrays: every decision compares uniform integers
(`numpy.random.Generator.integers`, exactly uniform) with integers, so the output law is exactly
the stated one; no floating-point number enters a sampling decision (floating-point samplers are
open to precision attacks, Mironov 2012). Rejection loops run on the entries still pending until
every entry is accepted.

Parameters are exact rationals (`fractions.Fraction`). A float is taken as the exact Fraction of
its binary value (`Fraction(0.1)` is 3602879701896397/36028797018963968), so the noise is drawn
for precisely the number given; the accounting (`discrete_laplace_event`,
`discrete_gaussian_epsilon`) receives `float(fraction)`, the same number again. The discrete
Gaussian's σ² must be a Fraction with a small denominator (an integer, or e.g. Fraction(3, 2));
a float σ² is converted exactly and refused when its terms are too large for int64 arithmetic.

Laws (x ∈ ℤ):
    discrete Laplace, scale t:  Pr[x] = tanh(1/(2t)) · exp(-|x|/t)       (variance below)
    discrete Gaussian, σ²:      Pr[x] = exp(-x²/(2σ²)) / Σ_y exp(-y²/(2σ²))  (variance < σ²)

Randomness: every sampler takes a `numpy.random.Generator`; None draws a fresh one from a 128-bit
secret of the operating system (`randomness.secret_seed`).

Accounting (neighbours: integer vectors differing by Δ ∈ ℤ^d, noise on every coordinate):
    discrete Laplace: dp-accounting's `DiscreteLaplaceDpEvent(1/t, |Δ_j|)`, one per changed
        coordinate (`discrete_laplace_event`).
    discrete Gaussian: dp-accounting's privacy loss distribution
        (`pld.privacy_loss_distribution.from_discrete_gaussian_mechanism`), one per changed
        coordinate (`discrete_gaussian_pld`, `discrete_gaussian_epsilon`), and the zCDP bound
        ρ = ‖Δ‖²/(2σ²) (CKS 2020, Theorem 4 per coordinate, additive over independent
        coordinates; `discrete_gaussian_rho`).

Example:
    >>> import numpy as np
    >>> noise = discrete_gaussian(100, sigma2=16, rng=np.random.default_rng(0))
    >>> noise.dtype, bool(np.all(noise == np.round(noise)))
    (dtype('int64'), True)
"""

from __future__ import annotations

import math
import numbers
from fractions import Fraction

import dp_accounting
import numpy as np
from dp_accounting import dp_event as dp_events
from dp_accounting.pld import privacy_loss_distribution

from dpmix_jax.privacy import accounting, randomness, validation

__all__ = [
    "as_fraction",
    "bernoulli_exp",
    "check_sigma2",
    "discrete_gaussian",
    "discrete_gaussian_epsilon",
    "discrete_gaussian_pld",
    "discrete_gaussian_pmf",
    "discrete_gaussian_rho",
    "discrete_laplace",
    "discrete_laplace_event",
    "discrete_laplace_pmf",
    "discrete_laplace_variance",
    "make_rng",
]

# A rational parameter's numerator stays below 2**53 (so that numerator·V fits int64 for the
# geometric count V < 1024 of Algorithm 2) and its denominator below 2**63.
_MAX_NUMERATOR = 2**53
_INT64_MAX = np.iinfo(np.int64).max


def make_rng(rng: np.random.Generator | None) -> np.random.Generator:
    """`rng` itself, or for None a Generator seeded with a fresh 128-bit secret.

    Privacy: the secret Generator's state is the noise; never log it.
    """
    if rng is None:
        return np.random.default_rng(randomness.secret_seed())
    if not isinstance(rng, np.random.Generator):
        raise ValueError(f"rng must be a numpy.random.Generator or None, got {rng!r}.")
    return rng


def as_fraction(value: numbers.Real | Fraction, name: str) -> Fraction:
    """`value` > 0 as an exact Fraction (a float's exact binary value): numerator < 2**53,
    denominator < 2**63 (every float in [2**-10, 2**53) qualifies).

    Raises:
        ValueError: `value` is not a finite number > 0, or its numerator or denominator is too
            large for the int64 arithmetic of the samplers.
    """
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real | Fraction)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    fraction = Fraction(value)
    if fraction.numerator >= _MAX_NUMERATOR or fraction.denominator > _INT64_MAX:
        raise ValueError(
            f"{name} = {value!r} is the fraction {fraction}, too large for int64 arithmetic "
            "(need numerator < 2**53 and denominator < 2**63); pass a Fraction with smaller terms."
        )
    return fraction


def _bernoulli_ratio(rng: np.random.Generator, num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """Bernoulli(num/den) per entry (0 <= num <= den), from one uniform integer in [0, den)."""
    return rng.integers(0, den, dtype=np.int64) < num


def _bernoulli_exp_at_most_one(
    rng: np.random.Generator, num: np.ndarray, den: np.ndarray
) -> np.ndarray:
    """Bernoulli(exp(-num/den)) for num/den in [0, 1] (CKS 2020, Algorithm 1, first case).

    K = 1; while Bernoulli(γ/K): K += 1; output 1 iff K is odd. Bernoulli(γ/K) is drawn as
    Bernoulli(γ)·Bernoulli(1/K) (independent), so no product den·K is formed.
    """
    size = num.shape[0]
    result = np.zeros(size, dtype=bool)
    k = np.ones(size, dtype=np.int64)
    active = np.arange(size)
    while active.size:
        success = _bernoulli_ratio(rng, num[active], den[active]) & (
            rng.integers(0, k[active], dtype=np.int64) == 0
        )
        stopped = active[~success]
        result[stopped] = k[stopped] % 2 == 1
        active = active[success]
        k[active] += 1
    return result


def bernoulli_exp(
    num: np.ndarray, den: np.ndarray, rng: np.random.Generator | None = None
) -> np.ndarray:
    """Exact Bernoulli(exp(-num/den)) draws, one per entry (CKS 2020, Algorithm 1).

    γ = num/den >= 0 is split as ⌊γ⌋ + r: ⌊γ⌋ Bernoulli(exp(-1)) draws and one Bernoulli(exp(-r)),
    all of which must succeed (the loop stops at an entry's first failure).

    Args:
        num, den: integer arrays of one shape, num >= 0, den >= 1 (int64).
        rng: the randomness; None: a secret Generator.

    Returns:
        A boolean array of the shape of `num`.
    """
    rng = make_rng(rng)
    num = np.asarray(num, dtype=np.int64)
    den = np.broadcast_to(np.asarray(den, dtype=np.int64), num.shape)
    if np.any(num < 0) or np.any(den < 1):
        raise ValueError("bernoulli_exp needs num >= 0 and den >= 1.")
    shape = num.shape
    num, den = num.ravel(), den.ravel()
    whole, rest = np.divmod(num, den)
    result = np.ones(num.shape[0], dtype=bool)
    ones = np.ones(num.shape[0], dtype=np.int64)
    active = np.flatnonzero(whole > 0)
    while active.size:
        result[active] = _bernoulli_exp_at_most_one(rng, ones[active], ones[active])
        whole[active] -= 1
        active = active[result[active] & (whole[active] > 0)]
    alive = np.flatnonzero(result)
    result[alive] = _bernoulli_exp_at_most_one(rng, rest[alive], den[alive])
    return result.reshape(shape)


def _geometric_exp_minus_one(rng: np.random.Generator, size: int) -> np.ndarray:
    """V per entry: the number of Bernoulli(exp(-1)) successes before the first failure."""
    count = np.zeros(size, dtype=np.int64)
    ones = np.ones(size, dtype=np.int64)
    active = np.arange(size)
    while active.size:
        success = _bernoulli_exp_at_most_one(rng, ones[active], ones[active])
        active = active[success]
        count[active] += 1
    return count


def _discrete_laplace_exact(rng: np.random.Generator, size: int, scale: Fraction) -> np.ndarray:
    """`size` draws of the discrete Laplace with scale t/s (CKS 2020, Algorithm 2)."""
    t, s = scale.numerator, scale.denominator
    out = np.zeros(size, dtype=np.int64)
    pending = np.arange(size)
    while pending.size:
        m = pending.size
        u = rng.integers(0, t, m, dtype=np.int64)
        keep = bernoulli_exp(u, np.full(m, t, dtype=np.int64), rng)
        v = _geometric_exp_minus_one(rng, m)
        y = (u + t * v) // s
        negative = rng.integers(0, 2, m, dtype=np.int64) == 1
        accepted = keep & ~(negative & (y == 0))
        out[pending[accepted]] = np.where(negative, -y, y)[accepted]
        pending = pending[~accepted]
    return out


def discrete_laplace(
    shape: int | tuple[int, ...],
    scale: numbers.Real | Fraction,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Exact discrete Laplace noise: Pr[x] ∝ exp(-|x|/scale) on ℤ (int64 array of `shape`).

    Args:
        shape: output shape.
        scale: t > 0, as an exact Fraction (a float is converted exactly, `as_fraction`).
        rng: the randomness; None: a secret Generator.

    Privacy:
        Noise for sensitive integer statistics; with integer L1 sensitivity Δ it is the discrete
        Laplace mechanism (pure ε = Δ/t); its accounting is `discrete_laplace_event`.
    """
    scale = as_fraction(scale, "scale")
    rng = make_rng(rng)
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    return _discrete_laplace_exact(rng, math.prod(shape), scale).reshape(shape)


def _sigma2_terms(sigma2: numbers.Real | Fraction, name: str = "sigma2") -> tuple[int, int, int]:
    """(p, q, t) for σ² = p/q and t = ⌊σ⌋ + 1, checked so that 2·p·q·t² fits int64."""
    fraction = as_fraction(sigma2, name)
    p, q = fraction.numerator, fraction.denominator
    t = math.isqrt(p // q) + 1
    if 2 * p * q * t * t > _INT64_MAX:
        raise ValueError(
            f"{name} = {sigma2!r} (the fraction {fraction}) is too large or has too large a "
            "denominator for exact int64 arithmetic (need 2·p·q·(⌊σ⌋+1)² < 2**63); pass a "
            "Fraction with a small denominator."
        )
    return p, q, t


def check_sigma2(sigma2: numbers.Real | Fraction, name: str = "sigma2") -> Fraction:
    """σ² as the exact Fraction the discrete Gaussian sampler uses, or a ValueError naming
    `name` when it is not > 0 or too large for its int64 arithmetic."""
    p, q, _ = _sigma2_terms(sigma2, name)
    return Fraction(p, q)


def discrete_gaussian(
    shape: int | tuple[int, ...],
    sigma2: numbers.Real | Fraction,
    rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Exact discrete Gaussian noise: Pr[x] ∝ exp(-x²/(2σ²)) on ℤ (int64 array of `shape`).

    CKS 2020, Algorithm 3: with t = ⌊σ⌋ + 1, draw Y from the discrete Laplace of scale t and
    accept it with probability exp(-(|Y| - σ²/t)²/(2σ²)); with σ² = p/q that exponent is the
    integer ratio (|Y|·q·t - p)² / (2·p·q·t²).

    Args:
        shape: output shape.
        sigma2: σ² > 0, the parameter (not the variance, which is slightly smaller), as an exact
            Fraction; a float is converted exactly and refused when its terms are too large.
        rng: the randomness; None: a secret Generator.

    Privacy:
        Noise for sensitive integer statistics; with integer sensitivity vector Δ it is
        ‖Δ‖²/(2σ²)-zCDP (`discrete_gaussian_rho`), and its exact ε is
        `discrete_gaussian_epsilon` (dp-accounting's privacy loss distribution).
    """
    p, q, t = _sigma2_terms(sigma2)
    rng = make_rng(rng)
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    size = math.prod(shape)
    out = np.zeros(size, dtype=np.int64)
    pending = np.arange(size)
    scale = Fraction(t)
    # |Y|·q·t beyond this bound would overflow when squared: such an entry is (exactly) rejected
    # with probability 1 - exp(-γ), γ > 2**61 / (2·p·q·t²) >= 1/4; it is redrawn the exact way.
    safe = math.isqrt(_INT64_MAX) // (q * t)
    while pending.size:
        y = _discrete_laplace_exact(rng, pending.size, scale)
        magnitude = np.abs(y)
        exact = magnitude <= safe
        accept = np.zeros(pending.size, dtype=bool)
        gap = magnitude[exact] * (q * t) - p
        accept[exact] = bernoulli_exp(gap * gap, np.full(gap.shape, 2 * p * q * t * t), rng)
        for index in np.flatnonzero(~exact):  # astronomically rare: Python integers
            accept[index] = _bernoulli_exp_python(
                rng, (int(magnitude[index]) * q * t - p) ** 2, 2 * p * q * t * t
            )
        out[pending[accept]] = y[accept]
        pending = pending[~accept]
    return out.reshape(shape)


def _bernoulli_exp_python(rng: np.random.Generator, num: int, den: int) -> bool:
    """Bernoulli(exp(-num/den)) for one entry with Python integers of any size."""
    whole, rest = divmod(num, den)
    one = np.ones(1, dtype=np.int64)
    for _ in range(whole):
        if not _bernoulli_exp_at_most_one(rng, one, one)[0]:
            return False
    # rest < den, and den < 2**63 here (checked in `_sigma2_terms`).
    return bool(bernoulli_exp(np.array([rest]), np.array([den]), rng)[0])


# --------------------------------------------------------------------------------------------
# Laws (float evaluations, for tests and accounting checks; never used to sample).
# --------------------------------------------------------------------------------------------


def discrete_laplace_pmf(x: np.ndarray, scale: float) -> np.ndarray:
    """tanh(1/(2t)) · exp(-|x|/t), the discrete Laplace pmf of scale t at integers x."""
    return math.tanh(0.5 / scale) * np.exp(-np.abs(np.asarray(x, dtype=float)) / scale)


def discrete_laplace_variance(scale: float) -> float:
    """2·e^(-1/t) / (1 - e^(-1/t))², the discrete Laplace variance at scale t."""
    r = math.exp(-1.0 / scale)
    return 2 * r / (1 - r) ** 2


def discrete_gaussian_pmf(x: np.ndarray, sigma2: float) -> np.ndarray:
    """exp(-x²/(2σ²)) / Σ_y exp(-y²/(2σ²)) at integers x (normaliser summed over |y| <= 60σ+60)."""
    bound = int(60 * math.sqrt(sigma2)) + 60
    support = np.arange(-bound, bound + 1, dtype=float)
    log_norm = np.logaddexp.reduce(-(support**2) / (2 * sigma2))
    return np.exp(-(np.asarray(x, dtype=float) ** 2) / (2 * sigma2) - log_norm)


# --------------------------------------------------------------------------------------------
# Accounting.
# --------------------------------------------------------------------------------------------


def discrete_laplace_event(
    scale: numbers.Real | Fraction, sensitivities: tuple[int, ...] = (1,)
) -> dp_accounting.DpEvent:
    """The dp-accounting event of discrete Laplace noise (scale t) on integer coordinates.

    Neighbours differ by the integers `sensitivities` on as many coordinates (e.g. (1, 1) for one
    vote moved between two tokens); independent noise on each makes the privacy loss a sum of
    independent scalar losses, so the event is the composition of
    `DiscreteLaplaceDpEvent(1/t, |Δ_j|)`, one per changed coordinate.
    """
    parameter = 1.0 / float(as_fraction(scale, "scale"))
    deltas = _check_sensitivities(sensitivities)
    events = [dp_events.DiscreteLaplaceDpEvent(parameter, d) for d in deltas]
    if len(set(deltas)) == 1:
        return (
            events[0]
            if len(events) == 1
            else dp_accounting.SelfComposedDpEvent(events[0], len(events))
        )
    return dp_accounting.ComposedDpEvent(events)


def _check_sensitivities(sensitivities: tuple[int, ...]) -> list[int]:
    if not sensitivities or any(
        isinstance(d, bool) or not isinstance(d, numbers.Integral) or d == 0 for d in sensitivities
    ):
        raise ValueError(
            f"sensitivities must be non-zero integers (one per changed coordinate), got "
            f"{sensitivities!r}."
        )
    return [abs(int(d)) for d in sensitivities]


def discrete_gaussian_pld(
    sigma2: numbers.Real | Fraction,
    sensitivities: tuple[int, ...] = (1,),
    *,
    count: int = 1,
    discretization: float = accounting.PLD_DISCRETIZATION,
) -> privacy_loss_distribution.PrivacyLossDistribution:
    """dp-accounting's privacy loss distribution of `count` calls of discrete Gaussian noise.

    One call: neighbours differ by `sensitivities` on as many coordinates, each with independent
    discrete Gaussian noise of parameter σ²; the call is the composition of the scalar
    mechanisms `from_discrete_gaussian_mechanism(σ, |Δ_j|)` (pessimistic, an upper bound).
    """
    sigma = math.sqrt(float(as_fraction(sigma2, "sigma2")))
    count = validation.check_steps(count, "count")
    pld = None
    for delta_j in _check_sensitivities(sensitivities):
        part = privacy_loss_distribution.from_discrete_gaussian_mechanism(
            sigma, sensitivity=delta_j, value_discretization_interval=discretization
        )
        pld = part if pld is None else pld.compose(part)
    return pld.self_compose(count) if count > 1 else pld


def discrete_gaussian_epsilon(
    sigma2: numbers.Real | Fraction,
    sensitivities: tuple[int, ...] = (1,),
    *,
    count: int = 1,
    delta: float,
) -> float:
    """ε at `delta` of `count` calls of discrete Gaussian noise (`discrete_gaussian_pld`)."""
    delta = validation.check_delta(delta)
    return float(
        discrete_gaussian_pld(sigma2, sensitivities, count=count).get_epsilon_for_delta(delta)
    )


def discrete_gaussian_rho(
    sigma2: numbers.Real | Fraction, sensitivities: tuple[int, ...] = (1,)
) -> float:
    """ρ = ‖Δ‖²/(2σ²): the discrete Gaussian's zCDP (CKS 2020, Theorem 4, summed over the
    independent coordinates, as Rényi divergences of product distributions add)."""
    deltas = _check_sensitivities(sensitivities)
    return sum(d * d for d in deltas) / (2 * float(as_fraction(sigma2, "sigma2")))
