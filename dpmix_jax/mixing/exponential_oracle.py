"""DP Frank-Wolfe whose linear oracle is the exponential mechanism over the simplex's vertices.

Over the simplex, Frank-Wolfe's linear oracle only has to pick one of the k vertices, so a private
oracle can *select* one instead of releasing a noisy k-dimensional gradient (Talwar, Thakurta and
Zhang 2015): the exponential mechanism's error grows like ln k, which gives private Frank-Wolfe
its log k dependence on the number of sources. From λ_0 = uniform, for t = 1..T, on the whole
mixture split (no sampling):

- S = Σ_i clip(shifted ∇Loss_i(λ_{t-1})), the sum over every example of the clipped gradients
  that the Gaussian oracle (`solvers.run_frank_wolfe`) sums over a batch, without noise;
- the score of vertex e_j is u_j = -S_j (the lowest linearised loss ⟨S, e_j⟩ scores highest);
- j is drawn with probability ∝ exp(ε_0 u_j / (2Δ)), as report-noisy-max with Gumbel noise:
  argmax_j u_j + (2Δ / ε_0) G_j with G_j independent standard Gumbel, the same law;
- λ_t = (1 - γ_t) λ_{t-1} + γ_t e_j with γ_t = 2 / (t + 2) (`solvers.frank_wolfe_step`).

The sensitivity. Adding or removing one example moves the scores by d, plus or minus that
example's clipped gradient, whose L2 norm is at most C (`privacy.clipping`, float rounding
included), so each score moves by |d_j| <= C. The exponential mechanism needs less than a bound
on each |d_j|: at outcome j its privacy loss is (ε_0 / 2Δ)(d_j - s), where s lies between
min_l d_l and max_l d_l (the log-normaliser moves by a log-average of the exp(ε_0 d_l / 2Δ)), so
the range max_l d_l - min_l d_l <= 2Δ is what must hold. For a vector of L2 norm <= C,
(d_j - d_l)² <= 2(d_j² + d_l²) <= 2C², so the range is at most √2·C (`score_range_bound`;
reached by d = (C, -C)/√2): 2Δ = √2·C, noise √2 smaller than the coordinate bound's 2Δ = 2C at
the same ε_0. Replace-one doubles the range (2√2·C).

The accounting. With 2Δ bounding the range, one selection is ε_0-DP and ε_0-bounded-range (the
log-probability ratios of any two outcomes between neighbours differ by at most ε_0), and an
ε_0-bounded-range mechanism is ε_0²/8-zCDP (Cesar and Rogers 2021), a quarter of the ε_0²/2 of a
generic ε_0-DP mechanism. A run of T selections is `SelfComposedDpEvent(ZCDpEvent(ε_0²/8), T)`
(`exponential_frank_wolfe_event`), composed by `dp_accounting`'s RDP accountant (its PLD
accountant has no zCDP event); ε_0 is calibrated to a target (ε, δ) by
`privacy.accounting.calibrate` (`calibrate_step_epsilon`).

Example:
    >>> import numpy as np
    >>> preds = np.random.default_rng(0).uniform(0.05, 0.95, size=(2000, 3))
    >>> result = dp_exponential_frank_wolfe(preds, epsilon=1.0, delta=1e-5, steps=20,
    ...                                     clip_norm=1.0, seed=0)
    >>> result.weights.shape, result.epsilon <= 1.0
    ((3,), True)
"""

from __future__ import annotations

import dataclasses
import functools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.mixing import objectives, solvers
from dpmix_jax.mixing.objectives import Kind
from dpmix_jax.mixing.solvers import DEFAULT_SHIFT, Examples, Shift, SolverTrace
from dpmix_jax.privacy import accounting, clipping, randomness, validation

# The accountant of every run: zCDP composes in Rényi DP (dp_accounting's PLD has no zCDP event).
ACCOUNTANT: accounting.Accountant = "rdp"


