"""Per-example clipped gradient sums for Flax NNX models, by vmap or by ghost clipping.

`model_clipped_grad_sum(model, batch_loss, clip_norm=C, method=...)` returns a
`privacy.ClippedGradSum` over the model's `nnx.Param` state for either method, so a training loop
selects the method per model without other changes:

- "vmap": per-example gradients with `jax.vmap` (any model), optionally in microbatches;
- "ghost": ghost norms and book-keeping (`privacy.ghost`): one forward and one backward pass to the
  layer outputs, then the clipped sums from the kept layer inputs and output gradients; for
  models built from `nnx.Linear`, `nnx.Embed` (including a tied `attend` head), `nnx.LayerNorm`,
  `nnx.RMSNorm`, `nnx.GroupNorm` and the ResNet `Conv` (without weight standardisation).

The ghost path reports layers to the tape without touching model code: inside the traced loss,
the freshly merged model's supported modules are switched to subclasses whose calls run the
original layer and then report its input and output to the tape (`tap_model`). With partial
fine-tuning (`key_fn` returns None for frozen parameters) only layers with a trainable parameter
are tapped, and a layer's frozen parameters get no gradient; `train.Trainer` uses this path by
default (`TrainConfig.clipping`).

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    >>> loss = lambda m, batch: jnp.sum(m(batch["x"]) ** 2, axis=-1)
    >>> grad_sum = model_clipped_grad_sum(model, loss, clip_norm=1.0, method="ghost")
    >>> total, stats = grad_sum(nnx.state(model, nnx.Param), {"x": jnp.ones((4, 3))},
    ...                         jnp.ones(4, bool))
    >>> stats["grad_norm"].shape
    (4,)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpmix_jax.models.resnet import Conv, GroupNorm, group_statistics
from dpmix_jax.privacy.clipping import ClippedGradSum, clipped_grad_sum
from dpmix_jax.privacy.ghost import Tape, ghost_clipped_grad_sum

# batch_loss(model, batch) -> (B,) per-example losses.
BatchLossFn = Callable[[nnx.Module, Any], jax.Array]
METHODS = ("vmap", "ghost")


def _tap(module: nnx.Module) -> tuple[Tape, str, dict[str, Any]]:
    """The tape, the layer name and the parameter keys (None: frozen) of a tapped module."""
    return (
        module.__dict__["_ghost_tape"],
        module.__dict__["_ghost_name"],
        module.__dict__["_ghost_keys"],
    )


def _name(path: tuple) -> str:
    return "/".join(map(str, path))


def _normalize(x: jax.Array, axes: tuple[int, ...], epsilon: float) -> jax.Array:
    """(x - mean) / sqrt(var + eps) over `axes`, as Flax computes it (fast variance)."""
    x = x.astype(jnp.float32)
    mean = x.mean(axes, keepdims=True)
    var = jnp.maximum(0.0, jnp.square(x).mean(axes, keepdims=True) - jnp.square(mean))
    return (x - mean) * jax.lax.rsqrt(var + epsilon)


class _TapLinear(nnx.Linear):
    def __call__(self, inputs, out_sharding=None):
        tape, name, keys = _tap(self)
        outputs = super().__call__(inputs, out_sharding=out_sharding)
        return tape.linear(name, inputs, outputs, kernel=keys["kernel"], bias=keys["bias"])


class _TapEmbed(nnx.Embed):
    def __call__(self, inputs, out_sharding=None):
        tape, name, keys = _tap(self)
        outputs = super().__call__(inputs, out_sharding=out_sharding)
        return tape.embedding(
            name, inputs, outputs, table=keys["embedding"], vocab_size=self.num_embeddings
        )

    def attend(self, query, out_sharding=None):
        tape, name, keys = _tap(self)
        logits = super().attend(query, out_sharding=out_sharding)
        return tape.attend(name + "/attend", query, logits, table=keys["embedding"])


class _TapLayerNorm(nnx.LayerNorm):
    def __call__(self, x, *, mask=None):
        if mask is not None:
            raise ValueError("ghost clipping does not support masked LayerNorm statistics.")
        tape, name, keys = _tap(self)
        outputs = super().__call__(x)
        axes = tuple(range(x.ndim))[self.reduction_axes :] if isinstance(
            self.reduction_axes, int
        ) else tuple(self.reduction_axes)  # fmt: skip
        normalized = _normalize(x, axes, self.epsilon)
        return tape.scale_shift(name, normalized, outputs, scale=keys["scale"], bias=keys["bias"])


class _TapRMSNorm(nnx.RMSNorm):
    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("ghost clipping does not support masked RMSNorm statistics.")
        tape, name, keys = _tap(self)
        outputs = super().__call__(x)
        axes = tuple(range(x.ndim))[self.reduction_axes :] if isinstance(
            self.reduction_axes, int
        ) else tuple(self.reduction_axes)  # fmt: skip
        x = x.astype(jnp.float32)
        normalized = x * jax.lax.rsqrt(jnp.square(x).mean(axes, keepdims=True) + self.epsilon)
        return tape.scale_shift(name, normalized, outputs, scale=keys["scale"], bias=None)


class _TapGroupNorm(nnx.GroupNorm):
    def __call__(self, x, *, mask=None):
        if mask is not None or self.reduction_axes is not None:
            raise ValueError("ghost clipping supports GroupNorm over all non-batch axes only.")
        tape, name, keys = _tap(self)
        outputs = super().__call__(x)
        mean, inv_std = group_statistics(x, self.num_groups, self.epsilon)
        normalized = (x.astype(jnp.float32) - mean) * inv_std
        return tape.scale_shift(name, normalized, outputs, scale=keys["scale"], bias=keys["bias"])


class _TapResNetGroupNorm(_TapGroupNorm, GroupNorm):
    """The tap over the ResNet's GroupNorm (its own forward, the same recorded arrays)."""


