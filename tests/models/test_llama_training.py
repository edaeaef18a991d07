"""Private training of Llama-family decoders through the `Trainer`.

A tiny Llama with grouped-query attention (4 query heads sharing 2 key/value heads), with a tied or
an untied head, is trained in full or through LoRA adapters on every attention and MLP projection,
at example and user level, with the next-token loss of `train.losses` (padding masked). The
default clipping ("auto") must select the ghost tape; its clipped sums must equal the vmap path's
on random batches and pass the adversarial harness of `test_adversarial_clipping` on constructed
ones (one token repeated, two alternating, the vocabulary's first and last ids, an embedding row
of huge norm). One private step on 8 simulated devices (data=8, and data=4 x model=2 with the
parameters sharded) equals the step on one device, and an interrupted run resumed from its
checkpoint equals the uninterrupted run.
"""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.models import lora
from dpmix_jax.models.llama import Llama, LlamaConfig
from dpmix_jax.train import TrainConfig, engine, ghost_models
from dpmix_jax.train.checkpoint import Checkpointer
from dpmix_jax.train.losses import next_token_nll
from tests.privacy.test_adversarial_clipping import CLIP, assert_sound
from tests.simulated_devices import xla_flags

VOCAB, SEQ, NUM_EXAMPLES = 64, 8, 24
ADAPTERS = lora.LoraConfig(rank=4, alpha=8.0)
LOSS = next_token_nll()


def llama_config(*, tied: bool = True, **overrides) -> LlamaConfig:
    """A 2-layer, 32-wide Llama: 4 query heads on 2 key/value heads (head_dim 8)."""
    settings = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
        max_position_embeddings=16, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaConfig.tiny(**{**settings, **overrides})


def llama_model(*, tied: bool = True, adapters: bool = False, seed: int = 0, **overrides):
    """The tiny Llama, with LoRA adapters whose B is random (A then has gradients) if asked."""
    model = Llama(llama_config(tied=tied, **overrides), rngs=nnx.Rngs(seed))
    if adapters:
        lora.add_lora(model, ADAPTERS, rngs=nnx.Rngs(seed + 1))
        rng = np.random.default_rng(seed)
        for _, module in nnx.iter_modules(model):
            if isinstance(module, lora.LoraLinear):
                shape = module.lora_b.kernel[...].shape
                module.lora_b.kernel[...] = jnp.asarray(0.2 * rng.standard_normal(shape))
    return model


def _random_data(seed=0, n=NUM_EXAMPLES):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, (n, SEQ)).astype(np.int32)
    lengths = rng.integers(2, SEQ + 1, n)
    return tokens, (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)


def make_gather(tokens, mask):
    """`gather(indices)` over fixed rows: -1 gives a zero row whose tokens are all masked."""

    def gather(indices):
        rows = np.maximum(indices, 0)
        return {"tokens": tokens[rows], "mask": mask[rows] * (indices >= 0)[:, None]}

    return gather


TOKENS, MASK = _random_data()
gather = make_gather(TOKENS, MASK)
USERS = np.arange(NUM_EXAMPLES) // 3  # 8 users of 3 examples


def private_config(level="example", **overrides) -> TrainConfig:
    settings = dict(
        steps=3, batch_size=8, learning_rate=0.05, optimizer="sgd", private=True, clip_norm=0.5,
        delta=1e-5, noise_multiplier=1.0, pad_multiple=8, progress=False, log_every=None,
    )  # fmt: skip
    if level == "user":
        settings |= {"level": "user", "max_examples_per_user": 3}
    return TrainConfig(**{**settings, **overrides})


def make_trainer(model, config, loss=LOSS, **kwargs):
    mask = lora.trainable_mask(model) if _has_adapters(model) else None
    return engine.Trainer(
        config, model, loss, trainable_mask=mask, num_units=NUM_EXAMPLES,
        noise_key=jax.random.key(3), **kwargs,
    )  # fmt: skip


def _has_adapters(model) -> bool:
    return any(isinstance(m, lora.LoraLinear) for _, m in nnx.iter_modules(model))


def _flat_params(model) -> dict[str, np.ndarray]:
    flat = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    return {jax.tree_util.keystr(path): np.asarray(value) for path, value in flat}


