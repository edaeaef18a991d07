"""Settings of the DP-MixMin gap study: why DP-MixMin trails non-private MixMin on the digits
stand-in while the paper finds them comparable.

Command (the stored run, docs/ablations.md):
    python -m experiments.mixmin_gap --reproducible --quiet --out runs/mixmin_gap

The ablations' composition table (docs/ablations.md) sets parallel DP-MixMin beside non-private
MixMin, which fine-tunes on the whole train split while DP-MixMin fine-tunes on D_ft only. The
study separates the two things that differ, per seed on the same split: the data fine-tuned on
(non-private MixMin's λ fine-tuned on D_ft, the same rows as DP-MixMin) and the noise in λ
(DP-MixMin's λ computed at a larger mixture ε, fine-tuned at the run's ε). It varies what
plausibly decides the gap: the size of D_mix (ρ, the mixture batch scaled with ρ to keep the
sampling rate, as in the ablations), the fine-tuning budget (steps of DP-SGD at the same ε) and
the number of seeds (8, against the ablations' 3), with Uniform on D_ft as the floor.

Expected: the fine-tuning data explain little of the gap (D_ft against the whole split is
30% fewer rows at ρ = 0.3); the noise in λ explains it: the gap narrows as D_mix grows or the
mixture ε rises, as the privacy term of the error bound (`experiments.rho_guide`) falls with the
number of examples that average the noise. The stored run took 9 minutes on one CPU core and
1.3 GiB; the tiny preset runs the same code with 3 steps per stage in under a minute.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import ImagePipelineConfig, presets
from dpmix_jax.privacy import validation

ARMS = ("uniform", "dp_mixmin", "nonprivate_ft", "nonprivate_all")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Condition:
    """One pipeline setting of the study.

    Attributes:
        mix_fraction: ρ, the share of the sensitive train split given to D_mix.
        finetune_steps: the DP fine-tuning steps (the fine-tuning budget at the run's ε).
    """

    mix_fraction: float
    finetune_steps: int

    def __post_init__(self) -> None:
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must lie in (0, 1), got {self.mix_fraction!r}.")
        validation.check_steps(self.finetune_steps, "finetune_steps")

    @property
    def label(self) -> str:
        """How tables name the condition."""
        return f"ρ = {self.mix_fraction:g}, {self.finetune_steps} fine-tuning steps"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixMinGapConfig:
    """Public settings of the study.

    Attributes:
        pipeline: the base pipeline (its ρ and fine-tuning steps are each condition's).
        conditions: the pipeline settings compared; every arm of `ARMS` runs at each.
        image_size: side of the digit images.
        epsilon: the fine-tuning ε of every arm, and DP-MixMin's end-to-end ε.
        mixture_epsilons: mixture ε of the extra DP-MixMin arms, run at the base condition
            only (λ at this ε, fine-tuned at `epsilon`: end to end the larger of the two).
        seeds: seeds per condition (each its own split, proxies and noise).
        progress: print a line per condition.
    """

    pipeline: ImagePipelineConfig
    conditions: tuple[Condition, ...] = (
        Condition(mix_fraction=0.1, finetune_steps=60),
        Condition(mix_fraction=0.3, finetune_steps=60),
        Condition(mix_fraction=0.5, finetune_steps=60),
        Condition(mix_fraction=0.7, finetune_steps=60),
        Condition(mix_fraction=0.3, finetune_steps=240),
    )
    image_size: int = 16
    epsilon: float = 1.0
    mixture_epsilons: tuple[float, ...] = (4.0, 16.0)
    seeds: tuple[int, ...] = tuple(range(8))
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.conditions or not self.seeds:
            raise ValueError("conditions and seeds must be non-empty.")
        if len(set(self.conditions)) != len(self.conditions):
            raise ValueError("conditions must not repeat.")
        if self.base not in self.conditions:
            raise ValueError(
                f"conditions must include the base pipeline's ({self.base.label}), where the "
                "mixture_epsilons run."
            )
        validation.check_steps(self.image_size, "image_size")
        validation.check_epsilon(self.epsilon)
        for epsilon in self.mixture_epsilons:
            validation.check_epsilon(epsilon)

    @property
    def base(self) -> Condition:
        """The base pipeline's condition."""
        return Condition(
            mix_fraction=self.pipeline.mix_fraction,
            finetune_steps=self.pipeline.finetune.steps,
        )

    def pipeline_for(self, condition: Condition) -> ImagePipelineConfig:
        """The pipeline of `condition`: the base with its ρ, the mixture batch scaled by ρ / ρ_0
        (the base's sampling rate of D_mix) and its fine-tuning steps."""
        base = self.pipeline
        batch = base.mixture.batch_size
        if condition.mix_fraction != base.mix_fraction:
            batch = round(batch * condition.mix_fraction / base.mix_fraction, 6)
        return dataclasses.replace(
            base,
            mix_fraction=condition.mix_fraction,
            mixture=dataclasses.replace(base.mixture, batch_size=batch),
            finetune=dataclasses.replace(base.finetune, steps=condition.finetune_steps),
        )


PRESETS = {
    "cpu": "the digits default, 5 conditions × 8 seeds (the stored run)",
    "tiny": "a one-minute check of the wiring (3 steps per stage, 1 seed)",
}


def get_config(preset: str = "cpu") -> MixMinGapConfig:
    """The preset's settings."""
    if preset == "cpu":
        return MixMinGapConfig(pipeline=presets.image_demo_config())
    if preset == "tiny":
        return MixMinGapConfig(
            pipeline=presets.wiring_check_config(),
            conditions=(
                Condition(mix_fraction=0.3, finetune_steps=3),
                Condition(mix_fraction=0.5, finetune_steps=3),
            ),
            image_size=8,
            mixture_epsilons=(16.0,),
            seeds=(0,),
        )
    raise ValueError(f"preset must be 'cpu' or 'tiny', got {preset!r}.")
