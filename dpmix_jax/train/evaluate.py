"""Evaluation: batched model outputs over a data set, AUC per task and macro AUC, perplexity.

API:
    model_outputs(model, apply, gather, num_examples, *, batch_size) -> np.ndarray
    roc_auc(scores, labels) -> float                   ties handled (average ranks)
    per_task_auc(scores, labels) -> np.ndarray         (T,), nan for a task with one class
    macro_auc(scores, labels) -> float                 mean over tasks with both classes
    auc_report(model, gather, num_examples, *, batch_size, input_key, label_key) -> dict
    perplexity(model, gather, num_examples, *, batch_size, tokens_key, mask_key) -> float
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
from flax import nnx

from dpmix_jax.train.losses import Batch, sequence_log_prob

Gather = Callable[[np.ndarray], Batch]
Apply = Callable[[nnx.Module, Batch], Any]


def model_outputs(
    model: nnx.Module, apply: Apply, gather: Gather, num_examples: int, *, batch_size: int
) -> Any:
    """`apply(model, batch)` over rows `0..num_examples-1` in fixed-size batches, concatenated.

    The last batch is padded with -1 indices (zero rows from `gather`) so one shape is compiled;
    padded rows are dropped. `apply` may return an array or a pytree of arrays with a leading
    batch axis.

    Privacy: on sensitive data the outputs are sensitive; release them only through a DP
    mechanism (the proxy-output matrix of DP-MixMin is consumed by its accounted solver).
    """
    if not isinstance(num_examples, int | np.integer) or num_examples < 1:
        raise ValueError(f"num_examples must be an integer >= 1, got {num_examples!r}.")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}.")
    graphdef, state = nnx.split(model)
    run = _compiled(graphdef, apply)
    parts = []
    for start in range(0, num_examples, batch_size):
        indices = np.arange(start, start + batch_size)
        indices[indices >= num_examples] = -1
        batch = jax.tree.map(jnp.asarray, gather(indices))
        parts.append(jax.device_get(run(state, batch)))
    outputs = jax.tree.map(lambda *xs: np.concatenate(xs), *parts)
    return jax.tree.map(lambda x: x[:num_examples], outputs)


@functools.lru_cache(maxsize=32)
def _compiled(graphdef: Any, apply: Apply) -> Callable:
    # One jitted function per (model structure, apply): every evaluation of a model of the same
    # structure reuses the compiled program instead of tracing a fresh closure.
    return jax.jit(lambda state, batch: apply(nnx.merge(graphdef, state), batch))


@functools.cache
def outputs_and_labels(input_key: str = "inputs", label_key: str = "labels") -> Apply:
    """`apply(model, batch) -> (model(batch[input_key]), batch[label_key])`, one object per keys
    (so `model_outputs` compiles it once)."""
    return lambda model, batch: (model(batch[input_key]), batch[label_key])


@functools.cache
def sequence_scores(tokens_key: str = "tokens", mask_key: str | None = "mask") -> Apply:
    """`apply(model, batch) -> (total log-prob, scored tokens)` per sequence of a language model
    (`losses.sequence_log_prob`), one object per keys."""

    def apply(model, batch):
        tokens = batch[tokens_key]
        mask = batch.get(mask_key) if mask_key is not None else None
        logits = model(tokens) if mask is None else model(tokens, attention_mask=mask)
        return sequence_log_prob(logits, tokens, mask)

    return apply


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of binary `labels` ranked by `scores` (ties count one half).

    Computed as the Mann-Whitney statistic with average ranks, which equals the trapezoidal area
    under the ROC curve (and `sklearn.metrics.roc_auc_score`).
    """
    scores = np.asarray(scores, dtype=np.float64).ravel()
    labels = np.asarray(labels).ravel()
    if scores.shape != labels.shape or scores.size == 0:
        raise ValueError(
            f"scores {scores.shape} and labels {labels.shape} must be equal and non-empty."
        )
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("labels must be 0 or 1.")
    if not np.isfinite(scores).all():
        raise ValueError("scores must be finite.")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError("AUC needs at least one positive and one negative label.")
    ranks = scipy.stats.rankdata(scores)
    rank_sum = ranks[labels == 1].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def per_task_auc(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """AUC of each column of `(n, T)` scores against `(n, T)` binary labels; nan for a task whose
    labels have a single class."""
    scores, labels = np.asarray(scores), np.asarray(labels)
    if scores.ndim != 2 or scores.shape != labels.shape:
        raise ValueError(f"scores {scores.shape} and labels {labels.shape} must both be (n, T).")
    out = np.full(scores.shape[1], np.nan)
    for task in range(scores.shape[1]):
        if 0 < labels[:, task].sum() < labels.shape[0]:
            out[task] = roc_auc(scores[:, task], labels[:, task])
    return out


def macro_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mean AUC over the tasks that have both classes."""
    aucs = per_task_auc(scores, labels)
    if np.isnan(aucs).all():
        raise ValueError("no task has both positive and negative labels.")
    return float(np.nanmean(aucs))


def auc_report(
    model: nnx.Module,
    gather: Gather,
    num_examples: int,
    *,
    batch_size: int = 256,
    input_key: str = "inputs",
    label_key: str = "labels",
) -> dict[str, float]:
    """`{"auc/<t>": AUC of task t, "macro_auc": ...}` for a multi-label classifier's logits."""
    logits, labels = model_outputs(
        model, outputs_and_labels(input_key, label_key), gather, num_examples, batch_size=batch_size
    )
    logits, labels = logits.reshape(num_examples, -1), labels.reshape(num_examples, -1)
    aucs = per_task_auc(logits, labels)
    report = {f"auc/{t}": float(a) for t, a in enumerate(aucs)}
    report["macro_auc"] = macro_auc(logits, labels)
    return report


def perplexity(
    model: nnx.Module,
    gather: Gather,
    num_examples: int,
    *,
    batch_size: int = 32,
    tokens_key: str = "tokens",
    mask_key: str | None = "mask",
) -> float:
    """exp(total next-token NLL / number of scored tokens) over the whole data set."""
    apply = sequence_scores(tokens_key, mask_key)
    log_prob, count = model_outputs(model, apply, gather, num_examples, batch_size=batch_size)
    if count.sum() == 0:
        raise ValueError("no scored token (every sequence is shorter than two tokens).")
    return float(np.exp(-log_prob.sum(dtype=np.float64) / count.sum(dtype=np.float64)))
