"""ResNet-18 / ResNet-50 in Flax NNX with GroupNorm (no BatchNorm), for per-example gradients.

BatchNorm mixes statistics across the examples of a batch, which breaks both per-example gradients
under ``jax.vmap`` and the privacy analysis of DP-SGD; every normalisation here is a per-example
GroupNorm, optionally combined with weight-standardised convolutions (Qiao et al. 2019), the
combination used for DP image classification by De et al. 2022 (arXiv 2204.13650).

Example Usage:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> model = ResNet(ResNetConfig.tiny(), num_outputs=3, rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 32, 32, 3))).shape
  (2, 3)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dpmix_jax.models.dtypes import float_dtype

_BLOCK_EXPANSION = {"basic": 1, "bottleneck": 4}
_STEMS = ("imagenet", "cifar")
_NORM_EPS = 1e-5
_WS_EPS = 1e-5


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResNetConfig:
    """Architecture of a GroupNorm ResNet.

    Attributes:
      block: "basic" (two 3x3 convs, ResNet-18/34) or "bottleneck" (1x1-3x3-1x1 with 4x expansion,
        ResNet-50 and up; stride on the 3x3 conv as in torchvision).
      stage_sizes: number of blocks per stage; stage i has ``width * 2**i`` channels (times the
        block expansion at its output) and every stage after the first halves the resolution.
      width: channels of the stem and of the first stage (64 for the ImageNet models).
      groups: number of GroupNorm groups; must divide ``width``.
      stem: "imagenet" (7x7 stride-2 conv + 3x3 stride-2 max-pool) or "cifar" (3x3 stride-1 conv,
        no pooling, for small inputs such as 32x32).
      weight_standardization: standardise every conv kernel per output channel before use.
      in_channels: channels of the NHWC input images.
      dtype: compute dtype (e.g. "bfloat16"); logits are always returned in float32.
      param_dtype: dtype of the stored parameters.
    """

    block: str = "basic"
    stage_sizes: tuple[int, ...] = (2, 2, 2, 2)
    width: int = 64
    groups: int = 32
    stem: str = "imagenet"
    weight_standardization: bool = False
    in_channels: int = 3
    dtype: Any = "float32"
    param_dtype: Any = "float32"

    def __post_init__(self):
        if self.block not in _BLOCK_EXPANSION:
            raise ValueError(f"block must be one of {sorted(_BLOCK_EXPANSION)}, got {self.block!r}")
        if self.stem not in _STEMS:
            raise ValueError(f"stem must be one of {_STEMS}, got {self.stem!r}")
        stage_sizes = tuple(self.stage_sizes)
        if not stage_sizes or any(int(n) != n or n < 1 for n in stage_sizes):
            raise ValueError(
                f"stage_sizes must be a non-empty tuple of ints >= 1, got {stage_sizes}"
            )
        object.__setattr__(self, "stage_sizes", tuple(int(n) for n in stage_sizes))
        for name in ("width", "groups", "in_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.width % self.groups:
            raise ValueError(
                f"groups ({self.groups}) must divide width ({self.width}) so that every GroupNorm "
                "channel count is divisible by it"
            )
        object.__setattr__(self, "dtype", float_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", float_dtype(self.param_dtype, "param_dtype"))

    @property
    def expansion(self) -> int:
        """Ratio of a block's output channels to its inner width."""
        return _BLOCK_EXPANSION[self.block]

    @property
    def feature_dim(self) -> int:
        """Channels of the pooled features fed to the head."""
        return self.width * 2 ** (len(self.stage_sizes) - 1) * self.expansion

    @classmethod
    def resnet18(cls, **overrides) -> ResNetConfig:
        """ResNet-18: basic blocks, stages (2, 2, 2, 2)."""
        return cls(**{"block": "basic", "stage_sizes": (2, 2, 2, 2), **overrides})

    @classmethod
    def resnet50(cls, **overrides) -> ResNetConfig:
        """ResNet-50: bottleneck blocks, stages (3, 4, 6, 3)."""
        return cls(**{"block": "bottleneck", "stage_sizes": (3, 4, 6, 3), **overrides})

    @classmethod
    def tiny(cls, **overrides) -> ResNetConfig:
        """Two basic stages of one block, width 8, CIFAR stem: for CPU tests."""
        defaults = {
            "block": "basic",
            "stage_sizes": (1, 1),
            "width": 8,
            "groups": 4,
            "stem": "cifar",
        }
        return cls(**{**defaults, **overrides})


