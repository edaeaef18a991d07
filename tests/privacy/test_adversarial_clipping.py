"""Adversarial inputs against every clipped-sum path: no unit may move the sum by more than C.

For each path (vmap, microbatched, user level, mesh axis; ghost dense in Gram and per-example
form, convolution, embedding, tied embedding, normalisation layers, user level; the Trainer's
default path with a frozen layer) and each parameter dtype, two properties are checked on
targeted constructions (positions whose gradients nearly cancel, huge and tiny norms, inf/nan
entries, subnormals) and on a property-based search around them:

- a unit alone adds at most C to the sum;
- removing any one unit moves the computed float32 sum by at most C, its rounding included (the
  sums are accumulated in float64 and each unit is clipped to the C' of
  `summation.effective_clip_norm`), also with 262,144 aligned units.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmix_jax.privacy import clipping, ghost, loose_units
from dpmix_jax.privacy.ghost import Tape, ghost_clipped_grad_sum, ghost_user_clipped_grad_sum
from dpmix_jax.train import TrainConfig, engine

CLIP = 1.0
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
SEARCH = settings(max_examples=12, deadline=None, derandomize=True)


def _norm64(tree) -> float:
    squares = (np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree))
    return float(np.sqrt(sum(squares)))


def _diff64(a, b) -> float:
    return _norm64(jax.tree.map(lambda x, y: np.asarray(x, np.float64) - np.asarray(y), a, b))


def assert_sound(fn, params, batch, mask):
    """Every kept unit alone adds <= C; removing it moves the (float32) sum by <= C."""
    mask = np.asarray(mask, bool)
    total, _ = fn(params, batch, mask)
    for leaf in jax.tree.leaves(total):
        assert jnp.promote_types(leaf.dtype, jnp.float32) == leaf.dtype  # never a narrow sum
    units = mask.reshape(len(mask), -1).any(axis=1)
    for j in np.flatnonzero(units):
        alone_mask = np.zeros_like(mask)
        alone_mask[j] = mask[j]
        alone = _norm64(fn(params, batch, alone_mask)[0]) / CLIP
        without_mask = mask.copy()
        without_mask[j] = False
        removed = _diff64(total, fn(params, batch, without_mask)[0]) / CLIP
        assert alone <= 1.0, (j, alone)
        assert removed <= 1.0, (j, removed)


def cancelling(rng, units, positions, d_in, d_out, scale=1e3, close=1e-4, residue=0.3, ratio=1.0):
    """Inputs x and output gradients v of a dense layer whose positions nearly cancel.

    Position pairs (2i, 2i+1) have inputs x_{2i+1} within `close` of `ratio`·x_{2i} and output
    gradients v_{2i+1} equal to -v_{2i} / `ratio` up to `residue`: each position's outer product
    has norm about `scale`·||x||, the example's gradient Σ_t x_t ⊗ v_t only about
    `residue`·||x||·sqrt(d_out).
    """
    x = rng.standard_normal((units, positions, d_in))
    v = scale * rng.standard_normal((units, positions, d_out))
    x[:, 1::2] = ratio * x[:, 0::2] + close * rng.standard_normal(x[:, 1::2].shape)
    v[:, 1::2] = -v[:, 0::2] / ratio + residue * rng.standard_normal(v[:, 1::2].shape)
    return x.astype(np.float32), v.astype(np.float32)


def _exact_norms(x, v):
    g = np.einsum("bti,btj->bij", x.astype(np.float64), v.astype(np.float64))
    return np.sqrt(np.sum(g**2, axis=(1, 2)))


def dense_taped(params, batch, tape):
    x = batch["x"]
    y = tape.linear("fc", x, x @ params["w"].astype(x.dtype), kernel="w")
    return jnp.sum(y.astype(jnp.float32) * batch["v"], axis=tuple(range(1, y.ndim)))


def dense_example(params, example):
    y = example["x"] @ params["w"].astype(example["x"].dtype)
    return jnp.sum(y.astype(jnp.float32) * example["v"])


_GHOST_DENSE = jax.jit(ghost_clipped_grad_sum(dense_taped, clip_norm=CLIP).function)


# ---------------------------------------------------------------------------------------------
# Ghost: the Gram form must not under-estimate a cancelling example's norm.
# ---------------------------------------------------------------------------------------------


def test_cancelling_positions_are_clipped_by_a_certified_bound():
    # Per-position gradients of norm ~1e4 that cancel to a norm of about 2: the float32 Gram form
    # under-estimated about a quarter of these norms, letting such examples add up to 3.6·C.
    params = {"w": jnp.zeros((8, 8))}
    x, v = cancelling(np.random.default_rng(0), 64, 2, 8, 8)
    _, stats = _GHOST_DENSE(params, {"x": x, "v": v}, np.ones(64, bool))
    assert np.all(np.asarray(stats["grad_norm"], np.float64) >= _exact_norms(x, v))
    batch = {"x": x[:16], "v": v[:16]}
    assert_sound(_GHOST_DENSE, params, batch, np.arange(16) != 3)


def test_ordinary_inputs_get_a_bound_within_1e4_of_the_norm():
    # Utility: the certified bound only costs clipping strength where rounding could matter.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3, 8)).astype(np.float32)
    v = rng.standard_normal((6, 3, 8)).astype(np.float32)
    _, stats = _GHOST_DENSE({"w": jnp.zeros((8, 8))}, {"x": x, "v": v}, np.ones(6, bool))
    ratio = np.asarray(stats["grad_norm"], np.float64) / _exact_norms(x, v)
    assert np.all(ratio >= 1.0) and np.all(ratio <= 1.0 + 1e-4), ratio


@given(
    seed=st.integers(0, 2**16),
    log_scale=st.floats(-30.0, 30.0),
    log_close=st.floats(-7.0, 0.0),
    log_residue=st.floats(-6.0, 1.0),
    ratio=st.sampled_from([1.0, -1.0, 3.0, 0.1]),
)
@SEARCH
def test_search_ghost_dense_gram_form(seed, log_scale, log_close, log_residue, ratio):
    # ratio != 1: the cancelling inputs are not close, so centring them does not help.
    x, v = cancelling(
        np.random.default_rng(seed), 3, 2, 8, 8, scale=10.0**log_scale, close=10.0**log_close,
        residue=10.0**log_residue * 10.0**log_scale, ratio=ratio,
    )  # fmt: skip
    assert_sound(_GHOST_DENSE, {"w": jnp.zeros((8, 8))}, {"x": x, "v": v}, np.ones(3, bool))


def test_ghost_per_example_form_and_special_values():
    # T·(d_in + d_out) > d_in·d_out: the per-example form; plus inf, nan, huge, subnormal rows.
    fn = jax.jit(ghost_clipped_grad_sum(dense_taped, clip_norm=CLIP).function)
    x, v = cancelling(np.random.default_rng(1), 6, 40, 3, 2)
    x[1, 0, 0], x[2, 3, 1] = np.inf, np.nan
    x[3] *= 1e18
    x[4] = np.float32(1e-42)  # subnormal inputs
    v[5] = np.float32(3e-40)
    assert_sound(fn, {"w": jnp.zeros((3, 2))}, {"x": x, "v": v}, np.ones(6, bool))


def conv_taped(params, batch, tape):
    x = batch["x"]
    dims = ("NHWC", "HWIO", "NHWC")
    y = jax.lax.conv_general_dilated(x, params["k"], (1, 1), "VALID", dimension_numbers=dims)
    y = tape.conv("c", x, y, kernel="k", kernel_size=(1, 1), strides=(1, 1), padding="VALID")
    return jnp.sum(y * batch["v"], axis=(1, 2, 3))


def test_cancelling_conv_patches():
    # A 1x1 convolution over two pixels (Gram form of the unfolded patches: 2·(8 + 8) <= 64).
    fn = jax.jit(ghost_clipped_grad_sum(conv_taped, clip_norm=CLIP).function)
    x, v = cancelling(np.random.default_rng(0), 16, 2, 8, 8)
    batch = {"x": x.reshape(16, 1, 2, 8), "v": v.reshape(16, 1, 2, 8)}
    assert_sound(fn, {"k": jnp.zeros((1, 1, 8, 8))}, batch, np.ones(16, bool))


def tied_taped(params, batch, tape):
    table = params["e"]
    h = tape.embedding("emb", batch["ids"], table[batch["ids"]], table="e", vocab_size=5)
    logits = tape.attend("head", batch["q"], batch["q"] @ table.T, table="e")
    return jnp.sum(h * batch["v"], axis=(1, 2)) + jnp.sum(logits * batch["w"], axis=(1, 2))


def embed_taped(params, batch, tape):
    h = tape.embedding("emb", batch["ids"], params["e"][batch["ids"]], table="e", vocab_size=5)
    return jnp.sum(h * batch["v"], axis=(1, 2))


def test_cancelling_embedding_rows():
    # Equal ids whose output gradients nearly cancel: an exact id Gram, a rounded gradient Gram.
    fn = jax.jit(ghost_clipped_grad_sum(embed_taped, clip_norm=CLIP).function)
    _, v = cancelling(np.random.default_rng(3), 16, 4, 8, 8)
    ids = np.tile(
        np.array([[1, 1, 2, 2], [0, 0, 0, 0], [4, 4, 3, 3], [2, 2, 2, 2]], np.int32), (4, 1)
    )
    assert_sound(fn, {"e": jnp.zeros((5, 8))}, {"ids": ids, "v": v}, np.ones(16, bool))


def test_tied_embedding_and_head_that_cancel():
    # The head's gradient on row 1 (Σ_t 1e3·q_t) cancels the embedding's (Σ_t v_t) up to a
    # residue: only the cross terms of the two uses bring the norm down to that residue.
    fn = jax.jit(ghost_clipped_grad_sum(tied_taped, clip_norm=CLIP).function)
    rng = np.random.default_rng(4)
    q = rng.standard_normal((16, 4, 8)).astype(np.float32)
    head = np.zeros((16, 4, 5), np.float32)
    head[:, :, 1] = 1e3
    v = (-1e3 * q + 0.3 * rng.standard_normal(q.shape)).astype(np.float32)
    batch = {"ids": np.ones((16, 4), np.int32), "q": q, "w": head, "v": v}
    assert_sound(fn, {"e": jnp.zeros((5, 8))}, batch, np.ones(16, bool))


def norm_taped(params, batch, tape):
    y = tape.scale_shift("ln", batch["x"], batch["x"] * params["s"] + params["b"], scale="s",
                         bias="b")  # fmt: skip
    return jnp.sum(y * batch["v"], axis=(1, 2))


def test_cancelling_normalisation_layer():
    fn = jax.jit(ghost_clipped_grad_sum(norm_taped, clip_norm=CLIP).function)
    x, v = cancelling(np.random.default_rng(4), 4, 6, 8, 8)
    assert_sound(fn, {"s": jnp.ones(8), "b": jnp.zeros(8)}, {"x": x, "v": v}, np.ones(4, bool))


def test_cancelling_examples_of_one_user():
    # Two examples of a user whose gradients nearly cancel (the old code let a user add 2.15·C).
    fn = jax.jit(ghost_user_clipped_grad_sum(dense_taped, clip_norm=CLIP).function)
    vmap_fn = jax.jit(clipping.user_clipped_grad_sum(dense_example, clip_norm=CLIP).function)
    x, v = cancelling(np.random.default_rng(0), 16, 2, 8, 8)
    batch = {"x": x[:, :, None, :], "v": v[:, :, None, :]}  # (U, G=2, T=1, d)
    mask = np.ones((16, 2), bool)
    mask[5, 1] = False
    assert_sound(fn, {"w": jnp.zeros((8, 8))}, batch, mask)
    assert_sound(vmap_fn, {"w": jnp.zeros((8, 8))}, batch, mask)


# ---------------------------------------------------------------------------------------------
# Ghost: a unit whose certified bound is loose is bounded again in float64.
# ---------------------------------------------------------------------------------------------


def _loose_cases():
    """(taped loss, params, batch, mask, user level) whose Gram bounds are many times the norm:
    ratio != 1, so that centring the inputs does not help."""
    x, v = cancelling(np.random.default_rng(0), 16, 2, 8, 8, ratio=3.0)
    _, big = cancelling(np.random.default_rng(3), 16, 4, 8, 8, scale=1e4)
    ids = np.tile(
        np.array([[1, 1, 2, 2], [0, 0, 0, 0], [4, 4, 3, 3], [2, 2, 2, 2]], np.int32), (4, 1)
    )
    rng = np.random.default_rng(4)
    q = rng.standard_normal((16, 4, 8)).astype(np.float32)
    head = np.zeros((16, 4, 5), np.float32)
    head[:, :, 1] = 1e3
    tied_v = (-1e3 * q + 0.3 * rng.standard_normal(q.shape)).astype(np.float32)
    mask = np.arange(16) != 3
    user_mask = np.ones((16, 2), bool)
    user_mask[5, 1] = False
    return {
        "dense": (dense_taped, {"w": jnp.zeros((8, 8))}, {"x": x, "v": v}, mask, False),
        "conv": (
            conv_taped, {"k": jnp.zeros((1, 1, 8, 8))},
            {"x": x.reshape(16, 1, 2, 8), "v": v.reshape(16, 1, 2, 8)}, mask, False,
        ),
        "embedding": (embed_taped, {"e": jnp.zeros((5, 8))}, {"ids": ids, "v": big}, mask, False),
        "tied": (
            tied_taped, {"e": jnp.zeros((5, 8))},
            {"ids": np.ones((16, 4), np.int32), "q": q, "w": head, "v": tied_v}, mask, False,
        ),
        "user": (
            dense_taped, {"w": jnp.zeros((8, 8))},
            {"x": x[:, :, None, :], "v": v[:, :, None, :]}, user_mask, True,
        ),
    }  # fmt: skip


def _vmap_of(taped, user_level):
    """The vmap path's clipped sum of a taped loss (the tape records nothing there)."""
    example = lambda p, ex: taped(p, jax.tree.map(lambda a: a[None], ex), Tape())[0]
    if user_level:
        return jax.jit(clipping.user_clipped_grad_sum(example, clip_norm=CLIP).function)
    return jax.jit(clipping.clipped_grad_sum(example, clip_norm=CLIP).function)


