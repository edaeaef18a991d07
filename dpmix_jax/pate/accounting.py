"""Privacy accounting for PATE aggregation: dp-accounting events and the data-dependent analysis.

Neighbouring relation: adding or removing one sensitive record changes one teacher's data, hence
(with the shared sampling noise public and data-independent) moves at most one vote: L1 = 2,
L2 = √2, L∞ = 1, and max_j c_j changes by at most 1. Every event below is normalised so that its
noise multiplier is (noise standard deviation or Laplace scale) / (sensitivity of what is noised).

* Data-independent: each executed aggregator call (every step, every retry) is recorded in a
  `PateLedger`: a `dpmix_jax.privacy.accounting.PrivacyLedger` of events, whose ε is
  dp-accounting's (PLD) composition, plus the δ that DPWS charges per call.
* Data-dependent (confident-GNMax only; Papernot et al. 2018, "Scalable private learning with
  PATE", Theorem 6, Propositions 7, 8 and 10): RDP that depends on the actual histograms, which
  dp-accounting has no analysis for; computed here and converted to ε by the classic
  conversion (`rdp_to_epsilon`). Where the histograms allow no saving it is dp-accounting's RDP
  of the same Gaussians.
  Unanswered queries pay only the threshold check, and peaked histograms pay little. The value is
  itself a function of the sensitive data: it is reported for analysis here; its private release
  (smooth sensitivity, as in the paper) is `dpmix_jax.pate.smooth_sensitivity`.

Example:
    >>> round(epsilon_of_steps(dpargmax_laplace_event(0.1), steps=10, delta=1e-6), 2)
    1.0
"""

from __future__ import annotations

import dataclasses
import fractions
import math

import dp_accounting
import numpy as np
from scipy import special, stats

from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import discrete_noise, validation

__all__ = [
    "DEFAULT_ORDERS",
    "GNMaxReport",
    "PateLedger",
    "confident_gnmax_discrete_epsilon",
    "confident_gnmax_discrete_event",
    "confident_gnmax_event",
    "confident_gnmax_report",
    "discrete_laplace_scale",
    "dpargmax_discrete_laplace_event",
    "dpargmax_laplace_event",
    "dpws_discrete_event",
    "dpws_event",
    "epsilon_of_steps",
    "gnmax_log_q",
    "log_pr_answered",
    "max_steps",
    "rdp_data_dependent_gaussian",
    "rdp_to_epsilon",
]

DEFAULT_ORDERS = np.concatenate([np.linspace(1.1, 10.9, 99), np.arange(11, 257, dtype=float)])


def dpargmax_laplace_event(epsilon: float) -> dp_accounting.DpEvent:
    """One `dpargmax_laplace` call: Laplace scale 2/ε on a vector of L1 sensitivity 2.

    Noise multiplier (2/ε)/2 = 1/ε, so the event is exactly ε-DP.
    """
    epsilon = validation.check_epsilon(epsilon)
    return dp_accounting.LaplaceDpEvent(1.0 / epsilon)


def confident_gnmax_event(sigma1: float, sigma2: float) -> dp_accounting.DpEvent:
    """One `confident_gnmax` call, charged in full whether or not it answered.

    Threshold check on max_j c_j (sensitivity 1): `GaussianDpEvent(σ1)`; noisy argmax over c
    (L2 sensitivity √2): `GaussianDpEvent(σ2/√2)`.
    """
    sigma1 = validation.check_positive(sigma1, "sigma1")
    sigma2 = validation.check_positive(sigma2, "sigma2")
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.GaussianDpEvent(sigma1),
            dp_accounting.GaussianDpEvent(sigma2 / math.sqrt(2)),
        ]
    )


def dpws_event(epsilon: float) -> dp_accounting.DpEvent:
    """The Laplace part of one `dpws` call; its δ is charged separately (`PateLedger`).

    On tokens in both neighbours' supports DPWS is the Laplace mechanism with scale 2/ε on a
    vector of L1 sensitivity 2 (noise multiplier 1/ε). A token entering or leaving the support
    is released with probability <= δ/2 each; outside that event (probability <= δ) the call is
    dominated by that Laplace mechanism. By a union bound over the calls, k adaptive calls are
    (ε_k, δ' + k·δ)-DP, where ε_k is the Laplace composition's ε at δ'.
    """
    return dp_accounting.LaplaceDpEvent(1.0 / validation.check_epsilon(epsilon))


