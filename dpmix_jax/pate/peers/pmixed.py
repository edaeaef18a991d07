"""PMixED: private mixing of ensemble distributions (Flemings, Razaviyayn and Annavaram,
"Differentially Private Next-Token Prediction of Large Language Models", NAACL 2024).

Per generated token: every teacher is kept independently with probability q (Poisson
subsampling); each kept teacher's next-token distribution p_i is pulled towards the public
model's p0 as p̄_i = λ_i p_i + (1 - λ_i) p0 with the largest λ_i in [0, 1] that keeps p̄_i in a
Rényi ball around p0 (found by bisection, all teachers at once); the p̄_i are averaged (p0 alone
when no teacher is kept) and one token is sampled from the average. No noise is added: the
sampling is the randomness.

Neighbouring relation: one sensitive unit is one teacher row, which may change arbitrarily
(every teacher is trained on a disjoint part of the data, so one record changes one teacher);
the public model and the shared prefix are public.

The ball. The paper projects onto {p̄ : D_α(p̄‖p0) ≤ αβ and D_α(p0‖p̄) ≤ αβ} and bounds two
members of the ball by D_α(p̄‖p̄') ≤ 4αβ (in its PMixED privacy theorem, via the triangle
inequality of zero-concentrated DP). That inequality needs the ball at orders above α, which a
constraint at order α alone does not give: with public mass ε0 on one token, a teacher that puts
all its mass there and one that puts none reach a D_α(p̄‖p̄') that grows like log(1/ε0)/(α-1),
without bound (V = 2, α = 2, β = 0.05, ε0 = 1e-8, four teachers, the other three also putting
all their mass on the other token, no subsampling: D_α between the two ensembles' outputs is
11.1 nats, against the 0.116 that theorem charges). Here the ball is taken at the orders the
triangle inequality uses, with the paper's radius per unit of order β:

    B = {p̄ : D_{2α}(p̄‖p0) ≤ 2αβ and D_{2α-1}(p0‖p̄) ≤ (2α-1)β},

so that (Mironov 2017, "Rényi differential privacy", Proposition 11 with p = q = 2) any two
members satisfy D_α(p̄‖p̄') ≤ (α - 1/2)/(α - 1) · 2αβ + (2α - 1)β = (2α - 1)²β/(α - 1) =: D.

Per-token privacy (order α). For neighbours differing in teacher j, condition on which other
teachers are kept (S', public randomness independent of the data). With m - 1 = |S'| of them, the
output is (1 - q/m) A + (q/m) p̄_j, where A is the average of the kept others (p0 when none), and
the neighbour's is the same with p̄'_j. The map (P, Q) ↦ Σ P^α Q^{1-α} is jointly convex for
α > 1, so averaging over S' and over the two cases gives

    e^{(α-1) ε_token} ≤ 1 + w (e^{(α-1) D} - 1),   w = E[q / (1 + Bin(n - 1, q))] = (1 - (1-q)^n)/n.

The paper instead charges the Poisson-subsampling bound of Zhu and Wang (2019) on per-size
losses that use 4kβ; the quadratic gain in q of that bound is not carried over here: this bound
is linear in w and equals the paper's size-n bound (with D for 4αβ) when q = 1.

Accounting: the tokens compose additively in RDP at the single order α; the total is converted
to (ε, δ) by `dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon` (the conversion of
Canonne, Kamath and Steinke 2020 that dp-accounting's RDP accountant uses). dp-accounting has no
event for a custom RDP curve, so the run's `dp_event` records its token count only.
`calibrate` fixes α from `ORDERS` (as the paper treats α as a fixed hyperparameter) and β in
closed form so that max_new_tokens tokens cost exactly the target ε, picking the α with the
largest β (β sets how far a teacher may move away from p0 in every order).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import dp_accounting
import jax
import jax.numpy as jnp
from dp_accounting.rdp import rdp_privacy_accountant

from dpmix_jax.pate import generation
from dpmix_jax.pate.method import Plan, RunSettings, Spent
from dpmix_jax.pate.peers import decoding, peer_method
from dpmix_jax.pate.peers.result import PeerResult
from dpmix_jax.privacy import validation

__all__ = [
    "METHOD",
    "ORDERS",
    "PMixEDConfig",
    "PMixEDMethod",
    "calibrate",
    "dp_event",
    "epsilon",
    "generate",
    "mixing_weights",
    "output_distribution",
    "pairwise_divergence_bound",
    "step",
    "token_rdp",
    "worst_case_charges",
]

ORDERS = (1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0, 16.0, 20.0, 24.0, 32.0, 64.0)
"""The Rényi orders `calibrate` chooses α from."""

RADIUS_SLACK = 1.0 - 1e-4
"""The projection aims at this fraction of each radius, so float32 rounding of the mixture
cannot carry it past the radius the accounting assumes."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PMixEDConfig:
    """Settings of one PMixED decoding run.

    Attributes:
        alpha: the Rényi order α > 1 of the guarantee.
        beta: radius per unit of order of the ball around p0 (> 0).
        sampling_rate: q, the probability that each teacher is kept for a token, in (0, 1].
        num_teachers: n, the teachers the accounting assumes.
        max_new_tokens: length limit (every token may read the teachers).
        temperature: softmax temperature of teachers and public model alike.
        bisection_iterations: halvings of [0, 1] that locate each λ.
    """

    alpha: float
    beta: float
    sampling_rate: float = 1.0
    num_teachers: int
    max_new_tokens: int = 32
    temperature: float = 1.0
    bisection_iterations: int = 30

    def __post_init__(self):
        if not isinstance(self.alpha, int | float) or not 1 < self.alpha < math.inf:
            raise ValueError(f"alpha must be a finite number > 1, got {self.alpha!r}.")
        validation.check_positive(self.beta, "beta")
        validation.check_sampling_rate(self.sampling_rate)
        validation.check_steps(self.num_teachers, "num_teachers")
        validation.check_steps(self.max_new_tokens, "max_new_tokens")
        validation.check_positive(self.temperature, "temperature")
        validation.check_steps(self.bisection_iterations, "bisection_iterations")


