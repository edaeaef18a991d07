"""Runs steps of ResNet-tiny and GPT-2-tiny on one device and on 8 simulated CPU devices.

Launched by tests/test_parallel.py in a fresh process (the device count is fixed when JAX starts).
Prints one JSON line: for each case, the largest absolute difference between the parameters after
one step on a single device and on the mesh, and whether parameters were really sharded; for
GPT-2-tiny's FSDP mesh, what the compiled steps gather and how they place their outputs.
"""

import os

from simulated_devices import xla_flags

os.environ["XLA_FLAGS"] = xla_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import collections  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402

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


def make_trainer(case, mesh, config):
    make, loss, data, mask_fn = case
    model = make()
    mask = None if mask_fn is None else mask_fn(model)
    return engine.Trainer(
        config,
        model,
        loss,
        trainable_mask=mask,
        num_units=data.num_examples if config.private else None,
        noise_key=jax.random.key(7) if config.private else None,
        mesh=mesh,
        fsdp_min_size=1024,
    )


def run(case, mesh, config):
    data = case[2]
    trainer = make_trainer(case, mesh, config)
    state = trainer.init_state()
    initial = jax.device_get(state.params)
    rng = np.random.default_rng(3)
    if config.private:
        state = trainer.private_step(state, data, rng)
    else:
        state, _ = trainer.public_step(state, data, rng)
    sharded = any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.params))
    return initial, jax.device_get(state.params), sharded


_ALL_GATHER = re.compile(r"= \w+\[([\d,]*)\]\{[^}]*\} all-gather")


def full_parameter_gathers(compiled, shapes):
    """How many all-gathers of the compiled program produce an array of one of `shapes`."""
    results = collections.Counter(
        tuple(int(d) for d in m.group(1).split(",") if d)
        for m in _ALL_GATHER.finditer(compiled.as_text())
    )
    return sum(count for shape, count in results.items() if shape in shapes)


def program_report(config, public):
    """What the compiled steps of GPT-2-tiny (every weight trainable, Adam) on data=4 x model=2
    gather and where they put their outputs, with a control jitted to return replicated
    parameters (what a step that gathers full parameters looks like)."""
    mesh = parallel.make_mesh(parallel.MeshConfig(data=4, model=2))
    case = text_case()
    case = (*case[:3], None)
    report = {}
    for name, private in (("private", True), ("public", False)):
        trainer = make_trainer(case, mesh, config if private else public)
        state = trainer.init_state()
        shapes = {v.shape for v in state.params.values() if not v.sharding.is_fully_replicated}
        indices, mask = np.arange(16), np.ones(16, bool)
        ((batch, unit_mask),) = trainer._chunks(case[2].gather, indices, mask)
        args = (state, trainer.frozen, trainer.rest, batch, *([unit_mask] * private))
        step = trainer.jitted_step(state)
        compiled = step.lower(*args).compile()
        placed = jax.tree.map(lambda x: x.sharding, state)
        kept = all(
            a.is_equivalent_to(b, len(np.shape(x)))
            for a, b, x in zip(
                jax.tree.leaves(compiled.output_shardings[0]),
                jax.tree.leaves(placed),
                jax.tree.leaves(state),
                strict=True,
            )
        )
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        control = jax.jit(step.__wrapped__, out_shardings=replicated).lower(*args).compile()
        report[name] = {
            "sharded_parameters": len(shapes),
            "full_parameter_gathers": full_parameter_gathers(compiled, shapes),
            "control_full_parameter_gathers": full_parameter_gathers(control, shapes),
            "outputs_keep_placement": kept,
        }
        jax.block_until_ready(step(*args)[0])
        report[name]["donated"] = all(x.is_deleted() for x in jax.tree.leaves(state.params))
    return report


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
    fused = dataclasses.replace(config, chunk_size=None)
    public = TrainConfig(
        steps=1, batch_size=16, learning_rate=0.05, optimizer="sgd", progress=False
    )
    report = {}
    for name, case, shape, settings in [
        ("resnet_data8", image_case(), (8, 1), config),
        ("gpt2_data4_model2", text_case(), (4, 2), config),
        ("gpt2_data4_model2_unchunked", text_case(), (4, 2), fused),
        ("gpt2_data4_model2_public", text_case(), (4, 2), public),
    ]:
        start, single, _ = run(case, None, settings)
        mesh = parallel.make_mesh(parallel.MeshConfig(data=shape[0], model=shape[1]))
        _, multi, sharded = run(case, mesh, settings)
        diff = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(multi), strict=True)
        )
        moved = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(start), strict=True)
        )
        report[name] = {"max_diff": diff, "moved": moved, "sharded": sharded}
    # Adam: the optimizer state holds two more copies of every parameter.
    adam = {"optimizer": "adam", "learning_rate": 0.01}
    programs = (dataclasses.replace(fused, **adam), dataclasses.replace(public, **adam))
    report["programs"] = program_report(*programs)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