def discrete_laplace_scale(epsilon: float) -> fractions.Fraction:
    """The discrete Laplace scale 2/ε of DPARGMAX and DPWS, as the exact Fraction of the float
    2/ε: the noise is drawn (`privacy.discrete_noise.discrete_laplace`) and accounted at it."""
    return discrete_noise.as_fraction(2.0 / validation.check_epsilon(epsilon), "2/epsilon")


def dpargmax_discrete_laplace_event(epsilon: float) -> dp_accounting.DpEvent:
    """One `dpargmax_laplace` call with discrete Laplace noise of scale t = 2/ε.

    A vote move changes two coordinates by 1 each: two discrete Laplace mechanisms of parameter
    1/t and sensitivity 1 (`DiscreteLaplaceDpEvent`), at most ε-DP (pure) together.
    """
    return discrete_noise.discrete_laplace_event(discrete_laplace_scale(epsilon), (1, 1))


def dpws_discrete_event(epsilon: float) -> dp_accounting.DpEvent:
    """The discrete Laplace part of one `dpws` call with discrete noise (`dpws_event`'s argument
    with the discrete Laplace); its δ per call is the same and is charged separately."""
    return dpargmax_discrete_laplace_event(epsilon)


def confident_gnmax_discrete_event(sigma1: float, sigma2: float) -> dp_accounting.DpEvent:
    """One `confident_gnmax` call with discrete Gaussian noise, as its zCDP (for the ledger).

    The discrete Gaussian with parameter σ² is ‖Δ‖²/(2σ²)-zCDP (CKS 2020, Theorem 4, summed over
    independent coordinates): the check (Δ = 1) is 1/(2σ1²)-zCDP, the argmax (two counts moved
    by 1) 1/σ2²-zCDP, as `ZCDpEvent`s, which dp-accounting's RDP accountant composes
    (`PateLedger` switches to it); σi² are the exact Fractions of `sigma_i**2`, as sampled. The
    tighter PLD value of the same calls is `confident_gnmax_discrete_epsilon`.
    """
    sigma1 = validation.check_positive(sigma1, "sigma1")
    sigma2 = validation.check_positive(sigma2, "sigma2")
    return dp_accounting.ComposedDpEvent(
        [
            dp_accounting.ZCDpEvent(discrete_noise.discrete_gaussian_rho(sigma1**2, (1,))),
            dp_accounting.ZCDpEvent(discrete_noise.discrete_gaussian_rho(sigma2**2, (1, 1))),
        ]
    )


def confident_gnmax_discrete_epsilon(
    sigma1: float, sigma2: float, *, steps: int, delta: float
) -> float:
    """ε at `delta` of `steps` `confident_gnmax` calls with discrete Gaussian noise.

    Per call: the threshold check on max_j c_j (sensitivity 1) with parameter σ1², and the
    noisy argmax (two coordinates changing by 1) with σ2², composed; dp-accounting's discrete
    Gaussian privacy loss distributions (`privacy.discrete_noise.discrete_gaussian_pld`). σ1²
    and σ2² are the exact Fractions of the floats `sigma1**2`, `sigma2**2`, as sampled.
    """
    sigma1 = validation.check_positive(sigma1, "sigma1")
    sigma2 = validation.check_positive(sigma2, "sigma2")
    delta = validation.check_delta(delta)
    steps = validation.check_steps(steps)
    check = discrete_noise.discrete_gaussian_pld(sigma1**2, (1,))
    argmax = discrete_noise.discrete_gaussian_pld(sigma2**2, (1, 1))
    pld = check.compose(argmax)
    if steps > 1:
        pld = pld.self_compose(steps)
    return float(pld.get_epsilon_for_delta(delta))


def epsilon_of_steps(event: dp_accounting.DpEvent, *, steps: int, delta: float) -> float:
    """ε at `delta` of `steps` adaptive repetitions of `event` (dp-accounting PLD)."""
    ledger = privacy.PrivacyLedger()
    ledger.record(event, validation.check_steps(steps))
    return ledger.epsilon(delta)


