"""Ablations of DP-MixMin (paper appendix A.5 and A.7, Tables 1, 3 and 6), on one image task.

Command:
    python -m experiments.ablations --preset cpu --out runs/ablations_cpu      # a few minutes
    python -m experiments.ablations --preset paper --nih-root DIR --public-root DIR --out DIR

Three studies, each DP-MixMin at end-to-end ε = 1 (δ = 1e-5) over several seeds:
- ρ, the fraction of the sensitive train split given to the mixture stage. Paper (Enron, ε = 1,
  Table 1): perplexity 17.97 ± 2.72, 17.52 ± 1.55, 16.78 ± 0.55 at ρ = 0.1, 0.2, 0.3.
- proxy training budget. Paper (NIH Atelectasis with CheXpert, ε = 1, Table 3): AUC 0.744,
  0.745, 0.742, 0.749 at 1, 2, 4, 6 proxy epochs; uniform pretraining 0.707.
- composition: parallel (disjoint splits, ε each) vs sequential (no split, ε_mix = 0.1,
  ε_ft = 0.9) vs non-private MixMin. Paper (Atelectasis, total ε = 1, Table 6): sequential
  0.740 ± 0.010, parallel 0.747 ± 0.005, non-private 0.746 ± 0.006.

The cpu preset uses the embedded digits default; expected: every setting above Uniform, with
differences between settings within about a standard deviation, as in the paper. The paper preset
runs NIH Atelectasis with CheXpert as public data (needs the data and an accelerator).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import ImagePipelineConfig, presets
from experiments.configs.nih import paper_pipeline


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblationConfig:
    """Attributes:
    pipeline: the base pipeline settings (each study varies one field).
    data: "digits" (cpu) or "chexpert" (NIH Atelectasis with CheXpert).
    epsilon: end-to-end ε of every run.
    seeds: seeds per setting.
    mix_fractions: ρ values.
    proxy_steps: proxy training budgets (steps).
    """

    pipeline: ImagePipelineConfig
    data: str
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0, 1, 2)
    mix_fractions: tuple[float, ...] = (0.1, 0.2, 0.3)
    proxy_steps: tuple[int, ...] = (75, 150, 300, 450)


def get_config(preset: str = "cpu") -> AblationConfig:
    if preset == "cpu":
        return AblationConfig(pipeline=presets.image_demo_config(), data="digits")
    if preset == "paper":
        steps_per_epoch = 1_000  # CheXpert frontal train images / batch 256, rounded
        return AblationConfig(
            pipeline=paper_pipeline(),
            data="chexpert",
            proxy_steps=tuple(e * steps_per_epoch for e in (1, 2, 4, 6)),
        )
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
