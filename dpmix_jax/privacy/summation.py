"""Sums of clipped unit contributions whose rounding stays inside the sensitivity.

A clipped sum adds thousands of contributions of norm up to C. Accumulated in float32, every
addition rounds at the scale of the running sum, not of one unit: removing one of 1,040 aligned
units moved a float32 sum by 1.00006·C, and with 262,144 units a float32 sum can be off by more
than C. The rounding also depends on the order of the additions, so it differs between two
neighbouring batches (a unit removed shifts every later unit to another row). What the sum's
sensitivity bounds is therefore the *computed* sum, rounding included:

- every clipped-sum path forms Σ_j c_j g_j in float64 (inside `jax.enable_x64`, whatever the
  global setting): a product of two float32 numbers is exact there, and the accumulation of K
  terms is off by at most γ⁶⁴_K times the sum of their magnitudes (Higham, "Accuracy and
  Stability of Numerical Algorithms", §3.1), in any order;
- the float64 total is rounded once into the sum's dtype (float32 for float32, bfloat16 and
  float16 parameters, float64 for float64 ones): a relative error of at most u, the unit
  roundoff of that dtype;
- a ghost contraction adds a unit's *rows* (Σ_t u_t ⊗ v_t), whose magnitudes M_j = Σ_t |u_t||v_t|
  can exceed the unit's norm many times over when its positions cancel: such a unit is clipped by
  max(N_j, m_j / u), with m_j = γ⁶⁴_K M_j its share of the accumulation error, so that all shares
  together stay below u·U·C' (`mixing_bound`).

With U units each clipped to C', the computed sum is within η·C' of the exact sum of the
contributions, η = 2u·U·(1 + u) (the accumulation's share plus the final rounding), so removing
one unit moves it by at most C'·(1 + 2η). Clipping to C' = C / (1 + 2η) (`effective_clip_norm`)
keeps that at C: a shrink of 2.5e-4 for U = 1,040 units and of 6% for U = 262,144, the price of
a float32 result. A caller that adds several clipped sums (gradient accumulation over chunks)
rounds each partial sum once more and the total once: it passes the release's units to each
call (`release_units`), whose clip norm then covers three roundings of the whole release.

Privacy: these bounds are what makes `ClippedGradSum.sensitivity()` true of the float32 array a
caller adds noise to, on every backend and for any order of the units in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

PyTree = Any

ACCUMULATION = jnp.float64
_FLOAT64_ROUNDOFF = 2.0**-53


def unit_roundoff(dtype: jnp.dtype) -> float:
    """u of a floating dtype: 2⁻²⁴ for float32, 2⁻⁵³ for float64 (half its machine epsilon)."""
    return float(jnp.finfo(dtype).eps) / 2.0


def float64_gamma(terms: int) -> float:
    """γ⁶⁴_K = K·u / (1 - K·u) for float64: the relative bound of K float64 roundings in sequence.

    Covers a float64 accumulation of K terms (K - 1 additions), or K - 1 additions and the
    rounding of a product of float64 inputs.
    """
    nu = max(int(terms), 1) * _FLOAT64_ROUNDOFF
    if nu >= 0.5:
        raise ValueError(f"a float64 accumulation of {terms} terms has no useful rounding bound.")
    return nu / (1.0 - nu)


def output_roundoff(tree: PyTree) -> float:
    """The largest unit roundoff among the leaves of a tree of sums (of their `sum_dtype`s)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return unit_roundoff(jnp.float32)
    return max(unit_roundoff(jnp.promote_types(leaf.dtype, jnp.float32)) for leaf in leaves)


