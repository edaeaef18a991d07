"""k-scaling with trained proxies: label functions, the config's T/η schedule, an end-to-end
run."""

import dataclasses
import functools
import json
import math

import numpy as np
import pytest

from dpmix_jax import mixing
from dpmix_jax.mixing import exponential_oracle
from dpmix_jax.pipeline.image import ModelSpec
from dpmix_jax.privacy import accounting
from dpmix_jax.train import TrainConfig
from experiments import k_scaling
from experiments.configs import k_scaling as configs


def test_digit_label_functions_are_all_distinct_nontrivial_subsets():
    every = k_scaling.digit_label_functions(1022, seed=0)
    assert every.shape == (10, 1022)
    sizes = every.sum(axis=0)
    assert sizes.min() == 1 and sizes.max() == 9  # no empty or full subset
    codes = (every.astype(int) * (2 ** np.arange(10))[:, None]).sum(axis=0)
    np.testing.assert_array_equal(np.sort(codes), np.arange(1, 1023))  # each subset once


def test_digit_label_functions_nest_and_depend_on_the_seed():
    large = k_scaling.digit_label_functions(1000, seed=3)
    np.testing.assert_array_equal(large[:, :32], k_scaling.digit_label_functions(32, seed=3))
    assert len({tuple(c) for c in large.T}) == 1000
    assert not np.array_equal(large[:, :32], k_scaling.digit_label_functions(32, seed=4))
    for bad in (0, 1023):
        with pytest.raises(ValueError, match="count"):
            k_scaling.digit_label_functions(bad, seed=0)


def test_the_config_schedules_with_its_budget():
    config = configs.get_config("cpu")  # n = 3000, ε = 1, δ = 1e-5, max_steps = 1000
    steps, rate = config.schedule(32, "mirror_descent", 20.0)
    # √(2 ln 32 / 1000) / 20 = 0.0041628 (`mixing.scaling.mirror_descent_learning_rate`).
    assert steps == 1000 and rate == pytest.approx(config.step_size * 0.004162773, rel=1e-6)
    assert config.schedule(1000, "frank_wolfe", 20.0) == (26, None)
    # Both Frank-Wolfe oracles run the same T_k (Talwar, Thakurta and Zhang's schedule).
    assert config.schedule(1000, "frank_wolfe_exponential", 20.0) == (26, None)
    assert config.solvers == configs.SOLVERS


def test_noise_levels_are_calibrated_per_solver_and_step_count():
    config = _tiny_config()
    levels = k_scaling.noise_levels(config)
    assert set(levels) == set(config.solvers)
    for solver, by_steps in levels.items():
        assert set(by_steps) == {config.schedule(k, solver, 1.0)[0] for k in config.ks}
    # σ of DP-SGD at q = b / n for the Gaussian solvers; ε_0 per selection for the exponential.
    q = config.batch_size / config.num_examples
    for steps, sigma in levels["frank_wolfe"].items():
        event = accounting.dpsgd_event(noise_multiplier=sigma, sampling_rate=q, steps=steps)
        assert accounting.epsilon(event, delta=config.delta) <= config.epsilon
    for steps, step_epsilon in levels["frank_wolfe_exponential"].items():
        event = exponential_oracle.exponential_frank_wolfe_event(step_epsilon, steps)
        spent = accounting.epsilon(event, delta=config.delta, accountant="rdp")
        assert config.epsilon * (1 - 1e-3) <= spent <= config.epsilon


def test_the_exponential_oracle_runs_as_a_study_solver():
    preds = np.random.default_rng(0).uniform(0.05, 0.95, size=(300, 4))
    config = _tiny_config()
    run = functools.partial(
        k_scaling.private_run,
        config,
        "frank_wolfe_exponential",
        preds,
        steps=10,
        learning_rate=None,
        clip_norm=2.0,
        seed=0,
    )
    weights, epsilon = run(noise=0.3)
    assert weights.shape == (4,) and 0 < epsilon < math.inf
    direct = mixing.dp_exponential_frank_wolfe(
        preds, step_epsilon=0.3, delta=config.delta, steps=10, clip_norm=2.0, seed=0
    )
    np.testing.assert_array_equal(weights, direct.weights)
    assert run(noise=math.inf)[1] == math.inf  # the noiseless twin


