"""The small-ε study: its summary, the sweep grid and its seed rule, and a tiny
end-to-end run whose spent ε is checked against dp_accounting directly."""

import dataclasses
import json
import math

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from dpmix_jax.pipeline import MixtureConfig, presets
from dpmix_jax.train import TrainConfig
from experiments import small_eps
from experiments.configs import small_eps as configs

QUIET = {"progress": False, "log_every": None}


def direct_pld_epsilon(noise_multiplier, sampling_rate, steps, delta):
    """ε of T Poisson-subsampled Gaussian steps, straight from dp_accounting's PLD."""
    return (
        privacy_loss_distribution.from_gaussian_mechanism(
            noise_multiplier, sampling_prob=sampling_rate, value_discretization_interval=1e-4
        )
        .self_compose(steps)
        .get_epsilon_for_delta(delta)
    )


def test_summary_counts_runs_below_the_uniform_reference():
    rows = [
        {"uniform_cosine": 0.5, "num_units": 10, "runs": [run(0.2, 0.4), run(1.0, 0.9)]},
        {"uniform_cosine": 0.7, "num_units": 12, "runs": [run(0.2, 0.8), run(1.0, 0.6)]},
    ]
    low, high = small_eps.summarize(rows, (0.2, 1.0))
    assert low["below_uniform"] == 1 and high["below_uniform"] == 1
    assert low["cosine_mean"] == pytest.approx(0.6) and low["cosine_std"] == pytest.approx(0.2)
    assert high["uniform_mean"] == pytest.approx(0.6) and high["mean_units"] == 11
    assert high["max_spent_epsilon"] == 1.0


def run(epsilon, cosine):
    return {"epsilon": epsilon, "cosine": cosine, "spent_epsilon": epsilon}


def test_sweep_varies_one_setting_at_a_time_around_the_demo():
    config = configs.get_config("cpu")
    base = configs.base_point(presets.image_demo_config())
    assert config.sweep[0] == base
    assert len(set(config.sweep)) == len(config.sweep)
    single = configs.one_at_a_time(base, steps=(50, base.steps), clip_norm=(2.5,))
    assert [p.label() for p in single] == [
        base.label(),
        base.label().replace("T=100", "T=50"),
        base.label().replace("C=5", "C=2.5"),
    ]
    # A new ρ keeps the sampling rate: b scales with ρ unless b is given too.
    rho = configs.vary(base, mix_fraction=0.1)
    assert rho.batch_size == pytest.approx(base.batch_size / 3)
    assert configs.vary(base, mix_fraction=0.1, batch_size=7).batch_size == 7
    for point in config.sweep:
        assert (
            point.batch_size / point.mix_fraction == pytest.approx(400) or point.mix_fraction == 0.3
        )


def test_sweep_seeds_must_not_touch_the_reported_data():
    config = configs.get_config("cpu")
    with pytest.raises(ValueError, match="disjoint"):
        dataclasses.replace(config, sweep_seeds=(4, 100))
    with pytest.raises(ValueError, match="disjoint"):
        dataclasses.replace(config, sweep_seeds=(0,), seeds=(1,))
    with pytest.raises(ValueError, match="mix_fraction"):
        configs.SweepPoint(
            steps=10, learning_rate=0.4, batch_size=10, clip_norm=1.0, mix_fraction=1.0
        )


@pytest.mark.slow
def test_tiny_run_writes_results_and_spends_the_target(tmp_path):
    image = presets.image_demo_config(
        model=presets.ModelSpec(kind="mlp", mlp_hidden=(16,)),
        proxy=TrainConfig(steps=30, batch_size=64, learning_rate=1e-2, **QUIET),
        mixture=MixtureConfig(steps=20, batch_size=60, clip_norm=5.0, learning_rate=0.4),
    )
    base = configs.base_point(image)
    config = configs.SmallEpsConfig(
        data="builtin",
        image=image,
        text=None,
        seeds=(0,),
        sweep=(base, dataclasses.replace(base, mix_fraction=0.5)),
        sweep_seeds=(100,),
        sweep_draws=2,
    )
    results = small_eps.main(config, tmp_path, reproducible=True)
    for name in ("results.json", "results.md", "cosine_vs_epsilon.png"):
        assert (tmp_path / name).stat().st_size > 0
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["noise_seeded"] is True
    (row,) = stored["defaults"]["image"]["rows"]
    reference = np.array(row["nonprivate_weights"])
    assert row["uniform_cosine"] == pytest.approx(1 / (math.sqrt(12) * np.linalg.norm(reference)))
    for cell in row["runs"]:
        # σ and q as the mixture stage stored them; ε recomputed from them independently.
        (stage,) = tmp_path.glob(
            f"stages/image0/*/seed0/mixture_parallel_eps{cell['epsilon']!r}.json"
        )
        mixture = json.loads(stage.read_text())
        direct = direct_pld_epsilon(
            mixture["noise_multiplier"], mixture["sampling_rate"], 20, image.delta
        )
        assert cell["spent_epsilon"] == pytest.approx(direct, rel=2e-3)
        assert 0.97 * cell["epsilon"] <= cell["spent_epsilon"] <= cell["epsilon"]
        weights = np.array(cell["weights"])
        assert cell["cosine"] == pytest.approx(
            weights @ reference / np.linalg.norm(weights) / np.linalg.norm(reference)
        )
    first, wider = results["sweep"]
    assert wider["mean_units"] > first["mean_units"]  # ρ = 0.5 gives D_mix more units
    assert first["delta"] == (0.0, 0.0)
    differences = [
        w["cosine"] - f["cosine"] for w, f in zip(wider["cells"], first["cells"], strict=True)
    ]
    assert wider["delta"][0] == pytest.approx(np.mean(differences))
    assert wider["delta"][1] == pytest.approx(np.std(differences) / np.sqrt(2))
    for point in (first, wider):
        assert [(c["seed"], c["draw"]) for c in point["cells"]] == [(100, 0), (100, 1)]
        for cell in point["cells"]:
            direct = direct_pld_epsilon(cell["noise_multiplier"], cell["sampling_rate"], 20, 1e-5)
            assert cell["spent_epsilon"] == pytest.approx(direct, rel=2e-3)
            assert cell["spent_epsilon"] <= config.sweep_epsilon
    text = (tmp_path / "results.md").read_text()
    assert "0.97 ± 0.01 (CheXpert)" in text
    assert text.count("| 20 | 0.4 | 60 | 5 |") == 2
