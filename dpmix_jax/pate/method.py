"""One protocol for every private text generator over a teacher ensemble.

A `Method` runs in three steps on the same teachers and public model:

1. `calibrate(run)`: from the public `RunSettings` (the target (ε, δ), the number of texts and
   their length limit, n, ...) the method's noise or clip bound, chosen so that the longest run
   (every text at full length) costs at most the target by the method's own analysis; a `Plan`;
2. `generate(plan, teachers, public_model, prompt=..., key=...)`: every text of the run, each
   a `Sample` (its tokens, where each came from, why it stopped);
3. `charge(plan, samples)`: the ε of what ran and the run's counts, a `Spent`.

Hot PATE's coordinated and independent samplers (`pate.hot_pate_method`) and the peers of
`pate.peers` implement it; `dpmix_jax.synthesis` keeps the registry it dispatches through.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import jax

from dpmix_jax.pate.generation import PublicModel, Teachers
from dpmix_jax.privacy import validation

__all__ = ["Method", "Plan", "RunSettings", "Sample", "Spent", "sample_keys"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSettings:
    """The public settings a method is calibrated for.

    Attributes:
        epsilon, delta: the target budget of the whole run (all its texts).
        num_samples: texts to generate.
        max_new_tokens: length limit of a text.
        num_teachers: n, the teachers of the ensemble.
        vocab_size: V, the public model's vocabulary.
        temperature: the sampling temperature.
        eos_id: the end token (None: none).
        stop_sequences: token sequences that end a text.
        stop_at_newline: whether `stop_sequences` are the newline tokens (for reports).
        aggregator, threshold_fraction, max_retries, public_fallback: Hot PATE's aggregator,
            its threshold as a fraction of n (None: the aggregator's default), the retries of
            a failed step and whether the public model's token replaces a failed one; the peers
            have their own mechanisms and ignore them.
        public_candidates: Hot PATE's c: the aggregator reads only the votes for the public
            model's c most likely next tokens (None: the whole vocabulary).
        allow_large_delta: accept δ >= 1/n (refused by default: at that δ the guarantee
            allows publishing a unit in the clear).
        min_unanimous_release: Hot PATE refuses to calibrate when a token all n teachers vote
            for would be released with a lower probability (its released tokens would be
            near-uniform picks, not the teachers' vote); 0 (default) accepts any. The peers
            ignore it.
    """

    epsilon: float
    delta: float
    num_samples: int
    max_new_tokens: int
    num_teachers: int
    vocab_size: int
    temperature: float = 1.0
    eos_id: int | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    stop_at_newline: bool = False
    aggregator: str = "confident_gnmax"
    threshold_fraction: float | None = None
    max_retries: int = 0
    public_fallback: bool = True
    public_candidates: int | None = None
    allow_large_delta: bool = False
    min_unanimous_release: float = 0.0

    def __post_init__(self) -> None:
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)
        for name in ("num_samples", "max_new_tokens", "vocab_size"):
            validation.check_steps(getattr(self, name), name)
        teachers = self.num_teachers
        if isinstance(teachers, bool) or not isinstance(teachers, int) or teachers < 2:
            raise ValueError(f"num_teachers must be an integer >= 2, got {teachers!r}")
        floor = self.min_unanimous_release
        if isinstance(floor, bool) or not isinstance(floor, int | float) or not 0 <= floor <= 1:
            raise ValueError(f"min_unanimous_release must be in [0, 1], got {floor!r}")
        if self.public_candidates is not None:
            validation.check_steps(self.public_candidates, "public_candidates")
            if not self.public_candidates < self.vocab_size:
                raise ValueError(
                    f"public_candidates must be below the vocabulary's {self.vocab_size} "
                    f"tokens, got {self.public_candidates}"
                )

    @property
    def worst_case_tokens(self) -> int:
        """Tokens of the longest run: every text at full length (num_samples · max_new_tokens)."""
        return self.num_samples * self.max_new_tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """A method calibrated for a run.

    Attributes:
        run: the settings it was calibrated for.
        config: the method's own calibrated config (noise, clip bound, thresholds).
        planned_epsilon: the ε of the longest run by the method's analysis (<= the target).
        mechanism: the calibrated parameters, for reports.
        aggregator: what reports name the mechanism that reads the teachers.
    """

    run: RunSettings
    config: Any
    planned_epsilon: float
    mechanism: Mapping[str, Any]
    aggregator: str


class Sample(Protocol):
    """One generated text."""

    @property
    def tokens(self) -> Sequence[int]:
        """The generated tokens (prompt excluded)."""
        ...

    @property
    def sources(self) -> Sequence[str]:
        """Per token, "private" (released from the teachers) or "public" (the public model's)."""
        ...

    @property
    def stop_reason(self) -> str:
        """Why decoding stopped ("eos", "stop_sequence", "max_new_tokens", ...)."""
        ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class Spent:
    """What a run cost and did.

    Attributes:
        epsilon, delta: the guarantee of everything that ran, by the method's analysis.
        num_queries: mechanism calls that read the teachers (retries included).
        steps_without_output: tokens not released from the teachers (the public model's, or
            a step where every try failed).
        teacher_forward_passes: forward passes of single teachers.
        data_dependent_epsilon, released_epsilons: confident-GNMax's data-dependent ε of the
            run and each text's private release of it (None for the other methods).
    """

    epsilon: float
    delta: float
    num_queries: int
    steps_without_output: int
    teacher_forward_passes: int
    data_dependent_epsilon: float | None = None
    released_epsilons: tuple[float, ...] | None = None


@runtime_checkable
class Method(Protocol):
    """A private text generator over a teacher ensemble (see the module docstring)."""

    @property
    def name(self) -> str:
        """The registry's name of the method."""
        ...

    @property
    def label(self) -> str:
        """How tables and figures name it."""
        ...

    def calibrate(self, run: RunSettings) -> Plan:
        """The method calibrated so that the longest run costs at most (run.epsilon, run.delta).

        Raises:
            ValueError: one line naming the setting the method cannot calibrate for.

        Privacy:
            Reads no sensitive data: a function of public settings only.
        """
        ...

    def generate(
        self,
        plan: Plan,
        teachers: Teachers,
        public_model: PublicModel,
        *,
        prompt: Sequence[int],
        key: jax.Array | None,
    ) -> Sequence[Sample]:
        """The run's `plan.run.num_samples` texts, each decoded after the public `prompt`.

        Text i draws its randomness from the i-th of `sample_keys(key, num_samples)`; None
        draws secret randomness.

        Privacy:
            Reads the teachers only through the method's calibrated mechanism.
        """
        ...

    def charge(self, plan: Plan, samples: Sequence[Sample]) -> Spent:
        """The guarantee and counts of `samples`, every text the run decoded (`generate`'s).

        Privacy:
            The ε is data independent (confident-GNMax's data-dependent ε is released
            privately); the counts describe the released texts.
        """
        ...


def sample_keys(key: jax.Array | None, count: int) -> list[jax.Array | None]:
    """The keys of `count` texts, split off `key` one after another (`key, text_key =
    jax.random.split(key)`); all None when `key` is None (secret randomness per text).

    Privacy:
        As secret as `key`.
    """
    if key is None:
        return [None] * count
    keys = []
    for _ in range(count):
        key, text_key = jax.random.split(key)
        keys.append(text_key)
    return keys
