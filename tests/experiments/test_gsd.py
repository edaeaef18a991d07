"""Gradient subspace distance against principal angles computed independently, and GSD
selection end to end (a tiny `gsd` experiment run)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scipy.linalg

from dpmix_jax import mixing


def _orthonormal(rng, p, d):
    return np.linalg.qr(rng.normal(size=(p, d)))[0]


def _principal_angle_distance(a, b):
    """sqrt(d - Σ cos²θ)/sqrt(d), cos θ the singular values of the bases' cross product."""
    qa, qb = scipy.linalg.orth(a), scipy.linalg.orth(b)
    cosines = np.linalg.svd(qa.T @ qb, compute_uv=False)
    return np.sqrt((qa.shape[1] - np.sum(cosines**2)) / qa.shape[1])


def test_zero_for_identical_one_for_orthogonal_subspaces():
    rng = np.random.default_rng(0)
    basis = _orthonormal(rng, 30, 4)
    assert mixing.projection_distance(basis, basis) == pytest.approx(0.0, abs=1e-7)
    full = _orthonormal(rng, 30, 8)
    assert mixing.projection_distance(full[:, :4], full[:, 4:]) == pytest.approx(1.0)


def test_matches_principal_angles_and_ignores_the_basis():
    rng = np.random.default_rng(1)
    for _ in range(5):
        a, b = _orthonormal(rng, 40, 5), _orthonormal(rng, 40, 5)
        expected = _principal_angle_distance(a, b)
        assert mixing.projection_distance(a, b) == pytest.approx(expected, abs=1e-9)
        angles = scipy.linalg.subspace_angles(a, b)
        assert expected == pytest.approx(np.sqrt(np.mean(np.sin(angles) ** 2)), abs=1e-9)
        rotation = _orthonormal(rng, 5, 5)  # another basis of the same subspace
        assert mixing.projection_distance(a @ rotation, b) == pytest.approx(expected, abs=1e-9)


def test_gradient_subspace_distance_ignores_row_signs_and_scales():
    rng = np.random.default_rng(2)
    grads_a = rng.normal(size=(60, 3)) @ rng.normal(size=(3, 25))  # rank 3
    grads_b = rng.normal(size=(50, 25))
    base = mixing.gradient_subspace_distance(grads_a, grads_b, dim=3)
    flipped = grads_a * rng.choice([-1.0, 1.0], size=(60, 1)) * rng.uniform(0.5, 2, (60, 1))
    assert mixing.gradient_subspace_distance(flipped, grads_b, dim=3) == pytest.approx(base)
    # Same row space, different rows: distance 0.
    mixed = rng.normal(size=(40, 60)) @ grads_a
    assert mixing.gradient_subspace_distance(grads_a, mixed, dim=3) == pytest.approx(0, abs=1e-6)
    for matrix in (grads_b, grads_b.T[:20]):  # tall (n > p) and wide (n < p) gradient matrices
        top = mixing.top_subspace(matrix, 3)
        _, _, vt = np.linalg.svd(matrix)
        assert _principal_angle_distance(top, vt[:3].T) == pytest.approx(0, abs=1e-6)
        np.testing.assert_allclose(top.T @ top, np.eye(3), atol=1e-10)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: mixing.top_subspace(np.ones((3, 4)), 4), "dim"),
        (lambda: mixing.top_subspace(np.ones(4), 1), "gradients"),
        (lambda: mixing.projection_distance(np.eye(4)[:, :2], np.eye(4)[:, :3]), "shapes"),
        (lambda: mixing.projection_distance(2 * np.eye(4)[:, :2], np.eye(4)[:, :2]), "basis_a"),
    ],
)
def test_bad_inputs_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.slow
def test_tiny_gsd_run_writes_its_files(tmp_path):
    from experiments import gsd
    from experiments.configs import gsd as configs

    config = configs.get_config("tiny")
    results = gsd.main(config, tmp_path, reproducible=True)
    for name in ("gsd.json", "gsd.md", "gsd.png"):
        assert (tmp_path / name).stat().st_size > 0
    stored = json.loads((tmp_path / "gsd.json").read_text())
    assert len(stored["single_source"]) == 12
    distances = stored["distances"]["random_init"]
    assert set(distances) >= {"control: transposed images"}
    assert all(0 <= d <= 1 for d in distances.values())
    assert results["gsd_private"] is False
    assert "NOT private" in (tmp_path / "gsd.md").read_text()
