"""Ghost clipping: per-example gradient norms without per-example gradients.

For a layer whose weight gradient for one example is a sum of outer products over positions t,
`G = Σ_t u_t ⊗ v_t` (a dense layer: u = its input, v = the gradient of the loss with respect to its
output), the squared Frobenius norm is

    ||G||² = Σ_{t,s} (u_t · u_s)(v_t · v_s)

(Li et al. 2022, "ghost norm"), which costs T² per example instead of d_in·d_out. Per layer the
cheaper form is used: the two T×T Gram matrices when T² <= d_in·d_out, the per-example outer product
otherwise. Embeddings use one-hot inputs (the Gram of the ids is an equality test), a tied output
head (`logits = h @ Eᵀ`) puts the logit gradient on the table side, convolutions use their
unfolded patches, and the scale and shift of a normalisation layer have direct per-example
gradients Σ_t x̂_t ⊙ v_t and Σ_t v_t. A parameter used by several layers (a tied embedding) gets
the cross terms Σ_{t,s} (u_t · u'_s)(v_t · v'_s) too, so its norm is that of the summed gradient.

The model's forward pass reports each layer to a `Tape`. `ghost_clipped_grad_sum` then runs

1. a forward pass and one backward pass to the layer *outputs* (gradients with respect to zero
   perturbations added to them; no weight gradient is formed), giving every example's gradient
   norm ||g_j||;
2. one backward pass on the reweighted loss Σ_j c_j loss_j with c_j = min(1, C / ||g_j||) held
   constant (0 for padded rows and non-finite norms), which is Σ_j clip(g_j): the clipped sum.

It returns the same `ClippedGradSum` as `clipping.clipped_grad_sum`, so the two are
interchangeable. The loss must be per-example: example j's loss may depend on example j only (no
BatchNorm, no cross-example terms), and every parameter must be reported by some tape call (model
glue checks this, see `dpmix_jax.train.ghost_models`).

Example:
    >>> import jax, jax.numpy as jnp
    >>> def loss_fn(params, batch, tape):
    ...     y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
    ...     return jnp.sum((y - batch["y"]) ** 2, axis=-1)
    >>> grad_sum = ghost_clipped_grad_sum(loss_fn, clip_norm=1.0)
    >>> batch = {"x": jnp.ones((4, 3)), "y": jnp.zeros((4, 2))}
    >>> total, stats = grad_sum({"w": jnp.ones((3, 2))}, batch, jnp.array([1, 1, 1, 0], bool))
    >>> round(float(jnp.linalg.norm(total["w"])), 4), stats["grad_norm"].shape
    (3.0, (4,))
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from dpmix_jax.privacy.accounting import check_positive
from dpmix_jax.privacy.clipping import ClippedGradSum

PyTree = Any
ParamKey = Hashable
# loss_fn(params, batch, tape) -> (B,) per-example losses.
TapedLossFn = Callable[[PyTree, PyTree, "Tape"], jax.Array]

# Where a factor of an outer product comes from: the layer's recorded input ("input"), its
# recorded integer ids read as one-hot rows ("ids"), or the gradient at its output ("grad").
_INPUT, _IDS, _GRAD = "input", "ids", "grad"


@dataclasses.dataclass(frozen=True)
class _Outer:
    """A weight gradient Σ_t left_t ⊗ right_t of one example (both flattened to (T, ·))."""

    param: ParamKey
    left: str
    right: str
    left_size: int
    right_size: int


@dataclasses.dataclass(frozen=True)
class _Direct:
    """A vector gradient Σ_t (x̂_t ⊙ v_t) (`scaled`) or Σ_t v_t of one example."""

    param: ParamKey
    scaled: bool


@dataclasses.dataclass(frozen=True)
class _Conv:
    """How to unfold a convolution's input into patches (one row per output position)."""

    kernel_size: tuple[int, ...]
    strides: tuple[int, ...]
    padding: Any
    dimension_numbers: tuple[str, str, str]


