"""The image pipeline end to end on a tiny preset: stages, disjointness, budgets, resume."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

from dpmix_jax.pipeline import ImagePipeline, MixtureConfig, common, presets, run_comparison
from dpmix_jax.privacy import accounting
from dpmix_jax.train import TrainConfig

QUIET = {"progress": False, "log_every": None}


@pytest.fixture(scope="module")
def task():
    return presets.digit_task(image_size=8)


def tiny_config(**overrides):
    settings = dict(
        mix_fraction=0.3,
        model=presets.ModelSpec(kind="mlp", mlp_hidden=(16,)),
        proxy=TrainConfig(steps=30, batch_size=64, learning_rate=1e-2, **QUIET),
        mixture=MixtureConfig(steps=20, batch_size=60, clip_norm=5.0, learning_rate=0.4),
        pretrain=TrainConfig(steps=20, batch_size=64, learning_rate=1e-2, **QUIET),
        finetune=TrainConfig(
            steps=4,
            batch_size=64,
            learning_rate=1e-3,
            private=True,
            clip_norm=1.0,
            epsilon=1.0,
            delta=1e-5,
            **QUIET,
        ),
        random_search_candidates=2,
    )
    settings.update(overrides)
    return presets.image_demo_config(**settings)


def test_dp_mixmin_run_stores_its_stages_and_composes_budgets_in_parallel(task, tmp_path):
    stages = []
    pipeline = ImagePipeline(task, tiny_config(), tmp_path, on_stage=stages.append)
    result = pipeline.run("dp_mixmin", 1.0, seed=0)

    mix, ft = pipeline.split(0)
    assert len(np.intersect1d(mix, ft)) == 0
    assert np.array_equal(np.sort(np.concatenate([mix, ft])), np.arange(len(task.train)))
    assert len(mix) == pytest.approx(0.3 * len(task.train), abs=1)

    store = tmp_path / "seed0"
    mixture = json.loads((store / "mixture_parallel_eps1.json").read_text())
    # The mixture stage's ε is the accountant's for the σ, rate and steps it ran.
    expected_mix = accounting.epsilon(
        accounting.dpsgd_event(
            noise_multiplier=mixture["noise_multiplier"],
            sampling_rate=mixture["sampling_rate"],
            steps=20,
        ),
        delta=1e-5,
    )
    assert mixture["sampling_rate"] == pytest.approx(60 / len(mix))
    assert result.stages["mixture"].epsilon == pytest.approx(expected_mix)
    assert accounting.PrivacyLedger.from_state_dict(mixture["ledger"]).count == 20
    assert result.spent.epsilon == max(s.epsilon for s in result.stages.values())
    assert 0.99 <= result.spent.epsilon <= 1.0
    assert len(result.weights) == task.k and sum(result.weights) == pytest.approx(1.0)
    assert {"split", "proxy", "proxy_outputs", "mixture", "finetune"} <= set(stages)
    assert any(s.startswith("pretrain_") for s in stages)
    assert (store / "run_dp_mixmin_parallel_eps1.json").exists()


def test_sequential_composition_uses_all_data_and_adds_the_stage_budgets(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(composition="sequential"), tmp_path)
    result = pipeline.run("dp_mixmin", 2.0, seed=0)
    mix, ft = pipeline.split(0)
    assert np.array_equal(mix, ft) and len(mix) == len(task.train)
    assert result.stages["mixture"].epsilon <= 0.2 and result.stages["finetune"].epsilon <= 1.8
    assert result.spent.epsilon == pytest.approx(sum(s.epsilon for s in result.stages.values()))
    assert result.spent.epsilon <= 2.0


def test_resume_skips_finished_stages_and_reports_the_same_budget(task, tmp_path):
    first = ImagePipeline(task, tiny_config(), tmp_path).run("dp_mixmin", 1.0, seed=1)
    store = tmp_path / "seed1"
    (store / "run_dp_mixmin_parallel_eps1.json").unlink()
    for finetune_dir in store.glob("finetune_*"):
        shutil.rmtree(finetune_dir)  # a run killed during fine-tuning

    stages = []
    again = ImagePipeline(task, tiny_config(), tmp_path, on_stage=stages.append)
    second = again.run("dp_mixmin", 1.0, seed=1)
    assert stages == ["finetune"]
    assert second.weights == first.weights
    assert second.spent == first.spent
    assert second.utility == pytest.approx(first.utility, abs=1e-6)
    stages.clear()
    assert again.run("dp_mixmin", 1.0, seed=1) == second and stages == []


def test_baselines_are_labelled_and_accounted(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(), tmp_path)
    uniform = pipeline.run("uniform", 1.0, seed=0)
    assert uniform.weights == pytest.approx([1 / task.k] * task.k)
    assert set(uniform.stages) == {"finetune"} and uniform.private
    random_init = pipeline.run("random_init", 1.0, seed=0)
    assert random_init.weights is None and random_init.private
    search = pipeline.run("random_search", 1.0, seed=0)
    assert not search.private
    scores = search.extra["validation_utilities"]
    assert len(scores) == 2 and search.extra["selected_validation_utility"] == max(scores)
    # Two candidates, each fine-tuned on the same D_ft at ε = 1: their budgets add up.
    assert 2 * 0.99 <= search.spent.epsilon <= 2.0
    assert not pipeline.run("nonprivate_mixmin", 1.0, seed=0).private


def test_comparison_writes_results_in_the_documented_shape(task, tmp_path):
    results = run_comparison(
        ImagePipeline(task, tiny_config(), tmp_path / "stages"),
        dataset="digits",
        metric="test AUC",
        higher_is_better=True,
        methods=["dp_mixmin", "uniform", "nonprivate_mixmin"],
        epsilons=[1.0],
        seeds=[0],
        out_dir=tmp_path,
        true_weights=task.true_weights,
        progress=False,
    )
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert {"dataset", "metric", "higher_is_better", "runs", "true_weights"} <= set(on_disk)
    for run in on_disk["runs"]:
        assert run["method"] in common.METHODS
        assert isinstance(run["utility"], float) and 0 <= run["utility"] <= 1
        assert {"epsilon", "delta", "seed", "weights"} <= set(run)
    dp = next(r for r in on_disk["runs"] if r["method"] == "dp_mixmin")
    assert -1 <= dp["weight_quality"]["cosine_true"] <= 1
    assert "cosine_reference" in dp["weight_quality"]
    assert (tmp_path / "results.md").read_text().count("| dp_mixmin |") == 2
    assert (tmp_path / "utility_vs_epsilon.png").stat().st_size > 0
    assert (tmp_path / "weights.png").stat().st_size > 0


def test_group_ids_give_a_group_disjoint_split():
    groups = np.repeat(np.arange(30), 4)
    mix, ft = common.split_mixture(len(groups), 0.2, seed=0, group_ids=groups)
    assert not set(groups[mix]) & set(groups[ft])
    assert len(mix) + len(ft) == len(groups)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mix_fraction": 0.0}, "mix_fraction"),
        ({"composition": "interleaved"}, "composition"),
        ({"sequential_mixture_share": 1.5, "composition": "sequential"}, "mixture_share"),
    ],
)
def test_bad_pipeline_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**kwargs)


def test_bad_run_arguments_are_rejected(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(), tmp_path)
    with pytest.raises(ValueError, match="method"):
        pipeline.run("best_guess", 1.0, seed=0)
    with pytest.raises(ValueError, match="epsilon"):
        pipeline.run("uniform", 0.0, seed=0)
    with pytest.raises(ValueError, match="private"):
        dataclasses.replace(
            tiny_config(), finetune=TrainConfig(steps=1, batch_size=8, learning_rate=0.1)
        )