class Conv(nnx.Module):
    """Bias-free 2-D convolution on NHWC inputs, torch-style symmetric padding ``(k - 1) // 2``.

    With ``weight_standardization`` the kernel is standardised per output channel (zero mean, unit
    variance over its receptive field and input channels) at every call.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        stride: int = 1,
        weight_standardization: bool = False,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ):
        init = nnx.initializers.variance_scaling(2.0, "fan_out", "normal")
        shape = (kernel_size, kernel_size, in_channels, out_channels)
        self.kernel = nnx.Param(init(rngs.params(), shape, param_dtype))
        self.stride = stride
        self.padding = (kernel_size - 1) // 2
        self.weight_standardization = weight_standardization
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        if self.weight_standardization:
            kernel = kernel.astype(jnp.float32)
            mean = kernel.mean(axis=(0, 1, 2), keepdims=True)
            var = kernel.var(axis=(0, 1, 2), keepdims=True)
            kernel = (kernel - mean) * jax.lax.rsqrt(var + _WS_EPS)
        pad = (self.padding, self.padding)
        return jax.lax.conv_general_dilated(
            x.astype(self.dtype),
            kernel.astype(self.dtype),
            window_strides=(self.stride, self.stride),
            padding=(pad, pad),
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )


def group_statistics(x: jax.Array, num_groups: int, epsilon: float) -> tuple[jax.Array, jax.Array]:
    """Per-example GroupNorm statistics of channels-last `x`, broadcast to its channels.

    Returns `(mean, inv_std)`, float32 of shape `(batch, 1, ..., 1, channels)` (broadcastable
    against `x`): the mean of the channel's group over all non-batch positions and
    `1 / sqrt(var + epsilon)` (variance as E[x²] - E[x]²).
    Channel sums over positions come first and are then summed per group, which keeps the long
    reductions over a contiguous channel axis.
    """
    batch, channels = x.shape[0], x.shape[-1]
    rows = x.astype(jnp.float32).reshape(batch, -1, channels)
    group_size = channels // num_groups

    def group_mean(values):
        sums = values.sum(axis=1).reshape(batch, num_groups, group_size).sum(axis=-1)
        return jnp.repeat(sums / (rows.shape[1] * group_size), group_size, axis=1)

    mean = group_mean(rows)
    var = jnp.maximum(group_mean(jnp.square(rows)) - jnp.square(mean), 0.0)
    shape = (batch,) + (1,) * (x.ndim - 2) + (channels,)
    return mean.reshape(shape), jax.lax.rsqrt(var + epsilon).reshape(shape)


class GroupNorm(nnx.GroupNorm):
    """`nnx.GroupNorm` over all non-batch axes, computed as one per-channel affine map.

    Same parameters and outputs as Flax's layer (up to rounding). With the statistics of
    `group_statistics`, the output is `x * a + d` for per-example, per-channel `a = scale *
    inv_std` and `d = bias - mean * a`; forward and backward are 3-4x faster on CPU than Flax's
    reductions over a grouped reshape. Masks, explicit reduction axes, the two-pass variance and
    cross-device statistics fall back to Flax's implementation.
    """

    def __call__(self, x: jax.Array, *, mask: jax.Array | None = None) -> jax.Array:
        if (
            mask is not None
            or self.reduction_axes is not None
            or not self.use_fast_variance
            or self.axis_name is not None
        ):
            return super().__call__(x, mask=mask)
        mean, inv_std = group_statistics(x, self.num_groups, self.epsilon)
        a = inv_std * self.scale[...].astype(jnp.float32) if self.scale is not None else inv_std
        d = -mean * a
        if self.bias is not None:
            d = d + self.bias[...].astype(jnp.float32)
        y = x.astype(jnp.float32) * a + d
        return y.astype(self.dtype or jnp.result_type(x.dtype, self.param_dtype))


def _conv(config: ResNetConfig, cin: int, cout: int, k: int, stride: int, rngs: nnx.Rngs) -> Conv:
    return Conv(
        cin,
        cout,
        k,
        stride=stride,
        weight_standardization=config.weight_standardization,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


def _norm(config: ResNetConfig, channels: int, rngs: nnx.Rngs) -> GroupNorm:
    return GroupNorm(
        channels,
        num_groups=config.groups,
        epsilon=_NORM_EPS,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


def _shortcut(config, cin, cout, stride, rngs) -> nnx.Sequential | None:
    if stride == 1 and cin == cout:
        return None
    return nnx.Sequential(_conv(config, cin, cout, 1, stride, rngs), _norm(config, cout, rngs))


class BasicBlock(nnx.Module):
    """Two 3x3 conv + GroupNorm layers with a residual connection."""

    def __init__(self, config: ResNetConfig, cin: int, width: int, stride: int, rngs: nnx.Rngs):
        self.conv1 = _conv(config, cin, width, 3, stride, rngs)
        self.norm1 = _norm(config, width, rngs)
        self.conv2 = _conv(config, width, width, 3, 1, rngs)
        self.norm2 = _norm(config, width, rngs)
        self.shortcut = _shortcut(config, cin, width, stride, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        residual = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(y + residual)


class Bottleneck(nnx.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand (4x), each with GroupNorm, plus a residual."""

    def __init__(self, config: ResNetConfig, cin: int, width: int, stride: int, rngs: nnx.Rngs):
        cout = width * config.expansion
        self.conv1 = _conv(config, cin, width, 1, 1, rngs)
        self.norm1 = _norm(config, width, rngs)
        self.conv2 = _conv(config, width, width, 3, stride, rngs)
        self.norm2 = _norm(config, width, rngs)
        self.conv3 = _conv(config, width, cout, 1, 1, rngs)
        self.norm3 = _norm(config, cout, rngs)
        self.shortcut = _shortcut(config, cin, cout, stride, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.norm1(self.conv1(x)))
        y = jax.nn.relu(self.norm2(self.conv2(y)))
        y = self.norm3(self.conv3(y))
        residual = x if self.shortcut is None else self.shortcut(x)
        return jax.nn.relu(y + residual)


