"""Settings of the k-scaling study (excess MixMin loss of DP-MixMin vs the number of sources k).

Run:
    python -m experiments.k_scaling --preset cpu --out DIR

The cpu preset (k in {2, 8, 32, 128, 256}, 3 seeds, n = 20,000, T = 500, both solvers, each DP
run repeated with σ = 0) takes about 1 minute on 2 CPU cores. C_k = 4 × the 90th percentile of
public gradient norms at uniform λ (5.4, 10.6, 20, 37, 52: about 3.3√k), η_k = 20 / C_k.
Measured (mean of 3 seeds, k = 2 .. 256): mirror descent's excess 2.9e-3, 1.2e-3, 1.1e-3,
3.3e-3, 4.0e-3 (uniform weights ~0.1), slope over k >= 32: 0.67, of which the noise part has
slope 0.57 and the σ = 0 bias 1.08 (the bias is mostly optimisation error: η_k ∝ 1/√k makes the
fixed T = 500 less converged at large k; at most 0.7% of examples are clipped at the optimum).
Frank-Wolfe: 3.4e-4 .. 6.7e-2, slope 0.47 (noise part 0.51, dominant; bias 0.22).
The former setting (C = 20 and η = 1 for every k, T = 200) gave slope ~1.2: its σ = 0 runs
showed clipping bias dominating at k >= 128 (4-10% clipped at the optimum, up to 1.5e-2 excess
on one seed; 4e-4 with the same η and no clipping), since per-example norms grow like √k.
The paper preset (k from 2 to 1000, 5 seeds, n = 50,000) is the paper's grid (its reported
slope: 0.49; theory: 0.5).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import accounting


@dataclasses.dataclass(frozen=True, kw_only=True)
class KScalingConfig:
    """Public settings of the k-scaling study.

    Attributes:
        ks: numbers of sources to run.
        seeds: data/noise seeds (each gives a fresh synthetic problem and run).
        num_examples: n, the size of the mixture split.
        num_features: input dimension of the synthetic proxies.
        support: number of sources in the true mixture λ* (the rest are distractors).
        proxy_scale: scale of the proxies' logits (higher = more confident proxies).
        epsilon, delta: the privacy target.
        steps, batch_size: DP-MixMin's T and expected batch size b, fixed across k.
        clip_quantile, clip_scale: C_k = clip_scale × the `clip_quantile` quantile of the
            (mean-shifted) per-example gradient norms at uniform weights on a *public* stand-in
            problem with k sources (`public_seed`, `public_examples` examples); it grows like
            √k, as the norms do, and never looks at the sensitive split.
        step_size: η_k = step_size / C_k, so a step moves the logits by a similar amount
            whatever C_k is.
        public_examples, public_seed: size and seed of the public stand-in problem (the seed
            must differ from every study seed).
        solvers: "mirror_descent" and/or "frank_wolfe".
        reference_steps, reference_learning_rate: non-private MixMin for the reference optimum.
        slope_min_k: the log-log slope is fitted over k >= this.
    """

    ks: tuple[int, ...]
    seeds: tuple[int, ...]
    num_examples: int
    num_features: int = 16
    support: int = 4
    proxy_scale: float = 3.0
    epsilon: float = 1.0
    delta: float = 1e-5
    steps: int = 500
    batch_size: int = 1000
    clip_quantile: float = 0.9
    clip_scale: float = 4.0
    step_size: float = 20.0
    public_examples: int = 5000
    public_seed: int = 10_000
    solvers: tuple[str, ...] = ("mirror_descent", "frank_wolfe")
    reference_steps: int = 2000
    reference_learning_rate: float = 2.0
    slope_min_k: int = 32

    def __post_init__(self) -> None:
        if not self.ks or any(not isinstance(k, int) or k < 2 for k in self.ks):
            raise ValueError(f"ks must be integers >= 2, got {self.ks!r}.")
        if not self.seeds:
            raise ValueError("seeds must not be empty.")
        if sum(k >= self.slope_min_k for k in self.ks) < 2:
            raise ValueError(f"need at least two ks >= slope_min_k = {self.slope_min_k}.")
        for name in ("num_examples", "num_features", "support", "batch_size", "public_examples"):
            accounting.check_steps(getattr(self, name), name)
        accounting.check_epsilon(self.epsilon)
        accounting.check_delta(self.delta)
        accounting.check_steps(self.steps)
        accounting.check_steps(self.reference_steps, "reference_steps")
        for name in ("proxy_scale", "clip_scale", "step_size", "reference_learning_rate"):
            accounting.check_positive(getattr(self, name), name)
        if not 0.0 < self.clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1], got {self.clip_quantile!r}.")
        if self.public_seed in self.seeds:
            raise ValueError(f"public_seed {self.public_seed} must differ from the study seeds.")
        if not set(self.solvers) <= {"mirror_descent", "frank_wolfe"} or not self.solvers:
            raise ValueError(f"unknown solvers {self.solvers!r}.")


def get_config(preset: str = "cpu") -> KScalingConfig:
    """The "cpu" preset (minutes on 2 cores) or the "paper" preset (the paper's grid)."""
    if preset == "cpu":
        return KScalingConfig(ks=(2, 8, 32, 128, 256), seeds=(0, 1, 2), num_examples=20_000)
    if preset == "paper":
        return KScalingConfig(
            ks=(2, 4, 8, 16, 32, 64, 128, 256, 512, 1000),
            seeds=(0, 1, 2, 3, 4),
            num_examples=50_000,
        )
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