def max_steps(
    event: dp_accounting.DpEvent, *, epsilon: float, delta: float, limit: int = 10**6
) -> int:
    """The most adaptive repetitions of `event` whose ε at `delta` stays <= `epsilon`.

    Bisection over `epsilon_of_steps` (ε grows with the count); 0 when one repetition already
    exceeds `epsilon`, `limit` when `limit` repetitions do not.
    """
    epsilon = validation.check_epsilon(epsilon)
    limit = validation.check_steps(limit, "limit")

    def fits(steps: int) -> bool:
        return epsilon_of_steps(event, steps=steps, delta=delta) <= epsilon

    if not fits(1):
        return 0
    if fits(limit):
        return limit
    low, high = 1, limit  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


@dataclasses.dataclass
class PateLedger:
    """What a PATE run executed: dp-accounting events, plus δ charged per call (DPWS).

    The reported guarantee of everything recorded is (ε, δ + extra_delta) with ε the events'
    composition at δ (PLD; RDP when a `ZCDpEvent` was recorded, which PLD does not take).
    `state_dict()` / `from_state_dict()` make it checkpointable.
    """

    events: privacy.PrivacyLedger = dataclasses.field(default_factory=privacy.PrivacyLedger)
    extra_delta: float = 0.0

    def record(self, event: dp_accounting.DpEvent, count: int = 1, *, delta: float = 0.0):
        """Records `count` executions of `event`, each also charging `delta` (in [0, 1))."""
        if not 0 <= delta < 1:
            raise ValueError(f"delta must be in [0, 1), got {delta!r}.")
        self.events.record(event, count)
        self.extra_delta += count * delta

    @property
    def count(self) -> int:
        """How many aggregator calls were recorded."""
        return self.events.count

    def budget(
        self,
        delta: float,
        *,
        num_units: int | None = None,
        unit: str = "records",
        allow_large_delta: bool = False,
    ) -> privacy.PrivacyBudget:
        """The (ε, δ + extra_delta) guarantee of everything recorded.

        Args:
            delta: the δ at which the events' ε is computed, in (0, 1).
            num_units: n, the sensitive units (documents, users) behind the teachers, or a lower
                bound on it (every teacher holds at least one: the number of teachers); None
                skips the check of the total δ against 1/n.
            unit: what a unit is, for the message.
            allow_large_delta: accept a total δ >= 1/n.

        Raises:
            ValueError: `delta` outside (0, 1), a total δ >= 1, or a total δ >= 1/n without
                `allow_large_delta`.

        Privacy: a total δ >= 1/n allows publishing one of the n units in the clear.
        """
        delta = validation.check_delta(delta)
        zcdp = any(_contains_zcdp(event) for event, _ in self.events.entries)
        eps = self.events.epsilon(delta, "rdp" if zcdp else "pld") if self.events.entries else 0.0
        total = delta + self.extra_delta
        if total >= 1:
            raise ValueError(f"the accumulated δ ({total}) is >= 1: no guarantee.")
        if num_units is not None:
            validation.check_delta_for_units(
                total,
                num_units,
                unit=unit,
                name="delta + per-call delta",
                allow_large_delta=allow_large_delta,
            )
        return privacy.PrivacyBudget(eps, total)

    def state_dict(self) -> dict:
        """A JSON-serialisable snapshot."""
        return {"events": self.events.state_dict(), "extra_delta": self.extra_delta}

    @classmethod
    def from_state_dict(cls, state: dict) -> PateLedger:
        """Restores a ledger written by `state_dict()`."""
        events = privacy.PrivacyLedger.from_state_dict(state["events"])
        return cls(events=events, extra_delta=float(state["extra_delta"]))


def _contains_zcdp(event: dp_accounting.DpEvent) -> bool:
    """Whether `event` is or contains a `ZCDpEvent` (accounted by RDP, not PLD)."""
    if isinstance(event, dp_accounting.ZCDpEvent):
        return True
    if isinstance(event, dp_accounting.ComposedDpEvent):
        return any(_contains_zcdp(e) for e in event.events)
    if isinstance(event, dp_accounting.SelfComposedDpEvent):
        return _contains_zcdp(event.event)
    return False