def rounding_slack(num_units: int, roundoff: float, roundings: int = 2) -> float:
    """η: the computed sum of `num_units` contributions of norm <= C' is within η·C' of the exact.

    η = roundings · u · U · (1 + u): one share u·U for the float64 accumulation (for a ghost
    contraction, through the per-unit cap of `mixing_bound`), and one u·U·(1 + u) for each
    rounding of a partial or final sum of norm at most U·C'(1 + u) into the output dtype.
    """
    if num_units < 0 or roundings < 1:
        raise ValueError(f"need num_units >= 0 and roundings >= 1, got {num_units}, {roundings}.")
    return roundings * roundoff * max(num_units, 1) * (1.0 + roundoff)


def effective_clip_norm(
    clip_norm: float | jax.Array,
    num_units: int,
    roundoff: float,
    release_units: int | jax.Array | None = None,
) -> float | jax.Array:
    """C' = C / (1 + 2η): each unit's bound, so that removing a unit moves the computed sum by
    at most C (see the module docstring).

    Args:
        clip_norm: C, the sensitivity the sum is released with.
        num_units: the units of this sum.
        roundoff: u of the sum's dtype (`output_roundoff`).
        release_units: None for a sum released as it is (two roundings' worth of η, for its
            `num_units`); the units of the whole release when this sum is one of several partial
            sums added in float64 and rounded again (three roundings' worth, for all of them).
            May be traced, so that one compiled chunk serves every release size.
    """
    if release_units is None:
        return clip_norm / (1.0 + 2.0 * rounding_slack(num_units, roundoff))
    units = jnp.maximum(jnp.asarray(release_units, jnp.float32), num_units)
    return clip_norm / (1.0 + 2.0 * 3.0 * roundoff * (1.0 + roundoff) * units)


def mixing_bound(mass: jax.Array, terms: int, roundoff: float) -> jax.Array:
    """The norm bound a unit must be clipped by for its rows' share of the accumulation error.

    `mass` (U,) bounds Σ_t |u_t||v_t| of each unit's rows in a float64 accumulation of `terms`
    terms; the returned m_j / u = γ⁶⁴_K·mass_j / u. Clipping unit j to c_j <= C' / that keeps
    Σ_j c_j γ⁶⁴_K mass_j <= u·U·C'. It is far below the unit's norm unless its rows cancel
    (the factor γ⁶⁴_K / u is 2⁻²⁹·K).
    """
    return mass * jnp.float32(float64_gamma(terms + 1) / roundoff)


def in_float64(fn: Callable) -> Callable:
    """`fn` traced with 64-bit types enabled (its float64 arrays stay float64 inside it).

    Only the accumulation runs in this scope; a model's loss never does, so it keeps its own
    dtypes.
    """

    def scoped(*args, **kwargs):
        with jax.enable_x64(True):
            return fn(*args, **kwargs)

    scoped.__name__ = getattr(fn, "__name__", "scoped")
    scoped.__doc__ = fn.__doc__
    return scoped


@in_float64
def wide(x: jax.Array) -> jax.Array:
    """`x` converted to float64 (exact for float32, bfloat16 and float16 values)."""
    return x.astype(ACCUMULATION)


@in_float64
def wide_zeros(tree: PyTree) -> PyTree:
    """Float64 zeros shaped like every leaf of `tree` (an accumulator)."""
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), ACCUMULATION), tree)


@in_float64
def add(acc: PyTree, part: PyTree) -> PyTree:
    """`acc + part` leaf by leaf in float64."""
    return jax.tree.map(lambda a, p: a + p.astype(ACCUMULATION), acc, part)


@in_float64
def sum_units(tree: PyTree) -> PyTree:
    """Σ over the leading (unit) axis of every leaf, in float64."""
    return jax.tree.map(lambda x: jnp.sum(x.astype(ACCUMULATION), axis=0), tree)


@in_float64
def rounded(tree: PyTree, like: PyTree) -> PyTree:
    """Float64 sums rounded once into the sum dtype of the matching leaves of `like`."""
    return jax.tree.map(
        lambda s, p: s.astype(jnp.promote_types(p.dtype, jnp.float32)).reshape(jnp.shape(p)),
        tree,
        like,
    )
