"""Canary audits: empirical lower bounds on ε, and the canaries that make them strong.

An audit runs a private mechanism many times on two neighbouring data sets (with and without one
*canary* record), turns each output into a real *score* (higher means "the canary was there"), and
asks how well any threshold on the score tells the two worlds apart. (ε, δ)-DP forces, for every
test with true- and false-positive rates TPR, FPR (Kairouz et al. 2015):

    TPR <= e^ε FPR + δ   and   1 - FPR <= e^ε (1 - TPR) + δ,

and the same with the worlds swapped (add/remove is symmetric). Clopper-Pearson confidence bounds
on TPR and FPR turn these into a lower bound ε_LB that holds with the stated confidence
(Jagielski, Ullman, Oprea 2020). A mechanism whose ε_LB exceeds its claimed ε violates its claim.

Statistics use only numpy and `scipy.stats.beta`. Canary constructions cover the λ release of
DP-MixMin on `nll` proxy outputs and DP-SGD (a gradient "dirac" canary and an input-space outlier).

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> bound = epsilon_lower_bound(rng.normal(3, 1, 2000), rng.normal(0, 1, 2000), delta=1e-5)
    >>> 4.0 < bound.epsilon < 16.7  # N(3, 1) vs N(0, 1) is (16.7, 1e-5)-indistinguishable
    True
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from scipy import stats

from dpmix_jax.privacy.accounting import check_delta, check_positive

Method = Literal["split", "bonferroni"]
METHODS: tuple[str, ...] = ("split", "bonferroni")
PyTree = Any


# --------------------------------------------------------------------------------------------
# Clopper-Pearson bounds and the ε lower bound.
# --------------------------------------------------------------------------------------------


def clopper_pearson(
    successes: np.ndarray, trials: int, *, alpha: float
) -> tuple[np.ndarray, np.ndarray]:
    """One-sided exact binomial bounds, each at level `alpha`.

    Returns `(lower, upper)` with P[p < lower] <= alpha and P[p > upper] <= alpha for the true
    success probability p: lower = Beta(α; k, n-k+1) quantile (0 when k = 0), upper =
    Beta(1-α; k+1, n-k) quantile (1 when k = n).
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}.")
    k = np.asarray(successes, dtype=np.float64)
    if np.any(k < 0) or np.any(k > trials) or np.any(k != np.round(k)):
        raise ValueError(f"successes must be integers in [0, {trials}].")
    with np.errstate(invalid="ignore", divide="ignore"):
        lower = np.where(k > 0, stats.beta.ppf(alpha, k, trials - k + 1), 0.0)
        upper = np.where(k < trials, stats.beta.ppf(1 - alpha, k + 1, trials - k), 1.0)
    return lower, upper


class LowerBound(NamedTuple):
    """An audit's ε lower bound and the test that achieved it.

    Attributes:
        epsilon: ε_LB >= 0, valid with probability >= `confidence` over the audit's trials.
        threshold: τ of the best test.
        direction: "greater" (guess "with canary" when score >= τ) or "less" (score < τ).
        tpr_low: the Clopper-Pearson lower bound on that test's TPR.
        fpr_high: the Clopper-Pearson upper bound on its FPR.
        method: "split" or "bonferroni" (see `epsilon_lower_bound`).
        confidence: the overall confidence level.
    """

    epsilon: float
    threshold: float
    direction: str
    tpr_low: float
    fpr_high: float
    method: str
    confidence: float


