"""Privacy accounting on top of `dp_accounting`: events, ε, calibration, budgets and a ledger.

Every ε this library prints comes from here, and everything here comes from `dp_accounting`'s
accountants (PLD by default, RDP as a cross-check); nothing is approximated by hand.

Example:
    >>> from dpmix_jax.privacy import accounting
    >>> event = accounting.dpsgd_event(noise_multiplier=3.0, sampling_rate=0.1, steps=512)
    >>> round(accounting.epsilon(event, delta=1e-6), 2)
    3.77
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import dp_accounting
from dp_accounting import dp_event as dp_events
from dp_accounting.pld import PLDAccountant
from dp_accounting.rdp import RdpAccountant

from dpmix_jax.privacy.validation import (
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_positive,
    check_sampling_rate,
    check_steps,
    is_real,
)

Accountant = Literal["pld", "rdp"]
NeighboringRelation = dp_accounting.NeighboringRelation
ADD_OR_REMOVE_ONE = NeighboringRelation.ADD_OR_REMOVE_ONE

# PLD discretisation: 1e-4 reproduces dp_accounting's published numbers; PLD stays an upper bound.
PLD_DISCRETIZATION = 1e-4


# --------------------------------------------------------------------------------------------
# Events and ε.
# --------------------------------------------------------------------------------------------


def dpsgd_event(
    *, noise_multiplier: float, sampling_rate: float, steps: int
) -> dp_accounting.DpEvent:
    """The event of `steps` rounds of Poisson-sampled Gaussian noise (DP-SGD, DP-MixMin).

    Args:
        noise_multiplier: σ, the Gaussian standard deviation in units of the sensitivity.
        sampling_rate: q, the probability that each unit (example or user) joins a batch.
        steps: T, the number of noisy rounds.

    Returns:
        `SelfComposedDpEvent(PoissonSampledDpEvent(q, GaussianDpEvent(σ)), T)`.
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sampling_rate(sampling_rate)
    steps = check_steps(steps)
    gaussian = dp_accounting.GaussianDpEvent(sigma)
    step_event = gaussian if q == 1.0 else dp_accounting.PoissonSampledDpEvent(q, gaussian)
    return dp_accounting.SelfComposedDpEvent(step_event, steps)


def make_accountant(
    accountant: Accountant = "pld",
    neighboring_relation: NeighboringRelation = ADD_OR_REMOVE_ONE,
    *,
    discretization: float = PLD_DISCRETIZATION,
) -> dp_accounting.PrivacyAccountant:
    """A fresh `dp_accounting` accountant: PLD (tight, default) or RDP (fast cross-check).

    `discretization` is the PLD's value discretisation interval (an upper bound at any value;
    coarser is faster and looser).
    """
    if accountant == "pld":
        return PLDAccountant(neighboring_relation, value_discretization_interval=discretization)
    if accountant == "rdp":
        return RdpAccountant(neighboring_relation=neighboring_relation)
    raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}.")


def epsilon(
    event: dp_accounting.DpEvent,
    *,
    delta: float,
    accountant: Accountant = "pld",
    neighboring_relation: NeighboringRelation = ADD_OR_REMOVE_ONE,
) -> float:
    """ε of `event` at `delta`, from a fresh `dp_accounting` accountant.

    An event with a noiseless Gaussian (σ = 0, the no-noise control) has ε = ∞. PLD's
    discretisation is `PLD_DISCRETIZATION` for ε up to 1 and grows in proportion to ε above
    (`pld_discretization`), so that large ε costs no more than small ε; it stays an upper bound.
    A sampled event under the replace-one relation is not supported by `dp_accounting`'s Poisson
    analysis and raises `dp_accounting.UnsupportedEventError`.

    Raises:
        ValueError: the noise is too small for the accountant to evaluate (ε astronomically
            large); the message gives the RDP bound and what to do.
    """
    delta = check_delta(delta)
    make_accountant(accountant)  # validates the name
    if _has_noiseless_gaussian(event):
        return math.inf
    key = json.dumps(event_to_dict(event), sort_keys=True)
    return _cached_epsilon(key, delta, accountant, neighboring_relation)


