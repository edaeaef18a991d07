"""Sparse-vector aggregation: the steps that release no token cost no privacy.

Each step first asks a private gate whether the histogram's top count clears a threshold; only a
step that passes selects a token. The gate is the sparse vector technique with `c` positive
answers (Lyu, Su and Li 2017, Algorithm 1, whose threshold noise is drawn once): its privacy cost
is fixed by `c`, however many steps fail it, and it answers nothing once `c` steps have
passed. A run of any length is therefore charged the gate plus `c` selections.

Under the vote-move relation of `pate.aggregators` the top count max_j c_j has sensitivity 1.

* Gate, (ε1 + ε2)-DP: the noisy threshold ρ = T + Lap(1/ε1) is drawn once; step i passes when
  max_j c_j + Lap(2c/ε2) >= ρ, and after `c` passes every later step fails without reading
  its histogram.
* Selection on a passing step: "argmax", argmax_j (c_j + Lap(2/ε3)) (report noisy max, ε3-DP:
  the Laplace mechanism on a vector of L1 sensitivity 2), or "weighted", DPWS at (ε3, δ3)
  (`aggregators.dpws`, which may still return ⊥).
* Accounting (`epsilon`): the gate's pure ε as a privacy loss distribution
  (`from_privacy_parameters`), composed with `c` Laplace selections (`from_laplace_mechanism`),
  by dp-accounting; DPWS selections add c·δ3 to δ. The gate's steps interleave with the
  selections, a concurrent composition, which for these mechanisms is as good as the
  sequential one computed here (Vadhan and Zhang 2023).

Example:
    >>> import jax, jax.numpy as jnp
    >>> config = SparseConfig(threshold=6.0, max_answers=2, gate_epsilon=2.0, select_epsilon=1.0)
    >>> state = start(jax.random.key(0), config)
    >>> token, state = step(jax.random.key(1), state, jnp.array([0, 9, 1]), config)
    >>> int(state.answered) == int(token >= 0)
    True
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from dp_accounting import pld

from dpmix_jax.pate import aggregators
from dpmix_jax.privacy import validation

__all__ = ["SELECTIONS", "GateState", "SparseConfig", "epsilon", "start", "step"]

SELECTIONS = ("argmax", "weighted")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Public settings of a sparse-vector aggregation run.

    Attributes:
        threshold: T, the top count a step needs (before noise).
        max_answers: c, the most steps that may pass the gate (then it closes).
        gate_epsilon: ε1 + ε2, the gate's whole cost.
        threshold_share: ε1 / (ε1 + ε2), the part spent on the threshold's noise.
        select_epsilon: ε3 of each selection.
        selection: "argmax" (report noisy max) or "weighted" (DPWS).
        select_delta: δ3 of each DPWS selection ("weighted" only).
    """

    threshold: float
    max_answers: int
    gate_epsilon: float
    threshold_share: float = 0.5
    select_epsilon: float
    selection: str = "argmax"
    select_delta: float | None = None

    def __post_init__(self):
        validation.check_steps(self.max_answers, "max_answers")
        validation.check_epsilon(self.gate_epsilon, "gate_epsilon")
        validation.check_epsilon(self.select_epsilon, "select_epsilon")
        if not 0 < self.threshold_share < 1:
            raise ValueError(f"threshold_share must be in (0, 1), got {self.threshold_share!r}.")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {self.selection!r}.")
        if (self.selection == "weighted") != (self.select_delta is not None):
            raise ValueError("select_delta is needed by, and only by, selection='weighted'.")
        if self.select_delta is not None:
            validation.check_delta(self.select_delta, "select_delta")

    @property
    def threshold_scale(self) -> float:
        """Laplace scale of the threshold's noise, 1/ε1."""
        return 1.0 / (self.threshold_share * self.gate_epsilon)

    @property
    def query_scale(self) -> float:
        """Laplace scale of each step's noise, 2c/ε2."""
        return 2.0 * self.max_answers / ((1.0 - self.threshold_share) * self.gate_epsilon)


class GateState(NamedTuple):
    """The gate between steps: its noisy threshold (secret) and the steps that passed."""

    noisy_threshold: jax.Array
    answered: jax.Array


def start(key: jax.Array, config: SparseConfig) -> GateState:
    """Draws the gate's noisy threshold.

    Privacy:
        The state is secret: releasing the noisy threshold voids the gate's guarantee. `key`
        must be secret and used once.
    """
    noise = config.threshold_scale * jax.random.laplace(key, (), jnp.float32)
    return GateState(jnp.float32(config.threshold) + noise, jnp.int32(0))


def step(
    key: jax.Array, state: GateState, counts: jax.Array, config: SparseConfig
) -> tuple[jax.Array, GateState]:
    """One step: the gate, then (if it passes) the selection; jittable.

    Args:
        key: this step's PRNG key (secret, fresh).
        state: the gate's state from `start` or the previous step.
        counts: `(V,)` vote histogram of n teachers.
        config: the run's settings.

    Returns:
        The token (or `aggregators.FAIL`) and the gate's next state.

    Privacy:
        Reads the (sensitive) histogram. A run of any number of steps from one `start` is
        charged `epsilon(config, delta)` only if every step gets the state the previous step
        returned: feeding an earlier state again reopens answers the cap has counted, which the
        charge does not cover. A second run on the same data is charged again.
    """
    key_gate, key_select = jax.random.split(key)
    counts = jnp.asarray(counts)
    noisy_top = jnp.max(counts) + config.query_scale * jax.random.laplace(key_gate, (), jnp.float32)
    open_ = state.answered < config.max_answers
    passed = open_ & (noisy_top >= state.noisy_threshold)
    if config.selection == "argmax":  # DPARGMAX without a threshold: report noisy max
        chosen = aggregators.dpargmax_laplace(key_select, counts, -jnp.inf, config.select_epsilon)
    else:
        chosen = aggregators.dpws(
            key_select, counts, config.select_epsilon, config.select_delta, 1.0
        )
    token = jnp.where(passed, chosen, aggregators.FAIL).astype(jnp.int32)
    return token, GateState(state.noisy_threshold, state.answered + passed.astype(jnp.int32))


def epsilon(config: SparseConfig, delta: float) -> float:
    """ε at total `delta` of a whole run (any number of steps), by dp-accounting's PLDs.

    For "weighted" selections `delta` includes their c·δ3, so it must exceed it.
    """
    delta = validation.check_delta(delta)
    spent_delta = 0.0
    if config.selection == "weighted":
        spent_delta = config.max_answers * config.select_delta
        if not delta > spent_delta:
            raise ValueError(
                f"delta ({delta:g}) must exceed the selections' c·δ3 = {spent_delta:g}."
            )
    gate = pld.privacy_loss_distribution.from_privacy_parameters(
        pld.common.DifferentialPrivacyParameters(config.gate_epsilon, 0.0)
    )
    selections = pld.privacy_loss_distribution.from_laplace_mechanism(1.0 / config.select_epsilon)
    if config.max_answers > 1:
        selections = selections.self_compose(config.max_answers)
    return float(gate.compose(selections).get_epsilon_for_delta(delta - spent_delta))
