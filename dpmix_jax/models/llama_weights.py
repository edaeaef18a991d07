"""Pretrained weights for `models.llama.Llama`: transformers folders and llama.cpp GGUF files.

`load_llama(path)` reads either

- a transformers ``save_pretrained`` folder: ``config.json`` (model_type llama, mistral or
  qwen2) and ``model.safetensors`` or a sharded ``model.safetensors.index.json``; the LM head is
  tied or a separate ``lm_head.weight`` as the config says; or
- a GGUF file (architecture ``llama`` or ``qwen2``): the config from the file's metadata, every
  tensor dequantized to float32 with ``gguf.quants.dequantize`` (F32, F16, Q4_0, Q4_1, Q8_0,
  K-quants, ...). llama.cpp's converter permutes the rows of the ``llama`` query and key weights
  so that each head's rotary pairs are adjacent (its interleaved RoPE); the permutation is undone
  here to get transformers' ``rotate_half`` layout. Llama 3.1's frequency scaling, stored by
  llama.cpp as a ``rope_freqs`` tensor, is recognised and mapped back to the ``llama3`` scheme.

The tokenizers of both formats live in `data.pretrained_tokenizers`.

Example:
    >>> model = load_llama("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.models.llama import Llama, LlamaConfig, RopeScaling, rope_inverse_frequencies

GGUF_ARCHITECTURES = ("llama", "qwen2")
_HF_LAYER_TENSOR = re.compile(
    r"model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj|input_layernorm"
    r"|post_attention_layernorm)\.(weight|bias)"
)
_GGUF_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GGUF_LAYER_MODULES = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
    "attn_norm": ("input_layernorm",),
    "ffn_norm": ("post_attention_layernorm",),
}
_GGUF_TOP_MODULES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}
# Llama 3.1's scaling constants, which every released Llama 3.x checkpoint uses.
_LLAMA3_FREQ_FACTORS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
_LLAMA3_CONTEXT = 8192


def load_llama(path: str | os.PathLike, *, dtype: Any = None) -> Llama:
    """Loads a Llama-family model from a transformers folder or a GGUF file.

    Args:
      path: a ``save_pretrained`` folder or a ``.gguf`` file.
      dtype: optional compute dtype overriding the config's (parameters stay float32).

    Returns:
      The model with the checkpoint's weights.

    Raises:
      ValueError: naming the file, if it is missing, unreadable, of an unsupported model type or
        architecture, or its tensors do not fit the config.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        config, tensors = read_transformers_folder(path)
    elif os.path.isfile(path):
        config, tensors = read_gguf(path)
    else:
        raise ValueError(f"{path} is neither a transformers folder nor a GGUF file")
    if dtype is not None:
        config = dataclasses.replace(config, dtype=dtype)
    return _build(config, tensors, path)


