"""Every product inside a norm bound, a Gram form or a clipped sum asks for full precision.

The rounding bounds of `privacy.clipping`, `privacy.ghost` and `privacy.summation` assume IEEE
float32 (and float64) arithmetic; at the default precision TPUs multiply in bfloat16 passes and
GPUs in TF32, far coarser. Each clipped-sum path is traced with a model whose own products ask
for HIGHEST too, so that every `dot_general` and convolution left in the jaxpr (forward,
backward and the clipping machinery) must say HIGHEST.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.privacy import clipping
from dpmix_jax.privacy.ghost import ghost_clipped_grad_sum, ghost_user_clipped_grad_sum

HIGHEST = jax.lax.Precision.HIGHEST
_PRODUCTS = ("dot_general", "conv_general_dilated")


def _matmul(a, b):
    return jnp.matmul(a, b, precision=HIGHEST)


def dense(params, batch, tape):
    y = tape.linear("fc", batch["x"], _matmul(batch["x"], params["w"]), kernel="w", bias="b")
    return jnp.sum((y + params["b"]) * batch["v"], axis=tuple(range(1, y.ndim)))


def conv(params, batch, tape):
    dims = ("NHWC", "HWIO", "NHWC")
    y = jax.lax.conv_general_dilated(
        batch["x"], params["k"], (1, 1), "SAME", dimension_numbers=dims, precision=HIGHEST
    )
    y = tape.conv("c", batch["x"], y, kernel="k", kernel_size=(3, 3), strides=(1, 1),
                  padding="SAME")  # fmt: skip
    return jnp.sum(y * batch["v"], axis=(1, 2, 3))


def tied(params, batch, tape):
    table = params["e"]
    h = tape.embedding("emb", batch["ids"], table[batch["ids"]], table="e", vocab_size=5)
    logits = tape.attend("head", h, _matmul(h, table.T), table="e")
    y = tape.scale_shift("ln", logits, logits * params["s"], scale="s", bias=None)
    return jnp.sum(y * batch["w"], axis=(1, 2))


def dense_example(params, example):
    return dense(params, jax.tree.map(lambda x: x[None], example), _Untaped())[0]


class _Untaped:
    def linear(self, name, inputs, outputs, **keys):
        return outputs


def _products(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _PRODUCTS:
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                if hasattr(sub, "jaxpr") and hasattr(sub, "consts"):
                    yield from _products(sub.jaxpr)
                elif hasattr(sub, "eqns"):
                    yield from _products(sub)


def _dense_batch(positions, d_in=4, d_out=3):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, positions, d_in)).astype(np.float32)
    v = rng.standard_normal((8, positions, d_out)).astype(np.float32)
    return {"w": jnp.zeros((d_in, d_out)), "b": jnp.zeros(d_out)}, {"x": x, "v": v}


def _case(name):
    mask = np.ones(8, bool)
    if name == "vmap":
        params, batch = _dense_batch(2)
        grad_sum = clipping.clipped_grad_sum(dense_example, clip_norm=1.0)
    elif name == "microbatch":
        params, batch = _dense_batch(2)
        grad_sum = clipping.clipped_grad_sum(dense_example, clip_norm=1.0, microbatch_size=4)
    elif name == "user vmap":
        params, batch = _dense_batch(2)
        batch = jax.tree.map(lambda x: x.reshape(4, 2, *x.shape[1:]), batch)
        grad_sum, mask = clipping.user_clipped_grad_sum(dense_example, clip_norm=1.0), mask[:8]
        mask = np.ones((4, 2), bool)
    elif name == "ghost gram":  # T·(d_in + d_out) <= d_in·d_out
        params, batch = _dense_batch(2, 8, 8)
        grad_sum = ghost_clipped_grad_sum(dense, clip_norm=1.0)
    elif name == "ghost per-example":
        params, batch = _dense_batch(16)
        grad_sum = ghost_clipped_grad_sum(dense, clip_norm=1.0)
    elif name == "ghost user":
        params, batch = _dense_batch(2, 8, 8)
        batch = jax.tree.map(lambda x: x.reshape(4, 2, *x.shape[1:]), batch)
        grad_sum, mask = ghost_user_clipped_grad_sum(dense, clip_norm=1.0), np.ones((4, 2), bool)
    elif name == "ghost conv":
        rng = np.random.default_rng(1)
        params = {"k": jnp.zeros((3, 3, 4, 4))}
        batch = {"x": rng.standard_normal((8, 5, 5, 4)), "v": rng.standard_normal((8, 5, 5, 4))}
        grad_sum = ghost_clipped_grad_sum(conv, clip_norm=1.0)
    else:  # ghost tied embedding, head and a normalisation scale
        rng = np.random.default_rng(2)
        params = {"e": jnp.zeros((5, 8)), "s": jnp.ones(5)}
        batch = {"ids": rng.integers(0, 5, (8, 3)), "w": rng.standard_normal((8, 3, 5))}
        grad_sum = ghost_clipped_grad_sum(tied, clip_norm=1.0)
    return grad_sum, params, batch, mask


@pytest.mark.parametrize(
    "path",
    [
        "vmap", "microbatch", "user vmap", "ghost gram", "ghost per-example", "ghost user",
        "ghost conv", "ghost tied",
    ],
)  # fmt: skip
def test_every_product_of_a_clipped_sum_path_asks_for_highest_precision(path):
    grad_sum, params, batch, mask = _case(path)
    jaxpr = jax.make_jaxpr(grad_sum.function)(params, batch, mask).jaxpr
    products = list(_products(jaxpr))
    assert products, "the traced path holds no product to check"
    coarse = [
        (eqn.primitive.name, eqn.params.get("precision"))
        for eqn in products
        if eqn.params.get("precision") not in ((HIGHEST, HIGHEST), HIGHEST)
    ]
    assert not coarse, coarse