def _ghost_of(taped, user_level):
    ghost_sum = ghost_user_clipped_grad_sum if user_level else ghost_clipped_grad_sum
    return jax.jit(ghost_sum(taped, clip_norm=CLIP).function)


@pytest.mark.parametrize("case", ["dense", "conv", "embedding", "tied", "user"])
def test_loose_units_are_sound(case):
    # Every unit but the padded one is loose and bounded again; whether a unit is depends on its
    # own data only, so that removing one unit changes no other unit's clipping.
    taped, params, batch, mask, user_level = _loose_cases()[case]
    assert_sound(_ghost_of(taped, user_level), params, batch, mask)


@pytest.mark.parametrize("block", [None, 16])
@pytest.mark.parametrize("case", ["dense", "conv", "embedding", "tied", "user"])
def test_loose_units_add_what_the_vmap_path_adds(case, block, monkeypatch):
    # Cancelling units whose float32 Gram bound is many times their norm add far less than C
    # when clipped by it; bounded again in float64, each adds what the vmap path adds (C, or its
    # whole gradient when that is shorter). With 16 entries per block, their gradients are formed
    # in 2-4 blocks, the last overlapping the one before it.
    if block is not None:
        monkeypatch.setattr(loose_units, "BLOCK_ELEMENTS", block)
    taped, params, batch, mask, user_level = _loose_cases()[case]

    def contributions(fn):
        alone = [np.where(np.arange(16) == j, mask.T, False).T for j in range(0, 16, 3)]
        return np.array([_norm64(fn(params, batch, m)[0]) for m in alone])

    want = contributions(_vmap_of(taped, user_level))
    got = contributions(_ghost_of(taped, user_level))
    np.testing.assert_allclose(got, want, rtol=0.01)
    monkeypatch.setattr(ghost, "_LOOSE", float("inf"))  # the float32 bound alone
    loose = contributions(_ghost_of(taped, user_level))
    assert np.all(loose[want > 0] < 0.6 * want[want > 0])