@functools.lru_cache(maxsize=4096)
def _cached_epsilon(
    event_json: str, delta: float, accountant: Accountant, relation: NeighboringRelation
) -> float:
    # Accounting is a pure function of the event; PLD composition costs up to a second, and the
    # same events recur (every seed of an experiment, every ledger report of a run).
    event = event_from_dict(json.loads(event_json))
    if accountant == "rdp":
        return _compose(make_accountant("rdp", relation), event, delta)
    return _pld_epsilon(event, delta, relation)


def pld_discretization(epsilon_bound: float) -> float:
    """The PLD discretisation used for an event whose ε is about `epsilon_bound`:
    `PLD_DISCRETIZATION`·max(1, ε), a relative resolution of 1e-4 above ε = 1."""
    return PLD_DISCRETIZATION * max(1.0, epsilon_bound)


# Integer RDP orders: a fast, looser bound (a fraction of the default orders' cost) that sizes the
# PLD grid and brackets calibration; never reported.
_HINT_ORDERS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 128, 256, 512)


def _rdp_hint(
    event: dp_accounting.DpEvent, delta: float, relation: NeighboringRelation
) -> float | None:
    """An RDP upper bound on ε over `_HINT_ORDERS`, or None when RDP cannot evaluate it."""
    try:
        with _quiet_rdp_orders():
            hint = RdpAccountant(list(_HINT_ORDERS), neighboring_relation=relation)
            return _compose(hint, event, delta)
    except (dp_accounting.UnsupportedEventError, ValueError, OverflowError, ArithmeticError):
        return None


def _pld_epsilon(
    event: dp_accounting.DpEvent, delta: float, relation: NeighboringRelation
) -> float:
    hint = _rdp_hint(event, delta, relation)
    try:
        grid = _grid(hint)
        eps = _compose(make_accountant("pld", relation, discretization=grid), event, delta)
        needed = pld_discretization(eps)
        if grid > 2 * needed or (eps <= 1 and grid != needed):
            # The hint was loose: recompute at the resolution the ε found asks for.
            eps = _compose(make_accountant("pld", relation, discretization=needed), event, delta)
    except (OverflowError, MemoryError, FloatingPointError) as err:
        bound = "" if hint is None else f" (an RDP bound gives ε <= {hint:.3g})"
        raise ValueError(
            f"the noise is too small for the PLD accountant to evaluate ε{bound}: there is no "
            "meaningful guarantee. Use more noise (a larger noise_multiplier or a target ε "
            "in [0.01, 100]), or noise_multiplier = 0 for a labelled no-noise control (ε = ∞)"
        ) from err
    return eps


# The integer-order RDP hint exceeds the PLD ε, by about 10% near ε = 1: a hint up to this
# factor above 1 still gets the ε <= 1 grid, which spares a second composition there.
_HINT_SLACK = 1.25


def _grid(hint: float | None) -> float:
    if hint is None or not math.isfinite(hint) or hint <= _HINT_SLACK:
        return PLD_DISCRETIZATION
    return pld_discretization(hint)


def _compose(
    accountant: dp_accounting.PrivacyAccountant, event: dp_accounting.DpEvent, delta: float
) -> float:
    accountant.compose(event)
    return float(accountant.get_epsilon(delta))


def _has_noiseless_gaussian(event: dp_accounting.DpEvent) -> bool:
    if isinstance(event, dp_accounting.GaussianDpEvent):
        return event.noise_multiplier == 0
    children = []
    for name in ("event", "events"):
        value = getattr(event, name, None)
        children += value if isinstance(value, list | tuple) else [value]
    return any(_has_noiseless_gaussian(c) for c in children if isinstance(c, dp_events.DpEvent))


# The targets calibration serves: in this range it takes well under a second for the step counts
# and sampling rates of the presets (up to tens of thousands of steps, rates 1e-4 to 1).
CALIBRATION_EPSILON_RANGE = (0.01, 100.0)