def score_range_bound(clip_norm: float) -> float:
    """2Δ = √2·C: the largest range max_j d_j - min_j d_j of the change d of the scores when one
    example is added or removed (d is a clipped gradient, of L2 norm at most C = `clip_norm`).

    Privacy: the exponential mechanism with probabilities ∝ exp(ε_0 u_j / (2Δ)) is ε_0-DP and
    ε_0-bounded-range under add/remove of one example (the module docstring derives it).
    """
    return math.sqrt(2.0) * validation.check_positive(clip_norm, "clip_norm")


def vertex_scores(
    weights: jax.Array,
    examples: Examples,
    mask: jax.Array,
    *,
    kind: Kind,
    clip_norm: float,
    shift: Shift = DEFAULT_SHIFT,
) -> jax.Array:
    """The oracle's scores u = -Σ_i clip(shifted ∇Loss_i(λ)) `(k,)` over the examples in `mask`.

    Args:
        weights: λ `(k,)`, the current iterate.
        examples: packed proxy outputs from `objectives.prepare_examples`.
        mask: `(n,)` bool, True for the examples of the data set (False rows contribute zero).
        kind: objective kind.
        clip_norm: C, the L2 bound of each example's shifted gradient.
        shift: per-example gradient shift before clipping (`solvers.shifted_example_loss`;
            every vertex's linearised loss moves by the same constant, so the best vertex does
            not change).

    Returns:
        float32 scores; vertex j's is minus the j-th coordinate of the clipped sum.

    Privacy: adding or removing one example moves the scores by a vector of L2 norm at most C:
    each score by at most C, and their range by at most `score_range_bound(C)` = √2·C.
    """
    loss = solvers.shifted_example_loss(kind, shift)
    total, _ = clipping.clipped_grad_sum(loss, clip_norm=clip_norm)(weights, examples, mask)
    return -total


def select_vertex(
    key: jax.Array, scores: jax.Array, *, step_epsilon: float | jax.Array, score_range: float
) -> jax.Array:
    """The exponential mechanism: index j with probability ∝ exp(ε_0 · scores_j / score_range).

    Drawn as report-noisy-max, argmax_j scores_j + (score_range / ε_0) G_j with G_j independent
    standard Gumbel (float32), which has exactly that law (up to float32 rounding); ε_0 = inf
    adds no noise (the exact argmax, a non-private control).

    Args:
        key: the secret key of this selection (fresh for every selection).
        scores: `(k,)` float32 scores u.
        step_epsilon: ε_0 > 0, or inf (traced: can be vmapped).
        score_range: 2Δ, a bound on the range of the change of `scores` between neighbouring
            data sets (`score_range_bound`).

    Returns:
        The selected index, an int32 scalar.

    Privacy: ε_0-DP and ε_0-bounded-range (ε_0²/8-zCDP) when `score_range` bounds the range of
    the change of the scores between neighbours; a key reused for two selections voids that.
    """
    gumbel = jax.random.gumbel(key, scores.shape, jnp.float32)
    return jnp.argmax(scores + (score_range / step_epsilon) * gumbel)


@functools.partial(jax.jit, static_argnames=("kind", "clip_norm", "steps", "shift"))
def run_exponential_frank_wolfe(
    examples: Examples,
    mask: jax.Array,
    key: jax.Array,
    *,
    kind: Kind,
    clip_norm: float,
    step_epsilon: float | jax.Array,
    steps: int,
    shift: Shift = DEFAULT_SHIFT,
) -> SolverTrace:
    """DP Frank-Wolfe over the simplex with the exponential-mechanism oracle; jitted core.

    One `lax.scan` over t = 1..T: scores at λ_{t-1} over every example in `mask`
    (`vertex_scores`), a vertex drawn by `select_vertex` with 2Δ = `score_range_bound(C)`, then
    `solvers.frank_wolfe_step`. Step t's selection uses `jax.random.split(key, T)[t - 1]`.

    Args:
        examples: packed proxy outputs from `objectives.prepare_examples`.
        mask: `(n,)` bool, the examples of the data set (a neighbour masks one row more or less).
        key: the secret key of the run.
        kind: objective kind (static).
        clip_norm: C (static).
        step_epsilon: ε_0 per selection, > 0 or inf (no noise) (traced: can be vmapped).
        steps: T (static).
        shift: per-example gradient shift before clipping (static).

    Returns:
        `SolverTrace(weights=λ_T, history=(λ_1..λ_T))`; every iterate is on the simplex.

    Privacy: `exponential_frank_wolfe_event(ε_0, T)` under add/remove of one example: T adaptive
    selections, each ε_0-bounded-range; the iterates are post-processing of the selections.
    Nothing is checked here: `dp_exponential_frank_wolfe` is the validated entry point.
    """
    score_range = score_range_bound(clip_norm)

    def body(weights, xs):
        t, step_key = xs
        scores = vertex_scores(weights, examples, mask, kind=kind, clip_norm=clip_norm, shift=shift)
        vertex = select_vertex(step_key, scores, step_epsilon=step_epsilon, score_range=score_range)
        weights = solvers.frank_wolfe_step(weights, vertex, t)
        return weights, weights

    num_sources = examples["preds"].shape[1]
    uniform = jnp.full(num_sources, 1.0 / num_sources, jnp.float32)
    xs = (jnp.arange(1, steps + 1), jax.random.split(key, steps))
    weights, history = jax.lax.scan(body, uniform, xs)
    return SolverTrace(weights, history)


