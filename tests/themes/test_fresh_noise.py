"""Every release of a reused object draws fresh noise, or the reuse is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmix_jax.privacy import noise
from dpmix_jax.train import IndexedData, TrainConfig, Trainer, fit, losses

RS = np.random.default_rng(0)
X, Y = RS.normal(size=(50, 40)).astype(np.float32), RS.integers(0, 25, size=50)
DATA = IndexedData(
    gather=lambda idx: {"inputs": X[np.maximum(idx, 0)], "label": Y[np.maximum(idx, 0)]},
    num_examples=50,
)
SIGMA, CLIP, LR = 2.0, 0.5, 1.0
ONE_STEP = TrainConfig(
    steps=1,
    batch_size=10,
    learning_rate=LR,
    optimizer="sgd",
    private=True,
    clip_norm=CLIP,
    delta=1e-5,
    noise_multiplier=SIGMA,
    progress=False,
    log_every=None,
)


def _trainer(noise_key=None):
    model = nnx.Linear(40, 25, rngs=nnx.Rngs(0))  # 1,025 parameters
    return Trainer(
        ONE_STEP, model, losses.softmax_cross_entropy(), num_units=50, noise_key=noise_key
    )


def _flat(params):
    return np.concatenate([np.ravel(np.asarray(v)) for v in params.values()])


def test_two_inits_of_one_private_optimizer_draw_independent_noise():
    optimizer = noise.private_optimizer(
        optax.sgd(1.0), noise_multiplier=SIGMA, sensitivity=CLIP, expected_batch_size=1.0
    )
    zeros = jnp.zeros(4000)
    first, _ = optimizer.update(zeros, optimizer.init(zeros), zeros)
    second, _ = optimizer.update(zeros, optimizer.init(zeros), zeros)
    # Independent N(0, (σC)²) draws: their difference has standard deviation √2·σC.
    assert np.std(first - second) == pytest.approx(np.sqrt(2) * SIGMA * CLIP, rel=0.05)


def test_two_fits_of_one_trainer_without_a_key_draw_independent_noise():
    trainer = _trainer()
    # The same Poisson batch twice: the one-step models differ by the noise alone,
    # lr·(z1 - z2)/b with z ~ N(0, (σC)²) per coordinate.
    first = fit(trainer, DATA, rng=np.random.default_rng(1))
    second = fit(trainer, DATA, rng=np.random.default_rng(1))
    difference = _flat(first.state.params) - _flat(second.state.params)
    expected = LR * np.sqrt(2) * SIGMA * CLIP / trainer.plan.expected_batch_size
    assert np.std(difference) == pytest.approx(expected, rel=0.1)


def test_a_second_run_on_a_callers_key_is_refused_unless_replayed_on_purpose():
    trainer = _trainer(jax.random.key(3))
    first = fit(trainer, DATA, rng=np.random.default_rng(1))
    with pytest.raises(ValueError, match="noise_key already drove a run from step 0"):
        fit(trainer, DATA, rng=np.random.default_rng(2))
    replay = fit(trainer, DATA, rng=np.random.default_rng(1), state=trainer.init_state())
    np.testing.assert_array_equal(_flat(first.state.params), _flat(replay.state.params))