def calibrate_noise_multiplier(
    *,
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Accountant = "pld",
    tolerance: float = 1e-4,
) -> float:
    """The smallest σ (up to a relative `tolerance`) whose DP-SGD ε is at most `target_epsilon`.

    The returned σ never exceeds the budget: `epsilon(dpsgd_event(σ, q, T), delta) <= target`.

    Raises:
        ValueError: a target outside `CALIBRATION_EPSILON_RANGE`, or invalid δ, q or T.
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    delta = check_delta(delta)
    q = check_sampling_rate(sampling_rate)
    steps = check_steps(steps)
    return _cached_dpsgd_calibration(target_epsilon, delta, q, steps, accountant, tolerance)


@functools.lru_cache(maxsize=1024)
def _cached_dpsgd_calibration(
    target_epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    accountant: Accountant,
    tolerance: float,
) -> float:
    return calibrate(
        lambda sigma: dpsgd_event(noise_multiplier=sigma, sampling_rate=sampling_rate, steps=steps),
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=accountant,
        tolerance=tolerance,
    )


def calibrate(
    make_event: Callable[[float], dp_accounting.DpEvent],
    *,
    target_epsilon: float,
    delta: float,
    accountant: Accountant = "pld",
    tolerance: float = 1e-4,
) -> float:
    """The smallest noise parameter (up to a relative `tolerance`) whose ε is at most the target.

    `make_event(scale)` must build an event whose ε decreases as `scale` grows (a noise
    multiplier). A fast integer-order RDP bound gives a start; for PLD a coarse grid (relative
    resolution 1e-3, a few cheap evaluations) moves it near the answer; then secant steps on
    log ε against log scale, evaluated by `epsilon` (the accountant that reports ε), find the
    boundary. Only a scale whose reported ε was evaluated and found within the target is
    returned, so it is feasible for exactly the ε that is reported.

    Raises:
        ValueError: a target outside `CALIBRATION_EPSILON_RANGE` (far below it the noise would
            swamp any signal; far above it the guarantee means nothing, and the search would
            be slow), or an invalid δ, tolerance or accountant.
    """
    target_epsilon = check_epsilon(target_epsilon, "target_epsilon")
    low, high = CALIBRATION_EPSILON_RANGE
    if not low <= target_epsilon <= high:
        raise ValueError(
            f"target_epsilon must be in [{low:g}, {high:g}] for calibration, got "
            f"{target_epsilon!r}; for a no-noise control use noise_multiplier = 0 (ε = ∞)."
        )
    delta = check_delta(delta)
    tolerance = check_positive(tolerance, "tolerance")
    make_accountant(accountant)  # validates the name before the search starts

    def coarse(scale: float) -> float:
        # A PLD grid at a relative resolution of 1e-3: several times faster, slightly pessimistic.
        fresh = make_accountant("pld", discretization=1e-3 * target_epsilon)
        return _compose(fresh, make_event(scale), delta)

    def reported(scale: float) -> float:
        return epsilon(make_event(scale), delta=delta, accountant=accountant)

    with _quiet_rdp_orders():
        start = dp_accounting.calibrate_dp_mechanism(
            lambda: RdpAccountant(list(_HINT_ORDERS)),
            make_event,
            target_epsilon,
            delta,
            bracket_interval=dp_accounting.LowerEndpointAndGuess(0.0, 1.0),
            tol=_COARSE_TOLERANCE,
        )
        search = coarse if accountant == "pld" else reported
        start, slope = _log_secant(search, target_epsilon, start)
        return _smallest_feasible(reported, target_epsilon, start, slope, tolerance)


# Relative precision of the cheap stages; the reported accountant then refines to `tolerance`.
_COARSE_TOLERANCE = 1e-3
# d log ε / d log σ is about -1 for Gaussian mechanisms (the classic bound has ε ∝ 1/σ); used
# only until two evaluations give a secant.
_DEFAULT_SLOPE = -1.0
_MAX_STEP = 0.5  # at most a factor e^0.5 per secant step
_MAX_SECANT_STEPS = 30


def _secant_slope(x0: float, y0: float, x1: float, y1: float, fallback: float) -> float:
    """The secant slope of log ε against log scale, or `fallback` where discretisation noise
    makes it non-negative (ε must decrease as the noise grows)."""
    if x1 == x0:
        return fallback
    slope = (y1 - y0) / (x1 - x0)
    return slope if math.isfinite(slope) and slope < 0 else fallback


def _log_secant(fn: Callable[[float], float], target: float, scale: float) -> tuple[float, float]:
    """A scale where `fn` is about `target` (relative `_COARSE_TOLERANCE`), and the local slope
    of log fn against log scale there, by secant steps from `scale`."""
    goal = math.log(target)
    x0, y0 = math.log(scale), math.log(max(fn(scale), 1e-300))
    slope = _DEFAULT_SLOPE
    for _ in range(_MAX_SECANT_STEPS):
        step = min(max((goal - y0) / slope, -_MAX_STEP), _MAX_STEP)
        if abs(step) <= _COARSE_TOLERANCE:
            break
        x1 = x0 + step
        y1 = math.log(max(fn(math.exp(x1)), 1e-300))
        slope = _secant_slope(x0, y0, x1, y1, slope)
        x0, y0 = x1, y1
    return math.exp(x0), slope


def _smallest_feasible(
    fn: Callable[[float], float], target: float, scale: float, slope: float, tolerance: float
) -> float:
    """The smallest scale, up to a relative `tolerance`, with `fn(scale) <= target`.

    Secant steps on log fn against log scale aim a little below the target (by the change a
    step of tolerance/2 makes), inside the bracket of the scales evaluated so far. The answer is
    always a scale whose `fn` was evaluated and found within the target.
    """
    goal = math.log(target)
    feasible, infeasible = math.inf, 0.0  # the smallest within the target, the largest above it
    y = math.log(max(fn(scale), 1e-300))
    for _ in range(_MAX_SECANT_STEPS):
        if y <= goal:
            feasible = min(feasible, scale)
            # The boundary lies (goal - y) / |slope| below log(scale): close enough?
            if (goal - y) / -slope <= tolerance:
                break
        else:
            infeasible = max(infeasible, scale)
        if infeasible and math.log(feasible / infeasible) <= tolerance:
            break
        x = math.log(scale)
        nx = x + (goal + slope * tolerance / 2 - y) / slope
        nx = min(max(nx, x - _MAX_STEP), x + _MAX_STEP)
        if infeasible and math.isfinite(feasible):
            lo, hi = math.log(infeasible), math.log(feasible)
            if not lo < nx < hi:
                nx = (lo + hi) / 2
        next_scale = math.exp(nx)
        ny = math.log(max(fn(next_scale), 1e-300))
        slope = _secant_slope(x, y, nx, ny, slope)
        scale, y = next_scale, ny
    # Safety net for a non-smooth ε: step up from the largest scale tried until within target.
    scale, step = infeasible, tolerance
    while math.isinf(feasible):
        scale *= 1 + step
        if fn(scale) <= target:
            feasible = scale
        step *= 2
    return float(feasible)


class _DropNonConvergedOrders(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to converge" not in record.getMessage()


@contextlib.contextmanager
def _quiet_rdp_orders():
    """Silences RDP's per-order convergence warnings while the search probes extreme σ.

    Those orders are excluded from ε by the accountant itself; the warnings carry no information
    for the user of a calibration.
    """
    logger, drop = logging.getLogger("absl"), _DropNonConvergedOrders()
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


# --------------------------------------------------------------------------------------------
# Budgets and their composition.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrivacyBudget:
    """An (ε, δ) guarantee. Validated: ε >= 0 or ε = ∞ (no noise: no guarantee), 0 <= δ < 1."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        eps, delta = self.epsilon, self.delta
        if not is_real(eps) or math.isnan(eps) or eps < 0:
            raise ValueError(f"PrivacyBudget.epsilon must be a number >= 0 or inf, got {eps!r}.")
        if not is_real(delta) or not 0 <= delta < 1:
            raise ValueError(f"PrivacyBudget.delta must be in [0, 1), got {delta!r}.")
        object.__setattr__(self, "epsilon", float(eps))
        object.__setattr__(self, "delta", float(delta))

    @property
    def is_private(self) -> bool:
        """False for ε = ∞ (a run without noise)."""
        return math.isfinite(self.epsilon)

    def __str__(self) -> str:
        return f"(ε = {format_epsilon(self.epsilon)}, δ = {self.delta:.3g})"


