"""Quality of a learned mixture: cosine similarity and L1 distance to a reference λ, excess loss.

Example:
    >>> import numpy as np
    >>> round(cosine_similarity(np.array([0.5, 0.5]), np.array([1.0, 0.0])), 4)
    0.7071
    >>> l1_distance(np.array([0.5, 0.5]), np.array([1.0, 0.0]))
    1.0
"""

from __future__ import annotations

import numpy as np

from dpmix_jax.mixing import objectives
from dpmix_jax.mixing.objectives import Kind


def _pair(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.ndim != 1 or a.shape != b.shape:
        raise ValueError(
            f"expected two weight vectors of equal shape (k,), got {a.shape}, {b.shape}."
        )
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
        raise ValueError("weight vectors must be finite.")
    return a, b


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """⟨a, b⟩ / (‖a‖ ‖b‖) of two weight vectors (1 = same direction)."""
    a, b = _pair(a, b)
    norms = np.linalg.norm(a) * np.linalg.norm(b)
    if norms == 0:
        raise ValueError("cosine similarity of a zero vector is undefined.")
    return float(a @ b / norms)


def uniform_cosine(reference: np.ndarray) -> float:
    """cos(1/k, λ_ref): the uniform mixture's cosine to a mixture λ_ref of k sources."""
    reference = np.asarray(reference, np.float64)
    return cosine_similarity(np.full(len(reference), 1.0 / len(reference)), reference)


def l1_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Σ_i |a_i - b_i| (between 0 and 2 for two mixtures)."""
    a, b = _pair(a, b)
    return float(np.abs(a - b).sum())


def excess_loss(
    weights: np.ndarray,
    reference_weights: np.ndarray,
    preds: np.ndarray,
    *,
    kind: Kind = "nll",
    targets: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
) -> float:
    """F(λ) - F(λ_ref): the MixMin loss of `weights` above that of the reference mixture.

    With λ_ref from non-private MixMin on the same `preds`, this is the excess MixMin loss of a
    private λ (>= 0 up to the reference's optimisation error).

    Privacy: not private; an evaluation metric over the given outputs.
    """
    examples = objectives.prepare_examples(preds, kind=kind, targets=targets, lengths=lengths)
    k = examples["preds"].shape[1]
    weights = objectives.check_weights(weights, k)
    reference = objectives.check_weights(reference_weights, k)
    loss = objectives.mean_loss(weights, examples, kind=kind)
    return float(loss - objectives.mean_loss(reference, examples, kind=kind))