class _TapConv(Conv):
    def __call__(self, x):
        tape, name, keys = _tap(self)
        outputs = super().__call__(x)
        size = self.kernel.shape[:2]
        pad = (self.padding, self.padding)
        return tape.conv(
            name, x.astype(self.dtype), outputs, kernel=keys["kernel"],
            kernel_size=size, strides=(self.stride, self.stride), padding=(pad, pad),
        )  # fmt: skip


_TAPPED = {
    nnx.Linear: _TapLinear,
    nnx.Embed: _TapEmbed,
    nnx.LayerNorm: _TapLayerNorm,
    nnx.RMSNorm: _TapRMSNorm,
    nnx.GroupNorm: _TapGroupNorm,
    GroupNorm: _TapResNetGroupNorm,
    Conv: _TapConv,
}
_PARAM_NAMES = ("kernel", "bias", "embedding", "scale")
# The parameter that carries the layer's outer-product gradient (it must be trainable whenever
# any parameter of the layer is: the tape cannot record a layer without it).
_MATRIX = {nnx.Linear: "kernel", nnx.Embed: "embedding", Conv: "kernel"}
# A parameter's key for the tape from its path in the model (module path + attribute name), or
# None for a frozen parameter.
KeyFn = Callable[[tuple], Any]


def _param_paths(params: nnx.State) -> list[tuple]:
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return [tuple(k.key for k in p if isinstance(k, jax.tree_util.DictKey)) for p, _ in paths]


def _layer_keys(module: nnx.Module, path: tuple, key_fn: KeyFn) -> dict[str, Any]:
    return {
        name: key_fn(path + (name,)) if getattr(module, name, None) is not None else None
        for name in _PARAM_NAMES
    }


def _tapped_layers(model: nnx.Module, key_fn: KeyFn):
    """(path, module, keys) of each supported layer with at least one trainable parameter."""
    for path, module in nnx.iter_modules(model):
        if type(module) in _TAPPED:
            keys = _layer_keys(module, path, key_fn)
            if any(key is not None for key in keys.values()):
                yield path, module, keys