def pairwise_divergence_bound(alpha: float, beta: float) -> float:
    """D = (2α - 1)²β/(α - 1): the largest D_α(p̄‖p̄') between two members of the ball."""
    return (2 * alpha - 1) ** 2 * beta / (alpha - 1)


def _kept_weight(sampling_rate: float, num_teachers: int) -> float:
    """w = E[q / (1 + Bin(n - 1, q))] = (1 - (1 - q)^n) / n."""
    return (1 - (1 - sampling_rate) ** num_teachers) / num_teachers


def token_rdp(config: PMixEDConfig) -> float:
    """The RDP at order α of one token: log(1 + w (e^{(α-1)D} - 1)) / (α - 1)."""
    alpha = config.alpha
    weight = _kept_weight(config.sampling_rate, config.num_teachers)
    growth = math.expm1((alpha - 1) * pairwise_divergence_bound(alpha, config.beta))
    return math.log1p(weight * growth) / (alpha - 1)


def epsilon(config: PMixEDConfig, *, steps: int, delta: float) -> float:
    """ε at `delta` of `steps` private tokens (RDP composition at order α, then conversion)."""
    delta = validation.check_delta(delta)
    if steps == 0:
        return 0.0
    steps = validation.check_steps(steps)
    eps, _ = rdp_privacy_accountant.compute_epsilon(
        [config.alpha], [steps * token_rdp(config)], delta
    )
    return float(eps)


def worst_case_charges(config: PMixEDConfig) -> dict[str, int]:
    """The charges of the costliest run: every one of `max_new_tokens` tokens private."""
    return {"steps": config.max_new_tokens}


def dp_event(config: PMixEDConfig, *, steps: int) -> dp_accounting.DpEvent:
    """The run's event: `steps` tokens of a mechanism dp-accounting cannot analyse (its RDP
    curve is `token_rdp`, at order `config.alpha` only)."""
    return dp_accounting.SelfComposedDpEvent(dp_accounting.UnsupportedDpEvent(), steps)


def _beta_for(alpha: float, *, epsilon: float, delta: float, steps: int, weight: float):
    """The β at which `steps` tokens cost exactly `epsilon` at order `alpha` (None if none)."""
    total_rdp = epsilon - math.log1p(-1 / alpha) + math.log(delta * alpha) / (alpha - 1)
    if total_rdp <= 0:
        return None
    growth = math.expm1((alpha - 1) * total_rdp / steps) / weight
    divergence = math.log1p(growth) / (alpha - 1)
    return divergence * (alpha - 1) / (2 * alpha - 1) ** 2


