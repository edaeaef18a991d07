"""Per-row losses of a model on a batch dict, the unit the training engine differentiates.

A loss here is `loss_fn(model, batch) -> (B,)`: one loss per row of the batch, computed by calling
the (merged) NNX model on the batch. The engine averages rows for public steps and clips each row's
gradient for private steps, so the same loss serves both.

API:
    softmax_cross_entropy(*, input_key, label_key)     integer class labels
    sigmoid_bce(*, input_key, target_key)              targets (B, k) in [0, 1], summed over heads
    mixture_bce(weights, *, input_key, labels_key)     target Σ_i λ_i y_i from labels (B, k)
    next_token_nll(*, tokens_key, mask_key)            mean next-token NLL of each sequence
    sequence_log_prob(logits, tokens, mask)            total log-probability and token count per row
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

Batch = Mapping[str, Any]
LossFn = Callable[[nnx.Module, Batch], jax.Array]


def softmax_cross_entropy(*, input_key: str = "inputs", label_key: str = "label") -> LossFn:
    """Cross-entropy of `model(batch[input_key])` logits (B, C) against integer labels (B,)."""

    def loss_fn(model: nnx.Module, batch: Batch) -> jax.Array:
        logits = model(batch[input_key])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[label_key])

    return loss_fn


def _bce_rows(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logits = logits.reshape(targets.shape).astype(jnp.float32)
    losses = optax.sigmoid_binary_cross_entropy(logits, targets.astype(jnp.float32))
    return losses.reshape(losses.shape[0], -1).sum(axis=1)


def sigmoid_bce(*, input_key: str = "inputs", target_key: str = "targets") -> LossFn:
    """Binary cross-entropy of k sigmoid heads against targets in [0, 1], summed over the heads.

    `model(batch[input_key])` gives logits (B, k) and `batch[target_key]` is (B, k) (or (B,) with
    a single head). This is the multi-head proxy loss (one head per label source).
    """

    def loss_fn(model: nnx.Module, batch: Batch) -> jax.Array:
        return _bce_rows(model(batch[input_key]), batch[target_key])

    return loss_fn


def mixture_bce(weights: Any, *, input_key: str = "inputs", labels_key: str = "labels") -> LossFn:
    """BCE against the soft mixture target Σ_i λ_i y_i (pretraining on λ, shared inputs).

    Args:
        weights: λ of shape (k,) (one output head) or (T, k) (one mixture per downstream task, T
            heads); non-negative, each row summing to 1.
        input_key: the batch key of the model input.
        labels_key: the batch key of the (B, k) labels of the k label sources.

    Returns:
        `loss_fn(model, batch) -> (B,)`, the BCE summed over the T heads. With λ = e_i it equals
        `sigmoid_bce` on the labels of source i alone.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim not in (1, 2) or weights.shape[-1] < 1:
        raise ValueError(f"weights must have shape (k,) or (T, k), got {weights.shape}.")
    if not np.isfinite(weights).all() or (weights < 0).any():
        raise ValueError(f"weights must be finite and non-negative, got {weights.tolist()}.")
    if not np.allclose(weights.sum(axis=-1), 1.0, atol=1e-6):
        raise ValueError(f"weights must sum to 1 (per row), got {weights.sum(axis=-1).tolist()}.")
    matrix = jnp.asarray(np.atleast_2d(weights).T, dtype=jnp.float32)  # (k, T)
    k = weights.shape[-1]

    def loss_fn(model: nnx.Module, batch: Batch) -> jax.Array:
        labels = batch[labels_key]
        if labels.shape[-1] != k:
            raise ValueError(f"labels have {labels.shape[-1]} sources, weights have {k}.")
        targets = labels.astype(jnp.float32) @ matrix
        return _bce_rows(model(batch[input_key]), targets)

    return loss_fn


def sequence_log_prob(
    logits: jax.Array, tokens: jax.Array, mask: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Total next-token log-probability of each sequence and the number of predicted tokens.

    Token t (t >= 1) is predicted from the logits at position t - 1; the first token of a row is
    the context and is not scored. A token counts when it and its predecessor are both real
    (`mask` 1), so padding never contributes.

    Args:
        logits: (B, S, V) next-token logits.
        tokens: (B, S) token ids.
        mask: (B, S) 1 for real tokens; None means all real.

    Returns:
        `(log_prob, count)`, both (B,) float32.
    """
    if mask is None:
        mask = jnp.ones(tokens.shape, bool)
    log_probs = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1)[..., 0]
    scored = jnp.logical_and(mask[:, 1:] != 0, mask[:, :-1] != 0)
    log_prob = jnp.sum(jnp.where(scored, picked, 0.0), axis=1)
    return log_prob, jnp.sum(scored, axis=1).astype(jnp.float32)


def next_token_nll(*, tokens_key: str = "tokens", mask_key: str | None = "mask") -> LossFn:
    """Mean next-token negative log-likelihood of each sequence (language modelling).

    Calls `model(tokens, attention_mask=mask)` when the batch has `mask_key`, else `model(tokens)`.
    Rows without any scored token get loss 0.
    """

    def loss_fn(model: nnx.Module, batch: Batch) -> jax.Array:
        tokens = batch[tokens_key]
        mask = batch.get(mask_key) if mask_key is not None else None
        logits = model(tokens) if mask is None else model(tokens, attention_mask=mask)
        log_prob, count = sequence_log_prob(logits, tokens, mask)
        return -log_prob / jnp.maximum(count, 1.0)

    return loss_fn