# --------------------------------------------------------------------------------------------
# Data-dependent RDP of confident-GNMax (Papernot et al. 2018).
# --------------------------------------------------------------------------------------------


def _log1mexp(x: float) -> float:
    """log(1 - e^x) for x <= 0."""
    if x > 0:
        raise ValueError(f"log1mexp needs x <= 0, got {x}.")
    if x == 0:
        return -math.inf
    return math.log1p(-math.exp(x)) if x < -math.log(2) else math.log(-math.expm1(x))


def gnmax_log_q(counts: np.ndarray, sigma: float) -> float:
    """Upper bound on ln Pr[GNMax(σ) output != argmax c] (Proposition 7, union bound).

    q <= Σ_{j != j*} Pr[N(0, 2σ²) >= c_{j*} - c_j], capped at 1 - 1/V.

    Privacy:
        A function of the sensitive histogram: analysis only, not a private release.
    """
    counts = np.asarray(counts, dtype=float)
    if counts.ndim != 1 or counts.size < 2:
        raise ValueError(f"counts must be a histogram of shape (V,), V >= 2, got {counts.shape}.")
    top = int(np.argmax(counts))
    gaps = np.delete(counts[top] - counts, top)
    log_terms = stats.norm.logsf(gaps, scale=math.sqrt(2.0) * sigma)
    return min(float(special.logsumexp(log_terms)), math.log(1.0 - 1.0 / counts.size))


def log_pr_answered(counts: np.ndarray, threshold: float, sigma1: float) -> float:
    """ln Pr[max_j c_j + N(0, σ1²) >= T], with max c rounded as in the PATE 2018 analysis.

    Privacy:
        A function of the sensitive histogram: analysis only, not a private release.
    """
    return float(stats.norm.logsf(threshold - round(float(np.max(counts))), scale=sigma1))


