"""Diversity-transfer metrics of vote histograms `(r, V)` over a grid of thresholds.

* coverage(T): mean over the r histograms of Σ_{c_j >= T} c_j / n (= the yield of TWS_{T,1});
* transferred support(T): how many tokens reach c_j >= T in at least one histogram;
* yield of TARGMAX_T (Pr[max_j c_j >= T]) and of TWS_{T,γ} (E[min(1, γ·M_T/n)]);
* maximum passing threshold with k tries: max over k histograms of max_j c_j;
* the largest threshold at which coverage still reaches a level;
* top-1 minus top-2 margin of each histogram.

Examples:
    >>> import jax.numpy as jnp
    >>> h = jnp.array([[3, 1, 0], [2, 2, 0]])
    >>> [round(float(x), 3) for x in coverage(h, jnp.array([2.0, 3.0]))]
    [0.875, 0.375]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "coverage",
    "max_passing_threshold",
    "summarize",
    "targmax_yield",
    "threshold_at_coverage",
    "threshold_grid",
    "top_margin",
    "transferred_support",
    "tws_yield",
]


def _check(histograms: jax.Array) -> jax.Array:
    if getattr(histograms, "ndim", None) != 2:
        shape = getattr(histograms, "shape", None)
        raise ValueError(f"histograms must have shape (r, V), got {shape}.")
    return jnp.asarray(histograms)


def threshold_grid(num_teachers: int, num: int = 20) -> np.ndarray:
    """`num` thresholds spaced geometrically from n/16 to n/2 (the paper's 2^linspace(5, 8))."""
    if num_teachers < 2 or num < 1:
        raise ValueError(f"need num_teachers >= 2 and num >= 1, got {num_teachers}, {num}.")
    return np.geomspace(num_teachers / 16, num_teachers / 2, num)


@jax.jit
def _passing_mass(histograms: jax.Array, thresholds: jax.Array) -> jax.Array:
    """(len(T), r) mass Σ_{c_j >= T} c_j per histogram."""
    return jax.vmap(lambda t: jnp.sum(jnp.where(histograms >= t, histograms, 0), axis=-1))(
        thresholds
    )


def coverage(histograms: jax.Array, thresholds: jax.Array) -> jax.Array:
    """Mean over histograms of the fraction of votes on tokens with >= T votes, per threshold."""
    histograms = _check(histograms)
    n = jnp.sum(histograms[0])
    return jnp.mean(_passing_mass(histograms, jnp.asarray(thresholds)), axis=-1) / n


@jax.jit
def transferred_support(histograms: jax.Array, thresholds: jax.Array) -> jax.Array:
    """Number of tokens with >= T votes in at least one histogram, per threshold."""
    best = jnp.max(histograms, axis=0)
    return jax.vmap(lambda t: jnp.sum(best >= t))(jnp.asarray(thresholds))


@jax.jit
def targmax_yield(histograms: jax.Array, thresholds: jax.Array) -> jax.Array:
    """Fraction of histograms on which TARGMAX_T outputs a token, per threshold."""
    top = jnp.max(histograms, axis=-1)
    return jax.vmap(lambda t: jnp.mean(top >= t))(jnp.asarray(thresholds))


def tws_yield(histograms: jax.Array, thresholds: jax.Array, gamma: float = 1.0) -> jax.Array:
    """Expected yield of TWS_{T,γ}: mean of min(1, γ·M_T/n), per threshold."""
    histograms = _check(histograms)
    n = jnp.sum(histograms[0])
    mass = _passing_mass(histograms, jnp.asarray(thresholds))
    return jnp.mean(jnp.minimum(1.0, gamma * mass / n), axis=-1)


def max_passing_threshold(histograms: jax.Array, tries: int) -> tuple[float, float]:
    """Mean and standard error over groups of `tries` histograms of max_group max_j c_j.

    The r histograms are split into r // tries disjoint groups (a remainder is dropped).
    """
    histograms = _check(histograms)
    if not 1 <= tries <= histograms.shape[0]:
        raise ValueError(f"tries must be in [1, r = {histograms.shape[0]}], got {tries}.")
    groups = histograms.shape[0] // tries
    top = np.asarray(jnp.max(histograms[: groups * tries], axis=-1)).reshape(groups, tries)
    best = top.max(axis=1).astype(float)
    stderr = float(best.std(ddof=1) / np.sqrt(groups)) if groups > 1 else 0.0
    return float(best.mean()), stderr


def threshold_at_coverage(
    histograms: jax.Array, level: float, thresholds: np.ndarray | None = None
) -> float:
    """The largest threshold T with coverage(T) >= `level` (0.0 if none reaches it).

    Exact in one pass over the counts: the votes on tokens with c_j >= T, pooled over the r
    histograms, are a tail sum of the vote mass per count value.

    Args:
        histograms: `(r, V)` integer vote counts, each row summing to n.
        level: the coverage to reach, in (0, 1].
        thresholds: candidate thresholds; None means every integer 1..n.
    """
    counts = np.asarray(_check(histograms))
    if not 0 < level <= 1:
        raise ValueError(f"level must be in (0, 1], got {level!r}.")
    if counts.size == 0 or (counts < 0).any() or (counts != np.round(counts)).any():
        raise ValueError("histograms must be non-empty counts: integers >= 0.")
    counts = counts.astype(np.int64)
    totals = counts.sum(axis=1)
    if (totals != totals[0]).any() or totals[0] < 1:
        raise ValueError(
            f"every histogram must hold the same n >= 1 votes, got row sums {sorted(set(totals))}."
        )
    n = int(totals[0])
    mass = np.bincount(counts.ravel(), weights=counts.ravel(), minlength=n + 2)
    tail = np.cumsum(mass[::-1])[::-1] / (counts.shape[0] * n)  # tail[v]: coverage at T = v
    if thresholds is None:
        thresholds = np.arange(1, n + 1)
    thresholds = np.asarray(thresholds, np.float64)
    at = tail[np.clip(np.ceil(thresholds), 0, n + 1).astype(np.int64)]
    reached = at >= level
    return float(thresholds[reached].max()) if reached.any() else 0.0


@jax.jit
def top_margin(histograms: jax.Array) -> jax.Array:
    """Top-1 minus top-2 vote count of each histogram, `(r,)`."""
    top2 = jax.lax.top_k(histograms, 2)[0]
    return top2[:, 0] - top2[:, 1]


def summarize(
    histograms: jax.Array, thresholds: np.ndarray, *, gamma: float = 1.0, tries=(1, 5, 10)
) -> dict:
    """All metrics of one batch of histograms as plain Python values (for JSON)."""
    histograms = _check(histograms)
    thresholds = jnp.asarray(thresholds, jnp.float32)
    margins = np.asarray(top_margin(histograms))
    return {
        "thresholds": [float(t) for t in thresholds],
        "coverage": np.asarray(coverage(histograms, thresholds)).tolist(),
        "support": np.asarray(transferred_support(histograms, thresholds)).tolist(),
        "targmax_yield": np.asarray(targmax_yield(histograms, thresholds)).tolist(),
        "tws_yield": np.asarray(tws_yield(histograms, thresholds, gamma)).tolist(),
        "max_passing_threshold": {
            str(k): max_passing_threshold(histograms, k) for k in tries if k <= histograms.shape[0]
        },
        "mean_top_margin": float(margins.mean()),
    }
