"""What every DP-MixMin pipeline shares: methods, settings, splits, stage storage and budgets.

A pipeline run is one (method, ε, seed) of one experiment. Its stages (split, proxy, mixture,
pretraining, fine-tuning, evaluation) store their results under a run directory; a rerun finds
them there and skips the work, so a killed pipeline resumes where it stopped and reports the same
budget (training stages resume mid-run from their orbax checkpoints, see `train.checkpoint`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

import numpy as np

from dpmix_jax.data.sources import group_disjoint_split, random_split
from dpmix_jax.mixing import DEFAULT_SHIFT
from dpmix_jax.privacy import accounting

Method = Literal["dp_mixmin", "uniform", "random_init", "random_search", "nonprivate_mixmin"]
METHODS: tuple[Method, ...] = (
    "dp_mixmin",
    "uniform",
    "random_init",
    "random_search",
    "nonprivate_mixmin",
)
Composition = Literal["parallel", "sequential"]

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
class MixtureConfig:
    """Public settings of the DP-MixMin stage (see `mixing.dp_mixmin`).

    Attributes:
        steps: T, mirror-descent (or Frank-Wolfe) steps.
        batch_size: expected examples (or users, at user level) per step.
        clip_norm: C of the per-unit λ-gradient.
        learning_rate: η (None for Frank-Wolfe).
        solver: "mirror_descent" or "frank_wolfe".
        shift: per-example gradient shift before clipping.
        max_examples_per_user: G for user-level runs.
        accountant: "pld" or "rdp".
        nonprivate_steps: steps of the exact (non-private) MixMin baseline.
    """

    steps: int
    batch_size: float
    clip_norm: float
    learning_rate: float | None
    solver: str = "mirror_descent"
    shift: str = DEFAULT_SHIFT
    max_examples_per_user: int | None = None
    accountant: accounting.Accountant = "pld"
    nonprivate_steps: int = 300

    def __post_init__(self) -> None:
        accounting.check_steps(self.steps)
        accounting.check_steps(self.nonprivate_steps, "nonprivate_steps")
        accounting.check_positive(self.batch_size, "batch_size")
        accounting.check_positive(self.clip_norm, "clip_norm")
        if self.solver not in ("mirror_descent", "frank_wolfe"):
            raise ValueError(
                f"solver must be 'mirror_descent' or 'frank_wolfe', got {self.solver!r}."
            )
        if (self.learning_rate is None) != (self.solver == "frank_wolfe"):
            raise ValueError(
                "learning_rate is required for mirror descent and unused by Frank-Wolfe."
            )


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
        extra: method-specific details (validation scores of candidates, σ, ...).
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
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
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
            "extra": dict(self.extra),
        }


def stage_epsilons(
    epsilon: float, composition: Composition, mixture_share: float
) -> tuple[float, float]:
    """Target ε of the mixture and fine-tuning stages for an end-to-end target ε.

    Parallel composition (disjoint D_mix and D_ft): both stages get the whole ε. Sequential
    composition (both stages on the same, unsplit data): ε_mix = share·ε, ε_ft = (1 - share)·ε
    (the paper's sequential setting is share = 0.1).
    """
    accounting.check_epsilon(epsilon)
    if composition == "parallel":
        return epsilon, epsilon
    if composition == "sequential":
        if not 0 < mixture_share < 1:
            raise ValueError(f"mixture_share must be in (0, 1), got {mixture_share!r}.")
        return mixture_share * epsilon, (1 - mixture_share) * epsilon
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def end_to_end_budget(
    stages: Mapping[str, accounting.PrivacyBudget], composition: Composition
) -> accounting.PrivacyBudget:
    """Parallel composition (max, max) over disjoint splits, or sequential (sums) over the same."""
    if composition == "parallel":
        return accounting.compose_parallel(*stages.values())
    if composition == "sequential":
        return accounting.compose_sequential(*stages.values())
    raise ValueError(f"composition must be 'parallel' or 'sequential', got {composition!r}.")


def split_mixture(
    num_examples: int, mix_fraction: float, *, seed: int, group_ids: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (D_mix, D_ft) index arrays: a fraction ρ for the mixture, the rest to fine-tune.

    With `group_ids` (users) the split is along group boundaries: a user is in one part only.

    Privacy: the split is data-independent (a seeded permutation of positions or users), so each
    part can be spent on separately and the budgets compose in parallel.
    """
    if not 0 < mix_fraction < 1:
        raise ValueError(f"mix_fraction (ρ) must be in (0, 1), got {mix_fraction!r}.")
    fractions = (mix_fraction, 1 - mix_fraction)
    if group_ids is None:
        mix, ft = random_split(num_examples, fractions, seed=seed)
    else:
        mix, ft = group_disjoint_split(np.asarray(group_ids), fractions, seed=seed)
    if len(mix) == 0 or len(ft) == 0:
        raise ValueError(
            f"ρ = {mix_fraction} leaves an empty part of {num_examples} examples; change ρ."
        )
    return mix, ft


def dirichlet_candidates(k: int, count: int, *, seed: int) -> np.ndarray:
    """`count` mixture candidates λ ~ Dirichlet(1, ..., 1) over k sources (random search)."""
    return np.random.default_rng(seed).dirichlet(np.ones(k), size=count)


def weights_key(weights: np.ndarray | None) -> str:
    """A short stable name for a λ (stage directories are shared between runs with equal λ)."""
    if weights is None:
        return "none"
    rounded = np.round(np.asarray(weights, dtype=np.float64), 10)
    return hashlib.sha256(rounded.tobytes()).hexdigest()[:12]


class StageStore:
    """JSON results of pipeline stages under one directory; computed once, then read back."""

    def __init__(self, root: str | os.PathLike):
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, *parts: str) -> pathlib.Path:
        """A sub-directory for a stage's own files (checkpoints), created if needed."""
        path = self.root.joinpath(*parts)
        path.mkdir(parents=True, exist_ok=True)
        return path

    def has(self, name: str) -> bool:
        return (self.root / f"{name}.json").exists()

    def json(self, name: str, compute: Callable[[], Mapping[str, Any]]) -> dict[str, Any]:
        """The stored result `name`, or `compute()` written atomically and returned."""
        target = self.root / f"{name}.json"
        if target.exists():
            return json.loads(target.read_text())
        result = dict(compute())
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=1, default=_json_default))
        tmp.replace(target)
        return json.loads(target.read_text())


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} as JSON")


def budget_to_json(budget: accounting.PrivacyBudget) -> dict[str, float]:
    return {"epsilon": budget.epsilon, "delta": budget.delta}


def budget_from_json(data: Mapping[str, float]) -> accounting.PrivacyBudget:
    return accounting.PrivacyBudget(float(data["epsilon"]), float(data["delta"]))


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
