"""Model zoo: GroupNorm ResNets for images and GPT-2 for text, with LoRA adapters (Flax NNX)."""

from dpmix_jax.models.gpt2 import GPT2, GPT2Config, KVCache, generate, trainable_mask
from dpmix_jax.models.lora import LoraConfig, LoraLinear, add_lora, lora_from_pretrained, merge_lora
from dpmix_jax.models.resnet import GroupNorm, ResNet, ResNet18, ResNet50, ResNetConfig

__all__ = [
    "GPT2",
    "GPT2Config",
    "GroupNorm",
    "KVCache",
    "LoraConfig",
    "LoraLinear",
    "ResNet",
    "ResNet18",
    "ResNet50",
    "ResNetConfig",
    "add_lora",
    "generate",
    "lora_from_pretrained",
    "merge_lora",
    "trainable_mask",
]
