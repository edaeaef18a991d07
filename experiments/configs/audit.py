"""Canary audit of DP-MixMin's released λ and of DP-SGD (SPEC §6).

Command:
    python -m experiments.audit --preset cpu --out DIR      # about 100 s on 2 CPU cores

Writes DIR/audit.md (tables), DIR/audit.json and DIR/audit.png. Expected with the cpu preset
(400 runs per world, k = 14, n = 200, T = 300, q ≈ 0.5, σ ≈ 32 for ε = 1): every ε_LB at the
claimed ε = 1 is below it (natural and max-clip canaries 0.00-0.02, DP-SGD canaries 0.00), and
the no-noise controls reach ε_LB ≈ 3.1-3.7 for the λ release and ≈ 4.0 for both DP-SGD
canaries; 4.0 is the most that 200 held-out runs per world can certify. `--known-batches`
(trials share the other units' batches) takes about 50 s and brings every no-noise ε_LB to
≈ 4.0. The paper preset reproduces the DP-MixMin audit protocol (ε = 1, δ = 1e-5, ρ = 0.1,
k = 14, 14 tasks, 2000 runs per configuration, i.e. 1000 per world) on synthetic proxy outputs
of NIH-like size (n = 8970, b = 1000), with shared batches so that the no-noise control keeps
its power at that scale (one task: ε_LB 0.07 natural, 0.00 max-clip, 4.9 without noise, 160 s
on 2 CPU cores; the λ audit takes about 40 minutes).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import accounting
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
        accounting.check_delta(self.delta)
        accounting.check_steps(self.steps)
        for name in ("batch_size", "clip_norm", "learning_rate"):
            accounting.check_positive(getattr(self, name), name)
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
        accounting.check_delta(self.delta)
        accounting.check_steps(self.steps)
        for name in ("batch_size", "clip_norm", "learning_rate", "canary_scale"):
            accounting.check_positive(getattr(self, name), name)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AuditConfig:
    """Both audits and the statistics they share.

    Attributes:
        mixmin: the λ audit.
        dpsgd: the DP-SGD audit.
        trials: independent runs per world (with / without the canary) for each canary.
        chunk: trials vmapped together (bounds memory).
        confidence: confidence of the Clopper-Pearson bound.
        method: threshold-selection correction, "split" (SELECT/EVAL halves) or "bonferroni".
        known_batches: if True, every trial shares the other units' batches and only the
            canary's inclusion and the noise are random (a stronger adversary, still covered by
            the accountant; see `experiments.audit.sample_trial_batches`). If False, each "with"
            trial is an independent `dp_mixmin` / DP-SGD run.
        seed: master seed.
    """

    mixmin: MixMinAuditConfig
    dpsgd: DpSgdAuditConfig
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
        accounting.check_epsilon(eps)


def get_config(preset: str = "cpu") -> AuditConfig:
    """The audit settings: "cpu" (a few minutes on 2 cores) or "paper" (the paper's protocol)."""
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
