"""Checkpoints: a stopped and resumed private run is bit-identical to an uninterrupted one."""

import jax
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.privacy.accounting import PrivacyLedger, dpsgd_event
from dpmix_jax.train import Checkpointer, engine, losses


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


RS = np.random.default_rng(0)
X = RS.normal(size=(80, 4)).astype(np.float32)
Y = RS.integers(0, 3, size=80)


def gather(idx):
    keep = idx >= 0
    rows = np.where(keep, idx, 0)
    return {"inputs": X[rows] * keep[:, None], "label": Y[rows] * keep}


DATA = engine.IndexedData(gather=gather, num_examples=80)
CONFIG = engine.TrainConfig(
    steps=6,
    batch_size=10,
    learning_rate=0.05,
    optimizer="adam",
    private=True,
    clip_norm=1.0,
    delta=1e-5,
    noise_multiplier=1.2,
    pad_multiple=8,
    checkpoint_every=2,
    log_every=None,
    progress=False,
)


def new_trainer():
    return engine.Trainer(
        CONFIG,
        MLP(nnx.Rngs(0)),
        losses.softmax_cross_entropy(),
        num_units=80,
        noise_key=jax.random.key(42),
    )


def test_resume_is_bit_identical_and_ledger_not_double_counted(tmp_path):
    reference = engine.fit(new_trainer(), DATA, rng=np.random.default_rng(7))

    # First job: stops ("is killed") after step 3; checkpoints exist for steps 2 and 3.
    first = engine.fit(
        new_trainer(),
        DATA,
        rng=np.random.default_rng(7),
        checkpointer=Checkpointer(tmp_path),
        until=3,
    )
    assert first.ledger.count == 3
    checkpointer = Checkpointer(tmp_path)
    assert checkpointer.latest_step() == 3
    # Second job: a fresh process state; the seed given is ignored in favour of the checkpoint.
    resumed = engine.fit(
        new_trainer(), DATA, rng=np.random.default_rng(12345), checkpointer=checkpointer
    )
    assert int(resumed.state.step) == CONFIG.steps
    for name, value in reference.state.params.items():
        assert np.asarray(value).tobytes() == np.asarray(resumed.state.params[name]).tobytes()
    assert resumed.ledger.count == CONFIG.steps == reference.ledger.count
    assert resumed.ledger.epsilon(1e-5) == reference.ledger.epsilon(1e-5)
    assert resumed.ledger.epsilon(1e-5) == pytest.approx(new_trainer().plan.spent().epsilon)
    # The noise key (secret) and the sampler continue exactly as well.
    ref_key = jax.random.key_data(reference.state.opt_state[0].key)
    np.testing.assert_array_equal(ref_key, jax.random.key_data(resumed.state.opt_state[0].key))
    assert resumed.rng.bit_generator.state == reference.rng.bit_generator.state


def test_checkpoint_round_trip_and_errors(tmp_path):
    trainer = new_trainer()
    state = trainer.init_state()
    ledger = PrivacyLedger()
    ledger.record(dpsgd_event(noise_multiplier=1.0, sampling_rate=0.1, steps=1), count=5)
    rng = np.random.default_rng(3)
    rng.random(10)
    checkpointer = Checkpointer(tmp_path / "ck", max_to_keep=1)
    with pytest.raises(ValueError, match="no checkpoint"):
        checkpointer.restore(state)
    checkpointer.save(5, state, rng=rng, ledger=ledger)
    restored, restored_rng, restored_ledger = checkpointer.restore(state)
    assert restored_ledger.state_dict() == ledger.state_dict()
    assert restored_rng.random() == rng.random()
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(restored.params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="step 4"):
        checkpointer.restore(state, step=4)
    with pytest.raises(ValueError):
        Checkpointer(tmp_path / "x", max_to_keep=0)
