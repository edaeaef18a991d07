"""The throughput benchmark for research code (`dpmix_jax.bench`): a caller's own model and loss
timed non-private and on every DP path, no recompilation after warm-up, each step the update it
claims to be, LoRA rows on a language model, and `dpmix bench --model MODULE:FACTORY`."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dpmix_jax import bench
from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.models.mlp import MLP, MLPConfig

FAST = bench.ThroughputSettings(warmup_steps=1, rounds=2, steps_per_round=2, microbatch_size=4)
BATCH = {
    "x": np.random.default_rng(0).standard_normal((8, 4, 4, 1)).astype(np.float32),
    "y": np.arange(8, dtype=np.int32) % 3,
}


def make_mlp() -> MLP:
    return MLP(MLPConfig(in_features=16, hidden=(8,)), 3, rngs=nnx.Rngs(0))


def classification_loss(model, batch):
    return optax.softmax_cross_entropy_with_integer_labels(model(batch["x"]), batch["y"])


def tiny_target() -> bench.Target:
    """The factory `dpmix bench --model tests.test_bench:tiny_target` calls."""
    return bench.Target(
        make_model=make_mlp, loss=classification_loss, batch=BATCH,
        methods=("nonprivate", "dp_vmap", "dp_ghost"), name="tiny_mlp",
    )  # fmt: skip


def test_every_path_is_timed_without_recompiling():
    methods = ("nonprivate", "dp_vmap", "dp_microbatch", "dp_ghost", "dp_bandmf", "trainer_dp")
    rows = bench.throughput(make_mlp, classification_loss, BATCH, methods=methods, settings=FAST)
    assert [row["method"] for row in rows] == list(methods)
    for row in rows:
        assert row["compiles"] == 0 and row["compiles_warmup"] >= 1, row
        assert row["examples_per_second"] == pytest.approx(8 / row["median_step_seconds"])
        low, high = row["round_median_range_seconds"]
        assert 0 < low <= high
        assert row["peak_memory_bytes"] > 0  # XLA's estimate on CPU
        assert row["trainable_parameters"] == 16 * 8 + 8 + 8 * 3 + 3
    assert set(bench.ratios(rows)) == set(methods) - {"nonprivate"}
    table = bench.table(rows)
    assert table.count("\n") == len(rows) + 1 and "| dp_ghost | 8 |" in table


def test_the_nonprivate_step_is_sgd_and_the_dp_step_adds_noise_of_sigma_c_over_b():
    params = nnx.state(make_mlp(), nnx.Param)
    graph, _, rest = nnx.split(make_mlp(), nnx.Param, ...)

    def mean_loss(p):
        return jnp.mean(classification_loss(nnx.merge(graph, p, rest), BATCH))

    grads = jax.grad(mean_loss)(params)
    expected = jax.tree.map(lambda p, g: p - FAST.learning_rate * g, params, grads)
    runner = bench.build_runner("nonprivate", make_mlp, classification_loss, BATCH, FAST)
    runner.step()
    for got, want in zip(jax.tree.leaves(runner.params()), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    # With σ = 100 the noise dominates the clipped signal: the update differs from SGD's by
    # N(0, (lr σ C / B)²) per coordinate, lr σ C / B = 0.01 · 100 · 1 / 8 = 0.125.
    loud = dataclasses.replace(FAST, noise_multiplier=100.0)
    noisy = bench.build_runner("dp_ghost", make_mlp, classification_loss, BATCH, loud)
    noisy.step()
    difference = np.concatenate([
        (np.asarray(a) - np.asarray(b)).ravel()
        for a, b in zip(jax.tree.leaves(noisy.params()), jax.tree.leaves(expected), strict=True)
    ])  # fmt: skip
    assert 0.1 < difference.std() < 0.15, difference.std()


def test_lora_rows_train_the_adapters_alone():
    config = GPT2Config.tiny(vocab_size=64, n_positions=16)
    ids = np.random.default_rng(0).integers(0, 64, (4, 9)).astype(np.int32)

    def lm_loss(model, batch):
        logits = model(batch["ids"][:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean(-1)

    rows = bench.throughput(
        lambda: GPT2(config, rngs=nnx.Rngs(0)), lm_loss, {"ids": ids},
        methods=("nonprivate", "lora_nonprivate", "lora_dp"), settings=FAST,
    )  # fmt: skip
    full, adapters, private = (row["trainable_parameters"] for row in rows)
    assert adapters == private and 0 < adapters < full / 2
    assert all(row["compiles"] == 0 for row in rows)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tests.test_bench", "--model takes MODULE:FACTORY"),
        ("no_such_module_here:f", "module no_such_module_here does not import"),
        ("tests.test_bench:missing", "tests.test_bench has no callable missing"),
        ("tests.test_bench:make_mlp", r"make_mlp\(\) returned a MLP, not a dpmix_jax.bench.Target"),
    ],
)
def test_a_bad_target_is_one_line(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        bench.load_target(spec)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"methods": ("nonprivate", "dp_sgd")}, "methods must be a non-empty subset"),
        ({"methods": ("dp_microbatch",), "settings": bench.ThroughputSettings()},
         "dp_microbatch needs a microbatch_size"),
    ],
)  # fmt: skip
def test_bad_methods_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        bench.throughput(make_mlp, classification_loss, BATCH, **kwargs)


def test_dpmix_bench_times_a_model_named_by_module_and_factory(tmp_path, capsys):
    from dpmix_jax import cli

    out = tmp_path / "bench"
    argv = ["bench", "--model", "tests.test_bench:tiny_target", "--preset", "cpu_small",
            "--out", str(out)]  # fmt: skip
    assert cli.main(argv) in (0, None)
    report = json.loads((out / "bench.json").read_text())
    assert report["target"] == "tests.test_bench:tiny_target"
    assert [row["method"] for row in report["results"]] == ["nonprivate", "dp_vmap", "dp_ghost"]
    assert all(row["model"] == "tiny_mlp" for row in report["results"])
    assert set(report["ratios"]) == {"dp_vmap", "dp_ghost"}
    assert "| dp_ghost | 8 |" in capsys.readouterr().out
