"""Per-task gains of DP-MixMin over Random Initialisation (paper §5.1.2: Figure 3, Tables 7, 8,
10 and 12).

Commands:
    dpmix run per_task --preset cpu --reproducible          # 8 digit tasks, 3 seeds: 13.5 min, 1 GB
    dpmix run per_task --preset paper --nih-root DIR --public-root DIR --out DIR   # CheXpert
    dpmix run per_task --preset paper_mimic --nih-root DIR --public-root DIR --out DIR

Per task at ε = 1 (δ = 1e-5): test AUC of DP-MixMin, Uniform, Random Search and Random
Initialisation, and each method's relative gain over Random Initialisation,
(AUC - AUC_RI) / AUC_RI, paired by seed, then mean ± std over seeds; "macro" is the mean over
tasks. Tasks are split by prevalence into two halves, A (more prevalent) and B (less), and each
half reports DP-MixMin's gain over Uniform, absolute and relative (Table 10). The least prevalent
task is the rare-label task: its λ's cosine to non-private MixMin's λ on the same D_mix, for
DP-MixMin and for uniform weights (Table 12).

Paper numbers (NIH ChestX-ray14, 14 findings, ε = 1, δ = 1e-5, ρ = 0.1):
    Figure 3, macro relative gain over Random Init: CheXpert DP-MixMin +11.48%, Uniform +5.42%,
    Random Search +4.74%; MIMIC-CXR +12.29%, +6.87%, +5.22% ("roughly doubles").
    Tables 7 and 8, macro AUC: CheXpert 0.707 / 0.670 / 0.667 / 0.636 (DP-MixMin / Uniform /
    Random Search / Random Init), MIMIC-CXR 0.712 / 0.679 / 0.670 / 0.636; Cardiomegaly with
    CheXpert 0.872 against Uniform's 0.710.
    Table 10 (CheXpert, against Uniform): group A (n = 7) +0.040 (+5.6%), group B (n = 7) +0.034
    (+6.0%).
    Table 12 (Hernia, 227 positives, 0.20%, CheXpert, ρ = 0.1): cosine 0.99 ± 0.00 for
    DP-MixMin, 0.64 for uniform.

The cpu preset builds a multi-task image default: the digits default's 12 label rules and one
shared input set, eight sensitive tasks with their own sparse λ*_t, labelled
y ~ Bernoulli(s_t Σ_i λ*_ti y_i(x)). Five tasks have s_t = 1 (prevalence 39-50%, the range a
mixture of these rules allows); three have their positives thinned, s_t = 0.0125, 0.5 and 0.2
(prevalence 0.55%, 24% and 8%; task 5 is the rare-label task: 11 positives in 2,000 images, 5
in the train split, 2 in validation, 4 in test). A thinned label's probability is s_t times a
mixture, not a mixture of the sources, as for NIH findings that no public label matches
(Hernia): MixMin's λ is then the best mixture under the loss, not λ*. Pipeline settings are
`dpmix demo`'s (MLP, ρ = 0.3), 3 seeds. Expected result: see the README's per-task bullet
(measured, with the paper's numbers beside).

The paper presets run the same analysis on the 14 NIH findings with CheXpert's (`paper`) or
MIMIC-CXR's (`paper_mimic`) 14 observations as sources (`experiments/configs/nih.py`'s pipeline:
ResNet-50 proxy, ResNet-18, 224x224; the data sets and an accelerator are needed).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import ImagePipelineConfig, presets
from experiments.configs.nih import paper_pipeline

DATA_CHOICES = ("digits", "chexpert", "mimic")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PerTaskConfig:
    """One per-task experiment.

    Attributes:
        data: "digits" (the embedded multi-task default) or "chexpert" / "mimic" (NIH findings
            with that data set's labels as public sources).
        pipeline: the per-task pipeline settings.
        epsilon: end-to-end target ε of every run.
        seeds: seeds per task.
        prevalence_scales: digits only: one task per entry, its prevalence scale s_t.
        data_seed: digits only: the seed of λ*, the labels and the splits.
        findings: NIH only: the findings to run (None: all 14).
        image_size: images are resized to this square size.
    """

    data: str
    pipeline: ImagePipelineConfig
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0, 1, 2)
    prevalence_scales: tuple[float, ...] = ()
    data_seed: int = 0
    findings: tuple[str, ...] | None = None
    image_size: int = 224

    def __post_init__(self) -> None:
        if self.data not in DATA_CHOICES:
            raise ValueError(f"data must be one of {DATA_CHOICES}, got {self.data!r}.")
        if not self.epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got {self.epsilon!r}.")
        if not self.seeds:
            raise ValueError("seeds must be non-empty.")
        if self.data == "digits" and len(self.prevalence_scales) < 2:
            raise ValueError("the digits data needs at least two prevalence_scales (tasks).")
        if self.data != "digits" and self.prevalence_scales:
            raise ValueError("prevalence_scales apply to the digits data only.")
        if self.findings is not None and len(self.findings) < 2:
            raise ValueError("findings must name at least two tasks (or None for all 14).")


PRESETS = {
    "cpu": "the multi-task digits default (offline)",
    "paper": "the 14 NIH findings with CheXpert as public data",
    "paper_mimic": "the 14 NIH findings with MIMIC-CXR as public data",
}


def get_config(preset: str = "cpu") -> PerTaskConfig:
    """`cpu`: the multi-task digits default; `paper` / `paper_mimic`: NIH with CheXpert /
    MIMIC-CXR."""
    if preset == "cpu":
        return PerTaskConfig(
            data="digits",
            pipeline=presets.image_demo_config(),
            prevalence_scales=(1.0, 1.0, 1.0, 1.0, 1.0, 0.0125, 0.5, 0.2),
            image_size=16,
        )
    if preset in ("paper", "paper_mimic"):
        public = "chexpert" if preset == "paper" else "mimic"
        return PerTaskConfig(data=public, pipeline=paper_pipeline())
    raise ValueError(f"preset must be 'cpu', 'paper' or 'paper_mimic', got {preset!r}.")
