"""Per-unit gradient clipping that returns clipped *sums* with a stated sensitivity.

A unit is one example (example-level DP) or one user (user-level DP: the mean gradient over the
user's examples). For each unit the gradient is computed with `jax.vmap`, clipped to L2 norm at most
C, zeroed if it is padding or not finite, and summed. Dividing by a batch size is *not* done here:
the caller divides the noisy sum by a public constant (see `noise`).

Sensitivity contract: adding or removing one unit changes the returned sum by at most C in L2 norm
(`sensitivity()`); replacing one unit changes it by at most 2C. The clip norm may also be given at
call time (a traced value, as adaptive clipping does): a call with C_t has sensitivity C_t. Every
unit is clipped by a *certified upper bound* of its gradient norm (`norm_upper_bound`: the float32
sum of squares taken axis by axis, so that each reduction is short, times the worst-case rounding
factor of those reductions), so float32 rounding in the norm cannot let a unit exceed C. The
units are summed in float64 and the total rounded once into float32, or float64 for float64
parameters, whatever the parameter dtype, with each unit clipped to the C' of
`summation.effective_clip_norm`, so that the rounding of the sum is inside the sensitivity too
(summing thousands of clipped units in bfloat16 or float16 would round the running sum so
coarsely that removing one unit moves it by several C; in float32, by more than C for a few
hundred thousand units). Cast to the parameter dtype only after the noise is added.

Example:
    >>> import jax.numpy as jnp
    >>> loss = lambda w, ex: jnp.sum((ex["x"] @ w - ex["y"]) ** 2)
    >>> grad_sum = clipped_grad_sum(loss, clip_norm=1.0)
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros(4)}
    >>> total, stats = grad_sum(jnp.ones(3), batch, jnp.array([True, True, True, False]))
    >>> float(jnp.linalg.norm(total)) <= 3.0 + 1e-5, stats["grad_norm"].shape, total.dtype
    (True, (4,), dtype('float32'))
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from dpmix_jax.privacy import summation
from dpmix_jax.privacy.accounting import ADD_OR_REMOVE_ONE, NeighboringRelation
from dpmix_jax.privacy.validation import check_positive

PyTree = Any
# loss_fn(params, example) -> scalar loss, or (scalar loss, aux) when has_aux.
LossFn = Callable[[PyTree, PyTree], Any]


# Relative slack under C for the float32 rounding of the clip factor and of the scaling (a few
# units in the last place; the norm's own rounding is in `norm_upper_bound`).
_FLOAT32_SLACK = 2.0**-20
# The unit roundoff of float32, the widest rounding of any float32 operation (ghost's and this
# module's bounds all assume float32 or wider arithmetic).
UNIT_ROUNDOFF = 2.0**-24
# Axes longer than this are split in two before a staged reduction, so no single reduction is long.
_LONG_AXIS = 4096


def rounding_gamma(n: int) -> float:
    """γ_n = n·u / (1 - n·u): the relative error bound of n float32 roundings in sequence.

    A sum of n terms in any order has an error of at most γ_{n-1} Σ|x_i| (Higham, "Accuracy and
    Stability of Numerical Algorithms", §4.2); a dot product of length n at most γ_n Σ|x_i y_i|.
    """
    nu = n * UNIT_ROUNDOFF
    if nu >= 0.5:
        raise ValueError(f"a float32 reduction of length {n} has no useful rounding bound.")
    return nu / (1.0 - nu)


def _split_long_axes(x: jax.Array, lead: int) -> jax.Array:
    """`x` with each axis after `lead` longer than `_LONG_AXIS` split into two (a free reshape)."""
    shape = list(x.shape[:lead])
    for n in x.shape[lead:]:
        a = max((k for k in range(1, math.isqrt(n) + 1) if n % k == 0), default=1)
        shape += [a, n // a] if n > _LONG_AXIS and a > 1 else [n]
    return x.reshape(shape)


def staged_sum(x: jax.Array, lead: int = 0) -> tuple[jax.Array, int]:
    """Σ x over the axes after the first `lead`, and the depth of its chain of roundings.

    The axes are reduced one at a time (an optimisation barrier between them keeps XLA from
    merging the reductions into one long one), so that the rounding error is at most
    γ_depth · Σ|x| with depth = Σ (n_i - 1) over the reduced axes: the sum of the axis lengths
    rather than their product.
    """
    x = _split_long_axes(x, lead)
    depth = 0
    for axis in reversed(range(lead, x.ndim)):
        depth += x.shape[axis] - 1
        x = jax.lax.optimization_barrier(jnp.sum(x, axis=axis))
    return x, depth


def staged_square_sum(x: jax.Array, lead: int = 0) -> tuple[jax.Array, int]:
    """Σ x² over the axes after the first `lead`, in float32 or wider, and its depth.

    The terms are non-negative, so the rounding error is at most γ_depth · value (the depth
    counts the squaring too; see `staged_sum`).
    """
    total, depth = staged_sum(jnp.square(x.astype(sum_dtype(x.dtype))), lead)
    return total, depth + 1


def norm_upper_bound(tree: PyTree) -> jax.Array:
    """A certified upper bound of the L2 norm of all leaves of `tree` together (float32).

    The float32 sum of squares of every leaf (`staged_square_sum`), summed over leaves, times
    1 + γ of the longest chain of roundings: every term is non-negative, so the relative error is
    at most that, for any order XLA sums in. Above the exact norm by at most that factor: about
    1e-4 for leaves with a few thousand entries per axis.
    """
    parts = [staged_square_sum(leaf) for leaf in jax.tree.leaves(tree)]
    if not parts:
        return jnp.zeros((), jnp.float32)
    depth = max(d for _, d in parts) + len(parts) + 4  # + the leaf sum, sqrt and products
    total = sum(value.astype(jnp.float32) for value, _ in parts)
    return jnp.sqrt(total) * jnp.float32(1.0 + rounding_gamma(depth))


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves of `tree` together, accumulated in float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves))


def sum_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """The dtype of clipped sums, their noise and the noisy mean for parameters of `dtype`:
    float32 or wider.

    Privacy: in bfloat16 or float16 a sum of thousands of clipped units, or the sum plus its
    noise, would be rounded at the scale of the sum; the sensitivity and the Gaussian
    mechanism's analysis assume neither.
    """
    return jnp.promote_types(dtype, jnp.float32)


def clip_factor(norm: jax.Array, clip_norm: float | jax.Array, keep: jax.Array) -> jax.Array:
    """The float32 factor that clips a unit of gradient norm `norm` to at most `clip_norm`.

    min(1, C' / norm) with C' = C·(1 - 2⁻²⁰), so that the float32 rounding of the norm and of the
    scaling cannot push the result above C; 0 unless `keep` and the norm is finite.
    """
    keep = jnp.logical_and(keep, jnp.isfinite(norm))
    bound = clip_norm * (1.0 - _FLOAT32_SLACK)
    norm = jnp.asarray(norm, jnp.float32)
    return jnp.where(keep, jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30)), 0.0)


def unclipped(norm: jax.Array, clip_norm: float | jax.Array, keep: jax.Array) -> jax.Array:
    """Whether a unit is kept, its norm bound finite and at most `clip_norm` (bool).

    Privacy: one bit per unit, computed from the same certified bound the unit is clipped by;
    their count has sensitivity 1 under add/remove of one unit. Not private until noised
    (`adaptive_clipping`).
    """
    keep = jnp.logical_and(keep, jnp.isfinite(norm))
    return jnp.logical_and(keep, jnp.asarray(norm, jnp.float32) <= clip_norm)


def scale_in_dtype(leaf: jax.Array, factor: jax.Array) -> jax.Array:
    """`leaf * factor` computed in float32 (or wider) and cast back to `leaf.dtype` toward zero.

    Rounding to nearest in bfloat16 or float16 can enlarge an entry by up to 2⁻⁸ or 2⁻¹¹ of
    its size (more for subnormals), and with it the norm; rounding toward zero never enlarges an
    entry, so a clipped unit stays within C in the dtype it is summed in.
    """
    wide = jnp.promote_types(leaf.dtype, jnp.float32)
    scaled = leaf.astype(wide) * factor.astype(wide)
    if wide == leaf.dtype:
        return scaled
    narrow = scaled.astype(leaf.dtype)
    grew = jnp.abs(narrow.astype(wide)) > jnp.abs(scaled)
    return jnp.where(grew, jnp.nextafter(narrow, jnp.zeros_like(narrow)), narrow)


def clip_to_norm(tree: PyTree, clip_norm: float, keep: jax.Array) -> tuple[PyTree, jax.Array]:
    """Scales `tree` to L2 norm <= `clip_norm`; returns zeros unless `keep` and the norm is finite.

    The norm is a certified float32 upper bound (`norm_upper_bound`), the scale is float32, and
    each leaf is rounded toward zero into its own dtype, so the bound holds for the returned
    bfloat16/float16 leaves too. Returns the clipped tree and the norm bound it was clipped by.
    """
    norm = norm_upper_bound(tree)
    keep = jnp.logical_and(keep, jnp.isfinite(norm))
    factor = clip_factor(norm, clip_norm, keep)
    # jnp.where (not a product) so that a NaN leaf cannot survive a zero scale.
    clipped = jax.tree.map(
        lambda g: jnp.where(keep, scale_in_dtype(g, factor), 0).astype(g.dtype), tree
    )
    return clipped, norm


@dataclasses.dataclass(frozen=True)
class ClippedGradSum:
    """`(params, batch, mask) -> (Σ clipped unit gradients, per-unit stats)`.

    Built by `clipped_grad_sum`, `user_clipped_grad_sum` or their ghost counterparts. The sum's
    leaves are float32 (float64 for float64 parameters) whatever the parameters' dtype, so that
    the sensitivity holds for the sum itself; add the noise in that dtype and cast afterwards.
    The per-unit stats (`loss`, `grad_norm`: the certified upper bound of the unit's gradient norm
    that it was clipped by, `unclipped`: whether that bound was at most the clip norm, and `aux`
    when the loss has one) are *not* private: use them for debugging or pass them through a DP
    mechanism of their own (`adaptive_clipping` noises the count of `unclipped`). The clip norm
    may be given at call time, `grad_sum(params, batch, mask, clip_norm)`.
    """

    function: Callable[..., tuple[PyTree, dict[str, jax.Array]]]
    clip_norm: float

    def __call__(
        self,
        params: PyTree,
        batch: PyTree,
        mask: jax.Array,
        clip_norm: float | jax.Array | None = None,
        *,
        release_units: int | None = None,
    ):
        """The clipped sum and per-unit stats, clipped to `clip_norm` (default: `self.clip_norm`).

        `clip_norm` may be a traced float32 scalar C_t > 0 (adaptive clipping); the stats then
        hold `unclipped`, whether each unit's norm bound was at most C_t (`clipping.unclipped`).
        `release_units` (an int, or a traced scalar): this sum is one of several partial sums
        of a release of that many units, added in float64 by the caller (gradient
        accumulation); its units are clipped so that the release's rounding stays inside the
        sensitivity (`summation.effective_clip_norm`).
        """
        if clip_norm is None:
            clip_norm = self.clip_norm
        elif isinstance(clip_norm, numbers.Real):
            clip_norm = check_positive(clip_norm, "clip_norm")
        return self.function(params, batch, mask, clip_norm, release_units)

    def sensitivity(self, relation: NeighboringRelation = ADD_OR_REMOVE_ONE) -> float:
        """The L2 sensitivity of the sum: C for add/remove (and zero-out), 2C for replace-one.

        For a call with a clip norm C_t given at call time the same rule holds with C_t for C
        (adaptive clipping: sensitivity C_t at step t, so its noise stddev is σ_Δ·C_t).
        """
        if relation == NeighboringRelation.REPLACE_ONE:
            return 2.0 * self.clip_norm
        return self.clip_norm


def _clipped_sum(
    unit_value_and_grad: Callable[[PyTree, PyTree, jax.Array], tuple[Any, PyTree]],
    *,
    clip_norm: float,
    microbatch_size: int | None,
    spmd_axis_name: str | None,
) -> Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, dict[str, jax.Array]]]:
    """Vmaps `unit_value_and_grad` over units, clips each, masks, sums (optionally in chunks).

    `unit_value_and_grad(params, unit, unit_mask) -> ((loss, aux), grad)`, and `unit_mask` is the
    unit's row of the batch mask: a bool for an example, a `(G,)` vector for a user. The returned
    function takes the clip norm as an optional last argument (default: `clip_norm`).
    """

    def one_unit(params, unit, unit_mask, unit_clip_norm, unit_bound):
        (loss, aux), grad = unit_value_and_grad(params, unit, unit_mask)
        norm = norm_upper_bound(grad)
        keep = jnp.logical_and(jnp.any(unit_mask), jnp.isfinite(norm))
        factor = clip_factor(norm, unit_bound, keep)
        # Scaled in float32 (or wider): the sum must not round in the leaf dtype.
        # jnp.where (not a product) so that a NaN leaf cannot survive a zero scale.
        clipped = jax.tree.map(
            lambda g: jnp.where(keep, g.astype(sum_dtype(g.dtype)) * factor, 0), grad
        )
        stats = {"loss": loss, "grad_norm": norm, "aux": aux}
        return clipped, stats | {"unclipped": unclipped(norm, unit_clip_norm, keep)}

    per_unit = jax.vmap(one_unit, in_axes=(None, 0, 0, None, None), spmd_axis_name=spmd_axis_name)

    def chunk_sum(params, units, mask, call_clip_norm, bound):
        clipped, stats = per_unit(params, units, mask, call_clip_norm, bound)
        return summation.sum_units(clipped), stats

    def function(params, batch, mask, call_clip_norm=clip_norm, release_units=None):
        mask = jnp.asarray(mask, dtype=bool)
        num_units = mask.shape[0]
        _check_batch(batch, num_units)
        roundoff = summation.output_roundoff(params)
        bound = summation.effective_clip_norm(call_clip_norm, num_units, roundoff, release_units)
        if microbatch_size is None or microbatch_size >= num_units:
            total, stats = chunk_sum(params, batch, mask, call_clip_norm, bound)
        else:
            if num_units % microbatch_size:
                raise ValueError(
                    f"batch of {num_units} units is not a multiple of microbatch_size "
                    f"{microbatch_size}; pad batches to a multiple of it."
                )
            chunks = num_units // microbatch_size
            split = lambda x: x.reshape(chunks, microbatch_size, *x.shape[1:])

            def body(acc, chunk):
                part, stats = chunk_sum(params, *chunk, call_clip_norm, bound)
                return summation.add(acc, part), stats

            zeros = summation.wide_zeros(params)
            total, stats = jax.lax.scan(body, zeros, (jax.tree.map(split, batch), split(mask)))
            stats = jax.tree.map(lambda s: s.reshape(num_units, *s.shape[2:]), stats)
        if stats["aux"] is None:
            del stats["aux"]
        return summation.rounded(total, params), stats

    return function


def _check_batch(batch: PyTree, num_units: int) -> None:
    for leaf in jax.tree.leaves(batch):
        if leaf.shape[:1] != (num_units,):
            raise ValueError(
                f"every batch leaf needs a leading axis of {num_units} (the mask's length); "
                f"got a leaf of shape {leaf.shape}."
            )


def _check_microbatch_size(microbatch_size: int | None) -> None:
    if microbatch_size is not None and (
        not isinstance(microbatch_size, numbers.Integral) or microbatch_size < 1
    ):
        raise ValueError(
            f"microbatch_size must be None or an integer >= 1, got {microbatch_size!r}."
        )


def _value_and_grad(loss_fn: LossFn, has_aux: bool):
    with_aux = loss_fn if has_aux else (lambda p, ex: (loss_fn(p, ex), None))
    return jax.value_and_grad(with_aux, has_aux=True)


def clipped_grad_sum(
    loss_fn: LossFn,
    *,
    clip_norm: float,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    keep_batch_dim: bool = False,
    spmd_axis_name: str | None = None,
) -> ClippedGradSum:
    """Example-level clipped gradient sum.

    Args:
        loss_fn: `loss_fn(params, example) -> scalar` (or `(scalar, aux)` with `has_aux`), where
            `example` is the batch pytree sliced at one row along axis 0. The leading axis is
            dropped by default; with `keep_batch_dim=True` the example keeps a leading axis of
            size 1, so an ordinary batched loss can be used unchanged.
        clip_norm: C > 0, the L2 bound of each example's gradient.
        microbatch_size: if set, examples are processed in `lax.scan` chunks of this many (less
            memory, same result); the padded batch size must be a multiple of it.
        has_aux: whether `loss_fn` returns `(loss, aux)`.
        keep_batch_dim: see `loss_fn`.
        spmd_axis_name: mesh axis that the example axis is sharded over (for `jax.vmap`).

    Returns:
        A `ClippedGradSum` callable `(params, batch, mask[, clip_norm]) -> (sum, stats)`;
        `mask` (B,) marks real rows, and padded rows contribute exactly zero.

    Privacy: the returned sum has L2 sensitivity `clip_norm` under add/remove of one example
    (each example's gradient is clipped; padding, masked and non-finite rows contribute zero).
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    _check_microbatch_size(microbatch_size)
    value_and_grad = _value_and_grad(loss_fn, has_aux)

    def unit_value_and_grad(params, example, _):
        if keep_batch_dim:
            example = jax.tree.map(lambda x: x[None], example)
        return value_and_grad(params, example)

    function = _clipped_sum(
        unit_value_and_grad,
        clip_norm=clip_norm,
        microbatch_size=microbatch_size,
        spmd_axis_name=spmd_axis_name,
    )
    return ClippedGradSum(function, clip_norm)


def user_clipped_grad_sum(
    loss_fn: LossFn,
    *,
    clip_norm: float,
    microbatch_size: int | None = None,
    has_aux: bool = False,
    spmd_axis_name: str | None = None,
) -> ClippedGradSum:
    """User-level clipped gradient sum for batches shaped `(users, max_examples_per_user, ...)`.

    Each user's gradient is the mean of the gradients of its real examples (the `(U, G)` mask),
    then clipped to `clip_norm`; users with no real example contribute zero. `loss_fn(params,
    example)` takes one example (no leading axis). The per-unit stats hold each user's mean loss.

    Privacy: the returned sum has L2 sensitivity `clip_norm` under add/remove of one *user* with
    all of their examples, provided the batch holds each sampled user in a single row.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    _check_microbatch_size(microbatch_size)
    per_example = jax.vmap(_value_and_grad(loss_fn, has_aux), in_axes=(None, 0))

    def unit_value_and_grad(params, user_examples, user_mask):
        (losses, aux), grads = per_example(params, user_examples)
        weights = user_mask / jnp.maximum(jnp.sum(user_mask), 1)

        def weighted_mean(x):
            w = weights.reshape(-1, *([1] * (x.ndim - 1))).astype(x.dtype)
            # where() so that a non-finite gradient of a padded example cannot leak through 0 * inf.
            return jnp.sum(jnp.where(w > 0, x * w, 0), axis=0)

        return (weighted_mean(losses), aux), jax.tree.map(weighted_mean, grads)

    function = _clipped_sum(
        unit_value_and_grad,
        clip_norm=clip_norm,
        microbatch_size=microbatch_size,
        spmd_axis_name=spmd_axis_name,
    )
    return ClippedGradSum(function, clip_norm)