def format_epsilon(epsilon: float, spec: str = ".4g") -> str:
    """ε for people: `format(ε, spec)`, or "∞ (no noise)" for a run without noise."""
    return format(epsilon, spec) if math.isfinite(epsilon) else "∞ (no noise)"


def compose_parallel(*budgets: PrivacyBudget) -> PrivacyBudget:
    """Parallel composition over *disjoint* data: (max ε, max δ)."""
    _check_budgets(budgets)
    return PrivacyBudget(max(b.epsilon for b in budgets), max(b.delta for b in budgets))


def compose_sequential(*budgets: PrivacyBudget) -> PrivacyBudget:
    """Basic sequential composition over the *same* data: (Σ ε, Σ δ).

    Only for guarantees that are not `DpEvent`s; runs that kept a `PrivacyLedger` compose
    through the accountant with `compose_ledgers`, which is tighter.
    """
    _check_budgets(budgets)
    return PrivacyBudget(sum(b.epsilon for b in budgets), sum(b.delta for b in budgets))


def _check_budgets(budgets: Sequence[PrivacyBudget]) -> None:
    if not budgets:
        raise ValueError("compose needs at least one PrivacyBudget.")
    for b in budgets:
        if not isinstance(b, PrivacyBudget):
            raise ValueError(f"expected PrivacyBudget, got {type(b).__name__}.")