def _max_pool_3x3_s2(x: jax.Array) -> jax.Array:
    # A Python -inf lets lax recognise the max monoid, which has a gradient; an array init value
    # makes it a generic reduction that reverse-mode autodiff cannot go through.
    return jax.lax.reduce_window(
        x,
        -jnp.inf,
        jax.lax.max,
        window_dimensions=(1, 3, 3, 1),
        window_strides=(1, 2, 2, 1),
        padding=((0, 0), (1, 1), (1, 1), (0, 0)),
    )


class ResNet(nnx.Module):
    """GroupNorm ResNet mapping NHWC images to ``(batch, num_outputs)`` float32 logits.

    ``num_outputs`` is the concatenation of all heads: for a multi-head proxy over k sources it
    is the sum of the sources' label counts; for a downstream task it is that task's outputs.
    Inputs may have any spatial size (features are globally average-pooled).

    Args:
      config: the architecture.
      num_outputs: width of the linear head.
      rngs: random streams for initialisation.
    """

    def __init__(self, config: ResNetConfig, num_outputs: int, *, rngs: nnx.Rngs):
        if not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"num_outputs must be a positive int, got {num_outputs!r}")
        self.config = config
        imagenet_stem = config.stem == "imagenet"
        self.stem_conv = _conv(
            config, config.in_channels, config.width, 7 if imagenet_stem else 3,
            2 if imagenet_stem else 1, rngs,
        )  # fmt: skip
        self.stem_norm = _norm(config, config.width, rngs)
        block_cls = BasicBlock if config.block == "basic" else Bottleneck
        blocks, cin = [], config.width
        for stage, size in enumerate(config.stage_sizes):
            width = config.width * 2**stage
            for i in range(size):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(block_cls(config, cin, width, stride, rngs))
                cin = width * config.expansion
        self.blocks = nnx.List(blocks)
        self.head = nnx.Linear(
            config.feature_dim,
            num_outputs,
            dtype=config.dtype,
            param_dtype=config.param_dtype,
            rngs=rngs,
        )

    def features(self, images: jax.Array) -> jax.Array:
        """Globally pooled features ``(batch, config.feature_dim)`` of NHWC ``images``."""
        if images.ndim != 4 or images.shape[-1] != self.config.in_channels:
            raise ValueError(
                f"expected NHWC images with {self.config.in_channels} channels, "
                f"got shape {images.shape}"
            )
        x = jax.nn.relu(self.stem_norm(self.stem_conv(images)))
        if self.config.stem == "imagenet":
            x = _max_pool_3x3_s2(x)
        for block in self.blocks:
            x = block(x)
        return x.mean(axis=(1, 2))

    def __call__(self, images: jax.Array) -> jax.Array:
        """Logits ``(batch, num_outputs)`` in float32."""
        return self.head(self.features(images)).astype(jnp.float32)


def ResNet18(num_outputs: int, *, rngs: nnx.Rngs, **options) -> ResNet:  # noqa: N802
    """ResNet-18; ``options`` override :class:`ResNetConfig` fields (width, stem, groups, ...)."""
    return ResNet(ResNetConfig.resnet18(**options), num_outputs, rngs=rngs)


def ResNet50(num_outputs: int, *, rngs: nnx.Rngs, **options) -> ResNet:  # noqa: N802
    """ResNet-50; ``options`` override :class:`ResNetConfig` fields (width, stem, groups, ...)."""
    return ResNet(ResNetConfig.resnet50(**options), num_outputs, rngs=rngs)
