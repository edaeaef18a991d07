"""MixMin solvers: exact (non-private) MixMin, DP-MixMin by entropic mirror descent, DP Frank-Wolfe.

All solvers start from the uniform mixture and run as one `lax.scan` (no per-step dispatch or
recompilation). The private solvers take *pre-sampled* padded index batches, so that

- `dp_mixmin` samples every batch on the host first (`PoissonSampler.sample_steps` or
  `UserPoissonSampler.sample_steps`, from the same `DpSgdPlan` that calibrates σ and builds the
  accountant's event), then calls one jitted scan;
- an audit can `jax.vmap` the jitted cores `run_mirror_descent` / `run_frank_wolfe` over noise keys
  and batches to run thousands of independent trials at once.

Example:
    >>> import numpy as np
    >>> preds = np.random.default_rng(0).uniform(0.05, 0.95, size=(2000, 3))
    >>> result = dp_mixmin(preds, epsilon=1.0, delta=1e-5, steps=20, batch_size=200,
    ...                    clip_norm=1.0, learning_rate=1.0, seed=0)
    >>> result.weights.shape, result.epsilon <= 1.0
    ((3,), True)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.mixing import objectives
from dpmix_jax.mixing.objectives import Kind
from dpmix_jax.privacy import (
    accounting,
    clipping,
    correlated_noise,
    cyclic_sampling,
    gaussian_noise,
    plan,
    randomness,
    sampling,
    validation,
)
from dpmix_jax.privacy.adaptive_clipping import (
    AdaptiveClipping,
    centred_count,
    split_noise_multiplier,
)

Solver = Literal["mirror_descent", "frank_wolfe"]
Shift = Literal["none", "mean", "weighted"]
SOLVERS: tuple[str, ...] = ("mirror_descent", "frank_wolfe")
SHIFTS: tuple[str, ...] = ("none", "mean", "weighted")
# Centring, rather than the paper's raw clipping ("none"): in the stored shift study
# (experiments/shift_study.py, docs/shift-study.md), at ε = 1 on the image and text defaults,
# "mean" at the preset's C gave the highest cosine to non-private MixMin and the lowest excess
# MixMin loss, above "none" both at the same C and at the C tuned for "none" on other data draws.
DEFAULT_SHIFT: Shift = "mean"

Examples = dict[str, jax.Array]


class SolverTrace(NamedTuple):
    """Output of a private solver core: the last iterate `(k,)` and every iterate `(T, k)`;
    with adaptive clipping also the clip norms C_1..C_T `(T,)` (after each step's update)."""

    weights: jax.Array
    history: jax.Array
    clip_norms: jax.Array | None = None


# --------------------------------------------------------------------------------------------
# Non-private MixMin.
# --------------------------------------------------------------------------------------------


def mixmin(
    preds: np.ndarray,
    *,
    kind: Kind = "nll",
    targets: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    steps: int = 100,
    learning_rate: float = 1.0,
) -> jax.Array:
    """Exact MixMin: full-batch exponentiated gradient from the uniform mixture, last iterate.

    λ ← λ ⊙ exp(-η ∇F(λ)) / Z, `steps` times (MixMin's defaults: 100 steps, η = 1).

    Args:
        preds, kind, targets, lengths: proxy outputs (see `objectives.prepare_examples`).
        steps: number of updates T >= 1.
        learning_rate: η > 0.

    Returns:
        λ, shape `(k,)`, on the simplex.

    Privacy: not private. Use it on public data, as the non-private reference, or as an upper
    bound; releasing its output on sensitive data is not DP.
    """
    examples = objectives.prepare_examples(preds, kind=kind, targets=targets, lengths=lengths)
    steps = validation.check_steps(steps)
    learning_rate = validation.check_positive(learning_rate, "learning_rate")
    return _exponentiated_gradient(examples, learning_rate, kind=kind, steps=steps)


@functools.partial(jax.jit, static_argnames=("kind", "steps"))
def _exponentiated_gradient(
    examples: Examples, learning_rate: float, *, kind: Kind, steps: int
) -> jax.Array:
    grad = jax.grad(functools.partial(objectives.mean_loss, kind=kind))

    def body(logits, _):
        logits = logits - learning_rate * grad(jax.nn.softmax(logits), examples)
        return logits - jnp.max(logits), None

    num_sources = examples["preds"].shape[1]
    logits, _ = jax.lax.scan(body, jnp.zeros(num_sources, jnp.float32), None, length=steps)
    return jax.nn.softmax(logits)


# --------------------------------------------------------------------------------------------
# Per-example gradient shift and the private gradient sum.
# --------------------------------------------------------------------------------------------


def shifted_example_loss(kind: Kind, shift: Shift) -> Callable[[jax.Array, Examples], jax.Array]:
    """Loss_j with the same value but a per-example shifted gradient g_j - c_j·1.

    - "none": c_j = 0.
    - "mean": c_j = mean_i g_ji; the shifted gradient is the projection of g_j onto the
      sum-zero plane, the smallest-norm member of {g_j - c·1}.
    - "weighted": c_j = ⟨λ, g_j⟩ (orthogonal to λ; for nll this is g_j + 1).

    Exponentiated-gradient updates ignore a constant added to every coordinate and the
    Frank-Wolfe argmin ignores it too, so the shift changes only what clipping does.

    Privacy: a fixed per-example map applied before clipping; clipping still bounds each unit's
    contribution by C, so the sensitivity and the accounting are unchanged.
    """
    if shift not in SHIFTS:
        raise ValueError(f"shift must be one of {SHIFTS}, got {shift!r}.")
    base = functools.partial(objectives.example_loss, kind=kind)
    if shift == "none":
        return base

    def loss(weights, example):
        # `point` equals `weights` exactly (x - x == 0 in floating point) but has Jacobian J, so
        # the gradient is Jᵀ g: J = I - 11ᵀ/k gives g - mean(g)·1; J = I - λ1ᵀ gives g - ⟨λ,g⟩·1.
        if shift == "mean":
            moved = weights - jnp.mean(weights)
        else:
            moved = weights - jax.lax.stop_gradient(weights) * jnp.sum(weights)
        point = jax.lax.stop_gradient(weights) + (moved - jax.lax.stop_gradient(moved))
        return base(point, example)

    return loss


def _gather(examples: Examples, indices: jax.Array) -> Examples:
    # Padding indices (-1) read row 0; the mask zeroes their clipped gradients.
    return jax.tree.map(lambda x: x[jnp.maximum(indices, 0)], examples)


def _run_private(
    init: jax.Array,
    update: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
    to_weights: Callable[[jax.Array], jax.Array],
    examples: Examples,
    batches: jax.Array,
    masks: jax.Array,
    key: jax.Array,
    *,
    kind: Kind,
    clip_norm: float,
    noise_multiplier: jax.Array,
    shift: Shift,
    strategy: tuple[float, ...],
    adaptive_clipping: AdaptiveClipping | None = None,
    expected_batch_size: float | None = None,
) -> SolverTrace:
    """Scans `update(state, noisy_sum, t)` over the batches; t = 1..T.

    `batches`/`masks` are `(T, B)` for example level, `(T, U, G)` for user level. Step t's
    Gaussian draw is `gaussian_noise_tree(jax.random.split(key, T)[t - 1], sum, σ·C)`
    (`privacy.gaussian_noise`);
    the noise added is that draw correlated by the banded `strategy` coefficients
    (`correlated_noise.correlate`; (1.0,) adds the draw itself). With `adaptive_clipping` (C is
    then C_0; independent noise only): step t's key is split into the sum's and the count's
    noise keys, the sum is clipped to C_t with noise σ_Δ·C_t, and C_{t+1} comes from the noisy
    centred count (`privacy.adaptive_clipping`; b = `expected_batch_size`).
    """
    if batches.shape != masks.shape or batches.ndim not in (2, 3):
        raise ValueError(
            "batches and masks must share a shape (T, B) (examples) or (T, U, G) (users), "
            f"got {batches.shape} and {masks.shape}."
        )
    loss = shifted_example_loss(kind, shift)
    if batches.ndim == 3:
        grad_sum = clipping.user_clipped_grad_sum(loss, clip_norm=clip_norm)
    else:
        grad_sum = clipping.clipped_grad_sum(loss, clip_norm=clip_norm)
    steps = batches.shape[0]
    xs = (jnp.arange(1, steps + 1), batches, masks, jax.random.split(key, steps))
    if adaptive_clipping is None:
        stddev = noise_multiplier * clip_norm  # sensitivity C under add/remove of one unit
        banded = correlated_noise.BandedToeplitzStrategy(coefficients=strategy)

        def body(carry, xs):
            state, past_noise = carry
            t, indices, mask, step_key = xs
            total, _ = grad_sum(to_weights(state), _gather(examples, indices), mask)
            draw = gaussian_noise.gaussian_noise_tree(step_key, total, stddev)
            step_noise, past_noise = correlated_noise.correlate(draw, past_noise, banded)
            state = update(state, total + step_noise, t)
            return (state, past_noise), to_weights(state)

        no_noise_yet = tuple(jnp.zeros(init.shape, jnp.float32) for _ in strategy[1:])
        (state, _), history = jax.lax.scan(body, (init, no_noise_yet), xs)
        return SolverTrace(to_weights(state), history)

    if len(strategy) != 1:
        raise ValueError("adaptive clipping runs with independent noise (strategy (1.0,)) only.")
    sigma_b = adaptive_clipping.count_stddev(expected_batch_size, noise_multiplier)
    sigma_delta = adaptive_clipping.gradient_noise_multiplier(noise_multiplier, expected_batch_size)

    def adaptive_body(carry, xs):
        state, clip_t = carry
        t, indices, mask, step_key = xs
        noise_key, count_key = jax.random.split(step_key)
        total, stats = grad_sum(to_weights(state), _gather(examples, indices), mask, clip_t)
        noisy = total + gaussian_noise.gaussian_noise_tree(noise_key, total, sigma_delta * clip_t)
        count_noise = sigma_b * randomness.normal(count_key, 1)[0]
        count = centred_count(stats["unclipped"], mask) + count_noise
        clip_t = adaptive_clipping.next_clip_norm(clip_t, 0.5 + count / expected_batch_size)
        state = update(state, noisy, t)
        return (state, clip_t), (to_weights(state), clip_t)

    (state, _), (history, clips) = jax.lax.scan(adaptive_body, (init, jnp.float32(clip_norm)), xs)
    return SolverTrace(to_weights(state), history, clips)


@functools.partial(
    jax.jit, static_argnames=("kind", "clip_norm", "shift", "strategy", "adaptive_clipping")
)
def run_mirror_descent(
    examples: Examples,
    batches: jax.Array,
    masks: jax.Array,
    key: jax.Array,
    *,
    kind: Kind,
    clip_norm: float,
    noise_multiplier: float,
    expected_batch_size: float,
    learning_rate: float,
    shift: Shift = DEFAULT_SHIFT,
    strategy: tuple[float, ...] = (1.0,),
    adaptive_clipping: AdaptiveClipping | None = None,
) -> SolverTrace:
    """DP entropic mirror descent (Algorithms 1 and 2) on pre-sampled batches; jitted core.

    From λ_0 = uniform, for t = 1..T: per-unit gradients at λ_{t-1} (an example, or the mean over
    a user's sampled examples), shifted (`shifted_example_loss`), clipped to C, summed;
    G = (Σ + N(0, σ²C² I_k)) / b; λ_t ∝ λ_{t-1} ⊙ exp(-η G) (kept as logits, so no weight
    underflows to an absorbing 0).

    Args:
        examples: packed proxy outputs from `objectives.prepare_examples`.
        batches: `(T, B)` example indices, or `(T, U, G)` per-user example indices; -1 is padding.
        masks: bool, same shape as `batches`, True for real entries.
        key: the secret noise key; step t uses `jax.random.split(key, T)[t - 1]`.
        kind: objective kind (static).
        clip_norm: C (static).
        noise_multiplier: σ >= 0 (traced: can be vmapped).
        expected_batch_size: b, the public expected number of units per step (never the
            realised count).
        learning_rate: η.
        shift: per-example gradient shift before clipping (static).
        strategy: the coefficients (c_0, ..., c_{b-1}) of BandMF's banded strategy (static):
            the noise is C⁻¹Z (`correlated_noise`); (1.0,) (default) is independent noise.
        adaptive_clipping: None, or adaptive clipping settings (static): C is then C_0 and the
            trace holds C_1..C_T (`privacy.adaptive_clipping`; σ_b > σ/2 is checked by
            `dp_mixmin`, not here).

    Returns:
        `SolverTrace(weights=λ_T, history=(λ_1..λ_T))`.

    Privacy: with Poisson-sampled batches at rate q, one run is `dpsgd_event(σ, q, T)` under
    add/remove of one unit (example or user), with or without adaptive clipping (whose noise
    split keeps each step one Gaussian mechanism of multiplier σ); with a normalised strategy of
    b bands and cyclic Poisson batches, `correlated_noise.amplified_bandmf_event(σ, q, T, b)`.
    Nothing is checked here: `dp_mixmin` is the validated entry point; callers of the core must
    sample and account themselves.
    """

    def update(logits, noisy_sum, t):
        del t
        logits = logits - learning_rate * noisy_sum / expected_batch_size
        return logits - jnp.max(logits)

    num_sources = examples["preds"].shape[1]
    return _run_private(
        jnp.zeros(num_sources, jnp.float32),
        update,
        jax.nn.softmax,
        examples,
        batches,
        masks,
        key,
        kind=kind,
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        shift=shift,
        strategy=strategy,
        adaptive_clipping=adaptive_clipping,
        expected_batch_size=expected_batch_size,
    )


@functools.partial(
    jax.jit, static_argnames=("kind", "clip_norm", "shift", "strategy", "adaptive_clipping")
)
def run_frank_wolfe(
    examples: Examples,
    batches: jax.Array,
    masks: jax.Array,
    key: jax.Array,
    *,
    kind: Kind,
    clip_norm: float,
    noise_multiplier: float,
    shift: Shift = DEFAULT_SHIFT,
    strategy: tuple[float, ...] = (1.0,),
    adaptive_clipping: AdaptiveClipping | None = None,
    expected_batch_size: float | None = None,
) -> SolverTrace:
    """DP Frank-Wolfe over the simplex on pre-sampled batches; jitted core.

    From λ_0 = uniform, for t = 1..T: S = Σ clip(shifted per-unit gradient at λ_{t-1}) +
    N(0, σ²C² I_k); the linear-minimisation oracle over the simplex picks the vertex
    e_s with s = argmin_i S_i (report-noisy-min); λ_t = (1 - γ_t) λ_{t-1} + γ_t e_s with
    γ_t = 2 / (t + 2). Dividing S by b would not change the argmin, so it is skipped.

    Args:
        examples, batches, masks, key, kind: as in `run_mirror_descent`.
        clip_norm, noise_multiplier, shift, strategy, adaptive_clipping: likewise.
        expected_batch_size: b, needed only with `adaptive_clipping` (the count's normaliser).

    Returns:
        `SolverTrace(weights=λ_T, history=(λ_1..λ_T))`.

    Privacy: the oracle reads the data only through the noisy sum S, the same Poisson-subsampled
    Gaussian mechanism as DP mirror descent (sensitivity C per unit, noise σC); the argmin is
    post-processing. A run is therefore exactly `dpsgd_event(σ, q, T)` under add/remove of one
    unit. (Report-noisy-min releases only log2(k) bits per step, so this is loose; the
    exponential-mechanism oracle of `exponential_oracle` is accounted as a selection instead.)
    """

    def update(weights, noisy_sum, t):
        return frank_wolfe_step(weights, jnp.argmin(noisy_sum), t)

    num_sources = examples["preds"].shape[1]
    return _run_private(
        jnp.full(num_sources, 1.0 / num_sources, jnp.float32),
        update,
        lambda weights: weights,
        examples,
        batches,
        masks,
        key,
        kind=kind,
        clip_norm=clip_norm,
        noise_multiplier=noise_multiplier,
        shift=shift,
        strategy=strategy,
        adaptive_clipping=adaptive_clipping,
        expected_batch_size=expected_batch_size,
    )


def frank_wolfe_step(weights: jax.Array, vertex: jax.Array, t: jax.Array) -> jax.Array:
    """λ_t = (1 - γ_t) λ_{t-1} + γ_t e_vertex with γ_t = 2 / (t + 2): the Frank-Wolfe move from
    `weights` towards the simplex vertex (an index) that step t's linear oracle picked.

    Privacy: post-processing of the oracle's pick.
    """
    gamma = 2.0 / (t + 2.0)
    return (1.0 - gamma) * weights + gamma * jax.nn.one_hot(
        vertex, weights.shape[0], dtype=weights.dtype
    )


# --------------------------------------------------------------------------------------------
# DP-MixMin: plan, sample, run, account.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureRelease:
    """What every private solver of the mixture weights released and what it cost.

    Attributes:
        weights: λ_T, the last iterate, `(k,)` on the simplex (the released mixture).
        average_weights: mean of λ_1..λ_T (also private: post-processing of the same run).
        history: `(T, k)` iterates λ_1..λ_T (private: post-processing).
        epsilon: the accountant's ε at `delta` for the executed mechanism (inf for a no-noise
            control).
        delta: δ.
        steps: T.
        clip_norm: C.
        shift: the per-example gradient shift used.
        num_units: n, examples or users in the mixture split.
        ledger: the `PrivacyLedger` holding the executed step events.
        seeded: True when the caller's seed drove the randomness (reproducible, not private
            against anyone who knows the seed: `privacy.SEEDED_NOTE`); False when it was a
            secret from the operating system.
        allow_large_delta: True when the caller accepted δ >= 1/n (`num_units`), a δ that
            allows publishing a unit in the clear.
    """

    weights: np.ndarray
    average_weights: np.ndarray
    history: np.ndarray
    epsilon: float
    delta: float
    steps: int
    clip_norm: float
    shift: str
    num_units: int
    ledger: accounting.PrivacyLedger
    seeded: bool
    allow_large_delta: bool = False

    @property
    def event(self) -> dp_accounting.DpEvent:
        """The composed event of the run (what the ε was computed from)."""
        return self.ledger.event()

    @property
    def is_private(self) -> bool:
        """False for a no-noise control (ε = inf)."""
        return math.isfinite(self.epsilon)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DpMixMinResult(MixtureRelease):
    """A DP-MixMin run (noisy mirror descent or Frank-Wolfe): `MixtureRelease` and its noise.

    Attributes:
        noise_multiplier: σ used (calibrated, or given; 0 for a no-noise control).
        sampling_rate: q, the Poisson rate of the sampler (per example or per user).
        expected_batch_size: b = q·n (units), the public normaliser.
        solver: "mirror_descent" or "frank_wolfe".
        user_level: whether the unit of privacy is a user.
        accountant: "pld" or "rdp".
        noise: "independent" or "bandmf" (correlated noise with cyclic Poisson sampling; the
            ledger then holds ceil(T / b) cycles).
        bands: b for BandMF, None for independent noise.
        clip_norms: with adaptive clipping, `(T,)` C_1..C_T (public: post-processing of the
            noisy counts); None otherwise (`clip_norm` throughout).
    """

    noise_multiplier: float
    sampling_rate: float
    expected_batch_size: float
    solver: str
    user_level: bool
    accountant: str
    noise: str = "independent"
    bands: int | None = None
    clip_norms: np.ndarray | None = None


def dp_mixmin(
    preds: np.ndarray,
    *,
    kind: Kind = "nll",
    targets: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    user_ids: np.ndarray | None = None,
    max_examples_per_user: int | None = None,
    epsilon: float | None = None,
    delta: float,
    steps: int,
    batch_size: float,
    clip_norm: float,
    learning_rate: float | None = None,
    seed: int | None = None,
    solver: Solver = "mirror_descent",
    accountant: accounting.Accountant = "pld",
    shift: Shift = DEFAULT_SHIFT,
    noise_multiplier: float | None = None,
    allow_large_delta: bool = False,
    noise: plan.Noise = "independent",
    bands: int | None = None,
    adaptive_clipping: AdaptiveClipping | None = None,
) -> DpMixMinResult:
    """DP-MixMin: privately learn mixture weights λ from cached proxy outputs.

    Example level (`user_ids=None`, Algorithm 1): each step Poisson-samples examples with rate
    q = batch_size / n, clips each example's (shifted) λ-gradient to C, sums, adds N(0, σ²C² I_k)
    and divides by the expected batch size before the update. User level (Algorithm 2): each step
    Poisson-samples users with rate q = batch_size / (number of users), takes up to
    `max_examples_per_user` of each sampled user's examples, averages their gradients, clips,
    sums, adds noise and divides by the expected number of users. σ is calibrated to (ε, δ)
    for exactly that rate and T (`plan_dp_sgd`), unless `noise_multiplier` is given.

    Choosing C (`experiments/clip_study.py` measures it on a synthetic problem): C trades
    clipping bias against noise. Per-example nll gradients at uniform λ have norm about √k and
    grow without bound as weights shrink. When C is far below the typical norm, every example is
    rescaled to norm C and the update follows an average of *normalised* gradients, whose fixed
    point is not the MixMin optimum: even without noise the result can be worse than uniform
    weights when nearly every example is clipped.
    Centring (the default `shift="mean"`) removes the part of each gradient the update ignores,
    so fewer gradients are clipped; on the image and text defaults it beat raw clipping
    (`shift="none"`) at the preset's C and at a C tuned for raw clipping (docs/shift-study.md,
    `experiments/shift_study.py`). Pick C around the 90th percentile of per-example gradient
    norms measured on *public* or proxy data (not on the sensitive split, or account for that
    choice), and scale η ∝ 1/C so a step moves the logits by a similar amount (‖G‖ <= C without
    noise). Larger C adds noise σC/b per coordinate;
    larger b = q·n dilutes it.

    Args:
        preds, kind, targets, lengths: proxy outputs on the mixture split (see
            `objectives.prepare_examples`).
        user_ids: `(n,)` user id per example for user-level DP; None for example level.
        max_examples_per_user: G, required with `user_ids` (the paper's G_ULS).
        epsilon: target ε; give exactly one of `epsilon` and `noise_multiplier`.
        delta: δ in (0, 1).
        steps: T.
        batch_size: expected units per step (examples, or users at user level).
        clip_norm: C > 0.
        learning_rate: η for mirror descent (required there); must be None for Frank-Wolfe,
            whose step sizes are 2 / (t + 2).
        seed: None (default): the sampler and the noise key come from a secret drawn from the
            operating system (results differ run to run). An integer seeds both: the run is
            reproducible, `result.seeded` is True, and it is not private against anyone who
            knows the seed.
        solver: "mirror_descent" (the paper's) or "frank_wolfe".
        accountant: "pld" (default) or "rdp".
        shift: per-example gradient shift before clipping: "mean" (default), "weighted", "none".
        noise_multiplier: a fixed σ >= 0; ε is then computed, not targeted. σ = 0 is a no-noise
            control: ε = inf and `result.is_private` is False.
        allow_large_delta: accept δ >= 1/n (n examples, or users at user level), refused by
            default; the result records it.
        noise: "independent" (default) or "bandmf": BandMF's correlated noise with `bands`
            bands and cyclic Poisson sampling (`privacy.DpSgdConfig`): units in `bands`
            partitions by a keyed hash of their id (the key derived from the run's secret
            seed), partition t mod b sampled at step t with rate q = batch_size / (n / bands).
        bands: b for noise="bandmf" (1 <= b <= steps).
        adaptive_clipping: None, or `privacy.adaptive_clipping.AdaptiveClipping` settings: the
            clip norm of the λ-gradients starts at `clip_norm` and follows their target
            quantile (`result.clip_norms` holds C_1..C_T); same σ, same ε.

    Returns:
        A `DpMixMinResult`.

    Raises:
        ValueError: on invalid proxy outputs or settings (see `objectives.prepare_examples`),
            or δ >= 1/n without `allow_large_delta`.

    Privacy: (ε, δ)-DP under add/remove of one example (or one user with all their examples)
    of the mixture split, with ε from the accountant for `dpsgd_event(σ, q, T)` (for BandMF,
    `dpsgd_event(σ, q, ceil(T / b))` at the partition's rate q); the released
    weights, iterates and average are post-processing. Settings (C, η, T, b) chosen by looking
    at the sensitive split are not covered. With an integer `seed` the noise and the sampled
    units can be regenerated by anyone who knows it.
    """
    examples = objectives.prepare_examples(preds, kind=kind, targets=targets, lengths=lengths)
    num_examples = examples["preds"].shape[0]
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}.")
    if shift not in SHIFTS:
        raise ValueError(f"shift must be one of {SHIFTS}, got {shift!r}.")
    if solver == "mirror_descent":
        if learning_rate is None:
            raise ValueError("mirror_descent needs a learning_rate.")
        learning_rate = validation.check_positive(learning_rate, "learning_rate")
    elif learning_rate is not None:
        raise ValueError("frank_wolfe uses step sizes 2/(t+2); learning_rate must be None.")
    if (epsilon is None) == (noise_multiplier is None):
        raise ValueError("give exactly one of epsilon (to calibrate σ) and noise_multiplier.")
    seed, seeded = randomness.resolve_seed(seed)

    users = _users(user_ids, max_examples_per_user, num_examples)
    config = plan.DpSgdConfig(
        epsilon=epsilon,
        delta=delta,
        clip_norm=clip_norm,
        batch_size=batch_size,
        steps=steps,
        noise_multiplier=noise_multiplier,
        accountant=accountant,
        max_examples_per_user=max_examples_per_user,
        allow_large_delta=allow_large_delta,
        noise=noise,
        bands=bands,
    )
    dp_plan = plan.plan_dp_sgd(config, num_units=num_examples if users is None else len(users))
    rng = np.random.default_rng(seed)
    sampler = dp_plan.sampler()
    if config.noise == "bandmf":
        unit_ids = np.arange(num_examples) if users is None else np.unique(user_ids)
        partition_key = hashlib.sha256(f"dp_mixmin/partition/{seed}".encode()).digest()
        parts = cyclic_sampling.cyclic_parts(unit_ids, bands=config.bands, key=partition_key)
        cyclic = (parts,) if users is None else (users, parts)
        batches, masks = sampler.sample_steps(rng, *cyclic, config.steps)[:2]
    else:
        units = num_examples if users is None else users
        batches, masks = sampler.sample_steps(rng, units, config.steps)[:2]
    key = randomness.prng_key(seed)
    strategy = dp_plan.strategy()

    if adaptive_clipping is not None:  # refuses σ_b <= σ/2 before anything runs
        if config.noise == "bandmf":
            raise ValueError(
                "adaptive_clipping runs with independent noise; use noise='independent' or no "
                "adaptive_clipping."
            )
        sigma = dp_plan.noise_multiplier
        split_noise_multiplier(
            sigma, adaptive_clipping.count_stddev(dp_plan.expected_batch_size, sigma)
        )
    common = dict(
        kind=kind,
        clip_norm=config.clip_norm,
        noise_multiplier=dp_plan.noise_multiplier,
        shift=shift,
        strategy=(1.0,) if strategy is None else strategy.coefficients,
        adaptive_clipping=adaptive_clipping,
        expected_batch_size=dp_plan.expected_batch_size,
    )
    arrays = (examples, jnp.asarray(batches), jnp.asarray(masks), key)
    if solver == "mirror_descent":
        trace = run_mirror_descent(*arrays, learning_rate=learning_rate, **common)
    else:
        trace = run_frank_wolfe(*arrays, **common)

    history = np.asarray(trace.history)
    _check_finite(history, solver)
    ledger = accounting.PrivacyLedger()
    ledger.record(dp_plan.step_event(), count=config.accounted_steps)
    return DpMixMinResult(
        weights=np.asarray(trace.weights),
        average_weights=history.mean(axis=0),
        history=history,
        epsilon=ledger.epsilon(config.delta, accountant),
        delta=config.delta,
        noise_multiplier=dp_plan.noise_multiplier,
        sampling_rate=dp_plan.sampling_rate,
        expected_batch_size=dp_plan.expected_batch_size,
        steps=config.steps,
        clip_norm=config.clip_norm,
        solver=solver,
        shift=shift,
        user_level=users is not None,
        num_units=dp_plan.num_units,
        accountant=accountant,
        ledger=ledger,
        seeded=seeded,
        allow_large_delta=config.allow_large_delta,
        noise=config.noise,
        bands=config.bands,
        clip_norms=None if trace.clip_norms is None else np.asarray(trace.clip_norms),
    )


def _check_finite(history: np.ndarray, solver: str) -> None:
    """Raises a ValueError naming the first step whose λ is not finite (e.g. too large a step)."""
    finite = np.isfinite(history).all(axis=1)
    if not finite.all():
        step = int(np.argmin(finite)) + 1
        hint = "lower learning_rate" if solver == "mirror_descent" else "check the proxy outputs"
        raise ValueError(
            f"DP-MixMin ({solver}) produced non-finite mixture weights at step {step} of "
            f"{len(history)}; {hint}."
        )


def _users(
    user_ids: np.ndarray | None, max_examples_per_user: int | None, num_examples: int
) -> list[np.ndarray] | None:
    """Example indices per user, validated; None at example level."""
    if user_ids is None:
        if max_examples_per_user is not None:
            raise ValueError("max_examples_per_user is only used with user_ids (user level).")
        return None
    if max_examples_per_user is None:
        raise ValueError("user-level DP-MixMin needs max_examples_per_user (G).")
    user_ids = np.asarray(user_ids)
    if user_ids.shape != (num_examples,):
        raise ValueError(
            f"user_ids must have one id per example, shape ({num_examples},), got {user_ids.shape}."
        )
    return sampling.group_by_user(user_ids)
