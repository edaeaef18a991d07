"""Float64 norm bounds of the units on which a certified float32 bound is loose.

The ghost path bounds a unit's gradient Σ_t u_t ⊗ v_t by a Gram form whose certified float32
rounding bound grows with Σ_t ||u_t|| ||v_t||: for positions that cancel, the bound can be many
times the norm, and the unit is clipped far harder than its norm would have it. Such a unit is
bounded again here, from its gradient formed in float64 out of its own float32 factors: products
of float32 values are exact in float64, so every entry errs by at most γ⁶⁴_T times its
Σ_t |u_t||v_t|, the whole gradient by at most γ⁶⁴_T·Σ_t ||u_t|| ||v_t|| in norm (positions that
cancel by 10¹⁰ still get a bound within about 1e-3 of their norm at T = 384).

`float64_square_bounds` visits the loose units one at a time in one `lax.while_loop` (no pass
when there are none) and bounds all their parameters at once: one loop and one body, however deep
the model. A loose unit costs about one float64 weight-gradient computation of those parameters
for its rows (T·n·m per parameter), `BLOCK_ELEMENTS` entries at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dpmix_jax.privacy import summation
from dpmix_jax.privacy.clipping import UNIT_ROUNDOFF

# Entries of a loose unit's float64 gradient formed at a time (32 MiB).
BLOCK_ELEMENTS = 2**22


def unit_rows(x: jax.Array, j: jax.Array) -> jax.Array:
    """x[j:j + 1] for a traced j, as a masked sum over the units: on a mesh that shards the units,
    each device sums its own and one small all-reduce follows, where a slice at a traced index
    would gather the whole array first (exact: the other units add exact zeros)."""
    chosen = (jnp.arange(x.shape[0]) == j).reshape(-1, *([1] * (x.ndim - 1)))
    return jnp.sum(jnp.where(chosen, x, jnp.zeros((), x.dtype)), axis=0, keepdims=True)


def materialised_square(uses: list, sizes: tuple[int, int], triangle: jax.Array) -> jax.Array:
    """A float32 upper bound of the squared norm of one unit's gradient Σ_uses Σ_t l_t ⊗ r_t of
    a matrix parameter of layout `sizes` (n, m), from its rows `uses` [((l, is_ids), (r,
    is_ids))] ((1, T, ·) floats, or (1, T) int ids read as one-hot rows) and `triangle` >=
    Σ_uses Σ_t ||l_t|| ||r_t||, by forming the gradient in float64, `BLOCK_ELEMENTS` entries at
    a time along its longer axis (the last block overlapping the one before it rather than
    overrun). Its computed squared norm, a sum of n·m non-negative roundings, is within γ⁶⁴_nm of
    its own; the gradient within γ⁶⁴_T·triangle (module docstring).

    Privacy: a bound computed from the unit's own data only; it serves only to clip.
    """
    n, m = sizes
    along_left = n >= m
    longer, shorter = (n, m) if along_left else (m, n)
    block = max(1, min(longer, BLOCK_ELEMENTS // shorter))
    blocks = -(-longer // block)

    def window(x, is_ids, size, start, first):
        """Columns [start, start + size) of the rows in float64, those below `first` zeroed."""
        columns = start + jnp.arange(size)
        if is_ids:
            return ((x[..., None] == columns) & (columns >= first)).astype(summation.ACCUMULATION)
        x = summation.wide(jax.lax.dynamic_slice_in_dim(x, start, size, axis=2))
        return jnp.where(columns >= first, x, 0.0)

    def square_of_block(b):
        first = b * block
        start = jnp.minimum(first, longer - block)
        total = 0.0
        for (left, left_ids), (right, right_ids) in uses:
            if along_left:
                left = window(left, left_ids, block, start, first)
                right = window(right, right_ids, shorter, 0, 0)
            else:
                left = window(left, left_ids, shorter, 0, 0)
                right = window(right, right_ids, block, start, first)
            total = total + jnp.einsum(
                "bti,btj->ij", left, right, precision=jax.lax.Precision.HIGHEST
            )
        return jnp.sum(jnp.square(total))

    if blocks == 1:
        square = square_of_block(0)
    else:
        zero = jnp.zeros((), summation.ACCUMULATION)
        square = jax.lax.fori_loop(0, blocks, lambda b, acc: acc + square_of_block(b), zero)
    rows = sum(use[0][0].shape[1] for use in uses)
    gamma = summation.float64_gamma
    norm = jnp.sqrt(square * (1.0 + 2.0 * gamma(n * m + blocks + 1))) * (1.0 + 2.0**-52)
    norm = norm + gamma(rows + 1) * summation.wide(triangle) * (1.0 + 2.0**-50)
    # Rounded up into float32: the float64 square, the conversion and the product.
    square = (jnp.square(norm) * (1.0 + 4.0 * 2.0**-53)).astype(jnp.float32)
    return square * (1.0 + 4.0 * UNIT_ROUNDOFF)


@summation.in_float64
def float64_square_bounds(
    factors: list, sizes: list, triangles: jax.Array, loose: jax.Array
) -> jax.Array:
    """(G, U) float32 upper bounds of the squared norms of G matrix parameters of the `loose`
    units, inf elsewhere.

    Args:
        factors: per parameter, per use, ((left, is_ids), (right, is_ids)): the (U, T, ·)
            factor arrays (or (U, T) ids) of all the units.
        sizes: per parameter, its layout (n, m).
        triangles: (G, U) bounds of Σ_t ||l_t|| ||r_t|| over each parameter's uses.
        loose: (U,) the units to bound, each chosen from its own data only.

    Privacy: each unit's bounds are computed from its own data; they serve only to clip.
    """
    order = jnp.argsort(jnp.logical_not(loose), stable=True)  # the loose units first

    def visit(state):
        step, tight = state
        j = order[step]
        values = [
            materialised_square(
                [tuple((unit_rows(x, j), is_ids) for x, is_ids in use) for use in uses],
                size,
                bound,
            )
            for uses, size, bound in zip(factors, sizes, unit_rows(triangles.T, j)[0], strict=True)
        ]
        chosen = jnp.arange(tight.shape[1]) == j
        return step + 1, jnp.where(chosen, jnp.stack(values)[:, None], tight)

    unbounded = jnp.full((len(factors), loose.shape[0]), jnp.inf, jnp.float32)
    count = jnp.sum(loose, dtype=jnp.int32)
    init = (jnp.zeros((), jnp.int32), unbounded)
    return jax.lax.while_loop(lambda state: state[0] < count, visit, init)[1]