@dataclasses.dataclass
class _Layer:
    uses: list[_Outer | _Direct]
    output: jax.ShapeDtypeStruct
    conv: _Conv | None = None


class Tape:
    """Receives every parameterised layer of one forward pass.

    Each method takes the layer's input-side array and its output, and returns the output (plus
    a zero perturbation when the tape is differentiating, so that its gradient is the gradient at
    the layer's output). Names must be unique within one forward pass; parameter keys name the
    parameter a gradient lands in (equal keys = a shared parameter). A tape built with
    `perturbations=None` records nothing of cost and changes nothing: the forward pass is the
    plain one.

    Arrays are `(B, ..., features)`: axis 0 is the example, the middle axes are positions t.
    """

    def __init__(self, perturbations: dict[str, jax.Array] | None = None):
        self._perturbations = perturbations
        self.layers: dict[str, _Layer] = {}
        self.arrays: dict[str, jax.Array] = {}

    def _record(self, name, outputs, uses, arrays, conv=None):
        if name in self.layers:
            raise ValueError(f"layer name {name!r} was recorded twice in one forward pass.")
        self.layers[name] = _Layer(
            list(uses), jax.ShapeDtypeStruct(outputs.shape, outputs.dtype), conv
        )
        if self._perturbations is None:
            return outputs
        self.arrays.update({f"{name}/{k}": v for k, v in arrays.items()})
        return outputs + self._perturbations[name].astype(outputs.dtype)

    def linear(
        self,
        name: str,
        inputs: jax.Array,
        outputs: jax.Array,
        *,
        kernel: ParamKey,
        bias: ParamKey | None = None,
    ) -> jax.Array:
        """`outputs = inputs @ kernel (+ bias)` with kernel `(d_in, d_out)`."""
        uses = [_Outer(kernel, _INPUT, _GRAD, inputs.shape[-1], outputs.shape[-1])]
        if bias is not None:
            uses.append(_Direct(bias, scaled=False))
        return self._record(name, outputs, uses, {"input": inputs})

    def embedding(
        self, name: str, ids: jax.Array, outputs: jax.Array, *, table: ParamKey, vocab_size: int
    ) -> jax.Array:
        """`outputs = table[ids]` with table `(vocab_size, d)`."""
        uses = [_Outer(table, _IDS, _GRAD, vocab_size, outputs.shape[-1])]
        return self._record(name, outputs, uses, {"ids": ids})

    def attend(
        self, name: str, queries: jax.Array, logits: jax.Array, *, table: ParamKey
    ) -> jax.Array:
        """`logits = queries @ tableᵀ` with table `(vocab_size, d)` (a tied output head)."""
        uses = [_Outer(table, _GRAD, _INPUT, logits.shape[-1], queries.shape[-1])]
        return self._record(name, logits, uses, {"input": queries})

    def conv(
        self,
        name: str,
        inputs: jax.Array,
        outputs: jax.Array,
        *,
        kernel: ParamKey,
        kernel_size: Sequence[int],
        strides: Sequence[int],
        padding: Any,
        dimension_numbers: tuple[str, str, str] = ("NHWC", "HWIO", "NHWC"),
        bias: ParamKey | None = None,
    ) -> jax.Array:
        """`outputs = lax.conv_general_dilated(inputs, kernel, strides, padding)` (no dilation)."""
        conv = _Conv(tuple(kernel_size), tuple(strides), padding, tuple(dimension_numbers))
        channels = inputs.shape[dimension_numbers[0].index("C")]
        patch = channels * math.prod(kernel_size)
        uses = [_Outer(kernel, _INPUT, _GRAD, patch, outputs.shape[-1])]
        if bias is not None:
            uses.append(_Direct(bias, scaled=False))
        return self._record(name, outputs, uses, {"input": inputs}, conv)

    def scale_shift(
        self,
        name: str,
        normalized: jax.Array,
        outputs: jax.Array,
        *,
        scale: ParamKey | None,
        bias: ParamKey | None,
    ) -> jax.Array:
        """`outputs = normalized * scale + bias` along the last axis (LayerNorm, GroupNorm)."""
        uses = [_Direct(scale, scaled=True)] if scale is not None else []
        if bias is not None:
            uses.append(_Direct(bias, scaled=False))
        return self._record(name, outputs, uses, {"normalized": normalized})