def calibrate(
    *,
    epsilon: float,
    delta: float,
    max_new_tokens: int,
    num_teachers: int,
    sampling_rate: float = 1.0,
    alpha: float | None = None,
    **settings,
) -> PMixEDConfig:
    """The config whose `max_new_tokens` private tokens cost at most (epsilon, delta).

    Args:
        epsilon, delta: the target.
        max_new_tokens: tokens the run may generate (all charged).
        num_teachers: n.
        sampling_rate: q.
        alpha: a fixed order; None picks, from `ORDERS`, the one with the largest β.
        **settings: the other `PMixEDConfig` fields (temperature, bisection_iterations).

    Raises:
        ValueError: a bad argument, or no order in reach of the target.
    """
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    steps = validation.check_steps(max_new_tokens, "max_new_tokens")
    num_teachers = validation.check_steps(num_teachers, "num_teachers")
    sampling_rate = validation.check_sampling_rate(sampling_rate)
    if alpha is not None and (not isinstance(alpha, int | float) or not 1.01 < alpha < math.inf):
        raise ValueError(f"alpha must be a finite number > 1.01, got {alpha!r}.")
    weight = _kept_weight(sampling_rate, num_teachers)
    orders = ORDERS if alpha is None else (alpha,)
    betas = {
        order: _beta_for(order, epsilon=epsilon, delta=delta, steps=steps, weight=weight)
        for order in orders
    }
    betas = {order: beta for order, beta in betas.items() if beta is not None and beta > 0}
    if not betas:
        raise ValueError(
            f"(epsilon={epsilon:g}, delta={delta:g}) cannot be met at any order in "
            f"{orders}: the RDP-to-DP conversion alone costs more than epsilon."
        )
    order = max(betas, key=betas.get)
    return PMixEDConfig(
        alpha=order,
        beta=betas[order],
        sampling_rate=sampling_rate,
        num_teachers=num_teachers,
        max_new_tokens=steps,
        **settings,
    )


def _log_renyi(log_p: jax.Array, log_q: jax.Array, order: float) -> jax.Array:
    """D_order(p‖q) along the last axis, from log-probabilities (tokens where both are 0 drop)."""
    terms = order * log_p + (1 - order) * log_q
    terms = jnp.where(jnp.isneginf(log_p) & jnp.isneginf(log_q), -jnp.inf, terms)
    return jax.nn.logsumexp(terms, axis=-1) / (order - 1)


def _log_mixture(weight: jax.Array, log_p: jax.Array, log_p0: jax.Array) -> jax.Array:
    """log(λ p + (1 - λ) p0) with λ of shape (n,), log p of shape (n, V), log p0 of shape (V,)."""
    weight = weight[:, None]
    return jnp.logaddexp(jnp.log(weight) + log_p, jnp.log1p(-weight) + log_p0)


def _inside(weight, log_p, log_p0, *, alpha: float, beta: float) -> jax.Array:
    """Whether λ p + (1 - λ) p0 lies in the ball (per teacher)."""
    log_mix = _log_mixture(weight, log_p, log_p0)
    forward = _log_renyi(log_mix, log_p0, 2 * alpha) <= RADIUS_SLACK * 2 * alpha * beta
    backward = _log_renyi(log_p0, log_mix, 2 * alpha - 1) <= RADIUS_SLACK * (2 * alpha - 1) * beta
    return forward & backward


@functools.partial(jax.jit, static_argnames="config")
def mixing_weights(
    teacher_logits: jax.Array, public_logits: jax.Array, config: PMixEDConfig
) -> jax.Array:
    """λ (n,): per teacher, the largest weight in [0, 1] (to `bisection_iterations` halvings,
    from below) whose mixture with p0 lies in the ball; both divergences grow with λ.

    Privacy:
        Reads the teachers' logits (sensitive); its output is only used inside `step`.
    """
    log_p = jax.nn.log_softmax(teacher_logits / config.temperature, axis=-1)
    log_p0 = jax.nn.log_softmax(public_logits / config.temperature)
    inside = functools.partial(_inside, alpha=config.alpha, beta=config.beta)
    ones = jnp.ones(log_p.shape[0], log_p.dtype)

    def halve(_, bounds):
        low, high = bounds
        middle = (low + high) / 2
        ok = inside(middle, log_p, log_p0)
        return jnp.where(ok, middle, low), jnp.where(ok, high, middle)

    low, _ = jax.lax.fori_loop(0, config.bisection_iterations, halve, (jnp.zeros_like(ones), ones))
    return jnp.where(inside(ones, log_p, log_p0), ones, low)


@functools.partial(jax.jit, static_argnames="config")
def output_distribution(
    teacher_logits: jax.Array,
    public_logits: jax.Array,
    kept: jax.Array,
    config: PMixEDConfig,
) -> jax.Array:
    """The (V,) distribution a token is sampled from when the teachers in `kept` (n,) bool are
    kept: the average of their projected mixtures, or p0 when none is kept.

    Privacy:
        Reads the teachers' logits (sensitive); released only through one sample.
    """
    weights = mixing_weights(teacher_logits, public_logits, config)
    log_p = jax.nn.log_softmax(teacher_logits / config.temperature, axis=-1)
    p0 = jax.nn.softmax(public_logits / config.temperature)
    mixtures = jnp.exp(_log_mixture(weights, log_p, jnp.log(p0)))
    count = kept.sum()
    average = (kept[:, None] * mixtures).sum(0) / jnp.maximum(count, 1)
    return jnp.where(count > 0, average, p0)


