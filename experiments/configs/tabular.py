"""Settings of the tabular study: DP-MixMin, Uniform, Random Init and the density-ratio variant
on the statsmodels `fair` table, over ε and a covariate-shift knob.

Command:
    python -m experiments.tabular --reproducible --out runs/tabular

Methods: DP-MixMin, Uniform, Random Init, the density-ratio variant (`dp_mixmin_ratio`) and, as
a labelled non-private reference, non-private MixMin.

The table (`data.tabular`): 6,366 rows of the `fair` survey; a public pool of 35% of the rows
split into k = 4 age-band sources; 1,500 sensitive rows drawn from the rest with the age mix
π* = (0.1, 0.15, 0.25, 0.5) and a tilt exp(-shift · z(marriage rating)) within every band
(shift ∈ {0, 1, 2}); test 400, validation 150, train 950 rows (D_mix ≈ 285 at ρ = 0.3).
Pipeline: MLP (one hidden layer of 32), a proxy per source (200 steps), DP-MixMin (T = 100,
b = 60, C = 5, η = 0.4), pretraining 300 steps, DP fine-tuning 60 steps at b = 128, C = 1; the
variant's domain classifier is a logistic regression, 100 DP-SGD steps at b = 256, C = 1.
δ = 1e-5, ε ∈ {0.5, 1, 3}, seeds 0-2. The settings are the image demo's adapted to the table's
size (fixed before the study ran; none was tuned on its results).

Measured (`docs/tabular.md` has the tables, rebuilt from `docs/results/tabular.json`): 135 runs
in 7 min 19 s wall and 1.08 GB peak resident memory under `/usr/bin/time -v` on the shared
2-core machine. Pretraining on the public sources beats Random Init by +0.06 to +0.13 AUC;
DP-MixMin is level with Uniform (paired differences -0.023 to +0.005 at every shift and ε) and
non-private MixMin is below it (-0.006 to -0.017); the density-ratio variant is below DP-MixMin
at 7 of 9 points, by up to 0.038 at shift 2.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.data.tabular import TabularTaskConfig
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.pipeline.tabular import RATIO_METHOD, DensityRatioConfig, TabularPipelineConfig
from dpmix_jax.train import TrainConfig

METHODS = ("dp_mixmin", "uniform", "random_init", RATIO_METHOD, "nonprivate_mixmin")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TabularStudyConfig:
    """Settings of the study.

    Attributes:
        task: the tabular task (its `shift` is replaced by each entry of `shifts`).
        pipeline: the pipeline settings.
        shifts: the covariate-shift knob's values.
        epsilons, seeds, methods: the grid (methods from `METHODS`).
    """

    task: TabularTaskConfig = TabularTaskConfig()
    pipeline: TabularPipelineConfig
    shifts: tuple[float, ...] = (0.0, 1.0, 2.0)
    epsilons: tuple[float, ...] = (0.5, 1.0, 3.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = METHODS

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"methods must be among {METHODS}, got {self.methods!r}.")
        for name in ("shifts", "epsilons", "seeds"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty.")
        for shift in self.shifts:
            TabularTaskConfig(shift=shift)  # validates the knob


def pipeline_config(**overrides) -> TabularPipelineConfig:
    """The study's pipeline settings (see the module docstring)."""
    quiet = {"progress": False, "log_every": None}
    settings = dict(
        delta=1e-5,
        mix_fraction=0.3,
        proxy=TrainConfig(steps=200, batch_size=64, learning_rate=3e-3, **quiet),
        mixture=MixtureConfig(steps=100, batch_size=60, clip_norm=5.0, learning_rate=0.4),
        pretrain=TrainConfig(steps=300, batch_size=128, learning_rate=3e-3, **quiet),
        finetune=TrainConfig(
            steps=60,
            batch_size=128,
            learning_rate=1e-3,
            private=True,
            clip_norm=1.0,
            epsilon=1.0,
            delta=1e-5,
            chunk_size=64,
            pad_multiple=64,
            **quiet,
        ),
        density_ratio=DensityRatioConfig(
            steps=100, batch_size=256, clip_norm=1.0, learning_rate=0.05
        ),
    )
    settings.update(overrides)
    return TabularPipelineConfig(**settings)


def get_config(**overrides) -> TabularStudyConfig:
    """The study's settings (`python -m experiments.tabular`)."""
    return TabularStudyConfig(pipeline=pipeline_config(), **overrides)
