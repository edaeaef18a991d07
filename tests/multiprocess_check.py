"""DP fine-tuning of ResNet-tiny and GPT-2-tiny as one of the processes of a multi-process run.

Launched by tests/test_multiprocess.py: once alone, and as 2 processes joined by
`jax.distributed` on 127.0.0.1 (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID), each
with 2 simulated CPU devices. Every case trains 2 private steps, checkpoints with orbax, and a
fresh Trainer resumes from the checkpoint to step 4. Usage: `multiprocess_check.py OUT_DIR`.
Process 0 writes OUT_DIR/CASE.npz (the final parameters) and OUT_DIR/ledger.json; every process
writes OUT_DIR/rows_PROCESS.json, the number of example rows it read.
"""

import json
import os
import pathlib
import sys

from simulated_devices import xla_flags

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = xla_flags(2)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from dpmix_jax import parallel  # noqa: E402
from dpmix_jax.models import gpt2, resnet  # noqa: E402
from dpmix_jax.train import TrainConfig, checkpoint, engine, losses  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")
READ = {"rows": 0}


def _indexed(arrays):
    def gather(idx):
        READ["rows"] += int(idx.size)
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {k: v[rows] * keep.reshape(-1, *([1] * (v.ndim - 1))) for k, v in arrays.items()}

    return engine.IndexedData(gather=gather, num_examples=len(next(iter(arrays.values()))))


def cases():
    rs = np.random.default_rng(0)
    images = {
        "inputs": rs.normal(size=(64, 8, 8, 3)).astype(np.float32),
        "targets": rs.integers(0, 2, size=(64, 3)).astype(np.float32),
    }
    tokens = {"tokens": rs.integers(0, 512, size=(64, 16)).astype(np.int32)}
    yield (
        "resnet",
        lambda: resnet.ResNet(resnet.ResNetConfig.tiny(), 3, rngs=nnx.Rngs(0)),
        losses.sigmoid_bce(),
        _indexed(images),
        None,
    )
    yield (
        "gpt2",
        lambda: gpt2.GPT2(gpt2.GPT2Config.tiny(), rngs=nnx.Rngs(0)),
        losses.next_token_nll(mask_key=None),
        _indexed(tokens),
        lambda model: gpt2.trainable_mask(model, last_n_blocks=1),
    )


def main(out: pathlib.Path) -> None:
    if "JAX_NUM_PROCESSES" in os.environ:
        parallel.initialize(
            parallel.MeshConfig(
                distributed=True,
                coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                process_id=int(os.environ["JAX_PROCESS_ID"]),
            )
        )
    mesh = parallel.make_mesh(parallel.MeshConfig())
    config = TrainConfig(
        steps=4, batch_size=16, learning_rate=0.05, optimizer="adam", private=True,
        clip_norm=0.5, delta=1e-5, noise_multiplier=1.0, pad_multiple=8, progress=False,
        log_every=None,
    )  # fmt: skip
    ledgers = {}
    for name, make, loss, data, mask_fn in cases():
        for until in (2, 4):  # the second leg is a fresh Trainer resuming from the checkpoint
            model = make()
            trainer = engine.Trainer(
                config, model, loss, trainable_mask=None if mask_fn is None else mask_fn(model),
                num_units=data.num_examples, noise_key=jax.random.key(7), mesh=mesh,
                fsdp_min_size=1024,
            )  # fmt: skip
            checkpointer = checkpoint.Checkpointer(out / "checkpoints" / name)
            resumed_from = checkpointer.latest_step()
            result = engine.fit(
                trainer, data, rng=np.random.default_rng(3), checkpointer=checkpointer,
                until=until,
            )  # fmt: skip
            checkpointer.close()
        params = multihost_utils.process_allgather(result.state.params, tiled=True)
        ledgers[name] = {
            "steps": result.ledger.count,
            "epsilon": result.ledger.epsilon(config.delta),
            "resumed_from": resumed_from,
            "clipping": trainer.clipping,
        }
        if parallel.is_main_process():
            np.savez(out / f"{name}.npz", **{k: np.asarray(v) for k, v in params.items()})
    if parallel.is_main_process():
        (out / "ledger.json").write_text(json.dumps(ledgers))
    index = jax.process_index()
    (out / f"rows_{index}.json").write_text(json.dumps({"rows": READ["rows"]}))


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