@functools.partial(jax.jit, static_argnames="config")
def step(
    key: jax.Array, teacher_logits: jax.Array, public_logits: jax.Array, *, config: PMixEDConfig
) -> jax.Array:
    """One PMixED token: Poisson-subsample the teachers, project, average, sample.

    Args:
        key: PRNG key of the subsample and the token.
        teacher_logits: (n, V) logits of the teachers.
        public_logits: (V,) logits of the public model.
        config: the run's settings (static).

    Returns:
        The token (int32 scalar).

    Privacy:
        Reads the teachers' logits (sensitive); costs `token_rdp(config)` at order α.
    """
    key_subsample, key_token = jax.random.split(key)
    kept = jax.random.bernoulli(key_subsample, config.sampling_rate, teacher_logits.shape[:1])
    distribution = output_distribution(teacher_logits, public_logits, kept, config)
    return jax.random.categorical(key_token, jnp.log(distribution)).astype(jnp.int32)


def generate(
    teachers: generation.Teachers,
    public_model: generation.PublicModel,
    *,
    prompt: Sequence[int],
    config: PMixEDConfig,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
    delta: float = 1e-5,
) -> PeerResult:
    """Decodes one text with PMixED.

    Args:
        teachers: the ensemble; it must hold `config.num_teachers` teachers.
        public_model: the public model p0.
        prompt: the public prefix shared by all teachers (may be empty).
        config: the run's settings.
        key: PRNG key; None draws a secret one (a known key makes the output reproducible, and
            not private, for whoever knows it).
        eos_id: stop after this token (None: no such token).
        stop_sequences: stop once the output ends with one of these.
        delta: the δ at which the run's ε is reported.

    Returns:
        A `PeerResult` whose ε covers the tokens generated.

    Privacy:
        Every token reads the teachers (sensitive) through `step` only and is charged
        `token_rdp(config)`; the report composes the tokens that ran.
    """
    decoding.check_teachers(teachers, config.num_teachers)
    delta = validation.check_delta(delta)

    def next_token(key, prefix):
        teacher_logits = jnp.asarray(teachers(prefix), jnp.float32)
        public_logits = jnp.asarray(public_model(prefix), jnp.float32)
        return step(key, teacher_logits, public_logits, config=config)

    decoded = decoding.decode(
        next_token,
        prompt=prompt,
        key=key,
        max_new_tokens=config.max_new_tokens,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
    )
    tokens = decoded.tokens
    steps = len(tokens)
    return PeerResult(
        tokens=tokens,
        sources=["private"] * steps,
        stop_reason=decoded.stop_reason,
        event=dp_event(config, steps=steps),
        charges={"steps": steps},
        epsilon=epsilon(config, steps=steps, delta=delta),
        delta=delta,
        teacher_forward_passes=steps * config.num_teachers,
        public_forward_passes=steps,
        seeded=decoded.seeded,
    )


class PMixEDMethod:
    """PMixED as a `pate.method.Method` (`peer_method`: calibrated for all of a run's texts at
    full length, charged the tokens that ran)."""

    name = "pmixed"
    label = "PMixED"

    def calibrate(self, run: RunSettings) -> Plan:
        """`calibrate` for `run.worst_case_tokens` tokens on the run's teachers.

        Privacy:
            Public: a function of public settings only.
        """
        config = calibrate(
            epsilon=run.epsilon,
            delta=run.delta,
            max_new_tokens=run.worst_case_tokens,
            num_teachers=run.num_teachers,
            temperature=run.temperature,
        )
        return peer_method.plan(self.name, run, config, epsilon, worst_case_charges(config))

    def generate(
        self,
        plan: Plan,
        teachers: generation.Teachers,
        public_model: generation.PublicModel,
        *,
        prompt: Sequence[int],
        key: jax.Array | None,
    ) -> list[PeerResult]:
        """Every text of the run, each by `generate` with the run's `max_new_tokens`, reported
        at the run's δ.

        Privacy:
            Reads the teachers only through `step`.
        """
        run = plan.run
        text_config = dataclasses.replace(plan.config, max_new_tokens=run.max_new_tokens)
        return peer_method.decode_texts(
            generate,
            text_config,
            run,
            teachers,
            public_model,
            prompt=prompt,
            key=key,
            delta=run.delta,
        )

    def charge(self, plan: Plan, samples: Sequence[PeerResult]) -> Spent:
        """`epsilon` of every token that ran (`peer_method.charge`).

        Privacy:
            Reads the texts' charges only.
        """
        return peer_method.charge(plan, samples, epsilon)


METHOD = PMixEDMethod()
