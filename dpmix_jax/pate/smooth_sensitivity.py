"""A private release of confident-GNMax's data-dependent ε by smooth sensitivity (PATE 2018, §4).

The data-dependent RDP R(x) of a run (`accounting.confident_gnmax_report`) is a function of the
sensitive histograms x, so publishing it leaks. Papernot et al. 2018 ("Scalable private learning
with PATE", §4 and appendix B-C) release it with the Gaussian noise with smooth sensitivity (GNSS)
mechanism, at one Rényi order λ fixed in advance:

1. Local sensitivity at distance d. Under the vote-move relation a query's histogram moves one vote
   per neighbouring step. For the threshold check, R depends on v = round(max_j c_j) only, which
   moves by at most 1 per step: LS_thr(d) = max over |v' - v| <= d (and v' >= ⌈n/V⌉) of the
   largest one-step change of R at v'. For GNMax, R depends on q = the union bound on
   Pr[output != argmax]; one step moves q within [bl(q), bu(q)] with
   bl/bu(q) = (m-1)/2·erfc(erfcinv(2q/(m-1)) ± 1/σ) (m tokens). R(q) is the data-dependent bound
   below q0 (where it meets the data-independent λ/σ²) and λ/σ² above, and
   LS(q) = max(R(bu(q)) - R(q), R(q) - R(bl(q))) (their Proposition 13, Algorithm 3). Walking
   the histogram towards the plateau [q1, q0] (q1 = bl(q0)), where LS is largest, bounds the LS
   of every histogram at distance d (their Algorithms 4-5). The run's LS(d) is the sum over
   queries (answered queries add their GNMax part).
2. Smooth sensitivity SS = max_d e^{-βd}·LS(d), with β < 1/(2λ) (default 0.49/λ).
3. Release R̃ = R(x) + SS·σ_s·N(0, 1). The release is itself (λ, ρ)-RDP with
   ρ = λ·e^{2β}/σ_s² + (βλ - ½·ln(1 - 2λβ))/(λ - 1) (their Theorem 23), and this cost is added to
   the published value: ε̃ = R̃ + ρ + ln(1/δ)/(λ - 1), the classic RDP-to-DP conversion of
   `accounting.rdp_to_epsilon` at the one order λ (dp-accounting's improved conversion would
   publish ln(λ)/(λ - 1) - ln(1 - 1/λ) less; it is not used, so that the release and the
   report share one conversion). Above q0, R is λ/σ², dp-accounting's RDP of the Gaussian.

The noise multiplier σ_s and λ must be chosen without looking at the sensitive data (e.g. from a
public dry run); `suggested_noise_multiplier` gives PATE's choice for a guessed SS, and
`choose_release` picks (λ, β, σ_s) on a grid by the ε a public hypothetical run would publish
(no privacy cost, unlike choosing the order on the sensitive run's own ε).

Example:
    >>> import numpy as np
    >>> hist = np.array([[30, 1, 1], [31, 1, 0]])
    >>> out = release_data_dependent_epsilon(
    ...     hist, np.array([True, True]), threshold=20, sigma1=4.0, sigma2=2.0, order=8.0,
    ...     noise_multiplier=1.0, delta=1e-5, seed=0)
    >>> out.epsilon > out.epsilon_noise_free - 10 * out.noise_std
    True
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
from scipy import optimize, special, stats

from dpmix_jax.pate import accounting
from dpmix_jax.privacy import randomness, validation

__all__ = [
    "ReleaseChoice",
    "SmoothRelease",
    "choose_release",
    "gnmax_local_sensitivity",
    "gnss_rdp",
    "release_data_dependent_epsilon",
    "smooth_sensitivity",
    "suggested_noise_multiplier",
    "threshold_local_sensitivity",
]


def _data_dependent_bound(log_q: float, sigma: float, order: float) -> float:
    """Theorem 6's bound at q, without its validity checks (the caller compares q with q0)."""
    variance = sigma**2
    mu2 = sigma * math.sqrt(-log_q)
    mu1 = mu2 + 1
    eps1, eps2 = mu1 / variance, mu2 / variance
    log_1mq = accounting._log1mexp(log_q)
    log_a = (order - 1) * (log_1mq - accounting._log1mexp((log_q + eps2) * (1 - 1 / mu2)))
    log_b = (order - 1) * (eps1 - log_q / (mu1 - 1))
    return float(np.logaddexp(log_1mq + log_a, log_q + log_b) / (order - 1))


