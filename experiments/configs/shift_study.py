"""Settings of the gradient-shift study: DP-MixMin's λ with and without a shift of the per-unit
λ-gradients before clipping, each at the default's clip norm and at a clip norm tuned for it.

Command (the stored run, docs/shift-study.md):
    python -m experiments.shift_study --reproducible --quiet --out runs/shift_study

Only the mixture stage runs (split, proxy, proxy outputs on D_mix, DP-MixMin and exact MixMin on
the same D_mix, as in `experiments.small_eps`), on the image default (`pipeline.presets`,
digits, data seed 0) and the text default (`pipeline.text_presets`, user level), at ε = 1 and
δ = 1e-5, over 5 seeds. Every shift of `mixing.SHIFTS` runs at the preset's C and at the C it
scored best with on other draws of the same default (image data seeds 100-103, text task seeds
100-101: other splits, mixtures and labels or users; never the reported data), chosen by λ's
mean cosine to non-private MixMin over a grid of multiples of the preset's C. η follows C as
η = η_preset · C_preset / C, so that a step with every gradient clipped moves λ's logits by the
preset's amount.

Measured duration of the stored run (docs/results/shift_study.json): 6 min 41 s wall clock on 2
shared CPU cores (`/usr/bin/time -v`), 1.7 GB peak memory.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.mixing.solvers import SHIFTS
from dpmix_jax.pipeline import ImagePipelineConfig, presets, text_presets
from dpmix_jax.pipeline.text import TextPipelineConfig
from dpmix_jax.privacy import validation


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShiftStudyConfig:
    """Attributes:
    image: the image pipeline settings (None: no image rows).
    text: the text pipeline settings (None: no text rows).
    epsilon: target ε of the mixture stage.
    seeds: run seeds (split, noise) on the reported task (data seed 0).
    shifts: the gradient shifts compared (`mixing.SHIFTS`).
    clip_factors: the tuning grid, multiples of the preset's C (1 included).
    image_tuning_seeds: image data seeds (and run seeds) the clip norms are tuned on.
    text_tuning_seeds: text task seeds (and run seeds) the clip norms are tuned on.
    tuning_draws: noise draws per tuning seed (the same streams at every grid point).
    """

    image: ImagePipelineConfig | None
    text: TextPipelineConfig | None
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    shifts: tuple[str, ...] = SHIFTS
    clip_factors: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    image_tuning_seeds: tuple[int, ...] = (100, 101, 102, 103)
    text_tuning_seeds: tuple[int, ...] = (100, 101)
    tuning_draws: int = 2

    def __post_init__(self) -> None:
        if self.image is None and self.text is None:
            raise ValueError("give an image or a text pipeline config (or both).")
        validation.check_epsilon(self.epsilon)
        validation.check_steps(self.tuning_draws, "tuning_draws")
        if not self.seeds:
            raise ValueError("seeds must be non-empty.")
        unknown = [s for s in self.shifts if s not in SHIFTS]
        if not self.shifts or unknown:
            raise ValueError(f"shifts must be a non-empty subset of {SHIFTS}, got {self.shifts}.")
        if 1.0 not in self.clip_factors or any(f <= 0 for f in self.clip_factors):
            raise ValueError(
                f"clip_factors must be positive and include 1 (the preset's C), got "
                f"{self.clip_factors}."
            )
        for name in ("image_tuning_seeds", "text_tuning_seeds"):
            tuning = getattr(self, name)
            shared = set(tuning) & ({0} | set(self.seeds))
            if not tuning or shared:
                raise ValueError(
                    f"{name} must be non-empty and disjoint from the seeds and from data seed 0 "
                    f"(never tune on the reported data); shared: {sorted(shared)}."
                )


def get_config() -> ShiftStudyConfig:
    """The image and text demo settings (`dpmix demo`, `dpmix demo --text`)."""
    return ShiftStudyConfig(image=presets.image_demo_config(), text=text_presets.text_demo_config())
