"""Clipped gradient sums against a naive per-example Python loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.privacy import accounting, clipping


def init_mlp(key, sizes=(5, 8, 3)):
    keys = jax.random.split(key, len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params, example):
    h = example["x"]
    for layer in params[:-1]:
        h = jnp.tanh(h @ layer["w"] + layer["b"])
    logits = h @ params[-1]["w"] + params[-1]["b"]
    return -jax.nn.log_softmax(logits)[example["y"]]


def make_batch(key, n=12):
    kx, ky = jax.random.split(key)
    return {"x": 3.0 * jax.random.normal(kx, (n, 5)), "y": jax.random.randint(ky, (n,), 0, 3)}


def naive_clipped_sum(params, batch, mask, clip_norm):
    total = jax.tree.map(jnp.zeros_like, params)
    for i in range(len(mask)):
        if not mask[i]:
            continue
        grad = jax.grad(mlp_loss)(params, jax.tree.map(lambda x, i=i: x[i], batch))
        norm = float(np.sqrt(sum(float(jnp.sum(g**2)) for g in jax.tree.leaves(grad))))
        scale = min(1.0, clip_norm / norm)
        total = jax.tree.map(lambda t, g, s=scale: t + s * g, total, grad)
    return total


def assert_trees_close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **tol)


@pytest.fixture
def problem():
    params = init_mlp(jax.random.key(0))
    batch = make_batch(jax.random.key(1))
    mask = np.array([True] * 9 + [False] * 3)
    return params, batch, mask


def test_matches_naive_loop_and_every_norm_is_bounded(problem):
    params, batch, mask = problem
    clip = 0.5
    grad_sum = clipping.clipped_grad_sum(mlp_loss, clip_norm=clip)
    total, stats = grad_sum(params, batch, mask)
    assert_trees_close(total, naive_clipped_sum(params, batch, mask, clip), rtol=1e-5, atol=1e-6)
    # The test only means something if some examples were actually clipped.
    assert np.sum(np.asarray(stats["grad_norm"])[mask] > clip) >= 3
    assert stats["loss"].shape == (12,)


def test_each_clipped_gradient_has_norm_at_most_c(problem):
    params, batch, _ = problem
    for i in range(12):
        one = jax.tree.map(lambda x, i=i: x[i : i + 1], batch)
        total, _ = clipping.clipped_grad_sum(mlp_loss, clip_norm=0.3)(params, one, np.ones(1, bool))
        assert float(clipping.global_norm(total)) <= 0.3 * (1 + 1e-5)


@pytest.mark.parametrize("microbatch_size", [1, 2, 3, 4, 6])
def test_result_does_not_depend_on_microbatch_size(problem, microbatch_size):
    params, batch, mask = problem
    full, full_stats = clipping.clipped_grad_sum(mlp_loss, clip_norm=0.5)(params, batch, mask)
    chunked, stats = clipping.clipped_grad_sum(
        mlp_loss, clip_norm=0.5, microbatch_size=microbatch_size
    )(params, batch, mask)
    assert_trees_close(full, chunked, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(full_stats["grad_norm"], stats["grad_norm"], rtol=1e-6)


def test_microbatch_size_must_divide_the_padded_batch(problem):
    params, batch, mask = problem
    with pytest.raises(ValueError, match="multiple of microbatch_size"):
        clipping.clipped_grad_sum(mlp_loss, clip_norm=1.0, microbatch_size=5)(params, batch, mask)


def test_padding_rows_contribute_exactly_zero(problem):
    params, batch, mask = problem
    grad_sum = clipping.clipped_grad_sum(mlp_loss, clip_norm=0.5)
    garbage = jax.tree.map(lambda x: x.at[9:].set(x[9:] * 1000 + 7), batch)
    a, _ = grad_sum(params, batch, mask)
    b, _ = grad_sum(params, garbage, mask)
    assert_trees_close(a, b, rtol=0, atol=0)
    nothing, _ = grad_sum(params, batch, np.zeros(12, bool))
    assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(nothing))


def test_non_finite_gradients_are_zeroed(problem):
    params, batch, mask = problem
    poisoned = {"x": batch["x"].at[0, 0].set(jnp.nan), "y": batch["y"]}
    grad_sum = clipping.clipped_grad_sum(mlp_loss, clip_norm=0.5)
    total, stats = grad_sum(params, poisoned, mask)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(total))
    without_first = mask.copy()
    without_first[0] = False
    expected, _ = grad_sum(params, batch, without_first)
    assert_trees_close(total, expected, rtol=1e-6, atol=1e-7)
    assert not np.isfinite(float(stats["grad_norm"][0]))


def test_keep_batch_dim_passes_a_leading_axis_of_one(problem):
    params, batch, mask = problem
    batched_loss = lambda p, ex: jnp.mean(jax.vmap(mlp_loss, in_axes=(None, 0))(p, ex))
    kept, _ = clipping.clipped_grad_sum(batched_loss, clip_norm=0.5, keep_batch_dim=True)(
        params, batch, mask
    )
    dropped, _ = clipping.clipped_grad_sum(mlp_loss, clip_norm=0.5)(params, batch, mask)
    assert_trees_close(kept, dropped, rtol=1e-5, atol=1e-6)


def test_user_level_averages_then_clips_like_a_naive_loop():
    params = init_mlp(jax.random.key(0))
    users, per_user = 5, 4
    flat = make_batch(jax.random.key(3), users * per_user)
    batch = jax.tree.map(lambda x: x.reshape(users, per_user, *x.shape[1:]), flat)
    mask = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 1, 0, 0]], bool)
    clip = 0.2
    total, stats = clipping.user_clipped_grad_sum(mlp_loss, clip_norm=clip)(params, batch, mask)

    expected = jax.tree.map(jnp.zeros_like, params)
    for u in range(users):
        rows = np.flatnonzero(mask[u])
        if len(rows) == 0:
            continue
        grads = [
            jax.grad(mlp_loss)(params, jax.tree.map(lambda x, u=u, r=r: x[u, r], batch))
            for r in rows
        ]
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        scale = min(1.0, clip / float(clipping.global_norm(mean)))
        expected = jax.tree.map(lambda e, g, s=scale: e + s * g, expected, mean)
    assert_trees_close(total, expected, rtol=1e-5, atol=1e-6)
    assert stats["grad_norm"].shape == (users,)
    chunked, _ = clipping.user_clipped_grad_sum(mlp_loss, clip_norm=clip, microbatch_size=1)(
        params, batch, mask
    )
    assert_trees_close(total, chunked, rtol=1e-5, atol=1e-6)


def test_sensitivity_follows_the_neighbouring_relation():
    grad_sum = clipping.clipped_grad_sum(mlp_loss, clip_norm=1.5)
    assert grad_sum.sensitivity() == 1.5
    assert grad_sum.sensitivity(accounting.NeighboringRelation.REPLACE_ONE) == 3.0


@pytest.mark.parametrize("clip_norm", [0.0, -1.0, float("nan"), float("inf")])
def test_bad_clip_norm_is_rejected(clip_norm):
    with pytest.raises(ValueError, match="clip_norm"):
        clipping.clipped_grad_sum(mlp_loss, clip_norm=clip_norm)
    with pytest.raises(ValueError, match="clip_norm"):
        clipping.user_clipped_grad_sum(mlp_loss, clip_norm=clip_norm)


def test_mismatched_mask_and_batch_are_rejected(problem):
    params, batch, _ = problem
    with pytest.raises(ValueError, match="leading axis"):
        clipping.clipped_grad_sum(mlp_loss, clip_norm=1.0)(params, batch, np.ones(5, bool))


def _random_tree(rng, dtype, scale):
    shapes = {"a": (37,), "b": (5, 7), "c": (3, 2, 5)}
    return {k: jnp.asarray(scale * rng.standard_normal(s), dtype=dtype) for k, s in shapes.items()}


def _float64_norm(tree):
    return np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_clipped_unit_stays_within_c_in_its_own_dtype(dtype):
    # Round-to-nearest casts of the scaled leaves used to give norms up to 1.0032·C in bfloat16.
    rng = np.random.default_rng(0)
    clip_fn = jax.jit(clipping.clip_to_norm)
    worst = 0.0
    for trial in range(120):
        clip = float(rng.choice([1.0, 0.37, 13.0, 1e-3]))
        scale = clip * float(10.0 ** rng.uniform(-1.5, 2.0))
        tree = _random_tree(rng, dtype, scale)
        clipped, norm = clip_fn(tree, clip, jnp.array(True))
        assert all(leaf.dtype == dtype for leaf in jax.tree.leaves(clipped))
        ratio = _float64_norm(clipped) / clip
        worst = max(worst, ratio)
        assert ratio <= 1.0, (trial, ratio)
        if float(norm) > clip:  # clipped units lose the slack, the bound's margin and the cast
            assert ratio >= 1.0 - 2.0**-20 - 1e-5 - 2 * float(jnp.finfo(dtype).eps)
    assert worst > 0.99  # the check was reached by units clipped to about C


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_low_precision_clipped_sum_of_one_unit_stays_within_c(dtype):
    def loss(w, example):
        return jnp.sum((example["x"] * w).astype(jnp.float32) ** 2)

    grad_sum = clipping.clipped_grad_sum(loss, clip_norm=1.0)
    rng = np.random.default_rng(1)
    for _ in range(20):
        w = jnp.asarray(rng.standard_normal(64), dtype)
        batch = {"x": jnp.asarray(rng.uniform(1, 5, size=(1, 64)), dtype)}
        total, _ = grad_sum(w, batch, np.ones(1, bool))
        assert total.dtype == jnp.float32  # the sum is never taken in the parameters' dtype
        assert _float64_norm(total) <= 1.0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_user_clipped_gradient_stays_within_c_in_low_precision(dtype):
    def loss(w, example):
        return jnp.sum((example["x"] * w).astype(jnp.float32) ** 2)

    grad_sum = clipping.user_clipped_grad_sum(loss, clip_norm=0.5)
    rng = np.random.default_rng(2)
    for _ in range(20):
        w = jnp.asarray(rng.standard_normal(48), dtype)
        batch = {"x": jnp.asarray(rng.uniform(1, 5, size=(1, 3, 48)), dtype)}
        total, _ = grad_sum(w, batch, np.ones((1, 3), bool))
        assert _float64_norm(total) <= 0.5
