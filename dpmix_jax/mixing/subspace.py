"""Gradient subspace distance (GSD, Gu et al.): how far apart two sets of per-example gradients
are, as the projection metric between their top principal subspaces.

For gradient matrices G (n × p) the top-d right singular vectors V (p × d) span the subspace
the gradients mostly lie in; for two such bases V₁, V₂ with principal angles θ_1..θ_d,

    GSD = sqrt(d - Σ_i cos² θ_i) / sqrt(d) = ‖V₁V₁ᵀ - V₂V₂ᵀ‖_F / sqrt(2d)   ∈ [0, 1],

0 for the same subspace and 1 for orthogonal ones. It depends on the subspaces only, not on the
bases chosen for them, and not on the sign or scale of any single gradient (GᵀG is unchanged).
Knows no model: the gradients come from the caller.

Example:
    >>> import numpy as np
    >>> basis = np.eye(4)[:, :2]
    >>> projection_distance(basis, basis), projection_distance(basis, np.eye(4)[:, 2:])
    (0.0, 1.0)
"""

from __future__ import annotations

import numpy as np


def _matrix(value: np.ndarray, name: str) -> np.ndarray:
    value = np.asarray(value, np.float64)
    if value.ndim != 2 or 0 in value.shape:
        raise ValueError(f"{name} must be a non-empty 2-D array, got shape {value.shape}.")
    if not np.all(np.isfinite(value)):
        raise ValueError(f"{name} must be finite.")
    return value


def top_subspace(gradients: np.ndarray, dim: int) -> np.ndarray:
    """An orthonormal basis `(p, dim)` of the top-`dim` right singular subspace of `gradients`.

    Args:
        gradients: `(n, p)`, one (flattened) per-example gradient per row.
        dim: d, with 1 <= d <= min(n, p).

    Raises:
        ValueError: naming `gradients` or `dim` when invalid.

    Privacy: not private; the basis is a deterministic function of every row. On sensitive
    gradients it must stay inside an accounted mechanism or be treated as non-private.
    """
    gradients = _matrix(gradients, "gradients")
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer):
        raise ValueError(f"dim must be an integer, got {dim!r}.")
    if not 1 <= dim <= min(gradients.shape):
        raise ValueError(f"dim must be in [1, {min(gradients.shape)}], got {dim}.")
    if gradients.shape[0] < gradients.shape[1]:
        # Through the n × n Gram matrix (one matrix product, n²p work, then a small eigenproblem)
        # rather than an SVD of the wide n × p matrix: the top eigenvectors U give V ∝ GᵀU.
        _, vectors = np.linalg.eigh(gradients @ gradients.T)
        return np.linalg.qr(gradients.T @ vectors[:, ::-1][:, :dim])[0]
    _, vectors = np.linalg.eigh(gradients.T @ gradients)
    return vectors[:, ::-1][:, :dim]


def projection_distance(basis_a: np.ndarray, basis_b: np.ndarray) -> float:
    """The projection metric sqrt(d - ‖AᵀB‖_F²)/sqrt(d) between two orthonormal bases `(p, d)`.

    Raises:
        ValueError: if the shapes differ or a basis is not orthonormal.
    """
    basis_a, basis_b = _matrix(basis_a, "basis_a"), _matrix(basis_b, "basis_b")
    if basis_a.shape != basis_b.shape:
        raise ValueError(f"bases must have equal shapes, got {basis_a.shape}, {basis_b.shape}.")
    dim = basis_a.shape[1]
    for name, basis in (("basis_a", basis_a), ("basis_b", basis_b)):
        if not np.allclose(basis.T @ basis, np.eye(dim), atol=1e-6):
            raise ValueError(f"{name} must have orthonormal columns.")
    overlap = float(np.sum((basis_a.T @ basis_b) ** 2))
    return float(np.sqrt(max(dim - overlap, 0.0) / dim))


def gradient_subspace_distance(
    gradients_a: np.ndarray, gradients_b: np.ndarray, *, dim: int
) -> float:
    """GSD between two per-example gradient matrices `(n_a, p)`, `(n_b, p)`: the projection
    metric between their top-`dim` subspaces.

    Privacy: not private (see `top_subspace`): scoring a public source against sensitive
    gradients this way reveals a function of the sensitive data with no DP guarantee.
    """
    return projection_distance(top_subspace(gradients_a, dim), top_subspace(gradients_b, dim))