def _path_keys(key_path) -> tuple:
    return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def _build(config: LlamaConfig, tensors: Mapping[tuple, np.ndarray], source: str) -> Llama:
    """A :class:`Llama` whose parameters are ``tensors`` (keyed by parameter path)."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    expected = {_path_keys(p) for p, _ in leaves}
    if missing := sorted(map(str, expected - tensors.keys())):
        raise ValueError(f"{source} lacks parameters {missing[:5]} (of {len(missing)})")
    if extra := sorted(map(str, tensors.keys() - expected)):
        raise ValueError(f"{source} has tensors the config lacks: {extra[:5]}")

    def load(key_path, leaf):
        key = _path_keys(key_path)
        array = tensors[key]
        if array.shape != leaf.shape:
            raise ValueError(f"{source}: {key} has shape {array.shape}, the model {leaf.shape}")
        return jnp.asarray(array, dtype=leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(load, abstract_state))


def _parameter(module_path: tuple, leaf: str, array: np.ndarray) -> tuple[tuple, np.ndarray]:
    """Our parameter path and array for a ``(out, in)`` weight or a bias of ``module_path``."""
    array = np.asarray(array, np.float32)
    if leaf == "bias":
        return (*module_path, "bias"), array
    name = module_path[-1]
    if name == "embed_tokens":
        return (*module_path, "embedding"), array
    if name.endswith("norm"):
        return (*module_path, "scale"), array
    return (*module_path, "kernel"), array.T


# ------------------------------------------------------------------------------------------
# transformers folders
# ------------------------------------------------------------------------------------------


def read_transformers_folder(folder: str | os.PathLike) -> tuple[LlamaConfig, dict]:
    """The config and the parameters (keyed by parameter path) of a ``save_pretrained`` folder.

    Raises:
      ValueError: naming the file, if ``config.json`` or the safetensors weights are missing or
        the model type is unsupported.
    """
    folder = os.fspath(folder)
    config_file = os.path.join(folder, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"{folder} has no config.json")
    try:
        with open(config_file) as f:
            config = LlamaConfig.from_hf(json.load(f))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{config_file}: {err}") from err
    tensors = {}
    for file in _safetensors_files(folder):
        tensors.update(_hf_parameters(file, config.tie_word_embeddings))
    return config, tensors


def _safetensors_files(folder: str) -> list[str]:
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(single):
        return [single]
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(folder, shard) for shard in shards]
    raise ValueError(f"{folder} holds neither model.safetensors nor model.safetensors.index.json")


def _hf_parameters(file: str, tied: bool) -> dict[tuple, np.ndarray]:
    # safe_open reads bfloat16 (as ml_dtypes.bfloat16), which safetensors.numpy.load_file cannot.
    from safetensors import safe_open

    parameters = {}
    with safe_open(file, framework="numpy") as weights:
        for name in weights.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue  # a recomputed buffer, or a copy of the tied embedding
            if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
                module_path, leaf = (name.removeprefix("model.").split(".")[0],), "weight"
            elif match := _HF_LAYER_TENSOR.fullmatch(name):
                layer, module, leaf = match.groups()
                module_path = ("layers", int(layer), *module.split("."))
            else:
                raise ValueError(f"{file}: unexpected tensor {name!r}")
            key, array = _parameter(module_path, leaf, weights.get_tensor(name))
            parameters[key] = array
    return parameters


# ------------------------------------------------------------------------------------------
# GGUF files
# ------------------------------------------------------------------------------------------


def _open_gguf(path: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file: {err}") from err


class _Metadata:
    """Typed access to a GGUF file's key/value metadata, with errors naming the file."""

    def __init__(self, reader, path: str):
        self._fields, self._path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        if key not in self._fields:
            raise ValueError(f"{self._path} lacks the GGUF metadata key {key!r}")
        return self._fields[key].contents()


