"""Individual (per-teacher) privacy accounting for heterogeneous ensembles: a Rényi filter.

In a heterogeneous ensemble each teacher holds one privacy unit (one user's data). A teacher whose
vote agrees with a public model's vote does not matter at that step: the public fallback would
output the same token. Here such a teacher contributes nothing and is charged nothing; each
teacher has its own budget of M charges, after which it contributes nothing for good.

Neighbouring relation: adding or removing one teacher's whole data x_i (the other teachers'
data, the public model and the public noise unchanged). With one privacy unit per teacher (the
heterogeneous setting) this is unit-level DP. With several units per teacher the guarantee is
per teacher's part only: removing one unit inside a part changes teacher i's votes to those of
an unseen counterfactual x_i', and the loss of that change, α·‖f_t(x_i) - f_t(x_i')‖²/(2σ²) per
step (up to α/σ² when the two vote for different tokens), depends on the counterfactual vote,
whose norm the filter never sees; the two neighbours' filters (charge histories) also diverge.
The theorem below does not cover that relation; use the data-independent accounting of
`pate.accounting` for it.

Mechanism, at every generation step t (`individual_step`):

1. Shared Gumbel noise g ~ Gumbel(0, 1)^V, public and independent of the data (the coordinated
   sampler's noise), gives teacher i the vote v_i = argmax_j(x_ij / τ + g_j) (x_i its logits,
   τ the temperature) and the public model the vote p = argmax_j(y_j / τ + g_j), where y are
   logits that read no sensitive data.
2. Teacher i contributes f_t(x_i) = e_{v_i} (one-hot) when v_i != p and it has been charged fewer
   than M times; otherwise it abstains, f_t(x_i) = 0. Both conditions depend on teacher i's own
   data, the public history and the public noise only.
3. Release ĉ = Σ_i f_t(x_i) + N(0, σ² I_V): Gaussian noise on every token of the vocabulary.
   The token is post-processing of ĉ (and public values): a token j with ĉ_j >= T drawn with
   probability ∝ ĉ_j among those, or p when none passes. T is for utility only: with
   T = σ·sqrt(2·ln(V/η)) (`threshold_for`) a token no teacher voted for passes with probability
   Pr[N(0, σ²) >= T] <= exp(-T²/(2σ²))/2 = η/(2V), so some such token passes with probability
   <= η/2 (union bound over the V tokens).
4. Teacher i's individual RDP at step t, given the history, is α·‖f_t(x_i)‖²/(2σ²) at every
   order α (the Gaussian mechanism on a sum, both directions): α/(2σ²) if it voted, else 0.

Theorem (Feldman and Zrnic 2021, "Individual Privacy Accounting via a Rényi Filter": the Rényi
filter). In an adaptive composition where each point i is dropped once its accumulated
individual RDP at order α would exceed B(α), the output law with and without point i is within
Rényi divergence B(α) at order α. Here every charge has the same curve α/(2σ²), so the filter at
every order is the same rule "at most M charges", and the whole run is, for every teacher,
(α, α·M/(2σ²))-RDP for all α at once: the RDP of M compositions of the Gaussian mechanism with
noise multiplier σ (sensitivity 1). Its (ε, δ) is dp-accounting's `RdpAccountant` ε of
`SelfComposedDpEvent(GaussianDpEvent(σ), M)` (`rdp_epsilon`); M is the largest count whose ε at δ
is within the target (`budget_per_teacher`). The theorem is an RDP theorem, so the accounting
is RDP's, not a privacy loss distribution (PLD): the number of charged steps is itself random
and adaptive, and a composition theorem for fixed sequences of mechanisms (what a PLD of M
Gaussians computes) does not by itself cover a filtered run.

Conditions of the guarantee:

* σ, T, M, τ and the public model are public and fixed in advance (the public logits of a step
  may depend on the released history). The analysis treats each step's g as released before
  the step's ĉ (a data-independent output, at no cost), so that whether teacher i is charged is
  a function of the history, as the theorem requires; the guarantee for (g, ĉ) implies it for
  ĉ alone, and g may indeed be released.
* Adaptivity is allowed: teacher logits and public logits may depend on every earlier released
  output, and the run may have any finite number of steps, chosen in advance or from the outputs.
* The abstention rule of teacher i may depend only on teacher i's own data and public values
  (the history, the public noise, its own charge count); never on other teachers' data.
* ‖f_t(x_i)‖ <= 1 and f_t(x_i) = 0 whenever teacher i has been charged M times already.
* The Gaussian noise is fresh and secret at every step, and the filter state (the charges) is
  kept between steps: reusing an earlier state reopens charges the bound has counted.

The realised charges are a function of the sensitive data: they are for analysis and must not be
released; the guarantee is the one the filter enforces (`IndividualLedger.epsilon`), from M.

The data-independent alternative charges every teacher at every step: the same mechanism is then
(ε, δ) within the target for at most M steps in total (`rdp_epsilon` of the steps run).

Example:
    >>> config = IndividualConfig(sigma=6.0, threshold=30.0, epsilon=8.0, delta=1e-6)
    >>> config.budget, round(rdp_epsilon(6.0, config.budget, 1e-6), 2) <= 8.0
    (75, True)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.pate import samplers
from dpmix_jax.privacy import validation

__all__ = [
    "IndividualConfig",
    "IndividualLedger",
    "StepInfo",
    "budget_per_teacher",
    "individual_step",
    "rdp_epsilon",
    "run_stream",
    "sigma_for_steps",
    "threshold_for",
]

# The most charges `budget_per_teacher` looks for (a larger budget is capped: a filter with a
# smaller budget is only safer).
MAX_BUDGET = 10**9


@functools.lru_cache(maxsize=4096)
def rdp_epsilon(sigma: float, count: int, delta: float) -> float:
    """ε at `delta` of `count` compositions of the Gaussian mechanism with noise multiplier σ.

    dp-accounting's `RdpAccountant` (its default orders, add-or-remove-one relation) on
    `SelfComposedDpEvent(GaussianDpEvent(σ), count)`; 0 for `count` = 0.

    Args:
        sigma: noise standard deviation / sensitivity (> 0).
        count: number of compositions (>= 0).
        delta: the target δ, in (0, 1).
    """
    sigma = validation.check_positive(sigma, "sigma")
    delta = validation.check_delta(delta)
    if count == 0:
        return 0.0
    count = validation.check_steps(count, "count")
    accountant = dp_accounting.rdp.RdpAccountant(
        neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), count)
    )
    return float(accountant.get_epsilon(delta))


@functools.lru_cache(maxsize=1024)
def budget_per_teacher(sigma: float, epsilon: float, delta: float) -> int:
    """M: the largest number of charges whose RDP ε at `delta` stays <= `epsilon`.

    ε(M) = `rdp_epsilon(σ, M, δ)` grows with M; 0 when one charge already exceeds `epsilon`,
    capped at `MAX_BUDGET`.

    Args:
        sigma: the Gaussian noise multiplier of every release (> 0).
        epsilon: the per-teacher target ε (> 0).
        delta: the per-teacher target δ, in (0, 1).
    """
    sigma = validation.check_positive(sigma, "sigma")
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)

    def fits(count: int) -> bool:
        return rdp_epsilon(sigma, count, delta) <= epsilon

    if not fits(1):
        return 0
    low = 1
    while low < MAX_BUDGET and fits(min(2 * low, MAX_BUDGET)):
        low = min(2 * low, MAX_BUDGET)
    if low == MAX_BUDGET:
        return MAX_BUDGET
    high = min(2 * low, MAX_BUDGET)  # fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def sigma_for_steps(steps: int, epsilon: float, delta: float) -> float:
    """The smallest σ (to 0.1%) whose budget M is at least `steps`: the noise the
    data-independent accounting needs to run `steps` steps with every teacher charged.

    Args:
        steps: the number of steps (>= 1).
        epsilon: the target ε (> 0).
        delta: the target δ, in (0, 1).
    """
    steps = validation.check_steps(steps)
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    low, high = 1e-3, 1.0
    while rdp_epsilon(high, steps, delta) > epsilon:
        low, high = high, 2 * high
    while high / low > 1.001:
        middle = math.sqrt(low * high)
        fits = rdp_epsilon(middle, steps, delta) <= epsilon
        low, high = (low, middle) if fits else (middle, high)
    return high


def threshold_for(sigma: float, vocab_size: int, eta: float) -> float:
    """T = σ·sqrt(2·ln(V/η)): a token no teacher voted for passes with probability <= η/(2V),
    so some such token passes with probability <= η/2 (Gaussian tail, union bound).

    Args:
        sigma: the Gaussian noise's standard deviation (> 0).
        vocab_size: V (>= 1).
        eta: the allowed probability, in (0, 1).
    """
    sigma = validation.check_positive(sigma, "sigma")
    vocab_size = validation.check_steps(vocab_size, "vocab_size")
    if not 0 < eta < 1:
        raise ValueError(f"eta must be in (0, 1), got {eta!r}.")
    return sigma * math.sqrt(2.0 * math.log(vocab_size / eta))


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndividualConfig:
    """Public settings of an individually accounted run.

    Attributes:
        sigma: σ, the standard deviation of the Gaussian noise on every count (the noise
            multiplier: a teacher's contribution has norm <= 1).
        threshold: T, the noisy count a token needs to be released (`threshold_for`).
        epsilon: each teacher's target ε.
        delta: each teacher's target δ.
        temperature: τ of the teachers' and the public model's votes.
    """

    sigma: float
    threshold: float
    epsilon: float
    delta: float
    temperature: float = 1.0

    def __post_init__(self):
        validation.check_positive(self.sigma, "sigma")
        validation.check_positive(self.threshold, "threshold")
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)
        validation.check_positive(self.temperature, "temperature")
        if self.budget < 1:
            raise ValueError(
                f"sigma = {self.sigma!r} is too small for (epsilon, delta) = ({self.epsilon!r},"
                f" {self.delta!r}): not one charge fits; use a larger sigma."
            )

    @property
    def budget(self) -> int:
        """M, the charges each teacher may have (`budget_per_teacher`)."""
        return budget_per_teacher(self.sigma, self.epsilon, self.delta)

    @property
    def guaranteed_epsilon(self) -> float:
        """The ε at `delta` every teacher gets from the filter: `rdp_epsilon(σ, M, δ)` <= ε."""
        return rdp_epsilon(self.sigma, self.budget, self.delta)


def _votes(scores: jax.Array) -> jax.Array:
    """The first index of each row's maximum (`samplers.first_argmax`), NaN counting as the
    maximum, so that every row, however broken, votes for one token."""
    return samplers.first_argmax(jnp.where(jnp.isnan(scores), jnp.inf, scores))


class StepInfo(NamedTuple):
    """What one step computed.

    Released (public): `public_vote`, `noisy_counts` (ĉ) and `from_public`. Sensitive (functions
    of the teachers' data, for analysis and tests only): `votes`, `charged`, `counts`.
    """

    votes: jax.Array
    public_vote: jax.Array
    charged: jax.Array
    counts: jax.Array
    noisy_counts: jax.Array
    from_public: jax.Array


def individual_step(
    key: jax.Array,
    teacher_logits: jax.Array,
    public_logits: jax.Array,
    charges: jax.Array,
    config: IndividualConfig,
    budget: int | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, StepInfo]:
    """One generation step: votes, abstentions, the filter, the noisy release and the token.

    Pure and jittable (`config` static); vectorised over the teachers. `key` is split into three
    (`jax.random.split(key, 3)`): the shared Gumbel noise of the votes, the Gaussian noise of
    the release, and the draw of the output token.

    Args:
        key: this step's PRNG key (secret, fresh).
        teacher_logits: `(n, V)` the teachers' next-token logits.
        public_logits: `(V,)` the public model's logits (computed from no sensitive data).
        charges: `(n,)` int, how many times each teacher has been charged so far.
        config: the run's public settings.
        budget: M, the charges a teacher may have; default `config.budget`. Another value
            changes the guarantee to `rdp_epsilon(config.sigma, budget, delta)`.

    Returns:
        `(token, new_charges, info)`: the output token (int32), the charges after this step
        (`charges` + 1 for every teacher that voted), and the `StepInfo`.

    Privacy:
        Reads the teachers' logits. Releasing ĉ (hence the token) at every step of a run whose
        charges are always the previous step's `new_charges` is, for every teacher, within
        `rdp_epsilon(config.sigma, budget, config.delta)` at `config.delta` (module docstring).
        `new_charges` and the sensitive fields of `info` must not be released.
    """
    teacher_logits = jnp.asarray(teacher_logits)
    public_logits = jnp.asarray(public_logits)
    charges = jnp.asarray(charges)
    if teacher_logits.ndim != 2 or public_logits.shape != teacher_logits.shape[1:]:
        raise ValueError(
            "need teacher_logits (n, V) and public_logits (V,), got"
            f" {teacher_logits.shape} and {public_logits.shape}."
        )
    if charges.shape != teacher_logits.shape[:1]:
        raise ValueError(
            f"need charges of shape (n,) = {teacher_logits.shape[:1]}, got {charges.shape}."
        )
    budget = config.budget if budget is None else budget
    vocab = public_logits.shape[0]
    key_vote, key_noise, key_token = jax.random.split(key, 3)
    gumbel = jax.random.gumbel(key_vote, (vocab,), jnp.float32)
    scale = jnp.float32(1.0 / config.temperature)
    votes = _votes(teacher_logits.astype(jnp.float32) * scale + gumbel)
    public_vote = _votes(public_logits.astype(jnp.float32) * scale + gumbel)
    charged = (votes != public_vote) & (charges < budget)
    counts = jnp.zeros(vocab, jnp.int32).at[votes].add(charged.astype(jnp.int32))
    noisy = counts + config.sigma * jax.random.normal(key_noise, (vocab,), jnp.float32)
    passing = noisy >= config.threshold
    log_weights = jnp.where(passing, jnp.log(jnp.where(passing, noisy, 1.0)), -jnp.inf)
    drawn = jax.random.categorical(key_token, log_weights)
    from_public = ~jnp.any(passing)
    token = jnp.where(from_public, public_vote, drawn).astype(jnp.int32)
    new_charges = charges + charged.astype(charges.dtype)
    info = StepInfo(
        votes=votes.astype(jnp.int32),
        public_vote=public_vote.astype(jnp.int32),
        charged=charged,
        counts=counts,
        noisy_counts=noisy,
        from_public=from_public,
    )
    return token, new_charges, info


@functools.partial(jax.jit, static_argnames="config")
def run_stream(
    key: jax.Array,
    teacher_logits: jax.Array,
    public_logits: jax.Array,
    config: IndividualConfig,
    charges: jax.Array | None = None,
    budget: int | jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, StepInfo]:
    """`individual_step` over a stream of precomputed logits (a `jax.lax.scan`).

    Args:
        key: the run's PRNG key (secret), split into one key per step.
        teacher_logits: `(steps, n, V)`.
        public_logits: `(steps, V)`.
        config: the run's public settings (static).
        charges: `(n,)` charges before the stream; default zeros.
        budget: M; default `config.budget`.

    Returns:
        `(tokens (steps,), final charges (n,), StepInfo stacked over the steps)`.

    Privacy:
        As `individual_step`: the whole stream, and any later stream started from the returned
        charges, is within the filter's guarantee.
    """
    if charges is None:
        charges = jnp.zeros(teacher_logits.shape[1], jnp.int32)
    budget = config.budget if budget is None else budget

    def body(state, inputs):
        step_key, teachers, public = inputs
        token, state, info = individual_step(step_key, teachers, public, state, config, budget)
        return state, (token, info)

    keys = jax.random.split(key, teacher_logits.shape[0])
    final, (tokens, infos) = jax.lax.scan(body, charges, (keys, teacher_logits, public_logits))
    return tokens, final, infos


@dataclasses.dataclass
class IndividualLedger:
    """Per-teacher charges of a run and the guarantee the filter enforces.

    Attributes:
        config: the run's settings; the guarantee is `config`'s, from M.
        charges: `(n,)` charges so far (sensitive: for analysis, never released).
        steps: steps recorded.
        max_charges: M when the run passes `budget` = M to `individual_step` (at most
            `config.budget`); None (default): `config.budget`.
    """

    config: IndividualConfig
    charges: np.ndarray
    steps: int = 0
    max_charges: int | None = None

    def __post_init__(self):
        if self.max_charges is not None:
            self.max_charges = validation.check_steps(self.max_charges, "max_charges")
            if self.max_charges > self.config.budget:
                raise ValueError(
                    f"max_charges = {self.max_charges} exceeds the budget"
                    f" M = {self.config.budget} of sigma = {self.config.sigma!r} at"
                    f" (epsilon, delta) = ({self.config.epsilon!r}, {self.config.delta!r})."
                )

    @classmethod
    def start(
        cls, config: IndividualConfig, num_teachers: int, max_charges: int | None = None
    ) -> IndividualLedger:
        """A ledger of `num_teachers` teachers, none charged (M = `max_charges`, default
        `config.budget`)."""
        num_teachers = validation.check_steps(num_teachers, "num_teachers")
        return cls(config, np.zeros(num_teachers, np.int64), max_charges=max_charges)

    def record(self, charges, steps: int = 1) -> None:
        """Records the charges after `steps` more steps.

        Raises:
            ValueError: the charges decrease, grow by more than `steps`, or exceed M: the
                run did not follow the filter, and the guarantee does not hold.
        """
        charges = np.asarray(charges, np.int64)
        if charges.shape != self.charges.shape:
            raise ValueError(f"need charges of shape {self.charges.shape}, got {charges.shape}.")
        growth = charges - self.charges
        if growth.min(initial=0) < 0 or growth.max(initial=0) > steps:
            raise ValueError(f"charges may only grow by 0 to {steps} in {steps} steps.")
        if charges.max(initial=0) > self.budget:
            raise ValueError(
                f"a teacher was charged {charges.max()} > M = {self.budget} times: the filter"
                " was bypassed."
            )
        self.charges = charges
        self.steps += steps

    @property
    def budget(self) -> int:
        """M."""
        return self.config.budget if self.max_charges is None else self.max_charges

    @property
    def max_charge(self) -> int:
        """The most charges of any teacher."""
        return int(self.charges.max(initial=0))

    @property
    def mean_charge(self) -> float:
        """The charges per teacher, on average."""
        return float(self.charges.mean()) if self.charges.size else 0.0

    @property
    def epsilon(self) -> float:
        """The guaranteed ε at `config.delta` for every teacher (from M, not the charges)."""
        if self.max_charges is None:
            return self.config.guaranteed_epsilon
        return rdp_epsilon(self.config.sigma, self.max_charges, self.config.delta)

    def guarantee(self) -> tuple[float, float]:
        """(ε, δ) of every teacher."""
        return self.epsilon, self.config.delta

    def summary(self) -> dict:
        """Steps, M, the mean and max charge, and the guarantee, as a JSON-able dict."""
        return {
            "steps": self.steps,
            "budget": self.budget,
            "mean_charge": self.mean_charge,
            "max_charge": self.max_charge,
            "epsilon": self.epsilon,
            "delta": self.config.delta,
        }
