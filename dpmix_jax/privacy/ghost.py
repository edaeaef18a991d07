"""Book-keeping ghost clipping: per-example clipped gradient sums in one backward pass.

For a layer whose weight gradient for one example is a sum of outer products over positions t,
`G = Σ_t u_t ⊗ v_t` (a dense layer: u = its input, v = the gradient of the loss with respect to its
output), the squared Frobenius norm is

    ||G||² = Σ_{t,s} (u_t · u_s)(v_t · v_s)

(Li et al. 2022, "ghost norm"), which costs T²·(d_in + d_out) per example instead of T·d_in·d_out.
Per layer the cheaper form is used: the two T×T Gram matrices when T·(d_in + d_out) <= d_in·d_out,
the per-example gradient otherwise (its B·d_in·d_out floats are then fewer than the B·T·(d_in +
d_out) of the layer's kept input and output gradient, and the clipped sum is a weighted sum of it).
Embeddings use one-hot inputs (the Gram of the ids is an equality test), a tied output head
(`logits = h @ Eᵀ`) puts the logit gradient on the table side, convolutions use their unfolded
patches for the Gram form and, for per-example kernels, batched matmuls of the output gradients
with either unfolded patches or shifted copies of the input (stride 1), and the scale and shift of
a normalisation layer have direct per-example gradients Σ_t x̂_t ⊙ v_t and Σ_t v_t. A parameter
used by several layers (a tied embedding) gets the cross terms Σ_{t,s} (u_t · u'_s)(v_t · v'_s)
too, so its norm is that of the summed gradient.

The model's forward pass reports each layer to a `Tape`. `ghost_clipped_grad_sum` runs a forward
pass and one backward pass to the layer *outputs* (gradients with respect to zero perturbations
added to them; no weight gradient is formed). From the kept inputs u and output gradients v it
computes a certified upper bound N_j of every example's norm ||g_j||, the clip factor
c_j = min(1, C / N_j) (0 for padded rows and non-finite bounds), and then the clipped sums
directly, as in the book-keeping method of
Bu et al. 2023: Σ_j c_j Σ_t u_jt ⊗ v_jt is one matmul over the batch and positions (a scatter-add
of the rows c_j v_jt at the ids for an embedding), and a vector parameter gets Σ_j c_j Σ_t (x̂ ⊙)
v_jt. There is no second backward pass.

Rounding: the Gram form sums T² products whose total can be far smaller than its terms (positions
whose gradients nearly cancel), so its float32 value alone can under-estimate a norm many times
over, and the unit would escape clipping. N_j adds the worst-case float32 rounding of the Gram
entries and of their sum (staged, so its depth is T + S rather than T·S), computed on layer inputs
centred at their mean over positions (their common direction is what makes the bound loose) with
the centring's own rounding added, capped by the triangle inequality ||g_j|| <= Σ_t ||u_t||
||v_t|| (see `_BookKeeper.clip_bounds`). For ordinary inputs N_j is within about 1e-4 of ||g_j||
on small layers and 1e-3 on GPT-2-sized ones (T = 384, 768 x 3072); cancelling inputs get a larger
N_j. A unit whose N_j exceeds both C' (below) and `_LOOSE` (1.25) times its float32 estimate of
its norm, so that the bound alone would clip it harder than its norm does, is bounded again: the
gradients of its Gram-form parameters are formed in float64 from its recorded factors, where the
products of float32 values are exact and the whole rounding is at most γ⁶⁴_T·Σ_t ||u_t|| ||v_t||,
so that it is clipped by its norm and adds what the per-example path adds. A `lax.while_loop`
visits such units one at a time, deciding for each from its own data only; on ordinary inputs it
makes no pass. What such a unit can still lose is its share of the accumulation's rounding
(below), which exceeds its norm only when its positions cancel by about 2²⁹ / (units · rows).
The clipped sums are accumulated in float64 and rounded once into
float32 (float64 for float64 parameters) whatever the parameter dtype, each unit is clipped to
the C' of `summation.effective_clip_norm`, and a unit whose rows' magnitudes dwarf its norm is
clipped by its share of the accumulation's rounding (`summation.mixing_bound`), so that the
rounding of the whole sum, in any order of the units, stays inside the sensitivity C.

It returns the same `ClippedGradSum` as `clipping.clipped_grad_sum`, so the two are
interchangeable; `ghost_user_clipped_grad_sum` is the user-level counterpart of
`clipping.user_clipped_grad_sum` (a user's factors are the rows of all of its examples, so its
norm is that of its mean gradient). The loss must be per-example: example j's loss may depend on
example j only (no BatchNorm, no cross-example terms), and every parameter must be reported by
some tape call (a parameter that is not raises a `ValueError`; model glue checks coverage up
front, see `dpmix_jax.train.ghost_models`).

Parameter keys: a leaf of `params` is named by the tuple of the dict keys and sequence indices on
its path (attribute steps, such as an `nnx.Variable`'s value, are skipped); a key that is not a
tuple stands for the 1-tuple, so `kernel="w"` names `params["w"]`.

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

from dpmix_jax.privacy import loose_units, summation
from dpmix_jax.privacy.clipping import (
    UNIT_ROUNDOFF,
    ClippedGradSum,
    clip_factor,
    rounding_gamma,
    staged_square_sum,
    staged_sum,
    sum_dtype,
    unclipped,
)
from dpmix_jax.privacy.validation import check_positive

PyTree = Any
ParamKey = Hashable
# loss_fn(params, batch, tape) -> (B,) per-example losses.
TapedLossFn = Callable[[PyTree, PyTree, "Tape"], jax.Array]

# Where a factor of an outer product comes from: the layer's recorded input ("input"), its
# recorded integer ids read as one-hot rows ("ids"), or the gradient at its output ("grad").
_INPUT, _IDS, _GRAD = "input", "ids", "grad"
# Examples per step of the loop that forms per-example convolution gradients on CPU. Measured on
# ResNet-tiny and ResNet-18 layers (2-core Xeon): one example per step pays the loop's overhead,
# and a whole batch at once runs 1.4-3.5x slower than two at a time once its arrays leave the cache.
_CPU_CHUNK_EXAMPLES = 2
# How many times its float32 norm estimate a unit's certified bound must be for the unit to be
# bounded again in float64 (ordinary inputs: within about 1e-3; see `_BookKeeper.clip_bounds`).
_LOOSE = 1.25
# Contractions whose rounding the norm bounds account for run in true float32: the bounds assume
# float32 arithmetic, not the bfloat16 passes (TPU) or TF32 (GPU) of the default precision.
_EXACT = jax.lax.Precision.HIGHEST


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
    """A convolution's geometry: to unfold its input and to transpose it in the kernel."""

    kernel_shape: tuple[int, ...]
    strides: tuple[int, ...]
    padding: Any
    dimension_numbers: tuple[str, str, str]

    @property
    def spatial(self) -> str:
        """The kernel's spatial axis letters (e.g. "HW"), in kernel order."""
        return "".join(c for c in self.dimension_numbers[1] if c not in "IO")

    @property
    def kernel_size(self) -> tuple[int, ...]:
        rhs = self.dimension_numbers[1]
        return tuple(self.kernel_shape[rhs.index(c)] for c in self.spatial)

    def _padded_channel_major(self, x: jax.Array) -> tuple[jax.Array, list[int]]:
        """(B, C, *spatial) zero-padded input, spatial axes in kernel order; the output sizes."""
        lhs = self.dimension_numbers[0]
        spatial = [lhs.index(c) for c in self.spatial]
        x = jnp.transpose(x, (lhs.index("N"), lhs.index("C"), *spatial))
        in_sizes = x.shape[2:]
        pads = self.padding
        if isinstance(pads, str):
            pads = jax.lax.padtype_to_pads(in_sizes, self.kernel_size, self.strides, pads)
        x = jnp.pad(x, ((0, 0), (0, 0), *pads))
        out_sizes = [
            (n - k) // s + 1
            for n, k, s in zip(x.shape[2:], self.kernel_size, self.strides, strict=True)
        ]
        return x, out_sizes

    def unfold(self, x: jax.Array) -> jax.Array:
        """(B, k·C, T) input patches: kernel offsets, then channels; output positions last.

        Built from strided slices of the padded input in channel-major layout, so that the
        positions axis is contiguous for the contraction over it (XLA's generic patch
        extraction is a convolution with an identity kernel, several times slower on CPU).
        """
        x, out_sizes = self._padded_channel_major(x)
        slices = [
            x[(..., *(slice(o, o + s * (n - 1) + 1, s)
                      for o, s, n in zip(offset, self.strides, out_sizes, strict=True)))]
            for offset in itertools.product(*map(range, self.kernel_size))
        ]  # fmt: skip
        return jnp.stack(slices, axis=1).reshape(x.shape[0], -1, math.prod(out_sizes))

    def channel_major(self, out_grads: jax.Array) -> jax.Array:
        """(B, O, T) output gradients, positions in the order of `unfold`."""
        out = self.dimension_numbers[2]
        axes = (out.index("N"), out.index("C"), *(out.index(c) for c in self.spatial))
        g = jnp.transpose(out_grads, axes)
        return g.reshape(*g.shape[:2], -1)

    def per_example_kernel_grads(self, inputs: jax.Array, out_grads: jax.Array) -> jax.Array:
        """(B, *kernel_shape) kernel gradients of every example.

        A stride-1 convolution whose shifted copies (`_correlate`) are smaller than its
        unfolded patches takes them (a 3x3 layer with more than half as many input channels as
        outputs); a strided one, or one with few input channels such as an RGB stem, contracts
        unfolded patches. On CPU the examples go through two at a time
        (`_CPU_CHUNK_EXAMPLES`).
        """
        size = self.kernel_size
        channels = self.kernel_shape[self.dimension_numbers[1].index("I")]
        out_channels = self.kernel_shape[self.dimension_numbers[1].index("O")]
        positions = out_grads[0].size // out_channels
        patch_rows = math.prod(size) * channels * positions
        shifted_rows = (size[-1] * channels + math.prod(size[:-1]) * out_channels) * positions
        if all(s == 1 for s in self.strides) and shifted_rows < patch_rows:
            fn = self._shifted_kernel_grads
        else:
            fn = self._unfolded_kernel_grads
        return _map_in_chunks(fn, (inputs, out_grads))

    def _shifted_kernel_grads(self, inputs: jax.Array, out_grads: jax.Array) -> jax.Array:
        x, out_sizes = self._padded_channel_major(inputs)
        g = self.channel_major(out_grads)
        return self._kernel_layout(
            _correlate(x, g.reshape(*g.shape[:2], *out_sizes), self.kernel_size)
        )

    def _unfolded_kernel_grads(self, inputs: jax.Array, out_grads: jax.Array) -> jax.Array:
        # Without the barrier XLA:CPU fuses the slicing into the matmul's operand and loses its
        # fast dot kernel.
        patches = jax.lax.optimization_barrier(self.unfold(inputs))
        grads = jnp.einsum("bkt,bot->bko", patches, self.channel_major(out_grads), precision=_EXACT)
        return self._kernel_layout(
            grads.reshape(grads.shape[0], *self.kernel_size, -1, grads.shape[-1])
        )

    def _kernel_layout(self, grads: jax.Array) -> jax.Array:
        """(B, *spatial, I, O) in kernel spatial order -> (B, *kernel_shape)."""
        order = self.spatial + "IO"
        return jnp.transpose(grads, (0, *(1 + order.index(c) for c in self.dimension_numbers[1])))

    def kernel_grad(self, inputs: jax.Array, out_grads: jax.Array) -> jax.Array:
        """Σ over examples and positions of the kernel gradient: the conv transposed in it."""

        def apply(kernel):
            return jax.lax.conv_general_dilated(
                inputs, kernel, self.strides, self.padding,
                dimension_numbers=self.dimension_numbers, precision=_EXACT,
            )  # fmt: skip

        kernel = jax.ShapeDtypeStruct(self.kernel_shape, inputs.dtype)
        return jax.linear_transpose(apply, kernel)(out_grads)[0]


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
        """`outputs = lax.conv_general_dilated(inputs, kernel, strides, padding)` (no dilation).

        `kernel_size` follows the order of the kernel's spatial axes in `dimension_numbers[1]`,
        whose letters must be those of the input's spatial axes; the output's channel axis is
        `dimension_numbers[2]`'s "C".
        """
        lhs, rhs, out = dimension_numbers
        sizes = dict(zip((c for c in rhs if c not in "IO"), kernel_size, strict=True))
        sizes |= {"I": inputs.shape[lhs.index("C")], "O": outputs.shape[out.index("C")]}
        kernel_shape = tuple(sizes[c] for c in rhs)
        conv = _Conv(kernel_shape, tuple(strides), padding, tuple(dimension_numbers))
        patch = sizes["I"] * math.prod(kernel_size)
        uses = [_Outer(kernel, _INPUT, _GRAD, patch, sizes["O"])]
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