# --------------------------------------------------------------------------------------------
# The ledger: what a run executed, in a checkpointable form.
# --------------------------------------------------------------------------------------------


def event_to_dict(event: dp_accounting.DpEvent) -> dict[str, Any]:
    """A JSON-friendly description of a `DpEvent` (inverse: `event_from_dict`)."""
    fields = {}
    for field in dataclasses.fields(event) if dataclasses.is_dataclass(event) else ():
        fields[field.name] = _value_to_json(getattr(event, field.name))
    if not fields:
        for name, value in _attrs_items(event):
            fields[name] = _value_to_json(value)
    return {"type": type(event).__name__, **fields}


def event_from_dict(data: Mapping[str, Any]) -> dp_accounting.DpEvent:
    """Rebuilds a `DpEvent` written by `event_to_dict`."""
    data = dict(data)
    cls = getattr(dp_events, data.pop("type"))
    return cls(**{k: _value_from_json(v) for k, v in data.items()})


def _attrs_items(event: Any) -> list[tuple[str, Any]]:
    attributes = getattr(type(event), "__attrs_attrs__", ())
    return [(a.name, getattr(event, a.name)) for a in attributes]


def _value_to_json(value: Any) -> Any:
    if isinstance(value, dp_events.DpEvent):
        return event_to_dict(value)
    if isinstance(value, list | tuple):
        return [_value_to_json(v) for v in value]
    return value


def _value_from_json(value: Any) -> Any:
    if isinstance(value, Mapping) and "type" in value:
        return event_from_dict(value)
    if isinstance(value, list):
        return [_value_from_json(v) for v in value]
    return value


