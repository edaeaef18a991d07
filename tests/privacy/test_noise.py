"""Gaussian noise scale, the DP-SGD step, the plan, and compilation counts."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

from dpmix_jax.privacy import accounting, clipping, gaussian_noise, noise, plan, sampling


def test_noise_stddev_matches_sigma_times_sensitivity():
    sigma, clip = 1.3, 0.7
    transform = gaussian_noise.add_gaussian_noise(sigma * clip, jax.random.key(42))
    zeros = {"a": jnp.zeros((200, 100)), "b": jnp.zeros(5_000)}
    state = transform.init(zeros)
    noisy, state = transform.update(zeros, state)
    draws = np.concatenate([np.ravel(x) for x in jax.tree.leaves(noisy)])
    # 25,000 draws: the sample stddev is within ~1.5% of the truth at 3.5 standard errors.
    assert np.std(draws) == pytest.approx(sigma * clip, rel=0.016)
    assert abs(np.mean(draws)) < 3.5 * sigma * clip / np.sqrt(draws.size)
    assert stats.normaltest(draws).pvalue > 1e-3
    again, _ = transform.update(zeros, state)
    assert not np.allclose(noisy["b"], again["b"])  # a fresh key every step


def test_noise_is_reproducible_from_the_key_and_independent_across_leaves():
    transform = gaussian_noise.add_gaussian_noise(1.0, jax.random.key(0))
    tree = {"a": jnp.zeros(1000), "b": jnp.zeros(1000)}
    first, _ = transform.update(tree, transform.init(tree))
    second, _ = transform.update(tree, transform.init(tree))
    np.testing.assert_array_equal(first["a"], second["a"])
    assert abs(np.corrcoef(first["a"], first["b"])[0, 1]) < 0.15


def linear_loss(w, example):
    return 0.5 * jnp.sum((example["x"] @ w - example["y"]) ** 2)


def test_dp_sgd_step_is_noisy_sum_over_expected_batch_then_optimizer():
    grad_sum = clipping.clipped_grad_sum(linear_loss, clip_norm=0.5)
    key = jax.random.key(3)
    optimizer = noise.private_optimizer(
        optax.sgd(0.1), noise_multiplier=2.0, sensitivity=0.5, expected_batch_size=10.0, key=key
    )
    params = jnp.ones(4)
    batch = {"x": jax.random.normal(jax.random.key(1), (8, 4)), "y": jnp.zeros(8)}
    mask = np.arange(8) < 6
    new_params, _, _ = noise.make_dp_sgd_step(grad_sum, optimizer)(
        params, optimizer.init(params), batch, mask
    )
    total, _ = grad_sum(params, batch, mask)
    _, noise_key = jax.random.split(key)
    expected_noise = gaussian_noise.gaussian_noise_tree(noise_key, total, 2.0 * 0.5)
    expected = params - 0.1 * (total + expected_noise) / 10.0
    np.testing.assert_allclose(new_params, expected, rtol=1e-6)


def test_bfloat16_updates_are_noised_and_divided_in_float32_then_cast_last():
    key = jax.random.key(5)
    optimizer = noise.private_optimizer(
        optax.sgd(1.0), noise_multiplier=2.0, sensitivity=0.5, expected_batch_size=7.0, key=key
    )
    params = jnp.zeros(4000, jnp.bfloat16)
    total = jax.random.normal(jax.random.key(6), (4000,), jnp.float32) * 3.0
    updates, _ = optimizer.update(total.astype(jnp.bfloat16), optimizer.init(params), params)
    _, noise_key = jax.random.split(key)
    noisy_sum = total.astype(jnp.bfloat16).astype(jnp.float32) + gaussian_noise.gaussian_noise_tree(
        noise_key, params, 2.0 * 0.5
    )
    assert noisy_sum.dtype == jnp.float32
    assert updates.dtype == jnp.bfloat16
    np.testing.assert_array_equal(updates, -(noisy_sum * (1 / 7.0)).astype(jnp.bfloat16))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"sensitivity": 0.0}, "sensitivity"),
        ({"expected_batch_size": 0.0}, "expected_batch_size"),
    ],
)
def test_bad_private_optimizer_input_is_rejected(kwargs, message):
    args = {"noise_multiplier": 1.0, "sensitivity": 1.0, "expected_batch_size": 8.0} | kwargs
    with pytest.raises(ValueError, match=message):
        noise.private_optimizer(optax.sgd(0.1), key=jax.random.key(0), **args)


def test_training_loop_compiles_once_per_padded_size():
    traces = []

    def loss(w, example):
        traces.append(example["x"].shape)  # runs only while tracing
        return linear_loss(w, example)

    grad_sum = clipping.clipped_grad_sum(loss, clip_norm=1.0)
    optimizer = noise.private_optimizer(
        optax.sgd(0.05),
        noise_multiplier=1.0,
        sensitivity=1.0,
        expected_batch_size=20.0,
        key=jax.random.key(0),
    )
    step = jax.jit(noise.make_dp_sgd_step(grad_sum, optimizer))
    data = {
        "x": np.random.default_rng(0).normal(size=(400, 4)).astype(np.float32),
        "y": np.zeros(400, np.float32),
    }
    sampler = sampling.PoissonSampler(sampling_rate=0.05, pad_multiple=16)
    rng = np.random.default_rng(1)
    params, state = jnp.zeros(4), optimizer.init(jnp.zeros(4))
    sizes = set()
    for _ in range(40):
        batch = sampler.sample(rng, 400)
        sizes.add(batch.indices.shape[0])
        rows = np.where(batch.mask, batch.indices, 0)
        params, state, _ = step(params, state, {k: v[rows] for k, v in data.items()}, batch.mask)
    assert len(traces) == len(sizes) >= 1
    assert step._cache_size() == len(sizes)


def test_plan_drives_sampler_noise_and_accountant_from_one_config():
    config = plan.DpSgdConfig(epsilon=2.0, delta=1e-5, clip_norm=1.0, batch_size=64, steps=100)
    resolved = plan.plan_dp_sgd(config, num_units=6400)
    assert resolved.sampling_rate == 0.01
    assert resolved.sampler().sampling_rate == resolved.sampling_rate
    assert resolved.expected_batch_size == pytest.approx(64)
    direct = accounting.epsilon(
        accounting.dpsgd_event(
            noise_multiplier=resolved.noise_multiplier, sampling_rate=0.01, steps=100
        ),
        delta=1e-5,
    )
    assert resolved.spent().epsilon == pytest.approx(direct)
    assert 0.99 * 2.0 <= direct <= 2.0
    ledger = accounting.PrivacyLedger()
    for _ in range(100):
        ledger.record(resolved.step_event())
    assert ledger.epsilon(1e-5) == pytest.approx(direct, rel=1e-9)


def test_user_level_plan_uses_the_user_sampler():
    config = plan.DpSgdConfig(
        epsilon=1.0, delta=1e-5, clip_norm=1.0, batch_size=10, steps=20, max_examples_per_user=4
    )
    resolved = plan.plan_dp_sgd(config, num_units=100)
    sampler = resolved.sampler()
    assert isinstance(sampler, sampling.UserPoissonSampler)
    assert sampler.sampling_rate == 0.1 and sampler.max_examples_per_user == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": 0.0}, "epsilon"),
        ({"epsilon": None}, "noise_multiplier"),
        ({"delta": 1.0}, "delta"),
        ({"clip_norm": -1.0}, "clip_norm"),
        ({"batch_size": 0}, "batch_size"),
        ({"steps": 0}, "steps"),
        ({"max_examples_per_user": 0}, "max_examples_per_user"),
    ],
)
def test_bad_plan_config_is_rejected(kwargs, message):
    args = {"epsilon": 1.0, "delta": 1e-5, "clip_norm": 1.0, "batch_size": 8, "steps": 5} | kwargs
    with pytest.raises(ValueError, match=message):
        plan.DpSgdConfig(**args)