def test_gpt2_sized_cancelling_units_add_what_the_vmap_path_adds(monkeypatch):
    # A GPT-2 MLP layer (768 x 3072, T = 384) whose positions cancel by a factor of about 10⁴:
    # the float32 bound alone lets each unit add about 0.02-0.07 C; bounded again, it adds C,
    # as the vmap path does (which clips by its own certified bound, within 3e-4 of C).
    x, v = cancelling(np.random.default_rng(0), 2, 384, 768, 3072, scale=30.0, ratio=3.0,
                      residue=0.05)  # fmt: skip
    params, batch = {"w": jnp.zeros((768, 3072))}, {"x": x, "v": v}

    def contributions(fn):
        return np.array([_norm64(fn(params, batch, np.arange(2) == j)[0]) for j in range(2)])

    want = contributions(_vmap_of(dense_taped, False))
    np.testing.assert_allclose(contributions(_ghost_of(dense_taped, False)), want, rtol=1e-3)
    monkeypatch.setattr(ghost, "_LOOSE", float("inf"))
    assert np.all(contributions(_ghost_of(dense_taped, False)) < 0.1 * want)


# ---------------------------------------------------------------------------------------------
# Low-precision parameters: the sum must not be taken in the parameters' dtype.
# ---------------------------------------------------------------------------------------------