def check_ghost_support(model: nnx.Module, key_fn: KeyFn = lambda path: path) -> None:
    """Raises ValueError unless every trainable parameter of `model` is in a layer the tape covers.

    Args:
        model: the NNX model.
        key_fn: a parameter's key from its path, None for a frozen parameter (default: every
            parameter is trainable and keyed by its path).
    """
    covered = set()
    for path, module, keys in _tapped_layers(model, key_fn):
        if isinstance(module, Conv) and module.weight_standardization:
            raise ValueError(
                f"ghost clipping does not support weight-standardised convolutions "
                f"({_name(path)}); use method='vmap'."
            )
        matrix = next((v for k, v in _MATRIX.items() if isinstance(module, k)), None)
        if matrix is not None and keys[matrix] is None:
            raise ValueError(
                f"ghost clipping needs the {matrix} of {_name(path)} trainable when another of "
                "its parameters is; use method='vmap'."
            )
        covered |= {path + (name,) for name in _PARAM_NAMES}
    trainable = {p for p in _param_paths(nnx.state(model, nnx.Param)) if key_fn(p) is not None}
    if missing := trainable - covered:
        names = sorted(_name(p) for p in missing)
        raise ValueError(
            f"ghost clipping needs every parameter in a supported layer "
            f"({', '.join(t.__name__ for t in _TAPPED)}); not covered: {names[:5]}. "
            "Use method='vmap'."
        )


def tap_model(model: nnx.Module, tape: Tape, key_fn: KeyFn = lambda path: path) -> nnx.Module:
    """Switches the supported layers of a freshly merged `model` to taps that report to `tape`.

    Call inside the traced loss on a model rebuilt by `nnx.merge` (the switch mutates it). Layers
    whose parameters are all frozen (`key_fn` None) stay plain: no gradient is kept for them.
    """
    for path, module, keys in list(_tapped_layers(model, key_fn)):
        module.__class__ = _TAPPED[type(module)]
        module.__dict__["_ghost_tape"] = tape
        module.__dict__["_ghost_name"] = _name(path)
        module.__dict__["_ghost_keys"] = keys
    return model


def model_clipped_grad_sum(
    model: nnx.Module,
    batch_loss: BatchLossFn,
    *,
    clip_norm: float,
    method: str = "vmap",
    microbatch_size: int | None = None,
) -> ClippedGradSum:
    """Clipped per-example gradient sum over `nnx.state(model, nnx.Param)`.

    Args:
        model: the NNX model (its non-parameter state is captured as a constant).
        batch_loss: `batch_loss(model, batch) -> (B,)` per-example losses; example j's loss must
            depend on example j only.
        clip_norm: C > 0.
        method: "vmap" or "ghost" (see the module docstring).
        microbatch_size: vmap only: examples per `lax.scan` chunk.

    Returns:
        `(params, batch, mask) -> (sum, stats)` with `params` an `nnx.State` of the model's
        parameters; `sum` has the same structure.

    Privacy: the sum has L2 sensitivity `clip_norm` under add/remove of one example (each
    example's gradient over all parameters is clipped; padded and non-finite rows add zero).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}.")
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)
    if method == "vmap":

        def example_loss(params, example):
            return batch_loss(nnx.merge(graphdef, params, rest), example)[0]

        return clipped_grad_sum(
            example_loss, clip_norm=clip_norm, microbatch_size=microbatch_size,
            keep_batch_dim=True,
        )  # fmt: skip
    if microbatch_size is not None:
        raise ValueError("microbatch_size applies to method='vmap' only.")
    check_ghost_support(model)

    def taped_loss(params, batch, tape):
        return batch_loss(tap_model(nnx.merge(graphdef, params, rest), tape), batch)

    return ghost_clipped_grad_sum(taped_loss, clip_norm=clip_norm)