def _rows(x: jax.Array) -> jax.Array:
    """(B, ..., d) -> (B, T, d); a rank-2 array is one position per example."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _patches(x: jax.Array, conv: _Conv) -> jax.Array:
    """(B, P, C·k) unfolded input patches, P = output positions (channel-major, as in lax)."""
    lhs, _, out = conv.dimension_numbers
    patches = jax.lax.conv_general_dilated_patches(
        x,
        conv.kernel_size,
        conv.strides,
        conv.padding,
        dimension_numbers=(lhs, "OI" + "".join("HWD"[: len(conv.kernel_size)]), out),
    )
    if out.index("C") != len(out) - 1:
        patches = jnp.moveaxis(patches, out.index("C"), -1)
    return _rows(patches)


class _Factors:
    """The (B, T, ·) factor arrays of the recorded layers, built lazily and once each."""

    def __init__(self, layers: dict[str, _Layer], arrays: dict, grads: dict):
        self._layers, self._arrays, self._grads = layers, arrays, grads
        self._cache: dict[tuple[str, str], jax.Array] = {}

    def get(self, name: str, side: str) -> jax.Array:
        if (name, side) not in self._cache:
            if side == _GRAD:
                value = _rows(self._grads[name])
            elif side == _IDS:
                value = self._arrays[f"{name}/ids"].reshape(self._grads[name].shape[0], -1)
            else:
                layer, x = self._layers[name], self._arrays[f"{name}/input"]
                value = _rows(x) if layer.conv is None else _patches(x, layer.conv)
            self._cache[(name, side)] = value.astype(jnp.float32)
        return self._cache[(name, side)]


def _gram(a: jax.Array, a_side: str, b: jax.Array, b_side: str) -> jax.Array:
    """(B, T, S) inner products of the rows of two factors (ids read as one-hot rows)."""
    if a_side == _IDS and b_side == _IDS:
        return (a[:, :, None] == b[:, None, :]).astype(jnp.float32)
    if a_side == _IDS:
        return _gram(b, b_side, a, a_side).transpose(0, 2, 1)
    if b_side == _IDS:  # <a_t, onehot(ids_s)> = a_t[ids_s]
        index = jnp.broadcast_to(b[:, None, :], (*a.shape[:2], b.shape[1]))
        return jnp.take_along_axis(a, index.astype(jnp.int32), axis=2)
    return jnp.einsum("btd,bsd->bts", a, b)


def _outer_sq_norms(factors: _Factors, uses: list[tuple[str, _Outer]]) -> jax.Array:
    """(B,) squared norms of one parameter's summed per-example gradient over its uses."""
    if len(uses) == 1:
        name, use = uses[0]
        left, right = factors.get(name, use.left), factors.get(name, use.right)
        direct_ok = _IDS not in (use.left, use.right)
        if direct_ok and left.shape[1] ** 2 > use.left_size * use.right_size:
            grads = jnp.einsum("btn,btm->bnm", left, right)
            return jnp.sum(jnp.square(grads), axis=(1, 2))
    total = 0.0
    for (i, (n1, u1)), (j, (n2, u2)) in itertools.combinations_with_replacement(enumerate(uses), 2):
        left = _gram(factors.get(n1, u1.left), u1.left, factors.get(n2, u2.left), u2.left)
        right = _gram(factors.get(n1, u1.right), u1.right, factors.get(n2, u2.right), u2.right)
        total = total + (1.0 if i == j else 2.0) * jnp.sum(left * right, axis=(1, 2))
    return total