def _aligned_units(units, dtype):
    """`units` identical single-position examples with gradients of norm 10 along one axis."""
    x = np.zeros((units, 1, 4), np.float32)
    x[:, 0, 0] = 10.0
    v = np.zeros((units, 1, 2), np.float32)
    v[:, 0, 0] = 1.0
    return {"x": jnp.asarray(x, dtype), "v": jnp.asarray(v)}, {"w": jnp.zeros((4, 2), dtype)}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("path", ["vmap", "microbatch", "ghost"])
def test_removing_one_of_many_units_moves_a_low_precision_sum_by_at_most_c(dtype, path):
    # n units clipped to C along one axis: a bfloat16 sum near 1028 rounds to 1024 or 1032, so
    # it moved by 8·C when one unit left (a float16 sum by up to 2·C near a half-integer).
    batch, params = _aligned_units(1040, dtype)
    if path == "ghost":
        fn = ghost_clipped_grad_sum(dense_taped, clip_norm=CLIP).function
    else:
        fn = clipping.clipped_grad_sum(
            dense_example, clip_norm=CLIP, microbatch_size=260 if path == "microbatch" else None,
            keep_batch_dim=True,
        ).function  # fmt: skip
    fn = jax.jit(fn)
    for units in range(1024, 1041):
        mask = np.arange(1040) < units
        total = fn(params, batch, mask)[0]
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(total))
        removed = _diff64(total, fn(params, batch, mask & (np.arange(1040) != 0))[0])
        assert removed <= CLIP, (units, removed)


