"""A run's privacy budget end to end: how its stages compose (`Composition`), the target ε of each
stage (`stage_epsilons`), the (ε, δ) the stages' ledgers add up to (`end_to_end_budget`), the
check of the `allow_large_delta` override, and budgets as stored JSON."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from dpmix_jax.privacy import accounting, validation

Composition = Literal["parallel", "sequential"]


def check_allow_large_delta(value: Any) -> None:
    """Refuses an `allow_large_delta` setting that is not exactly True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"allow_large_delta must be True or False, got {value!r}.")


def stage_epsilons(
    epsilon: float, composition: Composition, mixture_share: float
) -> tuple[float, float]:
    """Target ε of the mixture and fine-tuning stages for an end-to-end target ε.

    Parallel composition (disjoint D_mix and D_ft): both stages get the whole ε. Sequential
    composition (both stages on the same, unsplit data): ε_mix = share·ε, ε_ft = (1 - share)·ε
    (the paper's sequential setting is share = 0.1). The split calibrates each stage's noise
    by basic composition (the targets sum to ε); the reported end-to-end ε is the accountant's
    for the composition of the two stages' events (`end_to_end_budget`), at most ε.
    """
    validation.check_epsilon(epsilon)
    if composition == "parallel":
        return epsilon, epsilon
    if composition == "sequential":
        if not 0 < mixture_share < 1:
            raise ValueError(f"mixture_share must be in (0, 1), got {mixture_share!r}.")
        return mixture_share * epsilon, (1 - mixture_share) * epsilon
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def end_to_end_budget(
    ledgers: Mapping[str, accounting.PrivacyLedger],
    composition: Composition,
    *,
    delta: float,
    accountant: accounting.Accountant = "pld",
) -> accounting.PrivacyBudget:
    """The end-to-end (ε, δ) of a run's private stages, from their ledgers.

    Parallel composition (stages on disjoint splits): (max ε, δ) of the stages' ε at δ.
    Sequential composition (stages on the same data): the accountant's ε at δ of the
    composition of all the stages' events (`accounting.compose_ledgers`), not the sum of their
    ε. Both are computed by `accountant`.

    Privacy: parallel composition needs the stages' data disjoint in the privacy unit.
    """
    if not ledgers:
        raise ValueError("end_to_end_budget needs at least one stage ledger.")
    if composition == "parallel":
        return accounting.compose_parallel(
            *(ledger.budget(delta, accountant) for ledger in ledgers.values())
        )
    if composition == "sequential":
        return accounting.compose_ledgers(*ledgers.values()).budget(delta, accountant)
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def budget_to_json(budget: accounting.PrivacyBudget) -> dict[str, float]:
    """`budget` as the JSON a stage stores (`{"epsilon", "delta"}`)."""
    return {"epsilon": budget.epsilon, "delta": budget.delta}


def budget_from_json(data: Mapping[str, float]) -> accounting.PrivacyBudget:
    """The inverse of `budget_to_json`."""
    return accounting.PrivacyBudget(float(data["epsilon"]), float(data["delta"]))
