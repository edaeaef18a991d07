"""Each generator's ε under the two neighbouring relations the papers use.

Papers state their guarantees for different neighbours, so their ε are not comparable as
printed. For a calibrated plan, `plan_epsilons` gives the ε of its longest run under both:

* "REPLACE_ONE": one reference (a teacher row) changes arbitrarily. This is what adding or
  removing one unit does in `synthesize`'s ensembles, where a teacher holds several units, and
  every teacher method is calibrated to it; for DP-SGD one example is replaced.
* "ADD_OR_REMOVE_ONE": one reference's term is added to or dropped from the aggregate with the
  batch size fixed, each unit its own reference (the relation of InvisibleInk's and Amin et
  al.'s papers): for InvisibleInk its clipped difference drops to 0, for Amin et al. its
  clipped logits and its softmax leave the sums, for PMixED its slot is left to the public
  distribution, for Hot PATE its vote is dropped; for DP-SGD one example (the accountant's
  default relation, which `dp_finetuning` is calibrated to).

Under add/remove every sensitivity halves for the peers (InvisibleInk: Δ = C/B instead of
2C/B, so ρ/4; Amin et al.: the exponential mechanism's ρ/4 and the sparse-vector ε/2), a vote
histogram loses one vote instead of moving one (L1 sensitivity 1 instead of 2, L2 1 instead of
√2; the threshold's max count moves by 1 under both), and PMixED's pairwise divergence bound
D = (2α - 1)²β/(α - 1) becomes the ball's own radius 2αβ (D_α(p̄‖p0) ≤ D_2α(p̄‖p0) ≤ 2αβ and
D_α(p0‖p̄) ≤ D_{2α-1}(p0‖p̄) ≤ (2α - 1)β, Rényi divergence growing with the order). DP-SGD's two
values come from dp-accounting's PLD accountant with each relation.

Example:
    >>> from dpmix_jax.pate.method import RunSettings
    >>> run = RunSettings(epsilon=1.0, delta=1e-5, num_samples=2, max_new_tokens=8,
    ...                   num_teachers=16, vocab_size=100)
    >>> row = table(run)[2]
    >>> row["method"], round(row["REPLACE_ONE"], 2), row["ADD_OR_REMOVE_ONE"] < 0.5
    ('invisibleink', 1.0, True)
"""

from __future__ import annotations

import math

import dp_accounting
from dp_accounting.rdp import rdp_privacy_accountant

from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pate.method import Plan, RunSettings
from dpmix_jax.pate.peers import amin, invisibleink, pmixed
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.synthesis.registry import REGISTRY

__all__ = ["ADD_OR_REMOVE_ONE", "REPLACE_ONE", "dp_sgd_epsilons", "plan_epsilons", "table"]

ADD_OR_REMOVE_ONE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE.name
REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE.name


def plan_epsilons(plan: Plan) -> dict[str, float]:
    """ε at the run's δ of `plan`'s longest run under both relations (the module docstring).

    Raises:
        ValueError: a plan of a method this module has no analysis for.

    Privacy:
        Public: a function of the plan's public settings only.
    """
    name, config, run = plan.aggregator, plan.config, plan.run
    if name in ("invisibleink", "invisibleink_disjoint"):
        steps = plan.mechanism["max_calls"]
        rho = invisibleink.per_token_rho(config)
        return {
            ADD_OR_REMOVE_ONE: _zcdp_epsilon(rho / 4, steps, run.delta),
            REPLACE_ONE: invisibleink.epsilon(config, steps=steps),
        }
    if name == "amin":
        tokens, runs = amin.worst_case_counts(config)
        parts = [(amin.em_rho(config) / 4, tokens), (amin.svt_epsilon(config) ** 2 / 8, runs)]
        event = dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(rho), count)
                for rho, count in parts
                if count
            ]
        )
        return {
            ADD_OR_REMOVE_ONE: privacy.epsilon(event, delta=run.delta, accountant="rdp"),
            REPLACE_ONE: amin.worst_case_epsilon(config),
        }
    if name == "pmixed":
        steps = config.max_new_tokens
        alpha = config.alpha
        weight = (1 - (1 - config.sampling_rate) ** config.num_teachers) / config.num_teachers
        rdp = math.log1p(weight * math.expm1((alpha - 1) * 2 * alpha * config.beta)) / (alpha - 1)
        return {
            ADD_OR_REMOVE_ONE: _rdp_epsilon(alpha, steps * rdp, run.delta),
            REPLACE_ONE: pmixed.epsilon(config, steps=steps, delta=run.delta),
        }
    if name in ("confident_gnmax", "dpargmax_laplace", "dpws"):
        calls = run.worst_case_tokens * (run.max_retries + 1)
        if name == "confident_gnmax":
            events = {
                ADD_OR_REMOVE_ONE: pate_accounting.confident_gnmax_event(
                    config.sigma1, config.sigma2 * math.sqrt(2)
                ),
                REPLACE_ONE: pate_accounting.confident_gnmax_event(config.sigma1, config.sigma2),
            }
        else:
            events = {
                ADD_OR_REMOVE_ONE: pate_accounting.dpargmax_laplace_event(config.epsilon / 2),
                REPLACE_ONE: pate_accounting.dpargmax_laplace_event(config.epsilon),
            }
        return {
            relation: pate_accounting.epsilon_of_steps(
                event, steps=calls, delta=config.report_delta
            )
            for relation, event in events.items()
        }
    raise ValueError(f"plan.aggregator {name!r} has no analysis under both relations here")


def dp_sgd_epsilons(
    *, noise_multiplier: float, sampling_rate: float, steps: int, delta: float
) -> dict[str, float]:
    """ε at `delta` of DP-SGD (`privacy.accounting.dpsgd_event`) under both relations, from
    dp-accounting's PLD accountant.

    Privacy:
        Public: a function of the training's public settings only.
    """
    event = privacy.dpsgd_event(
        noise_multiplier=noise_multiplier, sampling_rate=sampling_rate, steps=steps
    )
    return {
        relation: privacy.epsilon(
            event, delta=delta, neighboring_relation=dp_accounting.NeighboringRelation[relation]
        )
        for relation in (ADD_OR_REMOVE_ONE, REPLACE_ONE)
    }


def table(run: RunSettings) -> list[dict]:
    """Every teacher method of the registry calibrated for `run`, with its ε under both
    relations: rows `{"method", "label", "guarantee", ADD_OR_REMOVE_ONE, REPLACE_ONE}`, where
    "guarantee" names the relation the method is calibrated to (REPLACE_ONE for all of them).
    Hot PATE's rows use `run.aggregator`; InvisibleInk's disjoint setting needs n >= num_samples.

    Privacy:
        Public: a function of public settings only.
    """
    rows = []
    for name, method in REGISTRY.items():
        values = plan_epsilons(method.calibrate(run))
        rows.append({"method": name, "label": method.label, "guarantee": REPLACE_ONE, **values})
    return rows


def _zcdp_epsilon(rho: float, steps: int, delta: float) -> float:
    event = dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(rho), steps)
    return privacy.epsilon(event, delta=delta, accountant="rdp")


def _rdp_epsilon(order: float, rdp: float, delta: float) -> float:
    return float(rdp_privacy_accountant.compute_epsilon([order], [rdp], delta)[0])
