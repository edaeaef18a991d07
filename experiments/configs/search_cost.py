"""Settings of the search-cost study: the privacy cost of Random Search over mixtures against
DP-MixMin's, as the number of sources k grows (the paper's Lemma 4.1 contrast).

Run:
    python -m experiments.search_cost --out DIR --reproducible

On the synthetic exact-mixture problem of `mixing.synthetic.mixture_problem` (k sigmoid
proxies, labels from a mixture of four of them, n sensitive examples), for every k and seed:
DP-MixMin at (ε, δ) (the k-scaling schedule for T_k, η_k and C_k) and a pool of Dirichlet(1)
candidates, all scored by their excess MixMin loss over non-private MixMin. m*(k) is the
smallest candidate count m whose expected best-of-m excess (the best picked by the true loss,
the most favourable non-private selection) reaches DP-MixMin's mean excess; Random Search then
fine-tunes m*(k) candidates on the same data, each run the image demo's DP fine-tuning at ε,
and spends the accountant's composition of those m*(k) runs.

The cpu preset (k in {2, 4, 8, 16, 32, 64}, 5 seeds, n = 20,000, m in {1, 2, ..., 256} from a
pool of 4096 candidates) took 39 s of wall time (26 s of CPU time, 0.8 GB peak memory) on the
loaded 2-core machine. Measured (docs/search-cost.md): DP-MixMin's mean excess 1.7e-3 (k = 2;
one of five seeds' mirror descent stalls at 8.4e-3) and 4.0e-5 .. 3.0e-3 (k = 4 .. 64) at ε = 1;
Random Search matches it only at k = 2 (m* = 32: composed ε 6.85, m·ε = 32); for k >= 4 even
256 candidates fall short (best-of-256 excess 1.5e-3 .. 8.7e-2), so its ε exceeds 25.4
composed (256 naive).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import validation
from experiments.configs.k_scaling import KScalingConfig

SOLVERS = ("mirror_descent", "frank_wolfe")
PRESETS = {"cpu": "k in {2, ..., 64}, 5 seeds, n = 20,000", "tiny": "a seconds-long test run"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchCostConfig:
    """Public settings of the search-cost study.

    Attributes:
        ks: numbers of sources (at least two, each >= 2).
        seeds: data seeds (a fresh synthetic problem and candidate pool per k and seed).
        num_examples: n, the sensitive mixture split of DP-MixMin and of the candidates' scores.
        epsilon, delta: DP-MixMin's target, and the target of each Random Search fine-tuning.
        solver: DP-MixMin's solver ("mirror_descent", the paper's, or "frank_wolfe").
        batch_size, max_steps, step_size, clip_quantile, clip_scale, public_examples,
            public_seed, reference_steps, reference_learning_rate, num_features, support,
            proxy_scale: as in `KScalingConfig` (the problem, T_k, η_k, C_k and the reference).
        candidate_counts: the Random Search sizes m tried, increasing.
        candidate_pool: Dirichlet(1) candidates scored per (k, seed); the expected best-of-m
            excess is computed exactly over this pool (m draws with replacement).
        progress: print a line per (seed, k) problem as it finishes.
    """

    ks: tuple[int, ...] = (2, 4, 8, 16, 32, 64)
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    num_examples: int = 20_000
    epsilon: float = 1.0
    delta: float = 1e-5
    solver: str = "mirror_descent"
    batch_size: int = 1000
    max_steps: int = 1000
    step_size: float = 20.0
    clip_quantile: float = 0.9
    clip_scale: float = 4.0
    public_examples: int = 5000
    public_seed: int = 10_000
    reference_steps: int = 2000
    reference_learning_rate: float = 2.0
    num_features: int = 16
    support: int = 4
    proxy_scale: float = 3.0
    candidate_counts: tuple[int, ...] = tuple(2**i for i in range(9))
    candidate_pool: int = 4096
    progress: bool = True

    def __post_init__(self) -> None:
        if len(self.ks) < 2:
            raise ValueError(f"ks needs at least two numbers of sources, got {self.ks!r}.")
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {SOLVERS}, got {self.solver!r}.")
        counts = self.candidate_counts
        if not counts or any(not isinstance(m, int) or m < 1 for m in counts):
            raise ValueError(f"candidate_counts must be integers >= 1, got {counts!r}.")
        if list(counts) != sorted(set(counts)):
            raise ValueError(f"candidate_counts must be strictly increasing, got {counts!r}.")
        validation.check_steps(self.candidate_pool, "candidate_pool")
        if self.candidate_pool < max(counts):
            raise ValueError(
                f"candidate_pool ({self.candidate_pool}) must be >= the largest candidate count"
                f" ({max(counts)})."
            )
        self.problem()  # validates the shared problem and schedule settings

    def problem(self) -> KScalingConfig:
        """The k-scaling settings of the same problem, schedule and DP-MixMin target."""
        return KScalingConfig(
            ks=self.ks,
            seeds=self.seeds,
            num_examples=self.num_examples,
            num_features=self.num_features,
            support=self.support,
            proxy_scale=self.proxy_scale,
            epsilon=self.epsilon,
            delta=self.delta,
            batch_size=self.batch_size,
            max_steps=self.max_steps,
            step_size=self.step_size,
            clip_quantile=self.clip_quantile,
            clip_scale=self.clip_scale,
            public_examples=self.public_examples,
            public_seed=self.public_seed,
            solvers=(self.solver,),
            reference_steps=self.reference_steps,
            reference_learning_rate=self.reference_learning_rate,
            slope_min_k=min(self.ks),
        )


def get_config(preset: str = "cpu") -> SearchCostConfig:
    """ "cpu" (k up to 64, 5 seeds, n = 20,000: minutes on 2 cores) or "tiny" (a test run)."""
    if preset == "cpu":
        return SearchCostConfig()
    if preset == "tiny":
        return SearchCostConfig(
            ks=(2, 4, 8),
            seeds=(0,),
            num_examples=2000,
            batch_size=200,
            max_steps=50,
            public_examples=500,
            reference_steps=300,
            candidate_counts=(1, 2, 4, 8, 16),
            candidate_pool=256,
        )
    raise ValueError(f"preset must be 'cpu' or 'tiny', got {preset!r}.")
