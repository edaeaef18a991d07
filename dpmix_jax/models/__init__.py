"""Model zoo: GroupNorm ResNets for images and GPT-2 for text (Flax NNX)."""

from dpmix_jax.models.gpt2 import GPT2, GPT2Config, KVCache, generate, trainable_mask
from dpmix_jax.models.resnet import GroupNorm, ResNet, ResNet18, ResNet50, ResNetConfig

__all__ = [
    "GPT2",
    "GPT2Config",
    "GroupNorm",
    "KVCache",
    "ResNet",
    "ResNet18",
    "ResNet50",
    "ResNetConfig",
    "generate",
    "trainable_mask",
]
