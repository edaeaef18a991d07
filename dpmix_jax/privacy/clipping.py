"""Per-unit gradient clipping that returns clipped *sums* with a stated sensitivity.

A unit is one example (example-level DP) or one user (user-level DP: the mean gradient over the
user's examples). For each unit the gradient is computed with `jax.vmap`, clipped to L2 norm at most
C, zeroed if it is padding or not finite, and summed. Dividing by a batch size is *not* done here:
the caller divides the noisy sum by a public constant (see `noise`).

Sensitivity contract: adding or removing one unit changes the returned sum by at most C in L2 norm
(`sensitivity()`); replacing one unit changes it by at most 2C. The bound holds in the dtype the
sum is taken in: norms and clip factors are float32, and a bfloat16/float16 clipped unit is
rounded toward zero, so the cast cannot lift its norm above C.

Example:
    >>> import jax.numpy as jnp
    >>> loss = lambda w, ex: jnp.sum((ex["x"] @ w - ex["y"]) ** 2)
    >>> grad_sum = clipped_grad_sum(loss, clip_norm=1.0)
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros(4)}
    >>> total, stats = grad_sum(jnp.ones(3), batch, jnp.array([True, True, True, False]))
    >>> float(jnp.linalg.norm(total)) <= 3.0 + 1e-5, stats["grad_norm"].shape
    (True, (4,))
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from dpmix_jax.privacy.accounting import ADD_OR_REMOVE_ONE, NeighboringRelation, check_positive

PyTree = Any
# loss_fn(params, example) -> scalar loss, or (scalar loss, aux) when has_aux.
LossFn = Callable[[PyTree, PyTree], Any]


# Relative slack under C for the float32 arithmetic of the norm and of the scaling (XLA's float32
# sums of squares are accurate to about 1e-7 even over 1e7 entries; this is ten times that).
_FLOAT32_SLACK = 2.0**-20


def global_norm(tree: PyTree) -> jax.Array:
    """The L2 norm of all leaves of `tree` together, accumulated in float32."""
    leaves = jax.tree.leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves))


def clip_factor(norm: jax.Array, clip_norm: float, keep: jax.Array) -> jax.Array:
    """The float32 factor that clips a unit of gradient norm `norm` to at most `clip_norm`.

    min(1, C' / norm) with C' = C·(1 - 2⁻²⁰), so that the float32 rounding of the norm and of the
    scaling cannot push the result above C; 0 unless `keep` and the norm is finite.
    """
    keep = jnp.logical_and(keep, jnp.isfinite(norm))
    bound = clip_norm * (1.0 - _FLOAT32_SLACK)
    norm = jnp.asarray(norm, jnp.float32)
    return jnp.where(keep, jnp.minimum(1.0, bound / jnp.maximum(norm, 1e-30)), 0.0)


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

    The norm and the scale are float32, and each leaf is rounded toward zero into its own dtype,
    so the bound holds for the returned bfloat16/float16 leaves too. Returns the clipped tree and
    the norm before clipping.
    """
    norm = global_norm(tree)
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

    Built by `clipped_grad_sum` or `user_clipped_grad_sum`. The per-unit stats (`loss`,
    `grad_norm`, and `aux` when the loss has one) are *not* private: use them for debugging or pass
    them through a DP mechanism of their own.
    """

    function: Callable[[PyTree, PyTree, jax.Array], tuple[PyTree, dict[str, jax.Array]]]
    clip_norm: float

    def __call__(self, params: PyTree, batch: PyTree, mask: jax.Array):
        return self.function(params, batch, mask)

    def sensitivity(self, relation: NeighboringRelation = ADD_OR_REMOVE_ONE) -> float:
        """The L2 sensitivity of the sum: C for add/remove (and zero-out), 2C for replace-one."""
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
    unit's row of the batch mask: a bool for an example, a `(G,)` vector for a user.
    """

    def one_unit(params, unit, unit_mask):
        (loss, aux), grad = unit_value_and_grad(params, unit, unit_mask)
        clipped, norm = clip_to_norm(grad, clip_norm, jnp.any(unit_mask))
        return clipped, {"loss": loss, "grad_norm": norm, "aux": aux}

    per_unit = jax.vmap(one_unit, in_axes=(None, 0, 0), spmd_axis_name=spmd_axis_name)

    def chunk_sum(params, units, mask):
        clipped, stats = per_unit(params, units, mask)
        return jax.tree.map(lambda g: jnp.sum(g, axis=0), clipped), stats

    def function(params, batch, mask):
        mask = jnp.asarray(mask, dtype=bool)
        num_units = mask.shape[0]
        _check_batch(batch, num_units)
        if microbatch_size is None or microbatch_size >= num_units:
            total, stats = chunk_sum(params, batch, mask)
        else:
            if num_units % microbatch_size:
                raise ValueError(
                    f"batch of {num_units} units is not a multiple of microbatch_size "
                    f"{microbatch_size}; pad batches to a multiple of it."
                )
            chunks = num_units // microbatch_size
            split = lambda x: x.reshape(chunks, microbatch_size, *x.shape[1:])

            def body(acc, chunk):
                part, stats = chunk_sum(params, *chunk)
                return optax.tree.add(acc, part), stats

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), params)
            total, stats = jax.lax.scan(body, zeros, (jax.tree.map(split, batch), split(mask)))
            stats = jax.tree.map(lambda s: s.reshape(num_units, *s.shape[2:]), stats)
        if stats["aux"] is None:
            del stats["aux"]
        return total, stats

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
        A `ClippedGradSum` callable `(params, batch, mask) -> (sum, stats)`; `mask` (B,) marks
        real rows, and padded rows contribute exactly zero.

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
