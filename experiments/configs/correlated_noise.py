"""Settings of the correlated-noise study: BandMF's correlated noise against DP-SGD's independent
noise at equal ε, in fine-tuning (image and text), in DP-MixMin, and in the cost of a noise step.

Command (the stored run, docs/correlated-noise.md):
    python -m experiments.correlated_noise --out runs/correlated_noise --reproducible

Every mechanism's σ is calibrated to the same target ε (BandMF with b bands: cyclic Poisson
sampling over b partitions, accounted as DP-SGD with ceil(T / b) steps at the partition's rate);
3 seeds. The parts: the image demo's private fine-tuning from a random initialisation (150
steps, 16 epochs, b in {2, 8}, ε in {1, 4}); a long fine-tuning meant for BandMF (expected batch
16, 750 steps, 10 epochs, b in {4, 16}, ε in {1, 4, 16}) with the preset's Adam and with SGD with
momentum at η = 0.05 (DP-SGD's best of {0.02, 0.05, 0.1, 0.2} by validation AUC at ε = 4 in one
run of seed 100, not a reported seed; BandMF was not tuned); the text demo's user-level
fine-tuning of the uniform-pretrained model (60 steps); DP-MixMin on the synthetic problem of
`mixing.synthetic.mixture_problem` (k = 8, n = 20,000); one jitted noise update on 10⁶
parameters.

Measured (docs/correlated-noise.md has the tables, rebuilt from
docs/results/correlated_noise.json; 8 min 23 s on 2 CPU cores): with the preset's batch of 128
BandMF is below DP-SGD (test AUC 0.6416 to 0.6839 against 0.6627 and 0.7171); in the long
fine-tuning with momentum BandMF b = 4 is above DP-SGD at every ε (0.7518 against 0.7133 at
ε = 1); on text the perplexities agree within the seeds' spread (70.9 to 71.7); DP-MixMin's
cosine to non-private MixMin is 0.997 to 0.998 for every mechanism.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import correlated_noise, validation
from dpmix_jax.train.config import Optimizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrelatedNoiseConfig:
    """Public settings of the study.

    Attributes:
        bands: BandMF's b values of the fine-tuning, text and DP-MixMin parts (the
            independent-noise baseline always runs).
        epsilons: the target ε of those parts.
        seeds: data, initialisation and (with `--reproducible`) noise seeds.
        finetune_steps: T of the image fine-tuning.
        long_bands, long_epsilons: b and ε of the long fine-tuning.
        long_batch_size, long_steps: its expected batch and T.
        long_optimizers: (optimizer, learning rate) pairs of the long fine-tuning, each run in
            full (learning rate None: the preset's).
        text_steps: T of the text fine-tuning.
        mixmin_examples, mixmin_sources: n and k of the synthetic DP-MixMin problem.
        mixmin_steps, mixmin_batch_size, mixmin_clip_norm, mixmin_learning_rate: its T, b, C
            and η.
        delta: δ of every run.
        bench_size: parameters of the timed noise update.
        bench_repeats: timed calls of the noise update (the median is reported).
    """

    bands: tuple[int, ...] = (2, 8)
    epsilons: tuple[float, ...] = (1.0, 4.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    finetune_steps: int = 150
    long_bands: tuple[int, ...] = (4, 16)
    long_batch_size: int = 16
    long_steps: int = 750
    long_epsilons: tuple[float, ...] = (1.0, 4.0, 16.0)
    long_optimizers: tuple[tuple[Optimizer, float | None], ...] = (
        ("adam", None),
        ("momentum", 0.05),
    )
    text_steps: int = 60
    mixmin_examples: int = 20_000
    mixmin_sources: int = 8
    mixmin_steps: int = 300
    mixmin_batch_size: int = 1000
    mixmin_clip_norm: float = 10.0
    mixmin_learning_rate: float = 0.2
    delta: float = 1e-5
    bench_size: int = 1_000_000
    bench_repeats: int = 20

    def __post_init__(self) -> None:
        for b in self.bands + self.long_bands:
            correlated_noise.check_bands(b)
        for epsilon in self.epsilons + self.long_epsilons:
            validation.check_epsilon(epsilon)
        validation.check_delta(self.delta)
        validation.check_steps(self.finetune_steps, "finetune_steps")
        validation.check_steps(self.long_steps, "long_steps")
        validation.check_steps(self.text_steps, "text_steps")
        if not isinstance(self.long_batch_size, int) or self.long_batch_size < 1:
            raise ValueError(
                f"long_batch_size must be an integer >= 1, got {self.long_batch_size!r}"
            )
        validation.check_steps(self.mixmin_steps, "mixmin_steps")
        validation.check_steps(self.bench_repeats, "bench_repeats")
        if not self.long_optimizers:
            raise ValueError("long_optimizers must name at least one (optimizer, learning rate).")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed.")


def get_config() -> CorrelatedNoiseConfig:
    """The stored run's settings."""
    return CorrelatedNoiseConfig()