def _ghost_sq_norms(layers: dict[str, _Layer], arrays: dict, grads: dict) -> jax.Array:
    """(B,) squared per-example gradient norms from recorded layers and their output gradients.

    Privacy: the norms are computed from every example's own data; they are not private and
    serve only to clip.
    """
    factors = _Factors(layers, arrays, grads)
    outer: dict[ParamKey, list[tuple[str, _Outer]]] = {}
    direct: dict[ParamKey, jax.Array] = {}
    for name, layer in layers.items():
        for use in layer.uses:
            if isinstance(use, _Outer):
                outer.setdefault(use.param, []).append((name, use))
                continue
            v = factors.get(name, _GRAD)
            if use.scaled:
                x = _rows(arrays[f"{name}/normalized"]).astype(jnp.float32)
                v = x * v
            direct[use.param] = direct.get(use.param, 0.0) + jnp.sum(v, axis=1)
    if shared := set(outer) & set(direct):
        raise ValueError(f"parameters {sorted(map(str, shared))} are used as matrix and vector.")
    total = sum(jnp.sum(jnp.square(v), axis=1) for v in direct.values())
    for uses in outer.values():
        total = total + _outer_sq_norms(factors, uses)
    return jnp.asarray(total, jnp.float32)


def ghost_clipped_grad_sum(loss_fn: TapedLossFn, *, clip_norm: float) -> ClippedGradSum:
    """Example-level clipped gradient sum by ghost norms and one reweighted backward pass.

    Args:
        loss_fn: `loss_fn(params, batch, tape) -> (B,)` per-example losses of a whole batch. It
            reports every parameterised layer to `tape` (see `Tape`); example j's loss must not
            depend on other examples.
        clip_norm: C > 0, the L2 bound of each example's gradient.

    Returns:
        A `ClippedGradSum` `(params, batch, mask) -> (sum, stats)` with `stats["loss"]` and
        `stats["grad_norm"]` (B,), a drop-in for `clipping.clipped_grad_sum`.

    Privacy: the returned sum has L2 sensitivity `clip_norm` under add/remove of one example:
    it is Σ_j c_j ∇loss_j with c_j ||∇loss_j|| <= C, provided the tape covers every parameter
    (otherwise the norms are too small). Padded rows and rows with a non-finite norm get c_j = 0
    and are replaced by a kept row in the second pass, so that 0 · inf cannot reach the sum.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")

    def function(params, batch, mask):
        mask = jnp.asarray(mask, dtype=bool)
        for leaf in jax.tree.leaves(batch):
            if leaf.shape[:1] != mask.shape:
                raise ValueError(
                    f"every batch leaf needs a leading axis of {mask.shape[0]} (the mask's "
                    f"length); got a leaf of shape {leaf.shape}."
                )
        probe = Tape()
        jax.eval_shape(lambda: loss_fn(params, batch, probe))
        zeros = {name: jnp.zeros(layer.output.shape, jnp.float32) for name, layer in
                 probe.layers.items()}  # fmt: skip

        def taped(perturbations):
            tape = Tape(perturbations)
            return loss_fn(params, batch, tape), tape.arrays

        losses, pullback, arrays = jax.vjp(taped, zeros, has_aux=True)
        (grads,) = pullback(jnp.ones_like(losses))
        norms = jnp.sqrt(_ghost_sq_norms(probe.layers, arrays, grads))
        keep = mask & jnp.isfinite(norms)
        weights = jnp.where(keep, jnp.minimum(1.0, clip_norm / jnp.maximum(norms, 1e-30)), 0.0)
        rows = jnp.arange(mask.shape[0])
        source = jnp.where(keep, rows, jnp.argmax(keep))
        safe_batch = jax.tree.map(lambda x: x[source], batch)

        def weighted_loss(p):
            return jnp.sum(jax.lax.stop_gradient(weights) * loss_fn(p, safe_batch, Tape()))

        total = jax.grad(weighted_loss)(params)
        any_kept = jnp.any(keep)
        total = jax.tree.map(lambda g: jnp.where(any_kept, g, 0).astype(g.dtype), total)
        return total, {"loss": losses, "grad_norm": norms}

    return ClippedGradSum(function, clip_norm)