def _counts(scores: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """#{score >= τ} for each τ."""
    ordered = np.sort(scores)
    return len(ordered) - np.searchsorted(ordered, thresholds, side="left")


def _epsilons(
    k_with: np.ndarray, n_with: int, k_without: np.ndarray, n_without: int, alpha, delta
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """max of ln((TPR_lo - δ)/FPR_hi) and ln((1 - FPR_hi - δ)/(1 - TPR_lo)) per threshold.

    `alpha` is the level of each of the two one-sided bounds (a scalar or a pair).
    """
    alpha_tpr, alpha_fpr = np.broadcast_to(np.asarray(alpha, dtype=np.float64), (2,))
    tpr_low, _ = clopper_pearson(k_with, n_with, alpha=alpha_tpr)
    _, fpr_high = clopper_pearson(k_without, n_without, alpha=alpha_fpr)
    with np.errstate(divide="ignore", invalid="ignore"):
        direct = np.log(np.maximum(tpr_low - delta, 0.0)) - np.log(fpr_high)
        complement = np.log(np.maximum(1.0 - fpr_high - delta, 0.0)) - np.log(1.0 - tpr_low)
    return np.maximum(direct, complement), tpr_low, fpr_high


def _all_tests(with_: np.ndarray, without: np.ndarray, alpha, delta):
    """ε per (direction, threshold) over every distinct pooled score, both directions."""
    thresholds = np.unique(np.concatenate([with_, without]))
    k_with, k_without = _counts(with_, thresholds), _counts(without, thresholds)
    n_w, n_o = len(with_), len(without)
    greater = _epsilons(k_with, n_w, k_without, n_o, alpha, delta)
    less = _epsilons(n_w - k_with, n_w, n_o - k_without, n_o, alpha, delta)
    return thresholds, (greater, less)


def _check_scores(scores: np.ndarray, name: str) -> np.ndarray:
    scores = np.asarray(scores, dtype=np.float64)
    if scores.ndim != 1 or len(scores) < 2:
        raise ValueError(f"{name} must be a 1-D array of at least 2 scores, got {scores.shape}.")
    if not np.all(np.isfinite(scores)):
        raise ValueError(f"{name} contains non-finite scores.")
    return scores


def epsilon_lower_bound(
    scores_with: np.ndarray,
    scores_without: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    method: Method = "split",
    seed: int = 0,
) -> LowerBound:
    """A Clopper-Pearson lower bound on ε from audit scores with and without the canary.

    Every threshold τ over the pooled scores defines two tests ("with" iff score >= τ, and iff
    score < τ). For each, with TPR_lo a one-sided lower confidence bound on its TPR and FPR_hi an
    upper one on its FPR,

        ε(τ) = max(ln((TPR_lo - δ) / FPR_hi), ln((1 - FPR_hi - δ) / (1 - TPR_lo))),

    and ε_LB = max over tests of ε(τ), clipped at 0. Choosing the best of many tests on the same
    data would overstate the bound, so one of two corrections is applied:

    - "split" (default, as in the DP-MixMin audit's SELECT/EVAL protocol): each sample is
      shuffled with `seed` and halved; the test is chosen on the first halves, and only that one
      test is evaluated on the second halves, with both one-sided bounds at level α/2
      (α = 1 - confidence), so the bound holds with probability >= confidence.
    - "bonferroni": all tests on all the data. TPR_lo(τ) depends on the data only through the
      count k of scores >= τ, and the event {TPR_lo(τ) > TPR(τ) for some τ} is contained in the
      union over k = 1..n of {Binomial(n, p_k) >= k} events of probability <= α' each; so n
      bounds at level α' hold simultaneously for *every* τ, data-chosen ones included. The four
      families (TPR lower and upper, FPR lower and upper, the upper ones serving the "less" tests)
      each get α/4, split over n: one-sided bounds at α / (4n).

    Args:
        scores_with: `(n_with,)` scores of the trials that included the canary.
        scores_without: `(n_without,)` scores of the trials that did not.
        delta: the δ of the claim being audited.
        confidence: overall confidence 1 - α of the bound, in (0, 1).
        method: "split" or "bonferroni".
        seed: the shuffle of "split" (ignored by "bonferroni").

    Returns:
        A `LowerBound`.

    Raises:
        ValueError: on non-finite scores, fewer than 2 (4 for "split") scores per world, or
            invalid `delta`, `confidence`, `method`.
    """
    with_ = _check_scores(scores_with, "scores_with")
    without = _check_scores(scores_without, "scores_without")
    delta = check_delta(delta)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    alpha = 1.0 - confidence

    if method == "bonferroni":
        levels = (alpha / (4 * len(with_)), alpha / (4 * len(without)))
        thresholds, results = _all_tests(with_, without, levels, delta)
        return _best(thresholds, results, method, confidence)

    if min(len(with_), len(without)) < 4:
        raise ValueError("method='split' needs at least 4 scores per world.")
    rng = np.random.default_rng(seed)
    with_, without = rng.permutation(with_), rng.permutation(without)
    half_w, half_o = len(with_) // 2, len(without) // 2
    thresholds, results = _all_tests(with_[:half_w], without[:half_o], alpha / 2, delta)
    chosen = _best(thresholds, results, method, confidence)
    eval_w, eval_o = with_[half_w:], without[half_o:]
    k_w, k_o = _counts(eval_w, np.array([chosen.threshold])), _counts(eval_o, [chosen.threshold])
    if chosen.direction == "less":
        k_w, k_o = len(eval_w) - k_w, len(eval_o) - k_o
    eps, tpr_low, fpr_high = _epsilons(k_w, len(eval_w), k_o, len(eval_o), alpha / 2, delta)
    return chosen._replace(
        epsilon=max(float(eps[0]), 0.0), tpr_low=float(tpr_low[0]), fpr_high=float(fpr_high[0])
    )


def _best(thresholds, results, method: str, confidence: float) -> LowerBound:
    best = None
    for direction, (eps, tpr_low, fpr_high) in zip(("greater", "less"), results, strict=True):
        i = int(np.argmax(eps))
        if best is None or eps[i] > best.epsilon:
            best = LowerBound(
                float(eps[i]),
                float(thresholds[i]),
                direction,
                float(tpr_low[i]),
                float(fpr_high[i]),
                method,
                confidence,
            )
    return best._replace(epsilon=max(best.epsilon, 0.0))


# --------------------------------------------------------------------------------------------
# Canaries for the λ release of DP-MixMin (nll proxy outputs).
# --------------------------------------------------------------------------------------------


def natural_canary(num_examples: int, *, seed: int) -> int:
    """The index of a natural canary: a uniformly random real example of the sensitive set.

    Its "without" world is the data set with that row removed; its row of proxy outputs is the
    canary. Drawn with `numpy.random.default_rng(seed)`, independently of the data.
    """
    if not isinstance(num_examples, int | np.integer) or num_examples < 2:
        raise ValueError(f"num_examples must be an integer >= 2, got {num_examples!r}.")
    return int(np.random.default_rng(seed).integers(num_examples))


def max_clip_nll_canary(weights: np.ndarray, *, clip_norm: float) -> np.ndarray:
    """A row of `nll` proxy outputs whose clipped λ-gradient is C times a vertex direction.

    Construction: s = argmax_i λ_i (the most weighted source) and the row P = e_s (proxy s gives
    the observed label probability 1, every other proxy 0). Its nll gradient is
    g = -P / <λ, P> = -e_s / λ_s. Gradient shifts g - c·1 (any c; the DP-MixMin solver's "none",
    "mean" and "weighted" shifts are such c) are ignored by the exponentiated-gradient update,
    and the smallest of them (c = mean g) has norm sqrt(1 - 1/k) / λ_s. So whenever
    sqrt(1 - 1/k) / λ_s >= C, every shift's gradient is clipped to norm exactly C and moves the
    centred logits along (e_s - 1/k) / sqrt(1 - 1/k), straight towards source s. Under the mean
    shift the whole clipped norm C lies in that direction: the largest push a single example can
    give; under the other shifts part of C goes to the constant direction, which the update
    ignores.

    Args:
        weights: λ `(k,)` at which the canary is built (e.g. the non-private MixMin optimum of
            the data set, which the audit's adversary knows).
        clip_norm: C.

    Returns:
        The row `(k,)`, float64.

    Raises:
        ValueError: if `weights` is not a probability vector, or if sqrt(1 - 1/k) / max λ < C
            (no nll row can then reach the clip norm towards that source).

    Privacy: an audit tool, not a mechanism. Weights computed non-privately from the sensitive
    set (the adversary's knowledge in an audit) make the canary itself sensitive.
    """
    weights = np.asarray(weights, dtype=np.float64)
    clip_norm = check_positive(clip_norm, "clip_norm")
    if weights.ndim != 1 or len(weights) < 2 or np.any(weights < 0):
        raise ValueError(f"weights must be a (k,) probability vector, k >= 2, got {weights}.")
    if abs(weights.sum() - 1) > 1e-4:
        raise ValueError(f"weights must sum to 1, got {weights.sum():.6g}.")
    k, source = len(weights), int(np.argmax(weights))
    reach = math.sqrt(1 - 1 / k) / weights[source]
    if reach < clip_norm:
        raise ValueError(
            f"a vertex canary for source {source} has gradient norm {reach:.4g} < clip_norm "
            f"{clip_norm:.4g} at these weights; audit with a smaller clip norm."
        )
    return np.eye(k)[source]


def logit_direction(gradient: np.ndarray) -> np.ndarray:
    """The unit direction `(..., k)` in which a λ-gradient moves the centred logits (log λ).

    Mirror descent updates logits by -η·G; the constant part of G is lost in the softmax, so the
    direction is -(g - mean g) / ||g - mean g||.
    """
    gradient = np.asarray(gradient, dtype=np.float64)
    centred = gradient - gradient.mean(axis=-1, keepdims=True)
    norm = np.linalg.norm(centred, axis=-1, keepdims=True)
    if np.any(norm == 0):
        raise ValueError("a constant gradient moves no weight; it has no logit direction.")
    return -centred / norm


def logit_score(weights: np.ndarray, direction: np.ndarray) -> np.ndarray:
    """The audit score of released weights: <log λ - mean log λ, direction>, per trial.

    Args:
        weights: `(..., k)` released λ (one row per trial).
        direction: `(k,)` the canary's `logit_direction`.

    Returns:
        `(...)` scores; a canary that was present pushes its trial's score up.
    """
    logs = np.log(np.maximum(np.asarray(weights, dtype=np.float64), np.finfo(np.float64).tiny))
    return (logs - logs.mean(axis=-1, keepdims=True)) @ np.asarray(direction, dtype=np.float64)


# --------------------------------------------------------------------------------------------
# Canaries for DP-SGD.
# --------------------------------------------------------------------------------------------


def dirac_canary_gradient(params: PyTree, *, index: int, clip_norm: float) -> PyTree:
    """A gradient of norm C on one coordinate: -C at flat position `index` of `params`, else 0.

    With `with_gradient_canary`, the canary example's gradient is this constant whatever the
    parameters, so it survives clipping unchanged, and each DP-SGD step that samples it raises
    that parameter by lr·C / b. Score a trial by the final value of that parameter.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    flat, unravel = ravel_pytree(params)
    if not isinstance(index, int | np.integer) or not 0 <= index < flat.shape[0]:
        raise ValueError(f"index must be an integer in [0, {flat.shape[0]}), got {index!r}.")
    return unravel(jnp.zeros_like(flat).at[index].set(-clip_norm))


def with_gradient_canary(
    loss_fn: Callable[[PyTree, PyTree], jax.Array], canary_gradient: PyTree
) -> Callable[[PyTree, PyTree], jax.Array]:
    """Wraps a per-example loss: examples flagged `example["is_canary"]` become gradient canaries.

    A flagged example's loss is <params, canary_gradient>, whose gradient is `canary_gradient`;
    other examples keep `loss_fn(params, example)` (which must be finite on the canary's
    placeholder fields).

    Privacy: the canary is one more example; clipping and accounting treat it like any other.
    """

    def loss(params: PyTree, example: PyTree) -> jax.Array:
        canary_loss = sum(
            jnp.vdot(p, g)
            for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(canary_gradient), strict=True)
        )
        return jnp.where(example["is_canary"], canary_loss, loss_fn(params, example))

    return loss


def outlier_input(inputs: np.ndarray, *, scale: float) -> np.ndarray:
    """An input-space canary: `scale` times the least-variance principal direction of `inputs`.

    Other examples barely move the model along that direction, so the canary's own (clipped)
    gradient dominates there (ClipBKD, Jagielski et al. 2020). Pair it with a flipped label:
    the label a model fitted without the canary finds least likely at this input.

    Privacy: not private; it reads every input. Use it to audit, never to release.
    """
    inputs = np.asarray(inputs, dtype=np.float64)
    if inputs.ndim != 2 or inputs.shape[0] < 2:
        raise ValueError(f"inputs must be a 2-D (examples, features) array, got {inputs.shape}.")
    scale = check_positive(scale, "scale")
    centred = inputs - inputs.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=True)
    return scale * vt[-1]