def rdp_data_dependent_gaussian(log_q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """RDP of a Gaussian noisy-max style mechanism given q = Pr[non-modal outcome] (Theorem 6).

    Data-independent bound: λ/σ² (Proposition 8; a mechanism of L2 sensitivity √2 and noise σ).
    Where Proposition 10's conditions hold for the orders μ2 = sqrt(σ²·ln(1/q)), μ1 = μ2 + 1,
    the bound is min(λ/σ², 1/(λ-1) · ln((1-q)·A^(λ-1) + q·B^(λ-1))) with
    A = (1-q) / (1 - (e^ε2 q)^(1-1/μ2)), B = e^ε1 / q^(1/(μ1-1)), εi = μi/σ².
    It never exceeds the data-independent bound.
    """
    orders = np.asarray(orders, dtype=float)
    if log_q > 0 or sigma <= 0 or np.any(orders <= 1):
        raise ValueError("need log_q <= 0, sigma > 0 and orders > 1.")
    if math.isinf(log_q):  # the output is fixed: no privacy loss
        return np.zeros_like(orders)
    variance = sigma**2
    data_independent = orders / variance
    mu2 = math.sqrt(variance * -log_q)
    mu1 = mu2 + 1
    if mu2 <= 1:
        return data_independent
    eps1, eps2 = mu1 / variance, mu2 / variance
    # q must lie where the bound is increasing in q, and A must be positive.
    q_ok = log_q <= (mu2 - 1) * eps2 - mu2 * (
        math.log(1 + 1 / (mu1 - 1)) + math.log(1 + 1 / (mu2 - 1))
    )
    if not (q_ok and -log_q > eps2):
        return data_independent
    log_1mq = _log1mexp(log_q)
    log_a = (orders - 1) * (log_1mq - _log1mexp((log_q + eps2) * (1 - 1 / mu2)))
    log_b = (orders - 1) * (eps1 - log_q / (mu1 - 1))
    bound = np.logaddexp(log_1mq + log_a, log_q + log_b) / (orders - 1)
    return np.where(orders < mu1, np.minimum(data_independent, bound), data_independent)


def rdp_to_epsilon(rdp: np.ndarray, orders: np.ndarray, delta: float) -> tuple[float, float]:
    """(ε, best order) by the classic conversion ε = min_λ RDP(λ) + ln(1/δ)/(λ-1).

    `dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon` (what its RDP accountant
    reports) uses an improved conversion, lower by ln(λ)/(λ-1) - ln(1 - 1/λ) at each order
    (0.14 at λ = 32), so the two are not interchangeable. This one is kept so that the
    report's data-dependent ε and its smooth-sensitivity release (`pate.smooth_sensitivity`,
    which publishes R̃ + ρ + ln(1/δ)/(λ-1) as PATE 2018 does) use one conversion; it is never
    below dp_accounting's conversion of the same curve (tests check both).
    """
    delta = validation.check_delta(delta)
    eps = np.asarray(rdp) + math.log(1 / delta) / (np.asarray(orders) - 1)
    best = int(np.argmin(eps))
    return float(eps[best]), float(np.asarray(orders)[best])


@dataclasses.dataclass(frozen=True, kw_only=True)
class GNMaxReport:
    """Both analyses of a run of confident-GNMax queries.

    Attributes:
        epsilon_data_independent: dp-accounting (PLD) ε of every query charged in full.
        epsilon_data_independent_rdp: the same, by the RDP conversion below (for comparison).
        epsilon_data_dependent: data-dependent RDP ε (not itself private; a private release is
            `pate.smooth_sensitivity.release_data_dependent_epsilon`).
        num_queries, num_answered: how many queries ran, and how many passed the threshold check.
        delta: the δ of all three ε values.
    """

    epsilon_data_independent: float
    epsilon_data_independent_rdp: float
    epsilon_data_dependent: float
    num_queries: int
    num_answered: int
    delta: float


def confident_gnmax_report(
    histograms: np.ndarray,
    answered: np.ndarray,
    *,
    threshold: float,
    sigma1: float,
    sigma2: float,
    delta: float,
    orders: np.ndarray = DEFAULT_ORDERS,
) -> GNMaxReport:
    """Data-independent and data-dependent ε of confident-GNMax queries (PATE 2018).

    Every query pays the threshold check's data-dependent RDP (from ln Pr[answered]); answered
    queries also pay GNMax's data-dependent RDP (from q of Proposition 7).

    Args:
        histograms: `(Q, V)` vote histograms of the queries that ran.
        answered: `(Q,)` booleans, whether each query passed the noisy threshold check.
        threshold, sigma1, sigma2: the mechanism's parameters.
        delta: target δ.
        orders: Rényi orders for the RDP analyses.

    Privacy:
        The data-dependent ε is a function of the sensitive histograms; it is reported for
        analysis and is not a private release (see `pate.smooth_sensitivity` for one).
    """
    histograms = np.asarray(histograms)
    answered = np.asarray(answered, dtype=bool)
    if histograms.ndim != 2 or answered.shape != histograms.shape[:1]:
        raise ValueError(
            f"need histograms (Q, V) and answered (Q,), got {histograms.shape}, {answered.shape}."
        )
    queries = validation.check_steps(histograms.shape[0], "number of queries")
    orders = np.asarray(orders, dtype=float)
    rdp = np.zeros_like(orders)
    for counts, was_answered in zip(histograms, answered, strict=True):
        log_pr = log_pr_answered(counts, threshold, sigma1)
        # The check has sensitivity 1: it is the √2-sensitivity analysis at noise √2·σ1.
        log_q_check = min(log_pr, _log1mexp(log_pr))
        rdp += rdp_data_dependent_gaussian(log_q_check, math.sqrt(2) * sigma1, orders)
        if was_answered:
            rdp += rdp_data_dependent_gaussian(gnmax_log_q(counts, sigma2), sigma2, orders)
    independent_rdp = queries * (orders / (2 * sigma1**2) + orders / sigma2**2)
    return GNMaxReport(
        epsilon_data_independent=epsilon_of_steps(
            confident_gnmax_event(sigma1, sigma2), steps=queries, delta=delta
        ),
        epsilon_data_independent_rdp=rdp_to_epsilon(independent_rdp, orders, delta)[0],
        epsilon_data_dependent=rdp_to_epsilon(rdp, orders, delta)[0],
        num_queries=queries,
        num_answered=int(answered.sum()),
        delta=delta,
    )
