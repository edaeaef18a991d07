"""The training engine: config validation, private steps, accumulation, trace counts, masks,
pretraining on λ."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmix_jax.models import gpt2
from dpmix_jax.privacy import gaussian_noise
from dpmix_jax.privacy.clipping import clip_to_norm
from dpmix_jax.train import TrainConfig, engine, losses, pretrain


class MLP(nnx.Module):
    def __init__(self, din, dout, rngs, batchnorm=False):
        self.a = nnx.Linear(din, 8, rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs) if batchnorm else None
        self.b = nnx.Linear(8, dout, rngs=rngs)

    def __call__(self, x):
        h = self.a(x)
        if self.bn is not None:
            h = self.bn(h)
        return self.b(jax.nn.tanh(h))


RS = np.random.default_rng(0)
X = RS.normal(size=(60, 4)).astype(np.float32)
Y = RS.integers(0, 3, size=60)
USERS = RS.integers(0, 12, size=60)


def gather(idx):
    keep = idx >= 0
    rows = np.where(keep, idx, 0)
    return {"inputs": X[rows] * keep[:, None], "label": Y[rows] * keep}


DATA = engine.IndexedData(gather=gather, num_examples=60, user_ids=USERS)
LOSS = losses.softmax_cross_entropy()


def private_config(**kw):
    base = dict(
        steps=4,
        batch_size=12,
        learning_rate=0.1,
        optimizer="sgd",
        private=True,
        clip_norm=0.3,
        delta=1e-5,
        noise_multiplier=1.0,
        pad_multiple=8,
        progress=False,
        log_every=None,
    )
    return TrainConfig(**{**base, **kw})


def make_trainer(config, model=None, **kw):
    model = MLP(4, 3, nnx.Rngs(0)) if model is None else model
    return engine.Trainer(
        config, model, kw.pop("loss", LOSS), num_units=60, noise_key=jax.random.key(1), **kw
    )


def naive_clipped_sum(trainer, params, indices, clip):
    """Per-example loop: gradient of each real example, clipped, summed."""
    total = jax.tree.map(jnp.zeros_like, params)
    for i in indices[indices >= 0]:
        example = jax.tree.map(jnp.asarray, gather(np.array([i])))
        grad = jax.grad(
            lambda p, ex=example: LOSS(trainer.split.merge(p, trainer.frozen, trainer.rest), ex)[0]
        )(params)
        clipped, _ = clip_to_norm(grad, clip, jnp.array(True))
        total = optax.tree.add(total, clipped)
    return total


@pytest.mark.parametrize(
    "kw",
    [
        dict(private=False, clip_norm=1.0),
        dict(private=True, clip_norm=None, delta=1e-5, noise_multiplier=1.0),
        dict(private=True, clip_norm=1.0, delta=1e-5),  # neither ε nor σ
        dict(private=True, clip_norm=1.0, delta=1e-5, noise_multiplier=1.0, level="user"),
        dict(optimizer="lion"),
        dict(pad_multiple=8, microbatch_size=3),
        dict(steps=0),
    ],
)
def test_config_rejects_bad_settings(kw):
    with pytest.raises(ValueError):
        TrainConfig(**{"steps": 3, "batch_size": 4, "learning_rate": 0.1, **kw})


def test_batchnorm_in_private_step_is_a_clear_error():
    with pytest.raises(ValueError, match="BatchNorm"):
        make_trainer(private_config(), MLP(4, 3, nnx.Rngs(0), batchnorm=True))
    # Public training of the same model is allowed.
    public = TrainConfig(steps=1, batch_size=4, learning_rate=0.1, progress=False)
    engine.Trainer(public, MLP(4, 3, nnx.Rngs(0), batchnorm=True), LOSS)


def test_accumulation_matches_one_chunk_and_naive_loop():
    indices = np.array([3, 7, 11, 20, 41, 59, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1])
    mask = indices >= 0
    whole = make_trainer(private_config(pad_multiple=16))
    chunked = make_trainer(private_config(pad_multiple=16, chunk_size=4, microbatch_size=2))
    params = whole.init_state().params
    one = whole.clipped_sum(params, gather, indices, mask)
    acc = chunked.clipped_sum(params, gather, indices, mask)
    naive = naive_clipped_sum(whole, params, indices, 0.3)
    for k in params:
        np.testing.assert_allclose(one[k], acc[k], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(one[k], naive[k], rtol=1e-5, atol=1e-6)


def test_one_call_step_matches_chunked_step_and_keeps_the_initial_state():
    indices = np.array([3, 7, 11, 20, 41, 59, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1])
    mask = indices >= 0
    whole = make_trainer(private_config(pad_multiple=16))
    chunked = make_trainer(private_config(pad_multiple=16, chunk_size=4))
    initial = jax.tree.map(np.array, whole.init_state().params)
    fused = whole.noisy_step(whole.init_state(), gather, indices, mask)
    stepped = chunked.noisy_step(chunked.init_state(), gather, indices, mask)
    assert int(fused.step) == int(stepped.step) == 1
    for k in initial:  # same clipped sum, same noise key: the same update either way
        np.testing.assert_allclose(fused.params[k], stepped.params[k], rtol=1e-5, atol=1e-6)
        assert not np.allclose(fused.params[k], initial[k])
    # The step consumed (donated) its input state, never the trainer's initial parameters: a
    # second run from a fresh initial state repeats the first exactly.
    again = whole.noisy_step(whole.init_state(), gather, indices, mask)
    for k in initial:
        np.testing.assert_array_equal(whole.init_state().params[k], initial[k])
        np.testing.assert_array_equal(again.params[k], fused.params[k])


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_bfloat16_update_comes_from_a_float32_noisy_sum_cast_last(chunk_size):
    indices = np.array([3, 7, 11, 20, 41, 59, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1])
    mask = indices >= 0
    model = nnx.Linear(4, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    config = private_config(pad_multiple=16, chunk_size=chunk_size, learning_rate=1.0)
    trainer = make_trainer(config, model)
    params = trainer.init_state().params
    total = trainer.clipped_sum(params, gather, indices, mask)
    assert {v.dtype for v in total.values()} == {jnp.dtype(jnp.float32)}  # the accumulator
    stepped = trainer.noisy_step(trainer.init_state(), gather, indices, mask)
    _, noise_key = jax.random.split(jax.random.key(1))  # make_trainer's key
    noisy = optax.tree.add(total, gaussian_noise.gaussian_noise_tree(noise_key, total, 1.0 * 0.3))
    scale = 1 / trainer.plan.expected_batch_size
    for k, value in stepped.params.items():
        assert value.dtype == jnp.bfloat16
        np.testing.assert_array_equal(value, params[k] - (noisy[k] * scale).astype(jnp.bfloat16))


def test_user_level_sum_clips_each_users_mean_gradient():
    trainer = make_trainer(private_config(level="user", max_examples_per_user=3))
    params = trainer.init_state().params
    indices = np.array([[0, 5, -1], [9, -1, -1], [-1, -1, -1], [-1, -1, -1]])
    total = trainer.clipped_sum(params, gather, indices, indices >= 0)
    expected = jax.tree.map(jnp.zeros_like, params)
    for row in indices:
        real = row[row >= 0]
        if len(real) == 0:
            continue
        batch = jax.tree.map(jnp.asarray, gather(real))
        grad = jax.grad(
            lambda p, b=batch: jnp.mean(
                LOSS(trainer.split.merge(p, trainer.frozen, trainer.rest), b)
            )
        )(params)
        clipped, _ = clip_to_norm(grad, 0.3, jnp.array(True))
        expected = optax.tree.add(expected, clipped)
    for k in params:
        np.testing.assert_allclose(total[k], expected[k], rtol=1e-5, atol=1e-6)
    # A full user-level run records one event per step.
    result = engine.fit(trainer, DATA, rng=np.random.default_rng(0))
    assert result.ledger.count == 4


def test_private_loop_compiles_once_per_padded_size():
    traces = []

    def counting_loss(model, batch):
        traces.append(batch["inputs"].shape)
        return LOSS(model, batch)

    config = private_config(steps=12, batch_size=20, pad_multiple=4)
    trainer = make_trainer(config, loss=counting_loss)
    replay = np.random.default_rng(3)
    sizes = {trainer.sampler.sample(replay, 60).indices.shape[0] for _ in range(12)}
    assert len(sizes) > 1  # the test only means something with several padded sizes
    result = engine.fit(trainer, DATA, rng=np.random.default_rng(3))
    # The ghost path traces the loss twice per compilation (a shape probe, then the pass).
    per_compile = 2 if trainer.clipping == "ghost" else 1
    assert trainer.clipping == "ghost"
    assert len(traces) == per_compile * len(sizes)
    assert result.ledger.count == 12
    # With fixed-size chunks there is a single compiled shape, whatever the batch size.
    traces.clear()
    chunked = make_trainer(
        private_config(steps=12, batch_size=20, pad_multiple=4, chunk_size=8), loss=counting_loss
    )
    engine.fit(chunked, DATA, rng=np.random.default_rng(3))
    assert len(traces) == per_compile


@pytest.mark.parametrize(("private", "bad_step"), [(True, 4), (False, 2)])
def test_non_finite_parameters_stop_a_run_without_log_steps_within_a_few_steps(private, bad_step):
    # Adam moves each weight by about the learning rate per step: float32 soon overflows.
    if private:
        trainer = make_trainer(private_config(steps=40, optimizer="adam", learning_rate=1e38))
    else:
        config = TrainConfig(
            steps=40, batch_size=12, learning_rate=1e38, progress=False, log_every=None
        )
        trainer = engine.Trainer(config, MLP(4, 3, nnx.Rngs(0)), LOSS)
    done = []
    message = rf"non-finite parameters at step {bad_step} \(finite at step {bad_step - 1}\)"
    with pytest.raises(ValueError, match=message):
        engine.fit(trainer, DATA, rng=np.random.default_rng(7), on_step=lambda d, _: done.append(d))
    assert max(done) < engine._MAX_STEPS_AHEAD  # stopped where fit first waits for the device


def test_public_training_reduces_loss():
    config = TrainConfig(steps=60, batch_size=20, learning_rate=0.05, progress=False, log_every=10)
    trainer = engine.Trainer(config, MLP(4, 3, nnx.Rngs(0)), LOSS)
    full = jax.tree.map(jnp.asarray, gather(np.arange(60)))
    before = float(jnp.mean(LOSS(MLP(4, 3, nnx.Rngs(0)), full)))
    result = engine.fit(trainer, DATA, rng=np.random.default_rng(0))
    after = float(jnp.mean(LOSS(result.model, full)))
    assert after < 0.8 * before
    assert result.ledger is None


def test_mixture_bce_soft_labels_and_one_hot_lambda():
    labels = RS.integers(0, 2, size=(16, 3)).astype(np.float32)
    inputs = X[:16]
    model = MLP(4, 1, nnx.Rngs(2))
    weights = np.array([0.2, 0.5, 0.3])
    mixed = losses.mixture_bce(weights)(model, {"inputs": inputs, "labels": labels})
    soft = losses.sigmoid_bce()(model, {"inputs": inputs, "targets": labels @ weights[:, None]})
    np.testing.assert_allclose(mixed, soft, rtol=1e-6)
    graphdef, params = nnx.split(model)
    for i in range(3):
        one_hot = np.eye(3)[i]

        def mean_loss(p, loss, batch):
            return jnp.mean(loss(nnx.merge(graphdef, p), batch))

        g_mix = jax.grad(mean_loss)(
            params, losses.mixture_bce(one_hot), {"inputs": inputs, "labels": labels}
        )
        g_src = jax.grad(mean_loss)(
            params, losses.sigmoid_bce(), {"inputs": inputs, "targets": labels[:, i : i + 1]}
        )
        for a, b in zip(jax.tree.leaves(g_mix), jax.tree.leaves(g_src), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError):
        losses.mixture_bce([0.5, 0.6])


def test_packed_mixture_draws_by_lambda():
    sources = [
        [np.full(n, 10 + i) for n in (3, 5, 7)] for i in range(3)
    ]  # source i's documents are made of token 10 + i
    only_one = pretrain.PackedMixture(sources, [0, 1, 0], seq_len=8, batch_size=4, eos_id=0)
    batch = only_one.batch(np.random.default_rng(0))
    assert batch["tokens"].shape == (4, 8) and (batch["source"] == 1).all()
    assert set(np.unique(batch["tokens"])) <= {0, 11}
    mixed = pretrain.PackedMixture(sources, [0.7, 0.3, 0.0], seq_len=64, batch_size=32, eos_id=0)
    rng = np.random.default_rng(1)
    tokens = np.concatenate([mixed.batch(rng)["tokens"].ravel() for _ in range(10)])
    share = np.mean(tokens[tokens > 0] == 10)
    assert 0.65 < share < 0.75 and not (tokens == 12).any()
    # A batch depends only on the generator state (resumable by checkpointing the generator).
    a, b = np.random.default_rng(5), np.random.default_rng(5)
    np.testing.assert_array_equal(mixed.batch(a)["tokens"], mixed.batch(b)["tokens"])


def test_dp_finetuning_with_mask_leaves_frozen_params_bit_identical():
    config = gpt2.GPT2Config.tiny(n_layer=3, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    model = gpt2.GPT2(config, rngs=nnx.Rngs(0))
    mask = gpt2.trainable_mask(model, last_n_blocks=2)
    before = {
        jax.tree_util.keystr(p): np.array(v)
        for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    }
    tokens = np.random.default_rng(0).integers(0, 64, size=(40, 8)).astype(np.int32)

    def gather_tokens(idx):
        keep = idx >= 0
        return {"tokens": tokens[np.where(keep, idx, 0)] * keep[:, None]}

    train_config = private_config(steps=2, batch_size=8, learning_rate=0.05)
    trainer = engine.Trainer(
        train_config,
        model,
        losses.next_token_nll(mask_key=None),
        trainable_mask=mask,
        num_units=40,
        noise_key=jax.random.key(0),
    )
    result = engine.fit(
        trainer,
        engine.IndexedData(gather=gather_tokens, num_examples=40),
        rng=np.random.default_rng(0),
    )
    after = {
        jax.tree_util.keystr(p): np.array(v)
        for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(result.model, nnx.Param))[0]
    }
    flags = dict(zip(before, jax.tree.leaves(mask), strict=True))
    assert set(after) == set(before) and not all(flags.values()) and any(flags.values())
    for name, trainable in flags.items():
        if trainable:
            assert not np.array_equal(before[name], after[name]), name
        else:
            assert before[name].tobytes() == after[name].tobytes(), name
    assert set(result.state.params) == {n for n, t in flags.items() if t}


@pytest.mark.parametrize("chunk_size", [None, 8, "public"])
def test_a_consumed_state_is_refused_in_one_line(chunk_size):
    # Every step donates its input state's buffers to the state it returns.
    if chunk_size == "public":
        config = TrainConfig(steps=2, batch_size=12, learning_rate=0.1, progress=False)
        trainer = engine.Trainer(config, MLP(4, 3, nnx.Rngs(0)), LOSS)
        step = trainer.public_step
    else:
        trainer = make_trainer(private_config(steps=2, chunk_size=chunk_size))
        step = trainer.private_step
    state = trainer.init_state()
    result = engine.fit(trainer, DATA, state=state, rng=np.random.default_rng(0))
    assert int(result.state.step) == 2
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(state.params))
    for reuse in (
        lambda: engine.fit(trainer, DATA, state=state, rng=np.random.default_rng(0)),
        lambda: step(state, DATA, np.random.default_rng(0)),
    ):
        with pytest.raises(ValueError, match="consumed by an earlier step") as info:
            reuse()
        assert "FitResult.state" in str(info.value) and "init_state()" in str(info.value)
    engine.fit(trainer, DATA, state=trainer.init_state(), rng=np.random.default_rng(1))