@functools.lru_cache(maxsize=256)
def _log_q0(sigma: float, order: float) -> float:
    """ln q0: below it the data-dependent bound is valid and beats λ/σ²; above it, λ/σ²."""

    def valid(log_q):
        mu2 = sigma * math.sqrt(-log_q)
        mu1 = mu2 + 1
        if mu1 < order or mu2 <= 1:
            return False
        eps2 = mu2 / sigma**2
        return log_q <= (mu2 - 1) * eps2 - mu2 * math.log(mu1 / (mu1 - 1) * mu2 / (mu2 - 1))

    def gap(log_q):
        return _data_dependent_bound(log_q, sigma, order) - order / sigma**2

    upper = min(-((1 + 1 / sigma) ** 2), -(((order - 0.99) / sigma) ** 2), -1 / sigma**2)
    if not valid(upper):
        raise ValueError(f"no data-dependent GNMax bound at sigma={sigma}, order={order}.")
    if gap(upper) < 0:
        return upper
    lower = 2 * upper
    while gap(lower) > 0:
        if lower < -1e4:
            raise ValueError(f"q0 not bracketed for sigma={sigma}, order={order}.")
        lower *= 1.5
    return float(optimize.brentq(gap, lower, upper))


def _rdp_gnmax(log_q: float, sigma: float, order: float) -> float:
    """R(q) as the smooth-sensitivity analysis uses it (module docstring)."""
    if math.isinf(log_q):
        return 0.0
    if log_q >= _log_q0(sigma, order):
        return order / sigma**2
    return _data_dependent_bound(log_q, sigma, order)


def _q_bounds(q: float, sigma: float, classes: int) -> tuple[float, float]:
    """(bl(q), bu(q)): how far one vote move can take the union-bound q (Proposition 12)."""
    base = special.erfcinv(2 * q / (classes - 1))
    half = (classes - 1) / 2
    return half * special.erfc(base + 1 / sigma), min(1.0, half * special.erfc(base - 1 / sigma))


def _log(x: float) -> float:
    return math.log(x) if x > 0 else -math.inf


def _gnmax_ls_at(log_q: float, sigma: float, classes: int, order: float) -> float:
    """Upper bound on the local sensitivity of R at a histogram with union bound q."""
    log_q0 = _log_q0(sigma, order)
    log_q1 = _log(_q_bounds(math.exp(log_q0), sigma, classes)[0])
    if log_q1 <= log_q <= log_q0:
        log_q = log_q1  # the plateau: LS is largest there
    low, high = _q_bounds(math.exp(log_q), sigma, classes)
    here = _rdp_gnmax(log_q, sigma, order)
    return max(
        _rdp_gnmax(_log(high), sigma, order) - here, here - _rdp_gnmax(_log(low), sigma, order)
    )


def gnmax_local_sensitivity(counts: np.ndarray, sigma: float, order: float) -> np.ndarray:
    """LS(d), d = 0..n-1: bound on the local sensitivity of GNMax's R at order λ over every
    histogram within d vote moves of `counts` (n = Σ counts).

    Privacy:
        A function of the sensitive histogram; only its smoothed form enters a release.
    """
    counts = np.asarray(counts, dtype=float)
    n, classes = int(round(counts.sum())), counts.size
    log_q0 = _log_q0(sigma, order)
    log_q1 = _log(_q_bounds(math.exp(log_q0), sigma, classes)[0])
    plateau = _gnmax_ls_at(log_q1, sigma, classes, order)
    result = np.full(n, plateau)
    log_q = accounting.gnmax_log_q(counts, sigma)
    if log_q1 <= log_q <= log_q0:
        return result
    votes = sorted(counts.tolist(), reverse=True)
    result[0] = _gnmax_ls_at(log_q, sigma, classes, order)
    widen = log_q > log_q0  # above the plateau: histograms nearby have larger gaps
    d = 0
    while (widen and log_q > log_q0 and votes[1] > 0) or (not widen and log_q < log_q1):
        d += 1
        if d >= n:
            break
        if widen:
            votes[0] += 1
            votes[1] -= 1
            votes[1:] = sorted(votes[1:], reverse=True)
        else:
            votes[0] -= 1
            votes[1] += 1
        log_q = accounting.gnmax_log_q(np.asarray(votes), sigma)
        result[d] = _gnmax_ls_at(log_q, sigma, classes, order)
    return result


