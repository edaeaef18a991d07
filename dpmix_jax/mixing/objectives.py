"""MixMin objectives over cached proxy outputs: F(λ) = mean_j Loss_j(λ) for λ on the simplex.

The mixture stage reads only a matrix of proxy outputs on the sensitive split (`(n, k)`, one
column per public source), in one of three kinds:

- `"nll"`: P[j, i] = p_i(y_j | x_j) in [0, 1], the probability proxy i gives to the observed label;
  Loss_j = -log Σ_i λ_i P[j, i]. The mixture probability is floored at `NLL_FLOOR` before the log,
  so an example that every source gives probability 0 costs -log(NLL_FLOOR) ≈ 69 (and has zero
  gradient) instead of an infinite loss.
- `"sequence"`: L[j, i] = log p_i(x_j), the total log-probability of sequence j under proxy i, with
  T_j tokens; Loss_j = -(1/T_j) · log Σ_i λ_i exp(L[j, i]), computed as a weighted logsumexp (no
  overflow or underflow for very negative log-probabilities, finite gradients at λ_i = 0).
- `"mse"`: P[j, i] = f_i(x_j) real predictions with targets y_j; Loss_j = (Σ_i λ_i P[j, i] - y_j)².

`prepare_examples` validates the host arrays and packs them into one pytree with a fixed structure
(`preds`, `target`, `length`; unused fields are filled with constants), so that every kind runs
through the same jitted, vmapped code. `example_loss` is the per-example loss that the solvers
differentiate; `mixmin_loss` is the validated mean loss for users.

Example:
    >>> import numpy as np
    >>> preds = np.array([[0.9, 0.1], [0.2, 0.6]])
    >>> round(float(mixmin_loss(np.array([0.5, 0.5]), preds)), 4)
    0.8047
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Kind = Literal["nll", "sequence", "mse"]
KINDS: tuple[str, ...] = ("nll", "sequence", "mse")

# Floor on Σ_i λ_i P[j, i] for the nll kind (a float32 normal number, far below any real
# probability a proxy reports).
NLL_FLOOR = 1e-30
# Tolerance when checking that host-provided weights lie on the simplex.
SIMPLEX_TOLERANCE = 1e-4
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def check_kind(kind: str) -> str:
    """Returns `kind`, or raises ValueError unless it is one of `KINDS`."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
    return kind


def prepare_examples(
    preds: np.ndarray,
    *,
    kind: Kind = "nll",
    targets: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
) -> dict[str, jax.Array]:
    """Validates proxy outputs and packs them as `{"preds", "target", "length"}` arrays.

    Args:
        preds: `(n, k)` proxy outputs with k >= 2 sources (see the module docstring per kind).
        kind: "nll", "sequence" or "mse".
        targets: `(n,)` real targets, required for "mse" (and only allowed there).
        lengths: `(n,)` token counts T_j > 0, required for "sequence" (and only allowed there).

    Returns:
        float32 device arrays; `target` is 0 and `length` is 1 where the kind does not use them.

    Raises:
        ValueError: on a wrong shape, k < 2, no examples, non-finite values, values that overflow
            float32, an all-zero matrix, probabilities outside [0, 1] (nll), positive
            log-probabilities (sequence), or missing/extra targets/lengths.

    Warns:
        UserWarning: when some rows (examples, except for mse) are all 0, or, with more than one
            example, some columns (sources).

    Privacy: the arrays are the sensitive input of the mixture stage; this function only checks
    them; its errors and warnings are for the data holder and are not part of any release.
    """
    kind = check_kind(kind)
    preds = np.asarray(preds, dtype=np.float64)
    if preds.ndim != 2:
        raise ValueError(f"preds must be a 2-D (examples, sources) array, got shape {preds.shape}.")
    n, k = preds.shape
    if n < 1:
        raise ValueError("preds has no examples (n = 0).")
    if k < 2:
        raise ValueError(f"preds needs at least 2 sources (columns) to mix, got k = {k}.")
    if not np.all(np.isfinite(preds)):
        raise ValueError("preds contains non-finite values (NaN or inf).")
    if kind == "nll" and (np.any(preds < 0) or np.any(preds > 1)):
        raise ValueError(
            "nll preds must be probabilities in [0, 1]; found values "
            f"in [{preds.min():.3g}, {preds.max():.3g}]."
        )
    if kind == "sequence" and np.any(preds > 0):
        raise ValueError("sequence preds are total log-probabilities and must be <= 0.")

    target = _optional_vector(targets, "targets", n, needed=kind == "mse", kind=kind)
    length = _optional_vector(lengths, "lengths", n, needed=kind == "sequence", kind=kind)
    if length is not None and np.any(length <= 0):
        raise ValueError("lengths must be > 0 (token counts).")
    _check_magnitude(preds, target, kind)
    _check_zeros(preds, kind)
    return {
        "preds": jnp.asarray(preds, jnp.float32),
        "target": jnp.asarray(np.zeros(n) if target is None else target, jnp.float32),
        "length": jnp.asarray(np.ones(n) if length is None else length, jnp.float32),
    }


