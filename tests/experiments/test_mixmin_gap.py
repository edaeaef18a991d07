"""The DP-MixMin gap study on its tiny preset: every arm of every condition within its budget,
the two non-private arms on one λ, a resumed run that computes nothing again, and one-line
refusals of bad settings."""

import pytest

from dpmix_jax.pipeline import mixture_pipeline
from experiments import mixmin_gap
from experiments.configs import mixmin_gap as configs


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixmin_gap")
    config = configs.get_config("tiny")
    return config, out, mixmin_gap.main(config, out, reproducible=True)


def test_every_arm_of_every_condition_runs_within_its_budget(study):
    config, out, results = study
    extra = [mixmin_gap.mixture_arm(e) for e in config.mixture_epsilons]
    rows = {(r["condition"], r["arm"], r["seed"]): r for r in results["runs"]}
    expected = {
        (c.label, arm, seed)
        for c in config.conditions
        for arm in configs.ARMS + tuple(extra if c == config.base else ())
        for seed in config.seeds
    }
    assert set(rows) == expected
    train = len(mixmin_gap.presets.digit_task(image_size=config.image_size).train)
    for (_, arm, _), row in rows.items():
        budget = row["mixture_epsilon"] if arm in extra else config.epsilon
        assert 0 < row["spent_epsilon"] <= budget * (1 + 1e-9), row
        whole = arm == "nonprivate_all"
        assert row["finetune_rows"] + (0 if whole else row["mixture_examples"]) == train
        assert abs(sum(row["weights"]) - 1) < 1e-6
    for condition in config.conditions:
        for seed in config.seeds:
            here = (
                rows[condition.label, "nonprivate_ft", seed],
                rows[condition.label, "nonprivate_all", seed],
            )
            assert here[0]["weights"] == here[1]["weights"]
            assert here[0]["cosine_nonprivate"] == pytest.approx(1.0)
    small, large = (rows[c.label, "dp_mixmin", 0]["mixture_examples"] for c in config.conditions)
    assert small < large
    table = (out / "results.md").read_text()
    assert "| ρ = 0.3, 3 fine-tuning steps |" in table and "λ at ε = 16" in table
    assert (out / "mixmin_gap.png").stat().st_size > 0


def test_the_summary_pairs_the_gaps_by_seed(study):
    _, _, results = study
    by_key = {(r["condition"], r["arm"], r["seed"]): r["utility"] for r in results["runs"]}
    for row in results["summary"]:
        want = (
            by_key[row["condition"], "nonprivate_ft", 0] - by_key[row["condition"], row["arm"], 0]
        )
        assert row["gap_to_nonprivate_ft"] == pytest.approx(want)
        assert row["gap_to_nonprivate_ft_se"] is None  # one seed


def test_a_rerun_reads_every_stage_back(study, monkeypatch):
    config, out, results = study

    def refuse(self, name):
        raise AssertionError(f"stage {name} was computed again")

    monkeypatch.setattr(mixture_pipeline.MixturePipeline, "_on_stage", refuse)
    again = mixmin_gap.main(config, out, reproducible=True)
    assert again["runs"] == results["runs"]


def test_bad_settings_are_refused_in_one_line():
    base = configs.get_config("tiny")
    with pytest.raises(ValueError, match=r"mix_fraction must lie in \(0, 1\)"):
        configs.Condition(mix_fraction=1.0, finetune_steps=3)
    with pytest.raises(ValueError, match="conditions must include the base pipeline's"):
        configs.MixMinGapConfig(
            pipeline=base.pipeline,
            conditions=(configs.Condition(mix_fraction=0.5, finetune_steps=3),),
        )
    with pytest.raises(ValueError, match="must not repeat"):
        configs.MixMinGapConfig(pipeline=base.pipeline, conditions=base.conditions * 2)
    with pytest.raises(ValueError, match="preset must be 'cpu' or 'tiny'"):
        configs.get_config("paper")


def test_an_unknown_preset_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        mixmin_gap.cli(["--preset", "paper"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'paper'" in capsys.readouterr().err