def read_gguf(path: str | os.PathLike) -> tuple[LlamaConfig, dict]:
    """The config and the dequantized parameters (keyed by parameter path) of a GGUF file.

    Raises:
      ValueError: naming the file, if it is not a readable GGUF file, its architecture is not
        llama or qwen2, or it uses a feature this implementation does not have.
    """
    path = os.fspath(path)
    from gguf.quants import dequantize

    reader = _open_gguf(path)
    metadata = _Metadata(reader, path)
    architecture = metadata.require("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {architecture!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    raw = {}
    for tensor in reader.tensors:
        try:
            raw[tensor.name] = np.asarray(
                dequantize(tensor.data, tensor.tensor_type), np.float32
            ).reshape(tuple(int(n) for n in reversed(tensor.shape)))
        except (ValueError, NotImplementedError) as err:
            raise ValueError(f"{path}: cannot read tensor {tensor.name!r}: {err}") from err
    config = _gguf_config(metadata, architecture, raw, path)
    parameters = {}
    for name, array in raw.items():
        if name == "rope_freqs.weight":
            continue  # folded into config.rope_scaling
        module, _, leaf = name.rpartition(".")
        if module in _GGUF_TOP_MODULES and leaf == "weight":
            module_path = (_GGUF_TOP_MODULES[module],)
        elif (match := _GGUF_LAYER_TENSOR.fullmatch(name)) and match[2] in _GGUF_LAYER_MODULES:
            module_path = ("layers", int(match[1]), *_GGUF_LAYER_MODULES[match[2]])
            if architecture == "llama" and match[2] in ("attn_q", "attn_k"):
                heads = config.num_heads if match[2] == "attn_q" else config.num_kv_heads
                array = _unpermute_rotary_rows(array, heads)
        else:
            raise ValueError(f"{path}: unexpected tensor {name!r}")
        key, array = _parameter(module_path, leaf, array)
        parameters[key] = array
    return config, parameters


def _unpermute_rotary_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """Undoes llama.cpp's row permutation of a query/key weight (or bias).

    The converter writes, per head, the rows of rotary pair i as rows 2i and 2i + 1 (its
    interleaved RoPE); transformers' ``rotate_half`` pairs row i with row i + head_dim / 2.
    """
    half = array.shape[0] // heads // 2
    rows = array.reshape(heads, half, 2, *array.shape[1:])
    return rows.swapaxes(1, 2).reshape(array.shape)


def _gguf_config(
    metadata: _Metadata, architecture: str, raw: Mapping[str, np.ndarray], path: str
) -> LlamaConfig:
    def key(name):
        return f"{architecture}.{name}"

    if "token_embd.weight" not in raw:
        raise ValueError(f"{path} has no token_embd.weight tensor")
    vocab_size, hidden_size = raw["token_embd.weight"].shape
    num_heads = metadata.require(key("attention.head_count"))
    head_dim = metadata.get(key("attention.key_length"), hidden_size // num_heads)
    rotary_dims = metadata.get(key("rope.dimension_count"), head_dim)
    if rotary_dims != head_dim:
        raise ValueError(
            f"{path}: partial rotary embeddings ({rotary_dims} of {head_dim} dims) are not "
            "supported"
        )
    theta = float(metadata.get(key("rope.freq_base"), 10000.0))
    fields = {
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden_size),
        "intermediate_size": metadata.require(key("feed_forward_length")),
        "num_layers": metadata.require(key("block_count")),
        "num_heads": num_heads,
        "num_kv_heads": metadata.get(key("attention.head_count_kv"), num_heads),
        "head_dim": head_dim,
        "rms_norm_eps": float(metadata.require(key("attention.layer_norm_rms_epsilon"))),
        "rope_theta": theta,
        "rope_scaling": _gguf_rope_scaling(metadata, key, raw, head_dim, theta, path),
        "attention_bias": "blk.0.attn_q.bias" in raw,
        "tie_word_embeddings": "output.weight" not in raw,
        "max_position_embeddings": metadata.get(key("context_length"), 2048),
    }
    try:
        return LlamaConfig(**fields)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err


def _gguf_rope_scaling(
    metadata: _Metadata, key, raw: Mapping[str, np.ndarray], head_dim: int, theta: float, path
) -> RopeScaling | None:
    kind = metadata.get(key("rope.scaling.type"), "none")
    if kind == "linear":
        return RopeScaling(
            kind="linear", factor=float(metadata.require(key("rope.scaling.factor")))
        )
    if kind != "none":
        raise ValueError(f"{path}: rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" not in raw:
        return None
    # llama.cpp divides each frequency by the stored factor; recover Llama 3.1's parameters.
    stored = raw["rope_freqs.weight"]
    scaling = RopeScaling(
        kind="llama3",
        factor=float(stored.max()),
        original_max_position_embeddings=metadata.get(
            key("rope.scaling.original_context_length"), _LLAMA3_CONTEXT
        ),
        **_LLAMA3_FREQ_FACTORS,
    )
    implied = rope_inverse_frequencies(head_dim, theta, None) / rope_inverse_frequencies(
        head_dim, theta, scaling
    )
    if stored.shape != implied.shape or not np.allclose(stored, implied, rtol=1e-4):
        raise ValueError(
            f"{path}: its rope_freqs tensor matches no llama3 rope scaling with low/high "
            "frequency factors 1 and 4"
        )
    return scaling
