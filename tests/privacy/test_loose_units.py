"""Float64 norm bounds of loose units, against exact (rational) computations."""

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.privacy import loose_units


def _exact_square(uses, sizes) -> Fraction:
    """||Σ_uses Σ_t l_t ⊗ r_t||² in exact rational arithmetic (ids as one-hot rows)."""
    n, m = sizes
    grad = [[Fraction(0)] * m for _ in range(n)]
    for (left, left_ids), (right, right_ids) in uses:
        left = np.eye(n, dtype=np.float32)[left[0]] if left_ids else left[0]
        right = np.eye(m, dtype=np.float32)[right[0]] if right_ids else right[0]
        for t in range(left.shape[0]):
            for i in np.nonzero(left[t])[0]:
                for j in np.nonzero(right[t])[0]:
                    grad[i][j] += Fraction(float(left[t, i])) * Fraction(float(right[t, j]))
    return sum(x * x for row in grad for x in row)


def _cancelling_use(rng, positions, n, m, scale):
    left = rng.standard_normal((1, positions, n)).astype(np.float32)
    right = (scale * rng.standard_normal((1, positions, m))).astype(np.float32)
    right[:, 1::2] = -right[:, 0::2] + rng.standard_normal(right[:, 1::2].shape).astype(np.float32)
    left[:, 1::2] = left[:, 0::2]
    return (left, False), (right, False)


def _triangle(uses):
    total = 0.0
    for (left, left_ids), (right, right_ids) in uses:
        norms = [np.ones(x.shape[1]) if ids else np.linalg.norm(x[0].astype(np.float64), axis=1)
                 for x, ids in ((left, left_ids), (right, right_ids))]  # fmt: skip
        total += float(np.sum(norms[0] * norms[1]))
    return np.float32(total * (1 + 1e-6))


@pytest.mark.parametrize("block", [None, 6])
def test_the_bound_is_above_the_exact_norm_and_tight_on_cancelling_positions(block, monkeypatch):
    # Positions cancelling by about 10⁶ in norm, a tied table (ids and a dense use), and with
    # 6 entries per block the gradient formed in 2-3 blocks, the last overlapping.
    if block is not None:
        monkeypatch.setattr(loose_units, "BLOCK_ELEMENTS", block)
    rng = np.random.default_rng(0)
    dense = [_cancelling_use(rng, 4, 3, 5, scale=1e6)]
    ids = np.array([[1, 1, 3, 0]], np.int32)
    rows = rng.standard_normal((1, 4, 2)).astype(np.float32)
    head = rng.standard_normal((1, 3, 4)).astype(np.float32)
    tied = [((ids, True), (rows, False)), ((head, False), (rng.standard_normal((1, 3, 2)).astype(
        np.float32), False))]  # fmt: skip
    for uses, sizes in ((dense, (3, 5)), (tied, (4, 2))):
        with jax.enable_x64(True):
            bound = loose_units.materialised_square(uses, sizes, _triangle(uses))
        exact = _exact_square(uses, sizes)
        assert Fraction(float(bound)) >= exact
        assert float(bound) <= float(exact) * (1 + 1e-5) + 1e-30


def test_unit_rows_is_an_exact_slice_that_ignores_other_units_non_finite_values():
    x = jnp.asarray([[1.5, -2.0], [np.inf, np.nan], [3.0, 1e-30]], jnp.float32)
    np.testing.assert_array_equal(loose_units.unit_rows(x, jnp.asarray(2)), x[2:3])
    ids = jnp.asarray([[4, 5], [7, 8]], jnp.int32)
    np.testing.assert_array_equal(loose_units.unit_rows(ids, jnp.asarray(1)), ids[1:2])


def test_only_loose_units_are_bounded_and_each_from_its_own_rows():
    rng = np.random.default_rng(1)
    left = rng.standard_normal((3, 4, 3)).astype(np.float32)
    right = rng.standard_normal((3, 4, 2)).astype(np.float32)
    triangles = jnp.asarray([[50.0, 50.0, 50.0]], jnp.float32)
    loose = jnp.asarray([True, False, True])
    factors = [[((jnp.asarray(left), False), (jnp.asarray(right), False))]]
    bounds = np.asarray(loose_units.float64_square_bounds(factors, [(3, 2)], triangles, loose))
    assert np.isinf(bounds[0, 1])
    for j in (0, 2):
        exact = np.sum(np.einsum("ti,tj->ij", left[j].astype(np.float64), right[j]) ** 2)
        np.testing.assert_allclose(bounds[0, j], exact, rtol=1e-5)
        assert bounds[0, j] >= exact
