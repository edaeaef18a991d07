"""GPT-2 in Flax NNX: model, Hugging Face weight loading, fine-tuning mask and KV-cache decoding.

The architecture follows OpenAI's GPT-2 exactly (pre-LayerNorm blocks, learned positions, causal
attention, tanh-approximated GELU, LayerNorm epsilon 1e-5, LM head tied to the token embedding),
so that a ``transformers`` checkpoint loads without conversion loss. Module names mirror the
Hugging Face ones (``wte``, ``wpe``, ``h.N.attn.c_attn``, ...); HF's ``Conv1D`` stores weights as
``(in, out)``, the layout of ``nnx.Linear`` kernels, so weights are copied as they are. There is
no dropout: DP fine-tuning and evaluation use none.

Example Usage:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> model = GPT2(GPT2Config.tiny(), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 512)
  >>> generate(model, jnp.zeros((2, 5), jnp.int32), max_new_tokens=3).shape
  (2, 3)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.models.dtypes import float_dtype

# GPT-2 checkpoints of every size use 64-dimensional attention heads.
_GPT2_HEAD_DIM = 64
_TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config:
    """Shape and numerics of a GPT-2 model.

    Attributes:
      vocab_size: number of tokens (50257 for the GPT-2 BPE).
      n_positions: maximum sequence length (learned position table size).
      n_embd: model width.
      n_layer: number of transformer blocks.
      n_head: attention heads; must divide ``n_embd``.
      n_inner: MLP hidden width; ``None`` means ``4 * n_embd``.
      layer_norm_eps: LayerNorm epsilon.
      dtype: compute dtype (e.g. "bfloat16"); attention softmax and logits stay float32.
      param_dtype: dtype of the stored parameters.
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    layer_norm_eps: float = 1e-5
    dtype: Any = "float32"
    param_dtype: Any = "float32"

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.n_inner is not None and (not isinstance(self.n_inner, int) or self.n_inner < 1):
            raise ValueError(f"n_inner must be None or a positive int, got {self.n_inner!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_head ({self.n_head}) must divide n_embd ({self.n_embd})")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps must be > 0, got {self.layer_norm_eps}")
        object.__setattr__(self, "dtype", float_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", float_dtype(self.param_dtype, "param_dtype"))

    @property
    def mlp_dim(self) -> int:
        """Hidden width of the MLP."""
        return 4 * self.n_embd if self.n_inner is None else self.n_inner

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls, **overrides) -> GPT2Config:
        """A 2-layer, 64-wide model with a 512-token vocabulary, for CPU tests."""
        defaults = {"vocab_size": 512, "n_positions": 128, "n_embd": 64, "n_layer": 2, "n_head": 4}
        return cls(**{**defaults, **overrides})

    @classmethod
    def small(cls, **overrides) -> GPT2Config:
        """GPT-2 small (124M parameters)."""
        return cls(**{"n_embd": 768, "n_layer": 12, "n_head": 12, **overrides})

    @classmethod
    def medium(cls, **overrides) -> GPT2Config:
        """GPT-2 medium (355M parameters)."""
        return cls(**{"n_embd": 1024, "n_layer": 24, "n_head": 16, **overrides})

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], **overrides) -> GPT2Config:
        """Builds a config from the contents of a transformers GPT-2 ``config.json``.

        Raises:
          ValueError: if the checkpoint uses features this implementation does not have
            (another activation, unscaled or layer-scaled attention).
        """
        activation = hf_config.get("activation_function", "gelu_new")
        if activation not in _TANH_GELU_NAMES:
            raise ValueError(f"unsupported activation_function {activation!r}; need tanh GELU")
        if not hf_config.get("scale_attn_weights", True):
            raise ValueError("scale_attn_weights=False is not supported")
        if hf_config.get("scale_attn_by_inverse_layer_idx", False):
            raise ValueError("scale_attn_by_inverse_layer_idx=True is not supported")
        fields = {
            "vocab_size": hf_config["vocab_size"],
            "n_positions": hf_config["n_positions"],
            "n_embd": hf_config["n_embd"],
            "n_layer": hf_config["n_layer"],
            "n_head": hf_config["n_head"],
            "n_inner": hf_config.get("n_inner"),
            "layer_norm_eps": hf_config.get("layer_norm_epsilon", 1e-5),
        }
        return cls(**{**fields, **overrides})


