"""Settings of the small-ε study: λ's cosine to non-private MixMin at ε = 0.2 and ε = 1 (paper
appendix, Tables 11, 14 and 15), and a sweep of the image default's mixture settings.

Commands:
    python -m experiments.small_eps --preset cpu --out runs/small_eps          # 15 min, 2.1 GB
    python -m experiments.small_eps --preset cpu --no-sweep                     # the table only
    python -m experiments.small_eps --preset paper --nih-root DIR --public-root DIR \\
        --data-root DATA --weights-root WEIGHTS --out DIR

Only the mixture stage runs (split, proxy, proxy outputs on D_mix, DP-MixMin at each ε and exact
MixMin on the same D_mix); nothing is pretrained or fine-tuned. For every seed it reports
cos(λ_DP, λ_non-private) and the uniform reference's cos(1/k, λ_non-private).

Paper numbers to compare with (mean ± std of the cosine to non-private MixMin):
    Table 11 (NIH, ρ = 0.1, 14 tasks x 5 seeds): ε = 1: 0.97 ± 0.01 (CheXpert), 0.93 ± 0.04
        (MIMIC-CXR); ε = 0.2: 0.70 ± 0.08, 0.58 ± 0.17; uniform reference 0.75, 0.80.
    Table 14 (Enron, user level, ρ = 0.1, about 12 users in D_mix): ε = 2: 0.92 ± 0.05;
        ε = 0.2: 0.08 ± 0.11; uniform reference 0.40.
    Table 15 (OpenWebMath, ρ = 0.1, 2.8M tokens): ε = 1: 1.00 ± 0.00; ε = 0.2: 0.92 ± 0.02.

The `cpu` preset runs the image default (`pipeline.presets`: digits, 12 label sources, the
`dpmix demo` settings, data seed 0) and the text default (`pipeline.text_presets`, user level, read
through its preset functions so that it follows that default) over 5 seeds. Its sweep varies one
mixture setting at a time around the image demo's (T, η, expected batch b, clip norm C, and ρ with
b scaled to keep the sampling rate), plus three combinations, each at ε = 1 with 8 noise draws per
data seed and a σ = 0 twin of every run (same batches, no noise); the draws use the same random
streams at every setting, so paired differences compare the settings. Choosing settings by
comparing with the sensitive data's non-private λ is itself a use of that data, so the sweep never
reads the default's data: it runs on data seeds 100-115 of the same generator (other
public/sensitive splits, other λ*, other labels), with run seeds 100-115 as well. The measured
numbers are in the README (Experiments) and in each run's results.md.

The `paper` preset reads NIH with CheXpert as public data (all 14 findings, 5 seeds, the
`nih_chexpert` paper settings at ρ = 0.1) and Enron with the Common Pile domains (5 seeds,
ρ = 0.1, the `enron` paper settings), at ε ∈ {0.2, 1, 2}; it has no sweep. Its proxies are the
paper's (ResNet-50, GPT-2 small) and need an accelerator.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import ImagePipelineConfig, presets, text_presets
from dpmix_jax.pipeline.text import TextPipelineConfig
from dpmix_jax.privacy import validation
from experiments.configs import enron, nih

PRESETS = {
    "cpu": "the embedded image and text defaults, with the sweep",
    "paper": "NIH with CheXpert and Enron (real data, an accelerator)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepPoint:
    """One mixture setting of the sweep.

    Attributes:
        steps: T.
        learning_rate: η.
        batch_size: b, the expected examples per step.
        clip_norm: C.
        mix_fraction: ρ.
    """

    steps: int
    learning_rate: float
    batch_size: float
    clip_norm: float
    mix_fraction: float

    def __post_init__(self) -> None:
        validation.check_steps(self.steps)
        for name in ("learning_rate", "batch_size", "clip_norm"):
            validation.check_positive(getattr(self, name), name)
        if not 0 < self.mix_fraction < 1:
            raise ValueError(f"mix_fraction must be in (0, 1), got {self.mix_fraction!r}.")

    def label(self) -> str:
        return (
            f"T={self.steps} η={self.learning_rate:g} b={self.batch_size:g} "
            f"C={self.clip_norm:g} ρ={self.mix_fraction:g}"
        )


def base_point(config: ImagePipelineConfig) -> SweepPoint:
    """The sweep point of a pipeline config's own mixture settings."""
    mixture = config.mixture
    return SweepPoint(
        steps=mixture.steps,
        learning_rate=mixture.learning_rate,
        batch_size=mixture.batch_size,
        clip_norm=mixture.clip_norm,
        mix_fraction=config.mix_fraction,
    )