# ---------------------------------------------------------------------------------------------
# Many units: the rounding of the whole float32 sum stays inside the sensitivity.
# ---------------------------------------------------------------------------------------------

MANY = 262_144


def _along_one_axis(lengths):
    """Single-position units whose gradients lie along one axis, with norms `lengths`."""
    x = np.zeros((len(lengths), 1, 4), np.float32)
    x[:, 0, 0] = lengths
    v = np.zeros((len(lengths), 1, 2), np.float32)
    v[:, 0, 0] = 1.0
    return {"x": x, "v": v}


def _without(rows, j):
    """`rows` without row j, the later rows moved up and a zero row appended: the batch of the
    neighbouring data set, in which every unit after j sits one row earlier."""
    return jax.tree.map(lambda a: np.concatenate([a[:j], a[j + 1 :], np.zeros_like(a[:1])]), rows)


def _many_units_batches():
    """Half the units clipped (norm 10·C), half below C with norms of their own, so the sum's
    float32 rounding depends on the order of the units."""
    lengths = np.random.default_rng(8).uniform(0.3, 1.0, MANY).astype(np.float32)
    lengths[1::2] = 10.0
    return _along_one_axis(lengths), np.ones(MANY, bool), _without(np.ones(MANY, bool), 0)


def _per_user(batch):
    return jax.tree.map(lambda a: a[:, None], batch)  # (U, G = 1, T = 1, d)


