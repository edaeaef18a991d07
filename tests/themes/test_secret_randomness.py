"""Secret randomness by default, reproducibility by choice; one of ε and σ; no Poisson rate 1."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmix_jax.mixing import dp_mixmin
from dpmix_jax.privacy import DpSgdConfig, noise, plan_dp_sgd
from dpmix_jax.train import IndexedData, TrainConfig, Trainer, fit, losses

PREDS = np.random.default_rng(3).uniform(0.05, 0.95, size=(400, 5))
MIXMIN = dict(epsilon=1.0, delta=1e-5, steps=15, batch_size=40, clip_norm=1.0, learning_rate=0.5)


def test_dp_mixmin_without_a_seed_draws_secret_randomness_and_says_so():
    first, second = dp_mixmin(PREDS, **MIXMIN), dp_mixmin(PREDS, **MIXMIN)
    assert not first.seeded and not second.seeded
    assert not np.allclose(first.weights, second.weights)  # fresh noise and batches each run
    seeded = dp_mixmin(PREDS, seed=4, **MIXMIN)
    assert seeded.seeded
    np.testing.assert_array_equal(seeded.weights, dp_mixmin(PREDS, seed=4, **MIXMIN).weights)
    assert first.epsilon == pytest.approx(seeded.epsilon)  # the same mechanism, same account


def test_dp_frank_wolfe_without_a_seed_is_secret_too():
    fw = dict(MIXMIN, learning_rate=None, solver="frank_wolfe")
    first, second = dp_mixmin(PREDS, **fw), dp_mixmin(PREDS, **fw)
    assert not first.seeded and not np.allclose(first.history, second.history)


def _model():
    return nnx.Linear(3, 2, rngs=nnx.Rngs(0))


RS = np.random.default_rng(0)
X, Y = RS.normal(size=(50, 3)).astype(np.float32), RS.integers(0, 2, size=50)
DATA = IndexedData(
    gather=lambda idx: {"inputs": X[np.maximum(idx, 0)], "label": Y[np.maximum(idx, 0)]},
    num_examples=50,
)
PRIVATE = TrainConfig(
    steps=3,
    batch_size=10,
    learning_rate=0.1,
    optimizer="sgd",
    private=True,
    clip_norm=1.0,
    delta=1e-5,
    noise_multiplier=1.0,
    progress=False,
    log_every=None,
)


def _trained(noise_key=None, rng=None):
    trainer = Trainer(
        PRIVATE, _model(), losses.softmax_cross_entropy(), num_units=50, noise_key=noise_key
    )
    result = fit(trainer, DATA, rng=rng)
    return np.asarray(result.state.params[next(iter(result.state.params))])


def test_trainer_and_fit_default_to_secret_noise_and_sampling():
    assert not np.allclose(_trained(), _trained())
    seeded = lambda: _trained(jax.random.key(1), np.random.default_rng(1))  # noqa: E731
    np.testing.assert_array_equal(seeded(), seeded())


def test_private_optimizer_without_a_key_draws_a_secret_one():
    def noised():
        optimizer = noise.private_optimizer(
            optax.sgd(1.0), noise_multiplier=1.0, sensitivity=1.0, expected_batch_size=1.0
        )
        updates, _ = optimizer.update(jnp.zeros(8), optimizer.init(jnp.zeros(8)))
        return np.asarray(updates)

    assert not np.allclose(noised(), noised())


def test_generation_without_a_key_is_secret():
    from dpmix_jax.pate import generation
    from dpmix_jax.pate.teachers import TableTeachers

    # 40 teachers that all agree on a flat distribution over 12 tokens: decoding is pure noise.
    teachers = TableTeachers(jnp.zeros((40, 12, 12)))
    config = generation.GenerationConfig(max_new_tokens=12, epsilon=5.0)
    runs = [generation.generate(teachers, [1], config) for _ in range(4)]
    assert len({tuple(run.tokens) for run in runs}) > 1 and not any(run.seeded for run in runs)
    assert generation.generate(teachers, [1], config, key=jax.random.key(0)).seeded


@pytest.mark.parametrize("make", [DpSgdConfig, TrainConfig])
def test_a_fixed_sigma_and_a_target_epsilon_together_are_rejected(make):
    settings = dict(epsilon=0.5, noise_multiplier=0.6, delta=1e-5, clip_norm=1.0, steps=10)
    if make is TrainConfig:
        settings |= dict(batch_size=10, learning_rate=0.1, private=True)
    else:
        settings |= dict(batch_size=10)
    with pytest.raises(ValueError, match="epsilon=0.5 and noise_multiplier=0.6"):
        make(**settings)


def test_a_run_with_a_fixed_sigma_reports_the_epsilon_it_spent():
    config = DpSgdConfig(
        epsilon=None, noise_multiplier=0.6, delta=1e-5, clip_norm=1.0, batch_size=10, steps=100
    )
    spent = plan_dp_sgd(config, num_units=100).spent().epsilon
    assert spent > 5  # far above a small target: σ is not silently calibrated
    trainer = Trainer(
        dataclasses.replace(PRIVATE, noise_multiplier=0.6, steps=100, batch_size=10),
        _model(),
        losses.softmax_cross_entropy(),
        num_units=50,
    )
    result = fit(trainer, DATA)
    assert result.ledger.epsilon(1e-5) == pytest.approx(trainer.plan.spent().epsilon)


@pytest.mark.parametrize(("batch_size", "unit"), [(100, "examples"), (120, "examples")])
def test_poisson_rate_one_is_refused_naming_the_numbers(batch_size, unit):
    config = DpSgdConfig(epsilon=1.0, delta=1e-5, clip_norm=1.0, batch_size=batch_size, steps=10)
    with pytest.raises(ValueError, match=f"batch_size {batch_size} >= 100 {unit}.*rate would be 1"):
        plan_dp_sgd(config, num_units=100)


def test_poisson_rate_one_is_refused_at_user_level_and_in_dp_mixmin():
    users = DpSgdConfig(
        epsilon=1.0, delta=1e-5, clip_norm=1.0, batch_size=100, steps=10, max_examples_per_user=4
    )
    with pytest.raises(ValueError, match="batch_size 100 >= 83 users.*below the number of users"):
        plan_dp_sgd(users, num_units=83)
    with pytest.raises(ValueError, match="batch_size 400 >= 400 examples"):
        dp_mixmin(PREDS, **dict(MIXMIN, batch_size=400))
    # The no-noise control claims no privacy (ε = inf) and may use full batches.
    control = DpSgdConfig(
        epsilon=None, noise_multiplier=0.0, delta=1e-5, clip_norm=1.0, batch_size=100, steps=1
    )
    assert plan_dp_sgd(control, num_units=100).sampling_rate == 1.0


def test_enron_paper_preset_samples_users_at_a_rate_below_one():
    from experiments.configs import enron

    config = enron.get_config("paper")
    # 148 Enron users, 80% in train; D_ft holds 1 - ρ of them (the smallest at the largest ρ).
    train_users = 148 * config.split_fractions[0]
    smallest_ft = train_users * (1 - max(config.mix_fractions))
    assert config.pipeline.finetune.batch_size < 0.8 * smallest_ft  # q < 1 with room to spare
    assert config.pipeline.mixture.batch_size < 0.8 * train_users * min(config.mix_fractions)
