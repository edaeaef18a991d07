"""The Random Search gain study on its tiny preset: every arm within its budget, the charged
m = 4 arm is the pipeline's Random Search, the calibrated arms spend ε, the gains are paired by
seed, a resumed run computes nothing again, and bad settings are refused in one line."""

import numpy as np
import pytest

from dpmix_jax.pipeline import ImagePipeline, mixture_pipeline, presets
from experiments import random_search_gain as study_module
from experiments.configs import random_search_gain as configs


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("random_search_gain")
    config = configs.get_config("tiny")
    return config, out, study_module.main(config, out, reproducible=True)


def test_every_arm_runs_within_its_budget(study):
    config, out, results = study
    rows = {(r["active_sources"], r["task"], r["arm"], r["seed"]): r for r in results["runs"]}
    expected = {
        (active, task, arm, seed)
        for active in config.active_sources
        for task in range(len(config.prevalence_scales))
        for arm in study_module.arms(config)
        for seed in config.seeds
    }
    assert set(rows) == expected
    for row in rows.values():
        m, budget = row["candidates"], row["budget"]
        if budget == "charged" and m > 1:
            assert row["spent_epsilon"] > config.epsilon * 1.1, row
            assert row["candidate_epsilon"] == config.epsilon
        else:
            assert 0.99 * config.epsilon < row["spent_epsilon"] <= config.epsilon * (1 + 1e-3), row
        if budget == "calibrated" and m > 1:
            assert row["candidate_epsilon"] < config.epsilon
        assert abs(sum(row["weights"] or [1.0]) - 1) < 1e-6
    assert "Random Search, m = 4, calibrated" in (out / "results.md").read_text()
    assert (out / "random_search_gain.png").stat().st_size > 0


def test_the_charged_search_of_four_is_the_pipelines_random_search(study):
    config, out, results = study
    assert config.pipeline.random_search_candidates == 4
    (task, *_) = study_module.study_tasks(config, config.active_sources[0])
    stages = out / "stages" / f"active{config.active_sources[0]}" / "task0"
    pipeline = ImagePipeline(task, config.pipeline, stages, reproducible=True)
    seed = config.seeds[0]
    run = pipeline.run("random_search", config.epsilon, seed)
    (row,) = [
        r
        for r in results["runs"]
        if r["active_sources"] == config.active_sources[0]
        and r["task"] == 0
        and r["seed"] == seed
        and r["arm"] == study_module.search_arm(4, "charged")
    ]
    assert row["utility"] == pytest.approx(run.utility)
    assert row["spent_epsilon"] == pytest.approx(run.spent.epsilon)
    assert row["weights"] == pytest.approx(run.weights)


def test_one_active_source_gives_one_hot_true_weights():
    for task in presets.digit_tasks(image_size=8, num_tasks=3, num_active_sources=1):
        assert np.count_nonzero(task.true_weights) == 1


def test_the_gains_are_paired_by_task_and_seed(study):
    config, _, results = study
    auc = {(r["active_sources"], r["arm"], r["task"]): r["utility"] for r in results["runs"]}
    tasks = range(len(config.prevalence_scales))
    for row in results["summary"]:
        active = row["active_sources"]

        def gain(arm, active=active):
            ri = [auc[active, "random_init", t] for t in tasks]
            return np.mean([(auc[active, arm, t] - r) / r for t, r in zip(tasks, ri, strict=True)])

        assert row["gain"] == pytest.approx(gain(row["arm"]))
        assert row["dp_minus_gain"] == pytest.approx(gain("dp_mixmin") - gain(row["arm"]))


def test_a_rerun_reads_every_stage_back(study, monkeypatch):
    config, out, results = study

    def refuse(self, name):
        raise AssertionError(f"stage {name} was computed again")

    monkeypatch.setattr(mixture_pipeline.MixturePipeline, "_on_stage", refuse)
    again = study_module.main(config, out, reproducible=True)
    assert again["runs"] == results["runs"]


def test_bad_settings_are_refused_in_one_line():
    base = configs.get_config("tiny")
    with pytest.raises(ValueError, match="candidate_counts must increase"):
        configs.RandomSearchGainConfig(pipeline=base.pipeline, candidate_counts=(4, 1))
    with pytest.raises(ValueError, match="candidate_counts must be integers >= 1"):
        configs.RandomSearchGainConfig(pipeline=base.pipeline, candidate_counts=(0, 2))
    with pytest.raises(ValueError, match=r"active_sources must lie in \[1, 12\]"):
        configs.RandomSearchGainConfig(pipeline=base.pipeline, active_sources=(13,))
    with pytest.raises(ValueError, match="preset must be 'cpu' or 'tiny'"):
        configs.get_config("paper")


def test_an_unknown_preset_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        study_module.cli(["--preset", "paper"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'paper'" in capsys.readouterr().err
