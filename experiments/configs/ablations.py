"""Ablations of DP-MixMin (paper appendix A.5 and A.7, Tables 1, 3 and 6), on one image task.

Command:
    python -m experiments.ablations --preset cpu --reproducible --out runs/ablations
    python -m experiments.ablations --preset paper --nih-root DIR --public-root DIR --out DIR

Three studies, each DP-MixMin at end-to-end ε = 1 (δ = 1e-5) over several seeds, beside Uniform
pretraining (the same pipeline with λ uniform):
- ρ, the fraction of the sensitive train split given to the mixture stage. Paper (Enron, ε = 1,
  Table 1): perplexity 17.97 ± 2.72, 17.52 ± 1.55, 16.78 ± 0.55 at ρ = 0.1, 0.2, 0.3.
- proxy training budget. Paper (NIH Atelectasis with CheXpert, ε = 1, Table 3): AUC 0.744,
  0.745, 0.742, 0.749 at 1, 2, 4, 6 proxy epochs; uniform pretraining 0.707.
- composition: parallel (disjoint splits, ε each) vs sequential (no split, ε_mix = 0.1,
  ε_ft = 0.9) vs non-private MixMin. Paper (Atelectasis, total ε = 1, Table 6): sequential
  0.740 ± 0.010, parallel 0.747 ± 0.005, non-private 0.746 ± 0.006.

The mixture batch of the ρ study follows D_mix's expected size: at ρ the expected batch is b_ρ =
b·ρ/ρ_0 (b and ρ_0 the base pipeline's), so every ρ runs DP-MixMin at the base's expected Poisson
rate b / (ρ_0 n) on the n train examples, and about the same σ for ε. A fixed b would exceed the
smaller D_mix (cpu preset: b = 120 against about 110 examples at ρ = 0.1, a rate of 1, which the
sampler refuses) or change the rate, and so σ, together with ρ. The cpu preset runs b = 40, 80, 120
at ρ = 0.1, 0.2, 0.3 (n = 1200: expected rate 1/3); the paper preset b = 1000, 2000, 3000. The
other studies keep the base pipeline (ρ_0, b) unchanged; settings equal to the base (ρ = ρ_0, the
base proxy budget, parallel composition) are one run, read back from the stage store.

The cpu preset uses the embedded digits default (MNIST-5k with 12 label sources, the settings of
`dpmix demo`): 9 distinct settings × 3 seeds, 4 min 28 s wall and about 0.9 GB peak resident
memory (`/usr/bin/time -v`) from an empty output folder, on 2 CPU cores shared with other jobs
(2 min 11 s on a less loaded machine). Its stored result and tables are in `docs/ablations.md`.
The tiny preset is a one-minute check of the wiring (1 seed, 3 steps per stage; numbers
meaningless). The paper preset runs NIH Atelectasis with CheXpert as public data (needs the data
and an accelerator).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import ImagePipelineConfig, presets
from dpmix_jax.privacy import validation
from experiments.configs.nih import paper_pipeline

STUDIES = ("uniform", "rho", "proxy", "composition")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """One row of the ablation tables: a method on one pipeline configuration.

    Attributes:
        study: one of `STUDIES` ("uniform" is the reference row of every table).
        label: the row's name in the tables.
        method: the pipeline method ("dp_mixmin", "uniform" or "nonprivate_mixmin").
        pipeline: the pipeline settings of the row.
    """

    study: str
    label: str
    method: str
    pipeline: ImagePipelineConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblationConfig:
    """Attributes:
    pipeline: the base pipeline settings (each study varies one field).
    data: "digits" (cpu, tiny) or "chexpert" (NIH Atelectasis with CheXpert).
    image_size: side of the digit images (digits only).
    epsilon: end-to-end ε of every run.
    seeds: seeds per setting.
    mix_fractions: ρ values; the mixture's expected batch scales with ρ (see the module
        docstring), so every ρ samples D_mix at the base pipeline's rate.
    proxy_steps: proxy training budgets (steps).
    """

    pipeline: ImagePipelineConfig
    data: str
    image_size: int = 16
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0, 1, 2)
    mix_fractions: tuple[float, ...] = (0.1, 0.2, 0.3)
    proxy_steps: tuple[int, ...] = (75, 150, 300, 450)

    def __post_init__(self) -> None:
        if self.data not in ("digits", "chexpert"):
            raise ValueError(f"data must be 'digits' or 'chexpert', got {self.data!r}.")
        validation.check_steps(self.image_size, "image_size")
        validation.check_epsilon(self.epsilon)
        if not self.seeds or not self.mix_fractions or not self.proxy_steps:
            raise ValueError("seeds, mix_fractions and proxy_steps must be non-empty.")
        for rho in self.mix_fractions:
            if not 0 < rho < 1:
                raise ValueError(f"mix_fractions must lie in (0, 1), got {rho!r}.")
        for steps in self.proxy_steps:
            validation.check_steps(steps, "proxy_steps")

    def mixture_batch_size(self, mix_fraction: float) -> float:
        """The expected mixture batch at ρ: the base batch scaled by ρ / ρ_0 (same rate); at
        ρ_0 exactly the base's, so that the base setting is one run."""
        base = self.pipeline
        if mix_fraction == base.mix_fraction:
            return base.mixture.batch_size
        return round(base.mixture.batch_size * mix_fraction / base.mix_fraction, 6)

    def settings(self) -> list[Setting]:
        """Every row of the three studies, in table order (Uniform first)."""
        base = self.pipeline
        rows = [Setting(study="uniform", label="Uniform", method="uniform", pipeline=base)]
        for rho in self.mix_fractions:
            mixture = dataclasses.replace(base.mixture, batch_size=self.mixture_batch_size(rho))
            pipeline = dataclasses.replace(base, mix_fraction=rho, mixture=mixture)
            rows.append(Setting(study="rho", label=f"ρ = {rho:g}", method="dp_mixmin",
                                pipeline=pipeline))  # fmt: skip
        for steps in self.proxy_steps:
            proxy = dataclasses.replace(base.proxy, steps=steps)
            rows.append(
                Setting(
                    study="proxy",
                    label=f"{steps} proxy steps",
                    method="dp_mixmin",
                    pipeline=dataclasses.replace(base, proxy=proxy),
                )
            )
        share = base.sequential_mixture_share
        rows += [
            Setting(
                study="composition",
                label="parallel",
                method="dp_mixmin",
                pipeline=dataclasses.replace(base, composition="parallel"),
            ),
            Setting(
                study="composition",
                label=f"sequential {share:g}/{1 - share:g}",
                method="dp_mixmin",
                pipeline=dataclasses.replace(base, composition="sequential"),
            ),
            Setting(
                study="composition",
                label="non-private MixMin",
                method="nonprivate_mixmin",
                pipeline=dataclasses.replace(base, composition="parallel"),
            ),
        ]
        return rows


PRESETS = {
    "cpu": "the digit tasks (offline)",
    "tiny": "a one-minute check of the wiring",
    "paper": "NIH with CheXpert as public data",
}


def get_config(preset: str = "cpu") -> AblationConfig:
    """ "cpu" (digits, 3 seeds), "tiny" (a test run: 1 seed, 3 steps per stage) or "paper"
    (NIH Atelectasis with CheXpert)."""
    if preset == "cpu":
        return AblationConfig(pipeline=presets.image_demo_config(), data="digits")
    if preset == "tiny":
        return AblationConfig(
            pipeline=presets.wiring_check_config(),
            data="digits",
            image_size=8,
            seeds=(0,),
            mix_fractions=(0.1, 0.3),
            proxy_steps=(2, 3),
        )
    if preset == "paper":
        steps_per_epoch = 1_000  # CheXpert frontal train images / batch 256, rounded
        return AblationConfig(
            pipeline=paper_pipeline(),
            data="chexpert",
            proxy_steps=tuple(e * steps_per_epoch for e in (1, 2, 4, 6)),
        )
    raise ValueError(f"preset must be 'cpu', 'tiny' or 'paper', got {preset!r}.")