# ---------------------------------------------------------------------------------------------
# The default path: ghost clipping, full fine-tuning and LoRA, example and user level.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapters", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_auto_clipping_selects_the_ghost_tape(tied, adapters):
    model = llama_model(tied=tied, adapters=adapters, attention_bias=True)  # Qwen2's q/k/v bias
    trainer = make_trainer(model, private_config())
    assert trainer.clipping == "ghost"
    ghost_models.check_ghost_support(model, trainer._ghost_key)
    # Every trainable parameter, RMSNorm scales and q/k/v biases included, has a tapped layer.
    tapped = {
        path + (name,)
        for path, _, keys in ghost_models._tapped_layers(model, trainer._ghost_key)
        for name, key in keys.items()
        if key is not None
    }
    assert len(tapped) == len(trainer.init_state().params)


@pytest.mark.parametrize(
    ("level", "adapters"), [("example", False), ("user", True), ("user", False)]
)
def test_private_fit_moves_exactly_the_trainable_parameters(level, adapters):
    model = llama_model(tied=level == "example", adapters=adapters)
    before = _flat_params(model)
    trainer = make_trainer(model, private_config(level))
    data = engine.IndexedData(
        gather=gather, num_examples=NUM_EXAMPLES, user_ids=USERS if level == "user" else None
    )
    result = engine.fit(trainer, data, rng=np.random.default_rng(0))
    assert result.ledger.count == 3 and int(result.state.step) == 3
    after = _flat_params(result.model)
    moved = {name for name, value in after.items() if not np.array_equal(value, before[name])}
    trainable = {name for name in after if "lora_" in name} if adapters else set(after)
    assert moved == trainable  # the noise moves every trainable parameter, nothing else
    for name in set(after) - trainable:
        assert after[name].tobytes() == before[name].tobytes(), name


def test_public_fit_lowers_the_next_token_loss():
    model = llama_model(tied=False)
    config = TrainConfig(steps=30, batch_size=8, learning_rate=0.01, progress=False, log_every=1)
    data = engine.IndexedData(gather=gather, num_examples=NUM_EXAMPLES)
    logger = engine.MetricLogger()
    engine.fit(make_trainer(model, config), data, rng=np.random.default_rng(0), logger=logger)
    losses = [record["train_loss"] for record in logger.history]
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5


@pytest.mark.parametrize(
    ("tied", "adapters", "level"),
    [(True, False, "example"), (False, False, "user"), (True, True, "user"),
     (False, True, "example")],
)  # fmt: skip
def test_ghost_and_vmap_clipped_sums_agree_on_random_batches(tied, adapters, level):
    if level == "user":
        indices = np.array([[0, 1, 2], [3, 4, -1], [5, -1, -1], [-1, -1, -1], [6, 7, 8],
                            [9, 10, 11], [12, -1, -1], [13, 14, 15]])  # fmt: skip
    else:
        indices = np.array([0, 1, 2, 3, 4, 5, -1, 6])
    sums = {}
    for clipping in ("auto", "vmap"):
        model = llama_model(tied=tied, adapters=adapters, seed=5)
        trainer = make_trainer(model, private_config(level, clipping=clipping))
        sums[trainer.clipping] = trainer.clipped_sum(
            trainer.init_state().params, gather, indices, indices >= 0
        )
    assert set(sums) == {"ghost", "vmap"}
    for name, ghost in sums["ghost"].items():
        np.testing.assert_allclose(ghost, sums["vmap"][name], atol=1e-5, err_msg=name)
    # Clipping is active: the total is far below the units' count times C.
    total = np.sqrt(sum(np.sum(np.square(v)) for v in sums["vmap"].values()))
    assert 0 < total < (indices >= 0).reshape(8, -1).any(axis=1).sum() * 0.5


# ---------------------------------------------------------------------------------------------
# The adversarial harness: no unit moves the Trainer's clipped sum by more than C.
# ---------------------------------------------------------------------------------------------


def _scaled_loss(scale):
    """The next-token loss times `scale` (so that some units are clipped and some are not)."""
    return lambda model, batch: scale * LOSS(model, batch)


