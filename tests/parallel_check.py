"""Runs private steps of ResNet-tiny and GPT-2-tiny on one device and on 8 simulated CPU devices.

Launched by tests/test_parallel.py in a fresh process (the device count is fixed when JAX starts).
Prints one JSON line: for each case, the largest absolute difference between the parameters after
one private step on a single device and on the mesh, and whether parameters were really sharded.
"""

import os

from simulated_devices import xla_flags

os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from dpmix_jax import parallel  # noqa: E402
from dpmix_jax.models import gpt2, resnet  # noqa: E402
from dpmix_jax.train import TrainConfig, engine, losses  # noqa: E402


def image_case():
    rs = np.random.default_rng(0)
    images = rs.normal(size=(64, 8, 8, 3)).astype(np.float32)
    labels = rs.integers(0, 2, size=(64, 3)).astype(np.float32)

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {
            "inputs": images[rows] * keep[:, None, None, None],
            "targets": labels[rows] * keep[:, None],
        }

    make = lambda: resnet.ResNet(resnet.ResNetConfig.tiny(), 3, rngs=nnx.Rngs(0))
    return make, losses.sigmoid_bce(), engine.IndexedData(gather=gather, num_examples=64), None


def text_case():
    rs = np.random.default_rng(1)
    tokens = rs.integers(0, 512, size=(64, 16)).astype(np.int32)

    def gather(idx):
        keep = idx >= 0
        return {"tokens": tokens[np.where(keep, idx, 0)] * keep[:, None]}

    make = lambda: gpt2.GPT2(gpt2.GPT2Config.tiny(), rngs=nnx.Rngs(0))
    mask = lambda model: gpt2.trainable_mask(model, last_n_blocks=1)
    loss = losses.next_token_nll(mask_key=None)
    return make, loss, engine.IndexedData(gather=gather, num_examples=64), mask


def run(case, mesh, config):
    make, loss, data, mask_fn = case
    model = make()
    mask = None if mask_fn is None else mask_fn(model)
    trainer = engine.Trainer(
        config,
        model,
        loss,
        trainable_mask=mask,
        num_units=data.num_examples,
        noise_key=jax.random.key(7),
        mesh=mesh,
        fsdp_min_size=1024,
    )
    state = trainer.init_state()
    initial = jax.device_get(state.params)
    rng = np.random.default_rng(3)
    state = trainer.private_step(state, data, rng)
    sharded = any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.params))
    return initial, jax.device_get(state.params), sharded


def main():
    assert jax.device_count() == 8, jax.device_count()
    config = TrainConfig(
        steps=1,
        batch_size=16,
        learning_rate=0.05,
        optimizer="sgd",
        private=True,
        clip_norm=0.5,
        delta=1e-5,
        noise_multiplier=1.0,
        pad_multiple=16,
        chunk_size=16,
        microbatch_size=8,
        progress=False,
    )
    report = {}
    for name, case, shape in [
        ("resnet_data8", image_case(), (8, 1)),
        ("gpt2_data4_model2", text_case(), (4, 2)),
    ]:
        start, single, _ = run(case, None, config)
        mesh = parallel.make_mesh(parallel.MeshConfig(data=shape[0], model=shape[1]))
        _, multi, sharded = run(case, mesh, config)
        diff = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(multi), strict=True)
        )
        moved = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(start), strict=True)
        )
        report[name] = {"max_diff": diff, "moved": moved, "sharded": sharded}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
