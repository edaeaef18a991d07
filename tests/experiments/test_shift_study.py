"""The gradient-shift study: its tuning never reads the reported data, a tiny end-to-end run whose
cells share batches and noise and spend ε as dp_accounting computes it, and the stored page."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution

from dpmix_jax.mixing.solvers import DEFAULT_SHIFT, SHIFTS
from dpmix_jax.pipeline import ImagePipeline, MixtureConfig, presets, report
from dpmix_jax.train import TrainConfig
from experiments import shift_study
from experiments.configs import shift_study as configs

ROOT = pathlib.Path(__file__).resolve().parents[2]
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


def test_config_refuses_tuning_on_the_reported_data():
    config = configs.get_config()
    assert config.shifts == SHIFTS and config.epsilon == 1.0 and config.seeds == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="image_tuning_seeds.*shared: \\[0\\]"):
        dataclasses.replace(config, image_tuning_seeds=(0, 100))
    with pytest.raises(ValueError, match="text_tuning_seeds.*shared: \\[3\\]"):
        dataclasses.replace(config, text_tuning_seeds=(3,))
    with pytest.raises(ValueError, match="clip_factors"):
        dataclasses.replace(config, clip_factors=(0.5, 2.0))
    with pytest.raises(ValueError, match="shifts"):
        dataclasses.replace(config, shifts=("median",))


def test_learning_rate_follows_the_clip_norm():
    settings = MixtureConfig(steps=10, batch_size=5, clip_norm=5.0, learning_rate=0.4)
    assert shift_study.scaled_learning_rate(settings, 5.0) == pytest.approx(0.4)
    assert shift_study.scaled_learning_rate(settings, 20.0) == pytest.approx(0.1)
    frank_wolfe = MixtureConfig(
        steps=10, batch_size=5, clip_norm=5.0, learning_rate=None, solver="frank_wolfe"
    )
    assert shift_study.scaled_learning_rate(frank_wolfe, 1.0) is None


@pytest.mark.slow
def test_tiny_run_tunes_elsewhere_and_spends_the_target(tmp_path):
    image = presets.image_demo_config(
        model=presets.ModelSpec(kind="mlp", mlp_hidden=(16,)),
        proxy=TrainConfig(steps=30, batch_size=64, learning_rate=1e-2, **QUIET),
        mixture=MixtureConfig(steps=20, batch_size=60, clip_norm=5.0, learning_rate=0.4),
    )
    config = configs.ShiftStudyConfig(
        image=image,
        text=None,
        seeds=(0, 1),
        clip_factors=(1.0, 4.0),
        image_tuning_seeds=(100,),
        tuning_draws=2,
    )
    results = shift_study.main(config, tmp_path, reproducible=True)
    for name in ("results.json", "results.md", "cosine_vs_clip_norm.png"):
        assert (tmp_path / name).stat().st_size > 0
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["noise_seeded"] is True and stored["provenance"]["command"]
    part = results["defaults"]["image"]
    tuning = part["tuning"]
    # Tuned on data seed 100 only; the chosen C is each shift's best mean tuning cosine.
    assert {r["seed"] for r in tuning["runs"]} == {100}
    for shift in SHIFTS:
        row = [t for t in tuning["table"] if t["shift"] == shift]
        assert [t["clip_norm"] for t in row] == [5.0, 20.0]
        assert tuning["best"][shift] == max(row, key=lambda t: t["cosine"][0])["clip_norm"]
        cells = [r for r in tuning["runs"] if r["shift"] == shift and r["clip_norm"] == 20.0]
        assert row[1]["cosine"][0] == pytest.approx(np.mean([c["cosine"] for c in cells]))
    # Reported on the seeds of data seed 0: every shift at the preset's C and at its tuned C.
    assert {r["seed"] for r in part["runs"]} == {0, 1}
    for shift in SHIFTS:
        clip_norms = {s["clip_norm"] for s in part["summary"] if s["shift"] == shift}
        assert clip_norms == {5.0, tuning["best"][shift]}
    for run in part["runs"]:
        direct = direct_pld_epsilon(run["noise_multiplier"], run["sampling_rate"], 20, 1e-5)
        assert run["spent_epsilon"] == pytest.approx(direct, rel=2e-3)
        assert 0.97 * config.epsilon <= run["spent_epsilon"] <= config.epsilon
        assert run["learning_rate"] == pytest.approx(0.4 * 5.0 / run["clip_norm"])
        assert run["excess_loss"] > -1e-4  # non-private MixMin is (nearly) the optimum
    # The preset's own row is the reference of the paired differences.
    (base,) = [s for s in part["summary"] if s["shift"] == DEFAULT_SHIFT and s["preset"]]
    assert base["delta_cosine"] == (0.0, 0.0)
    # Each (seed, draw) is one seeded stream shared by its cells: rerunning a cell gives the
    # stored λ, and the two tuning draws of a cell differ (noise was drawn).
    pipeline = ImagePipeline(
        presets.digit_task(), image, tmp_path / "stages" / "image0", reproducible=True
    )
    stored_cell = part["runs"][0]
    (rerun,) = shift_study.run_cells(
        pipeline, 0, [(stored_cell["shift"], stored_cell["clip_norm"])], epsilon=1.0
    )
    assert rerun["weights"] == pytest.approx(stored_cell["weights"], abs=1e-6)
    first, second = (
        r["weights"] for r in tuning["runs"] if r["shift"] == "none" and r["clip_norm"] == 5.0
    )
    assert not np.allclose(first, second)
    text = (tmp_path / "results.md").read_text()
    assert text.startswith("# ") and "| mean | 5 | preset" in text


def test_stored_page_matches_the_stored_run():
    page = ROOT / "docs" / "shift-study.md"
    results = ROOT / "docs" / "results"
    assert (results / "shift_study.json").is_file()
    assert "<!-- table:shift_study markdown -->" in page.read_text()
    assert report.check_markdown(page, results) == []


def test_stored_study_supports_the_default_shift():
    # DEFAULT_SHIFT's comment rests on this: on both defaults the default shift at the preset's C
    # has the highest mean cosine and the lowest mean excess loss of every reported cell, each
    # tuned C is its shift's best on the tuning draws only, and every run spent at most ε as
    # dp_accounting computes it for its σ, q and T.
    stored = json.loads((ROOT / "docs" / "results" / "shift_study.json").read_text())
    config = stored["config"]
    assert stored["noise_seeded"] is True and stored["provenance"]["commit"]
    assert set(stored["defaults"]) == {"image", "text"} and config["epsilon"] == 1.0
    for name, part in stored["defaults"].items():
        (default,) = [s for s in part["summary"] if s["shift"] == DEFAULT_SHIFT and s["preset"]]
        for cell in part["summary"]:
            assert cell["cosine"][0] <= default["cosine"][0], (name, cell["shift"])
            assert cell["excess_loss"][0] >= default["excess_loss"][0], (name, cell["shift"])
        tuning_seeds = set(config[f"{name}_tuning_seeds"])
        assert {r["seed"] for r in part["tuning"]["runs"]} == tuning_seeds
        assert not tuning_seeds & {0, *config["seeds"]}
        for shift, best in part["tuning"]["best"].items():
            means = {}
            for run in part["tuning"]["runs"]:
                if run["shift"] == shift:
                    means.setdefault(run["clip_norm"], []).append(run["cosine"])
            assert best == max(means, key=lambda c: np.mean(means[c])), (name, shift)
        steps = config[name]["mixture"]["steps"]
        for run in part["runs"][:: max(1, len(part["runs"]) // 4)]:
            direct = direct_pld_epsilon(run["noise_multiplier"], run["sampling_rate"], steps, 1e-5)
            assert run["spent_epsilon"] == pytest.approx(direct, rel=2e-3), name
            assert run["spent_epsilon"] <= config["epsilon"] * (1 + 1e-9)