_MANY_PATHS = {
    "vmap": (clipping.clipped_grad_sum(dense_example, clip_norm=CLIP, keep_batch_dim=True), None),
    **{
        f"microbatch {size}": (
            clipping.clipped_grad_sum(
                dense_example, clip_norm=CLIP, keep_batch_dim=True, microbatch_size=size
            ),
            None,
        )
        for size in (4096, 8192)
    },
    "ghost": (ghost_clipped_grad_sum(dense_taped, clip_norm=CLIP), None),
    "user vmap": (clipping.user_clipped_grad_sum(dense_example, clip_norm=CLIP), _per_user),
    "user ghost": (ghost_user_clipped_grad_sum(dense_taped, clip_norm=CLIP), _per_user),
}


@pytest.mark.parametrize("path", list(_MANY_PATHS))
def test_removing_one_of_262144_units_moves_the_float32_sum_by_at_most_c(path):
    # Summed in float32, 262,144 such units are off by several units in the last place of a sum
    # near 1.4e5 (0.0156 each), which differs between the two neighbouring batches.
    grad_sum, layout = _MANY_PATHS[path]
    fn = jax.jit(grad_sum.function)
    batch, mask, mask_without = _many_units_batches()
    layout = layout or (lambda b: b)
    user_mask = (lambda m: m[:, None]) if path.startswith("user") else (lambda m: m)
    params = {"w": jnp.zeros((4, 2))}
    total = fn(params, layout(batch), user_mask(mask))[0]
    for j in (1, MANY // 2 + 1, MANY - 1):  # clipped units, at the start, middle and end
        neighbour = fn(params, layout(_without(batch, j)), user_mask(mask_without))[0]
        assert _diff64(total, neighbour) <= CLIP, (path, j)


def test_trainer_gradient_accumulation_over_262144_units():
    # Chunks of 8,192 units: each chunk's float32 sum and the total are rounded; the chunks are
    # accumulated in float64 and clipped for the whole batch (`summation`, roundings=3).
    batch, _, _ = _many_units_batches()
    config = TrainConfig(
        steps=1, batch_size=MANY, learning_rate=0.1, optimizer="sgd", private=True,
        clip_norm=CLIP, delta=1e-7, noise_multiplier=1.0, pad_multiple=8192, chunk_size=8192,
        progress=False, log_every=None, clipping="vmap",
    )  # fmt: skip
    model = nnx.Linear(4, 2, use_bias=False, rngs=nnx.Rngs(0))
    loss = lambda m, b: jnp.sum(m(b["x"]) * b["v"], axis=(1, 2))
    trainer = engine.Trainer(config, model, loss, num_units=2 * MANY, noise_key=jax.random.key(0))
    params = trainer.init_state().params

    def clipped_sum(rows):
        indices = np.where(rows["keep"], np.arange(MANY), -1)
        gather = lambda idx: {k: rows[k][np.maximum(idx, 0)] for k in ("x", "v")}
        return trainer.clipped_sum(params, gather, indices, rows["keep"])

    rows = {**batch, "keep": np.ones(MANY, bool)}
    total = clipped_sum(rows)
    for j in (1, MANY - 1):
        assert _diff64(total, clipped_sum(_without(rows, j))) <= CLIP, j


# ---------------------------------------------------------------------------------------------
# vmap paths in every dtype: example level, microbatched, user level, a mesh axis.
# ---------------------------------------------------------------------------------------------


_VMAP = {
    "plain": jax.jit(
        clipping.clipped_grad_sum(dense_example, clip_norm=CLIP, keep_batch_dim=True).function
    ),
    "microbatch": jax.jit(
        clipping.clipped_grad_sum(
            dense_example, clip_norm=CLIP, keep_batch_dim=True, microbatch_size=2
        ).function
    ),
}


@pytest.mark.parametrize("dtype", DTYPES)
@given(seed=st.integers(0, 2**16), log_scale=st.floats(-20.0, 20.0))
@SEARCH
def test_search_vmap_paths_in_every_dtype(dtype, seed, log_scale):
    x, v = cancelling(np.random.default_rng(seed), 4, 2, 8, 8, scale=10.0**log_scale)
    batch = {"x": jnp.asarray(x, dtype), "v": jnp.asarray(v)}
    params = {"w": jnp.zeros((8, 8), dtype)}
    for fn in _VMAP.values():
        assert_sound(fn, params, batch, np.array([1, 1, 0, 1], bool))


def test_vmap_special_values():
    x, v = cancelling(np.random.default_rng(5), 6, 2, 8, 8)
    x[0, 0, 0], x[1, 1, 2] = np.inf, np.nan
    x[2] *= 1e30
    x[3] = np.float32(1e-42)
    v[4] = np.float32(1e-39)
    batch = {"x": jnp.asarray(x), "v": jnp.asarray(v)}
    for fn in _VMAP.values():
        assert_sound(fn, {"w": jnp.zeros((8, 8))}, batch, np.ones(6, bool))


def test_mesh_axis_path():
    # The spmd_axis_name path, on a one-device mesh (the 8-device run is in test_parallel).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    grad_sum = clipping.clipped_grad_sum(
        dense_example, clip_norm=CLIP, keep_batch_dim=True, spmd_axis_name="data"
    )
    fn = jax.jit(grad_sum.function)
    x, v = cancelling(np.random.default_rng(6), 4, 2, 8, 8)
    with mesh:
        assert_sound(fn, {"w": jnp.zeros((8, 8))}, {"x": x, "v": v}, np.ones(4, bool))