def _map_in_chunks(fn: Callable, batch: tuple) -> jax.Array:
    """`fn(*batch)` for a batched `fn`, `_CPU_CHUNK_EXAMPLES` examples at a time on CPU."""
    size = batch[0].shape[0]
    if jax.default_backend() != "cpu" or size <= _CPU_CHUNK_EXAMPLES:
        return fn(*batch)
    return jax.lax.map(
        lambda one: fn(*(x[None] for x in one))[0], batch, batch_size=_CPU_CHUNK_EXAMPLES
    )


def _correlate(x: jax.Array, g: jax.Array, kernel_size: Sequence[int]) -> jax.Array:
    """(B, *kernel_size, C, O): Σ_t x[b, c, t + d] · g[b, o, t] for every kernel offset d.

    `x` is (B, C, *P) and `g` (B, O, *out) with P_i >= out_i + k_i - 1 (a stride-1
    convolution's padded input and output gradient). Flattening x's grid, and laying g on the
    same grid with zeros past its edge, offset d reads x at flat position t + Σ_i d_i·stride_i.
    The offsets along the last axis shift x, those along the leading axes shift g the other
    way, and one batched matmul over positions of the two stacks gives every pair, i.e. every
    offset: k_last + Π k_lead copies of the layer's arrays instead of the Π k of unfolded
    patches.
    """
    batch, channels, grid = x.shape[0], x.shape[1], x.shape[2:]
    *lead_sizes, last_size = kernel_size
    flat_strides = [math.prod(grid[i + 1 :]) for i in range(len(grid))]
    edges = [(0, p - o) for p, o in zip(grid[1:], g.shape[3:], strict=True)]
    g = jnp.pad(g, ((0, 0), (0, 0), (0, 0), *edges)).reshape(batch, g.shape[1], -1)
    shifts = [
        sum(d * s for d, s in zip(offset, flat_strides, strict=False))
        for offset in itertools.product(*map(range, lead_sizes))
    ]
    length = g.shape[-1] + max(shifts)
    g_stack = jnp.concatenate(
        [jnp.pad(g, ((0, 0), (0, 0), (s, length - g.shape[-1] - s))) for s in shifts], axis=1
    )
    flat = x.reshape(batch, channels, -1)
    flat = jnp.pad(flat, ((0, 0), (0, 0), (0, max(0, length + last_size - 1 - flat.shape[-1]))))
    x_stack = jnp.concatenate([flat[..., d : d + length] for d in range(last_size)], axis=1)
    grads = jnp.einsum("bkt,bot->bko", x_stack, g_stack, precision=_EXACT)
    grads = grads.reshape(batch, last_size, channels, *lead_sizes, -1)
    lead_axes = range(3, 3 + len(lead_sizes))
    return jnp.transpose(grads, (0, *lead_axes, 1, 2, grads.ndim - 1))