@dataclasses.dataclass
class PrivacyLedger:
    """The events a run has executed, in order; reports (ε, δ) for exactly those.

    Consecutive records of the same event are merged into one self-composition, so a ledger of
    a 10,000-step run stays small. `state_dict()` / `from_state_dict()` make it checkpointable: a
    resumed run restores its ledger and neither forgets nor re-spends what it ran.

    Example:
        >>> ledger = PrivacyLedger()
        >>> step = dpsgd_event(noise_multiplier=1.0, sampling_rate=0.01, steps=1)
        >>> for _ in range(100):
        ...     ledger.record(step)
        >>> ledger.count
        100
    """

    neighboring_relation: NeighboringRelation = ADD_OR_REMOVE_ONE
    entries: list[tuple[dp_accounting.DpEvent, int]] = dataclasses.field(default_factory=list)

    def record(self, event: dp_accounting.DpEvent, count: int = 1) -> None:
        """Records that `event` was executed `count` more times."""
        count = check_steps(count, "count")
        if self.entries and self.entries[-1][0] == event:
            self.entries[-1] = (event, self.entries[-1][1] + count)
        else:
            self.entries.append((event, count))

    @property
    def count(self) -> int:
        """How many events were recorded in total."""
        return sum(n for _, n in self.entries)

    def event(self) -> dp_accounting.DpEvent:
        """The composition of everything recorded (`NoOpDpEvent` when empty)."""
        parts = [e if n == 1 else dp_accounting.SelfComposedDpEvent(e, n) for e, n in self.entries]
        if not parts:
            return dp_accounting.NoOpDpEvent()
        return parts[0] if len(parts) == 1 else dp_accounting.ComposedDpEvent(parts)

    def epsilon(self, delta: float, accountant: Accountant = "pld") -> float:
        """ε at `delta` for everything recorded (0 for an empty ledger)."""
        if not self.entries:
            check_delta(delta)
            return 0.0
        return epsilon(
            self.event(),
            delta=delta,
            accountant=accountant,
            neighboring_relation=self.neighboring_relation,
        )

    def budget(self, delta: float, accountant: Accountant = "pld") -> PrivacyBudget:
        """The (ε, δ) guarantee of everything recorded."""
        return PrivacyBudget(self.epsilon(delta, accountant), delta)

    def state_dict(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot, for checkpoints."""
        return {
            "neighboring_relation": self.neighboring_relation.name,
            "entries": [{"event": event_to_dict(e), "count": n} for e, n in self.entries],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyLedger:
        """Restores a ledger written by `state_dict()`."""
        relation = NeighboringRelation[state["neighboring_relation"]]
        entries = [(event_from_dict(e["event"]), int(e["count"])) for e in state["entries"]]
        return cls(neighboring_relation=relation, entries=entries)


def compose_ledgers(*ledgers: PrivacyLedger) -> PrivacyLedger:
    """The sequential composition of runs on the *same* data, as one ledger of all their events.

    Its `epsilon(delta)` is the accountant's ε, at that one δ, of the `ComposedDpEvent` of the
    runs' events in order (m identical runs become one m-fold `SelfComposedDpEvent`). It holds
    at δ itself, where the basic composition of the runs' budgets holds at Σ δ, and for the
    (sampled) Gaussian and Laplace events of this library its ε is below their Σ ε (for
    Gaussian noise it grows about as √m, not m).

    Raises:
        ValueError: no ledger, something that is not a `PrivacyLedger`, or ledgers under
            different neighbouring relations (their events do not compose).

    Privacy: adaptive composition: each run may depend on the outputs of the runs before it.
    """
    if not ledgers:
        raise ValueError("compose_ledgers needs at least one PrivacyLedger.")
    for ledger in ledgers:
        if not isinstance(ledger, PrivacyLedger):
            raise ValueError(f"expected PrivacyLedger, got {type(ledger).__name__}.")
    relations = {ledger.neighboring_relation for ledger in ledgers}
    if len(relations) > 1:
        names = sorted(relation.name for relation in relations)
        raise ValueError(f"cannot compose ledgers under different neighbouring relations {names}.")
    composed = PrivacyLedger(neighboring_relation=ledgers[0].neighboring_relation)
    for ledger in ledgers:
        for event, count in ledger.entries:
            composed.record(event, count)
    return composed
