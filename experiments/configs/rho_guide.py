"""Settings of the ρ-guide check: measured excess loss of DP-MixMin against the error bound of
`mixing.sufficient_mixture_size` over a grid of mixture-split sizes n (paper appendix A.2).

Run:
    python -m experiments.rho_guide --preset cpu --out DIR

Each (ε, n, seed) draws the synthetic problem of `mixing.synthetic.mixture_problem` (k = 8 sigmoid
proxies, labels from an exact mixture λ*), runs DP-MixMin (mirror descent, C from public
gradient norms, η = step_size/C, T steps, expected batch n/2) and non-private MixMin on the first n
examples, and measures the *population* excess F(λ) - F(λ*) on 200,000 held-out examples of the
same problem. Beside it: the bound B·sqrt(log k/n) + C·sqrt(log k·log(1/δ))/(nε) with B = 1
and C the run's clip norm, its regime, and the sufficient n for the configured α.

The paper's operating points (appendix A.2, ρ = 0.1): about 8,970 examples for α ≈ 0.01 in
vision (k = 14) and 2.8M tokens for α ≈ 0.001 in language (k = 16); the bound gives 27,500
and 2.78M with B = C = 1 (8,970 with B = C = 0.563).

Measured (cpu preset, C = 10.57, 20 s on 2 CPU cores, docs/results/rho_guide.json): for α = 0.01 the
guide asks for 30,254 examples at ε = 1 (statistics-limited) and 96,515 at ε = 0.1
(privacy-limited); the measured mean excess first falls below α at n = 4,000 and n = 16,000.
Measured / bound is 0.05-0.19 at ε = 1 and 0.08-0.43 at ε = 0.1: below the bound everywhere with
few steps of large batches (T = 50, b = n/2), where a fixed T = 500 and b <= 1,000 was above it
at three points.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import validation

PRESETS = {
    "cpu": "k = 8, n from 250 to 64,000, ε in {0.1, 1}",
    "tiny": "a test run",
    "paper": "k = 14, n up to 256,000",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RhoGuideConfig:
    """Public settings of the ρ-guide check.

    Attributes:
        sizes: the grid of mixture-split sizes n.
        epsilons: ε of the mixture stage (one curve each).
        seeds: problem/data seeds (each a fresh problem).
        num_sources: k.
        alpha: target excess α for the sufficient-size line.
        delta: δ.
        held_out: examples of each problem used to measure the population excess.
        steps: DP-MixMin's T.
        batch_fraction: its expected batch size as a fraction of n (b = fraction·n: few steps of
            large batches, the regime the bound's privacy term assumes).
        clip_quantile, clip_scale, step_size: C = clip_scale × the `clip_quantile` quantile of
            public gradient norms at uniform λ (a public stand-in problem), η = step_size / C.
        public_seed: seed of the public stand-in problem (differs from every seed).
        reference_steps, reference_learning_rate: non-private MixMin on the same n.
        num_features, support, proxy_scale: the synthetic problem (see `mixture_problem`).
    """

    sizes: tuple[int, ...]
    epsilons: tuple[float, ...]
    seeds: tuple[int, ...]
    num_sources: int = 8
    alpha: float = 1e-2
    delta: float = 1e-5
    held_out: int = 200_000
    steps: int = 50
    batch_fraction: float = 0.5
    clip_quantile: float = 0.9
    clip_scale: float = 4.0
    step_size: float = 10.0
    public_seed: int = 10_000
    reference_steps: int = 2000
    reference_learning_rate: float = 2.0
    num_features: int = 16
    support: int = 4
    proxy_scale: float = 3.0

    def __post_init__(self) -> None:
        if not self.sizes or any(not isinstance(n, int) or n < 2 for n in self.sizes):
            raise ValueError(f"sizes must be integers >= 2, got {self.sizes!r}.")
        if not self.epsilons or not self.seeds:
            raise ValueError("epsilons and seeds must not be empty.")
        for epsilon in self.epsilons:
            validation.check_epsilon(epsilon)
        validation.check_delta(self.delta)
        validation.check_positive(self.alpha, "alpha")
        for name in ("num_sources", "held_out", "steps", "reference_steps"):
            validation.check_steps(getattr(self, name), name)
        if self.num_sources < 2:
            raise ValueError(f"num_sources must be >= 2, got {self.num_sources}.")
        for name in ("clip_scale", "step_size", "reference_learning_rate", "proxy_scale"):
            validation.check_positive(getattr(self, name), name)
        if not 0.0 < self.batch_fraction < 1.0:
            raise ValueError(f"batch_fraction must be in (0, 1), got {self.batch_fraction!r}.")
        if not 0.0 < self.clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1], got {self.clip_quantile!r}.")
        if self.public_seed in self.seeds:
            raise ValueError(f"public_seed {self.public_seed} must differ from the seeds.")


def get_config(preset: str = "cpu") -> RhoGuideConfig:
    """ "cpu" (n from 250 to 64,000, ε in {0.1, 1}, 3 seeds: 1 minute and 0.7 GB on 2 cores),
    "tiny" (a test run) or "paper" (k = 14 as in the vision setting, n up to 256,000, 5 seeds)."""
    if preset == "cpu":
        return RhoGuideConfig(
            sizes=(250, 1000, 4000, 16_000, 64_000), epsilons=(0.1, 1.0), seeds=(0, 1, 2)
        )
    if preset == "tiny":
        return RhoGuideConfig(
            sizes=(200, 800), epsilons=(1.0,), seeds=(0,), held_out=5000, steps=20
        )
    if preset == "paper":
        return RhoGuideConfig(
            sizes=(500, 2000, 8970, 32_000, 128_000, 256_000),
            epsilons=(0.2, 1.0, 5.0),
            seeds=(0, 1, 2, 3, 4),
            num_sources=14,
        )
    raise ValueError(f"preset must be 'cpu', 'tiny' or 'paper', got {preset!r}.")
