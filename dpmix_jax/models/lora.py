"""LoRA adapters for GPT-2 and Llama: low-rank updates of the attention and MLP projections.

A LoRA layer (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") computes

    y = W x + b + (α / r) · B A x

with the pretrained ``W``, ``b`` frozen, ``A`` of shape ``(r, d_in)`` drawn from a normal
distribution and ``B`` of shape ``(d_out, r)`` initialised to zero, so the adapted model starts as
the pretrained one. Here ``A`` and ``B`` are two bias-free ``nnx.Linear`` layers (``lora_a`` with
kernel ``(d_in, r)``, ``lora_b`` with kernel ``(r, d_out)``): the ghost clipping tape
(`train.ghost_models`) covers them as it covers any dense layer, so a private Trainer with the
adapter mask selects ghost clipping (`clipping="auto"`) with no LoRA-specific code.

`add_lora` replaces the targeted ``nnx.Linear`` projections of a `GPT2` or a `Llama` in place by
`LoraLinear` (the original layer becomes its ``base``); `trainable_mask` marks the adapters alone as
trainable; `merge_lora` folds the adapters into the base kernels and returns a plain model with
the checkpoint's parameter layout, for export or decoding without the extra matmuls.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from dpmix_jax.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config.tiny(), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((1, 4), jnp.int32)
    >>> base_logits = model(tokens)
    >>> model = add_lora(model, LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
    >>> bool(jnp.array_equal(model(tokens), base_logits))  # B = 0: the identity at start
    True
    >>> merge_lora(model).h[0].attn.c_attn.kernel.shape
    (64, 192)
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpmix_jax.models.gpt2 import GPT2
from dpmix_jax.models.llama import Llama

# The projections each target names, as (sub-module of a block, attribute).
TARGET_LAYERS = {
    "attention": (("attn", "c_attn"), ("attn", "c_proj")),
    "mlp": (("mlp", "c_fc"), ("mlp", "c_proj")),
}
LLAMA_TARGET_LAYERS = {
    "attention": tuple(("self_attn", f"{name}_proj") for name in "qkvo"),
    "mlp": tuple(("mlp", f"{name}_proj") for name in ("gate", "up", "down")),
}
_ADAPTER_NAMES = ("lora_a", "lora_b")


def _positive_finite(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Shape and scale of the LoRA adapters.

    Attributes:
        rank: r, the inner width of every adapter (``1 <= r``; at most each layer's smaller side).
        alpha: α; the adapter's output is scaled by α / r (so changing r keeps the update's scale).
        targets: which projections of every block get an adapter: "attention" (``c_attn``,
            ``c_proj`` of the attention) and/or "mlp" (``c_fc``, ``c_proj`` of the MLP); for a
            `Llama`, the ``q/k/v/o_proj`` and the ``gate/up/down_proj`` projections.
        init_std: standard deviation of A's normal initialisation; None: 1 / sqrt(d_in) of each
            layer (the adapter's hidden activations then have the scale of its inputs).
    """

    rank: int
    alpha: float
    targets: tuple[str, ...] = ("attention", "mlp")
    init_std: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"rank must be an integer >= 1, got {self.rank!r}.")
        if not _positive_finite(self.alpha):
            raise ValueError(f"alpha must be a finite number > 0, got {self.alpha!r}.")
        targets = (self.targets,) if isinstance(self.targets, str) else tuple(self.targets)
        known = all(target in TARGET_LAYERS for target in targets)
        if not targets or not known or len(set(targets)) < len(targets):
            raise ValueError(
                f"targets must be distinct names among {tuple(TARGET_LAYERS)}, got "
                f"{self.targets!r}."
            )
        object.__setattr__(self, "targets", targets)
        if self.init_std is not None and not _positive_finite(self.init_std):
            raise ValueError(
                f"init_std must be None or a finite number > 0, got {self.init_std!r}."
            )

    @property
    def scaling(self) -> float:
        """α / r, the factor applied to the adapter's output."""
        return self.alpha / self.rank