class _FrozenThenHead(nnx.Module):
    """A frozen identity layer, then a trainable head whose positions' gradients cancel."""

    def __init__(self):
        self.frozen = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        self.frozen.kernel.value = jnp.eye(8)
        self.head = nnx.Linear(8, 8, use_bias=False, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.head(self.frozen(x))


def test_partial_fine_tuning_through_the_trainer():
    # The Trainer's default ("auto": ghost here) path with a frozen layer.
    x, v = cancelling(np.random.default_rng(7), 8, 2, 8, 8)
    model = _FrozenThenHead()
    config = TrainConfig(
        steps=1, batch_size=4, learning_rate=0.1, optimizer="sgd", private=True, clip_norm=CLIP,
        delta=1e-5, noise_multiplier=1.0, pad_multiple=4, progress=False, log_every=None,
    )  # fmt: skip
    trainable = jax.tree_util.tree_map_with_path(
        lambda path, _: "head" in jax.tree_util.keystr(path), nnx.state(model, nnx.Param)
    )
    trainer = engine.Trainer(
        config, model, lambda m, b: jnp.sum(m(b["x"]) * b["v"], axis=(1, 2)),
        trainable_mask=trainable, num_units=8, noise_key=jax.random.key(0),
    )  # fmt: skip
    assert trainer.clipping == "ghost"

    def gather(indices):
        rows = np.maximum(indices, 0)
        return {"x": x[rows], "v": v[rows]}

    def grad_sum(params, indices, mask):
        return trainer.clipped_sum(params, gather, indices, mask), None

    assert_sound(grad_sum, trainer.init_state().params, np.arange(8), np.ones(8, bool))
