"""Checkpoints: a stopped and resumed private run is bit-identical to an uninterrupted one."""

import dataclasses
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.privacy.accounting import PrivacyLedger, dpsgd_event
from dpmix_jax.train import Checkpointer, TrainConfig, engine, losses
from tests.tiny_trainer import TinyMLP, tiny_data

DATA = tiny_data(80)
gather = DATA.gather
CONFIG = TrainConfig(
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
        TinyMLP(nnx.Rngs(0)),
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


def _saved_checkpoint(directory):
    trainer = new_trainer()
    result = engine.fit(
        trainer, DATA, rng=np.random.default_rng(7), checkpointer=Checkpointer(directory), until=2
    )
    return trainer, result, directory / "2"


def test_a_damaged_array_chunk_is_refused_naming_the_checkpoint(tmp_path):
    # Overwriting 8 bytes of an optimizer-state chunk used to resume silently with bad weights.
    rs = np.random.default_rng(0)
    state = {
        "params": np.float32(rs.normal(size=(128, 64))),
        "opt_state": {"mu": np.float32(rs.normal(size=(128, 64))), "nu": np.ones((128, 64))},
    }
    state = jax.tree.map(jax.numpy.asarray, state)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(1, state, rng=np.random.default_rng(0))
    folder = tmp_path / "1" / "state"
    chunk = max((p for p in folder.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    original = chunk.read_bytes()
    middle = len(original) // 2
    chunk.write_bytes(original[:middle] + b"\xff" * 8 + original[middle + 8 :])
    with pytest.raises(ValueError, match=f"{folder} do not match their checksums"):
        Checkpointer(tmp_path).restore(state)
    chunk.write_bytes(original)
    restored, _, _ = Checkpointer(tmp_path).restore(state)  # intact again
    np.testing.assert_array_equal(restored["params"], state["params"])


def test_damaged_or_truncated_metadata_is_refused_naming_the_file(tmp_path):
    trainer, _, folder = _saved_checkpoint(tmp_path / "ck")
    for name in ("meta", "checksums"):
        path = folder / name / "metadata"
        original = path.read_text()
        path.write_text(original[: len(original) // 2])  # truncated
        with pytest.raises(ValueError, match=str(path)):
            Checkpointer(tmp_path / "ck").restore(trainer.init_state())
        path.write_text(original)
    meta_path = folder / "meta" / "metadata"
    meta = json.loads(meta_path.read_text())
    meta["ledger"]["entries"][0]["count"] = 1  # valid JSON, but not what was saved
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=str(meta_path)):
        Checkpointer(tmp_path / "ck").restore(trainer.init_state())


def test_non_finite_parameters_stop_training_naming_the_step(tmp_path):
    # Adam moves each weight by about the learning rate per step: float32 overflows at step 4.
    config = dataclasses.replace(CONFIG, learning_rate=1e38, log_every=1)
    trainer = engine.Trainer(
        config,
        TinyMLP(nnx.Rngs(0)),
        losses.softmax_cross_entropy(),
        num_units=80,
        noise_key=jax.random.key(42),
    )
    with pytest.raises(ValueError, match=r"non-finite parameters at step 4 \(finite at step 3\)"):
        engine.fit(trainer, DATA, rng=np.random.default_rng(7), checkpointer=Checkpointer(tmp_path))
    assert Checkpointer(tmp_path).latest_step() == 2  # the non-finite state was not saved


def test_checkpoints_are_owner_only_and_only_the_newest_is_kept(tmp_path):
    # Two kept checkpoints of consecutive steps give that step's noise exactly.
    directory = tmp_path / "ck"
    engine.fit(
        new_trainer(),
        DATA,
        rng=np.random.default_rng(7),
        checkpointer=Checkpointer(directory),
        until=5,
    )
    assert sorted(p.name for p in directory.iterdir()) == ["5"]
    paths = [directory, *directory.rglob("*")]
    loose = [p for p in paths if p.stat().st_mode & 0o777 != (0o700 if p.is_dir() else 0o600)]
    assert len(paths) > 10 and loose == []


def test_a_result_saved_without_a_sampler_restores_none(tmp_path):
    trainer = new_trainer()
    params = trainer.init_state().params
    ledger = PrivacyLedger()
    ledger.record(dpsgd_event(noise_multiplier=1.0, sampling_rate=0.1, steps=1), count=6)
    checkpointer = Checkpointer(tmp_path / "final")
    checkpointer.save(6, params, rng=None, ledger=ledger)
    restored, rng, restored_ledger = Checkpointer(tmp_path / "final").restore(params)
    assert rng is None and restored_ledger.state_dict() == ledger.state_dict()
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(a, b)


# A file-size limit makes every write past 16 kB fail as a full disk does (EFBIG, not ENOSPC).
FULL_DISK = """
import resource, signal, sys
import numpy as np, jax.numpy as jnp
from dpmix_jax.train import Checkpointer
checkpointer = Checkpointer(sys.argv[1])
state = {"a": jnp.asarray(np.random.default_rng(0).normal(size=(200, 200)), jnp.float32)}
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (16_000, resource.RLIM_INFINITY))
try:
    checkpointer.save(1, state, rng=np.random.default_rng(0))
except OSError as error:
    print(error)
"""


def test_a_write_error_during_a_save_is_one_line_naming_the_folder(tmp_path):
    folder = tmp_path / "ck"
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(folder)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"cannot write the checkpoint of step 1 to {folder} (")
    assert "File too large" in done.stdout and done.stdout.count("\n") == 1
    assert "Traceback" not in done.stderr  # Orbax's writer threads log none either