class KVCache(NamedTuple):
    """Preallocated key/value cache for incremental decoding (a pytree; shapes never change).

    Attributes:
      keys: per layer, ``(batch, capacity, n_head, head_dim)`` keys of the tokens seen so far.
      values: per layer, values with the same shape.
      valid: ``(batch, capacity)`` bool, True for slots holding a real (non-padding) token.
      index: int32 scalar, the next slot to write (slots are filled in order).
      position: ``(batch,)`` int32, the position id of each row's next real token.
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    valid: jax.Array
    index: jax.Array
    position: jax.Array


def _normal(stddev: float):
    return nnx.initializers.normal(stddev)


class CausalSelfAttention(nnx.Module):
    """Multi-head self-attention with a fused query/key/value projection (HF ``c_attn``)."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        d = config.n_embd
        dtypes = {"dtype": config.dtype, "param_dtype": config.param_dtype}
        self.c_attn = nnx.Linear(d, 3 * d, kernel_init=_normal(0.02), rngs=rngs, **dtypes)
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.c_proj = nnx.Linear(d, d, kernel_init=_normal(proj_std), rngs=rngs, **dtypes)
        self.n_head = config.n_head

    def __call__(
        self, x: jax.Array, mask: jax.Array, cache: tuple[jax.Array, jax.Array, jax.Array] | None
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attends ``x`` (batch, T, d) to itself, or to the cache with ``x``'s keys written in.

        Args:
          x: inputs ``(batch, T, n_embd)``.
          mask: ``(batch, T, S)`` bool, True where query t may attend to key s; S = T without a
            cache, the cache capacity with one.
          cache: optional ``(keys, values, index)``: this layer's cache arrays and the slot where
            the T new keys/values go.

        Returns:
          The attention output and the updated ``(keys, values)`` (None without a cache).
        """
        batch, length, width = x.shape
        head_shape = (batch, length, self.n_head, width // self.n_head)
        q, k, v = (t.reshape(head_shape) for t in jnp.split(self.c_attn(x), 3, axis=-1))
        new_cache = None
        if cache is not None:
            k_cache, v_cache, index = cache
            k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, index, 0, 0))
            v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, index, 0, 0))
            new_cache = (k, v)
        scores = jnp.einsum("bthd,bshd->bhts", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(head_shape[-1])
        # A finite fill keeps fully masked rows (left padding) NaN-free.
        scores = jnp.where(mask[:, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhts,bshd->bthd", weights, v).reshape(batch, length, width)
        return self.c_proj(out), new_cache


class MLP(nnx.Module):
    """Two-layer feed-forward network with tanh-approximated GELU (HF ``gelu_new``)."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        d, h = config.n_embd, config.mlp_dim
        dtypes = {"dtype": config.dtype, "param_dtype": config.param_dtype}
        self.c_fc = nnx.Linear(d, h, kernel_init=_normal(0.02), rngs=rngs, **dtypes)
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        self.c_proj = nnx.Linear(h, d, kernel_init=_normal(proj_std), rngs=rngs, **dtypes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jax.nn.gelu(self.c_fc(x), approximate=True))


def _layer_norm(config: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        config.n_embd,
        epsilon=config.layer_norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        self.ln_1 = _layer_norm(config, rngs)
        self.attn = CausalSelfAttention(config, rngs=rngs)
        self.ln_2 = _layer_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, mask, cache=None):
        attended, new_cache = self.attn(self.ln_1(x), mask, cache)
        x = x + attended
        return x + self.mlp(self.ln_2(x)), new_cache


def _positions_from_mask(token_mask: jax.Array) -> jax.Array:
    """Position id of every token = number of real tokens before it in its row."""
    token_mask = token_mask.astype(jnp.int32)
    return jnp.cumsum(token_mask, axis=1) - token_mask


class GPT2(nnx.Module):
    """GPT-2 language model with the LM head tied to the token embedding ``wte``.

    Args:
      config: the architecture.
      rngs: random streams for initialisation.
    """

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        self.config = config
        dtypes = {"dtype": config.dtype, "param_dtype": config.param_dtype}
        self.wte = nnx.Embed(
            config.vocab_size, config.n_embd, embedding_init=_normal(0.02), rngs=rngs, **dtypes
        )
        self.wpe = nnx.Embed(
            config.n_positions, config.n_embd, embedding_init=_normal(0.01), rngs=rngs, **dtypes
        )
        self.h = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.ln_f = _layer_norm(config, rngs)

    def _check_ids(self, input_ids: jax.Array, attention_mask: jax.Array | None) -> None:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {input_ids.shape}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}"
            )

    def _embed(self, input_ids: jax.Array, positions: jax.Array) -> jax.Array:
        return self.wte(input_ids) + self.wpe(positions)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        return self.wte.attend(self.ln_f(hidden)).astype(jnp.float32)

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits for every position.

        Args:
          input_ids: ``(batch, seq)`` int token ids, ``seq <= n_positions``.
          attention_mask: optional ``(batch, seq)``, 1 for real tokens and 0 for padding (which
            no token attends to). Left padding is supported: positions then count real tokens.
          positions: optional ``(batch, seq)`` position ids; by default the number of real tokens
            before each token (``0..seq-1`` without a mask).

        Returns:
          Float32 logits ``(batch, seq, vocab_size)``.
        """
        self._check_ids(input_ids, attention_mask)
        length = input_ids.shape[1]
        if length > self.config.n_positions:
            raise ValueError(f"sequence length {length} exceeds n_positions")
        token_mask = (
            jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask != 0
        )
        if positions is None:
            positions = _positions_from_mask(token_mask)
        causal = jnp.tril(jnp.ones((length, length), bool))
        mask = causal[None] & token_mask[:, None, :]
        hidden = self._embed(input_ids, positions)
        for block in self.h:
            hidden, _ = block(hidden, mask)
        return self._logits(hidden)

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache for ``batch_size`` rows and up to ``capacity`` tokens in total."""
        if batch_size < 1 or not 1 <= capacity <= self.config.n_positions:
            raise ValueError(
                f"need batch_size >= 1 and 1 <= capacity <= n_positions "
                f"({self.config.n_positions}), got {batch_size=}, {capacity=}"
            )
        cfg = self.config
        shape = (batch_size, capacity, cfg.n_head, cfg.head_dim)
        empty = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.n_layer))
        return KVCache(
            keys=empty,
            values=empty,
            valid=jnp.zeros((batch_size, capacity), bool),
            index=jnp.zeros((), jnp.int32),
            position=jnp.zeros((batch_size,), jnp.int32),
        )

    def extend(
        self, input_ids: jax.Array, cache: KVCache, *, attention_mask: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Runs ``input_ids`` after the tokens already in ``cache`` (prefill or decoding step).

        The logits equal those of the full forward pass over the concatenated sequence. The
        caller keeps the total number of tokens within the cache capacity (writes past it are
        clamped by ``dynamic_update_slice``); :func:`generate` sizes the cache accordingly.

        Args:
          input_ids: ``(batch, T)`` new tokens.
          cache: the cache from :meth:`init_cache` or a previous call.
          attention_mask: optional ``(batch, T)``, 0 for padding tokens (e.g. left padding of a
            prompt), which take no position and are never attended to.

        Returns:
          Float32 logits ``(batch, T, vocab_size)`` and the updated cache.
        """
        self._check_ids(input_ids, attention_mask)
        token_mask = (
            jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask != 0
        )
        length = input_ids.shape[1]
        positions = cache.position[:, None] + _positions_from_mask(token_mask)
        valid = jax.lax.dynamic_update_slice(cache.valid, token_mask, (0, cache.index))
        slots = jnp.arange(valid.shape[1])
        query_slots = cache.index + jnp.arange(length)
        mask = valid[:, None, :] & (slots[None, None, :] <= query_slots[None, :, None])
        hidden = self._embed(input_ids, positions)
        keys, values = [], []
        for block, k, v in zip(self.h, cache.keys, cache.values, strict=True):
            hidden, (k, v) = block(hidden, mask, (k, v, cache.index))
            keys.append(k)
            values.append(v)
        new_cache = KVCache(
            keys=tuple(keys),
            values=tuple(values),
            valid=valid,
            index=cache.index + length,
            position=cache.position + token_mask.sum(axis=1, dtype=jnp.int32),
        )
        return self._logits(hidden), new_cache

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        config: GPT2Config | None = None,
        dtype: Any = None,
    ) -> GPT2:
        """Loads a transformers GPT-2 checkpoint (``GPT2LMHeadModel`` or ``GPT2Model``).

        Args:
          path: a ``save_pretrained`` folder (``config.json`` plus ``model.safetensors``, a
            sharded ``model.safetensors.index.json`` or ``pytorch_model.bin``), a single
            ``.safetensors`` / ``.bin`` file, or a hub name (downloaded with
            ``huggingface_hub.snapshot_download``, which fails at once when offline).
          config: the architecture; by default read from ``config.json``, or for a lone weights
            file inferred from tensor shapes with GPT-2's 64-wide heads.
          dtype: optional compute dtype overriding the config's.

        Returns:
          The model with the checkpoint's weights.

        Raises:
          ValueError: if nothing can be found at ``path``, or the weights do not fit the config.
        """
        path = os.fspath(path)
        if not os.path.exists(path):
            path = _download(path)
        if os.path.isdir(path):
            tensors = _read_folder(path)
            config_file = os.path.join(path, "config.json")
            if config is None and os.path.isfile(config_file):
                with open(config_file) as f:
                    config = GPT2Config.from_hf(json.load(f))
        else:
            tensors = _read_weights_file(path)
        flat = _hf_to_flat(tensors)
        if config is None:
            config = _infer_config(flat)
        if dtype is not None:
            config = dataclasses.replace(config, dtype=dtype)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0)))
        graphdef, abstract_state = nnx.split(abstract)
        expected = {
            _path_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract_state)[0]
        }
        if missing := sorted(map(str, expected - flat.keys())):
            raise ValueError(f"checkpoint lacks parameters {missing[:5]} (of {len(missing)})")
        if extra := sorted(map(str, flat.keys() - expected)):
            raise ValueError(f"checkpoint has parameters the config lacks: {extra[:5]}")

        def load(key_path, leaf):
            array = flat[_path_keys(key_path)]
            if array.shape != leaf.shape:
                raise ValueError(
                    f"{_path_keys(key_path)}: checkpoint shape {array.shape} != model {leaf.shape}"
                )
            return jnp.asarray(array, dtype=leaf.dtype)

        state = jax.tree_util.tree_map_with_path(load, abstract_state)
        return nnx.merge(graphdef, state)


def _path_keys(key_path) -> tuple:
    """Plain keys of a pytree path into an nnx.State, without the Variable's ``.value``."""
    return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def _download(name: str) -> str:
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            repo_id=name, allow_patterns=["*.json", "*.safetensors", "pytorch_model.bin"]
        )
    except Exception as err:
        raise ValueError(
            f"{name!r} is not a local path and could not be fetched from the Hugging Face hub "
            f"(offline, or no such repository): {err}"
        ) from err


