"""A small multilayer perceptron over NHWC images, for CPU presets of the image experiments."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Sizes of an `MLP`.

    Attributes:
        in_features: H·W·C of the flattened input image.
        hidden: widths of the hidden layers (GELU activations, no normalisation).
    """

    in_features: int
    hidden: tuple[int, ...] = (128, 64)

    def __post_init__(self) -> None:
        if not isinstance(self.in_features, int) or self.in_features < 1:
            raise ValueError(f"in_features must be an integer >= 1, got {self.in_features!r}.")
        if not self.hidden or any(not isinstance(h, int) or h < 1 for h in self.hidden):
            raise ValueError(f"hidden must be non-empty positive integers, got {self.hidden!r}.")


class MLP(nnx.Module):
    """`model(images)`: NHWC images (B, H, W, C) flattened to logits (B, num_outputs)."""

    def __init__(self, config: MLPConfig, num_outputs: int, *, rngs: nnx.Rngs):
        if not isinstance(num_outputs, int) or num_outputs < 1:
            raise ValueError(f"num_outputs must be an integer >= 1, got {num_outputs!r}.")
        self.config = config
        sizes = (config.in_features, *config.hidden)
        self.layers = nnx.List(
            [nnx.Linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:], strict=True)]
        )
        self.head = nnx.Linear(sizes[-1], num_outputs, rngs=rngs)

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.reshape(images.shape[0], -1).astype(jnp.float32)
        if x.shape[1] != self.config.in_features:
            raise ValueError(
                f"expected images with {self.config.in_features} values, got {images.shape}."
            )
        for layer in self.layers:
            x = jax.nn.gelu(layer(x))
        return self.head(x)
