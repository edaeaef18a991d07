"""Canary audits: empirical lower bounds on ε, and the canaries that make them strong.

An audit runs a private mechanism many times on two neighbouring data sets (with and without one
*canary* record), turns each output into a real *score* (higher means "the canary was there"), and
asks how well any threshold on the score tells the two worlds apart. (ε, δ)-DP forces, for every
test with true- and false-positive rates TPR, FPR (Kairouz et al. 2015):

    TPR <= e^ε FPR + δ   and   1 - FPR <= e^ε (1 - TPR) + δ,

and the same with the worlds swapped (add/remove is symmetric). Clopper-Pearson confidence bounds
on TPR and FPR turn these into a lower bound ε_LB that holds with the stated confidence
(Jagielski, Ullman, Oprea 2020). A mechanism whose ε_LB exceeds its claimed ε violates its claim.

One-run audits (`one_run_epsilon_lower_bound`) need a single run: m canaries, each inserted
independently with probability 1/2, are ranked by score and the number of correct membership
guesses is bounded under the claim, by the binomial tail of Steinke, Nasr, Jagielski (2023) or
by the f-DP recursion of Mahloujifar, Melis, Chaudhuri (2024). Attack statistics: `auroc`,
`tpr_at_fpr` (with an exact interval) and `bootstrap_interval` for any of them.

Statistics use numpy and scipy. Canary constructions cover the λ release of DP-MixMin on `nll`
proxy outputs and DP-SGD (a gradient "dirac" canary, an input-space outlier, and a numerical
canary whose positions cancel, built to catch clipping that under-estimates norms in rounding).

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
from scipy import optimize, special, stats

from dpmix_jax.privacy.validation import check_delta, check_positive

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
        method: "split", "bonferroni" or "fixed" (`epsilon_lower_bound`,
            `epsilon_lower_bound_at`), or "steinke" / "fdp" (`one_run_epsilon_lower_bound`).
        confidence: the overall confidence level.
        details: test details of one-run bounds (guess counts, correct guesses, μ for "fdp");
            None for the many-run bounds. One-run bounds have `tpr_low = fpr_high = nan` and
            `direction = "both"` (the top guesses say "included", the bottom "excluded").
    """

    epsilon: float
    threshold: float
    direction: str
    tpr_low: float
    fpr_high: float
    method: str
    confidence: float
    details: dict | None = None


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
    held_out = epsilon_lower_bound_at(
        with_[half_w:],
        without[half_o:],
        threshold=chosen.threshold,
        direction=chosen.direction,
        delta=delta,
        confidence=confidence,
    )
    return held_out._replace(method=method)