def _read_folder(folder: str) -> dict[str, np.ndarray]:
    single = os.path.join(folder, "model.safetensors")
    index = os.path.join(folder, "model.safetensors.index.json")
    torch_file = os.path.join(folder, "pytorch_model.bin")
    if os.path.isfile(single):
        return _read_weights_file(single)
    if os.path.isfile(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(_read_weights_file(os.path.join(folder, shard)))
        return tensors
    if os.path.isfile(torch_file):
        return _read_weights_file(torch_file)
    raise ValueError(
        f"{folder} holds none of model.safetensors, model.safetensors.index.json, pytorch_model.bin"
    )


def _read_weights_file(path: str) -> dict[str, np.ndarray]:
    if path.endswith(".safetensors"):
        from safetensors.numpy import load_file

        return load_file(path)
    if path.endswith((".bin", ".pt", ".pth")):
        import torch

        state_dict = torch.load(path, map_location="cpu", weights_only=True)
        return {k: v.float().numpy() for k, v in state_dict.items()}
    raise ValueError(f"unknown weights file type {path!r}: need .safetensors or .bin")


_BLOCK_KEY = re.compile(r"h\.(\d+)\.(ln_1|ln_2|attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.")
_LEAF_NAMES = {"ln": {"weight": "scale", "bias": "bias"}, "linear": {"weight": "kernel"}}


def _hf_to_flat(tensors: Mapping[str, np.ndarray]) -> dict[tuple, np.ndarray]:
    """Maps HF GPT-2 tensor names to our parameter paths (``('h', 0, 'attn', 'c_attn', ...)``)."""
    flat = {}
    for name, array in tensors.items():
        key = name.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the tied head and the causal-mask buffers carry no extra parameters
        array = np.asarray(array, np.float32)
        if key in ("wte.weight", "wpe.weight"):
            flat[(key[:3], "embedding")] = array
        elif key in ("ln_f.weight", "ln_f.bias"):
            flat[("ln_f", _LEAF_NAMES["ln"][key[5:]])] = array
        elif match := _BLOCK_KEY.match(key):
            layer, module = int(match.group(1)), match.group(2)
            leaf = key[match.end() :]
            kind = "ln" if module.startswith("ln") else "linear"
            if leaf not in ("weight", "bias"):
                raise ValueError(f"unexpected GPT-2 tensor {name!r}")
            flat[("h", layer, *module.split("."), _LEAF_NAMES[kind].get(leaf, leaf))] = array
        else:
            raise ValueError(f"unexpected GPT-2 tensor {name!r}")
    head = tensors.get("lm_head.weight")
    if head is not None and not np.array_equal(
        np.asarray(head, np.float32), flat.get(("wte", "embedding"))
    ):
        raise ValueError("lm_head.weight differs from wte.weight; only tied heads are supported")
    return flat


def _infer_config(flat: Mapping[tuple, np.ndarray]) -> GPT2Config:
    try:
        vocab_size, n_embd = flat[("wte", "embedding")].shape
        n_positions = flat[("wpe", "embedding")].shape[0]
        n_inner = flat[("h", 0, "mlp", "c_fc", "kernel")].shape[1]
    except KeyError as err:
        raise ValueError(f"cannot infer the GPT-2 config: checkpoint lacks {err}") from err
    if n_embd % _GPT2_HEAD_DIM:
        raise ValueError(
            f"cannot infer n_head for width {n_embd} (not a multiple of {_GPT2_HEAD_DIM}); "
            "pass config="
        )
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=1 + max(k[1] for k in flat if k[0] == "h"),
        n_head=n_embd // _GPT2_HEAD_DIM,
        n_inner=n_inner,
    )