def _row_norm_bounds(x: jax.Array) -> jax.Array:
    """(U, T) upper bounds of the L2 norms of the rows of a float32 (U, T, d) factor."""
    squares, depth = staged_square_sum(x, lead=2)
    return jnp.sqrt(squares) * (1.0 + rounding_gamma(depth + 2))


def _rows(x: jax.Array) -> jax.Array:
    """(B, ..., d) -> (B, T, d); a rank-2 array is one position per example."""
    return x.reshape(x.shape[0], -1, x.shape[-1])


class _Factors:
    """The (U, T, ·) factor arrays of the recorded layers, built lazily and once each.

    A unit is `group` consecutive examples of the forward pass (a user's examples at user
    level): its factors are the rows of all its examples, (U, group·T, ·).
    """

    def __init__(self, layers: dict[str, _Layer], arrays: dict, grads: dict, group: int = 1):
        self._layers, self._arrays, self._grads = layers, arrays, grads
        self.group = group
        self._cache: dict[tuple[str, str], jax.Array] = {}

    def units(self, x: jax.Array) -> jax.Array:
        """(B, T, ...) per-example rows -> (B / group, group·T, ...) per-unit rows."""
        return x.reshape(x.shape[0] // self.group, -1, *x.shape[2:])

    def get(self, name: str, side: str) -> jax.Array:
        if (name, side) not in self._cache:
            if side == _GRAD:
                value = self.grad(name)
            elif side == _IDS:
                ids = self._arrays[f"{name}/ids"]
                value = self.units(ids.reshape(ids.shape[0], -1, 1))[..., 0]
            else:
                layer, x = self._layers[name], self._arrays[f"{name}/input"]
                x = _rows(x) if layer.conv is None else jnp.swapaxes(layer.conv.unfold(x), 1, 2)
                value = self.units(x)
            self._cache[(name, side)] = value if side == _IDS else value.astype(jnp.float32)
        return self._cache[(name, side)]

    def row_norms(self, name: str, side: str) -> jax.Array:
        """(U, T) upper bounds of the L2 norms of a factor's rows (1 for a one-hot id row)."""
        if (name, side, "norm") not in self._cache:
            x = self.get(name, side)
            value = jnp.ones(x.shape, jnp.float32) if side == _IDS else _row_norm_bounds(x)
            self._cache[(name, side, "norm")] = value
        return self._cache[(name, side, "norm")]

    def centred(self, name: str, use: _Outer) -> tuple[list, jax.Array]:
        """A use's [(rows, side, row norm bounds)] for its two sides, and a (U,) slack.

        The exact sum of outer products of the returned rows is within `slack` of the use's
        gradient. An input side's rows u_t become r_t = fl(u_t - μ) and one more row μ (their
        mean), paired with the other side's rows v_t and one more row ŝ = fl(Σ_t v_t):
        Σ_t r_t ⊗ v_t + μ ⊗ ŝ differs from Σ_t u_t ⊗ v_t by Σ_t e_t ⊗ v_t, |e_t| <= 2u |r_t|
        (the subtraction's rounding), and μ ⊗ (Σ_t v_t - ŝ), |Σ_t v_t - ŝ| <= γ_T Σ_t |v_t|.
        Layer inputs share a large common direction: centred, their Gram entries, and with them
        the rounding bound of the Gram form, shrink by about the number of positions.
        """
        sides = [(self.get(name, use.left), use.left), (self.get(name, use.right), use.right)]
        if _INPUT not in (use.left, use.right):
            zero = jnp.zeros(sides[0][0].shape[0], jnp.float32)
            return [(x, side, self.row_norms(name, side)) for x, side in sides], zero
        i = [side for _, side in sides].index(_INPUT)
        (x, x_side), (v, v_side) = sides[i], sides[1 - i]
        mean = jnp.mean(x, axis=1, keepdims=True)
        centred = jnp.concatenate([x - mean, mean], axis=1)
        paired = jnp.concatenate([v, jnp.sum(v, axis=1, keepdims=True)], axis=1)
        x_norms, v_norms = _row_norm_bounds(centred), _row_norm_bounds(paired)
        original = self.row_norms(name, v_side)
        positions = original.shape[1]
        slack = 2.0 * UNIT_ROUNDOFF * jnp.sum(x_norms[:, :-1] * original, axis=1)
        slack += rounding_gamma(positions + 2) * x_norms[:, -1] * jnp.sum(original, axis=1)
        rows = [(centred, x_side, x_norms), (paired, v_side, v_norms)]
        return (rows if i == 0 else rows[::-1]), slack * (1.0 + rounding_gamma(positions + 4))

    def grad(self, name: str) -> jax.Array:
        """(U, T, d) output gradients of a layer, channels last."""
        g, conv = self._grads[name], self._layers[name].conv
        if conv is not None and (channel := conv.dimension_numbers[2].index("C")) != g.ndim - 1:
            g = jnp.moveaxis(g, channel, -1)
        return self.units(_rows(g))

    def unit_sum(self, x: jax.Array) -> jax.Array:
        """(B, ...) per-example values -> (U, ...) sums over each unit's examples."""
        return x.reshape(x.shape[0] // self.group, self.group, *x.shape[1:]).sum(axis=1)

    def per_example(self, x: jax.Array) -> jax.Array:
        """(U, ...) per-unit values -> (B, ...), repeated for each of a unit's examples."""
        return jnp.repeat(x, self.group, axis=0)

    def conv_arrays(self, name: str) -> tuple[jax.Array, jax.Array]:
        """A convolution's float32 input and output gradient in its own layout."""
        return self._arrays[f"{name}/input"].astype(jnp.float32), self._grads[name]


def _gram(a: jax.Array, a_side: str, b: jax.Array, b_side: str) -> jax.Array:
    """(B, T, S) inner products of the rows of two factors (ids read as one-hot rows)."""
    if a_side == _IDS and b_side == _IDS:
        return (a[:, :, None] == b[:, None, :]).astype(jnp.float32)
    if a_side == _IDS:
        return _gram(b, b_side, a, a_side).transpose(0, 2, 1)
    if b_side == _IDS:  # <a_t, onehot(ids_s)> = a_t[ids_s]
        index = jnp.broadcast_to(b[:, None, :], (*a.shape[:2], b.shape[1]))
        return jnp.take_along_axis(a, index.astype(jnp.int32), axis=2)
    return jnp.einsum("btd,bsd->bts", a, b, precision=_EXACT)


def _gram_gamma(a: jax.Array, a_side: str, b_side: str) -> float:
    """The relative rounding bound of `_gram`'s entries: |error_ts| <= γ ||a_t|| ||b_s||.

    Zero when a side is ids (an equality test or a lookup is exact), else γ_d of a float32
    dot product of length d.
    """
    return 0.0 if _IDS in (a_side, b_side) else rounding_gamma(a.shape[-1])


def _norm_of_square(square: jax.Array) -> jax.Array:
    """An upper bound of sqrt(square) in float32 (the square root rounded up by its own u)."""
    return jnp.sqrt(square) * (1.0 + 2.0 * UNIT_ROUNDOFF)


def _masked(x: jax.Array, keep: jax.Array) -> jax.Array:
    """Rows of x where `keep`, exact zeros elsewhere (a where, so that inf and NaN cannot leak)."""
    return jnp.where(keep.reshape(-1, *([1] * (x.ndim - 1))), x, 0)


@dataclasses.dataclass
class _Param:
    """Everything one parameter's per-example gradients are built from.

    `direct` is the summed (B, d) per-example gradient of a vector parameter; `uses` are the
    outer-product uses of a matrix parameter; `per_example` is its per-example gradient (B, n, m),
    or (B, *kernel) for a convolution, when that was cheaper to form than Gram matrices (a single
    use with T·(n + m) > n·m).
    """

    direct: jax.Array | None = None
    uses: list[tuple[str, _Outer]] = dataclasses.field(default_factory=list)
    per_example: jax.Array | None = None


class _BookKeeper:
    """Per-example norms and clipped sums from recorded layer inputs and output gradients.

    Privacy: the norm bounds are computed from every example's own data; they are not private
    and serve only to clip. The clipped sums have sensitivity C when the clip factors are
    min(1, C / bound) and every parameter of the model was recorded.
    """

    def __init__(self, layers: dict[str, _Layer], arrays: dict, grads: dict, group: int = 1):
        self._convs = {name: layer.conv for name, layer in layers.items()}
        self._factors = _Factors(layers, arrays, grads, group)
        self.params: dict[ParamKey, _Param] = {}
        for name, layer in layers.items():
            for use in layer.uses:
                entry = self.params.setdefault(_as_key(use.param), _Param())
                if isinstance(use, _Outer):
                    entry.uses.append((name, use))
                    continue
                v = self._factors.get(name, _GRAD)
                if use.scaled:
                    normalized = _rows(arrays[f"{name}/normalized"]).astype(jnp.float32)
                    v = self._factors.units(normalized) * v
                direct = jnp.sum(v, axis=1)
                entry.direct = direct if entry.direct is None else entry.direct + direct
        if shared := [k for k, p in self.params.items() if p.uses and p.direct is not None]:
            raise ValueError(f"parameters [{_key_names(shared)}] are used as matrix and vector.")

    def clip_bounds(self, roundoff: float, eligible: jax.Array, clip_norm) -> jax.Array:
        """(U,) the bound every unit is clipped by: its certified norm bound, or its share of the
        clipped sum's accumulation error if that is larger.

        The norm bound covers the unit's exact gradient from the recorded factors, through the
        rounding of the Gram form; for ordinary inputs it is within about 1e-4 of the norm. The
        share is `summation.mixing_bound` of the magnitudes the unit adds to the float64
        accumulations of `clipped_sums` (its rows' Σ_t |u_t||v_t| in a contraction, its computed
        gradient's norm where that is summed directly); it exceeds the norm bound only for a
        unit whose positions cancel by a factor of about 2²⁹ / (units · rows).

        Loose bounds: an `eligible` unit whose bound exceeds both `_LOOSE` times its float32
        norm estimate and `clip_norm` (C': the bound clips it harder than its norm would) has
        its Gram-form parameters bounded again from their gradients formed in float64
        (`loose_units`), where the rounding of even strongly cancelling positions is negligible.

        Privacy: the bound, and whether a unit is bounded again, are computed from each unit's
        own data (and the public C'), so that no unit changes how another is clipped; they are
        not private and only set the clip factors.
        """
        parts = []
        for entry in self.params.values():
            if entry.direct is not None:
                # What the unit adds is the computed vector itself: only its norm's rounding.
                estimate, depth = staged_square_sum(entry.direct, lead=1)
                value = estimate * (1.0 + rounding_gamma(depth))
                mass, terms = _norm_of_square(value), value.shape[0]
            else:
                value, mass, terms, estimate = self._outer_bounds(entry)
            parts.append((value, summation.mixing_bound(mass, terms, roundoff), mass, estimate))
        # The parameters' bounds are formed apart, then added in one reduction each: fused into
        # a chain of additions, they made one fusion whose compile time grew about as the cube
        # of the model's depth (four minutes for SmolLM2's 30 layers on CPU).
        stacked = tuple(jnp.stack([part[n] for part in parts]) for n in range(4))
        squares, shares, masses, estimates = jax.lax.optimization_barrier(stacked)
        bound = self._combine(squares, shares)
        gram = [i for i, p in enumerate(self.params.values()) if p.uses and p.per_example is None]
        if not gram:
            return bound
        estimate = jnp.sqrt(jnp.sum(estimates, axis=0))
        loose = eligible & jnp.isfinite(bound) & (bound > clip_norm) & (bound > _LOOSE * estimate)
        tight = self._float64_squares(gram, masses[jnp.array(gram)], loose)
        return self._combine(squares.at[jnp.array(gram)].min(tight), shares)

    def _combine(self, squares: jax.Array, shares: jax.Array) -> jax.Array:
        """(U,) clip bounds from every parameter's (P, U) squared-norm bounds and shares."""
        widen = 1.0 + rounding_gamma(len(self.params) + 4)
        bound = jnp.sqrt(jnp.sum(squares, axis=0)) * widen
        return jnp.maximum(bound, jnp.sum(shares, axis=0)).astype(jnp.float32)

    def _float64_squares(self, gram: list[int], triangles: jax.Array, loose: jax.Array):
        """`loose_units.float64_square_bounds` of the Gram-form parameters `gram` (their (G, U)
        `triangles`: bounds of Σ_t |u_t||v_t| over their uses) of the `loose` units."""
        entries = [list(self.params.values())[i] for i in gram]
        factors = [
            [tuple((self._factors.get(name, side), side == _IDS) for side in (use.left, use.right))
             for name, use in entry.uses]
            for entry in entries
        ]  # fmt: skip
        sizes = [(entry.uses[0][1].left_size, entry.uses[0][1].right_size) for entry in entries]
        return loose_units.float64_square_bounds(factors, sizes, triangles, loose)

    def _outer_bounds(self, entry: _Param) -> tuple[jax.Array, jax.Array, int, jax.Array]:
        """A matrix parameter's (U,) bound of its squared norm, (U,) bound of the magnitudes it
        adds to its clipped sum's accumulation, the number of terms of that accumulation, and
        (U,) float32 estimates of its squared norm.

        Gram form, on the rows of `_Factors.centred` (within its slack of the gradient): with A, B
        the computed Gram matrices of the left and right rows, the exact squared norm
        Σ_ts A_ts B_ts exceeds the computed one by at most
        γ_{T+S}·Σ|ÂB̂| (the staged sum) + γ_a·Σ α_t α_s |B̂_ts| + γ_b·Σ |Â_ts| β_t β_s
        + γ_a γ_b·(Σ α β)² (the Gram entries' rounding, α, β the row norms), times 1 + γ_{T·S}
        for the rounding of these non-negative terms themselves (doubled for long sequences);
        and it never exceeds M² = (Σ_t α_t β_t)², the triangle inequality. The clipped sum
        contracts the unit's rows, of magnitudes M, over all units' rows.
        """
        norms = self._factors.row_norms
        units = self._factors.grad(entry.uses[0][0]).shape[0]
        if len(entry.uses) == 1:
            name, use = entry.uses[0]
            positions = self._factors.grad(name).shape[1]
            direct_ok = _IDS not in (use.left, use.right)
            size = use.left_size * use.right_size
            if direct_ok and positions * (use.left_size + use.right_size) > size:
                # The sum adds these computed gradients themselves: only their norm's rounding.
                entry.per_example = self._per_example(name, use)
                estimate, depth = staged_square_sum(entry.per_example, lead=1)
                value = estimate * (1.0 + rounding_gamma(depth))
                return value, _norm_of_square(value), units, estimate
        uses = [self._factors.centred(name, use) for name, use in entry.uses]
        value, error = 0.0, 0.0
        pairs = list(itertools.combinations_with_replacement(enumerate(uses), 2))
        for (i, (sides1, _)), (j, (sides2, _)) in pairs:
            weight = 1.0 if i == j else 2.0
            (l1, ls1, a1), (r1, rs1, b1) = sides1
            (l2, ls2, a2), (r2, rs2, b2) = sides2
            left, right = _gram(l1, ls1, l2, ls2), _gram(r1, rs1, r2, rs2)
            products = left * right
            pair, depth = staged_sum(products, lead=1)
            abs_sum, _ = staged_sum(jnp.abs(products), lead=1)
            gamma_a, gamma_b = _gram_gamma(l1, ls1, ls2), _gram_gamma(r1, rs1, rs2)
            bound = (
                rounding_gamma(depth + len(pairs) + 2) * abs_sum
                + gamma_a * jnp.einsum("bt,bts,bs->b", a1, jnp.abs(right), a2, precision=_EXACT)
                + gamma_b * jnp.einsum("bt,bts,bs->b", b1, jnp.abs(left), b2, precision=_EXACT)
                + gamma_a * gamma_b * jnp.sum(a1 * b1, axis=1) * jnp.sum(a2 * b2, axis=1)
            )
            terms = left.shape[1] * left.shape[2] + 8
            own = rounding_gamma(terms) if terms * UNIT_ROUNDOFF < 0.25 else 1.0
            value, error = value + weight * pair, error + weight * (1.0 + own) * bound
        slack = sum(use_slack for _, use_slack in uses)
        centred = jnp.sqrt(jnp.maximum(value, 0.0) + error) + slack
        rows = sum(norms(n, u.left).shape[1] for n, u in entry.uses)
        triangle = sum(jnp.sum(norms(n, u.left) * norms(n, u.right), axis=1) for n, u in entry.uses)
        triangle = triangle * (1.0 + rounding_gamma(rows + 2))
        bound = jnp.square(jnp.minimum(centred, triangle))
        return bound, triangle, units * rows, jnp.maximum(value, 0.0)

    @summation.in_float64
    def clipped_sums(self, weights: jax.Array, keep: jax.Array) -> dict[ParamKey, jax.Array]:
        """Σ_j weights_j g_j per parameter in float64, rows outside `keep` contributing exactly 0.

        Every factor is converted to float64 before it is scaled and contracted, so products of
        the float32 factors and weights are exact and only the accumulation rounds (see
        `summation`). Call after `clip_bounds` (which decides how each matrix parameter is
        formed).
        """
        weights = summation.wide(weights)
        sums = {}
        for key, entry in self.params.items():
            if entry.direct is not None:
                sums[key] = jnp.einsum(
                    "bd,b->d", _masked(summation.wide(entry.direct), keep), weights,
                    precision=_EXACT,
                )  # fmt: skip
            elif entry.per_example is not None:
                per_example = _masked(summation.wide(entry.per_example), keep)
                sums[key] = jnp.tensordot(weights, per_example, axes=1, precision=_EXACT)
            else:
                sums[key] = sum(self._outer_sum(n, u, weights, keep) for n, u in entry.uses)
        return sums

    def _per_example(self, name: str, use: _Outer) -> jax.Array:
        """(B, ...) per-example gradients of a single-use matrix parameter, in its layout."""
        if conv := self._convs[name]:
            inputs, out_grads = self._factors.conv_arrays(name)
            return self._factors.unit_sum(conv.per_example_kernel_grads(inputs, out_grads))
        left, right = self._factors.get(name, use.left), self._factors.get(name, use.right)
        return _outer_contract(left, right, batched=True)

    def _outer_sum(self, name: str, use: _Outer, weights: jax.Array, keep: jax.Array):
        """Σ_j weights_j Σ_t left_jt ⊗ right_jt in float64 (inside `clipped_sums`' scope): one
        matmul, a conv transpose, or a scatter-add."""
        if conv := self._convs[name]:
            inputs, out_grads = map(summation.wide, self._factors.conv_arrays(name))
            weights, keep = self._factors.per_example(weights), self._factors.per_example(keep)
            scaled = weights.reshape(-1, *([1] * (out_grads.ndim - 1))) * out_grads
            return conv.kernel_grad(_masked(inputs, keep), _masked(scaled, keep))

        def factor(side):
            x = self._factors.get(name, side)
            if side == _IDS:
                return x
            x = summation.wide(x)
            return _masked(x * weights[:, None, None] if side == _GRAD else x, keep)

        left, right = factor(use.left), factor(use.right)
        if use.left == _IDS:
            table = jnp.zeros((use.left_size, use.right_size), summation.ACCUMULATION)
            return table.at[left.reshape(-1)].add(right.reshape(-1, use.right_size))
        return _outer_contract(left, right, batched=False)


def _outer_contract(left: jax.Array, right: jax.Array, *, batched: bool) -> jax.Array:
    """Σ_t left_t ⊗ right_t of (B, T, n) and (B, T, m): (B, n, m), or (n, m) also summed over B.

    XLA:CPU's matmul wants its left operand with the contracted axis minor, so that operand is
    transposed in memory first: the narrower factor goes on the left (with a vocabulary-sized
    factor, such as a tied head's logit gradients, this is several times faster).
    """
    spec = "btn,btm->bnm" if batched else "btn,btm->nm"
    if left.shape[-1] <= right.shape[-1]:
        return jnp.einsum(spec, left, right, precision=_EXACT)
    return jnp.swapaxes(jnp.einsum(spec, right, left, precision=_EXACT), -1, -2)


def _as_key(key: ParamKey) -> tuple:
    return key if isinstance(key, tuple) else (key,)


def _key_names(keys) -> str:
    return ", ".join(sorted("/".join(map(str, key)) for key in keys)[:5])


def _path_key(path: tuple) -> tuple:
    """The parameter key of a leaf path: its dict keys and sequence indices."""
    steps = []
    for entry in path:
        if isinstance(entry, jax.tree_util.DictKey):
            steps.append(entry.key)
        elif isinstance(entry, jax.tree_util.SequenceKey):
            steps.append(entry.idx)
    return tuple(steps)


@summation.in_float64
def _fill(params: PyTree, sums: dict[tuple, jax.Array]) -> PyTree:
    """`params`-shaped tree of the float64 sums, each rounded once into its leaf's `sum_dtype`
    (float32 or wider) whatever the leaf dtype.

    Every leaf must have been recorded, and nothing else.
    """
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = {_path_key(path) for path, _ in leaves}
    if unknown := set(sums) - keys:
        raise ValueError(f"the tape names parameters [{_key_names(unknown)}] not in params.")
    if missing := keys - set(sums):
        raise ValueError(
            f"parameters [{_key_names(missing)}] were not reported to the tape, so their "
            "gradients would be unclipped; report every parameterised layer or use the vmap path."
        )

    def leaf_sum(path, leaf):
        total = sums[_path_key(path)]
        if total.size != leaf.size:
            raise ValueError(
                f"parameter {_path_key(path)} has shape {leaf.shape}, but its recorded layers "
                f"give a gradient of shape {total.shape}."
            )
        return total.reshape(leaf.shape).astype(sum_dtype(leaf.dtype))

    return jax.tree_util.tree_map_with_path(leaf_sum, params)


def ghost_clipped_grad_sum(loss_fn: TapedLossFn, *, clip_norm: float) -> ClippedGradSum:
    """Example-level clipped gradient sum by ghost norms and book-keeping, in one backward pass.

    Args:
        loss_fn: `loss_fn(params, batch, tape) -> (B,)` per-example losses of a whole batch. It
            reports every parameterised layer to `tape` (see `Tape`); example j's loss must not
            depend on other examples.
        clip_norm: C > 0, the L2 bound of each example's gradient.

    Returns:
        A `ClippedGradSum` `(params, batch, mask) -> (sum, stats)` with `stats["loss"]` and
        `stats["grad_norm"]` (B,): the certified norm bound each example was clipped by, and
        `stats["unclipped"]`, a drop-in for `clipping.clipped_grad_sum` (the clip norm may be
        given at call time too). The sum is float32 (float64 for float64
        parameters). It raises `ValueError` when a leaf of `params` is not reported to the tape.

    Privacy: the returned sum has L2 sensitivity `clip_norm` under add/remove of one example:
    it is Σ_j c_j ∇loss_j with c_j N_j <= C for a certified bound N_j >= ||∇loss_j|| that
    covers float32 rounding (see the module docstring), provided the tape covers every parameter
    (checked) and the loss is per-example. Padded rows and rows with a non-finite norm get
    c_j = 0, and their factors are zeroed with `where`, so that 0 · inf cannot reach the sum.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    return ClippedGradSum(_ghost_sum(loss_fn, clip_norm), clip_norm)


def ghost_user_clipped_grad_sum(loss_fn: TapedLossFn, *, clip_norm: float) -> ClippedGradSum:
    """User-level clipped gradient sum by ghost norms, for batches shaped `(U, G, ...)`.

    The forward pass runs on the `U·G` examples at once; a user's gradient is the mean of the
    gradients of its real examples (the `(U, G)` mask), as in `clipping.user_clipped_grad_sum`,
    and its norm bound is a certified ghost norm bound over the rows of all its examples.

    Args:
        loss_fn: as for `ghost_clipped_grad_sum`, called on the `(U·G, ...)` flattened batch.
        clip_norm: C > 0, the L2 bound of each user's gradient.

    Returns:
        A `ClippedGradSum` with per-user stats (`loss`: the user's mean loss), a drop-in for
        `clipping.user_clipped_grad_sum`.

    Privacy: the sum has L2 sensitivity `clip_norm` under add/remove of one user with all of
    their examples (each user in one row of the batch); padded examples get a zero loss weight,
    users with no real example, or a non-finite norm, contribute exactly zero.
    """
    clip_norm = check_positive(clip_norm, "clip_norm")
    return ClippedGradSum(_ghost_sum(loss_fn, clip_norm, user_level=True), clip_norm)


def _ghost_sum(loss_fn: TapedLossFn, clip_norm: float, user_level: bool = False) -> Callable:
    def function(params, batch, mask, call_clip_norm=clip_norm, release_units=None):
        mask = jnp.asarray(mask, dtype=bool)
        for leaf in jax.tree.leaves(batch):
            if leaf.shape[: mask.ndim] != mask.shape:
                raise ValueError(
                    f"every batch leaf needs a leading axis of {mask.shape} (the mask's "
                    f"shape); got a leaf of shape {leaf.shape}."
                )
        group = mask.shape[1] if user_level else 1
        if user_level:
            batch = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), batch)
            example_weights = mask / jnp.maximum(jnp.sum(mask, axis=1, keepdims=True), 1)
            example_weights = example_weights.reshape(-1)
            unit_mask = jnp.any(mask, axis=1)
        else:
            example_weights, unit_mask = jnp.ones(mask.shape, jnp.float32), mask
        probe = Tape()
        jax.eval_shape(lambda: loss_fn(params, batch, probe))
        zeros = {name: jnp.zeros(layer.output.shape, jnp.float32) for name, layer in
                 probe.layers.items()}  # fmt: skip

        def taped(perturbations):
            tape = Tape(perturbations)
            return loss_fn(params, batch, tape), tape.arrays

        losses, pullback, arrays = jax.vjp(taped, zeros, has_aux=True)
        (grads,) = pullback(example_weights.astype(losses.dtype))
        keeper = _BookKeeper(probe.layers, arrays, grads, group)
        roundoff = summation.output_roundoff(params)
        units = unit_mask.shape[0]
        bound = summation.effective_clip_norm(call_clip_norm, units, roundoff, release_units)
        norms = keeper.clip_bounds(roundoff, unit_mask, bound)
        keep = unit_mask & jnp.isfinite(norms)
        weights = clip_factor(norms, bound, keep)
        total = _fill(params, keeper.clipped_sums(weights, keep))
        if user_level:
            weighted = jnp.where(example_weights > 0, losses * example_weights, 0)
            losses = weighted.reshape(-1, group).sum(axis=1)
        within = unclipped(norms, call_clip_norm, keep)
        return total, {"loss": losses, "grad_norm": norms, "unclipped": within}

    return function
