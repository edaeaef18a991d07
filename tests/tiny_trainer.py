"""A tiny classifier and data set for `Trainer` tests: 4 inputs, 8 hidden units, 3 classes."""

import jax
import numpy as np
from flax import nnx

from dpmix_jax.train import engine


class TinyMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def tiny_data(num_examples: int, *, num_users: int | None = None) -> engine.IndexedData:
    """Gaussian inputs and uniform labels from seed 0 (users drawn after them when asked);
    `data.gather` returns zero-filled rows at padding (-1)."""
    rs = np.random.default_rng(0)
    inputs = rs.normal(size=(num_examples, 4)).astype(np.float32)
    labels = rs.integers(0, 3, size=num_examples)
    users = None if num_users is None else rs.integers(0, num_users, size=num_examples)

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {"inputs": inputs[rows] * keep[:, None], "label": labels[rows] * keep}

    return engine.IndexedData(gather=gather, num_examples=num_examples, user_ids=users)
