"""Private prediction with clipped logits and a sparse-vector test (Amin et al. 2024).

K. Amin, A. Bie, W. Kong, A. Kurakin, N. Ponomareva, U. Syed, A. Terzis, S. Vassilvitskii,
"Private prediction for large-scale synthetic text generation", Findings of EMNLP 2024
(arXiv 2407.12108), Algorithm 1 and Theorem 1, on our teachers: the n teacher rows play the
paper's batch of s sensitive prompts (s = n), the public model its public prompt.

Per token (Algorithm 1, lines 9-18):

* Sparse-vector test. d = ‖(1/n) Σ_i softmax(z_i) - softmax(z_pub)‖₁ (Eq. 2: raw teacher
  logits z_i, temperature 1) gets Laplace(2σ) noise and is compared with a noisy threshold
  θ̂ = θ + Laplace(σ), drawn at the start and again after every private token. If d̂ >= θ̂ the
  token is private, otherwise it is drawn from softmax(z_pub / τ_public).
* Private token. Each row is clipped with recentering, clip_c(z)_i = max(-c, z_i - max_j z_j + c)
  (Eq. 1, values in [-c, c], row maximum at c), the rows are averaged, and the token is drawn
  from softmax(z̄ / τ): the exponential mechanism with score z̄ / τ.
* A text holds at most r private tokens (the paper's private-token counter t < r): decoding
  stops after the r-th, with stop reason "private_token_budget". Without the test
  (`threshold=None`, the paper's θ = -∞ setting) every token is private.

Taken from the paper: Eq. 1, Eq. 2, the noise scales σ and 2σ, redrawing θ̂ after each private
token, the cap of r private tokens, the composition of Theorem 1 (exponential mechanism plus one
sparse-vector run per private token, in zCDP) and its defaults c = 10, θ = 0.5, σ = 0.2
(Table 7). Taken from the public re-implementation (InvisibleInk-Experiments,
`generate_amin.py`), where the paper gives no rule: `calibrate` fixes σ, τ and r, charges the
sparse-vector test first and gives the clip bound c the rest of the budget; decoding one text
ends at the r-th private token. The paper's top-k restriction of the vocabulary (used at
τ = 2.25 only) is not implemented.

Neighbouring relation: one unit is one teacher row, which may change arbitrarily (replace-one;
the paper analyses add/remove of one prompt with the expected batch size s fixed, which halves
both sensitivities below).

Sensitivity:

* Exponential mechanism. Rows clip into [-c, c], so replacing one row moves each coordinate of
  z̄ by (x - x')_y / n with (x - x')_y in [-2c, 2c]; the score's range of change across tokens is
  at most 4c / (nτ) (attained: x = (c, -c, ...), x' = (-c, c, ...)). The exponential mechanism
  is then η-bounded-range with η = 4c / (nτ), hence η²/8 = 2 (c / (nτ))²-zCDP (Cesar and Rogers
  2021, the analysis the paper's Lemma 4 uses; the paper's add/remove value is (1/2)(c/(sτ))²).
* Sparse-vector test. Replacing one row moves (1/n) Σ softmax(z_i) by (p - p') / n, of L1 norm
  at most 2/n, so d has sensitivity Δ = 2/n (the paper's Lemma 3 gives 1/s for add/remove).
  Each run of the test up to its first private token is AboveThreshold with threshold noise
  Laplace(2Δ/ε) and query noise Laplace(4Δ/ε), ε-DP for adaptively chosen queries (Dwork and
  Roth 2014, Theorem 3.23; Lyu, Su and Li 2017, Algorithm 1), here with ε = 2Δ/σ = 4/(nσ), and
  ε-DP implies ε²/2-zCDP (Bun and Steinke 2016, Proposition 3.3), as in the paper's Lemma 5.

Accounting: every private token is one `ZCDpEvent` of the exponential mechanism; every run of
the sparse-vector test that made at least one query is one `ZCDpEvent` of ε²/2 (one per private
token, plus the run still open when the text ended with public tokens). Public tokens cost
nothing beyond the run they belong to. ε at δ is dp-accounting's RDP conversion of the composed
events (`dpmix_jax.privacy.accounting.epsilon`, accountant "rdp"; the PLD accountant takes no
zCDP events), at least as tight as the paper's Theorem 1 bound ε = ρ + √(4ρ log(1/δ)). The worst
case of a configuration is min(r, max_new_tokens) private tokens and as many runs.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence

import dp_accounting
import jax
import jax.numpy as jnp

from dpmix_jax.pate.generation import PublicModel, Teachers
from dpmix_jax.pate.method import Plan, RunSettings, Spent
from dpmix_jax.pate.peers import decoding, peer_method
from dpmix_jax.pate.peers.result import PeerResult
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import randomness, validation

__all__ = [
    "METHOD",
    "AminConfig",
    "AminMethod",
    "calibrate",
    "clip_logits",
    "distance",
    "dp_event",
    "draw_threshold",
    "em_rho",
    "epsilon",
    "generate",
    "step",
    "svt_epsilon",
    "svt_noise_for",
    "worst_case_charges",
    "worst_case_counts",
    "worst_case_epsilon",
]

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


@dataclasses.dataclass(frozen=True, kw_only=True)
class AminConfig:
    """Settings of one decoding run.

    Attributes:
        num_teachers: n, the teacher rows averaged (the paper's batch size s).
        max_new_tokens: length limit of a text.
        max_private_tokens: r, the most private tokens one text may hold.
        clip_bound: c, the clipping range [-c, c] of Eq. 1.
        temperature: τ of the private softmax (the exponential mechanism).
        public_temperature: τ_public of public tokens.
        threshold: θ of the sparse-vector test; None disables the test (every token private).
        svt_noise: σ: the threshold gets Laplace(σ) noise and the distance Laplace(2σ); None
            exactly when `threshold` is None.
        delta: the δ at which a run's ε is reported; below 1/n (each teacher holds at least one
            sensitive unit) unless `allow_large_delta`.
        allow_large_delta: accept δ >= 1/n.
    """

    num_teachers: int
    max_new_tokens: int
    max_private_tokens: int
    clip_bound: float = 10.0
    temperature: float = 1.0
    public_temperature: float = 1.0
    threshold: float | None = 0.5
    svt_noise: float | None = 0.2
    delta: float = 1e-6
    allow_large_delta: bool = False

    def __post_init__(self):
        validation.check_steps(self.num_teachers, "num_teachers")
        validation.check_steps(self.max_new_tokens, "max_new_tokens")
        validation.check_steps(self.max_private_tokens, "max_private_tokens")
        validation.check_positive(self.clip_bound, "clip_bound")
        validation.check_positive(self.temperature, "temperature")
        validation.check_positive(self.public_temperature, "public_temperature")
        if (self.threshold is None) != (self.svt_noise is None):
            raise ValueError(
                "threshold and svt_noise must both be set (sparse-vector test) or both be None "
                f"(every token private), got threshold={self.threshold!r}, "
                f"svt_noise={self.svt_noise!r}."
            )
        if self.threshold is not None:
            if not _is_finite_number(self.threshold):
                raise ValueError(f"threshold must be a finite number, got {self.threshold!r}.")
            validation.check_positive(self.svt_noise, "svt_noise")
        validation.check_delta_for_units(
            self.delta,
            self.num_teachers,
            unit="teachers (each holds at least one sensitive unit)",
            allow_large_delta=self.allow_large_delta,
        )

    @property
    def uses_sparse_vector(self) -> bool:
        """Whether tokens may come from the public model after a sparse-vector test."""
        return self.threshold is not None


def _is_finite_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def em_rho(config: AminConfig) -> float:
    """zCDP ρ of one private token: η²/8 with η = 4c/(nτ), i.e. 2 (c / (nτ))²."""
    return 2.0 * (config.clip_bound / (config.num_teachers * config.temperature)) ** 2


def svt_epsilon(config: AminConfig) -> float:
    """Pure ε of one sparse-vector run: 2Δ/σ with Δ = 2/n, i.e. 4/(nσ); 0 without the test."""
    if not config.uses_sparse_vector:
        return 0.0
    return 4.0 / (config.num_teachers * config.svt_noise)


def worst_case_counts(config: AminConfig) -> tuple[int, int]:
    """(private tokens, sparse-vector runs) of the costliest run the configuration allows."""
    most = min(config.max_private_tokens, config.max_new_tokens)
    return most, most if config.uses_sparse_vector else 0


def worst_case_charges(config: AminConfig) -> dict[str, int]:
    """`worst_case_counts` as the keyword arguments of `epsilon` and `dp_event`."""
    private_tokens, svt_runs = worst_case_counts(config)
    return {"private_tokens": private_tokens, "svt_runs": svt_runs}


def dp_event(config: AminConfig, *, private_tokens: int, svt_runs: int) -> dp_accounting.DpEvent:
    """The event of `private_tokens` exponential mechanisms and `svt_runs` sparse-vector runs.

    Returns:
        A `ComposedDpEvent` of self-composed `ZCDpEvent`s (exponential mechanism: `em_rho`;
        sparse-vector run: ε²/2 with ε = `svt_epsilon`), or `NoOpDpEvent` when nothing ran.
    """
    if private_tokens < 0 or svt_runs < 0:
        raise ValueError(
            f"private_tokens and svt_runs must be >= 0, got {private_tokens}, {svt_runs}."
        )
    if svt_runs and not config.uses_sparse_vector:
        raise ValueError(f"svt_runs must be 0 without the sparse-vector test, got {svt_runs}.")
    parts = []
    if private_tokens:
        em = dp_accounting.ZCDpEvent(em_rho(config))
        parts.append(dp_accounting.SelfComposedDpEvent(em, private_tokens))
    if svt_runs:
        svt = dp_accounting.ZCDpEvent(svt_epsilon(config) ** 2 / 2)
        parts.append(dp_accounting.SelfComposedDpEvent(svt, svt_runs))
    return dp_accounting.ComposedDpEvent(parts) if parts else dp_accounting.NoOpDpEvent()


def epsilon(config: AminConfig, *, private_tokens: int, svt_runs: int, delta: float) -> float:
    """ε at `delta` of a run with these counts (dp-accounting RDP of `dp_event`)."""
    return _rdp_epsilon(dp_event(config, private_tokens=private_tokens, svt_runs=svt_runs), delta)


def worst_case_epsilon(config: AminConfig) -> float:
    """ε at `config.delta` of the costliest run the configuration allows (`worst_case_counts`)."""
    tokens, runs = worst_case_counts(config)
    return _rdp_epsilon(dp_event(config, private_tokens=tokens, svt_runs=runs), config.delta)


def _rdp_epsilon(event: dp_accounting.DpEvent, delta: float) -> float:
    return privacy.epsilon(event, delta=delta, accountant="rdp", neighboring_relation=REPLACE_ONE)


def calibrate(
    *,
    epsilon: float,
    delta: float,
    max_new_tokens: int,
    num_teachers: int,
    max_private_tokens: int | None = None,
    temperature: float = 1.0,
    public_temperature: float = 1.0,
    threshold: float | None = 0.5,
    svt_noise: float | None = 0.2,
    relative_tolerance: float = 1e-4,
    allow_large_delta: bool = False,
) -> AminConfig:
    """The largest clip bound c whose worst-case run costs at most (`epsilon`, `delta`).

    The sparse-vector test's cost is fixed by σ = `svt_noise` and is charged first; c takes the
    rest (the rule of the public re-implementation; the paper fixes c and reports ε).

    Args:
        epsilon, delta: the target guarantee.
        max_new_tokens: length limit of a text.
        num_teachers: n.
        max_private_tokens: r (None: `max_new_tokens`).
        temperature, public_temperature, threshold, svt_noise: as in `AminConfig`.
        relative_tolerance: c is within this relative distance of the largest feasible one.
        allow_large_delta: as in `AminConfig`.

    Raises:
        ValueError: invalid settings, or a sparse-vector test that alone exceeds the target.
    """
    epsilon = validation.check_epsilon(epsilon)
    relative_tolerance = validation.check_positive(relative_tolerance, "relative_tolerance")

    def config_with(clip_bound: float) -> AminConfig:
        return AminConfig(
            num_teachers=num_teachers,
            max_new_tokens=max_new_tokens,
            max_private_tokens=max_new_tokens if max_private_tokens is None else max_private_tokens,
            clip_bound=clip_bound,
            temperature=temperature,
            public_temperature=public_temperature,
            threshold=threshold,
            svt_noise=svt_noise,
            delta=delta,
            allow_large_delta=allow_large_delta,
        )

    probe = config_with(1.0)
    runs = worst_case_counts(probe)[1]
    svt_alone = _rdp_epsilon(dp_event(probe, private_tokens=0, svt_runs=runs), delta)
    if svt_alone >= epsilon:
        raise ValueError(
            f"the sparse-vector test alone costs ε = {svt_alone:.4g} over {runs} runs "
            f"(σ = {svt_noise}, n = {num_teachers}), at least the target {epsilon:g}: raise "
            "svt_noise, num_teachers or epsilon, or lower max_private_tokens."
        )
    low, high = 0.0, 1.0
    while worst_case_epsilon(config_with(high)) <= epsilon:
        low, high = high, 2.0 * high
    while high - low > relative_tolerance * high:
        middle = (low + high) / 2
        feasible = worst_case_epsilon(config_with(middle)) <= epsilon
        low, high = (middle, high) if feasible else (low, middle)
    return config_with(low)


def svt_noise_for(*, epsilon: float, delta: float, runs: int, num_teachers: int) -> float:
    """The noise σ at which `runs` sparse-vector runs alone cost `epsilon` at `delta`.

    Each run is ε_run = 4/(nσ)-DP, charged ρ = ε_run²/2-zCDP (`svt_epsilon`), so σ follows from
    the largest ρ whose `runs`-fold composition costs at most `epsilon` at `delta` (bisection).
    `calibrate(..., svt_noise=svt_noise_for(epsilon=share · ε, ...))` gives the test that share
    of the budget and the clip bound the rest.

    Privacy: reads no data; the result depends on public settings only.
    """
    epsilon = validation.check_epsilon(epsilon)
    runs = validation.check_steps(runs, "runs")
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, int) or num_teachers < 2:
        raise ValueError(f"num_teachers must be an integer >= 2, got {num_teachers!r}.")

    def cost(rho: float) -> float:
        return _rdp_epsilon(
            dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(rho), runs), delta
        )

    low, high = 0.0, 1.0
    while cost(high) <= epsilon:
        low, high = high, 2.0 * high
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cost(middle) <= epsilon else (low, middle)
    per_run = math.sqrt(2.0 * low)  # ε_run of the runs' zCDP ρ = ε_run²/2 each
    return 4.0 / (num_teachers * per_run)


def clip_logits(logits: jax.Array, clip_bound: float | jax.Array) -> jax.Array:
    """Eq. 1 on the last axis: max(-c, z - max z + c), in [-c, c] with the maximum at c.

    Privacy: applied to each teacher row separately; bounds what one row can move.
    """
    return jnp.maximum(-clip_bound, logits - jnp.max(logits, axis=-1, keepdims=True) + clip_bound)


def distance(teacher_logits: jax.Array, public_logits: jax.Array) -> jax.Array:
    """Eq. 2: ‖(1/n) Σ_i softmax(z_i) - softmax(z_pub)‖₁.

    Privacy: reads the teachers; sensitivity 2/n under replacing one row. Released only
    through the noisy comparison of `step`.
    """
    mean = jnp.mean(jax.nn.softmax(teacher_logits, axis=-1), axis=0)
    return jnp.sum(jnp.abs(mean - jax.nn.softmax(public_logits)))


@jax.jit
def draw_threshold(
    key: jax.Array, threshold: float | jax.Array, svt_noise: float | jax.Array
) -> jax.Array:
    """A noisy threshold θ + Laplace(σ) (with θ = -∞, σ = 0: -∞, no test)."""
    return threshold + svt_noise * jax.random.laplace(key)


@jax.jit
def step(
    key: jax.Array,
    teacher_logits: jax.Array,
    public_logits: jax.Array,
    noisy_threshold: jax.Array,
    *,
    clip_bound: float | jax.Array,
    temperature: float | jax.Array,
    public_temperature: float | jax.Array,
    threshold: float | jax.Array,
    svt_noise: float | jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token of Algorithm 1 (lines 9-18).

    Args:
        key: PRNG key of this step.
        teacher_logits: `(n, V)` teacher logits.
        public_logits: `(V,)` public-model logits.
        noisy_threshold: the current θ̂ (`draw_threshold`).
        clip_bound, temperature, public_temperature, threshold, svt_noise: c, τ, τ_public, θ,
            σ (θ = -∞ and σ = 0 make every token private).

    Returns:
        (token, whether it is private, the next θ̂: redrawn after a private token).

    Privacy: reads the teachers only through the noisy comparison (a sparse-vector query) and
    the clipped-average exponential mechanism; charge a private token `em_rho` and each run of
    the test up to its first private token `svt_epsilon`.
    """
    query_key, private_key, public_key, threshold_key = jax.random.split(key, 4)
    noisy_distance = distance(teacher_logits, public_logits) + 2 * svt_noise * (
        jax.random.laplace(query_key)
    )
    is_private = noisy_distance >= noisy_threshold
    averaged = jnp.mean(clip_logits(teacher_logits, clip_bound), axis=0)
    private_token = jax.random.categorical(private_key, averaged / temperature)
    public_token = jax.random.categorical(public_key, public_logits / public_temperature)
    token = jnp.where(is_private, private_token, public_token)
    next_threshold = jnp.where(
        is_private, draw_threshold(threshold_key, threshold, svt_noise), noisy_threshold
    )
    return token, is_private, next_threshold