def threshold_local_sensitivity(
    counts: np.ndarray, threshold: float, sigma: float, order: float
) -> np.ndarray:
    """LS(d), d = 0..n-1, of the threshold check's R at order λ (module docstring).

    Privacy:
        A function of the sensitive histogram; only its smoothed form enters a release.
    """
    counts = np.asarray(counts, dtype=float)
    n = int(round(counts.sum()))
    floor = -(-n // counts.size)  # every histogram's maximum is at least ⌈n/V⌉
    rdp = np.array([_threshold_rdp(v, threshold, sigma, order) for v in range(floor, n + 1)])
    step = np.abs(np.diff(rdp))  # |R(v + 1) - R(v)| for v = floor..n-1
    at = np.maximum(np.append(step, 0.0), np.insert(step, 0, 0.0))  # largest step at v
    top = int(round(counts.max())) - floor
    return np.array([at[max(top - d, 0) : top + d + 1].max() for d in range(n)])


def _threshold_rdp(top: int, threshold: float, sigma: float, order: float) -> float:
    log_pr = float(stats.norm.logsf(threshold - top, scale=sigma))
    log_q = min(log_pr, accounting._log1mexp(log_pr))
    orders = np.array([order])
    return float(accounting.rdp_data_dependent_gaussian(log_q, math.sqrt(2) * sigma, orders)[0])


def smooth_sensitivity(local_sensitivity: np.ndarray, beta: float) -> float:
    """max_d e^{-βd}·LS(d) (a β-smooth upper bound on the local sensitivity)."""
    ls = np.asarray(local_sensitivity, dtype=float)
    return float(np.max(ls * np.exp(-beta * np.arange(ls.size))))


def gnss_rdp(beta: float, noise_multiplier: float, order: float) -> float:
    """RDP at order λ of releasing f(x) + SS_β(x)·N(0, σ_s²) (PATE 2018, Theorem 23)."""
    if not 0 < beta < 1 / (2 * order) or order <= 1:
        raise ValueError(f"need order > 1 and 0 < beta < 1/(2·order), got {beta}, {order}.")
    return order * math.exp(2 * beta) / noise_multiplier**2 + (
        beta * order - 0.5 * math.log(1 - 2 * order * beta)
    ) / (order - 1)


def suggested_noise_multiplier(smooth_sens: float, order: float, beta: float | None = None):
    """PATE's σ_s = (λ·e^{2β} / SS)^{1/3}, which minimises ρ + 2·SS·σ_s; call it with an SS from
    public or synthetic data, never the sensitive run's own."""
    beta = 0.49 / order if beta is None else beta
    return (order * math.exp(2 * beta) / validation.check_positive(smooth_sens, "smooth_sens")) ** (
        1 / 3
    )


_RELEASE_ORDERS = (
    1.5,
    2.0,
    2.5,
    3.0,
    4.0,
    5.0,
    6.0,
    8.0,
    10.0,
    12.0,
    16.0,
    20.0,
    24.0,
    32.0,
    48.0,
    64.0,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReleaseChoice:
    """Public parameters of a smooth-sensitivity release (`choose_release`).

    Attributes:
        order, beta, noise_multiplier: λ, β and σ_s for `release_data_dependent_epsilon`.
        predicted_epsilon: the objective at the choice (published ε of the hypothetical run plus
            `spread` standard deviations of its noise).
    """

    order: float
    beta: float
    noise_multiplier: float
    predicted_epsilon: float


def choose_release(
    *,
    num_queries: int,
    num_teachers: int,
    num_classes: int,
    threshold: float,
    sigma1: float,
    sigma2: float,
    delta: float,
    orders: tuple[float, ...] = _RELEASE_ORDERS,
    beta_fractions: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.49),
    noise_multipliers: tuple[float, ...] = tuple(np.geomspace(0.25, 64.0, 33)),
    spread: float = 2.0,
    agreement: float = 0.75,
) -> ReleaseChoice:
    """(λ, β = f/λ, σ_s) on a grid, chosen from public inputs only.

    The objective is what a hypothetical run would publish: `num_queries` answered queries, each
    with a share `agreement` of the `num_teachers` votes on one of `num_classes` tokens and the
    rest on a second one (the closest race for its votes), released at (λ, β, σ_s):
    its R + ρ + ln(1/δ)/(λ - 1) plus `spread` standard deviations SS·σ_s of the release noise.
    The hypothetical's R and LS(d) are sums of identical per-query terms. The choice depends on
    the mechanism's public parameters alone, so it costs no privacy, unlike picking the order
    that minimises the sensitive run's own ε.

    Privacy:
        Reads no sensitive data.
    """
    validation.check_steps(num_queries, "num_queries")
    validation.check_steps(num_teachers, "num_teachers")
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}.")
    validation.check_delta(delta)
    if not 0.5 < agreement <= 1:
        raise ValueError(f"agreement must be in (0.5, 1], got {agreement!r}.")
    counts = np.zeros(num_classes)
    counts[0] = round(agreement * num_teachers)
    counts[1] = num_teachers - counts[0]
    log_q = accounting.gnmax_log_q(counts, sigma2)
    best = None
    for order in orders:
        rdp = num_queries * (
            _threshold_rdp(int(counts[0]), threshold, sigma1, order)
            + _rdp_gnmax(log_q, sigma2, order)
        )
        ls = num_queries * (
            threshold_local_sensitivity(counts, threshold, sigma1, order)
            + gnmax_local_sensitivity(counts, sigma2, order)
        )
        conversion = math.log(1 / delta) / (order - 1)
        for fraction in beta_fractions:
            beta = fraction / order
            smooth = smooth_sensitivity(ls, beta)
            for multiplier in noise_multipliers:
                value = (
                    rdp
                    + gnss_rdp(beta, multiplier, order)
                    + conversion
                    + spread * smooth * multiplier
                )
                if best is None or value < best.predicted_epsilon:
                    best = ReleaseChoice(
                        order=float(order),
                        beta=float(beta),
                        noise_multiplier=float(multiplier),
                        predicted_epsilon=float(value),
                    )
    return best


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmoothRelease:
    """A privately released data-dependent ε.

    Attributes:
        epsilon: ε̃ = R̃ + ρ + ln(1/δ)/(λ - 1): publishable.
        order, beta, noise_multiplier, delta: the release's public parameters.
        release_rdp: ρ, the release's own RDP at λ (included in `epsilon`).
        epsilon_noise_free: R + ρ + ln(1/δ)/(λ - 1) (not private: analysis only).
        smooth_sensitivity: SS (not private: analysis only).
        noise_std: SS·σ_s, the standard deviation of the noise in ε̃ (not private).
        seeded: True when the noise came from a caller's seed (then not private against anyone
            who knows it).
    """

    epsilon: float
    order: float
    beta: float
    noise_multiplier: float
    delta: float
    release_rdp: float
    epsilon_noise_free: float
    smooth_sensitivity: float
    noise_std: float
    seeded: bool


