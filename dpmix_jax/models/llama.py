"""Llama-family causal decoders in Flax NNX: Llama 3.x, SmolLM2, Qwen2.5 and Mistral.

These models share one architecture: pre-RMSNorm blocks, rotary position embeddings (RoPE) in
transformers' ``rotate_half`` layout, grouped-query attention (several query heads share a
key/value head) and a SwiGLU MLP, ``down(silu(gate(x)) * up(x))``. They differ only in settings
held by :class:`LlamaConfig`: RoPE base and scaling, biases on the query/key/value projections
(Qwen2), a sliding attention window (Mistral 7B v0.1) and whether the LM head is tied to the token
embedding. Module names mirror transformers' (``embed_tokens``, ``layers.N.self_attn.q_proj``,
``mlp.gate_proj``, ``norm``, ``lm_head``) without the ``model.`` prefix.

Every projection is an ``nnx.Linear``, the embedding an ``nnx.Embed`` (``attend`` gives a tied
head) and the norms ``nnx.RMSNorm``, so ghost clipping (`train.ghost_models`) and LoRA
(`models.lora`) apply unchanged. The KV-cache API (``init_cache``, ``extend``) is GPT-2's, and
``config.n_positions`` names the longest sequence, so `models.gpt2.generate` decodes either model.
Weights load with `models.llama_weights.load_llama`.

Example Usage:
  >>> import jax.numpy as jnp
  >>> from flax import nnx
  >>> from dpmix_jax.models.gpt2 import generate
  >>> model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  >>> model(jnp.zeros((2, 5), jnp.int32)).shape
  (2, 5, 512)
  >>> generate(model, jnp.zeros((2, 5), jnp.int32), max_new_tokens=3).shape
  (2, 3)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.models.dtypes import float_dtype
from dpmix_jax.models.gpt2 import KVCache

ROPE_SCALING_KINDS = ("linear", "llama3")
_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# transformers model types this module implements, mapped to whether q/k/v carry biases.
_QKV_BIAS_BY_MODEL_TYPE = {"llama": False, "mistral": False, "qwen2": True}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(value: Any) -> bool:
    number = isinstance(value, int | float) and not isinstance(value, bool)
    return number and math.isfinite(value) and value > 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """Stretching of the rotary frequencies for contexts longer than pre-training.

    Attributes:
      kind: "linear" (every frequency divided by ``factor``) or "llama3" (Llama 3.1's scheme: low
        frequencies divided by ``factor``, high ones kept, a smooth blend in between).
      factor: the context extension factor (> 0).
      low_freq_factor: llama3 only: wavelengths above ``original_max_position_embeddings /
        low_freq_factor`` are fully scaled.
      high_freq_factor: llama3 only: wavelengths below ``original_max_position_embeddings /
        high_freq_factor`` are kept.
      original_max_position_embeddings: llama3 only: the pre-training context length.
    """

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.kind not in ROPE_SCALING_KINDS:
            raise ValueError(
                f"rope scaling kind must be one of {ROPE_SCALING_KINDS}, got {self.kind!r}"
            )
        if not _positive(self.factor):
            raise ValueError(
                f"rope scaling factor must be a finite number > 0, got {self.factor!r}"
            )
        low, high = self.low_freq_factor, self.high_freq_factor
        if not (_positive(low) and _positive(high) and low < high):
            raise ValueError(
                f"rope scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor!r} and {self.high_freq_factor!r}"
            )
        if not _is_int(self.original_max_position_embeddings) or (
            self.original_max_position_embeddings < 1
        ):
            raise ValueError(
                "rope scaling original_max_position_embeddings must be a positive int, got "
                f"{self.original_max_position_embeddings!r}"
            )

    @classmethod
    def from_hf(cls, hf_scaling: Mapping[str, Any] | None) -> RopeScaling | None:
        """Reads transformers' ``rope_scaling`` / ``rope_parameters``; None for plain RoPE.

        Raises:
          ValueError: for a scaling type other than default, linear or llama3.
        """
        if hf_scaling is None:
            return None
        kind = hf_scaling.get("rope_type", hf_scaling.get("type", "default"))
        if kind == "default":
            return None
        if kind not in ROPE_SCALING_KINDS:
            raise ValueError(f"unsupported rope scaling {kind!r}; supported: {ROPE_SCALING_KINDS}")
        fields = {"kind": kind, "factor": hf_scaling["factor"]}
        if kind == "llama3":
            fields |= {name: hf_scaling[name] for name in _LLAMA3_FIELDS}
        return cls(**fields)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and numerics of a Llama-family decoder (defaults: SmolLM2-135M).

    Attributes:
      vocab_size: number of tokens.
      hidden_size: model width.
      intermediate_size: hidden width of the SwiGLU MLP.
      num_layers: number of transformer blocks.
      num_heads: query heads.
      num_kv_heads: key/value heads; must divide ``num_heads`` (fewer: grouped-query attention).
      head_dim: width of one head; ``None`` means ``hidden_size // num_heads``.
      rms_norm_eps: RMSNorm epsilon.
      rope_theta: RoPE base.
      rope_scaling: ``None``, a :class:`RopeScaling`, or transformers' dict form of one.
      attention_bias: whether the query/key/value projections have biases (Qwen2).
      sliding_window: if set, a token attends only to the last ``sliding_window`` positions,
        itself included (Mistral 7B v0.1).
      tie_word_embeddings: whether the LM head is the token embedding (else a separate
        ``lm_head``).
      max_position_embeddings: longest supported sequence (prompt plus generated tokens).
      dtype: compute dtype (e.g. "bfloat16"); attention softmax, RMSNorm statistics and logits
        stay float32.
      param_dtype: dtype of the stored parameters.
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    rope_scaling: RopeScaling | Mapping[str, Any] | None = None
    attention_bias: bool = False
    sliding_window: int | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    dtype: Any = "float32"
    param_dtype: Any = "float32"

    def __post_init__(self):
        for name in (
            "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
            "num_kv_heads", "max_position_embeddings",
        ):  # fmt: skip
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must divide hidden_size ({self.hidden_size}) "
                    "when head_dim is None"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not _is_int(self.head_dim) or self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim must be a positive even int, got {self.head_dim!r}")
        if not _positive(self.rms_norm_eps):
            raise ValueError(f"rms_norm_eps must be a finite number > 0, got {self.rms_norm_eps!r}")
        if not _positive(self.rope_theta):
            raise ValueError(f"rope_theta must be a finite number > 0, got {self.rope_theta!r}")
        if isinstance(self.rope_scaling, Mapping):
            object.__setattr__(self, "rope_scaling", RopeScaling.from_hf(self.rope_scaling))
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"rope_scaling must be None, a RopeScaling or a dict, got {self.rope_scaling!r}"
            )
        if self.sliding_window is not None and (
            not _is_int(self.sliding_window) or self.sliding_window < 1
        ):
            raise ValueError(
                f"sliding_window must be None or a positive int, got {self.sliding_window!r}"
            )
        for name in ("attention_bias", "tie_word_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        object.__setattr__(self, "dtype", float_dtype(self.dtype, "dtype"))
        object.__setattr__(self, "param_dtype", float_dtype(self.param_dtype, "param_dtype"))

    @property
    def n_positions(self) -> int:
        """The longest sequence, under the name GPT-2's config uses (read by `generate`)."""
        return self.max_position_embeddings

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """A 2-layer, 64-wide model with grouped-query attention and 512 tokens, for CPU tests."""
        defaults = {
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_layers": 2,
            "num_heads": 4, "num_kv_heads": 2, "rope_theta": 10000.0,
            "max_position_embeddings": 128,
        }  # fmt: skip
        return cls(**{**defaults, **overrides})

    @classmethod
    def from_hf(cls, hf_config: Mapping[str, Any], **overrides) -> LlamaConfig:
        """Builds a config from the contents of a transformers ``config.json``.

        Reads the rotary settings in both transformers 4 (``rope_theta``, ``rope_scaling``) and 5
        (``rope_parameters``) form.

        Raises:
          ValueError: for a model type other than llama, mistral or qwen2, or a feature this
            implementation does not have (another activation, MLP or output-projection biases,
            Qwen2's per-layer sliding window).
        """
        model_type = hf_config.get("model_type")
        if model_type not in _QKV_BIAS_BY_MODEL_TYPE:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: "
                f"{', '.join(_QKV_BIAS_BY_MODEL_TYPE)}"
            )
        if hf_config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {hf_config['hidden_act']!r}; need silu")
        if hf_config.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        if model_type != "qwen2" and hf_config.get("attention_bias", False):
            raise ValueError("attention_bias=True (biased o_proj) is not supported")
        if model_type == "qwen2" and hf_config.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True (Qwen2 per-layer windows) is not supported")
        rope = hf_config.get("rope_parameters") or {}
        num_heads = hf_config["num_attention_heads"]
        fields = {
            "vocab_size": hf_config["vocab_size"],
            "hidden_size": hf_config["hidden_size"],
            "intermediate_size": hf_config["intermediate_size"],
            "num_layers": hf_config["num_hidden_layers"],
            "num_heads": num_heads,
            "num_kv_heads": hf_config.get("num_key_value_heads") or num_heads,
            "head_dim": hf_config.get("head_dim"),
            "rms_norm_eps": hf_config.get("rms_norm_eps", 1e-6),
            "rope_theta": rope.get("rope_theta", hf_config.get("rope_theta", 10000.0)),
            "rope_scaling": RopeScaling.from_hf(rope or hf_config.get("rope_scaling")),
            "attention_bias": _QKV_BIAS_BY_MODEL_TYPE[model_type],
            "sliding_window": hf_config.get("sliding_window") if model_type == "mistral" else None,
            "tie_word_embeddings": hf_config.get("tie_word_embeddings", False),
            "max_position_embeddings": hf_config.get("max_position_embeddings", 2048),
        }
        return cls(**{**fields, **overrides})


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None
) -> np.ndarray:
    """``(head_dim // 2,)`` float32 angular frequencies of RoPE, scaled as transformers does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inverse = (1.0 / np.float32(theta) ** exponents).astype(np.float32)
    if scaling is None:
        return inverse
    if scaling.kind == "linear":
        return (inverse / np.float32(scaling.factor)).astype(np.float32)
    context = scaling.original_max_position_embeddings
    wavelength = 2 * np.pi / inverse
    scaled = np.where(
        wavelength > context / scaling.low_freq_factor, inverse / scaling.factor, inverse
    )
    smooth = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= context / scaling.high_freq_factor) & (
        wavelength <= context / scaling.low_freq_factor
    )
    return np.where(medium, blended, scaled).astype(np.float32)


def _rotary_tables(config: LlamaConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin ``(batch, T, head_dim)`` of every position, halves repeated (rotate_half)."""
    inverse = rope_inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inverse)
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def _rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Applies RoPE to ``x`` (batch, T, heads, head_dim)."""
    first, second = jnp.split(x, 2, axis=-1)
    rotated_half = jnp.concatenate([-second, first], axis=-1)
    cos, sin = (t[:, :, None, :].astype(x.dtype) for t in (cos, sin))
    return x * cos + rotated_half * sin


def _normal(stddev: float):
    return nnx.initializers.normal(stddev)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary position embeddings."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        width, head_dim = config.hidden_size, config.head_dim
        dtypes = {"dtype": config.dtype, "param_dtype": config.param_dtype}
        init = {"kernel_init": _normal(0.02), "rngs": rngs, **dtypes}
        bias = config.attention_bias
        self.q_proj = nnx.Linear(width, config.num_heads * head_dim, use_bias=bias, **init)
        self.k_proj = nnx.Linear(width, config.num_kv_heads * head_dim, use_bias=bias, **init)
        self.v_proj = nnx.Linear(width, config.num_kv_heads * head_dim, use_bias=bias, **init)
        self.o_proj = nnx.Linear(config.num_heads * head_dim, width, use_bias=False, **init)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads, config.num_kv_heads, head_dim
        )  # fmt: skip

    def __call__(
        self,
        x: jax.Array,
        rotary: tuple[jax.Array, jax.Array],
        mask: jax.Array,
        cache: tuple[jax.Array, jax.Array, jax.Array] | None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Attends ``x`` (batch, T, hidden) to itself, or to the cache with its keys written in.

        Args:
          x: inputs ``(batch, T, hidden_size)``.
          rotary: cos and sin tables of the T tokens' positions.
          mask: ``(batch, T, S)`` bool, True where query t may attend to key s; S = T without a
            cache, the cache capacity with one.
          cache: optional ``(keys, values, index)``: this layer's cache arrays and the slot where
            the T new keys/values go.

        Returns:
          The attention output and the updated ``(keys, values)`` (None without a cache).
        """
        batch, length, _ = x.shape
        groups = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        q, k = _rotate(q, *rotary), _rotate(k, *rotary)
        new_cache = None
        if cache is not None:
            k_cache, v_cache, index = cache
            k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, index, 0, 0))
            v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, index, 0, 0))
            new_cache = (k, v)
        # Query head h reads key/value head h // groups, as transformers' repeat_kv arranges.
        q = q.reshape(batch, length, self.num_kv_heads, groups, self.head_dim)
        scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(self.head_dim)
        # A finite fill keeps fully masked rows (left padding) NaN-free.
        scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bkgts,bskd->btkgd", weights, v)
        return self.o_proj(out.reshape(batch, length, -1)), new_cache


