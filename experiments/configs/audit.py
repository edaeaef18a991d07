"""Canary audits of every release: DP-MixMin's λ, DP-SGD, the pipeline, Hot PATE.

Command:
    python -m experiments.audit --preset cpu --out DIR   # about 120 s of CPU time on 2 cores

Writes DIR/results.md (the summary table, the tightness table and the λ / DP-SGD tables),
DIR/results.json and DIR/results.png (ε_LB against claimed ε per release and method, no-noise
controls hollow). Measured with the cpu preset: every private ε_LB at the claimed ε = 1 is below
it (λ and DP-SGD many-run canaries 0.00, one-run DP-SGD 0.08-0.17, end-to-end pipeline 0.01
over many runs and 0.07-0.12 in one run, Hot PATE 0.05-0.46); the no-noise controls reach
3.4-4.0 (many runs, 400 per world), 3.8 (one run, 500 canaries) and 7.2-7.9 (Hot PATE, 20,000
calls per world); the white-box tightness audit certifies ε_LB / ε = 0.66-0.82 for DP-SGD and
DP-MixMin at ε = 1 and 4. The λ settings (400 runs per world, k = 14, n = 200, T = 300,
q ≈ 0.5, σ ≈ 32 for ε = 1) give natural and max-clip ε_LB 0.00 against 3.4-3.6 without noise;
`--known-batches` (trials share the other units' batches) brings every no-noise ε_LB of the λ
and DP-SGD audits to ≈ 4.0.

The paper preset reproduces the DP-MixMin audit protocol (ε = 1, δ = 1e-5, ρ = 0.1, k = 14,
14 tasks, 2000 runs per configuration, i.e. 1000 per world) on synthetic proxy outputs of
NIH-like size (n = 8970, b = 1000), with shared batches so that the no-noise control keeps
its power at that scale (one task: ε_LB 0.07 natural, 0.00 max-clip, 4.9 without noise, 160 s
on 2 CPU cores; the λ audit takes about 40 minutes).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import validation
from dpmix_jax.privacy.audit import METHODS


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixMinAuditConfig:
    """The λ audit: DP-MixMin (mirror descent) on synthetic `nll` proxy outputs.

    Attributes:
        num_tasks: independent synthetic sensitive tasks (one table row per task and ε).
        num_sources: k.
        sensitive_size: N, examples of the sensitive set; the mixture split is ρN of them.
        mixture_fraction: ρ.
        epsilons: claimed ε values audited.
        delta: δ.
        steps, batch_size, clip_norm, learning_rate, shift: DP-MixMin settings.
    """

    num_tasks: int
    num_sources: int
    sensitive_size: int
    mixture_fraction: float
    epsilons: tuple[float, ...]
    delta: float
    steps: int
    batch_size: float
    clip_norm: float
    learning_rate: float
    shift: str = "mean"

    def __post_init__(self) -> None:
        for name in ("num_tasks", "num_sources", "sensitive_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < (2 if name == "num_sources" else 1):
                raise ValueError(f"{name} must be a positive integer (k >= 2), got {value!r}.")
        if not 0 < self.mixture_fraction <= 1:
            raise ValueError(f"mixture_fraction must be in (0, 1], got {self.mixture_fraction}.")
        if self.mixture_size < 10:
            raise ValueError("the mixture split must hold at least 10 examples.")
        _check_epsilons(self.epsilons)
        validation.check_delta(self.delta)
        validation.check_steps(self.steps)
        for name in ("batch_size", "clip_norm", "learning_rate"):
            validation.check_positive(getattr(self, name), name)
        if self.shift not in ("none", "mean", "weighted"):
            raise ValueError(f"shift must be 'none', 'mean' or 'weighted', got {self.shift!r}.")

    @property
    def mixture_size(self) -> int:
        """n = round(ρN), the size of the mixture split."""
        return round(self.mixture_fraction * self.sensitive_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpSgdAuditConfig:
    """The DP-SGD audit: binary logistic regression on scikit-learn's digits (1797 images).

    Attributes:
        epsilons: claimed ε values audited.
        delta: δ.
        steps, batch_size, clip_norm, learning_rate: DP-SGD settings (plain SGD updates).
        canary_scale: norm of the input-space canary (an outlier image).
    """

    epsilons: tuple[float, ...]
    delta: float
    steps: int
    batch_size: float
    clip_norm: float
    learning_rate: float
    canary_scale: float

    def __post_init__(self) -> None:
        _check_epsilons(self.epsilons)
        validation.check_delta(self.delta)
        validation.check_steps(self.steps)
        for name in ("batch_size", "clip_norm", "learning_rate", "canary_scale"):
            validation.check_positive(getattr(self, name), name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReleaseAuditConfig:
    """The audits of every release (see `experiments/audit_releases.py`).

    Attributes:
        epsilon, delta: the claim audited for DP-SGD (example and user level) and each Hot PATE
            aggregator call.
        clip_norm: C; learning_rate: DP-SGD step size.
        tight_epsilons: claimed ε values of the white-box tightness audit.
        tight_units, tight_steps, tight_rate, tight_learning_rate: its run (n units with the
            canary, T steps, Poisson rate q, step size).
        tight_pilot: draws per world of the claimed mechanism that choose the test.
        tight_trials: runs per world of the implementation that evaluate it.
        tight_control_trials: runs per world of the no-noise control.
        chunk: tightness runs vmapped together.
        one_run_canaries: m canaries (examples, or users) in the one-run DP-SGD audits, and
            in D_ft of the one-run end-to-end audit.
        one_run_steps, one_run_batch_size: that run's T and expected batch.
        ghost_examples, ghost_batch_size: ordinary examples and expected batch of the one-run
            audit of the ghost-clipping path with cancelling (numerical) canaries (its m and T
            are `one_run_canaries` and `one_run_steps`).
        examples_per_user: G for user-level runs (real users: G consecutive digits rows).
        user_examples, user_steps, user_batch_size: the many-run canary-user audit's data size,
            T and expected batch (users).
        pate_votes: h, the vote count of the PATE neighbour pairs.
        pate_trials: aggregator calls per histogram (many-run bound).
        pate_queries: queries of the one-run PATE audit (one canary teacher each).
        pipeline_units: sensitive units of the end-to-end audit (digits rows; the rest of
            digits trains the k = `pipeline_sources` public proxy models).
        pipeline_mix_fraction: ρ, the share of units the keyed split sends to D_mix.
        pipeline_mix_steps, pipeline_mix_batch, pipeline_mix_learning_rate: DP-MixMin stage.
        pipeline_ft_steps, pipeline_ft_batch: DP-SGD fine-tuning stage.
        pipeline_chunk: end-to-end runs vmapped together.
    """

    epsilon: float = 1.0
    delta: float = 1e-5
    clip_norm: float = 1.0
    learning_rate: float = 1.0
    tight_epsilons: tuple[float, ...] = (1.0, 4.0)
    tight_units: int = 8
    tight_steps: int = 2
    tight_rate: float = 0.5
    tight_learning_rate: float = 0.1
    tight_pilot: int = 1_000_000
    tight_trials: int = 1_000_000
    tight_control_trials: int = 20_000
    chunk: int = 100_000
    one_run_canaries: int = 500
    one_run_steps: int = 100
    one_run_batch_size: float = 256
    ghost_examples: int = 400
    ghost_batch_size: float = 64
    examples_per_user: int = 4
    user_examples: int = 400
    user_steps: int = 30
    user_batch_size: float = 32
    pate_votes: int = 10
    pate_trials: int = 20_000
    pate_queries: int = 1000
    pipeline_units: int = 600
    pipeline_sources: int = 4
    pipeline_mix_fraction: float = 0.5
    pipeline_mix_steps: int = 100
    pipeline_mix_batch: float = 100
    pipeline_mix_learning_rate: float = 0.1
    pipeline_ft_steps: int = 50
    pipeline_ft_batch: float = 64
    pipeline_chunk: int = 400

    def __post_init__(self) -> None:
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)
        _check_epsilons(self.tight_epsilons)
        for name in ("clip_norm", "learning_rate", "tight_learning_rate", "one_run_batch_size"):
            validation.check_positive(getattr(self, name), name)
        validation.check_positive(self.ghost_batch_size, "ghost_batch_size")
        validation.check_positive(self.user_batch_size, "user_batch_size")
        for name in ("pipeline_mix_batch", "pipeline_mix_learning_rate", "pipeline_ft_batch"):
            validation.check_positive(getattr(self, name), name)
        if not 0 < self.pipeline_mix_fraction < 1:
            raise ValueError(
                f"pipeline_mix_fraction must be in (0, 1), got {self.pipeline_mix_fraction!r}."
            )
        if not 0 < self.tight_rate <= 1:
            raise ValueError(f"tight_rate must be in (0, 1], got {self.tight_rate!r}.")
        for name in (
            "tight_units",
            "tight_steps",
            "tight_pilot",
            "tight_trials",
            "tight_control_trials",
            "chunk",
            "one_run_canaries",
            "one_run_steps",
            "ghost_examples",
            "examples_per_user",
            "user_examples",
            "user_steps",
            "pate_votes",
            "pate_trials",
            "pate_queries",
            "pipeline_units",
            "pipeline_sources",
            "pipeline_mix_steps",
            "pipeline_ft_steps",
            "pipeline_chunk",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 2 - (name == "examples_per_user"):
                raise ValueError(f"{name} must be an integer >= 2, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """Both audits and the statistics they share.

    Attributes:
        mixmin: the λ audit.
        dpsgd: the DP-SGD audit.
        releases: the one-run, user-level, Hot PATE and tightness audits.
        trials: independent runs per world (with / without the canary) for each canary.
        chunk: trials vmapped together (bounds memory).
        confidence: confidence of the Clopper-Pearson bound.
        method: threshold-selection correction, "split" (SELECT/EVAL halves) or "bonferroni".
        known_batches: if True, every trial shares the other units' batches and only the
            canary's inclusion and the noise are random (a stronger adversary, still covered by
            the accountant; see `privacy.audit_runs.sample_trial_batches`). If False, each "with"
            trial is an independent `dp_mixmin` / DP-SGD run.
        seed: master seed.
    """

    mixmin: MixMinAuditConfig
    dpsgd: DpSgdAuditConfig
    releases: ReleaseAuditConfig = dataclasses.field(default_factory=lambda: ReleaseAuditConfig())
    trials: int
    chunk: int
    confidence: float = 0.95
    method: str = "split"
    known_batches: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.trials, int) or self.trials < 4:
            raise ValueError(f"trials must be an integer >= 4, got {self.trials!r}.")
        if not isinstance(self.chunk, int) or self.chunk < 1:
            raise ValueError(f"chunk must be an integer >= 1, got {self.chunk!r}.")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence!r}.")
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}.")
        if not isinstance(self.known_batches, bool):
            raise ValueError(f"known_batches must be a bool, got {self.known_batches!r}.")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}.")


def _check_epsilons(epsilons: tuple[float, ...]) -> None:
    if not isinstance(epsilons, tuple) or not epsilons:
        raise ValueError(f"epsilons must be a non-empty tuple, got {epsilons!r}.")
    for eps in epsilons:
        validation.check_epsilon(eps)


PRESETS = {
    "cpu": "a CPU-sized audit (experiments/configs/audit.py)",
    "paper": "the paper's settings",
}


def get_config(preset: str = "cpu") -> AuditConfig:
    """The audit settings: "cpu" (4.5 minutes wall and 1.2 GB peak memory on 2 CPU cores shared
    with other jobs, docs/results/audit.json) or "paper" (the paper's protocol)."""
    if preset == "cpu":
        return AuditConfig(
            mixmin=MixMinAuditConfig(
                num_tasks=2,
                num_sources=14,
                sensitive_size=2000,
                mixture_fraction=0.1,
                epsilons=(1.0,),
                delta=1e-5,
                steps=300,
                batch_size=100,
                clip_norm=1.0,
                learning_rate=0.1,
            ),
            dpsgd=DpSgdAuditConfig(
                epsilons=(1.0,),
                delta=1e-5,
                steps=100,
                batch_size=128,
                clip_norm=1.0,
                learning_rate=1.0,
                canary_scale=4.0,
            ),
            trials=400,
            chunk=400,
        )
    if preset == "paper":
        return AuditConfig(
            mixmin=MixMinAuditConfig(
                num_tasks=14,
                num_sources=14,
                sensitive_size=89_696,
                mixture_fraction=0.1,
                epsilons=(1.0,),
                delta=1e-5,
                steps=100,
                batch_size=1000,
                clip_norm=1.0,
                learning_rate=1.0,
            ),
            dpsgd=DpSgdAuditConfig(
                epsilons=(1.0, 2.0, 5.0),
                delta=1e-5,
                steps=300,
                batch_size=128,
                clip_norm=1.0,
                learning_rate=1.0,
                canary_scale=4.0,
            ),
            trials=1000,
            chunk=250,
            known_batches=True,
        )
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
