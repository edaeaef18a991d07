"""Hot PATE's samplers as `pate.method.Method`s: the aggregator's noise for a run, and its cost.

`calibrated_config` calibrates the aggregator's noise so that a run's `num_calls` calls cost at
most a target (ε, δ) by the data-independent composition. `COORDINATED` (hot: shared sampling
noise) and `INDEPENDENT` (cold) decode every text of a run with `generation.generate`, calibrated
for the longest run (every text at full length, every retry taken), and charge the ledger's ε
of the calls that ran; with confident-GNMax each text also releases its data-dependent ε
privately (smooth sensitivity), composed over the texts.

Example:
    >>> config = calibrated_config(
    ...     "dpargmax_laplace", epsilon=1.0, delta=1e-5, num_calls=10, num_teachers=8)
    >>> config.aggregator, config.threshold
    ('dpargmax_laplace', 4.8)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import dp_accounting
import jax

from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pate import aggregators, generation, smooth_sensitivity
from dpmix_jax.pate.method import Plan, RunSettings, Spent, sample_keys
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import validation

__all__ = [
    "AGGREGATORS",
    "COORDINATED",
    "INDEPENDENT",
    "HotPateMethod",
    "WeakReleaseError",
    "calibrated_config",
]

AGGREGATORS = ("confident_gnmax", "dpargmax_laplace", "dpws")
# Default thresholds as fractions of the n teachers (the Hot PATE experiment's).
_THRESHOLDS = {"confident_gnmax": 0.5, "dpargmax_laplace": 0.6, "dpws": 0.0}
_GNMAX_SIGMA_RATIO = 2.0  # σ1 = 2·σ2: the threshold check is noisier than the argmax
# The data-dependent release is tuned for texts whose every step has this share of the votes.
_RELEASE_AGREEMENT = 0.75


def _repeated(event, count: int):
    return event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)


def _noise_free_or(make_event: Callable[[float], Any]) -> Callable[[float], Any]:
    """`make_event` for a scale > 0; a noise-free Gaussian (ε = ∞) at 0, where the calibration's
    search starts."""
    return lambda scale: make_event(scale) if scale > 0 else dp_accounting.GaussianDpEvent(0.0)


def calibrated_config(
    aggregator: str,
    *,
    epsilon: float,
    delta: float,
    num_calls: int,
    num_teachers: int,
    threshold_fraction: float | None = None,
    **settings,
) -> generation.GenerationConfig:
    """A `GenerationConfig` whose `num_calls` aggregator calls cost at most (ε, δ).

    The data-independent composition (PLD, dp-accounting) of `num_calls` calls is calibrated to
    `epsilon` at the report δ: confident-GNMax's σ2 (σ1 = 2σ2), or the per-call ε of DPARGMAX
    and DPWS. DPWS spends half of δ on its per-call δ (δ/(2·num_calls) each) and reports at the
    other half. Thresholds are `threshold_fraction` · n (default 0.5 for confident-GNMax, 0.6
    for DPARGMAX, none beyond DPWS's own for DPWS). `settings` go to `GenerationConfig`.

    Privacy:
        Reads no sensitive data: every choice depends on public settings only.
    """
    if aggregator not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {aggregator!r}")
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    low, high = privacy.CALIBRATION_EPSILON_RANGE
    if not low <= epsilon <= high:
        raise ValueError(f"epsilon must be in [{low:g}, {high:g}], got {epsilon!r}")
    num_calls = validation.check_steps(num_calls, "num_calls")
    fraction = _THRESHOLDS[aggregator] if threshold_fraction is None else threshold_fraction
    if not 0 <= fraction <= 1:
        raise ValueError(f"threshold_fraction must be in [0, 1], got {fraction!r}")
    threshold = fraction * num_teachers
    if aggregator == "confident_gnmax":
        sigma2 = privacy.calibrate(
            _noise_free_or(
                lambda s: _repeated(
                    pate_accounting.confident_gnmax_event(_GNMAX_SIGMA_RATIO * s, s), num_calls
                )
            ),
            target_epsilon=epsilon,
            delta=delta,
        )
        return generation.GenerationConfig(
            aggregator="confident_gnmax",
            threshold=threshold,
            sigma1=_GNMAX_SIGMA_RATIO * sigma2,
            sigma2=sigma2,
            report_delta=delta,
            **settings,
        )
    report_delta = delta / 2 if aggregator == "dpws" else delta
    scale = privacy.calibrate(
        _noise_free_or(
            lambda s: _repeated(pate_accounting.dpargmax_laplace_event(1.0 / s), num_calls)
        ),
        target_epsilon=epsilon,
        delta=report_delta,
    )
    per_call = 1.0 / scale
    # 1/(1/scale) may round below scale; step down until the charged event is within target.
    while (
        pate_accounting.epsilon_of_steps(
            pate_accounting.dpargmax_laplace_event(per_call), steps=num_calls, delta=report_delta
        )
        > epsilon
    ):
        per_call = math.nextafter(per_call, 0.0)
    if aggregator == "dpargmax_laplace":
        return generation.GenerationConfig(
            aggregator="dpargmax_laplace",
            epsilon=per_call,
            threshold=threshold,
            report_delta=delta,
            **settings,
        )
    return generation.GenerationConfig(
        aggregator="dpws",
        epsilon=per_call,
        delta=delta / (2 * num_calls),
        threshold=threshold,
        report_delta=report_delta,
        **settings,
    )


_MOST_TEACHERS_SEARCHED = 1 << 20


class WeakReleaseError(ValueError):
    """Hot PATE's calibration releases a token all n teachers vote for with a probability below
    the run's `min_unanimous_release`: its released tokens would be near-uniform picks among
    the candidates, not the teachers' vote.

    `str(error)` names the library's settings; a command line shows `message(flags=True)`.

    Attributes:
        run: the refused settings.
        num_calls: the aggregator calls the noise is calibrated for.
        probability: the unanimous token's release probability at those settings.
        needed: the fewest teachers that reach the floor at the same noise (None: none up to
            2^20).
    """

    def __init__(self, run: RunSettings, *, num_calls: int, probability: float, needed: int | None):
        self.run, self.num_calls = run, num_calls
        self.probability, self.needed = probability, needed
        super().__init__(self.message(flags=False))

    def message(self, *, flags: bool) -> str:
        """The refusal and its remedies, named as the library's arguments or, with `flags`, as
        `dpmix generate`'s options."""
        run = self.run
        teachers = f"at least {self.needed} teachers" if self.needed else "far more teachers"
        if flags:
            remedies = (
                f"{teachers} (--num-teachers), a larger --epsilon, fewer or shorter texts "
                "(--num-samples, --max-new-tokens), fewer --public-candidates, or a lower "
                "--min-unanimous-release"
            )
        else:
            remedies = (
                f"{teachers}, a larger epsilon, fewer or shorter texts, fewer "
                "public_candidates, or a lower min_unanimous_release"
            )
        return (
            f"at ε = {run.epsilon:g} over {self.num_calls} calls a token all {run.num_teachers} "
            f"teachers vote for is released with probability {self.probability:.2g}, below "
            f"the floor of {run.min_unanimous_release:g}: the released tokens would be "
            f"near-uniform picks, not the teachers' vote; use {remedies}"
        )


def _unanimous_release(
    config: generation.GenerationConfig, num_teachers: int, num_buckets: int, fraction: float
) -> float | None:
    """`aggregators.unanimous_release_probability` of `config`'s noise with `num_teachers`
    teachers and the threshold at `fraction` of them."""
    return aggregators.unanimous_release_probability(
        config.aggregator,
        num_teachers=num_teachers,
        num_buckets=num_buckets,
        threshold=fraction * num_teachers,
        sigma1=config.sigma1,
        sigma2=config.sigma2,
        epsilon=config.epsilon,
    )


def _teachers_for_release(
    config: generation.GenerationConfig,
    num_teachers: int,
    num_buckets: int,
    fraction: float,
    floor: float,
) -> int | None:
    """The fewest teachers (above `num_teachers`) whose unanimous token `config`'s noise
    releases with probability at least `floor`, the threshold the same fraction of them; None
    beyond `_MOST_TEACHERS_SEARCHED`. The noise does not depend on n (one teacher moves one
    vote), and the probability grows with n, so a doubling and a bisection find it."""

    def enough(n: int) -> bool:
        return _unanimous_release(config, n, num_buckets, fraction) >= floor

    low, high = num_teachers, min(2 * num_teachers, _MOST_TEACHERS_SEARCHED)
    while not enough(high):
        if high >= _MOST_TEACHERS_SEARCHED:
            return None
        low, high = high, min(2 * high, _MOST_TEACHERS_SEARCHED)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if enough(middle) else (middle, high)
    return high


@dataclasses.dataclass(frozen=True, kw_only=True)
class HotPateMethod:
    """Hot PATE with one histogram sampler, as a `pate.method.Method`.

    Attributes:
        sampler: "coordinated" (hot: shared sampling noise) or "independent" (cold); also the
            method's name.
        label: how tables and figures name it.
    """

    sampler: Literal["coordinated", "independent"]
    label: str

    def __post_init__(self) -> None:
        if self.sampler not in ("coordinated", "independent"):
            raise ValueError(
                f"sampler must be 'coordinated' or 'independent', got {self.sampler!r}"
            )

    @property
    def name(self) -> str:
        """The sampler's name."""
        return self.sampler

    def calibrate(self, run: RunSettings) -> Plan:
        """`calibrated_config` for the longest run, num_samples · max_new_tokens ·
        (max_retries + 1) calls; with confident-GNMax also the data-dependent release's
        (λ, β, σ_s), chosen from public inputs (`smooth_sensitivity.choose_release`).

        Raises:
            ValueError: one line naming the setting: an unknown aggregator, ε outside the
                calibration's range, a threshold fraction outside [0, 1], or a token all
                teachers vote for released with a probability below the run's
                `min_unanimous_release` (`WeakReleaseError`, naming the fewest teachers that
                reach it).

        Privacy:
            Reads no sensitive data: a function of public settings only.
        """
        n = run.num_teachers
        num_calls = run.worst_case_tokens * (run.max_retries + 1)
        config = calibrated_config(
            run.aggregator,
            epsilon=run.epsilon,
            delta=run.delta,
            num_calls=num_calls,
            num_teachers=n,
            threshold_fraction=run.threshold_fraction,
            sampler=self.sampler,
            temperature=run.temperature,
            max_retries=run.max_retries,
            max_new_tokens=run.max_new_tokens,
            eos_id=run.eos_id,
            stop_sequences=run.stop_sequences,
            public_candidates=run.public_candidates,
            public_fallback=run.public_fallback,
            allow_large_delta=run.allow_large_delta,
        )
        # The aggregator's counts: the candidates and the others' bucket, or the vocabulary.
        buckets = run.vocab_size if run.public_candidates is None else run.public_candidates + 1
        gnmax = config.aggregator == "confident_gnmax"
        if gnmax:
            release = smooth_sensitivity.choose_release(
                num_queries=run.max_new_tokens,
                num_teachers=n,
                num_classes=buckets,
                threshold=config.threshold,
                sigma1=config.sigma1,
                sigma2=config.sigma2,
                delta=config.report_delta,
                agreement=_RELEASE_AGREEMENT,
            )
            config = dataclasses.replace(
                config,
                release_order=release.order,
                release_noise_multiplier=release.noise_multiplier,
                release_beta=release.beta,
            )
        fraction = config.threshold / n
        unanimous = _unanimous_release(config, n, buckets, fraction)
        if unanimous is not None and unanimous < run.min_unanimous_release:
            raise WeakReleaseError(
                run,
                num_calls=num_calls,
                probability=unanimous,
                needed=_teachers_for_release(
                    config, n, buckets, fraction, run.min_unanimous_release
                ),
            )
        event, call_delta = config.charge()
        planned = pate_accounting.epsilon_of_steps(
            event, steps=num_calls, delta=config.report_delta
        )
        mechanism = {
            "threshold": config.threshold,
            "per_call_epsilon": None if gnmax else config.epsilon,
            "per_call_delta": call_delta,
            "sigma1": config.sigma1 if gnmax else None,
            "sigma2": config.sigma2 if gnmax else None,
            "report_delta": config.report_delta,
            "max_calls": num_calls,
            "release_order": config.release_order,
            "release_beta": config.release_beta,
            "release_noise_multiplier": (
                config.release_noise_multiplier if config.release_order is not None else None
            ),
            "max_new_tokens": run.max_new_tokens,
            "max_retries": run.max_retries,
            "temperature": run.temperature,
            "stop_at_newline": run.stop_at_newline,
            "public_fallback": run.public_fallback,
            "public_candidates": run.public_candidates,
            "unanimous_release_probability": unanimous,
        }
        return Plan(
            run=run,
            config=config,
            planned_epsilon=planned,
            mechanism=mechanism,
            aggregator=run.aggregator,
        )

    def generate(
        self,
        plan: Plan,
        teachers: generation.Teachers,
        public_model: generation.PublicModel,
        *,
        prompt: Sequence[int],
        key: jax.Array | None,
    ) -> list[generation.GenerationResult]:
        """Every text of the run by `generation.generate`, all recorded in one ledger; a failed
        step takes the public model's token when `plan.run.public_fallback`, else ends the text.

        Privacy:
            Reads the teachers only through the calibrated aggregator; every call is recorded.
        """
        ledger = pate_accounting.PateLedger()
        return [
            generation.generate(
                teachers,
                prompt,
                plan.config,
                key=text_key,
                public_model=public_model,
                ledger=ledger,
            )  # fmt: skip
            for text_key in sample_keys(key, plan.run.num_samples)
        ]

    def charge(self, plan: Plan, samples: Sequence[generation.GenerationResult]) -> Spent:
        """The ledger's ε and δ of every call that ran (the last text's, whose ledger holds them
        all), and with confident-GNMax the texts' released data-dependent ε composed at the
        common order λ: Σ (released ε_i − ln(1/δ)/(λ−1)) + ln(1/δ)/(λ−1).

        Privacy:
            The ε is data independent; the data-dependent one is the sum of private releases.
        """
        config = plan.config
        released = data_dependent = None
        if config.release_order is not None:
            released = tuple(float(sample.released.epsilon) for sample in samples)
            conversion = math.log(1 / config.report_delta) / (config.release_order - 1)
            data_dependent = sum(released) - (len(released) - 1) * conversion
        # Every step queries the teachers once; a step whose every try failed ends its text
        # ("fail") without a token when there is no public fallback.
        failed_ends = sum(sample.stop_reason == "fail" for sample in samples)
        public_tokens = sum(sample.sources.count("public") for sample in samples)
        steps = sum(len(sample.tokens) for sample in samples) + failed_ends
        return Spent(
            epsilon=samples[-1].epsilon,
            delta=samples[-1].delta,
            num_queries=sum(sample.num_queries for sample in samples),
            steps_without_output=public_tokens + failed_ends,
            teacher_forward_passes=steps * plan.run.num_teachers,
            data_dependent_epsilon=data_dependent,
            released_epsilons=released,
        )


COORDINATED = HotPateMethod(sampler="coordinated", label="Hot PATE (coordinated)")
INDEPENDENT = HotPateMethod(sampler="independent", label="PATE (independent)")
