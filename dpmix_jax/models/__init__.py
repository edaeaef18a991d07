"""Model zoo: GroupNorm ResNets for images, GPT-2 and Llama-family decoders for text, with LoRA
adapters (Flax NNX)."""

from dpmix_jax.models.gpt2 import GPT2, GPT2Config, KVCache, generate, trainable_mask
from dpmix_jax.models.llama import Llama, LlamaConfig, RopeScaling
from dpmix_jax.models.llama import trainable_mask as llama_trainable_mask
from dpmix_jax.models.llama_weights import load_llama
from dpmix_jax.models.lora import LoraConfig, LoraLinear, add_lora, lora_from_pretrained, merge_lora
from dpmix_jax.models.resnet import GroupNorm, ResNet, ResNet18, ResNet50, ResNetConfig

__all__ = [
    "GPT2",
    "GPT2Config",
    "GroupNorm",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "LoraConfig",
    "LoraLinear",
    "ResNet",
    "ResNet18",
    "ResNet50",
    "ResNetConfig",
    "RopeScaling",
    "add_lora",
    "generate",
    "llama_trainable_mask",
    "load_llama",
    "lora_from_pretrained",
    "merge_lora",
    "trainable_mask",
]