def release_data_dependent_epsilon(
    histograms: np.ndarray,
    answered: np.ndarray,
    *,
    threshold: float,
    sigma1: float,
    sigma2: float,
    order: float,
    noise_multiplier: float,
    delta: float,
    beta: float | None = None,
    seed: int | None = None,
) -> SmoothRelease:
    """Releases confident-GNMax's data-dependent ε at order λ with smooth sensitivity.

    Args:
        histograms: `(Q, V)` vote histograms of the queries that ran.
        answered: `(Q,)` whether each query passed the noisy threshold check (its output).
        threshold, sigma1, sigma2: the mechanism's parameters.
        order: λ, fixed before looking at the data.
        noise_multiplier: σ_s, fixed before looking at the data.
        delta: δ of the published ε.
        beta: smoothness β < 1/(2λ); default 0.49/λ.
        seed: None (default) draws the release noise from the operating system's entropy.

    Returns:
        A `SmoothRelease`; only `epsilon` and the parameters are publishable.

    Privacy:
        Reads the sensitive histograms; `epsilon` is (λ, release_rdp)-RDP with respect to them,
        and that cost is already part of it.
    """
    histograms = np.asarray(histograms, dtype=float)
    answered = np.asarray(answered, dtype=bool)
    if histograms.ndim != 2 or answered.shape != histograms.shape[:1] or not len(histograms):
        raise ValueError(
            f"need histograms (Q, V), Q >= 1, and answered (Q,), got {histograms.shape}, "
            f"{answered.shape}."
        )
    order = float(order)
    beta = 0.49 / order if beta is None else float(beta)
    release_rdp = gnss_rdp(
        beta, validation.check_positive(noise_multiplier, "noise_multiplier"), order
    )
    validation.check_delta(delta)
    rdp, ls = 0.0, 0.0
    for counts, was_answered in zip(histograms, answered, strict=True):
        rdp += _threshold_rdp(int(round(counts.max())), threshold, sigma1, order)
        ls = ls + threshold_local_sensitivity(counts, threshold, sigma1, order)
        if was_answered:
            rdp += _rdp_gnmax(accounting.gnmax_log_q(counts, sigma2), sigma2, order)
            ls = ls + gnmax_local_sensitivity(counts, sigma2, order)
    smooth = smooth_sensitivity(ls, beta)
    seed, seeded = randomness.resolve_seed(seed)
    noise = smooth * noise_multiplier * np.random.default_rng(seed).standard_normal()
    conversion = math.log(1 / delta) / (order - 1)
    noise_free = float(rdp) + release_rdp + conversion
    return SmoothRelease(
        epsilon=noise_free + float(noise),
        order=order,
        beta=beta,
        noise_multiplier=float(noise_multiplier),
        delta=delta,
        release_rdp=release_rdp,
        epsilon_noise_free=noise_free,
        smooth_sensitivity=smooth,
        noise_std=smooth * noise_multiplier,
        seeded=seeded,
    )