class MLP(nnx.Module):
    """SwiGLU feed-forward network: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        width, hidden = config.hidden_size, config.intermediate_size
        dtypes = {"dtype": config.dtype, "param_dtype": config.param_dtype}
        init = {"use_bias": False, "kernel_init": _normal(0.02), "rngs": rngs, **dtypes}
        self.gate_proj = nnx.Linear(width, hidden, **init)
        self.up_proj = nnx.Linear(width, hidden, **init)
        self.down_proj = nnx.Linear(hidden, width, **init)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _rms_norm(config: LlamaConfig, rngs: nnx.Rngs) -> nnx.RMSNorm:
    # nnx.RMSNorm computes x * (rsqrt(mean(x²) + eps) * scale) with float32 statistics. In float32
    # that is transformers' LlamaRMSNorm up to the order of the two products; in bfloat16,
    # transformers rounds before applying the scale and nnx.RMSNorm after.
    return nnx.RMSNorm(
        config.hidden_size,
        epsilon=config.rms_norm_eps,
        dtype=config.dtype,
        param_dtype=config.param_dtype,
        rngs=rngs,
    )


class DecoderLayer(nnx.Module):
    """Pre-RMSNorm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.input_layernorm = _rms_norm(config, rngs)
        self.self_attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = _rms_norm(config, rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x, rotary, mask, cache=None):
        attended, new_cache = self.self_attn(self.input_layernorm(x), rotary, mask, cache)
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x)), new_cache