def trainable_mask(model_or_params: GPT2 | nnx.State, *, last_n_blocks: int, head: bool = True):
    """Marks the parameters that fine-tuning updates: the last blocks and the LM head.

    GPT-2 ties its LM head to the token embedding, so "the head" is the final LayerNorm ``ln_f``
    plus ``wte``; training it also moves the input embeddings of the same tokens (untying would
    add a 38M-parameter matrix to GPT-2 small and depart from the checkpoint). The position
    table ``wpe`` and the earlier blocks stay frozen.

    Args:
      model_or_params: a :class:`GPT2` or its ``nnx.Param`` state (``nnx.split(model,
        nnx.Param, ...)[1]``).
      last_n_blocks: number of final transformer blocks to train, ``0..n_layer``.
      head: whether ``ln_f`` and the tied ``wte`` are trainable.

    Returns:
      A pytree with the structure of the parameter state and bool leaves (usable with
      ``optax.masked`` or to zero frozen gradients).
    """
    params = (
        nnx.state(model_or_params, nnx.Param)
        if isinstance(model_or_params, nnx.Module)
        else model_or_params
    )
    paths = [_path_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    n_layer = 1 + max((p[1] for p in paths if p[0] == "h"), default=-1)
    if not isinstance(last_n_blocks, int) or not 0 <= last_n_blocks <= n_layer:
        raise ValueError(f"last_n_blocks must be an int in [0, {n_layer}], got {last_n_blocks!r}")

    def is_trainable(key_path, _):
        keys = _path_keys(key_path)
        if keys[0] == "h":
            return keys[1] >= n_layer - last_n_blocks
        return head and keys[0] in ("wte", "ln_f")

    return jax.tree_util.tree_map_with_path(is_trainable, params)


def generate(
    model: GPT2,
    prompt_ids: jax.Array,
    *,
    max_new_tokens: int,
    key: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    eos_id: int | None = None,
    prompt_mask: jax.Array | None = None,
) -> jax.Array:
    """Decodes ``max_new_tokens`` tokens after ``prompt_ids`` with a KV cache.

    One compiled program per (shapes, ``top_k``, greedy/sampled): the cache is preallocated to
    prompt length + ``max_new_tokens`` and the steps run in a ``lax.scan``.

    Args:
      model: the language model.
      prompt_ids: ``(batch, prompt_len)`` token ids.
      max_new_tokens: number of tokens to generate.
      key: PRNG key for sampling; ``None`` decodes greedily (argmax).
      temperature: softmax temperature for sampling (> 0).
      top_k: if set, sample only among the ``top_k`` most likely tokens.
      eos_id: if set, a row that emits it keeps emitting it (padding) afterwards.
      prompt_mask: optional ``(batch, prompt_len)``, 0 for left padding of shorter prompts.

    Privacy:
      Decoding is not a private mechanism: generated tokens can reveal the prompt and the
      training data of the weights. Sensitive prompts (e.g. Hot PATE teachers' in-context
      examples) must only reach outputs through a DP aggregator, and ``key`` must not be a key
      that also drives DP noise.

    Returns:
      ``(batch, max_new_tokens)`` int32 generated tokens.
    """
    cfg = model.config
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] < 1:
        raise ValueError(f"prompt_ids must be (batch, prompt_len >= 1), got {prompt_ids.shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prompt_ids.shape[1] + max_new_tokens > cfg.n_positions:
        raise ValueError(
            f"prompt length {prompt_ids.shape[1]} + max_new_tokens {max_new_tokens} exceeds "
            f"n_positions {cfg.n_positions}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and not 1 <= top_k <= cfg.vocab_size:
        raise ValueError(f"top_k must be in [1, {cfg.vocab_size}], got {top_k}")
    if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
        raise ValueError(f"eos_id must be in [0, {cfg.vocab_size}), got {eos_id}")
    if prompt_mask is None:
        prompt_mask = jnp.ones(prompt_ids.shape, bool)
    elif prompt_mask.shape != prompt_ids.shape:
        raise ValueError(
            f"prompt_mask shape {prompt_mask.shape} != prompt shape {prompt_ids.shape}"
        )
    graphdef, state = nnx.split(model)
    return _generate(
        graphdef,
        state,
        jnp.asarray(prompt_ids, jnp.int32),
        jnp.asarray(prompt_mask, bool),
        jax.random.key(0) if key is None else key,
        jnp.float32(temperature),
        jnp.int32(-1 if eos_id is None else eos_id),
        max_new_tokens=max_new_tokens,
        top_k=top_k,
        sample=key is not None,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "top_k", "sample"))
def _generate(
    graphdef, state, prompt_ids, prompt_mask, key, temperature, eos_id, *, max_new_tokens, top_k,
    sample,
):  # fmt: skip
    model = nnx.merge(graphdef, state)
    batch, prompt_len = prompt_ids.shape
    cache = model.init_cache(batch, prompt_len + max_new_tokens)
    logits, cache = model.extend(prompt_ids, cache, attention_mask=prompt_mask)

    def choose(step_logits, step_key):
        if not sample:
            return jnp.argmax(step_logits, axis=-1).astype(jnp.int32)
        step_logits = step_logits / temperature
        if top_k is not None:
            kth = jax.lax.top_k(step_logits, top_k)[0][:, -1:]
            step_logits = jnp.where(step_logits < kth, -jnp.inf, step_logits)
        return jax.random.categorical(step_key, step_logits).astype(jnp.int32)

    def step(carry, step_key):
        last_logits, cache, done = carry
        token = jnp.where(done, eos_id, choose(last_logits, step_key))
        done = done | (token == eos_id)
        # The final step's extend is unused; it keeps the loop body uniform.
        logits, cache = model.extend(token[:, None], cache)
        return (logits[:, -1], cache, done), token

    init = (logits[:, -1], cache, jnp.zeros((batch,), bool))
    _, tokens = jax.lax.scan(step, init, jax.random.split(key, max_new_tokens))
    return tokens.T
