"""Proxy models of DP-MixMin: trained on public data, evaluated once on the sensitive mixture split.

Image tasks use **one** network with k sigmoid heads (the sources' label spaces concatenated),
trained with BCE on public data; language tasks use one proxy LM per domain. The mixture stage
reads the sensitive data only through the cached proxy-output matrix:

- `nll` kind: P[j, i] = p_i(y_j | x_j) for a binary target y_j and head i: f_i(x_j) if y_j = 1
  else 1 - f_i(x_j), with f_i = sigmoid(logit_i) (computed in float64 from the logits);
- `sequence` kind: L[j, i] = total next-token log-probability of sequence j under proxy i, with
  the token count T_j of scored tokens.

Privacy: computing proxy outputs on sensitive data is not itself a release; only the DP mechanism
that consumes the matrix (DP-MixMin's accounted solver) releases anything. The cached `.npz` is
as sensitive as the data it was computed on.

API:
    train_image_proxy(model, data, config, *, rng, input_key="inputs", labels_key="labels", **kw)
    train_lm_proxies(models, domains, config, *, rng, **fit_kw) -> list[FitResult]
    nll_matrix(logits, targets) -> (n, k) float64
    image_proxy_outputs(model, gather, num_examples, *, batch_size, input_key, target_key)
    sequence_proxy_outputs(models, gather, num_examples, *, batch_size, tokens_key, mask_key)
    ProxyOutputs(kind, matrix, token_counts=None, metadata={})
    save_proxy_outputs(path, outputs) / load_proxy_outputs(path) -> ProxyOutputs
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import scipy.special
from flax import nnx

from dpmix_jax.train import engine, evaluate, losses
from dpmix_jax.train.config import TrainConfig

Gather = Callable[[np.ndarray], losses.Batch]
Kind = Literal["nll", "sequence"]


def _check_public(config: TrainConfig) -> None:
    if config.private:
        raise ValueError("proxies are trained on public data: use a public TrainConfig.")


def train_image_proxy(
    model: nnx.Module,
    data: engine.IndexedData,
    config: TrainConfig,
    *,
    rng: np.random.Generator,
    input_key: str = "inputs",
    labels_key: str = "labels",
    **fit_kwargs: Any,
) -> engine.FitResult:
    """Trains the multi-head image proxy: logits (B, k) against the k sources' labels (B, k), BCE.

    `fit_kwargs` go to `engine.fit` (checkpointer, logger, evaluate, ...).
    """
    _check_public(config)
    trainer = engine.Trainer(
        config, model, losses.sigmoid_bce(input_key=input_key, target_key=labels_key)
    )
    return engine.fit(trainer, data, rng=rng, **fit_kwargs)


def train_lm_proxies(
    models: Sequence[nnx.Module],
    domains: Sequence[engine.IndexedData | engine.BatchFn],
    config: TrainConfig,
    *,
    rng: np.random.Generator,
    tokens_key: str = "tokens",
    mask_key: str | None = "mask",
    **fit_kwargs: Any,
) -> list[engine.FitResult]:
    """Trains one LM proxy per public domain (next-token NLL), in order, sharing `rng`."""
    _check_public(config)
    if len(models) != len(domains) or not models:
        raise ValueError(f"need one model per domain, got {len(models)} and {len(domains)}.")
    loss = losses.next_token_nll(tokens_key=tokens_key, mask_key=mask_key)
    return [
        engine.fit(engine.Trainer(config, model, loss), domain, rng=rng, **fit_kwargs)
        for model, domain in zip(models, domains, strict=True)
    ]


def nll_matrix(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """P[j, i] = sigmoid(logits[j, i]) if targets[j] = 1 else 1 - sigmoid(logits[j, i]).

    Args:
        logits: (n, k) head logits.
        targets: (n,) binary labels of the sensitive task.

    Privacy: P is computed from sensitive labels; it is an input of the accounted mixture solver.
    """
    logits = np.asarray(logits, dtype=np.float64)
    targets = np.asarray(targets)
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be (n, k) and targets (n,), got {logits.shape}, {targets.shape}."
        )
    if not np.isin(targets, (0, 1)).all():
        raise ValueError("targets must be binary (0 or 1).")
    sign = np.where(targets == 1, 1.0, -1.0)[:, None]
    return scipy.special.expit(sign * logits)


def image_proxy_outputs(
    model: nnx.Module,
    gather: Gather,
    num_examples: int,
    *,
    batch_size: int = 256,
    input_key: str = "inputs",
    target_key: str = "target",
) -> np.ndarray:
    """The `nll` matrix (n, k) of the multi-head proxy on a sensitive split.

    Privacy: reads sensitive examples; the result is released only through a DP mechanism.
    """
    logits, targets = evaluate.model_outputs(
        model,
        evaluate.outputs_and_labels(input_key, target_key),
        gather,
        num_examples,
        batch_size=batch_size,
    )
    return nll_matrix(logits, targets.reshape(num_examples))


def sequence_proxy_outputs(
    models: Sequence[nnx.Module],
    gather: Gather,
    num_examples: int,
    *,
    batch_size: int = 32,
    tokens_key: str = "tokens",
    mask_key: str | None = "mask",
) -> tuple[np.ndarray, np.ndarray]:
    """`(L, T)`: L[j, i] total log-probability of sequence j under proxy i, T[j] its scored
    tokens (the first token of a sequence is context, see `losses.sequence_log_prob`).

    Privacy: reads sensitive sequences; the result is released only through a DP mechanism.
    """
    if not models:
        raise ValueError("need at least one proxy model.")

    apply = evaluate.sequence_scores(tokens_key, mask_key)
    columns, counts = [], None
    for model in models:
        log_prob, counts = evaluate.model_outputs(
            model, apply, gather, num_examples, batch_size=batch_size
        )
        columns.append(log_prob.astype(np.float64))
    return np.stack(columns, axis=1), counts.astype(np.int64)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProxyOutputs:
    """A cached proxy-output matrix.

    Attributes:
        kind: "nll" (P in [0, 1]) or "sequence" (L, log-probabilities, with `token_counts`).
        matrix: (n, k) float64.
        token_counts: (n,) scored tokens per sequence ("sequence" kind only).
        metadata: JSON-serialisable description (proxies, split, seeds...).
    """

    kind: Kind
    matrix: np.ndarray
    token_counts: np.ndarray | None = None
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        matrix = np.asarray(self.matrix, dtype=np.float64)
        object.__setattr__(self, "matrix", matrix)
        if matrix.ndim != 2 or 0 in matrix.shape:
            raise ValueError(f"matrix must be a non-empty (n, k) array, got {matrix.shape}.")
        if self.kind == "nll":
            if self.token_counts is not None:
                raise ValueError("token_counts belong to the 'sequence' kind only.")
            if not ((matrix >= 0) & (matrix <= 1)).all():
                raise ValueError("an 'nll' matrix holds probabilities in [0, 1].")
        elif self.kind == "sequence":
            counts = np.asarray(self.token_counts)
            if self.token_counts is None or counts.shape != matrix.shape[:1]:
                raise ValueError(
                    f"a 'sequence' matrix needs token_counts of shape ({len(matrix)},)."
                )
            if not (np.isfinite(matrix).all() and (matrix <= 0).all()):
                raise ValueError("a 'sequence' matrix holds finite log-probabilities (<= 0).")
            object.__setattr__(self, "token_counts", counts.astype(np.int64))
        else:
            raise ValueError(f"kind must be 'nll' or 'sequence', got {self.kind!r}.")
        json.dumps(dict(self.metadata))


def save_proxy_outputs(path: str | pathlib.Path, outputs: ProxyOutputs) -> None:
    """Writes `outputs` to an `.npz` file (metadata as a JSON string).

    Privacy: the file is as sensitive as the split it was computed on.
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arrays = {"kind": np.array(outputs.kind), "matrix": outputs.matrix}
    if outputs.token_counts is not None:
        arrays["token_counts"] = outputs.token_counts
    arrays["metadata"] = np.array(json.dumps(dict(outputs.metadata)))
    with path.open("wb") as f:
        np.savez(f, **arrays)


def load_proxy_outputs(path: str | pathlib.Path) -> ProxyOutputs:
    """Reads a file written by `save_proxy_outputs`."""
    with np.load(path, allow_pickle=False) as data:
        return ProxyOutputs(
            kind=str(data["kind"]),
            matrix=data["matrix"],
            token_counts=data.get("token_counts"),
            metadata=json.loads(str(data["metadata"])),
        )
