"""Private sequential decoding with a teacher ensemble (Hot PATE / cold PATE).

Every step queries all teachers for the current prefix, samples one vote histogram (coordinated
or independent), and aggregates it with a DP aggregator. On FAIL the step is retried with fresh
randomness (charged) up to `max_retries` times, then the token comes from a public model (free:
it never reads sensitive data) or, without one, decoding stops. Decoding stops on EOS, on a stop
sequence (e.g. the tokens of a blank line) or at `max_new_tokens`.

Every aggregator call that ran is recorded in a `PrivacyLedger`; the reported ε is the ledger's
(data-independent composition over all steps and retries). For confident-GNMax the PATE 2018
data-dependent ε is reported as well.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Literal, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.pate import accounting, aggregators, samplers, smooth_sensitivity
from dpmix_jax.privacy import discrete_noise, randomness, validation

__all__ = [
    "GenerationConfig",
    "GenerationResult",
    "PublicModel",
    "Teachers",
    "generate",
    "make_step",
    "prepare_sampler",
    "public_candidates",
    "restrict_votes",
]


@runtime_checkable
class Teachers(Protocol):
    """An ensemble of n teachers over a vocabulary of V tokens (local models or an API)."""

    vocab_size: int

    @property
    def num_teachers(self) -> int: ...

    def __call__(self, prefix: Sequence[int]) -> jax.Array:
        """`(n, V)` next-token logits of every teacher after the shared `prefix`."""
        ...


PublicModel = Callable[[Sequence[int]], jax.Array]
"""A public (non-sensitive) model: prefix -> `(V,)` next-token logits."""

Aggregator = Literal["dpws", "dpargmax_laplace", "confident_gnmax"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """Settings of one private decoding run.

    Attributes:
        sampler: "coordinated" (hot) or "independent" (cold) vote histograms.
        temperature: teacher sampling temperature (also used for the public fallback).
        top_k: exact top-K fast path of the coordinated sampler (None = full scan).
        aggregator: "dpws", "dpargmax_laplace" or "confident_gnmax".
        epsilon: per-call ε of DPWS / DPARGMAX.
        delta: per-call δ of DPWS.
        gamma: DPWS's relevance factor γ.
        threshold: T (DPARGMAX, confident-GNMax; an extra keep threshold for DPWS).
        sigma1, sigma2: confident-GNMax's threshold and argmax noise.
        max_retries: retries of a failed step with fresh randomness (each one is charged).
        max_new_tokens: length limit.
        eos_id: end-of-sequence token (None: none).
        stop_sequences: decoding stops once the output ends with one of these token sequences.
        public_candidates: c: aggregate only the votes for the public model's c most likely
            next tokens, the other votes in one bucket whose release is a FAIL (None: the whole
            vocabulary). The candidates depend on the public model and the released prefix
            only; `generate` then needs the public model.
        public_fallback: a failed step takes the public model's token (when `generate` is
            given one); else decoding stops there.
        report_delta: the δ at which the run's ε is reported; with the per-call δ of every call
            the run may make it must stay below 1/n for the n teachers (each holds at least one
            sensitive unit), unless `allow_large_delta`; checked before any teacher is read.
        allow_large_delta: accept a total δ >= 1/n.
        release_order: for confident-GNMax, the Rényi order λ at which the sequence's
            data-dependent ε is released privately by smooth sensitivity (None: not released);
            fix it, and `release_noise_multiplier`, before looking at the data.
        release_noise_multiplier: σ_s of that release (noise = σ_s · smooth sensitivity).
        release_beta: its smoothness β < 1/(2λ) (None: 0.49/λ); `smooth_sensitivity.
            choose_release` picks (λ, β, σ_s) from public inputs.
        noise: "continuous" (float Laplace / Gaussian drawn by JAX) or "discrete": exact noise
            on the integer vote counts, drawn host-side with integer arithmetic only
            (`privacy.discrete_noise`): discrete Laplace of scale 2/ε for "dpws" and
            "dpargmax_laplace", discrete Gaussians of parameters σ1², σ2² for
            "confident_gnmax" (charged by their zCDP; no data-dependent analysis).
    """

    sampler: Literal["coordinated", "independent"] = "coordinated"
    temperature: float = 1.0
    top_k: int | None = None
    aggregator: Aggregator = "dpws"
    epsilon: float = 1.0
    delta: float = 1e-6
    gamma: float = 1.0
    threshold: float = 0.0
    sigma1: float = 1.0
    sigma2: float = 1.0
    max_retries: int = 0
    max_new_tokens: int = 32
    eos_id: int | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    public_candidates: int | None = None
    public_fallback: bool = True
    report_delta: float = 1e-5
    allow_large_delta: bool = False
    release_order: float | None = None
    release_noise_multiplier: float = 1.0
    release_beta: float | None = None
    noise: Literal["continuous", "discrete"] = "continuous"

    def __post_init__(self):
        if self.sampler not in ("coordinated", "independent"):
            raise ValueError(
                f"sampler must be 'coordinated' or 'independent', got {self.sampler!r}."
            )
        if self.aggregator not in ("dpws", "dpargmax_laplace", "confident_gnmax"):
            raise ValueError(
                "aggregator must be 'dpws', 'dpargmax_laplace' or 'confident_gnmax', "
                f"got {self.aggregator!r}."
            )
        validation.check_positive(self.temperature, "temperature")
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)
        validation.check_delta(self.report_delta, "report_delta")
        validation.check_positive(self.gamma, "gamma")
        validation.check_positive(self.sigma1, "sigma1")
        validation.check_positive(self.sigma2, "sigma2")
        if self.threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {self.threshold!r}.")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries!r}.")
        validation.check_steps(self.max_new_tokens, "max_new_tokens")
        if self.top_k is not None and self.sampler != "coordinated":
            raise ValueError("top_k applies to the coordinated sampler only.")
        if self.release_order is not None:
            if self.aggregator != "confident_gnmax":
                raise ValueError("release_order applies to the confident_gnmax aggregator only.")
            if not self.release_order > 1:
                raise ValueError(f"release_order must be > 1, got {self.release_order!r}.")
            if self.release_beta is not None and not 0 < self.release_beta < 0.5 / (
                self.release_order
            ):
                raise ValueError(
                    f"release_beta must be in (0, 1/(2·release_order)), got {self.release_beta!r}."
                )
        validation.check_positive(self.release_noise_multiplier, "release_noise_multiplier")
        if self.noise not in ("continuous", "discrete"):
            raise ValueError(f"noise must be 'continuous' or 'discrete', got {self.noise!r}.")
        if self.noise == "discrete" and self.aggregator == "confident_gnmax":
            if self.release_order is not None:
                raise ValueError(
                    "release_order (the data-dependent analysis) needs noise='continuous'."
                )
            discrete_noise.check_sigma2(self.sigma1**2, "sigma1**2")
            discrete_noise.check_sigma2(self.sigma2**2, "sigma2**2")
        elif self.noise == "discrete":
            accounting.discrete_laplace_scale(self.epsilon)  # 2/ε must be an int64 fraction
        if self.public_candidates is not None:
            validation.check_steps(self.public_candidates, "public_candidates")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence.")

    def charge(self) -> tuple:
        """(dp-accounting event, extra δ) of one aggregator call."""
        discrete = self.noise == "discrete"
        if self.aggregator == "dpws":
            event = accounting.dpws_discrete_event if discrete else accounting.dpws_event
            return event(self.epsilon), self.delta
        if self.aggregator == "dpargmax_laplace":
            if discrete:
                return accounting.dpargmax_discrete_laplace_event(self.epsilon), 0.0
            return accounting.dpargmax_laplace_event(self.epsilon), 0.0
        if discrete:
            return accounting.confident_gnmax_discrete_event(self.sigma1, self.sigma2), 0.0
        return accounting.confident_gnmax_event(self.sigma1, self.sigma2), 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationResult:
    """What a decoding run produced and what it cost.

    Attributes:
        tokens: the generated tokens (prompt excluded).
        sources: per token, "private" (released by the aggregator) or "public" (fallback).
        num_queries: aggregator calls that ran (steps plus retries), all charged.
        num_failed: calls that returned FAIL.
        stop_reason: "eos", "stop_sequence", "max_new_tokens" or "fail" (no public fallback).
        ledger: the privacy ledger (everything recorded in it, not only this sequence).
        epsilon: data-independent ε of everything in the ledger.
        delta: its δ (`report_delta` plus the δ charged per DPWS call).
        gnmax: for confident-GNMax, both PATE 2018 analyses of this sequence's queries
            (the data-dependent one is not itself private).
        released: with `release_order`, the sequence's data-dependent ε released privately
            (smooth sensitivity; its `epsilon` is publishable and includes its own cost). Its
            noise derives from the caller's key in a seeded run and is a new secret otherwise;
            its `seeded` is the run's.
        seeded: True when the caller gave the key (reproducible by anyone who knows it, so not
            private against them: `privacy.SEEDED_NOTE`); False for a secret key drawn here.
    """

    tokens: list[int]
    sources: list[str]
    num_queries: int
    num_failed: int
    stop_reason: str
    ledger: accounting.PateLedger
    epsilon: float
    delta: float
    seeded: bool
    gnmax: accounting.GNMaxReport | None = None
    released: smooth_sensitivity.SmoothRelease | None = None

    @property
    def fallback_fraction(self) -> float:
        """Fraction of generated tokens that came from the public model."""
        return self.sources.count("public") / max(len(self.sources), 1)

    @property
    def yield_rate(self) -> float:
        """Fraction of aggregator calls that released a token."""
        return 1.0 - self.num_failed / max(self.num_queries, 1)


@functools.lru_cache(maxsize=32)
def make_step(config: GenerationConfig) -> Callable[..., tuple]:
    """`(key, draw, candidates=None) -> (token or FAIL, histogram)` for one query, where
    `draw = prepare_sampler(config, logits)` is set up once per decoding step and shared by
    its retries (jitted parts). With `candidates` (`(c,)` token ids) the aggregator reads
    `restrict_votes(histogram, candidates)` and a release of its last bucket is a FAIL.

    Privacy:
        The histogram it returns (what the aggregator read) is sensitive: used only for the
        data-dependent analysis.
    """
    if config.aggregator == "dpws":
        aggregate = functools.partial(
            aggregators.dpws,
            epsilon=config.epsilon,
            delta=config.delta,
            gamma=config.gamma,
            threshold=config.threshold,
        )
    elif config.aggregator == "dpargmax_laplace":
        aggregate = functools.partial(
            aggregators.dpargmax_laplace, threshold=config.threshold, epsilon=config.epsilon
        )
    else:
        aggregate = functools.partial(
            aggregators.confident_gnmax,
            threshold=config.threshold,
            sigma1=config.sigma1,
            sigma2=config.sigma2,
        )

    aggregate = jax.jit(aggregate)

    def step(key, draw, candidates=None):
        key_hist, key_agg = jax.random.split(key)
        histogram = draw(key_hist, 1)[0]
        if candidates is not None:
            histogram = restrict_votes(histogram, candidates)
        if config.noise == "discrete":
            key_agg, key_noise = jax.random.split(key_agg)
            noise = _discrete_noise(config, key_noise, histogram.shape[0])
            token = aggregate(key_agg, histogram, noise=noise)
        else:
            token = aggregate(key_agg, histogram)
        if candidates is not None:
            token = _candidate_token(token, candidates)
        return token, histogram

    return step


@jax.jit
def restrict_votes(histogram: jax.Array, candidates: jax.Array) -> jax.Array:
    """`(c + 1,)`: the votes for each of the `(c,)` distinct candidate ids, then every other
    vote in one bucket (the counts still sum to n).

    Under the vote-move relation (one teacher's vote moves from one token to another) the
    restricted histogram also changes in at most two counts, by one each: every aggregator's
    analysis holds unchanged.

    Privacy:
        Reads the (sensitive) histogram; the result goes only to a DP aggregator.
    """
    chosen = histogram[candidates]
    return jnp.concatenate([chosen, (jnp.sum(histogram) - jnp.sum(chosen))[None]])


@jax.jit
def _candidate_token(index: jax.Array, candidates: jax.Array) -> jax.Array:
    """The token id of an aggregator's output over `restrict_votes`' buckets; the others'
    bucket, like a FAIL, is a FAIL (post-processing)."""
    inside = (index >= 0) & (index < candidates.shape[0])
    return jnp.where(inside, candidates[jnp.clip(index, 0)], aggregators.FAIL).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="count")
def public_candidates(public_logits: jax.Array, count: int) -> jax.Array:
    """The `count` ids of the largest public logits (ties to the smallest id).

    Privacy: reads only the public model's output.
    """
    return jax.lax.top_k(public_logits.astype(jnp.float32), count)[1].astype(jnp.int32)


def _discrete_noise(config: GenerationConfig, key: jax.Array, size: int):
    """The exact integer noise of one aggregator call on `size` counts, drawn host-side by a
    numpy Generator seeded with 128 bits of `key`: discrete Laplace of scale 2/ε (`(size,)`),
    or for confident-GNMax the discrete Gaussian pair (check `()`, argmax `(size,)`).

    Privacy: as secret as `key` (a secret key in an unseeded run).
    """
    words = np.asarray(jax.random.bits(key, (4,), jnp.uint32))
    rng = np.random.default_rng([int(w) for w in words])
    if config.aggregator == "confident_gnmax":
        check = discrete_noise.discrete_gaussian((), config.sigma1**2, rng)
        argmax = discrete_noise.discrete_gaussian(size, config.sigma2**2, rng)
        return jnp.asarray(check, jnp.int32), jnp.asarray(argmax, jnp.int32)
    scale = accounting.discrete_laplace_scale(config.epsilon)
    return jnp.asarray(discrete_noise.discrete_laplace(size, scale, rng), jnp.int32)


def prepare_sampler(config: GenerationConfig, logits: jax.Array) -> samplers.Draw:
    """The configured histogram sampler with its per-logits set-up done (once per step).

    Privacy:
        Reads the teachers' logits (sensitive); its histograms go only to the DP aggregator.
    """
    if config.sampler == "coordinated":
        return samplers.coordinated_sampler(
            logits, temperature=config.temperature, top_k=config.top_k
        )
    return samplers.independent_sampler(logits, temperature=config.temperature)


def generate(
    teachers: Teachers,
    prompt: Sequence[int],
    config: GenerationConfig,
    *,
    key: jax.Array | None = None,
    public_model: PublicModel | None = None,
    ledger: accounting.PateLedger | None = None,
) -> GenerationResult:
    """Decodes one sequence privately from the teacher ensemble.

    Args:
        teachers: the ensemble (`Teachers` protocol).
        prompt: the public prefix shared by all teachers (may be empty).
        config: decoding and privacy settings.
        key: PRNG key of the sampler and the aggregator noise; None (default) draws a secret one
            from the operating system for every call. A key from a known seed makes the output
            reproducible and not private against anyone who knows the seed. Never log it.
        public_model: the public model (free: it never reads sensitive data): the fallback of
            failed steps when `config.public_fallback`, and the source of the candidates with
            `config.public_candidates` (required then).
        ledger: a ledger to append to (e.g. across several sequences); a new one by default.

    Returns:
        A `GenerationResult`; its ε covers everything recorded in the ledger.

    Privacy:
        Reads the teachers (sensitive) only through the DP aggregator; every call is recorded in
        the ledger, retries included. Public fallback tokens read no sensitive data and are free.
    """
    if not isinstance(teachers, Teachers):
        raise ValueError("teachers must implement the Teachers protocol.")
    if config.public_candidates is not None:
        if public_model is None:
            raise ValueError("public_candidates needs a public_model to draw them from.")
        if not config.public_candidates < teachers.vocab_size:
            raise ValueError(
                f"public_candidates must be below the vocabulary's {teachers.vocab_size} "
                f"tokens, got {config.public_candidates}."
            )
    fallback = public_model if config.public_fallback else None
    ledger = accounting.PateLedger() if ledger is None else ledger
    seeded = key is not None
    key = key if seeded else randomness.prng_key(randomness.secret_seed())
    step = make_step(config)
    event, call_delta = config.charge()
    most_calls = config.max_new_tokens * (config.max_retries + 1)
    validation.check_delta_for_units(
        config.report_delta + ledger.extra_delta + most_calls * call_delta,
        teachers.num_teachers,
        unit="teachers (each holds at least one sensitive unit)",
        name="the run's total δ (report_delta plus the per-call δ of every possible call)",
        allow_large_delta=config.allow_large_delta,
    )
    prefix = [int(t) for t in prompt]
    tokens: list[int] = []
    sources: list[str] = []
    histograms, answered = [], []
    num_queries = num_failed = 0
    stop_reason = "max_new_tokens"
    while len(tokens) < config.max_new_tokens:
        public_logits = candidates = None
        if config.public_candidates is not None:
            public_logits = jnp.asarray(public_model(prefix + tokens), jnp.float32)
            candidates = public_candidates(public_logits, config.public_candidates)
        draw = prepare_sampler(config, teachers(prefix + tokens))  # shared by the retries
        token = aggregators.FAIL
        for _ in range(config.max_retries + 1):
            key, sub = jax.random.split(key)
            token, histogram = step(sub, draw, candidates)
            token = int(token)
            ledger.record(event, delta=call_delta)
            num_queries += 1
            num_failed += token == aggregators.FAIL
            if config.aggregator == "confident_gnmax" and config.noise == "continuous":
                histograms.append(np.asarray(histogram))
                answered.append(token != aggregators.FAIL)
            if token != aggregators.FAIL:
                break
        if token != aggregators.FAIL:
            sources.append("private")
        elif fallback is not None:
            key, sub = jax.random.split(key)
            if public_logits is None:
                public_logits = jnp.asarray(fallback(prefix + tokens), jnp.float32)
            token = int(jax.random.categorical(sub, public_logits / config.temperature))
            sources.append("public")
        else:
            stop_reason = "fail"
            break
        tokens.append(token)
        if config.eos_id is not None and token == config.eos_id:
            stop_reason = "eos"
            break
        if any(tuple(tokens[-len(s) :]) == tuple(s) for s in config.stop_sequences):
            stop_reason = "stop_sequence"
            break
    gnmax = released = None
    if histograms:
        gnmax = accounting.confident_gnmax_report(
            np.stack(histograms),
            np.array(answered),
            threshold=config.threshold,
            sigma1=config.sigma1,
            sigma2=config.sigma2,
            delta=config.report_delta,
        )
    if histograms and config.release_order is not None:
        release_seed = None  # a secret run's release noise: a new secret from the OS
        if seeded:
            words = np.asarray(jax.random.bits(jax.random.fold_in(key, 1), (4,), jnp.uint32))
            release_seed = sum(int(w) << (32 * i) for i, w in enumerate(words))
        released = smooth_sensitivity.release_data_dependent_epsilon(
            np.stack(histograms),
            np.array(answered),
            threshold=config.threshold,
            sigma1=config.sigma1,
            sigma2=config.sigma2,
            order=config.release_order,
            noise_multiplier=config.release_noise_multiplier,
            beta=config.release_beta,
            delta=config.report_delta,
            seed=release_seed,
        )
    budget = ledger.budget(config.report_delta)
    return GenerationResult(
        tokens=tokens,
        sources=sources,
        num_queries=num_queries,
        num_failed=num_failed,
        stop_reason=stop_reason,
        ledger=ledger,
        epsilon=budget.epsilon,
        delta=budget.delta,
        seeded=seeded,
        gnmax=gnmax,
        released=released,
    )
