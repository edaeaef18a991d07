"""Settings of the k-scaling study (excess MixMin loss of DP-MixMin vs the number of sources k).

Run:
    python -m experiments.k_scaling --preset cpu --out DIR

The cpu preset (k in {2, 8, 32, 128, 256}, 3 seeds, n = 20,000, both solvers) takes about
1.5 minutes on 2 CPU cores. Expected result (measured): mirror descent's mean excess loss grows
from about 2e-4 (k = 2) to 6e-3 (k = 256), well below uniform weights (~0.1), with a fitted
log-log slope over k >= 32 of about 1.2 (noisy with 3 seeds and 3 points; one k = 128 seed is an
outlier). Frank-Wolfe's excess is 2e-3 to 2.4e-2 and flat for k >= 32 (slope about 0.1): its
O(1/T) optimisation error, not the noise, dominates at T = 200. The paper preset (k from 2 to
1000, 5 seeds, n = 50,000) is the paper's grid (its reported slope: 0.49; theory: 0.5).
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
        steps, batch_size, clip_norm, learning_rate: DP-MixMin settings, fixed across k.
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
    steps: int = 200
    batch_size: int = 1000
    clip_norm: float = 20.0
    learning_rate: float = 1.0
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
        for name in ("num_examples", "num_features", "support", "batch_size"):
            accounting.check_steps(getattr(self, name), name)
        accounting.check_epsilon(self.epsilon)
        accounting.check_delta(self.delta)
        accounting.check_steps(self.steps)
        accounting.check_steps(self.reference_steps, "reference_steps")
        for name in ("proxy_scale", "clip_norm", "learning_rate", "reference_learning_rate"):
            accounting.check_positive(getattr(self, name), name)
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
