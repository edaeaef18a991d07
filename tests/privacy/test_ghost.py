"""Book-keeping ghost clipping equals the vmap clipped sum and norms, on small layers and models."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.models import GPT2, GPT2Config, ResNet, ResNetConfig
from dpmix_jax.privacy import ghost
from dpmix_jax.privacy.clipping import clipped_grad_sum
from dpmix_jax.privacy.ghost import Tape, ghost_clipped_grad_sum
from dpmix_jax.train.ghost_models import check_ghost_support, model_clipped_grad_sum


def _assert_trees_close(a, b, rtol=2e-4, atol=2e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _compare(model, batch_loss, batch, mask, clip_norm):
    params = nnx.state(model, nnx.Param)
    ref_total, ref_stats = jax.jit(
        model_clipped_grad_sum(model, batch_loss, clip_norm=clip_norm, method="vmap").function
    )(params, batch, mask)
    total, stats = jax.jit(
        model_clipped_grad_sum(model, batch_loss, clip_norm=clip_norm, method="ghost").function
    )(params, batch, mask)
    np.testing.assert_allclose(stats["grad_norm"], ref_stats["grad_norm"], rtol=1e-4)
    np.testing.assert_allclose(stats["loss"], ref_stats["loss"], rtol=1e-5)
    _assert_trees_close(total, ref_total)
    return stats


class DenseEmbedConv(nnx.Module):
    """Embedding, conv, LayerNorm, GroupNorm and dense layers with both long and short T."""

    def __init__(self, rngs):
        self.embed = nnx.Embed(11, 6, rngs=rngs)
        self.conv = nnx.Linear(6, 4, rngs=rngs)
        self.ln = nnx.LayerNorm(4, rngs=rngs)
        self.gn = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
        self.wide = nnx.Linear(4, 40, rngs=rngs)  # T·(4 + 40) > 4·40: per-example form
        self.out = nnx.Linear(40, 24, use_bias=False, rngs=rngs)  # T·(40 + 24) <= 40·24: Gram

    def __call__(self, ids):
        h = self.gn(self.ln(self.conv(self.embed(ids))))
        return self.out(jnp.tanh(self.wide(h))).mean(axis=1)


def _cls_loss(model, batch):
    logits = model(batch["x"])
    return -jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], -1)[:, 0]


def test_dense_embedding_norm_layers_match_vmap():
    model = DenseEmbedConv(nnx.Rngs(0))
    batch = {"x": jax.random.randint(jax.random.key(1), (5, 9), 0, 11), "y": jnp.arange(5) % 3}
    mask = jnp.array([True, True, False, True, True])
    stats = _compare(model, _cls_loss, batch, mask, clip_norm=0.3)
    assert float(stats["grad_norm"].min()) > 0.3  # every example is clipped: clipping matters


def test_ordinary_inputs_keep_the_gram_form(monkeypatch):
    # No unit's bound is loose, so none is bounded again: the same sums and bounds as with the
    # float64 bounds switched off.
    model = DenseEmbedConv(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    batch = {"x": jax.random.randint(jax.random.key(1), (5, 9), 0, 11), "y": jnp.arange(5) % 3}
    mask = jnp.array([True, True, False, True, True])

    def run():
        grad_sum = model_clipped_grad_sum(model, _cls_loss, clip_norm=0.3, method="ghost")
        return jax.jit(grad_sum.function)(params, batch, mask)

    total, stats = run()
    monkeypatch.setattr(ghost, "_LOOSE", float("inf"))
    gram_total, gram_stats = run()
    np.testing.assert_allclose(stats["grad_norm"], gram_stats["grad_norm"], rtol=1e-6)
    _assert_trees_close(total, gram_total, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("positions", "width"), [(40, 3), (2, 8)])
def test_per_example_and_gram_forms_match_vmap(positions, width):
    # T·(d_in + d_out) > d_in·d_out: per-example gradients (40·5 > 6), else Gram (2·16 <= 64).
    model = nnx.Linear(width, width - 1 if width == 3 else width, rngs=nnx.Rngs(0))
    loss = lambda m, b: jnp.sum(jnp.sin(m(b["x"])), axis=(1, 2))
    batch = {"x": jax.random.normal(jax.random.key(2), (4, positions, width))}
    _compare(model, loss, batch, jnp.array([True, True, False, True]), clip_norm=0.5)


class FloatNet(nnx.Module):
    def __init__(self, rngs):
        self.fc = nnx.Linear(5, 6, rngs=rngs)
        self.ln = nnx.LayerNorm(6, rngs=rngs)
        self.gn = nnx.GroupNorm(6, num_groups=2, rngs=rngs)
        self.head = nnx.Linear(6, 3, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.gn(self.ln(self.fc(x))))).mean(axis=1)


def test_non_finite_and_padded_rows_of_a_model_contribute_zero():
    model = FloatNet(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    x = jax.random.normal(jax.random.key(4), (5, 7, 5))
    x = x.at[1, 2, 0].set(jnp.inf).at[3].set(jnp.nan).at[4].set(1e30)
    batch = {"x": x, "y": jnp.arange(5) % 3}
    mask = jnp.array([True, True, True, False, False])  # row 1 is kept but not finite
    stats = _compare(model, _cls_loss, batch, mask, clip_norm=0.1)
    assert not np.isfinite(stats["grad_norm"][1])
    grad_sum = model_clipped_grad_sum(model, _cls_loss, clip_norm=0.1, method="ghost")
    grad_sum = jax.jit(grad_sum.function)
    total, _ = grad_sum(params, batch, mask)
    good = jax.tree.map(lambda a: a[jnp.array([0, 2])], batch)
    expected, _ = grad_sum(params, good, jnp.ones(2, bool))
    _assert_trees_close(total, expected, rtol=1e-6, atol=1e-7)
    nothing, _ = grad_sum(params, batch, jnp.array([False, True, False, False, False]))
    assert all(float(jnp.abs(leaf).sum()) == 0.0 for leaf in jax.tree.leaves(nothing))


@pytest.mark.parametrize(
    ("channels", "features", "chunk"), [(8, 16, None), (2, 3, None), (2, 3, 3), (2, 3, 4)]
)
def test_conv_layouts_and_forms_match_vmap(channels, features, chunk, monkeypatch):
    # NCHW input, OIHW kernel of size (3, 2), strides (2, 1), "SAME" padding, bias; T = 3·4 = 12
    # output positions. (8, 16): T·(48 + 16) <= 48·16, Gram of patches; (2, 3): per-example form,
    # in chunks of 2 (the default), 3 (and a remainder of 1), or the whole batch of 4.
    if chunk is not None:
        monkeypatch.setattr(ghost, "_CPU_CHUNK_EXAMPLES", chunk)
    dims = ("NCHW", "OIHW", "NCHW")

    def loss_fn(params, batch, tape):
        x = batch["x"]
        y = jax.lax.conv_general_dilated(x, params["k"], (2, 1), "SAME", dimension_numbers=dims)
        y = y + params["b"][:, None, None]
        y = tape.conv("c", x, y, kernel="k", kernel_size=(3, 2), strides=(2, 1), padding="SAME",
                      dimension_numbers=dims, bias="b")  # fmt: skip
        return jnp.sum(jnp.sin(y) * batch["t"], axis=(1, 2, 3))

    keys = jax.random.split(jax.random.key(5), 4)
    params = {"k": jax.random.normal(keys[0], (features, channels, 3, 2)),
              "b": jax.random.normal(keys[1], (features,))}  # fmt: skip
    batch = {"x": jax.random.normal(keys[2], (4, channels, 6, 4)),
             "t": jax.random.normal(keys[3], (4, features, 3, 4))}  # fmt: skip
    mask = jnp.array([True, False, True, True])
    total, stats = jax.jit(ghost_clipped_grad_sum(loss_fn, clip_norm=1.0).function)(
        params, batch, mask
    )
    ref_total, ref_stats = clipped_grad_sum(
        lambda p, ex: loss_fn(p, jax.tree.map(lambda a: a[None], ex), Tape())[0], clip_norm=1.0
    )(params, batch, mask)
    np.testing.assert_allclose(stats["grad_norm"], ref_stats["grad_norm"], rtol=1e-4)
    assert float(stats["grad_norm"].min()) > 1.0
    _assert_trees_close(total, ref_total)


@pytest.mark.parametrize(
    ("dims", "kernel_size", "strides", "padding", "spatial"),
    [
        (("NHWC", "HWIO", "NHWC"), (3, 3), (1, 1), ((1, 1), (1, 1)), (7, 5)),
        (("NCHW", "OIHW", "NCHW"), (3, 2), (1, 1), "SAME", (6, 4)),
        (("NHWC", "HWIO", "NHWC"), (2, 3), (1, 1), ((0, 2), (1, 0)), (5, 6)),
        (("NHWC", "HWIO", "NHWC"), (1, 1), (1, 1), "VALID", (4, 3)),
        (("NHWC", "WHIO", "NHWC"), (3, 2), (1, 1), "VALID", (6, 5)),
        (("NWC", "WIO", "NWC"), (3,), (1,), "SAME", (9,)),
        (("NDHWC", "DHWIO", "NDHWC"), (2, 3, 2), (1, 1, 1), "SAME", (3, 4, 5)),
        (("NHWC", "HWIO", "NHWC"), (3, 3), (2, 2), ((1, 1), (1, 1)), (7, 6)),
    ],
)
def test_per_example_kernel_grads_match_each_examples_conv_transpose(
    dims, kernel_size, strides, padding, spatial
):
    # Each example's kernel gradient, by either form (shifted copies: stride 1 only) and by the
    # form the layer picks, against the transpose of its own convolution.
    channels, features, batch = 3, 4, 3
    lhs, rhs, out = dims
    sizes = dict(zip((c for c in rhs if c not in "IO"), kernel_size, strict=True))
    kernel_shape = tuple({**sizes, "I": channels, "O": features}[c] for c in rhs)
    spatial_letters = [c for c in lhs if c not in "NC"]
    in_sizes = {"N": batch, "C": channels, **dict(zip(spatial_letters, spatial, strict=True))}
    x = jax.random.normal(jax.random.key(0), tuple(in_sizes[c] for c in lhs))
    kernel = jnp.zeros(kernel_shape)
    conv_fn = jax.lax.conv_general_dilated

    def apply(inputs, k):
        return conv_fn(inputs, k, strides, padding, dimension_numbers=dims)

    g = jax.random.normal(jax.random.key(1), jax.eval_shape(apply, x, kernel).shape)
    layer = ghost._Conv(kernel_shape, strides, padding, dims)
    forms = [layer.per_example_kernel_grads, layer._unfolded_kernel_grads]
    if set(strides) == {1}:
        forms.append(layer._shifted_kernel_grads)
    for form in forms:
        got = jax.jit(form)(x, g)
        for j in range(batch):
            one = jax.linear_transpose(lambda k, j=j: apply(x[j : j + 1], k), kernel)(g[j : j + 1])
            np.testing.assert_allclose(got[j], one[0], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_conv_and_group_norm_resnet_matches_vmap():
    model = ResNet(ResNetConfig.tiny(), 5, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (4, 12, 12, 3)).at[3, 0, 0, 0].set(jnp.nan)
    batch = {"x": x, "y": jnp.arange(4) % 5}
    _compare(model, _cls_loss, batch, jnp.array([True, True, True, False]), clip_norm=1.0)


@pytest.mark.slow
def test_tied_gpt2_matches_vmap():
    model = GPT2(GPT2Config.tiny(n_layer=1), rngs=nnx.Rngs(0))

    def lm_loss(m, b):
        logits = m(b["ids"][:, :-1])
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, b["ids"][:, 1:, None], -1)[..., 0].mean(-1)

    # repeated tokens make the embedding/head cross terms non-trivial
    batch = {"ids": jax.random.randint(jax.random.key(3), (3, 12), 0, 20)}
    _compare(model, lm_loss, batch, jnp.ones(3, bool), clip_norm=2.0)


def test_hand_written_tape_norms_are_exact():
    # One dense layer: per-example gradient x_j ⊗ 2(y_j - t_j), norm = ||x_j|| · ||2(y_j - t_j)||.
    def loss_fn(params, batch, tape):
        y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
        return jnp.sum((y - batch["t"]) ** 2, axis=-1)

    rng = np.random.default_rng(0)
    x, t, w = rng.normal(size=(6, 3)), rng.normal(size=(6, 2)), rng.normal(size=(3, 2))
    batch = {"x": jnp.asarray(x, jnp.float32), "t": jnp.asarray(t, jnp.float32)}
    mask = jnp.array([1, 1, 1, 1, 0, 1], bool)
    total, stats = ghost_clipped_grad_sum(loss_fn, clip_norm=0.5)(
        {"w": jnp.asarray(w, jnp.float32)}, batch, mask
    )
    residual = 2 * (x @ w - t)
    norms = np.linalg.norm(x, axis=1) * np.linalg.norm(residual, axis=1)
    np.testing.assert_allclose(stats["grad_norm"], norms, rtol=1e-5)
    scale = np.minimum(1, 0.5 / norms) * np.asarray(mask)
    expected = np.einsum("bi,bj,b->ij", x, residual, scale)
    np.testing.assert_allclose(total["w"], expected, rtol=1e-5, atol=1e-6)
    vmap_total, _ = clipped_grad_sum(
        lambda p, ex: loss_fn(p, jax.tree.map(lambda a: a[None], ex), Tape())[0], clip_norm=0.5
    )({"w": jnp.asarray(w, jnp.float32)}, batch, mask)
    np.testing.assert_allclose(total["w"], vmap_total["w"], rtol=1e-5, atol=1e-6)


def test_non_finite_and_padded_rows_contribute_zero():
    def loss_fn(params, batch, tape):
        y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
        return jnp.sum(y**2, axis=-1)

    x = jnp.array([[1.0, 2.0], [jnp.inf, 1.0], [3.0, -1.0], [jnp.nan, 0.0]])
    params = {"w": jnp.ones((2, 2))}
    grad_sum = ghost_clipped_grad_sum(loss_fn, clip_norm=1.0)
    total, stats = grad_sum(params, {"x": x}, jnp.array([True, True, False, False]))
    assert not np.isfinite(stats["grad_norm"][1])
    only_first, _ = grad_sum(params, {"x": x[:1]}, jnp.array([True]))
    np.testing.assert_allclose(total["w"], only_first["w"], rtol=1e-6)
    nothing, _ = grad_sum(params, {"x": x[1:2]}, jnp.array([True]))
    assert float(jnp.abs(nothing["w"]).sum()) == 0.0


def test_one_differentiated_pass_and_every_parameter_reported():
    calls = []

    def loss_fn(params, batch, tape):
        calls.append(1)
        y = tape.linear("fc", batch["x"], batch["x"] @ params["w"] + params["b"], kernel="w")
        return jnp.sum(y**2, axis=-1)

    params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    batch, mask = {"x": jnp.ones((3, 2))}, jnp.ones(3, bool)
    with pytest.raises(ValueError, match=r"\[b\] were not reported"):
        ghost_clipped_grad_sum(loss_fn, clip_norm=1.0)(params, batch, mask)
    assert len(calls) == 2  # a shape probe and the one differentiated pass; no second backward

    def wrong_key(params, batch, tape):
        return jnp.sum(tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="v"), -1)

    with pytest.raises(ValueError, match=r"\[v\] not in params"):
        ghost_clipped_grad_sum(wrong_key, clip_norm=1.0)({"w": params["w"]}, batch, mask)


def test_sensitivity_and_validation():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    loss = lambda m, b: jnp.sum(m(b["x"]), axis=-1)
    grad_sum = model_clipped_grad_sum(model, loss, clip_norm=1.5, method="ghost")
    assert grad_sum.sensitivity() == 1.5
    with pytest.raises(ValueError, match="leading axis"):
        grad_sum(nnx.state(model, nnx.Param), {"x": jnp.ones((3, 2))}, jnp.ones(4, bool))
    with pytest.raises(ValueError, match="method"):
        model_clipped_grad_sum(model, loss, clip_norm=1.0, method="hooks")
    with pytest.raises(ValueError, match="clip_norm"):
        ghost_clipped_grad_sum(lambda p, b, t: b, clip_norm=0.0)
    with pytest.raises(ValueError, match="weight-standardised"):
        check_ghost_support(ResNet(ResNetConfig.tiny(weight_standardization=True), 2,
                                   rngs=nnx.Rngs(0)))  # fmt: skip

    class Unsupported(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.ones(2))

        def __call__(self, x):
            return x * self.w[...]

    with pytest.raises(ValueError, match="not covered"):
        check_ghost_support(Unsupported())


def test_ghost_clipped_unit_never_exceeds_c():
    # One example per batch: the clipped sum is that example's clipped gradient (float32 sums).
    def loss_fn(params, batch, tape):
        y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
        return jnp.sum(y**2, axis=(-2, -1))

    clip = 0.37
    grad_sum = jax.jit(ghost_clipped_grad_sum(loss_fn, clip_norm=clip).function)
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(60):
        params = {"w": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}
        batch = {"x": jnp.asarray(rng.standard_normal((1, 3, 16)), jnp.float32)}
        total, stats = grad_sum(params, batch, np.ones(1, bool))
        assert float(stats["grad_norm"][0]) > clip
        norm = np.sqrt(np.sum(np.asarray(total["w"], np.float64) ** 2))
        worst = max(worst, norm / clip)
    assert 1.0 - 1e-5 < worst <= 1.0


def test_low_precision_parameters_get_float32_sums_from_both_paths():
    # A bfloat16 sum of many clipped units rounds by several C; both paths now sum in float32.
    model = nnx.Linear(6, 5, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    loss = lambda m, b: jnp.sum(m(b["x"]).astype(jnp.float32) ** 2, axis=(1, 2))
    batch = {"x": jax.random.normal(jax.random.key(7), (4, 3, 6)).astype(jnp.bfloat16)}
    params, mask = nnx.state(model, nnx.Param), jnp.array([True, True, False, True])
    results = {
        method: jax.jit(model_clipped_grad_sum(model, loss, clip_norm=0.5, method=method).function)(
            params, batch, mask
        )
        for method in ("vmap", "ghost")
    }
    for total, _ in results.values():
        assert {leaf.dtype for leaf in jax.tree.leaves(total)} == {jnp.dtype(jnp.float32)}
    np.testing.assert_allclose(
        results["ghost"][1]["grad_norm"], results["vmap"][1]["grad_norm"], rtol=2e-2
    )


def test_grad_norm_is_a_certified_bound_within_1e4_of_the_norm():
    # The stats report the bound each example was clipped by: never below the exact norm of the
    # float32 factors, and for ordinary inputs barely above it.
    def loss_fn(params, batch, tape):
        y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
        return jnp.sum(y * batch["v"], axis=(1, 2))

    rng = np.random.default_rng(8)
    x = rng.standard_normal((5, 4, 16)).astype(np.float32)  # 4·(16 + 12) <= 16·12: Gram form
    v = rng.standard_normal((5, 4, 12)).astype(np.float32)
    _, stats = ghost_clipped_grad_sum(loss_fn, clip_norm=1.0)(
        {"w": jnp.zeros((16, 12))}, {"x": x, "v": v}, jnp.ones(5, bool)
    )
    exact = np.linalg.norm(np.einsum("bti,btj->bij", x.astype(np.float64), v), axis=(1, 2))
    ratio = np.asarray(stats["grad_norm"], np.float64) / exact
    assert np.all(ratio >= 1.0) and np.all(ratio <= 1.0 + 1e-4), ratio