# --------------------------------------------------------------------------------------------
# Accounting and the validated entry point.
# --------------------------------------------------------------------------------------------


def selection_event(step_epsilon: float) -> dp_accounting.DpEvent:
    """One selection: `ZCDpEvent(ε_0²/8)` (ε_0-bounded-range), or `NonPrivateDpEvent` for
    ε_0 = inf (the no-noise control).

    Privacy: valid for `select_vertex` at this ε_0 with `score_range` bounding the range of the
    scores' change between neighbours (add/remove of one example for `vertex_scores`).
    """
    if step_epsilon == math.inf:
        return dp_accounting.NonPrivateDpEvent()
    step_epsilon = validation.check_epsilon(step_epsilon, "step_epsilon")
    return dp_accounting.ZCDpEvent(step_epsilon**2 / 8.0)


def exponential_frank_wolfe_event(step_epsilon: float, steps: int) -> dp_accounting.DpEvent:
    """The event of a run: T = `steps` selections at ε_0 = `step_epsilon`, self-composed.

    Privacy: the selections compose adaptively (each step's scores depend on the earlier picks).
    """
    steps = validation.check_steps(steps)
    return dp_accounting.SelfComposedDpEvent(selection_event(step_epsilon), steps)


def calibrate_step_epsilon(*, target_epsilon: float, delta: float, steps: int) -> float:
    """The largest ε_0 (up to a relative 1e-4) whose run of T = `steps` selections has RDP ε at
    most `target_epsilon` at `delta`; the ε of `exponential_frank_wolfe_event` at the returned
    ε_0 was evaluated and found within the target.

    Raises:
        ValueError: a target outside `accounting.CALIBRATION_EPSILON_RANGE`, or invalid δ or T.

    Privacy: reads no data; the run's ε is the accountant's for exactly this ε_0.
    """
    steps = validation.check_steps(steps)
    # calibrate searches a noise scale, here the temperature 1/ε_0 (in units of the range 2Δ);
    # dp_accounting's bracket search starts at temperature 0, no noise (ε_0 = inf).
    temperature = accounting.calibrate(
        lambda scale: exponential_frank_wolfe_event(1.0 / scale if scale else math.inf, steps),
        target_epsilon=target_epsilon,
        delta=delta,
        accountant=ACCOUNTANT,
    )
    return 1.0 / temperature


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExponentialFrankWolfeResult(solvers.MixtureRelease):
    """A run of DP Frank-Wolfe with the exponential-mechanism oracle: `solvers.MixtureRelease`
    (its ledger the T selections, its ε the RDP accountant's, inf for ε_0 = inf; every step
    reads all `num_units` examples of the mixture split) and its selections' ε_0.

    Attributes:
        step_epsilon: ε_0 of each selection (calibrated, or given).
    """

    step_epsilon: float


