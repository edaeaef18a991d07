"""The Trainer's clipped sums: ghost and vmap give the same sum (example and user level, ResNet
and GPT-2, full and partial fine-tuning), and "auto" picks ghost exactly where it applies."""

import jax
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.models import GPT2, GPT2Config, ResNet, ResNetConfig, gpt2
from dpmix_jax.train import TrainConfig, engine, losses

RS = np.random.default_rng(0)
IMAGES = RS.normal(size=(24, 8, 8, 3)).astype(np.float32)
LABELS = RS.integers(0, 3, size=24)
TOKENS = RS.integers(0, 512, size=(24, 9)).astype(np.int32)
USERS = np.repeat(np.arange(8), 3)


def _rows(idx):
    keep = idx >= 0
    return np.where(keep, idx, 0), keep


def image_gather(idx):
    rows, keep = _rows(idx)
    return {"inputs": IMAGES[rows] * keep[:, None, None, None], "label": LABELS[rows] * keep}


def token_gather(idx):
    rows, keep = _rows(idx)
    return {"tokens": TOKENS[rows] * keep[:, None]}


def resnet_partial(model):
    """The head, the last block and only the shift (not the scale) of the stem norm."""

    def trainable(path, _):
        name = jax.tree_util.keystr(path)
        return name.startswith(("['head']", "['blocks'][1]", "['stem_norm']['bias']"))

    return jax.tree_util.tree_map_with_path(trainable, nnx.state(model, nnx.Param))


CASES = {
    "resnet": (
        lambda: ResNet(ResNetConfig.tiny(), 3, rngs=nnx.Rngs(0)),
        losses.softmax_cross_entropy(),
        image_gather,
        resnet_partial,
    ),
    "gpt2": (
        lambda: GPT2(GPT2Config.tiny(), rngs=nnx.Rngs(0)),
        losses.next_token_nll(mask_key=None),
        token_gather,
        lambda model: gpt2.trainable_mask(model, last_n_blocks=1),
    ),
}


def trainer(case, clipping, level, partial):
    make_model, loss, _, mask_fn = CASES[case]
    model = make_model()
    config = TrainConfig(
        steps=2, batch_size=6, learning_rate=0.1, optimizer="sgd", private=True,
        clip_norm=0.05, delta=1e-5, noise_multiplier=1.0, pad_multiple=4, progress=False,
        log_every=None, clipping=clipping, level=level,
        max_examples_per_user=3 if level == "user" else None,
    )  # fmt: skip
    return engine.Trainer(
        config, model, loss, trainable_mask=mask_fn(model) if partial else None,
        num_units=8 if level == "user" else 24, noise_key=jax.random.key(1),
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "level", "partial"),
    [
        ("resnet", "example", False),
        ("resnet", "user", True),
        ("gpt2", "example", True),
        ("gpt2", "user", False),
    ],
)
def test_ghost_and_vmap_clipped_sums_are_identical(case, level, partial):
    ghost = trainer(case, "auto", level, partial)
    vmap = trainer(case, "vmap", level, partial)
    assert (ghost.clipping, vmap.clipping) == ("ghost", "vmap")
    assert set(ghost.init_state().params) == set(vmap.init_state().params)
    if level == "user":
        # Users 0, 2, 5 with 3, 2 and 1 real examples; row 3 is a padded user.
        indices = np.array([[0, 1, 2], [6, 7, -1], [15, -1, -1], [-1, -1, -1]])
    else:
        indices = np.array([0, 3, 5, 8, 13, 21, -1, -1])
    mask = indices >= 0
    params = ghost.init_state().params
    gather = CASES[case][2]
    want = vmap.clipped_sum(params, gather, indices, mask)
    got = ghost.clipped_sum(params, gather, indices, mask)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=2e-4, atol=1e-6, err_msg=name)
    units = int(mask.reshape(mask.shape[0], -1).any(axis=1).sum())
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in want.values()))
    assert 0 < total <= 0.05 * units + 1e-6


def test_auto_falls_back_to_vmap_and_ghost_refuses_unsupported_layers():
    def ws_trainer(clipping):
        model = ResNet(ResNetConfig.tiny(weight_standardization=True), 3, rngs=nnx.Rngs(0))
        config = TrainConfig(
            steps=1, batch_size=4, learning_rate=0.1, private=True, clip_norm=1.0, delta=1e-5,
            noise_multiplier=1.0, progress=False, clipping=clipping,
        )  # fmt: skip
        return engine.Trainer(
            config, model, losses.softmax_cross_entropy(), num_units=24,
            noise_key=jax.random.key(0),
        )  # fmt: skip

    assert ws_trainer("auto").clipping == "vmap"
    with pytest.raises(ValueError, match="weight-standardised"):
        ws_trainer("ghost")
    with pytest.raises(ValueError, match="clipping must be"):
        TrainConfig(steps=1, batch_size=1, learning_rate=0.1, clipping="hooks")
    with pytest.raises(ValueError, match="microbatch_size"):
        TrainConfig(
            steps=1, batch_size=4, learning_rate=0.1, private=True, clip_norm=1.0, delta=1e-5,
            noise_multiplier=1.0, clipping="ghost", microbatch_size=2, pad_multiple=4,
        )  # fmt: skip