def epsilon_lower_bound_at(
    scores_with: np.ndarray,
    scores_without: np.ndarray,
    *,
    threshold: float,
    direction: str,
    delta: float,
    confidence: float = 0.95,
) -> LowerBound:
    """The ε lower bound of one test fixed before seeing these scores.

    The test guesses "with canary" when score >= `threshold` ("greater") or score < `threshold`
    ("less"); its TPR lower and FPR upper Clopper-Pearson bounds are each at level α/2, so the
    bound holds with probability >= `confidence`. Valid only if the test was chosen
    independently of these scores (e.g. on pilot trials, or from the mechanism's claimed noise).

    Raises:
        ValueError: on invalid scores, `direction`, `delta` or `confidence`.
    """
    with_ = _check_scores(scores_with, "scores_with")
    without = _check_scores(scores_without, "scores_without")
    delta = check_delta(delta)
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    if direction not in ("greater", "less"):
        raise ValueError(f"direction must be 'greater' or 'less', got {direction!r}.")
    k_w, k_o = _counts(with_, np.array([threshold])), _counts(without, np.array([threshold]))
    if direction == "less":
        k_w, k_o = len(with_) - k_w, len(without) - k_o
    alpha = (1.0 - confidence) / 2
    eps, tpr_low, fpr_high = _epsilons(k_w, len(with_), k_o, len(without), alpha, delta)
    return LowerBound(
        max(float(eps[0]), 0.0),
        float(threshold),
        direction,
        float(tpr_low[0]),
        float(fpr_high[0]),
        "fixed",
        confidence,
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
# One-run audits: m canaries, each included with probability 1/2, in a single run.
# --------------------------------------------------------------------------------------------

OneRunMethod = Literal["steinke", "fdp"]
ONE_RUN_METHODS: tuple[str, ...] = ("steinke", "fdp")
_BISECTION_STEPS = 60


def steinke_p_value(canaries: int, guesses: int, correct: int, epsilon: float, delta: float):
    """P[>= `correct` right guesses out of `guesses`] under (ε, δ)-DP (Steinke et al. 2023).

    Steinke, Nasr, Jagielski (2023), "Privacy auditing with one (1) training run": their main
    theorem (δ = 0) and its (ε, δ) extension, computed as in their Appendix D. With m canaries
    each included independently with probability 1/2 and r guesses, the number W of correct
    guesses of an (ε, δ)-DP run satisfies

        P[W >= v] <= P[B >= v] + 2mδ · max_{i=1..v} P[v - i <= B < v] / i,

    with B ~ Binomial(r, e^ε / (1 + e^ε)), the accuracy of ε-randomised response.
    """
    q = 1.0 / (1.0 + math.exp(-epsilon))
    tail = stats.binom.sf(correct - 1, guesses, q)
    if correct == 0 or delta == 0:
        return min(float(tail), 1.0)
    below = np.cumsum(stats.binom.pmf(np.arange(correct - 1, -1, -1), guesses, q))
    spread = float(np.max(below / np.arange(1, correct + 1)))
    return min(float(tail) + 2 * canaries * delta * spread, 1.0)


def gaussian_blow_up_inverse(x: float, mu: float) -> float:
    """Φ(Φ⁻¹(x) - μ): the least probability, under one neighbour, of an event that has
    probability x under the other, for a μ-GDP mechanism (inverse of the blow-up
    x ↦ Φ(Φ⁻¹(x) + μ) = 1 - f_μ(x), with f_μ the Gaussian trade-off function)."""
    return float(special.ndtr(special.ndtri(x) - mu))


def fdp_rejects(canaries: int, guesses: int, correct: int, mu: float, alpha: float) -> bool:
    """Whether `correct` right guesses out of `guesses` reject μ-GDP at level `alpha`.

    Mahloujifar, Melis, Chaudhuri (2024), "Auditing f-differential privacy in one run": if the
    run were f-DP (here f = the μ-GDP trade-off, alphabet size 2 for membership) and
    P[>= c correct] >= α, then the probability mass that the guesses must spread over the
    counts 0..c, computed by the recursion (i = c-1, ..., 0)

        h_c = α (c' - c) / m,  r_c = α c / m,
        h_i = max(h_{i+1}, f̄⁻¹(r_{i+1})),  r_i = r_{i+1} + i / (c' - i) · (h_i - h_{i+1}),

    would exceed the c'/m available (c' = guesses, m = canaries); so r_0 + h_0 > c'/m means
    P[>= c correct] < α under μ-GDP, and observing c correct guesses rejects it.
    """
    h = alpha * (guesses - correct) / canaries
    r = alpha * correct / canaries
    for i in range(correct - 1, -1, -1):
        h_next = max(h, gaussian_blow_up_inverse(r, mu))
        r, h = r + i / (guesses - i) * (h_next - h), h_next
    return r + h > guesses / canaries


def gdp_epsilon(mu: float, delta: float) -> float:
    """ε at δ of μ-GDP: the root of Φ(-ε/μ + μ/2) - e^ε Φ(-ε/μ - μ/2) = δ (Dong et al. 2022)."""

    def excess(eps: float) -> float:
        return (
            special.ndtr(-eps / mu + mu / 2)
            - math.exp(eps + special.log_ndtr(-eps / mu - mu / 2))
            - delta
        )

    if mu <= 0 or excess(0.0) <= 0:
        return 0.0
    upper = 1.0
    while excess(upper) > 0:
        upper *= 2
    return float(optimize.brentq(excess, 0.0, upper, xtol=1e-10))


def _largest(predicate: Callable[[float], bool], upper: float) -> float:
    """sup {x in [0, upper]: predicate(x)} for a predicate true on an initial interval."""
    if not predicate(0.0):
        return 0.0
    if predicate(upper):
        return upper
    low, high = 0.0, upper
    for _ in range(_BISECTION_STEPS):
        mid = (low + high) / 2
        low, high = (mid, high) if predicate(mid) else (low, mid)
    return low


def _guess_counts(canaries: int, num_guesses: int | None) -> list[int]:
    """Guesses per side: the given one, or 1, 2, 4, ... up to m // 2 (and m // 2 itself)."""
    if num_guesses is not None:
        if not isinstance(num_guesses, int | np.integer) or not 1 <= num_guesses <= canaries // 2:
            raise ValueError(
                f"num_guesses must be an integer in [1, {canaries // 2}] (per side, top and "
                f"bottom), got {num_guesses!r}."
            )
        return [int(num_guesses)]
    counts = [2**j for j in range(canaries.bit_length()) if 2**j <= canaries // 2]
    return sorted(set(counts) | {canaries // 2})


def one_run_epsilon_lower_bound(
    scores: np.ndarray,
    included: np.ndarray,
    *,
    delta: float,
    confidence: float = 0.95,
    num_guesses: int | None = None,
    method: OneRunMethod = "steinke",
) -> LowerBound:
    """An ε lower bound from ONE run with m canaries, each included with probability 1/2.

    The auditor ranks the canaries by score and guesses "included" for the top k and
    "excluded" for the bottom k (r = 2k guesses, ties broken by a fixed random order that does
    not depend on `included`), and counts v correct guesses.

    - "steinke": the largest ε whose `steinke_p_value(m, r, v, ε, δ)` is below α = 1 -
      confidence: the run is not (ε, δ)-DP for any smaller ε, with probability >= confidence
      over the canaries' inclusion and the run's randomness.
    - "fdp": the largest μ such that `fdp_rejects(m, r, v, μ, α)`, reported as the ε at δ of
      μ-GDP (`gdp_epsilon`), as Mahloujifar et al. report it: the run is not μ'-GDP for any
      μ' < μ. This is a bound on ε within the Gaussian family of trade-off curves, which the
      subsampled Gaussian mechanism of DP-SGD approaches over many steps; "steinke" makes no
      such assumption.

    With `num_guesses=None`, every k in {1, 2, 4, ..., m // 2} ∪ {m // 2} is tried, each at
    level α / (number of k) (Bonferroni), and the largest bound is returned.

    Args:
        scores: `(m,)` one score per canary, higher meaning "more likely included".
        included: `(m,)` bool, which canaries were inserted (each independently, probability
            1/2; the bound is invalid otherwise).
        delta: δ of the audited claim (for "fdp", the δ at which μ is converted to ε).
        confidence: 1 - α.
        num_guesses: k, guesses per side; None to search.
        method: "steinke" or "fdp".

    Returns:
        A `LowerBound` with `threshold` = the lowest score guessed "included" and `details`
        {"canaries", "guesses_per_side", "guesses", "correct", "level"} (+ "mu" for "fdp").

    Raises:
        ValueError: on mismatched or non-finite inputs, fewer than 2 canaries, or invalid
            `delta`, `confidence`, `num_guesses`, `method`.
    """
    scores = _check_scores(scores, "scores")
    included = np.asarray(included)
    if included.shape != scores.shape or included.dtype != bool:
        raise ValueError(
            f"included must be a bool array of the scores' shape {scores.shape}, got "
            f"{included.dtype} {included.shape}."
        )
    delta = float(delta)
    if not 0 <= delta < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta!r}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    if method not in ONE_RUN_METHODS:
        raise ValueError(f"method must be one of {ONE_RUN_METHODS}, got {method!r}.")
    canaries = len(scores)
    counts = _guess_counts(canaries, num_guesses)
    level = (1.0 - confidence) / len(counts)
    tie_break = np.random.default_rng(0).random(canaries)
    ranked = included[np.lexsort((tie_break, -scores))]
    ordered_scores = np.sort(scores)[::-1]

    best = None
    for k in counts:
        correct = int(ranked[:k].sum() + (~ranked[canaries - k :]).sum())
        guesses = 2 * k
        details = {
            "canaries": canaries,
            "guesses_per_side": k,
            "guesses": guesses,
            "correct": correct,
            "level": level,
        }
        if method == "steinke":
            eps = _largest(
                lambda e, v=correct, r=guesses: steinke_p_value(canaries, r, v, e, delta) < level,
                upper=100.0,
            )
        else:
            mu = _largest(
                lambda u, v=correct, r=guesses: fdp_rejects(canaries, r, v, u, level), upper=40.0
            )
            details["mu"] = mu
            eps = gdp_epsilon(mu, delta) if delta > 0 else math.inf if mu > 0 else 0.0
        if best is None or eps > best.epsilon:
            best = LowerBound(
                float(eps),
                float(ordered_scores[k - 1]),
                "both",
                math.nan,
                math.nan,
                method,
                confidence,
                details,
            )
    return best


# --------------------------------------------------------------------------------------------
# Attack statistics: AUROC, TPR at low FPR, bootstrap intervals.
# --------------------------------------------------------------------------------------------


class TprAtFpr(NamedTuple):
    """The best test with empirical FPR <= a level, and an exact interval on its TPR.

    Attributes:
        tpr: its empirical TPR (the largest among tests with FPR <= level).
        tpr_low, tpr_high: two-sided Clopper-Pearson interval on that TPR at `confidence`
            (each side α/2). The threshold is chosen on the same data, so the interval
            describes the chosen test's TPR, not the best achievable one.
        fpr: its empirical FPR.
        threshold: τ, guessing "with" when score >= τ (inf: the empty test).
    """

    tpr: float
    tpr_low: float
    tpr_high: float
    fpr: float
    threshold: float


def auroc(scores_with: np.ndarray, scores_without: np.ndarray) -> float:
    """Area under the ROC curve: P[S_with > S_without] + P[S_with = S_without] / 2.

    Computed from midranks (the Mann-Whitney U statistic divided by n_with · n_without).
    """
    with_ = _check_scores(scores_with, "scores_with")
    without = _check_scores(scores_without, "scores_without")
    ranks = stats.rankdata(np.concatenate([with_, without]))
    n_w, n_o = len(with_), len(without)
    return float((ranks[:n_w].sum() - n_w * (n_w + 1) / 2) / (n_w * n_o))


def tpr_at_fpr(
    scores_with: np.ndarray,
    scores_without: np.ndarray,
    *,
    fpr_level: float,
    confidence: float = 0.95,
) -> TprAtFpr:
    """The largest TPR of a threshold test ("with" iff score >= τ) whose FPR is <= `fpr_level`.

    Raises:
        ValueError: on invalid scores, `fpr_level` outside [0, 1) or `confidence` outside (0, 1).
    """
    with_ = _check_scores(scores_with, "scores_with")
    without = _check_scores(scores_without, "scores_without")
    if not 0 <= fpr_level < 1:
        raise ValueError(f"fpr_level must be in [0, 1), got {fpr_level!r}.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    thresholds = np.append(np.unique(np.concatenate([with_, without])), np.inf)
    fpr = _counts(without, thresholds) / len(without)
    tpr = _counts(with_, thresholds) / len(with_)
    allowed = np.flatnonzero(fpr <= fpr_level)
    i = allowed[np.argmax(tpr[allowed])]
    hits = np.array([round(tpr[i] * len(with_))])
    low, high = clopper_pearson(hits, len(with_), alpha=(1 - confidence) / 2)
    return TprAtFpr(float(tpr[i]), float(low[0]), float(high[0]), float(fpr[i]), thresholds[i])


def bootstrap_interval(
    statistic: Callable[..., float],
    *samples: np.ndarray,
    confidence: float = 0.95,
    resamples: int = 1000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of `statistic(*samples)`.

    Each sample (e.g. the scores with and without the canary) is resampled with replacement
    independently, `resamples` times, with `numpy.random.default_rng(seed)`; the interval is
    the (α/2, 1 - α/2) quantiles of the statistic over the resamples. An approximate interval
    (unlike Clopper-Pearson), for statistics such as `auroc` or a `tpr_at_fpr` field.

    Raises:
        ValueError: on no sample, an empty sample, `confidence` outside (0, 1), resamples < 10.
    """
    if not samples or any(np.ndim(s) < 1 or len(s) == 0 for s in samples):
        raise ValueError("bootstrap_interval needs at least one non-empty sample.")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}.")
    if not isinstance(resamples, int) or resamples < 10:
        raise ValueError(f"resamples must be an integer >= 10, got {resamples!r}.")
    rng = np.random.default_rng(seed)
    arrays = [np.asarray(s) for s in samples]
    values = np.array(
        [
            statistic(*(a[rng.integers(len(a), size=len(a))] for a in arrays))
            for _ in range(resamples)
        ]
    )
    alpha = 1 - confidence
    low, high = np.quantile(values, [alpha / 2, 1 - alpha / 2])
    return float(low), float(high)


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


def cancelling_canary(
    d_in: int,
    d_out: int,
    *,
    clip_norm: float,
    scale: float = 1e4,
    excess: float = 3.0,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """A numerical canary for a dense layer: two positions whose gradients almost cancel.

    Returns float32 inputs x `(2, d_in)` and output gradients v `(2, d_out)` (feed them to a layer
    `y_t = x_t W` under the loss Σ_t <y_t, v_t>): each position's outer product x_t ⊗ v_t has norm
    `scale`·C, while the example's gradient Σ_t x_t ⊗ v_t has norm about `excess`·C. A clipped
    sum that evaluates norms by their Gram form in float32 (||G||² = Σ_ts (x_t·x_s)(v_t·v_s))
    loses the norm in rounding and, unless it clips by a certified bound, often lets such a
    canary add its whole `excess`·C;
    audits of the default (ghost) path should include these next to `dirac_canary_gradient`.

    Privacy: the canary is one more example; clipping and accounting treat it like any other.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    scale = check_positive(scale, "scale")
    excess = check_positive(excess, "excess")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(d_in)
    x /= np.linalg.norm(x)
    v = rng.standard_normal(d_out)
    v *= scale * clip_norm / np.linalg.norm(v)
    residue = rng.standard_normal(d_out)
    residue *= excess * clip_norm / np.linalg.norm(residue)
    inputs = np.stack([x, x]).astype(np.float32)
    grads = np.stack([v, residue - v]).astype(np.float32)
    return inputs, grads


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
