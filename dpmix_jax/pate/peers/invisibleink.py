"""InvisibleInk (Vinod, Pillutla and Thakurta, "InvisibleInk: High-Utility and Low-Cost Text
Generation with Differential Privacy", NeurIPS 2025, arXiv 2507.02974).

Every token is drawn by the exponential mechanism over clipped logit differences. With the n
teacher rows ℓ_1, …, ℓ_n (the paper's B private references, one per row) and the public model's
logits ℓ_pub after the same prefix:

* difference clipping: c_i = clip(ℓ_i − ℓ_pub, −C, C), coordinatewise (a NaN difference
  counts as 0);
* utility u = ℓ_pub + (1/n) Σ_i c_i;
* top-k+ set: the tokens whose public logit is at least the k-th largest public logit minus
  2C/n (the whole vocabulary when `top_k` is None or at least the vocabulary size);
* the token is drawn from softmax(u / τ) restricted to that set.

Neighbouring relation: one unit = one teacher row, which may change arbitrarily; the prompt, the
prefix and the public model are shared and public.

Sensitivity: c_i lies in [−C, C]^V whatever ℓ_i is, so replacing one row moves every coordinate
of u by at most Δ = 2C/n. The top-k+ set reads the public logits only, so it is the same on both
sides. On that fixed set, sampling ∝ exp(u / τ) is the exponential mechanism whose privacy loss
log p(y)/p'(y) takes values in an interval of width at most 2Δ/τ = 4C/(nτ) (bounded range),
hence ρ-zCDP per token with ρ_tok = (4C/(nτ))²/8 = 2·(C/(nτ))² (Cesar and Rogers 2021).
The paper's per-token rate ½·(C/(Bτ))² is that of a neighbour whose changed reference is dropped
and its slot left to the public prompt (c_i → 0, Δ = C/B). Under the replace-one relation above a
run costs four times that ρ: what the paper's analysis reports for the clip norm 2C.

Two settings on an ensemble of n rows, each its own `pate.method.Method`:

* "invisibleink" (`METHOD`): every text reads all n rows, so the run's texts compose: the run is
  calibrated for num_samples · max_new_tokens tokens with n in ρ_tok;
* "invisibleink_disjoint" (`DISJOINT_METHOD`, the setting of the authors' package): the rows
  are split into num_samples disjoint batches (`text_batches`), text i reads batch i only, and
  since a unit sits in one row (units go to rows by a keyed hash) it moves one text: by parallel
  composition the run costs what its costliest text costs, max_new_tokens tokens with the
  batch's B = ⌊n / num_samples⌋ rows (or one more) in ρ_tok. Each text also has fewer rows
  behind it, so which setting allows the larger clip depends on n, num_samples and the
  length (`calibrate` of each).

Both guarantees are for the replace-one relation above (one unit added or removed changes one
row arbitrarily); `synthesis.relations` gives the paper's add/remove value beside it.

Accounting: every generated token reads the teachers, and T tokens compose to T·ρ_tok. The event
is `SelfComposedDpEvent(ZCDpEvent(ρ_tok), T)`; its ε at δ is dp-accounting's RDP accountant's
(`privacy.accounting.epsilon(..., accountant="rdp")`), the zCDP-to-(ε, δ) conversion of Canonne,
Kamath and Steinke (2020) that the paper uses, taken over the accountant's grid of Rényi orders
rather than at the continuous optimum, so never smaller than the paper's conversion.

Example:
    >>> config = calibrate(epsilon=1.0, delta=1e-6, max_new_tokens=64, num_teachers=8)
    >>> round(epsilon(config, steps=64), 3)
    1.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Sequence

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.pate import generation
from dpmix_jax.pate.method import Plan, RunSettings, Spent, sample_keys
from dpmix_jax.pate.peers import decoding, peer_method
from dpmix_jax.pate.peers.result import PeerResult
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import validation

__all__ = [
    "DISJOINT_METHOD",
    "METHOD",
    "InvisibleInkDisjointMethod",
    "InvisibleInkConfig",
    "InvisibleInkMethod",
    "calibrate",
    "clipped_mean_logits",
    "dp_event",
    "epsilon",
    "generate",
    "per_token_rho",
    "step",
    "text_batches",
    "token_log_probs",
    "top_k_plus_mask",
    "worst_case_charges",
]

REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


@dataclasses.dataclass(frozen=True, kw_only=True)
class InvisibleInkConfig:
    """Settings of one InvisibleInk decoding run.

    Attributes:
        clip_norm: C, the bound on every coordinate of a clipped logit difference.
        temperature: τ, the sampling temperature (the exponential mechanism's scale).
        top_k: k of the top-k+ set (the paper's default 100); None, or a k at least the
            vocabulary size, samples from the whole vocabulary.
        max_new_tokens: length limit (the worst case that `calibrate` pays for).
        num_teachers: n, the teacher rows the analysis divides by (the paper's B).
        delta: the δ at which a run's ε is reported.
        allow_large_delta: accept δ >= 1/n (each teacher holds at least one sensitive unit).
    """

    clip_norm: float
    temperature: float = 1.0
    top_k: int | None = 100
    max_new_tokens: int
    num_teachers: int
    delta: float
    allow_large_delta: bool = False

    def __post_init__(self):
        validation.check_positive(self.clip_norm, "clip_norm")
        validation.check_positive(self.temperature, "temperature")
        if self.top_k is not None and not _is_positive_int(self.top_k):
            raise ValueError(f"top_k must be None or an integer >= 1, got {self.top_k!r}.")
        validation.check_steps(self.max_new_tokens, "max_new_tokens")
        if not _is_positive_int(self.num_teachers):
            raise ValueError(f"num_teachers must be an integer >= 1, got {self.num_teachers!r}.")
        validation.check_delta_for_units(
            self.delta,
            self.num_teachers,
            unit="teachers (each holds at least one sensitive unit)",
            allow_large_delta=self.allow_large_delta,
        )


def _is_positive_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def per_token_rho(config: InvisibleInkConfig) -> float:
    """ρ_tok = 2·(C/(nτ))², the zCDP of one token when one teacher row changes arbitrarily."""
    return _rho(config.clip_norm, config.num_teachers, config.temperature)


def _rho(clip_norm: float, num_teachers: int, temperature: float) -> float:
    return 2.0 * (clip_norm / (num_teachers * temperature)) ** 2


def dp_event(config: InvisibleInkConfig, *, steps: int) -> dp_accounting.DpEvent:
    """`SelfComposedDpEvent(ZCDpEvent(ρ_tok), steps)`: `steps` generated tokens."""
    return _event(per_token_rho(config), steps)


def _event(rho: float, steps: int) -> dp_accounting.DpEvent:
    steps = validation.check_steps(steps)
    return dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(rho), steps)


def epsilon(config: InvisibleInkConfig, *, steps: int, delta: float | None = None) -> float:
    """ε at `delta` (default: `config.delta`) of `steps` tokens, by dp-accounting's RDP
    accountant (replace-one relation)."""
    delta = config.delta if delta is None else delta
    event = dp_event(config, steps=steps)
    return privacy.epsilon(event, delta=delta, accountant="rdp", neighboring_relation=REPLACE_ONE)


def worst_case_charges(config: InvisibleInkConfig) -> dict[str, int]:
    """The charges of the costliest run: all `max_new_tokens` tokens (`epsilon`'s keywords)."""
    return {"steps": config.max_new_tokens}


def calibrate(
    *,
    epsilon: float,
    delta: float,
    max_new_tokens: int,
    num_teachers: int,
    temperature: float = 1.0,
    top_k: int | None = 100,
    allow_large_delta: bool = False,
) -> InvisibleInkConfig:
    """The config with the largest clip norm C whose worst-case run (all `max_new_tokens`
    tokens) costs at most (`epsilon`, `delta`).

    C is found up to a relative 1e-4 (`privacy.accounting.calibrate` on 1/C), and the config's
    own ε, evaluated by `epsilon`, is within the target.

    Raises:
        ValueError: a target ε outside `privacy.accounting.CALIBRATION_EPSILON_RANGE`, or any
            setting `InvisibleInkConfig` rejects (e.g. δ >= 1/n).
    """
    target = validation.check_epsilon(epsilon)
    low, high = privacy.CALIBRATION_EPSILON_RANGE
    if not low <= target <= high:
        raise ValueError(f"epsilon must be in [{low:g}, {high:g}] for calibration, got {target!r}.")
    template = InvisibleInkConfig(
        clip_norm=1.0,
        temperature=temperature,
        top_k=top_k,
        max_new_tokens=max_new_tokens,
        num_teachers=num_teachers,
        delta=delta,
        allow_large_delta=allow_large_delta,
    )

    def event_of_inverse_clip(inverse_clip: float) -> dp_accounting.DpEvent:
        clip_norm = 1.0 / inverse_clip if inverse_clip > 0 else math.inf
        rho = _rho(clip_norm, template.num_teachers, template.temperature)
        return _event(rho, max_new_tokens)

    inverse_clip = privacy.calibrate(
        event_of_inverse_clip, target_epsilon=target, delta=template.delta, accountant="rdp"
    )
    return dataclasses.replace(template, clip_norm=1.0 / inverse_clip)


@functools.partial(jax.jit, static_argnames=("top_k",))
def top_k_plus_mask(
    public_logits: jax.Array, *, top_k: int | None, clip_norm: float, num_teachers: int
) -> jax.Array:
    """`(V,)` bool: the tokens whose public logit is at least the k-th largest one minus
    2·clip_norm/num_teachers (all tokens when `top_k` is None or at least V).

    Privacy: reads the public logits only; the set is the same on neighbouring inputs.
    """
    if top_k is None or top_k >= public_logits.shape[-1]:
        return jnp.ones(public_logits.shape, bool)
    kth_largest = jax.lax.top_k(public_logits, top_k)[0][-1]
    return public_logits >= kth_largest - 2.0 * clip_norm / num_teachers


def clipped_mean_logits(
    teacher_logits: jax.Array, public_logits: jax.Array, clip_norm: float
) -> jax.Array:
    """`(V,)` utility ℓ_pub + mean_i clip(ℓ_i − ℓ_pub, −C, C) of `(n, V)` teacher logits.

    Privacy: reads the teachers; one row moves each coordinate by at most 2C/n, whatever the
    row holds (±inf clips to ±C, NaN counts as 0).
    """
    differences = jnp.nan_to_num(teacher_logits - public_logits, nan=0.0)
    return public_logits + jnp.clip(differences, -clip_norm, clip_norm).mean(axis=0)


def _scores(teacher_logits, public_logits, clip_norm, temperature, top_k):
    mask = top_k_plus_mask(
        public_logits, top_k=top_k, clip_norm=clip_norm, num_teachers=teacher_logits.shape[0]
    )
    utility = clipped_mean_logits(teacher_logits, public_logits, clip_norm)
    return jnp.where(mask, utility / temperature, -jnp.inf)


@functools.partial(jax.jit, static_argnames=("top_k",))
def token_log_probs(
    teacher_logits: jax.Array,
    public_logits: jax.Array,
    *,
    clip_norm: float,
    temperature: float,
    top_k: int | None,
) -> jax.Array:
    """`(V,)` log-probabilities of the next token (−inf outside the top-k+ set).

    Privacy: a function of the teachers; sensitive. Only `step`'s sample is released.
    """
    return jax.nn.log_softmax(_scores(teacher_logits, public_logits, clip_norm, temperature, top_k))


@functools.partial(jax.jit, static_argnames=("top_k",))
def step(
    key: jax.Array,
    teacher_logits: jax.Array,
    public_logits: jax.Array,
    *,
    clip_norm: float,
    temperature: float,
    top_k: int | None,
) -> jax.Array:
    """One token drawn from `token_log_probs`' distribution (int32 scalar).

    Privacy: ρ_tok-zCDP in the teacher rows (`per_token_rho`); `key` must be secret.
    """
    scores = _scores(teacher_logits, public_logits, clip_norm, temperature, top_k)
    return jax.random.categorical(key, scores).astype(jnp.int32)


def generate(
    teachers: generation.Teachers,
    public_model: generation.PublicModel,
    *,
    prompt: Sequence[int],
    config: InvisibleInkConfig,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> PeerResult:
    """Decodes one text with InvisibleInk: every token is drawn by `step`.

    Args:
        teachers: the ensemble; its `num_teachers` must equal `config.num_teachers`.
        public_model: prefix -> `(V,)` finite logits of a model that reads no sensitive data.
        prompt: the public prefix shared by the teachers and the public model.
        config: the settings (e.g. from `calibrate`).
        key: PRNG key of the sampling; None draws a secret one from the operating system. A key
            from a known seed makes the text reproducible by whoever knows it.
        eos_id: decoding stops after this token (None: no end token).
        stop_sequences: decoding stops once the output ends with one of these.

    Returns:
        A `PeerResult` whose event, charges and ε cover the tokens generated (all private).

    Raises:
        ValueError: the ensemble's size differs from `config.num_teachers`, a stop sequence is
            empty, or the logits have the wrong shape or the public logits are not finite
            (checked on public inputs, before sampling).

    Privacy:
        Reads the teachers only through `step`; each token costs ρ_tok (`per_token_rho`).
    """
    decoding.check_teachers(teachers, config.num_teachers)
    vocab_size = int(teachers.vocab_size)

    def next_token(key, prefix):
        public_logits = jnp.asarray(public_model(prefix), jnp.float32)
        _check_public_logits(public_logits, vocab_size)
        teacher_logits = jnp.asarray(teachers(prefix), jnp.float32)
        if teacher_logits.shape != (config.num_teachers, vocab_size):
            raise ValueError(
                f"teachers returned logits of shape {teacher_logits.shape}, expected "
                f"{(config.num_teachers, vocab_size)}."
            )
        return step(
            key,
            teacher_logits,
            public_logits,
            clip_norm=config.clip_norm,
            temperature=config.temperature,
            top_k=config.top_k,
        )

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
        epsilon=epsilon(config, steps=steps),
        delta=config.delta,
        teacher_forward_passes=config.num_teachers * steps,
        public_forward_passes=steps,
        seeded=decoded.seeded,
    )


def _check_public_logits(public_logits: jax.Array, vocab_size: int) -> None:
    if public_logits.shape != (vocab_size,):
        raise ValueError(
            f"public_model returned logits of shape {public_logits.shape}, expected "
            f"{(vocab_size,)}."
        )
    if not np.isfinite(np.asarray(public_logits)).all():
        raise ValueError("public_model returned non-finite logits; the top-k+ set needs finite.")


class InvisibleInkMethod:
    """InvisibleInk as a `pate.method.Method` (`peer_method`: calibrated for all of a run's
    texts at full length, charged the tokens that ran)."""

    name = "invisibleink"
    label = "InvisibleInk"

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
            allow_large_delta=run.allow_large_delta,
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
        """Every text of the run, each by `generate` with the run's `max_new_tokens`.

        Privacy:
            Reads the teachers only through `step`.
        """
        text_config = dataclasses.replace(plan.config, max_new_tokens=plan.run.max_new_tokens)
        return peer_method.decode_texts(
            generate, text_config, plan.run, teachers, public_model, prompt=prompt, key=key
        )

    def charge(self, plan: Plan, samples: Sequence[PeerResult]) -> Spent:
        """`epsilon` of every token that ran (`peer_method.charge`).

        Privacy:
            Reads the texts' charges only.
        """
        return peer_method.charge(plan, samples, epsilon)


METHOD = InvisibleInkMethod()


def text_batches(num_teachers: int, num_samples: int) -> list[np.ndarray]:
    """The rows each text reads in the disjoint setting: `num_samples` contiguous, disjoint
    batches covering rows 0..n-1, of ⌊n / num_samples⌋ rows or one more (the first ones).

    Raises:
        ValueError: fewer rows than texts (every text needs a batch).

    Privacy:
        Public: a function of n and num_samples only. The rows hold units by a keyed hash, so
        which units a text reads is as secret as that key.
    """
    if not _is_positive_int(num_samples):
        raise ValueError(f"num_samples must be an integer >= 1, got {num_samples!r}.")
    if not _is_positive_int(num_teachers) or num_teachers < num_samples:
        raise ValueError(
            f"num_teachers must be at least num_samples = {num_samples} (one disjoint batch of "
            f"teachers per text), got {num_teachers!r}."
        )
    return np.array_split(np.arange(num_teachers), num_samples)


class _Rows:
    """The teachers restricted to `rows` (every call computes all n rows and keeps these)."""

    def __init__(self, teachers: generation.Teachers, rows: np.ndarray):
        self._teachers = teachers
        self._rows = jnp.asarray(rows)
        self.vocab_size = teachers.vocab_size

    @property
    def num_teachers(self) -> int:
        return int(self._rows.shape[0])

    def __call__(self, prefix: Sequence[int]) -> jax.Array:
        return jnp.asarray(self._teachers(prefix))[self._rows]


class InvisibleInkDisjointMethod:
    """InvisibleInk in its package's setting as a `pate.method.Method`: text i reads only batch
    i of `text_batches`, and the run costs its costliest text (parallel composition)."""

    name = "invisibleink_disjoint"
    label = "InvisibleInk (disjoint batches)"

    def calibrate(self, run: RunSettings) -> Plan:
        """`calibrate` for one text at full length (`run.max_new_tokens` tokens) on the smallest
        batch, ⌊n / num_samples⌋ rows; a larger batch's text costs less with the same clip.

        Raises:
            ValueError: fewer teachers than texts (`text_batches`), or any setting `calibrate`
                rejects.

        Privacy:
            Public: a function of public settings only.
        """
        batches = text_batches(run.num_teachers, run.num_samples)
        config = calibrate(
            epsilon=run.epsilon,
            delta=run.delta,
            max_new_tokens=run.max_new_tokens,
            num_teachers=len(batches[-1]),
            temperature=run.temperature,
            allow_large_delta=run.allow_large_delta,
        )
        charges = worst_case_charges(config)
        return Plan(
            run=run,
            config=config,
            planned_epsilon=epsilon(config, delta=run.delta, **charges),
            mechanism={
                **dataclasses.asdict(config),
                "batches": "disjoint",
                "max_calls": run.max_new_tokens,
            },
            aggregator=self.name,
        )

    def generate(
        self,
        plan: Plan,
        teachers: generation.Teachers,
        public_model: generation.PublicModel,
        *,
        prompt: Sequence[int],
        key: jax.Array | None,
    ) -> list[PeerResult]:
        """Text i by `generate` on batch i's rows only, with the plan's clip and its own key.

        Privacy:
            Text i reads the teachers only through `step`, on its own batch's rows.
        """
        run = plan.run
        decoding.check_teachers(teachers, run.num_teachers)
        batches = text_batches(run.num_teachers, run.num_samples)
        return [
            generate(
                _Rows(teachers, rows),
                public_model,
                prompt=prompt,
                config=dataclasses.replace(plan.config, num_teachers=len(rows)),
                key=text_key,
                eos_id=run.eos_id,
                stop_sequences=run.stop_sequences,
            )
            for rows, text_key in zip(batches, sample_keys(key, run.num_samples), strict=True)
        ]

    def charge(self, plan: Plan, samples: Sequence[PeerResult]) -> Spent:
        """The costliest text's ε (parallel composition over disjoint batches), with the run's
        counts; every call computed all n rows (`teacher_forward_passes`).

        Privacy:
            Reads the texts' charges only.
        """
        sources = [source for sample in samples for source in sample.sources]
        return Spent(
            epsilon=max(sample.epsilon for sample in samples),
            delta=plan.run.delta,
            num_queries=len(sources),
            steps_without_output=sources.count("public"),
            teacher_forward_passes=plan.run.num_teachers * len(sources),
        )


DISJOINT_METHOD = InvisibleInkDisjointMethod()
