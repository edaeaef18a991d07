"""The methods a pipeline runs and what one run returns: `METHODS`, what each method reads of the
sensitive data (`METHOD_NOTES`), and `RunResult`, one (method, ε, seed) of an experiment as it is
stored and reported."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from dpmix_jax.pipeline.budget import Composition
from dpmix_jax.privacy import accounting

Method = Literal["dp_mixmin", "uniform", "random_init", "random_search", "nonprivate_mixmin"]
METHODS: tuple[Method, ...] = (
    "dp_mixmin",
    "uniform",
    "random_init",
    "random_search",
    "nonprivate_mixmin",
)

# What each method reads of the sensitive train split, and whether its λ is private.
METHOD_NOTES: Mapping[str, str] = {
    "dp_mixmin": "λ by DP-MixMin on D_mix, pretrain on λ, DP fine-tune on D_ft (disjoint)",
    "uniform": "λ = 1/k, pretrain on λ, DP fine-tune on all of the train split",
    "random_init": "no pretraining, DP fine-tune on all of the train split",
    "random_search": (
        "Dirichlet(1) candidates, each pretrained and DP fine-tuned on D_ft; the best is picked "
        "on the validation split NON-PRIVATELY (overstates what a private search achieves)"
    ),
    "nonprivate_mixmin": (
        "λ by exact MixMin on D_mix (NOT private: an upper bound), DP fine-tune on all of train"
    ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunResult:
    """One (method, ε, seed) of an experiment.

    Attributes:
        method: one of `METHODS`.
        epsilon: the target ε of the run.
        delta: δ.
        seed: the run's seed.
        utility: the experiment's metric on the test split.
        weights: the λ the run pretrained on (None for random init).
        spent: the end-to-end (ε, δ) the accountants report for what ran.
        stages: per-stage spent budgets ("mixture", "finetune").
        composition: how the stages' budgets were combined.
        private: False when some choice used sensitive data without accounting (random search's
            selection, non-private MixMin's λ).
        seeded: True when the run's seed drove its private randomness (split, noise, sampling):
            reproducible, and not private against anyone who knows the seed
            (`privacy.SEEDED_NOTE`). False: the randomness was a secret from the operating
            system and `seed` only numbers the repetition.
        extra: method-specific details (validation scores of candidates, σ, ...).
        allow_large_delta: True when the run accepted a δ >= 1/n for some private stage's n
            units (the user's explicit override; such a δ protects nobody).
    """

    method: str
    epsilon: float
    delta: float
    seed: int
    utility: float
    weights: list[float] | None
    spent: accounting.PrivacyBudget
    stages: Mapping[str, accounting.PrivacyBudget]
    composition: Composition
    private: bool
    seeded: bool
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    allow_large_delta: bool = False

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunResult:
        """The inverse of `to_json`."""
        delta = float(data["delta"])
        return cls(
            method=data["method"],
            epsilon=data["epsilon"],
            delta=delta,
            seed=data["seed"],
            utility=data["utility"],
            weights=data["weights"],
            spent=accounting.PrivacyBudget(data["spent_epsilon"], data["spent_delta"]),
            stages={
                k: accounting.PrivacyBudget(v, delta) for k, v in data["stage_epsilons"].items()
            },
            composition=data["composition"],
            private=data["private"],
            seeded=data.get("noise_seeded", True),  # results stored before secret randomness
            extra=data["extra"],
            allow_large_delta=data.get("allow_large_delta", False),
        )

    def to_json(self) -> dict[str, Any]:
        """The result as the JSON a run's stage stores and `results.json` lists."""
        return {
            "method": self.method,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "seed": self.seed,
            "utility": self.utility,
            "weights": self.weights,
            "spent_epsilon": self.spent.epsilon,
            "spent_delta": self.spent.delta,
            "stage_epsilons": {k: v.epsilon for k, v in self.stages.items()},
            "composition": self.composition,
            "private": self.private,
            "noise_seeded": self.seeded,
            "extra": dict(self.extra),
            "allow_large_delta": self.allow_large_delta,
        }
