"""Views of several public data sources mixed by weights λ on the simplex.

Two kinds of mixture appear in DP-MixMin pretraining:

* Shared inputs, different label functions (chest X-rays: one image, 14 label sources). The
  mixture is a soft target Σ_i λ_i y_i(x) trained with BCE (`soft_targets`, `SoftTargetSource`).
  λ may also be a matrix (T, k): one mixture per downstream task.
* Different inputs per source (text domains). Each example is drawn from source i with
  probability λ_i, uniformly within the source (`draw_mixture`, `MixtureSource`), or a token budget
  is split in proportion to λ (`allot_token_budget`).

API:
    check_weights(weights, k)                       validated float64 λ of shape (k,) or (T, k)
    soft_targets(labels, weights)                   (n, k) @ λ -> (n,) or (n, T)
    SoftTargetSource(source, weights, *, label_key="labels", target_key="target")
    draw_mixture(sizes, weights, num_draws, *, rng) -> (source_ids, within_ids)
    MixtureSource(sources, weights, *, num_examples, seed)
    allot_token_budget(total_tokens, weights)      integer allotment summing to total_tokens
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpmix_jax.data.sources import Source

_SUM_TOLERANCE = 1e-6


def check_weights(weights: np.ndarray | Sequence[float], k: int) -> np.ndarray:
    """Returns λ as float64 after checking it is finite, non-negative, sums to 1, has k entries.

    Args:
        weights: shape (k,), or (T, k) with one mixture per row.
        k: number of sources.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim not in (1, 2) or weights.shape[-1] != k:
        raise ValueError(f"weights must have shape ({k},) or (T, {k}), got {weights.shape}")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(f"weights must be finite and non-negative, got {weights.tolist()}")
    sums = weights.sum(axis=-1)
    if not np.allclose(sums, 1.0, atol=_SUM_TOLERANCE):
        raise ValueError(
            f"weights must sum to 1 (per row), got sums {np.atleast_1d(sums).tolist()}"
        )
    return weights


def soft_targets(labels: np.ndarray, weights: np.ndarray | Sequence[float]) -> np.ndarray:
    """Mixture targets Σ_i λ_i y_i for shared inputs labelled by k sources.

    Args:
        labels: (n, k) labels in [0, 1], one column per label source.
        weights: λ of shape (k,) or (T, k).

    Returns:
        float32 (n,) for a single mixture, (n, T) for T mixtures.
    """
    labels = np.asarray(labels)
    if labels.ndim != 2:
        raise ValueError(f"labels must have shape (n, k), got {labels.shape}")
    weights = check_weights(weights, labels.shape[1])
    return (labels.astype(np.float64) @ weights.T).astype(np.float32)


class SoftTargetSource(Source):
    """A source whose examples gain `target_key` = soft mixture target of their `label_key` row."""

    def __init__(
        self,
        source: Source,
        weights: np.ndarray | Sequence[float],
        *,
        label_key: str = "labels",
        target_key: str = "target",
    ):
        probe = source._fetch(np.zeros(0, dtype=np.int64))
        if label_key not in probe or probe[label_key].ndim != 2:
            raise ValueError(f"source must provide '{label_key}' rows of k labels")
        self._source = source
        self._weights = check_weights(weights, probe[label_key].shape[1])
        self._label_key = label_key
        self._target_key = target_key

    def __len__(self) -> int:
        return len(self._source)

    @property
    def user_ids(self) -> np.ndarray | None:
        return self._source.user_ids

    @property
    def group_ids(self) -> np.ndarray | None:
        return self._source.group_ids

    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        batch = self._source._fetch(indices)
        batch[self._target_key] = soft_targets(batch[self._label_key], self._weights)
        return batch


def draw_mixture(
    sizes: Sequence[int],
    weights: np.ndarray | Sequence[float],
    num_draws: int,
    *,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray]:
    """Draws examples from k sources: source i with probability λ_i, then uniform within it.

    Args:
        sizes: number of examples of each source.
        weights: λ, shape (k,).
        num_draws: how many examples to draw (with replacement).
        rng: numpy Generator.

    Returns:
        (source_ids, within_ids): int64 arrays of shape (num_draws,).
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    weights = check_weights(weights, len(sizes))
    if weights.ndim != 1:
        raise ValueError("draw_mixture takes a single mixture of shape (k,)")
    empty = (sizes <= 0) & (weights > 0)
    if empty.any():
        raise ValueError(f"sources {np.flatnonzero(empty).tolist()} have weight but no examples")
    if num_draws < 0:
        raise ValueError(f"num_draws must be non-negative, got {num_draws}")
    source_ids = rng.choice(len(sizes), size=num_draws, p=weights / weights.sum())
    within_ids = np.floor(rng.random(num_draws) * sizes[source_ids]).astype(np.int64)
    return source_ids.astype(np.int64), within_ids


class MixtureSource(Source):
    """A fixed random-access draw of `num_examples` examples from sources mixed by λ.

    The draw is made once from `seed`, so index i always names the same example. All sources must
    return the same keys with the same trailing shapes; a `source` key records where each example
    came from.
    """

    def __init__(
        self,
        sources: Sequence[Source],
        weights: np.ndarray | Sequence[float],
        *,
        num_examples: int,
        seed: int,
    ):
        if not sources:
            raise ValueError("MixtureSource needs at least one source")
        self._sources = tuple(sources)
        self._source_ids, self._within_ids = draw_mixture(
            [len(s) for s in self._sources],
            weights,
            num_examples,
            rng=np.random.default_rng(seed),
        )

    def __len__(self) -> int:
        return len(self._source_ids)

    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        source_ids = self._source_ids[indices]
        parts = [
            s._fetch(self._within_ids[indices][source_ids == i])
            for i, s in enumerate(self._sources)
        ]
        out = {}
        for key in parts[0]:
            first = parts[0][key]
            column = np.zeros((len(indices), *first.shape[1:]), dtype=first.dtype)
            for i, part in enumerate(parts):
                if part[key].shape[1:] != first.shape[1:]:
                    raise ValueError(f"sources disagree on the shape of '{key}'")
                column[source_ids == i] = part[key]
            out[key] = column
        out["source"] = source_ids
        return out


def allot_token_budget(total_tokens: int, weights: np.ndarray | Sequence[float]) -> np.ndarray:
    """Splits an integer token budget in proportion to λ (largest remainder; sums exactly).

    Returns:
        int64 array (k,) with Σ = total_tokens and |allotment_i - λ_i·total| < 1.
    """
    if total_tokens < 0:
        raise ValueError(f"total_tokens must be non-negative, got {total_tokens}")
    weights = check_weights(weights, len(np.atleast_1d(weights)))
    if weights.ndim != 1:
        raise ValueError("allot_token_budget takes a single mixture of shape (k,)")
    exact = weights / weights.sum() * total_tokens
    allotment = np.floor(exact).astype(np.int64)
    shortfall = int(total_tokens - allotment.sum())
    # Largest fractional parts first; ties broken by source order so the result is deterministic.
    order = np.lexsort((np.arange(len(exact)), -(exact - allotment)))
    allotment[order[:shortfall]] += 1
    return allotment
