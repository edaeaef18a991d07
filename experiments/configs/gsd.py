"""Settings of the GSD baseline (gradient subspace distance source selection, Gu et al.; paper
appendix A.4) on shared-input label sources.

Run:
    python -m experiments.gsd --preset cpu --out DIR        # 2 minutes, 1.1 GB peak, 2 cores
    python -m experiments.gsd --preset paper --nih-root DIR --public-root DIR --out DIR

On the image default (12 label rules over ONE public image set), every source is scored by the
GSD between its per-example gradients and the sensitive task's (top-`dim` subspaces of
`num_examples` gradients each, for a randomly initialised and for a uniform-pretrained
downstream model), against a control source with other inputs (the public images transposed).
Each source is also used alone (pretrain on it, DP fine-tune on the whole train split at ε), so
that the GSD pick and the oracle single source (best test AUC, a non-private choice) can be set
beside DP-MixMin and Uniform from the same pipeline stages.

The paper (appendix A.4): GSD cannot tell apart sources that share one image set (their
distances coincide), and even an oracle choice between whole corpora is below DP-MixMin. The
GSD scores read the sensitive data without DP: they are not private and are reported as such.

Measured (cpu preset, 2 seeds, ε = 1; 594 s on the loaded 2-core machine): with the randomly
initialised model the 12 sources' GSDs lie within 0.343-0.357 (a 3.9% spread) against 0.628 for
the control, and GSD picks sources outside λ*'s support (test AUC 0.528 ± 0.011); with the
uniform-pretrained model the spread is 12.9% (0.385-0.439; control 0.748) and the picks are in
λ*'s support (0.810 ± 0.041). The oracle single source reaches 0.848 ± 0.003, DP-MixMin
0.877 ± 0.007, Uniform 0.782, Random initialisation 0.669.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import ImagePipelineConfig, presets
from dpmix_jax.privacy import validation
from experiments.configs.nih import paper_pipeline

GRADIENT_MODELS: tuple[str, ...] = ("random_init", "uniform_pretrained")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GsdConfig:
    """Attributes:
    pipeline: the image pipeline's settings (single sources reuse its stages).
    data: "digits" (the embedded default) or "chexpert" (NIH with CheXpert's 14 labels).
    epsilon: end-to-end ε of every fine-tuning run.
    seeds: seeds (each one pipeline seed: model initialisation, split, noise).
    num_examples: gradients per set (public source, control, sensitive); Gu et al. use 2000.
    dim: the subspace dimension d (Gu et al.: 16).
    gradient_models: which models' gradients to compare ("random_init", as in Gu et al.'s
        released notebook, and/or "uniform_pretrained").
    head_only: compare last-layer gradients only (Gu et al.'s ResNet setting); False: all
        parameters (the small MLP of the cpu preset).
    """

    pipeline: ImagePipelineConfig
    data: str = "digits"
    epsilon: float = 1.0
    seeds: tuple[int, ...] = (0, 1)
    num_examples: int = 500
    dim: int = 16
    gradient_models: tuple[str, ...] = GRADIENT_MODELS
    head_only: bool = False

    def __post_init__(self) -> None:
        if self.data not in ("digits", "chexpert"):
            raise ValueError(f"data must be 'digits' or 'chexpert', got {self.data!r}.")
        validation.check_epsilon(self.epsilon)
        if not self.seeds:
            raise ValueError("seeds must not be empty.")
        validation.check_steps(self.num_examples, "num_examples")
        validation.check_steps(self.dim, "dim")
        if self.dim > self.num_examples:
            raise ValueError(f"dim ({self.dim}) must be <= num_examples ({self.num_examples}).")
        if not self.gradient_models or not set(self.gradient_models) <= set(GRADIENT_MODELS):
            raise ValueError(f"gradient_models must be a subset of {GRADIENT_MODELS}.")


PRESETS = {
    "cpu": "the digits default",
    "tiny": "a test run",
    "paper": "NIH Atelectasis with CheXpert's 14 labels",
}


def get_config(preset: str = "cpu") -> GsdConfig:
    """ "cpu" (digits, 2 seeds), "tiny" (a test run: 1 seed, few steps) or "paper" (NIH
    Atelectasis with CheXpert, 2000 gradients per set as in Gu et al.)."""
    if preset == "cpu":
        return GsdConfig(pipeline=presets.image_demo_config())
    if preset == "tiny":
        tiny = presets.image_demo_config()
        short = {
            name: dataclasses.replace(getattr(tiny, name), steps=5)
            for name in ("proxy", "pretrain", "finetune")
        }
        mixture = dataclasses.replace(tiny.mixture, steps=5, nonprivate_steps=5)
        return GsdConfig(
            pipeline=dataclasses.replace(tiny, mixture=mixture, **short),
            seeds=(0,),
            num_examples=40,
            dim=4,
            gradient_models=("random_init",),
        )
    if preset == "paper":
        return GsdConfig(
            pipeline=paper_pipeline(),
            data="chexpert",
            seeds=(0, 1, 2),
            num_examples=2000,
            head_only=True,
        )
    raise ValueError(f"preset must be 'cpu', 'tiny' or 'paper', got {preset!r}.")