def dp_exponential_frank_wolfe(
    preds: np.ndarray,
    *,
    kind: Kind = "nll",
    targets: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
    epsilon: float | None = None,
    step_epsilon: float | None = None,
    delta: float,
    steps: int,
    clip_norm: float,
    seed: int | None = None,
    shift: Shift = DEFAULT_SHIFT,
    allow_large_delta: bool = False,
) -> ExponentialFrankWolfeResult:
    """DP-MixMin's mixture weights by Frank-Wolfe with the exponential-mechanism oracle.

    Every step reads the whole mixture split: the clipped (shifted) per-example λ-gradients are
    summed and the vertex is drawn by the exponential mechanism on their negation (module
    docstring). ε_0 is calibrated so that the T selections compose to (ε, δ), unless
    `step_epsilon` is given. Choose C as for `solvers.dp_mixmin` (from public data), and T by
    `scaling.frank_wolfe_steps`.

    Args:
        preds, kind, targets, lengths: proxy outputs on the mixture split (see
            `objectives.prepare_examples`).
        epsilon: target ε; give exactly one of `epsilon` and `step_epsilon`.
        step_epsilon: a fixed ε_0 > 0 per selection; ε is then computed, not targeted.
            ε_0 = inf is a no-noise control: ε = inf and `result.is_private` is False.
        delta: δ in (0, 1), below 1/n unless `allow_large_delta`.
        steps: T.
        clip_norm: C > 0.
        seed: None (default): the selections' key is a secret from the operating system. An
            integer seeds it: the run is reproducible, `result.seeded` is True, and it is not
            private against anyone who knows the seed.
        shift: per-example gradient shift before clipping: "mean" (default), "weighted", "none".
        allow_large_delta: accept δ >= 1/n, refused by default; the result records it.

    Returns:
        An `ExponentialFrankWolfeResult`.

    Raises:
        ValueError: on invalid proxy outputs or settings, or δ >= 1/n without
            `allow_large_delta`.

    Privacy: (ε, δ)-DP under add/remove of one example of the mixture split, with ε from
    `dp_accounting`'s RDP accountant for `exponential_frank_wolfe_event(ε_0, T)`; the released
    weights, iterates and average are post-processing. Settings (C, T) chosen by looking at the
    sensitive split are not covered. With an integer `seed` the selections' noise can be
    regenerated by anyone who knows it.
    """
    examples = objectives.prepare_examples(preds, kind=kind, targets=targets, lengths=lengths)
    num_examples = examples["preds"].shape[0]
    if shift not in solvers.SHIFTS:
        raise ValueError(f"shift must be one of {solvers.SHIFTS}, got {shift!r}.")
    steps = validation.check_steps(steps)
    clip_norm = validation.check_positive(clip_norm, "clip_norm")
    delta = validation.check_delta_for_units(
        delta, num_examples, unit="examples", allow_large_delta=allow_large_delta
    )
    if (epsilon is None) == (step_epsilon is None):
        raise ValueError("give exactly one of epsilon (to calibrate ε_0) and step_epsilon.")
    if epsilon is not None:
        step_epsilon = calibrate_step_epsilon(target_epsilon=epsilon, delta=delta, steps=steps)
    ledger = accounting.PrivacyLedger()
    ledger.record(selection_event(step_epsilon), count=steps)  # validates step_epsilon
    seed, seeded = randomness.resolve_seed(seed)

    trace = run_exponential_frank_wolfe(
        examples,
        jnp.ones(num_examples, bool),
        randomness.prng_key(seed),
        kind=kind,
        clip_norm=clip_norm,
        step_epsilon=float(step_epsilon),
        steps=steps,
        shift=shift,
    )
    history = np.asarray(trace.history)
    return ExponentialFrankWolfeResult(
        weights=np.asarray(trace.weights),
        average_weights=history.mean(axis=0),
        history=history,
        epsilon=ledger.epsilon(delta, ACCOUNTANT),
        delta=delta,
        step_epsilon=float(step_epsilon),
        steps=steps,
        clip_norm=clip_norm,
        shift=shift,
        num_units=num_examples,
        ledger=ledger,
        seeded=seeded,
        allow_large_delta=allow_large_delta,
    )
