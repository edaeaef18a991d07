"""One config drives the sampler, the noise and the accountant, so they cannot drift apart.

`DpSgdConfig` holds the public settings of a Poisson-sampled Gaussian run (target budget, clip
norm, expected batch size, steps). `plan_dp_sgd(config, num_units=n)` adds the one data-dependent
value, the number of units (examples or users), and returns a `DpSgdPlan`: the sampling rate the
sampler uses, the σ calibrated for exactly that rate and step count, and the event the ledger
records per step (per cycle of b steps for BandMF's correlated noise, `noise="bandmf"`).

Example:
    >>> config = DpSgdConfig(epsilon=1.0, delta=1e-5, clip_norm=1.0, batch_size=100, steps=50)
    >>> plan = plan_dp_sgd(config, num_units=10_000)
    >>> plan.sampling_rate, plan.spent().epsilon <= 1.0
    (0.01, True)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Literal

import dp_accounting

from dpmix_jax.privacy import accounting, correlated_noise, validation
from dpmix_jax.privacy.cyclic_sampling import CyclicPoissonSampler, CyclicUserPoissonSampler
from dpmix_jax.privacy.sampling import PoissonSampler, UserPoissonSampler

Noise = Literal["independent", "bandmf"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpSgdConfig:
    """Public settings of a DP-SGD-style run (example or user level).

    Attributes:
        epsilon: target ε (> 0); give exactly one of `epsilon` and `noise_multiplier`.
        delta: target δ in (0, 1).
        clip_norm: C > 0.
        batch_size: expected number of units per step, b; the rate is q = b / n, which must be
            below 1 (b >= n would sample every unit every step: no amplification), except for
            the no-noise control σ = 0 (full batches, ε = inf).
        steps: T >= 1.
        noise_multiplier: a fixed σ (then ε is computed, not targeted, and the run reports the
            ε it spent); None calibrates σ to `epsilon`.
        accountant: "pld" (default) or "rdp".
        max_examples_per_user: G for user-level runs (None for example level).
        pad_multiple: sampler padding multiple.
        allow_large_delta: accept δ >= 1/n (n units in the run), which `plan_dp_sgd` refuses
            by default because such a δ allows publishing a unit in the clear; a plan and the
            results built from this config carry the setting.
        noise: "independent" (DP-SGD, default) or "bandmf": correlated noise of the banded
            square root of the prefix sum (`correlated_noise.sqrt_prefix_sum`) with cyclic
            Poisson sampling over `bands` partitions, accounted as DP-SGD with ceil(T / b)
            steps at the partition's rate q = b·batch_size / n.
        bands: b, 1 <= b <= steps, for noise="bandmf" only (None otherwise).
    """

    epsilon: float | None
    delta: float
    clip_norm: float
    batch_size: float
    steps: int
    noise_multiplier: float | None = None
    accountant: accounting.Accountant = "pld"
    max_examples_per_user: int | None = None
    pad_multiple: int = 32
    allow_large_delta: bool = False
    noise: Noise = "independent"
    bands: int | None = None

    def __post_init__(self) -> None:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError(
                "give exactly one of epsilon (a target; σ is calibrated to it) and "
                f"noise_multiplier (a fixed σ; ε is computed), got epsilon={self.epsilon!r} and "
                f"noise_multiplier={self.noise_multiplier!r}."
            )
        if self.epsilon is not None:
            validation.check_epsilon(self.epsilon)
        if self.noise_multiplier is not None:
            validation.check_noise_multiplier(self.noise_multiplier)
        validation.check_delta(self.delta)
        validation.check_positive(self.clip_norm, "clip_norm")
        validation.check_positive(self.batch_size, "batch_size")
        validation.check_steps(self.steps)
        accounting.make_accountant(self.accountant)
        if not isinstance(self.allow_large_delta, bool):
            raise ValueError(
                f"allow_large_delta must be True or False, got {self.allow_large_delta!r}."
            )
        if self.max_examples_per_user is not None and (
            not isinstance(self.max_examples_per_user, numbers.Integral)
            or self.max_examples_per_user < 1
        ):
            raise ValueError(
                f"max_examples_per_user must be None or an integer >= 1, "
                f"got {self.max_examples_per_user!r}."
            )
        check_noise_settings(self.noise, self.bands, self.steps)

    @property
    def user_level(self) -> bool:
        return self.max_examples_per_user is not None

    @property
    def cycle(self) -> int:
        """Steps per cycle of the partitions: `bands` for BandMF, 1 for independent noise."""
        return 1 if self.bands is None else self.bands

    @property
    def accounted_steps(self) -> int:
        """The DP-SGD steps the run is accounted as: ceil(steps / cycle)."""
        return -(-self.steps // self.cycle)


def check_noise_settings(noise: str, bands: int | None, steps: int) -> None:
    """Raises ValueError unless `noise` is "independent" (bands None) or "bandmf" with an
    integer 1 <= bands <= steps."""
    if noise not in ("independent", "bandmf"):
        raise ValueError(f"noise must be 'independent' or 'bandmf', got {noise!r}.")
    if noise == "independent":
        if bands is not None:
            raise ValueError(f"bands is for noise='bandmf' only, got bands={bands!r}.")
        return
    if bands is None:
        raise ValueError("noise='bandmf' needs bands (an integer >= 1).")
    if correlated_noise.check_bands(bands) > steps:
        raise ValueError(f"bands must be <= steps ({steps}), got {bands!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpSgdPlan:
    """A `DpSgdConfig` resolved for a data set of `num_units` units."""

    config: DpSgdConfig
    num_units: int
    sampling_rate: float
    noise_multiplier: float

    @property
    def expected_batch_size(self) -> float:
        """q·n / b, the public normaliser of the noisy gradient sum (b = 1 for independent
        noise: q·n)."""
        return self.sampling_rate * self.num_units / self.config.cycle

    def strategy(self) -> correlated_noise.BandedToeplitzStrategy | None:
        """BandMF's normalised strategy (`correlated_noise.sqrt_prefix_sum`); None for DP-SGD."""
        if self.config.noise == "independent":
            return None
        return correlated_noise.sqrt_prefix_sum(self.config.bands)

    def sampler(
        self,
    ) -> PoissonSampler | UserPoissonSampler | CyclicPoissonSampler | CyclicUserPoissonSampler:
        """The sampler whose rate the accountant assumes (cyclic for BandMF)."""
        config = self.config
        if config.noise == "bandmf" and config.user_level:
            return CyclicUserPoissonSampler(
                sampling_rate=self.sampling_rate,
                bands=config.bands,
                max_examples_per_user=config.max_examples_per_user,
                pad_multiple=config.pad_multiple,
            )
        if config.noise == "bandmf":
            return CyclicPoissonSampler(
                sampling_rate=self.sampling_rate,
                bands=config.bands,
                pad_multiple=config.pad_multiple,
            )
        if self.config.user_level:
            return UserPoissonSampler(
                sampling_rate=self.sampling_rate,
                max_examples_per_user=self.config.max_examples_per_user,
                pad_multiple=self.config.pad_multiple,
            )
        return PoissonSampler(
            sampling_rate=self.sampling_rate, pad_multiple=self.config.pad_multiple
        )

    def step_event(self) -> dp_accounting.DpEvent:
        """The event of one step, or of one cycle of b steps for BandMF: record it in the ledger
        at every executed step for which `event_due(step)` holds."""
        return accounting.dpsgd_event(
            noise_multiplier=self.noise_multiplier, sampling_rate=self.sampling_rate, steps=1
        )

    def event_due(self, step: int) -> bool:
        """Whether executing step `step` (0-based) starts a new cycle, whose `step_event()` the
        ledger records: every step for DP-SGD, steps 0, b, 2b, ... for BandMF (a resumed run
        records a cycle exactly once: at its first step)."""
        return step % self.config.cycle == 0

    def spent(self, steps: int | None = None) -> accounting.PrivacyBudget:
        """(ε, δ) after `steps` steps (default: all of them), from the accountant."""
        if self.noise_multiplier == 0:
            return accounting.PrivacyBudget(math.inf, self.config.delta)
        steps = self.config.steps if steps is None else steps
        event = accounting.dpsgd_event(
            noise_multiplier=self.noise_multiplier,
            sampling_rate=self.sampling_rate,
            steps=-(-validation.check_steps(steps) // self.config.cycle),
        )
        eps = accounting.epsilon(event, delta=self.config.delta, accountant=self.config.accountant)
        return accounting.PrivacyBudget(eps, self.config.delta)


class BatchTooLargeError(ValueError):
    """The expected batch size (times the bands of BandMF) reaches the number of units: the
    Poisson rate would be 1 or more (`plan_dp_sgd`).

    `str(error)` names the settings (`batch_size`, `bands`); a command line shows
    `message(what)` naming its own options.
    """

    def __init__(self, batch_size: float, bands: int | None, num_units: int, unit: str):
        self.batch_size, self.bands, self.num_units, self.unit = batch_size, bands, num_units, unit
        super().__init__(self.message("batch_size or bands" if bands else "batch_size"))

    def message(self, what: str) -> str:
        """The refusal, saying to lower `what` (e.g. "--batch-size or --bands")."""
        n, unit = self.num_units, self.unit
        if self.bands:
            over = self.batch_size * self.bands > n
            return (
                f"batch_size {self.batch_size:g} x {self.bands} bands {'>' if over else '>='} "
                f"{n} {unit}: the rate q = batch_size / (n / bands) would "
                f"{'exceed 1' if over else 'be 1 (no amplification)'}; lower {what}."
            )
        return (
            f"batch_size {self.batch_size:g} >= {n} {unit}: the Poisson rate would be 1 (no "
            f"amplification); lower {what} below the number of {unit}."
        )


def plan_dp_sgd(config: DpSgdConfig, *, num_units: int) -> DpSgdPlan:
    """Resolves `config` for `num_units` examples (or users): rate q = b / n and σ.

    For BandMF with `bands` partitions the rate is that inside the active partition,
    q = batch_size / (n / bands), and σ is calibrated for ceil(steps / bands) steps at q.

    Raises:
        ValueError: when b >= n (b·bands >= n for BandMF): the Poisson rate would be 1 (every
            unit in every batch), which loses the amplification by sampling and makes the
            normaliser the data set's size.
            Only the no-noise control (σ = 0, ε = inf: no privacy claimed) may run full batches.
            Also when δ >= 1/n, unless `config.allow_large_delta`.

    Privacy: `num_units` is the size of the sensitive set; under add/remove DP it is itself
    sensitive, and the guarantee holds for the σ calibrated here at the rate used by the sampler.
    """
    if not isinstance(num_units, numbers.Integral) or num_units < 1:
        raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}.")
    unit = "users" if config.user_level else "examples"
    validation.check_delta_for_units(
        config.delta, int(num_units), unit=unit, allow_large_delta=config.allow_large_delta
    )
    per_cycle = config.batch_size * config.cycle
    bandmf = config.noise == "bandmf"
    if (bandmf and per_cycle > num_units) or (
        per_cycle >= num_units and config.noise_multiplier != 0
    ):
        raise BatchTooLargeError(
            config.batch_size, config.cycle if bandmf else None, num_units, unit
        )
    rate = min(1.0, config.batch_size * config.cycle / num_units)
    if config.noise_multiplier is not None:
        sigma = config.noise_multiplier
    else:
        sigma = accounting.calibrate_noise_multiplier(
            target_epsilon=config.epsilon,
            delta=config.delta,
            sampling_rate=rate,
            steps=config.accounted_steps,
            accountant=config.accountant,
        )
    return DpSgdPlan(config=config, num_units=num_units, sampling_rate=rate, noise_multiplier=sigma)
