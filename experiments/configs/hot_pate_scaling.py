"""Settings of the Hot PATE scaling study (`experiments.hot_pate_scaling`).

Command:
    python -m experiments.hot_pate_scaling --out DIR --reproducible [--preset cpu|tiny]

Two parts, on synthetic teachers with a known ground truth (`pate.diversity`):

(1) Queries against the number of teachers. For each n in {16, 32, ..., 2048} and k in
    {1, 5, 20}, a fresh secret-set ensemble (V = 2000; 0.799 of each teacher's mass on k shared
    secret tokens with logit jitter 0.3, 0.2 on a private token of its own, 0.001 spread over V)
    and r = 1000 histograms per sampler. T(n) is the largest threshold at which the histograms'
    coverage (the mean share of the votes on tokens with >= T votes) stays >= 0.2. The queries
    answerable at that T within one total budget ε = 10 are counted for two per-call DP
    aggregators whose noise is set by T:

    * DPWS at the per-call ε whose keep threshold 1 + (2/ε)·ln(1/δ_call) is T (δ_call = 1e-10),
      composed by dp-accounting's PLD accountant at δ = 1e-6 with each call's δ on top;
    * the Gaussian thresholded release (Gaussian noise σ on every count, tokens with a noisy
      count >= T = σ·sqrt(2·ln(V/η)), η = 0.01, `pate.individual.threshold_for`) at the σ that
      makes T its threshold, charged on every call under the vote-move relation (L2 sensitivity
      √2): c calls are one Gaussian call with noise σ/√c, held to (ε, δ) = (10, 1e-6) by the
      PLD accountant.

    The growth with n is the slope of log(queries) against log(n), fitted by least squares over
    the grid points with at least one query, and the local slope between the two largest n.
(2) Histogram shape: r = 2000 histograms of n = 512 teachers from two ensembles, the secret-set
    one at k = 20 and a long-tailed one (shared logits 3·N(0, 1) over V = 2000 plus a per-teacher
    jitter 1·N(0, 1) on every token): the quantiles of the top count / n and of the top-1 minus
    top-2 margin / n, coordinated against independent sampling.

Expected (the cpu preset, about 1 minute on 2 CPU cores): coordinated sampling keeps T at
0.92-0.97·n at every k, so its Gaussian calls grow as n² over the whole grid and its DPWS calls
reach a local slope near 2 at the largest n (a fitted slope near 1.6 over the grid: at small n the
per-call ε is above 1, where composition is about linear in the calls). Independent sampling
keeps T near 0.8·n/k: at k = 1 it is close to coordinated; at k = 5 and 20 its T is about k times
smaller, its queries fall by the square of the thresholds' ratio (hundreds of times at k = 20)
and, under DPWS, grow more slowly with n over this grid (at k = 20 its per-call ε stays above
0.5). In the top-count distributions the coordinated 5% quantile lies above the independent 95%
quantile. The cpu preset's numbers are in docs/experiments.md ("Hot PATE scaling"), rebuilt
from the stored run.

`tiny` runs both parts at toy sizes (n in {16, 32, 64}, V = 200, r = 200); the tests run it.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PRESETS", "ScalingConfig", "get_config"]

PRESETS = {"cpu": "n = 16 to 2048 teachers, V = 2000, r = 1000", "tiny": "a test run"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    """Public settings of the scaling study.

    Attributes:
        teacher_counts: the n of part (1), increasing.
        set_sizes: the k (secret tokens) of part (1).
        vocab_size: V of every ensemble.
        private_mass, heterogeneity, background_mass: the secret-set ensembles' shape
            (`pate.diversity.secret_set_logits`).
        num_histograms: r per (n, k, sampler) in part (1).
        coverage_level: the coverage the threshold T of part (1) must keep.
        call_delta: DPWS's δ per call.
        budget_epsilon: the total ε within which the queries are counted.
        budget_delta: the δ at which the calls are composed (DPWS's per-call δ comes on top).
        gaussian_eta: η of the Gaussian release's threshold T = σ·sqrt(2·ln(V/η)).
        shape_teachers: n of part (2).
        shape_histograms: r per (ensemble, sampler) in part (2).
        shape_set_size: k of part (2)'s secret-set ensemble.
        logit_scale: the scale of the long-tailed ensemble's shared logits.
        logit_jitter: the scale of the long-tailed ensemble's per-teacher jitter.
        quantiles: the quantiles part (2) stores.
        bins: the bins on [0, 1] of part (2)'s stored histograms.
        seed: seed of the ensembles and of every draw.
        progress: print a line per setting.
    """

    teacher_counts: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048)
    set_sizes: tuple[int, ...] = (1, 5, 20)
    vocab_size: int = 2000
    private_mass: float = 0.2
    heterogeneity: float = 0.3
    background_mass: float = 1e-3
    num_histograms: int = 1000
    coverage_level: float = 0.2
    call_delta: float = 1e-10
    budget_epsilon: float = 10.0
    budget_delta: float = 1e-6
    gaussian_eta: float = 0.01
    shape_teachers: int = 512
    shape_histograms: int = 2000
    shape_set_size: int = 20
    logit_scale: float = 3.0
    logit_jitter: float = 1.0
    quantiles: tuple[float, ...] = (0.05, 0.25, 0.5, 0.75, 0.95)
    bins: int = 40
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        counts = self.teacher_counts
        if len(counts) < 2 or min(counts) < 2 or list(counts) != sorted(set(counts)):
            raise ValueError(f"teacher_counts must be >= 2 distinct increasing n, got {counts}.")
        if not self.set_sizes or min(self.set_sizes) < 1:
            raise ValueError(f"set_sizes must be >= 1, got {self.set_sizes}.")
        if max(*self.set_sizes, self.shape_set_size) + 2 >= self.vocab_size:
            raise ValueError("every set size must be < vocab_size - 2.")
        for name in ("num_histograms", "shape_histograms", "shape_teachers", "bins"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}.")
        for name in ("coverage_level", "call_delta", "budget_delta", "gaussian_eta"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}.")
        for name in ("budget_epsilon", "logit_scale", "heterogeneity"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}.")
        if not (self.private_mass >= 0 and self.background_mass > 0) or (
            self.private_mass + self.background_mass >= 1
        ):
            raise ValueError(
                "private_mass must be >= 0, background_mass > 0 and their sum < 1, got"
                f" {self.private_mass} and {self.background_mass}."
            )
        if self.logit_jitter < 0:
            raise ValueError(f"logit_jitter must be >= 0, got {self.logit_jitter}.")
        if not self.quantiles or not all(0 <= q <= 1 for q in self.quantiles):
            raise ValueError(f"quantiles must be in [0, 1], got {self.quantiles}.")


def get_config(preset: str = "cpu") -> ScalingConfig:
    """ "cpu" (the stored run) or "tiny" (both parts at toy sizes, for the tests)."""
    if preset == "cpu":
        return ScalingConfig()
    if preset == "tiny":
        return ScalingConfig(
            teacher_counts=(16, 32, 64),
            set_sizes=(1, 5),
            vocab_size=200,
            num_histograms=200,
            shape_teachers=64,
            shape_histograms=200,
            shape_set_size=5,
        )
    raise ValueError(f"preset must be 'cpu' or 'tiny', got {preset!r}.")