def generate(
    teachers: Teachers,
    public_model: PublicModel | None,
    *,
    prompt: Sequence[int],
    config: AminConfig,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> PeerResult:
    """Decodes one text with Algorithm 1.

    Decoding stops on `eos_id`, on a stop sequence, at `config.max_new_tokens`, or right after
    the r-th private token ("private_token_budget").

    Args:
        teachers: the ensemble; `teachers.num_teachers` must equal `config.num_teachers`.
        public_model: prefix -> `(V,)` logits; only read with the sparse-vector test (may be
            None without it).
        prompt: the shared public prefix.
        config: the settings (`calibrate`).
        key: PRNG key; None draws a secret one. A known key makes the text reproducible by
            whoever knows it.
        eos_id: end-of-sequence token, or None.
        stop_sequences: token sequences that end decoding once the output ends with one.

    Returns:
        A `PeerResult`. Every step reads the teachers (the test's distance needs them), so
        `teacher_forward_passes` is n per step, private or public.

    Privacy: charges each private token `em_rho` and each sparse-vector run that made a query
    ε²/2 with ε = `svt_epsilon` (`dp_event`); public tokens are covered by their run.
    """
    decoding.check_teachers(teachers, config.num_teachers)
    if config.uses_sparse_vector and public_model is None:
        raise ValueError("the sparse-vector test needs a public_model.")
    stop_sequences = [tuple(int(t) for t in s) for s in stop_sequences]
    if any(not s for s in stop_sequences):
        raise ValueError("stop_sequences must not contain an empty sequence.")
    seeded = key is not None
    key = key if seeded else randomness.prng_key(randomness.secret_seed())
    threshold = config.threshold if config.uses_sparse_vector else -math.inf
    svt_noise = config.svt_noise if config.uses_sparse_vector else 0.0
    key, threshold_key = jax.random.split(key)
    noisy_threshold = draw_threshold(threshold_key, threshold, svt_noise)
    public_logits = jnp.zeros((teachers.vocab_size,), jnp.float32)
    prefix = [int(t) for t in prompt]
    tokens: list[int] = []
    sources: list[str] = []
    private_tokens = svt_runs = public_passes = 0
    run_open = False
    stop_reason = "max_new_tokens"
    while len(tokens) < config.max_new_tokens:
        teacher_logits = jnp.asarray(teachers(prefix + tokens), jnp.float32)
        if config.uses_sparse_vector:
            public_logits = jnp.asarray(public_model(prefix + tokens), jnp.float32)
            public_passes += 1
            if not run_open:
                svt_runs += 1
                run_open = True
        key, step_key = jax.random.split(key)
        token, is_private, noisy_threshold = step(
            step_key,
            teacher_logits,
            public_logits,
            noisy_threshold,
            clip_bound=config.clip_bound,
            temperature=config.temperature,
            public_temperature=config.public_temperature,
            threshold=threshold,
            svt_noise=svt_noise,
        )
        tokens.append(int(token))
        if bool(is_private):
            sources.append("private")
            private_tokens += 1
            run_open = False
        else:
            sources.append("public")
        if eos_id is not None and tokens[-1] == eos_id:
            stop_reason = "eos"
            break
        if any(tuple(tokens[-len(s) :]) == s for s in stop_sequences):
            stop_reason = "stop_sequence"
            break
        if private_tokens >= config.max_private_tokens:
            stop_reason = "private_token_budget"
            break
    event = dp_event(config, private_tokens=private_tokens, svt_runs=svt_runs)
    return PeerResult(
        tokens=tokens,
        sources=sources,
        stop_reason=stop_reason,
        event=event,
        charges={"private_tokens": private_tokens, "svt_runs": svt_runs},
        epsilon=epsilon(
            config, private_tokens=private_tokens, svt_runs=svt_runs, delta=config.delta
        ),
        delta=config.delta,
        teacher_forward_passes=len(tokens) * config.num_teachers,
        public_forward_passes=public_passes,
        seeded=seeded,
    )


class AminMethod:
    """Amin et al. 2024 as a `pate.method.Method` (`peer_method`: calibrated for all of a run's
    texts at full length, charged the private tokens and sparse-vector tests that ran)."""

    name = "amin"
    label = "Amin et al. 2024"

    def calibrate(self, run: RunSettings) -> Plan:
        """`calibrate` for `run.worst_case_tokens` tokens on the run's teachers; the
        sparse-vector test gets half of the budget (`svt_noise_for`) and the clip bound the
        rest.

        Privacy:
            Public: a function of public settings only.
        """
        svt_noise = svt_noise_for(
            epsilon=run.epsilon / 2,
            delta=run.delta,
            runs=run.worst_case_tokens,
            num_teachers=run.num_teachers,
        )
        config = calibrate(
            epsilon=run.epsilon,
            delta=run.delta,
            max_new_tokens=run.worst_case_tokens,
            num_teachers=run.num_teachers,
            temperature=run.temperature,
            svt_noise=svt_noise,
            allow_large_delta=run.allow_large_delta,
        )
        return peer_method.plan(self.name, run, config, epsilon, worst_case_charges(config))

    def generate(
        self,
        plan: Plan,
        teachers: Teachers,
        public_model: PublicModel,
        *,
        prompt: Sequence[int],
        key: jax.Array | None,
    ) -> list[PeerResult]:
        """Every text of the run, each by `generate` with the run's `max_new_tokens` as its
        length limit and its private-token budget.

        Privacy:
            Reads the teachers only through `step`.
        """
        length = plan.run.max_new_tokens
        text_config = dataclasses.replace(
            plan.config, max_new_tokens=length, max_private_tokens=length
        )
        return peer_method.decode_texts(
            generate, text_config, plan.run, teachers, public_model, prompt=prompt, key=key
        )

    def charge(self, plan: Plan, samples: Sequence[PeerResult]) -> Spent:
        """`epsilon` of every private token and sparse-vector test that ran
        (`peer_method.charge`).

        Privacy:
            Reads the texts' charges only.
        """
        return peer_method.charge(plan, samples, epsilon)


METHOD = AminMethod()
