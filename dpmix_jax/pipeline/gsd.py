"""GSD source selection (Gu et al.): score each public source by the gradient subspace distance
between its per-example gradients and the sensitive data's, and select the closest one.

Gradients are those of a single-logit binary model's BCE loss against each set's labels; the
distance is `mixing.gradient_subspace_distance` between the top-`dim` subspaces. This is the
baseline's non-private form: the sensitive subspace (and so the ranking and the selected source)
is a deterministic function of the sensitive examples, with no DP guarantee. Gu et al. propose a
private variant (a DP top-k subspace) that is not implemented here.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import numpy as np
import optax
from flax import nnx
from jax.flatten_util import ravel_pytree

from dpmix_jax.mixing import projection_distance, top_subspace


@functools.partial(jax.jit, static_argnums=0)
def _flat_grads(graphdef: nnx.GraphDef, params, rest, inputs, labels) -> jax.Array:
    def example_loss(params, x, y):
        logit = nnx.merge(graphdef, params, rest)(x[None]).reshape(())
        return optax.sigmoid_binary_cross_entropy(logit, y)

    grads = jax.vmap(jax.grad(example_loss), in_axes=(None, 0, 0))(params, inputs, labels)
    return jax.vmap(lambda g: ravel_pytree(g)[0])(grads)


def per_example_gradients(
    model: nnx.Module,
    inputs: np.ndarray,
    labels: np.ndarray,
    *,
    head_only: bool = False,
    batch_size: int = 128,
) -> np.ndarray:
    """`(n, p)` flattened gradients of each example's BCE loss.

    Args:
        model: maps a batch of inputs to one logit per row.
        inputs: `(n, ...)` model inputs.
        labels: `(n,)` binary (or soft) targets in [0, 1].
        head_only: gradients of the parameters under `model.head` only (Gu et al. train only
            the last layer of a large network); False: every `nnx.Param`.
        batch_size: rows per vectorised call.

    Raises:
        ValueError: if `inputs` and `labels` disagree in length or `labels` is outside [0, 1].

    Privacy: not private; on sensitive rows the result is sensitive data.
    """
    labels = np.asarray(labels, np.float32).reshape(-1)
    if len(inputs) != len(labels) or len(labels) == 0:
        raise ValueError(f"need equally many inputs and labels, got {len(inputs)}, {len(labels)}.")
    if not np.all((labels >= 0) & (labels <= 1)):
        raise ValueError("labels must lie in [0, 1].")
    wanted = nnx.All(nnx.Param, nnx.PathContains("head")) if head_only else nnx.Param
    graphdef, params, rest = nnx.split(model, wanted, ...)
    chunks = [
        _flat_grads(graphdef, params, rest, inputs[s : s + batch_size], labels[s : s + batch_size])
        for s in range(0, len(labels), batch_size)
    ]
    return np.concatenate([np.asarray(c) for c in chunks])


@dataclasses.dataclass(frozen=True, kw_only=True)
class GsdSelection:
    """GSD's scores and choice.

    Attributes:
        distances: source name -> GSD to the sensitive gradients (in [0, 1], lower = closer).
        selected: the source with the smallest distance.
        dim: the subspace dimension d.
        private: always False: the selection reads the sensitive data without DP.
    """

    distances: Mapping[str, float]
    selected: str
    dim: int
    private: bool = False


def select_source(
    model: nnx.Module,
    sources: Mapping[str, tuple[np.ndarray, np.ndarray]],
    sensitive: tuple[np.ndarray, np.ndarray],
    *,
    dim: int,
    head_only: bool = False,
) -> GsdSelection:
    """Scores every source by GSD to the sensitive set and selects the closest.

    Args:
        model: the single-logit model whose gradients are compared.
        sources: name -> (inputs, labels) of each public source.
        sensitive: (inputs, labels) of the sensitive examples.
        dim: d, the subspace dimension (at most the smallest set's size).
        head_only: compare gradients of the last layer only (see `per_example_gradients`).

    Raises:
        ValueError: if `sources` is empty, or on invalid arrays or `dim`.

    Privacy: NOT private. The sensitive top-d subspace, the distances and the selected name
    are deterministic functions of the sensitive examples; report them as non-private.
    """
    if not sources:
        raise ValueError("sources must name at least one public source.")
    private_basis = top_subspace(per_example_gradients(model, *sensitive, head_only=head_only), dim)
    distances = {
        name: projection_distance(
            top_subspace(per_example_gradients(model, inputs, labels, head_only=head_only), dim),
            private_basis,
        )
        for name, (inputs, labels) in sources.items()
    }
    return GsdSelection(distances=distances, selected=min(distances, key=distances.get), dim=dim)
