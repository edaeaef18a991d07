"""Tests for the GroupNorm ResNets: shapes, parameter counts, no BatchNorm, per-example grads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.models import ResNet, ResNet18, ResNet50, ResNetConfig
from dpmix_jax.models.resnet import Conv, GroupNorm


def _param_count(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _abstract(factory):
    return nnx.eval_shape(factory)


def _images(key, shape):
    return jax.random.normal(jax.random.key(key), shape)


@nnx.jit
def _apply(model, x):
    return model(x)


@pytest.fixture(scope="module")
def tiny_models():
    return {
        block: ResNet(ResNetConfig.tiny(block=block), num_outputs=4, rngs=nnx.Rngs(0))
        for block in ("basic", "bottleneck")
    }


def test_tiny_forward_backward_shapes(tiny_models):
    model = tiny_models["basic"]
    x = _images(1, (5, 16, 16, 3))
    logits = _apply(model, x)
    assert logits.shape == (5, 4)
    assert logits.dtype == jnp.float32
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)

    grads = jax.jit(jax.grad(loss))(params)
    assert jax.tree.structure(grads) == jax.tree.structure(params)
    for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(params), strict=True):
        assert g.shape == p.shape
        assert np.all(np.isfinite(g))
    assert _param_count(params) == _param_count(grads)
    # Every parameter (stem, blocks, head) receives gradient.
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(grads))


@pytest.mark.parametrize(
    ("config", "shape"),
    [
        (ResNetConfig.tiny(in_channels=1), (2, 28, 28, 1)),
        (ResNetConfig.tiny(in_channels=5, stem="imagenet"), (2, 20, 12, 5)),
    ],
)
def test_any_input_size_and_channel_count(config, shape):
    model = ResNet(config, num_outputs=2, rngs=nnx.Rngs(0))
    logits = _apply(model, _images(2, shape))
    assert logits.shape == (shape[0], 2)
    assert np.all(np.isfinite(logits))


def test_wrong_channel_count_raises(tiny_models):
    with pytest.raises(ValueError, match="3 channels"):
        tiny_models["basic"](jnp.zeros((1, 32, 32, 1)))


def test_stems():
    imagenet = ResNet(ResNetConfig.tiny(stem="imagenet"), 2, rngs=nnx.Rngs(0))
    cifar = ResNet(ResNetConfig.tiny(), 2, rngs=nnx.Rngs(0))
    assert imagenet.stem_conv.kernel.shape == (7, 7, 3, 8)
    assert imagenet.stem_conv.stride == 2
    assert cifar.stem_conv.kernel.shape == (3, 3, 3, 8)
    assert cifar.stem_conv.stride == 1
    x = _images(3, (1, 32, 32, 3))
    feat = imagenet.stem_conv(x)
    assert feat.shape == (1, 16, 16, 8)
    assert cifar.stem_conv(x).shape == (1, 32, 32, 8)


@pytest.mark.parametrize(
    ("factory", "expected_body"),
    [
        # torchvision resnet18 / resnet50 totals (11,689,512 / 25,557,032) minus their
        # 1000-way fc layers: GroupNorm has the same 2 parameters per channel as BatchNorm.
        (lambda: ResNet18(1000, rngs=nnx.Rngs(0)), 11_689_512 - (512 * 1000 + 1000)),
        (lambda: ResNet50(1000, rngs=nnx.Rngs(0)), 25_557_032 - (2048 * 1000 + 1000)),
    ],
)
def test_imagenet_parameter_counts(factory, expected_body):
    model = _abstract(factory)
    params = nnx.state(model, nnx.Param)
    head = _param_count(nnx.state(model.head, nnx.Param))
    assert head == model.config.feature_dim * 1000 + 1000
    assert _param_count(params) - head == expected_body


def test_resnet18_body_count_closed_form():
    """Independent count from the architecture: convs (no bias) + 2 GroupNorm params/channel."""
    w = 64
    count = 7 * 7 * 3 * w + 2 * w
    cin = w
    for stage in range(4):
        c = w * 2**stage
        for _ in range(2):
            count += 3 * 3 * cin * c + 2 * c + 3 * 3 * c * c + 2 * c
            if cin != c:
                count += cin * c + 2 * c
            cin = c
    model = _abstract(lambda: ResNet18(7, rngs=nnx.Rngs(0)))
    assert _param_count(nnx.state(model, nnx.Param)) - (512 * 7 + 7) == count


def _module_types(model):
    return {type(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module)}


@pytest.mark.parametrize(
    "factory",
    [
        lambda: ResNet(ResNetConfig.tiny(), 3, rngs=nnx.Rngs(0)),
        lambda: ResNet18(3, rngs=nnx.Rngs(0)),
        lambda: ResNet50(3, rngs=nnx.Rngs(0)),
    ],
)
def test_no_batchnorm(factory):
    types = _module_types(_abstract(factory))
    assert GroupNorm in types
    assert not any(issubclass(t, nnx.BatchNorm) for t in types)
    state = nnx.state(_abstract(factory))
    assert not any(isinstance(v, nnx.BatchStat) for v in jax.tree.leaves(
        state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    ))  # fmt: skip


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_per_example_grads_vmap_match_loop(tiny_models, block):
    graphdef, params, rest = nnx.split(tiny_models[block], nnx.Param, ...)
    x = _images(4, (3, 1, 12, 12, 3))  # three examples, each with a batch axis of 1
    y = jnp.array([0, 3, 1])

    def loss(p, xi, yi):
        logits = nnx.merge(graphdef, p, rest)(xi)
        return -jax.nn.log_softmax(logits)[0, yi]

    batched = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(params, x, y)
    single_grad = jax.jit(jax.grad(loss))
    for i in range(3):
        single = single_grad(params, x[i], y[i])
        for b, s in zip(jax.tree.leaves(batched), jax.tree.leaves(single), strict=True):
            np.testing.assert_allclose(b[i], s, rtol=1e-4, atol=1e-5)
    # Examples do not influence each other (GroupNorm is per example): grads differ per row.
    first = jax.tree.leaves(batched)[0]
    assert not np.allclose(first[0], first[1])


def test_weight_standardization_invariance():
    """With WS the output ignores a per-output-channel affine change of the kernel."""
    rngs = nnx.Rngs(0)
    x = _images(5, (2, 8, 8, 3))
    for ws in (True, False):
        conv = Conv(3, 4, 3, weight_standardization=ws, rngs=rngs)
        before = conv(x)
        scale = jnp.array([2.0, 0.5, 3.0, 1.5])
        conv.kernel[...] = conv.kernel[...] * scale + jnp.array([0.1, -0.2, 0.3, 0.0])
        after = conv(x)
        assert np.allclose(before, after, rtol=1e-3, atol=1e-3) == ws


def test_weight_standardization_matches_explicit_standardization():
    conv = Conv(3, 4, 3, weight_standardization=True, rngs=nnx.Rngs(1))
    plain = Conv(3, 4, 3, rngs=nnx.Rngs(2))
    k = np.asarray(conv.kernel[...])
    plain.kernel[...] = (k - k.mean(axis=(0, 1, 2))) / np.sqrt(k.var(axis=(0, 1, 2)) + 1e-5)
    x = _images(6, (1, 9, 9, 3))
    np.testing.assert_allclose(conv(x), plain(x), rtol=1e-4, atol=1e-5)


def test_bfloat16_compute_close_to_float32():
    x = _images(7, (2, 16, 16, 3))
    f32 = ResNet(ResNetConfig.tiny(weight_standardization=True), 3, rngs=nnx.Rngs(0))
    bf16 = ResNet(
        ResNetConfig.tiny(weight_standardization=True, dtype="bfloat16"), 3, rngs=nnx.Rngs(0)
    )
    out = _apply(bf16, x)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(out, _apply(f32, x), rtol=0.1, atol=0.1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"block": "dense"}, "block"),
        ({"stem": "vit"}, "stem"),
        ({"width": 8, "groups": 3}, "groups"),
        ({"stage_sizes": ()}, "stage_sizes"),
        ({"stage_sizes": (1, 0)}, "stage_sizes"),
        ({"in_channels": 0}, "in_channels"),
        ({"dtype": "int32"}, "dtype"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        ResNetConfig.tiny(**overrides)


def test_num_outputs_validation():
    with pytest.raises(ValueError, match="num_outputs"):
        ResNet(ResNetConfig.tiny(), 0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("shape", "groups", "options"),
    [
        ((3, 6, 5, 8), 4, {}),
        ((2, 7, 12), 3, {"use_scale": False}),
        ((4, 2, 3, 2, 6), 6, {"use_bias": False}),
        ((3, 4, 4, 8), 2, {"dtype": jnp.bfloat16}),
    ],
)
def test_group_norm_matches_flax_values_and_gradients(shape, groups, options):
    channels = shape[-1]
    ours = GroupNorm(channels, num_groups=groups, epsilon=1e-5, rngs=nnx.Rngs(0), **options)
    flax = nnx.GroupNorm(channels, num_groups=groups, epsilon=1e-5, rngs=nnx.Rngs(0), **options)
    keys = jax.random.split(jax.random.key(3), 4)
    for module in (ours, flax):  # non-trivial affine parameters, the same in both
        if module.scale is not None:
            module.scale[...] = 1.0 + jax.random.normal(keys[0], (channels,))
        if module.bias is not None:
            module.bias[...] = jax.random.normal(keys[1], (channels,))
    # per-example offsets and scales, so that a mean or variance mixed across examples shows
    x = 3.0 * jax.random.normal(keys[2], shape) + jnp.arange(shape[0]).reshape(
        -1, *[1] * (len(shape) - 1)
    )
    weights = jax.random.normal(keys[3], shape)

    def loss(module, x):
        return jnp.sum(module(x).astype(jnp.float32) * weights)

    tol = {"rtol": 2e-2, "atol": 2e-2} if options.get("dtype") == jnp.bfloat16 else {"atol": 2e-5}
    assert ours(x).dtype == flax(x).dtype
    np.testing.assert_allclose(ours(x).astype(jnp.float32), flax(x).astype(jnp.float32), **tol)
    ours_grads = nnx.grad(loss, argnums=(0, 1))(ours, x)
    flax_grads = nnx.grad(loss, argnums=(0, 1))(flax, x)
    for a, b in zip(jax.tree.leaves(ours_grads), jax.tree.leaves(flax_grads), strict=True):
        np.testing.assert_allclose(a, b, **{**tol, "atol": 10 * tol["atol"]})


def test_group_norm_masked_statistics_use_flax():
    ours = GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0))
    flax = nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (2, 5, 4))
    mask = jnp.broadcast_to(jnp.arange(5)[None, :, None] < 3, x.shape)
    np.testing.assert_allclose(ours(x, mask=mask), flax(x, mask=mask), atol=1e-6)
