"""Settings of the low-ρ study: why DP-MixMin trails Uniform at ρ = 0.1 on the text stand-in
while the paper's DP-MixMin beats Uniform there.

Command (the stored run, docs/experiments.md):
    python -m experiments.low_rho --reproducible --quiet --out runs/low_rho

The Enron ρ sweep (docs/experiments.md) gives DP-MixMin a mean test perplexity above Uniform's at
ρ = 0.1 over 3 seeds, with one seed far above the other two. The study runs the same pipeline
(the embedded text default at user level, ε = 1) over more seeds and varies what plausibly
decides it, in two parts:

- λ alone, many noise draws per split (cheap: the mixture stage only): the size of D_mix (ρ),
  the mixture's sampling rate (its expected batch scaled to ρ = 0.3's rate), the mixture ε, and
  the released iterate (the last, as the pipeline releases, or the average: post-processing of
  the same run). Each λ is scored by its cosine to the population mixture λ*; Uniform's cosine
  is the line a λ must pass to say more about the task than λ = 1/k.
- the whole pipeline per seed, each seed one split and one noise stream for all arms: Uniform,
  DP-MixMin and non-private MixMin at ρ = 0.1, DP-MixMin's λ at a larger mixture ε fine-tuned at
  ε = 1, and DP-MixMin at ρ = 0.3, so that every arm pairs with Uniform by seed.

Expected: at ρ = 0.1 D_mix holds about 12 users, and at ε = 1 the noise in λ's logits
(η σ C √T / b) is several times the ρ = 0.3 noise: a share of the λs lands on domains λ* does
not use, and those seeds' perplexities sit far above Uniform's while the rest beat it. A batch
scaled with ρ leaves σ / b, hence the noise, about the same; a larger mixture ε removes it, as
more users in D_mix do. The stored run took 36 minutes on one CPU core shared with another job
(20 minutes of CPU time) and 2 GiB; the tiny preset runs the same code with a small model and a
few steps per stage in about a minute.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.models.gpt2 import GPT2Config
from dpmix_jax.pipeline.text import LanguageModelSpec, TextPipelineConfig
from dpmix_jax.pipeline.text_presets import text_demo_config
from dpmix_jax.privacy import validation
from dpmix_jax.train import TrainConfig

ARMS = ("uniform", "dp_mixmin", "nonprivate_mixmin")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LambdaCondition:
    """One setting of the mixture stage, run alone over many noise draws.

    Attributes:
        mix_fraction: ρ, the share of the sensitive train users given to D_mix.
        epsilon: the mixture ε.
        batch_size: the expected users per mixture step (None: the pipeline's).
    """

    mix_fraction: float
    epsilon: float
    batch_size: float | None = None

    def __post_init__(self) -> None:
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must lie in (0, 1), got {self.mix_fraction!r}.")
        validation.check_epsilon(self.epsilon)
        if self.batch_size is not None:
            validation.check_positive(self.batch_size, "batch_size")

    def label(self, pipeline: TextPipelineConfig) -> str:
        """How tables name the condition, with the batch the mixture stage runs at."""
        batch = pipeline.mixture.batch_size if self.batch_size is None else self.batch_size
        return f"ρ = {self.mix_fraction:g}, ε = {self.epsilon:g}, b = {batch:.3g}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LowRhoConfig:
    """Public settings of the study.

    Attributes:
        pipeline: the text pipeline (its ρ is replaced by `mix_fraction` or
            `reference_mix_fraction`).
        mix_fraction: the ρ studied.
        reference_mix_fraction: the ρ of the reference DP-MixMin arm.
        epsilon: the end-to-end ε of every arm, and the fine-tuning ε of the larger-mixture-ε
            arms.
        mixture_epsilons: mixture ε of the extra DP-MixMin arms at `mix_fraction` (λ at this ε,
            fine-tuned at `epsilon`: end to end the larger of the two).
        lambda_conditions: the mixture settings of the λ-only part.
        lambda_draws: noise draws per seed and λ condition.
        seeds: seeds of both parts (each its own split of D_mix and D_ft).
        progress: print a line per part and arm.
    """

    pipeline: TextPipelineConfig
    mix_fraction: float = 0.1
    reference_mix_fraction: float = 0.3
    epsilon: float = 1.0
    mixture_epsilons: tuple[float, ...] = (4.0,)
    lambda_conditions: tuple[LambdaCondition, ...] = (
        LambdaCondition(mix_fraction=0.1, epsilon=1.0),
        LambdaCondition(mix_fraction=0.1, epsilon=1.0, batch_size=4 / 3),
        LambdaCondition(mix_fraction=0.1, epsilon=2.0),
        LambdaCondition(mix_fraction=0.1, epsilon=4.0),
        LambdaCondition(mix_fraction=0.2, epsilon=1.0),
        LambdaCondition(mix_fraction=0.3, epsilon=1.0),
    )
    lambda_draws: int = 20
    seeds: tuple[int, ...] = tuple(range(10))
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.seeds or not self.lambda_conditions:
            raise ValueError("seeds and lambda_conditions must be non-empty.")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError("seeds must not repeat.")
        for rho in (self.mix_fraction, self.reference_mix_fraction):
            if not 0 < rho < 1:
                raise ValueError(f"mix fractions must lie in (0, 1), got {rho!r}.")
        if self.mix_fraction == self.reference_mix_fraction:
            raise ValueError("reference_mix_fraction must differ from mix_fraction.")
        validation.check_epsilon(self.epsilon)
        for epsilon in self.mixture_epsilons:
            validation.check_epsilon(epsilon)
        validation.check_steps(self.lambda_draws, "lambda_draws")

    def pipeline_at(self, mix_fraction: float) -> TextPipelineConfig:
        """The pipeline at ρ = `mix_fraction`."""
        return dataclasses.replace(self.pipeline, mix_fraction=mix_fraction)


PRESETS = {
    "cpu": "the embedded text default at user level, 10 seeds (the stored run)",
    "tiny": "a one-minute check of the wiring (a small model, a few steps per stage, 2 seeds)",
}


def get_config(preset: str = "cpu") -> LowRhoConfig:
    """The preset's settings."""
    if preset == "cpu":
        return LowRhoConfig(pipeline=text_demo_config())
    if preset == "tiny":
        quiet = {"progress": False, "log_every": None}
        small = LanguageModelSpec(
            config=GPT2Config.tiny(n_layer=1, n_embd=32, n_head=2, n_positions=32)
        )
        demo = text_demo_config()
        pipeline = dataclasses.replace(
            demo,
            vocab_size=300,
            proxy_model=small,
            model=small,
            proxy=TrainConfig(steps=6, batch_size=8, learning_rate=3e-3, **quiet),
            mixture=dataclasses.replace(demo.mixture, steps=10, nonprivate_steps=10),
            pretrain=TrainConfig(steps=6, batch_size=8, learning_rate=3e-3, **quiet),
            finetune=dataclasses.replace(demo.finetune, steps=3),
            finetune_last_blocks=0,
        )
        return LowRhoConfig(
            pipeline=pipeline,
            lambda_conditions=(
                LambdaCondition(mix_fraction=0.1, epsilon=1.0),
                LambdaCondition(mix_fraction=0.1, epsilon=4.0, batch_size=2.0),
            ),
            lambda_draws=3,
            seeds=(0, 1),
        )
    raise ValueError(f"preset must be 'cpu' or 'tiny', got {preset!r}.")