class LoraLinear(nnx.Module):
    """A frozen ``nnx.Linear`` plus a low-rank update: ``base(x) + s · lora_b(lora_a(x))``.

    Args:
        base: the pretrained layer (kept as the ``base`` attribute, its parameters unchanged).
        rank: r.
        scaling: s = α / r.
        init_std: standard deviation of ``lora_a``'s normal kernel (``lora_b``'s is zero).
        rngs: random streams for ``lora_a``'s initialisation.
    """

    def __init__(
        self, base: nnx.Linear, *, rank: int, scaling: float, init_std: float, rngs: nnx.Rngs
    ):
        d_in, d_out = base.in_features, base.out_features
        if rank > min(d_in, d_out):
            raise ValueError(
                f"rank {rank} exceeds the smaller side of a {d_in} x {d_out} layer; a LoRA "
                "update of that rank is no longer low-rank."
            )
        dtypes = {"dtype": base.dtype, "param_dtype": base.param_dtype}
        self.base = base
        normal = nnx.initializers.normal(init_std)
        self.lora_a = nnx.Linear(
            d_in, rank, use_bias=False, kernel_init=normal, rngs=rngs, **dtypes
        )
        self.lora_b = nnx.Linear(
            rank, d_out, use_bias=False, kernel_init=nnx.initializers.zeros, rngs=rngs, **dtypes
        )
        self.scaling = scaling

    def __call__(self, x: jax.Array) -> jax.Array:
        update = self.lora_b(self.lora_a(x))
        return self.base(x) + jnp.asarray(self.scaling, update.dtype) * update

    def merged_kernel(self) -> jax.Array:
        """``W + s · A B`` in the base kernel's ``(d_in, d_out)`` layout and dtype (float32 sum)."""
        kernel = self.base.kernel.value
        delta = jnp.matmul(
            self.lora_a.kernel.value.astype(jnp.float32),
            self.lora_b.kernel.value.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
        return (kernel.astype(jnp.float32) + self.scaling * delta).astype(kernel.dtype)


def _blocks_and_layers(model: GPT2 | Llama) -> tuple[nnx.List, dict]:
    """The transformer blocks of `model` and the projections each target names in a block."""
    if isinstance(model, Llama):
        return model.layers, LLAMA_TARGET_LAYERS
    return model.h, TARGET_LAYERS


def _targets(model: GPT2 | Llama, targets: tuple[str, ...]):
    """(parent module, attribute) of every targeted projection, block by block."""
    blocks, layers = _blocks_and_layers(model)
    for block in blocks:
        for target in targets:
            for module_name, attribute in layers[target]:
                yield getattr(block, module_name), attribute


def add_lora(model: GPT2 | Llama, config: LoraConfig, *, rngs: nnx.Rngs) -> GPT2 | Llama:
    """Adds LoRA adapters to the targeted projections of `model`, in place; returns `model`.

    The outputs are unchanged at first (B = 0); only `config.targets` get adapters.

    Args:
        model: a `GPT2` or `Llama` without adapters (e.g. from `GPT2.from_pretrained` or
            `llama_weights.load_llama`).
        config: the adapters' shape and scale.
        rngs: random streams for the A matrices.

    Returns:
        The same model object, whose targeted layers are now `LoraLinear`.

    Raises:
        ValueError: if the model already has adapters.
    """
    for parent, attribute in _targets(model, config.targets):
        layer = getattr(parent, attribute)
        if type(layer) is not nnx.Linear:
            raise ValueError(
                f"{attribute} is a {type(layer).__name__}, not a plain nnx.Linear; the model "
                "already has adapters."
            )
        std = config.init_std or 1.0 / math.sqrt(layer.in_features)
        adapted = LoraLinear(
            layer, rank=config.rank, scaling=config.scaling, init_std=std, rngs=rngs
        )
        setattr(parent, attribute, adapted)
    return model


def lora_from_pretrained(
    path: str | os.PathLike, config: LoraConfig, *, seed: int = 0, dtype: Any = None
) -> GPT2:
    """A transformers GPT-2 checkpoint (see `GPT2.from_pretrained`) with fresh adapters on top.

    Args:
        path: the checkpoint folder, weights file or hub name.
        config: the adapters.
        seed: seed of the A matrices' initialisation.
        dtype: optional compute dtype.
    """
    model = GPT2.from_pretrained(path, dtype=dtype)
    return add_lora(model, config, rngs=nnx.Rngs(seed))


def _is_adapter(key_path) -> bool:
    keys = [k.key for k in key_path if isinstance(k, jax.tree_util.DictKey)]
    return any(name in keys for name in _ADAPTER_NAMES)


def trainable_mask(model_or_params: nnx.Module | nnx.State):
    """The mask that trains the adapters alone: True on ``lora_a``/``lora_b`` kernels.

    Args:
        model_or_params: a model with adapters or its ``nnx.Param`` state.

    Returns:
        A bool pytree with the structure of the parameter state, for `train.Trainer`'s
        ``trainable_mask``: the pretrained weights (embeddings, LayerNorms, base projections)
        stay frozen, bit-identical after training.

    Raises:
        ValueError: if the model has no adapters.
    """
    params = (
        nnx.state(model_or_params, nnx.Param)
        if isinstance(model_or_params, nnx.Module)
        else model_or_params
    )
    mask = jax.tree_util.tree_map_with_path(lambda path, _: _is_adapter(path), params)
    if not any(jax.tree.leaves(mask)):
        raise ValueError("the model has no LoRA adapters; call add_lora first.")
    return mask


def merge_lora(model: GPT2 | Llama) -> GPT2 | Llama:
    """A plain model whose projections are ``W + (α / r) A B``: the adapted model, merged.

    The result has the parameter layout of `GPT2` or `Llama` (and of the checkpoint), so it
    decodes without the adapters' extra matmuls; `model` itself is left unchanged.

    Privacy: post-processing of the adapters and the (public) base weights: the merged model is
    exactly as private as the adapters released by the run.
    """
    merged = nnx.clone(model)
    found = False
    blocks, layers = _blocks_and_layers(merged)
    for block in blocks:
        for module_name, attribute in (pair for pairs in layers.values() for pair in pairs):
            parent = getattr(block, module_name)
            layer = getattr(parent, attribute)
            if isinstance(layer, LoraLinear):
                layer.base.kernel.value = layer.merged_kernel()
                setattr(parent, attribute, layer.base)
                found = True
    if not found:
        raise ValueError("the model has no LoRA adapters to merge.")
    return merged
