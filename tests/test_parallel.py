"""The device mesh: 8 simulated CPU devices give the same updates as one device, and the
compiled steps keep the FSDP placement without gathering full parameters."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from dpmix_jax import parallel
from dpmix_jax.privacy import randomness
from dpmix_jax.train import TrainConfig
from tests.simulated_devices import xla_flags


def test_mesh_config_and_sharding_rule():
    with pytest.raises(ValueError):
        parallel.MeshConfig(data=0)
    with pytest.raises(ValueError):
        parallel.MeshConfig(model=0)
    with pytest.raises(ValueError, match="device count"):
        parallel.make_mesh(parallel.MeshConfig(data=2, model=3))
    mesh = parallel.make_mesh(parallel.MeshConfig())
    assert mesh.axis_names == ("data", "model")
    assert mesh.shape["data"] == jax.device_count()
    tree = {"big": np.zeros((8, 4096)), "small": np.zeros(3)}
    # A model axis of size 1 replicates everything.
    specs = parallel.tree_sharding(tree, mesh, min_size=16)
    assert all(s.spec == jax.sharding.PartitionSpec() for s in jax.tree.leaves(specs))
    assert parallel._leaf_spec((8, 4096), 2, 16) == jax.sharding.PartitionSpec(None, "model")
    assert parallel._leaf_spec((6, 3), 4, 16) == jax.sharding.PartitionSpec()
    assert parallel._leaf_spec((8, 4096), 2, 10**6) == jax.sharding.PartitionSpec()
    rows = np.arange(8)
    np.testing.assert_array_equal(parallel.process_rows(rows, mesh), rows)
    placed = parallel.shard_batch({"x": rows}, mesh)
    np.testing.assert_array_equal(np.asarray(placed["x"]), rows)


@pytest.mark.slow
def test_private_step_on_8_devices_matches_1_device():
    script = pathlib.Path(__file__).with_name("parallel_check.py")
    env = {**os.environ, "XLA_FLAGS": xla_flags(8)}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    programs = report.pop("programs")
    assert set(report) == {
        "resnet_data8",
        "gpt2_data4_model2",
        "gpt2_data4_model2_unchunked",
        "gpt2_data4_model2_public",
    }
    for case in report.values():
        assert case["moved"] > 1e-4  # the step really changed the parameters
        assert case["max_diff"] < 1e-5  # same batch, same noise, same update
    assert all(report[name]["sharded"] for name in report if name.startswith("gpt2"))
    # The compiled steps declare their shardings: the state comes back placed as it went in
    # (FSDP-sharded parameters and Adam moments), donated, with at most one gather of a full
    # parameter per sharded parameter; a step returning replicated parameters gathers each of
    # them and their moments (the control shows the count catches it).
    for step in ("private", "public"):
        program = programs[step]
        assert program["sharded_parameters"] >= 4
        assert program["outputs_keep_placement"] and program["donated"]
        assert program["full_parameter_gathers"] <= program["sharded_parameters"]
        assert program["control_full_parameter_gathers"] >= 3 * program["sharded_parameters"]


def test_mesh_flag_parsing_and_the_active_mesh_reaches_the_trainer():
    assert parallel.parse_mesh("data=4,model=2") == parallel.MeshConfig(data=4, model=2)
    assert parallel.parse_mesh("model=1") == parallel.MeshConfig()
    for bad in ("data=4,data=2", "batch=2", "data=two", "data"):
        with pytest.raises(ValueError, match="--mesh"):
            parallel.parse_mesh(bad)
    from flax import nnx

    from dpmix_jax.train import engine, losses

    config = TrainConfig(steps=1, batch_size=1, learning_rate=0.1, progress=False)
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    mesh = parallel.make_mesh(parallel.MeshConfig())
    try:
        parallel.set_active_mesh(mesh, 16)
        trainer = engine.Trainer(config, model, losses.softmax_cross_entropy())
        assert trainer.mesh is mesh and trainer._min_shard == 16
    finally:
        parallel.set_active_mesh(None)
    assert engine.Trainer(config, model, losses.softmax_cross_entropy()).mesh is None
    written = []
    parallel.on_main_process(lambda: written.append(1))
    assert written == [1] and parallel.is_main_process()
    np.testing.assert_array_equal(parallel.broadcast_from_main(np.arange(3)), np.arange(3))
    secrets = (0, 2**32, 2**128 - 1)
    assert [randomness.agree_secret(v) for v in secrets] == list(secrets)
    assert parallel.agree(True) and not parallel.agree(False)


def test_every_experiment_takes_mesh_and_distributed():
    from experiments import common_args

    parser = common_args.experiment_parser("quickstart", "test")
    try:
        args = parser.parse_args(["--mesh", f"data={jax.device_count()}"])
        assert args.mesh == f"data={jax.device_count()}" and not args.distributed
        assert parallel.active_mesh()[0].shape["data"] == jax.device_count()
        with pytest.raises(SystemExit):
            parser.parse_args(["--mesh", "data=3,model=5"])  # does not fit the devices
        parser.add_argument("--out")
        with pytest.raises(SystemExit):
            parser.parse_args(["--out", "gs://bucket/run"])  # a URL, not a mounted folder
    finally:
        parallel.set_active_mesh(None)