def _check_magnitude(preds: np.ndarray, target: np.ndarray | None, kind: str) -> None:
    """Losses and gradients are float32 on the device: refuse values that overflow there."""
    if np.max(np.abs(preds)) > _FLOAT32_MAX:
        raise ValueError(
            f"{kind} preds exceed the float32 range (|value| > {_FLOAT32_MAX:.3g}) and would "
            "become inf on the device; rescale the proxy outputs."
        )
    if kind == "mse":
        # |∇ Loss_j| <= 2·(max|P| + max|y|)·max|P|·√k and Loss_j <= (max|P| + max|y|)².
        scale = np.max(np.abs(preds)) + np.max(np.abs(target))
        if 2.0 * scale * scale * np.sqrt(preds.shape[1]) > _FLOAT32_MAX:
            raise ValueError(
                "mse preds and targets are so large that squared errors and their gradients "
                "overflow float32 (every gradient would be zeroed and λ would follow the noise "
                "alone); rescale them, e.g. standardise the targets."
            )


def _check_zeros(preds: np.ndarray, kind: str) -> None:
    """All-zero proxy outputs carry no signal about λ: an error for the whole matrix, a warning
    for rows (examples) and columns (sources)."""
    zero = preds == 0
    if zero.all():
        meaning = {
            "nll": "every source gives probability 0 to every label, so the loss is infinite "
            "(floored) and has no gradient",
            "sequence": "every source gives probability 1 to every sequence, so the loss is 0 "
            "for every λ",
            "mse": "every source predicts 0, so the loss is the same for every λ",
        }[kind]
        raise ValueError(
            f"every {kind} pred is 0: {meaning}; λ would come from the noise alone. Check that "
            "the proxy outputs were computed (and cached) correctly."
        )
    zero_columns = np.flatnonzero(zero.all(axis=0))
    if len(zero_columns) and len(preds) > 1:  # (one example: a 0 entry is no pattern)
        warnings.warn(
            f"proxy output column(s) {zero_columns.tolist()} (source(s)) are all 0 for {kind!r}; "
            "check that those proxies were computed correctly.",
            stacklevel=3,
        )
    zero_rows = int(zero.all(axis=1).sum())
    if zero_rows and kind != "mse":
        effect = (
            "probability 0 under every source: they add no gradient"
            if kind == "nll"
            else "log-probability 0 (probability 1) under every source"
        )
        warnings.warn(
            f"{zero_rows} of {len(preds)} examples have {effect}; check the proxy outputs.",
            stacklevel=3,
        )


