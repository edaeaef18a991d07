"""Runs one private step of a tiny Llama on one device and on 8 simulated CPU devices.

Launched by tests/models/test_llama_training.py in a fresh process whose XLA_FLAGS simulate 8
devices (the device count is fixed when JAX starts). Prints one JSON line: for each mesh (data=8,
and data=4 x model=2 with full fine-tuning and with LoRA), the largest absolute difference between
the parameters after the step on a single device and on the mesh, how far the step moved them, the
clipping the Trainer selected and whether parameters were really sharded.
"""

import json

import jax
import numpy as np
from flax import nnx

from dpmix_jax import parallel
from dpmix_jax.models import lora
from dpmix_jax.models.llama import Llama, LlamaConfig
from dpmix_jax.train import TrainConfig, engine, losses

CONFIG = LlamaConfig.tiny(vocab_size=64, hidden_size=32, intermediate_size=64, num_kv_heads=2)
CASES = {  # name: (data, model, LoRA adapters)
    "data8": (8, 1, False),
    "data4_model2": (4, 2, False),
    "lora_data4_model2": (4, 2, True),
}


def _data() -> engine.IndexedData:
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, CONFIG.vocab_size, size=(64, 12)).astype(np.int32)
    mask = (np.arange(12)[None] < rng.integers(2, 13, 64)[:, None]).astype(np.int32)

    def gather(indices):
        keep = indices >= 0
        rows = np.where(keep, indices, 0)
        return {"tokens": tokens[rows], "mask": mask[rows] * keep[:, None]}

    return engine.IndexedData(gather=gather, num_examples=64)


def run(adapters: bool, mesh, data: engine.IndexedData):
    """(start, parameters after one private step, the Trainer's clipping, whether sharded)."""
    model = Llama(CONFIG, rngs=nnx.Rngs(0))
    mask = None
    if adapters:
        lora.add_lora(model, lora.LoraConfig(rank=4, alpha=8.0), rngs=nnx.Rngs(1))
        mask = lora.trainable_mask(model)
    config = TrainConfig(
        steps=1, batch_size=16, learning_rate=0.05, optimizer="sgd", private=True, clip_norm=0.5,
        delta=1e-5, noise_multiplier=1.0, pad_multiple=16, chunk_size=16, progress=False,
    )  # fmt: skip
    trainer = engine.Trainer(
        config, model, losses.next_token_nll(), trainable_mask=mask,
        num_units=data.num_examples, noise_key=jax.random.key(7), mesh=mesh, fsdp_min_size=256,
    )  # fmt: skip
    state = trainer.init_state()
    start = jax.device_get(state.params)
    state = trainer.private_step(state, data, np.random.default_rng(3))
    sharded = any(not leaf.sharding.is_fully_replicated for leaf in jax.tree.leaves(state.params))
    return start, jax.device_get(state.params), trainer.clipping, sharded


def _max_abs(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(x - y))) for x, y in pairs)


def main():
    assert jax.device_count() == 8, jax.device_count()
    data = _data()
    report = {}
    for name, (data_axis, model_axis, adapters) in CASES.items():
        start, single, _, _ = run(adapters, None, data)
        mesh = parallel.make_mesh(parallel.MeshConfig(data=data_axis, model=model_axis))
        _, multi, clipping, sharded = run(adapters, mesh, data)
        report[name] = {
            "max_diff": _max_abs(single, multi),
            "moved": _max_abs(single, start),
            "clipping": clipping,
            "sharded": sharded,
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