def vary(base: SweepPoint, **changes: float) -> SweepPoint:
    """`base` with `changes`; a new ρ alone also scales b with it, so that the sampling rate
    b / |D_mix| stays what it was (a smaller D_mix could not hold the same b)."""
    if "mix_fraction" in changes and "batch_size" not in changes:
        scaled = base.batch_size * changes["mix_fraction"] / base.mix_fraction
        changes["batch_size"] = round(scaled, 6)
    return dataclasses.replace(base, **changes)


def one_at_a_time(base: SweepPoint, **values: tuple[float, ...]) -> tuple[SweepPoint, ...]:
    """`base`, then `vary(base, name=value)` for each listed value of each setting."""
    points = [base]
    for name, options in values.items():
        points += [vary(base, **{name: v}) for v in options if v != getattr(base, name)]
    return tuple(points)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SmallEpsConfig:
    """Attributes:
    data: "builtin" (the embedded defaults) or "paper" (NIH with CheXpert, Enron).
    image: the image pipeline settings (None: no image rows).
    text: the text pipeline settings (None: no text rows).
    epsilons: target ε of the mixture stage.
    seeds: run seeds (split, noise) per task.
    sweep: mixture settings run on the image default at `sweep_epsilon`.
    sweep_seeds: data seeds and run seeds of the sweep; disjoint from `seeds` and from the
        default's data seed 0, so that the sweep never reads the reported task's data.
    sweep_epsilon: ε of the sweep.
    sweep_draws: noise draws per sweep seed (the same streams at every sweep point).
    """

    data: str
    image: ImagePipelineConfig | None
    text: TextPipelineConfig | None
    epsilons: tuple[float, ...] = (0.2, 1.0)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    sweep: tuple[SweepPoint, ...] = ()
    sweep_seeds: tuple[int, ...] = tuple(range(100, 116))
    sweep_epsilon: float = 1.0
    sweep_draws: int = 8

    def __post_init__(self) -> None:
        if self.data not in ("builtin", "paper"):
            raise ValueError(f"data must be 'builtin' or 'paper', got {self.data!r}.")
        if self.image is None and self.text is None:
            raise ValueError("give an image or a text pipeline config (or both).")
        if not self.epsilons or not self.seeds:
            raise ValueError("epsilons and seeds must be non-empty.")
        for epsilon in (*self.epsilons, self.sweep_epsilon):
            validation.check_epsilon(epsilon)
        validation.check_steps(self.sweep_draws, "sweep_draws")
        if self.sweep:
            if self.data != "builtin" or self.image is None:
                raise ValueError("the sweep runs on the embedded image default only.")
            shared = set(self.sweep_seeds) & ({0} | set(self.seeds))
            if not self.sweep_seeds or shared:
                raise ValueError(
                    f"sweep_seeds must be non-empty and disjoint from the seeds and from data "
                    f"seed 0; shared: {sorted(shared)}."
                )


def get_config(preset: str = "cpu", *, weights_root: str = "weights") -> SmallEpsConfig:
    """The "cpu" preset (embedded defaults, with the sweep) or the "paper" preset (its GPT-2
    proxies start from `weights_root`/gpt2)."""
    if preset == "cpu":
        image = presets.image_demo_config()
        base = base_point(image)
        return SmallEpsConfig(
            data="builtin",
            image=image,
            text=text_presets.text_demo_config(),
            sweep=one_at_a_time(
                base,
                steps=(50, 200, 400),
                learning_rate=(0.1, 0.2, 0.3, 0.8),
                batch_size=(60, 240),
                clip_norm=(2.5, 10.0),
                mix_fraction=(0.1, 0.5),
            )
            + (
                vary(base, steps=200, learning_rate=0.1),
                vary(base, steps=200, learning_rate=0.2),
                vary(base, learning_rate=0.2, mix_fraction=0.5),
            ),
        )
    if preset == "paper":
        return SmallEpsConfig(
            data="paper",
            image=dataclasses.replace(nih.paper_pipeline(), mix_fraction=0.1),
            text=dataclasses.replace(enron.paper_pipeline(weights_root), mix_fraction=0.1),
            epsilons=(0.2, 1.0, 2.0),
        )
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