def _optional_vector(
    values: np.ndarray | None, name: str, n: int, *, needed: bool, kind: str
) -> np.ndarray | None:
    if values is None:
        if needed:
            raise ValueError(f"kind={kind!r} needs {name} (one per example).")
        return None
    if not needed:
        raise ValueError(f"kind={kind!r} does not use {name}; pass None.")
    values = np.asarray(values, dtype=np.float64)
    if values.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {values.shape}.")
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{name} contains non-finite values.")
    return values


def check_weights(weights: np.ndarray, num_sources: int) -> jax.Array:
    """Returns `weights` as a float32 array, or raises ValueError unless it is on the simplex Δ_k.

    Weights must have shape `(num_sources,)`, be finite and >= 0, and sum to 1 within
    `SIMPLEX_TOLERANCE`.
    """
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (num_sources,):
        raise ValueError(
            f"weights must have shape ({num_sources},) (one per source), got {weights.shape}."
        )
    if not np.all(np.isfinite(weights)) or np.any(weights < 0):
        raise ValueError("weights must be finite and >= 0.")
    if abs(weights.sum() - 1.0) > SIMPLEX_TOLERANCE:
        raise ValueError(f"weights must sum to 1 (the simplex), got sum {weights.sum():.6g}.")
    return jnp.asarray(weights, jnp.float32)


def example_loss(weights: jax.Array, example: dict[str, jax.Array], *, kind: Kind) -> jax.Array:
    """Loss_j(λ) of one example (a row of `prepare_examples`' output), for any λ in the simplex.

    Pure and traceable: the solvers differentiate and vmap it. No validation happens here.
    """
    p = example["preds"]
    if kind == "nll":
        return -jnp.log(jnp.maximum(jnp.dot(p, weights), NLL_FLOOR))
    if kind == "sequence":
        return -jax.nn.logsumexp(p, b=weights) / example["length"]
    if kind == "mse":
        return jnp.square(jnp.dot(p, weights) - example["target"])
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")


@functools.partial(jax.jit, static_argnames="kind")
def per_example_losses(
    weights: jax.Array, examples: dict[str, jax.Array], *, kind: Kind
) -> jax.Array:
    """`(n,)` losses Loss_j(λ) of packed examples (see `prepare_examples`)."""
    return jax.vmap(functools.partial(example_loss, kind=kind), in_axes=(None, 0))(
        weights, examples
    )


@functools.partial(jax.jit, static_argnames="kind")
def mean_loss(weights: jax.Array, examples: dict[str, jax.Array], *, kind: Kind) -> jax.Array:
    """F(λ) = mean_j Loss_j(λ) of packed examples (jitted, no validation)."""
    return jnp.mean(per_example_losses(weights, examples, kind=kind))


@functools.partial(jax.jit, static_argnames="kind")
def per_example_grads(
    weights: jax.Array, examples: dict[str, jax.Array], *, kind: Kind
) -> jax.Array:
    """`(n, k)` per-example gradients ∇_λ Loss_j(λ) of packed examples."""
    grad = jax.grad(functools.partial(example_loss, kind=kind))
    return jax.vmap(grad, in_axes=(None, 0))(weights, examples)


def mixmin_loss(
    weights: np.ndarray,
    preds: np.ndarray,
    *,
    kind: Kind = "nll",
    targets: np.ndarray | None = None,
    lengths: np.ndarray | None = None,
) -> jax.Array:
    """The MixMin objective F(λ) = mean_j Loss_j(λ), with validated inputs.

    Args:
        weights: λ, shape `(k,)`, on the simplex.
        preds, kind, targets, lengths: the proxy outputs (see `prepare_examples`).

    Returns:
        A scalar float32 array.

    Privacy: not private; F on the sensitive split is for evaluation only (it is a metric of
    the released λ, not part of the mechanism).
    """
    examples = prepare_examples(preds, kind=kind, targets=targets, lengths=lengths)
    weights = check_weights(weights, examples["preds"].shape[1])
    return mean_loss(weights, examples, kind=kind)
