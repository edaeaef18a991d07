"""The k-scaling paper preset's `--smoke` mode, end to end on tfds' own mock data.

`tfds.testing.mock_data` stands in for prepared ImageNet-2012 and CIFAR-100: random images of
random sizes with random labels, served through the same `tfds.data_source` calls the paper
preset makes. The slow test runs `--preset paper --smoke` through the readiness check, the
loaders, 224x224 resizing, the 1000-head ResNet-50 proxy, the three DP-MixMin solvers and the
table.
"""

import dataclasses
import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

from dpmix_jax.data import tfds_sources
from experiments import k_scaling
from experiments.configs import k_scaling as configs

MOCK_EXAMPLES = 8  # per split; the smoke config's n (the whole mock CIFAR-100 train split)


def test_smoke_config_keeps_the_paper_settings():
    paper = configs.get_config("paper")
    smoke = configs.get_config("paper", smoke_test=True)
    for name in (
        "epsilon",
        "delta",
        "max_steps",
        "step_size",
        "clip_quantile",
        "clip_scale",
        "solvers",
        "reference_steps",
        "reference_learning_rate",
        "public_seed",
    ):
        assert getattr(smoke, name) == getattr(paper, name), name
    assert smoke.solvers == configs.SOLVERS
    for name in ("data", "model", "image_size", "num_label_functions", "tfds_data_dir"):
        assert getattr(smoke.trained, name) == getattr(paper.trained, name), name
    assert smoke.trained.model.kind == "resnet" and smoke.trained.image_size == 224
    assert smoke.trained.train.learning_rate == paper.trained.train.learning_rate
    assert smoke.trained.train.steps <= 2 and smoke.trained.train.batch_size == 2
    # The start of the paper's doubling grid, with a slope fitted over two of its k.
    assert smoke.ks == paper.ks[:3] and sum(k >= smoke.slope_min_k for k in smoke.ks) == 2
    assert smoke.num_examples == MOCK_EXAMPLES and smoke.seeds == (0,)
    for preset, proxies in (("cpu", "trained"), ("paper", "synthetic")):
        with pytest.raises(ValueError, match="smoke test applies to the paper preset"):
            configs.get_config(preset, proxies, smoke_test=True)


@pytest.mark.parametrize("argv", [["--smoke"], ["--preset", "cpu", "--smoke"]])
def test_smoke_needs_the_paper_preset(argv, capsys):
    with pytest.raises(SystemExit):
        k_scaling.cli(argv)
    assert "--smoke applies to --preset paper" in capsys.readouterr().err


def test_missing_tfds_data_is_refused_in_one_line_naming_it(tmp_path):
    config = configs.get_config("paper", smoke_test=True)
    trained = dataclasses.replace(config.trained, tfds_data_dir=str(tmp_path))
    out = tmp_path / "out"
    with pytest.raises(ValueError) as refused:
        k_scaling.main(dataclasses.replace(config, trained=trained), out)
    message = str(refused.value)
    assert "\n" not in message and "'imagenet2012'" in message and "'train'" in message
    assert f"not prepared in {tmp_path}" in message and "--preset cpu" in message
    assert not out.exists()  # refused before any work
    with pytest.raises(ValueError, match=r"^tfds data set 'cifar100' \(split 'test'\) is not"):
        tfds_sources.open_data_source("cifar100", "test", data_dir=str(tmp_path))


@pytest.mark.slow
def test_paper_smoke_writes_the_table_on_mock_data(tmp_path):
    out = tmp_path / "out"
    argv = ["--preset", "paper", "--smoke", "--reproducible", "--out", str(out)]
    with tfds.testing.mock_data(
        num_examples=MOCK_EXAMPLES, policy=tfds.testing.MockPolicy.USE_CODE
    ):
        results = k_scaling.cli(argv)
        cifar = tfds.data_source("cifar100", split="train")
        cifar_labels = [int(cifar[i]["label"]) for i in range(MOCK_EXAMPLES)]
        validation = tfds.data_source("imagenet2012", split="validation")
        validation_labels = {int(validation[i]["label"]) for i in range(MOCK_EXAMPLES)}
    config = configs.get_config("paper", smoke_test=True)

    rows = results["rows"]
    assert sorted((r["k"], r["task"]) for r in rows) == [(k, t) for k in (2, 4, 8) for t in (0, 1)]
    for row in rows:
        for solver in config.solvers:
            steps, _ = config.schedule(row["k"], solver, row["clip_norm"])
            assert row[f"{solver}_steps"] == steps
            assert 0 < row[f"{solver}_epsilon"] <= config.epsilon + 1e-6
            # The reference is the exact optimum on the same split: nothing beats it.
            assert row[f"{solver}_excess"] >= -1e-4 and row[f"{solver}_bias"] >= -1e-4

    # The proxy is the 1000-head ResNet-50, scored on the whole (mock) CIFAR-100 train split
    # as the sensitive data and on ImageNet validation images as the public holdout.
    with np.load(out / "proxies" / "proxy_seed0.npz") as proxy:
        assert proxy["sensitive_logits"].shape == (MOCK_EXAMPLES, 1000)
        assert proxy["holdout_logits"].shape == (config.trained.public_holdout, 1000)
        assert np.isfinite(proxy["sensitive_logits"]).all()
        np.testing.assert_array_equal(proxy["sensitive_ids"], cifar_labels)
        assert set(proxy["holdout_ids"].tolist()) <= validation_labels

    table = (out / "k_scaling.md").read_text()
    assert "1000-head proxy (ImageNet-2012 classes, tasks: CIFAR-100 classes)" in table
    assert all(f"\n| {k} | " in table for k in config.ks)
    assert all(f"{solver} excess" in table for solver in configs.SOLVERS)
    written = json.loads((out / "k_scaling.json").read_text())
    assert written["proxies"] == "trained" and set(written["slopes"]) == set(config.solvers)
    assert written["config"]["trained"]["model"]["resnet"]["dtype"] == "float32"
    assert (out / "k_scaling.png").exists()
