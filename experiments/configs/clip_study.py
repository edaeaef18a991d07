"""Settings of the clipping study: DP-MixMin's excess loss against the clip norm C, with each
per-example gradient shift, without noise and at ε = 1.

Command:
    python -m experiments.clip_study --out runs/clip_study

On the synthetic exact-mixture problem of `mixing.synthetic.mixture_problem` (k = 8, n = 20,000,
two seeds), DP-MixMin (mirror descent, T = 300, b = 1000, η = 2 / C) runs at every C of 0.03 to
30 and every shift of `mixing.SHIFTS`, once with σ = 0 (the clipping bias alone) and once at
ε = 1, δ = 1e-5 (σ = 3.40); `clip_study.md` has the mean excess per (setting, shift, C) and the
fraction of examples clipped at the non-private optimum.

Measured with `--reproducible` (35 s and 0.7 GB on 2 CPU cores; not a stored run): the excess is
smallest at C = 10 for every shift, with and without noise (σ = 0: 1.1e-3 without a shift,
3.8e-4 with the mean shift, 4.9e-4 weighted; ε = 1: 1.1e-3, 4.1e-4, 5.6e-4). At C <= 1, where
91% to 100% of the examples are clipped at the optimum, every excess (0.15 to 0.23) is above
uniform weights' 0.12; at C = 30 (η = 0.067) it rises again to 2.8e-3 to 3.0e-3, noise or not.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.mixing.solvers import SHIFTS
from dpmix_jax.privacy import validation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClipStudyConfig:
    """Public settings of the clipping study.

    Attributes:
        clip_norms: the clip norms C compared.
        shifts: the gradient shifts compared (`mixing.SHIFTS`).
        seeds: data seeds (and, with `--reproducible`, the noise's).
        num_sources: k of the synthetic problem.
        num_examples: n of the synthetic problem.
        epsilon, delta: the privacy target of the noisy runs.
        steps: T of every DP-MixMin run.
        batch_size: the expected batch size b.
        step_scale: η0 of the step η = η0 / C (a step moves the logits by at most about η0).
    """

    clip_norms: tuple[float, ...] = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0)
    shifts: tuple[str, ...] = SHIFTS
    seeds: tuple[int, ...] = (0, 1)
    num_sources: int = 8
    num_examples: int = 20_000
    epsilon: float = 1.0
    delta: float = 1e-5
    steps: int = 300
    batch_size: int = 1000
    step_scale: float = 2.0

    def __post_init__(self) -> None:
        for c in self.clip_norms:
            validation.check_positive(c, "clip_norm")
        if not set(self.shifts) <= set(SHIFTS) or not self.shifts:
            raise ValueError(f"shifts must be a non-empty subset of {SHIFTS}.")
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)
        validation.check_steps(self.steps)
        validation.check_positive(self.step_scale, "step_scale")


def get_config() -> ClipStudyConfig:
    """The study's settings (k = 8, n = 20,000, two seeds, seven clip norms)."""
    return ClipStudyConfig()
