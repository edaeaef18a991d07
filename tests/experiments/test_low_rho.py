"""The low-ρ study on its tiny preset: every λ setting and pipeline arm within its budget, the
logit noise and the paired differences as defined, a resumed run that computes no pipeline stage
again, and one-line refusals of bad settings."""

import numpy as np
import pytest

from dpmix_jax.pipeline import mixture_pipeline
from experiments import low_rho
from experiments.configs import low_rho as configs


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("low_rho")
    config = configs.get_config("tiny")
    return config, out, low_rho.main(config, out, reproducible=True)


def test_every_lambda_setting_runs_its_draws_within_its_budget(study):
    config, _, results = study
    rows = results["lambdas"]
    assert len(rows) == len(config.lambda_conditions) * len(config.seeds) * config.lambda_draws
    settings = config.pipeline.mixture
    for row in rows:
        assert 0 < row["spent_epsilon"] <= row["mixture_epsilon"] * (1 + 1e-9), row
        assert row["sampling_rate"] == pytest.approx(row["batch_size"] / row["users"])
        noise = settings.learning_rate * row["noise_multiplier"] * settings.clip_norm
        assert row["logit_noise"] == pytest.approx(
            noise * np.sqrt(settings.steps) / row["batch_size"]
        )
        assert -1 <= row["cosine_last"] <= 1 and -1 <= row["cosine_average"] <= 1
    base, larger = results["lambda_summary"]
    assert larger["noise_multiplier"] < base["noise_multiplier"]
    assert results["uniform_cosine"] == pytest.approx(
        low_rho.cosine_similarity(np.ones(7) / 7, np.asarray(results["true_weights"]))
    )


def test_every_arm_runs_for_every_seed_within_its_budget(study):
    config, out, results = study
    arms = (
        *configs.ARMS,
        *(low_rho.mixture_arm(e) for e in config.mixture_epsilons),
        low_rho.reference_arm(config.reference_mix_fraction),
    )
    rows = {(r["arm"], r["seed"]): r for r in results["runs"]}
    assert set(rows) == {(arm, seed) for arm in arms for seed in config.seeds}
    for row in rows.values():
        budget = row["mixture_epsilon"] or config.epsilon
        assert 0 < row["spent_epsilon"] <= budget * (1 + 1e-9), row
        assert abs(sum(row["weights"]) - 1) < 1e-6
    for seed in config.seeds:
        small = rows["dp_mixmin", seed]["mixture_examples"]
        assert (
            small
            < rows[low_rho.reference_arm(config.reference_mix_fraction), seed]["mixture_examples"]
        )
        assert rows["nonprivate_mixmin", seed]["cosine_nonprivate"] == pytest.approx(1.0)
    table = (out / "results.md").read_text()
    assert "| DP-MixMin, λ at ε = 4 | 0.1 | 4.000 |" in table
    assert "| ρ = 0.1, ε = 4, b = 2 |" in table
    assert (out / "low_rho.png").stat().st_size > 0


def test_the_summary_pairs_the_differences_to_uniform_by_seed(study):
    config, _, results = study
    by_key = {(r["arm"], r["seed"]): r["utility"] for r in results["runs"]}
    for row in results["summary"]:
        differences = [by_key[row["arm"], s] - by_key["uniform", s] for s in config.seeds]
        assert row["minus_uniform"] == pytest.approx(np.mean(differences))
        assert row["minus_uniform_se"] == pytest.approx(
            np.std(differences, ddof=1) / np.sqrt(len(differences))
        )
        assert row["worse_than_uniform"] == np.mean(np.array(differences) > 0)
        values = [by_key[row["arm"], s] for s in config.seeds]
        assert row["utility_median"] == pytest.approx(np.median(values))


def test_a_rerun_computes_no_pipeline_stage_again(study, monkeypatch):
    config, out, results = study

    def refuse(self, name):
        raise AssertionError(f"stage {name} was computed again")

    monkeypatch.setattr(mixture_pipeline.MixturePipeline, "_on_stage", refuse)
    again = low_rho.main(config, out, reproducible=True)
    assert again["runs"] == results["runs"]
    assert again["lambdas"] == results["lambdas"]


def test_bad_settings_are_refused_in_one_line():
    base = configs.get_config("tiny")
    with pytest.raises(ValueError, match=r"mix_fraction must lie in \(0, 1\)"):
        configs.LambdaCondition(mix_fraction=0.0, epsilon=1.0)
    with pytest.raises(ValueError, match="batch_size"):
        configs.LambdaCondition(mix_fraction=0.1, epsilon=1.0, batch_size=-1.0)
    with pytest.raises(ValueError, match="must differ"):
        configs.LowRhoConfig(pipeline=base.pipeline, reference_mix_fraction=0.1)
    with pytest.raises(ValueError, match="seeds must not repeat"):
        configs.LowRhoConfig(pipeline=base.pipeline, seeds=(0, 0))
    with pytest.raises(ValueError, match="preset must be 'cpu' or 'tiny'"):
        configs.get_config("paper")


def test_an_unknown_preset_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        low_rho.cli(["--preset", "paper"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'paper'" in capsys.readouterr().err
