"""Settings of the Enron stand-in's order study: why Random Search beats Uniform and DP-MixMin's
gain over Uniform does not widen as ε shrinks on the text default, where the paper (Table 1)
finds Random Search worse than Uniform and a gain of 13.9-15.6% that widens as ε shrinks.

Command (the stored run, docs/experiments.md):
    python -m experiments.enron_order --reproducible --quiet --out runs/enron_order

The study runs the text default of `python -m experiments.enron --preset cpu` (ρ = 0.3, user
level) and separates what decides the two orders, per seed on one split: the pretraining (each
λ's pretrained model is scored before any fine-tuning) from the DP fine-tuning (the same model
fine-tuned at each ε), and, for Random Search, the candidates from the selection (m Dirichlet(1)
candidates fine-tuned on D_ft, the best of the first m on validation users for m = 1, 2, 4:
m = 1 is one random λ, no selection). It varies the fine-tuning ε (1 and 5, the ends of the
paper's grid) and the number of candidates, and records how far each λ lies from the task's
sparse λ* (its cosine), over 3 seeds.

Expected: DP fine-tuning barely moves any model (its test perplexity changes by far less than
the gaps between the λs), so every method's perplexity is its pretraining's and the gain over
Uniform is λ's alone: it follows DP-MixMin's λ, which is about as good at ε = 1 as at ε = 5, and
cannot widen as ε shrinks. Random Search beats Uniform through its selection: λ* leaves most
domains at zero, a single Dirichlet candidate is no better than Uniform on average, and the best
of m on validation users is. The stored run took 17 minutes on one loaded CPU core and 1.4 GiB;
the tiny preset runs the same code with 3 steps per stage in about two minutes.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline.text import TextPipelineConfig
from dpmix_jax.pipeline.text_presets import text_demo_config
from dpmix_jax.privacy import validation


@dataclasses.dataclass(frozen=True, kw_only=True)
class EnronOrderConfig:
    """Public settings of the study.

    Attributes:
        pipeline: the text pipeline (the Enron stand-in's, ρ = 0.3, user level).
        epsilons: the fine-tuning ε of Uniform and DP-MixMin (DP-MixMin's λ at the same ε,
            parallel composition); Random Search's candidates are fine-tuned at the first.
        candidates: Random Search's candidates per seed; the study selects among the first m
            for every m in `selections`.
        selections: the numbers of candidates m of the Random Search rows.
        seeds: seeds (each its own split, pretraining and noise).
        progress: print a line per seed.
    """

    pipeline: TextPipelineConfig
    epsilons: tuple[float, ...] = (1.0, 5.0)
    candidates: int = 4
    selections: tuple[int, ...] = (1, 2, 4)
    seeds: tuple[int, ...] = (0, 1, 2)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.epsilons or not self.seeds:
            raise ValueError("epsilons and seeds must be non-empty.")
        for epsilon in self.epsilons:
            validation.check_epsilon(epsilon)
        validation.check_steps(self.candidates, "candidates")
        if not self.selections or not all(1 <= m <= self.candidates for m in self.selections):
            raise ValueError(
                f"selections must lie in 1..{self.candidates} (the candidates), got "
                f"{self.selections!r}."
            )


PRESETS = {
    "cpu": "the Enron stand-in at ρ = 0.3, ε ∈ {1, 5}, 4 candidates, 3 seeds (the stored run)",
    "tiny": "a check of the wiring (3 steps per stage, 2 candidates, 1 seed)",
}


def get_config(preset: str = "cpu") -> EnronOrderConfig:
    """The preset's settings."""
    if preset == "cpu":
        return EnronOrderConfig(pipeline=text_demo_config())
    if preset == "tiny":
        demo = text_demo_config()
        short = {
            name: dataclasses.replace(getattr(demo, name), steps=3)
            for name in ("proxy", "pretrain", "finetune")
        }
        mixture = dataclasses.replace(demo.mixture, steps=3)
        return EnronOrderConfig(
            pipeline=dataclasses.replace(demo, mixture=mixture, **short),
            candidates=2,
            selections=(1, 2),
            seeds=(0,),
        )
    raise ValueError(f"preset must be 'cpu' or 'tiny', got {preset!r}.")