def _positions_from_mask(token_mask: jax.Array) -> jax.Array:
    """Position id of every token = number of real tokens before it in its row."""
    token_mask = token_mask.astype(jnp.int32)
    return jnp.cumsum(token_mask, axis=1) - token_mask


class Llama(nnx.Module):
    """Llama-family language model.

    Args:
      config: the architecture.
      rngs: random streams for initialisation.
    """

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtypes = {"dtype": config.dtype, "param_dtype": config.param_dtype}
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, embedding_init=_normal(0.02), rngs=rngs,
            **dtypes,
        )  # fmt: skip
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs) for _ in range(config.num_layers)])
        self.norm = _rms_norm(config, rngs)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(
                config.hidden_size, config.vocab_size, use_bias=False,
                kernel_init=_normal(0.02), rngs=rngs, **dtypes,
            )  # fmt: skip

    def _check_ids(self, input_ids: jax.Array, attention_mask: jax.Array | None) -> None:
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be (batch, seq), got shape {input_ids.shape}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}"
            )

    def _window(self, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
        """``(batch, T, S)`` True where the key lies within the query's sliding window."""
        distance = query_positions[:, :, None] - key_positions[:, None, :]
        return distance < self.config.sliding_window

    def _head(self, states: jax.Array) -> jax.Array:
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(states).astype(jnp.float32)
        return self.lm_head(states).astype(jnp.float32)

    def _logits(self, hidden: jax.Array) -> jax.Array:
        return self._head(self.norm(hidden))

    def __call__(
        self,
        input_ids: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """Next-token logits for every position.

        Args:
          input_ids: ``(batch, seq)`` int token ids, ``seq <= max_position_embeddings``.
          attention_mask: optional ``(batch, seq)``, 1 for real tokens and 0 for padding (which
            no token attends to). Left padding is supported: positions then count real tokens.
          positions: optional ``(batch, seq)`` position ids; by default the number of real tokens
            before each token (``0..seq-1`` without a mask).

        Returns:
          Float32 logits ``(batch, seq, vocab_size)``.
        """
        states = self.final_states(input_ids, attention_mask=attention_mask, positions=positions)
        return self._head(states)

    def final_states(
        self,
        input_ids: jax.Array,
        *,
        attention_mask: jax.Array | None = None,
        positions: jax.Array | None = None,
    ) -> jax.Array:
        """The final RMSNorm's output for every position, ``(batch, seq, hidden_size)``: the
        states the output head reads (arguments as for ``__call__``)."""
        self._check_ids(input_ids, attention_mask)
        length = input_ids.shape[1]
        if length > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {length} exceeds max_position_embeddings")
        token_mask = (
            jnp.ones(input_ids.shape, bool) if attention_mask is None else attention_mask != 0
        )
        if positions is None:
            positions = _positions_from_mask(token_mask)
        causal = jnp.tril(jnp.ones((length, length), bool))
        mask = causal[None] & token_mask[:, None, :]
        if self.config.sliding_window is not None:
            mask &= self._window(positions, positions)
        rotary = _rotary_tables(self.config, positions)
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden, _ = layer(hidden, rotary, mask)
        return self.norm(hidden)

    def init_cache(self, batch_size: int, capacity: int) -> KVCache:
        """An empty cache for ``batch_size`` rows and up to ``capacity`` tokens in total."""
        cfg = self.config
        if batch_size < 1 or not 1 <= capacity <= cfg.max_position_embeddings:
            raise ValueError(
                f"need batch_size >= 1 and 1 <= capacity <= max_position_embeddings "
                f"({cfg.max_position_embeddings}), got {batch_size=}, {capacity=}"
            )
        shape = (batch_size, capacity, cfg.num_kv_heads, cfg.head_dim)
        empty = tuple(jnp.zeros(shape, cfg.dtype) for _ in range(cfg.num_layers))
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
        clamped by ``dynamic_update_slice``); `generate` sizes the cache accordingly.

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
        if self.config.sliding_window is not None:
            mask &= self._window(positions, _positions_from_mask(valid))
        rotary = _rotary_tables(self.config, positions)
        hidden = self.embed_tokens(input_ids)
        keys, values = [], []
        for layer, k, v in zip(self.layers, cache.keys, cache.values, strict=True):
            hidden, (k, v) = layer(hidden, rotary, mask, (k, v, cache.index))
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


def _path_keys(key_path) -> tuple:
    """Plain keys of a pytree path into an nnx.State, without the Variable's ``.value``."""
    return tuple(k.key for k in key_path if isinstance(k, jax.tree_util.DictKey))


def trainable_mask(model_or_params: Llama | nnx.State, *, last_n_blocks: int, head: bool = True):
    """Marks the parameters that fine-tuning updates: the last blocks and the LM head.

    The head is the final ``norm`` plus ``lm_head``, or, when the head is tied, the token
    embedding ``embed_tokens`` (training it then also moves the input embeddings of the same
    tokens, as for GPT-2). The earlier blocks, and an untied model's input embedding, stay frozen.

    Args:
      model_or_params: a :class:`Llama` or its ``nnx.Param`` state.
      last_n_blocks: number of final blocks to train, ``0..num_layers``.
      head: whether the head is trainable.

    Returns:
      A pytree with the structure of the parameter state and bool leaves (usable with
      ``optax.masked`` or as `train.Trainer`'s ``trainable_mask``).
    """
    params = (
        nnx.state(model_or_params, nnx.Param)
        if isinstance(model_or_params, nnx.Module)
        else model_or_params
    )
    paths = [_path_keys(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    num_layers = 1 + max((p[1] for p in paths if p[0] == "layers"), default=-1)
    if not _is_int(last_n_blocks) or not 0 <= last_n_blocks <= num_layers:
        raise ValueError(
            f"last_n_blocks must be an int in [0, {num_layers}], got {last_n_blocks!r}"
        )
    tied = not any(p[0] == "lm_head" for p in paths)
    head_modules = ("norm", "embed_tokens") if tied else ("norm", "lm_head")

    def is_trainable(key_path, _):
        keys = _path_keys(key_path)
        if keys[0] == "layers":
            return keys[1] >= num_layers - last_n_blocks
        return head and keys[0] in head_modules

    return jax.tree_util.tree_map_with_path(is_trainable, params)