def _constructed_rows():
    """Eight sequences: one id repeated, two ids alternating, the vocabulary's ends (alone,
    alternating), a ramp, and a repeated row twice (equal units), some of them padded."""
    last = VOCAB - 1
    tokens = np.stack([
        np.full(SEQ, 5), np.tile([3, 9], SEQ // 2), np.zeros(SEQ), np.full(SEQ, last),
        np.tile([0, last], SEQ // 2), np.arange(SEQ), np.full(SEQ, 7), np.full(SEQ, 7),
    ]).astype(np.int32)  # fmt: skip
    mask = np.ones_like(tokens)
    mask[1, 6:] = 0  # right padding
    mask[4, :3] = 0  # left padding
    return tokens, mask


CASES = {
    "repeated_and_alternating_ids": {},
    "huge_embedding_row": {"huge_row": True},
    "untied_lora": {"tied": False, "adapters": True},
    "user_level": {"level": "user"},
    "user_level_lora_huge_row": {"level": "user", "adapters": True, "huge_row": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_adversarial_batches_move_the_clipped_sum_by_at_most_c(case):
    settings = {"tied": True, "adapters": False, "level": "example", "huge_row": False}
    settings |= CASES[case]
    model = llama_model(tied=settings["tied"], adapters=settings["adapters"])
    tokens, mask = _constructed_rows()
    if settings["huge_row"]:  # the last id's embedding row has norm about 1e4
        table = model.embed_tokens.embedding
        table[...] = table[...].at[VOCAB - 1].multiply(1e5)
    if settings["level"] == "user":  # user u holds rows 2u and 2u + 1; user 2's second is padding
        indices, unit_mask = np.arange(8).reshape(4, 2), np.ones((4, 2), bool)
        unit_mask[2, 1] = False
        level = {"level": "user", "max_examples_per_user": 2}
    else:
        indices, unit_mask, level = np.arange(8), np.ones(8, bool), {}
    config = private_config(clip_norm=CLIP, **level)
    trainer = make_trainer(model, config, loss=_scaled_loss(0.2))
    assert trainer.clipping == "ghost"
    constructed = make_gather(tokens, mask)

    def grad_sum(params, unit_indices, units):
        return trainer.clipped_sum(params, constructed, unit_indices, units), None

    assert_sound(grad_sum, trainer.init_state().params, indices, unit_mask)


# ---------------------------------------------------------------------------------------------
# A mesh of 8 simulated devices, and checkpoints.
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_private_step_on_8_devices_matches_1_device():
    script = pathlib.Path(__file__).with_name("llama_parallel_check.py")
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(report) == {"data8", "data4_model2", "lora_data4_model2"}
    for name, case in report.items():
        assert case["clipping"] == "ghost", name
        assert case["moved"] > 1e-4, name  # the step really changed the parameters
        assert case["max_diff"] < 1e-5, name  # same batch, same noise, same update
    assert report["data4_model2"]["sharded"] and report["lora_data4_model2"]["sharded"]


def test_interrupted_lora_run_resumes_exactly(tmp_path):
    data = engine.IndexedData(gather=gather, num_examples=NUM_EXAMPLES)
    config = private_config(steps=4, optimizer="adam", learning_rate=0.01, checkpoint_every=1)

    def trainer():
        return make_trainer(llama_model(tied=False, adapters=True), config)

    reference = engine.fit(trainer(), data, rng=np.random.default_rng(7))
    first = engine.fit(
        trainer(), data, rng=np.random.default_rng(7), checkpointer=Checkpointer(tmp_path),
        until=2,
    )  # fmt: skip
    assert first.ledger.count == 2
    resumed = engine.fit(
        trainer(), data, rng=np.random.default_rng(99), checkpointer=Checkpointer(tmp_path)
    )
    assert int(resumed.state.step) == 4 and resumed.ledger.count == reference.ledger.count == 4
    assert set(resumed.state.params) == set(reference.state.params)
    assert all("lora_" in name for name in reference.state.params)
    for name, value in reference.state.params.items():
        assert np.asarray(value).tobytes() == np.asarray(resumed.state.params[name]).tobytes()
    assert resumed.ledger.state_dict() == reference.ledger.state_dict()
    assert resumed.ledger.epsilon(1e-5) == reference.ledger.epsilon(1e-5)
    assert resumed.rng.bit_generator.state == reference.rng.bit_generator.state