def _tiny_config(**overrides):
    trained = configs.TrainedProxyConfig(
        num_label_functions=8,
        num_tasks=2,
        public_holdout=100,
        stand_in_tasks=2,
        image_size=8,
        model=ModelSpec(kind="mlp", mlp_hidden=(16,)),
        train=TrainConfig(
            steps=20, batch_size=32, learning_rate=3e-3, progress=False, log_every=None
        ),
        eval_batch_size=128,
    )
    settings = dict(
        ks=(2, 4, 8),
        seeds=(0,),
        num_examples=300,
        batch_size=60,
        max_steps=20,
        reference_steps=2000,
        slope_min_k=4,
        trained=trained,
    )
    return configs.KScalingConfig(**{**settings, **overrides})


@pytest.mark.slow
def test_tiny_trained_run_end_to_end(tmp_path, monkeypatch):
    config = _tiny_config()
    results = k_scaling.main(config, tmp_path, reproducible=True)
    rows = results["rows"]
    assert sorted((r["k"], r["task"]) for r in rows) == [(k, t) for k in (2, 4, 8) for t in (0, 1)]
    for row in rows:
        steps, _ = config.schedule(row["k"], "frank_wolfe", row["clip_norm"])
        assert row["frank_wolfe_steps"] == steps and row["mirror_descent_steps"] == 20
        assert row["frank_wolfe_exponential_steps"] == steps
        for solver in config.solvers:
            assert row[f"{solver}_epsilon"] <= config.epsilon + 1e-6
            # The reference is the exact optimum on the same split: nothing beats it.
            assert row[f"{solver}_excess"] >= -1e-4 and row[f"{solver}_bias"] >= -1e-4
        assert row["uniform_excess"] >= -1e-4
    written = json.loads((tmp_path / "k_scaling.json").read_text())
    assert written["proxies"] == "trained" and set(written["slopes"]) == set(config.solvers)
    assert written["noise"] == json.loads(json.dumps(k_scaling.noise_levels(config)))
    table = (tmp_path / "k_scaling.md").read_text()
    assert "0.49" in table and "frank_wolfe_exponential excess" in table
    assert "ε_0²/8-zCDP" in table and (tmp_path / "k_scaling.png").exists()

    # The proxy is cached per seed: the same settings reuse it without training...
    cached = k_scaling.proxy_outputs(config, 0, tmp_path / "proxies")

    def no_training(*args, **kwargs):
        raise AssertionError("trained again")

    monkeypatch.setattr(k_scaling.proxies, "train_image_proxy", no_training)
    again = k_scaling.proxy_outputs(config, 0, tmp_path / "proxies")
    np.testing.assert_array_equal(again["sensitive_logits"], cached["sensitive_logits"])
    assert again["sensitive_logits"].shape == (300, 8)
    # ... and other settings do not.
    with pytest.raises(AssertionError, match="trained again"):
        k_scaling.proxy_outputs(_tiny_config(num_examples=200), 0, tmp_path / "proxies")


def test_task_labels_follow_the_recorded_mixtures():
    config = _tiny_config(num_examples=20_000)
    membership = k_scaling.digit_label_functions(8, seed=0)
    class_ids = np.random.default_rng(0).integers(0, 10, 20_000)
    labels, weights = k_scaling.task_labels(config, class_ids, membership, seed=0)
    assert labels.shape == (20_000, 2) and weights.shape == (2, 8)
    assert ((weights > 0).sum(axis=1) == 3).all() and np.allclose(weights.sum(axis=1), 1)
    probs = membership[class_ids] @ weights.T
    assert np.abs(labels.mean(axis=0) - probs.mean(axis=0)).max() < 0.02


def test_paper_preset_refuses_missing_tfds_data(tmp_path):
    config = configs.get_config("paper")
    trained = dataclasses.replace(config.trained, tfds_data_dir=str(tmp_path))
    config = dataclasses.replace(config, trained=trained)
    for run in (lambda: k_scaling.main(config), lambda: k_scaling.proxy_outputs(config, 0, None)):
        with pytest.raises(ValueError, match="imagenet2012.*not prepared"):
            run()


def test_config_rejects_more_sources_than_heads():
    with pytest.raises(ValueError, match="exceeds"):
        _tiny_config(ks=(2, 4, 16))
    with pytest.raises(ValueError, match="1022"):
        configs.TrainedProxyConfig(num_label_functions=1023)


def test_mnist_5k_digits_are_the_whole_pool_resized():
    from dpmix_jax.data import builtin

    images, digits = builtin.mnist_5k_digits(image_size=8)
    assert images.shape == (5000, 8, 8, 1) and images.dtype == np.float32
    assert images.min() >= 0.0 and images.max() <= 1.0 and images.max() > 0.5
    np.testing.assert_array_equal(np.bincount(digits), np.full(10, 500))
