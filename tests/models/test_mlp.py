"""The MLP of the CPU presets: shapes, per-example gradients, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.models.mlp import MLP, MLPConfig


def test_forward_shape_and_per_example_gradients_match_a_loop():
    model = MLP(MLPConfig(in_features=4 * 4 * 1, hidden=(8, 6)), 3, rngs=nnx.Rngs(0))
    images = jax.random.normal(jax.random.key(1), (5, 4, 4, 1))
    assert model(images).shape == (5, 3)
    graphdef, params = nnx.split(model)

    def loss(p, x):
        return jnp.sum(nnx.merge(graphdef, p)(x[None]) ** 2)

    batched = jax.vmap(jax.grad(loss), in_axes=(None, 0))(params, images)
    for i in range(5):
        single = jax.grad(loss)(params, images[i])
        for a, b in zip(jax.tree.leaves(batched), jax.tree.leaves(single), strict=True):
            np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError, match="in_features"):
        MLPConfig(in_features=0)
    with pytest.raises(ValueError, match="hidden"):
        MLPConfig(in_features=4, hidden=())
    model = MLP(MLPConfig(in_features=16), 1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="16 values"):
        model(jnp.ones((2, 3, 3, 1)))
    with pytest.raises(ValueError, match="num_outputs"):
        MLP(MLPConfig(in_features=16), 0, rngs=nnx.Rngs(0))
