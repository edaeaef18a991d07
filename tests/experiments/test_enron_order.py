"""The Enron order study on its tiny preset: every λ of every seed fine-tuned within its budget,
Random Search as the best of the first m candidates on validation perplexity, the gains paired by
seed, a resumed run that computes nothing again, and one-line refusals of bad settings."""

import pytest

from dpmix_jax.pipeline import mixture_pipeline
from experiments import enron_order
from experiments.configs import enron_order as configs


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    out = tmp_path_factory.mktemp("enron_order")
    config = configs.get_config("tiny")
    return config, out, enron_order.main(config, out, reproducible=True)


def test_every_lambda_is_fine_tuned_within_its_budget(study):
    config, out, results = study
    rows = {(r["seed"], r["arm"], r["candidate"], r["epsilon"]): r for r in results["runs"]}
    first = config.epsilons[0]
    expected = {
        (seed, arm, None, epsilon)
        for seed in config.seeds
        for arm in ("uniform", "dp_mixmin")
        for epsilon in config.epsilons
    } | {(seed, "candidate", i, first) for seed in config.seeds for i in range(config.candidates)}
    assert set(rows) == expected
    for (_, arm, _, epsilon), row in rows.items():
        assert 0 < row["spent_epsilon"] <= epsilon * (1 + 1e-9), row
        assert row["finetune_rows"] == ("all" if arm == "uniform" else "ft")
        assert abs(sum(row["weights"]) - 1) < 1e-6
        assert row["test"] != row["pretrained_test"]  # fine-tuning ran and changed the model
    for seed in config.seeds:
        uniform = [rows[seed, "uniform", None, e] for e in config.epsilons]
        # One pretrained model per λ and seed, fine-tuned at every ε.
        assert len({r["pretrained_test"] for r in uniform}) == 1
        assert len({r["test"] for r in uniform}) == len(config.epsilons)
    searches = {s["candidates"]: s for s in results["random_search"]}
    assert searches[1]["spent_epsilon"] <= first * (1 + 1e-9)
    assert searches[2]["spent_epsilon"] > first  # two fine-tunings on the same D_ft
    table = (out / "results.md").read_text()
    assert "| 1 | " in table and "Random Search at ε = 1" in table


def test_random_search_picks_on_validation_and_gains_pair_by_seed(study):
    config, _, results = study
    seed = config.seeds[0]
    candidates = [r for r in results["runs"] if r["arm"] == "candidate" and r["seed"] == seed]
    for search in results["random_search"]:
        first = candidates[: search["candidates"]]
        best = min(first, key=lambda r: r["val"])
        assert search["picked"] == best["candidate"] and search["test"] == best["test"]
    assert results["random_search"][0]["picked"] == 0
    by_key = {(r["arm"], r["epsilon"]): r for r in results["runs"] if r["seed"] == seed}
    for row in results["summary"]["per_epsilon"]:
        dp, uniform = by_key["dp_mixmin", row["epsilon"]], by_key["uniform", row["epsilon"]]
        assert row["gain_percent"][0] == pytest.approx(100 * (dp["test"] / uniform["test"] - 1))
        change = uniform["test"] - uniform["pretrained_test"]
        assert row["uniform_finetune_change"][0] == pytest.approx(change)
    uniform = by_key["uniform", config.epsilons[0]]["test"]
    rows = results["summary"]["random_search"]
    for search, row in zip(results["random_search"], rows, strict=True):
        assert row["minus_uniform"][0] == pytest.approx(search["test"] - uniform)


def test_a_rerun_reads_every_stage_back(study, monkeypatch):
    config, out, results = study

    def refuse(self, name):
        raise AssertionError(f"stage {name} was computed again")

    monkeypatch.setattr(mixture_pipeline.MixturePipeline, "_on_stage", refuse)
    again = enron_order.main(config, out, reproducible=True)
    assert again["runs"] == results["runs"]
    assert again["random_search"] == results["random_search"]


def test_bad_settings_are_refused_in_one_line():
    base = configs.get_config("tiny")
    with pytest.raises(ValueError, match=r"selections must lie in 1\.\.2"):
        configs.EnronOrderConfig(pipeline=base.pipeline, candidates=2, selections=(1, 3))
    with pytest.raises(ValueError, match="epsilons and seeds must be non-empty"):
        configs.EnronOrderConfig(pipeline=base.pipeline, seeds=())
    with pytest.raises(ValueError, match="preset must be 'cpu' or 'tiny'"):
        configs.get_config("paper")


def test_an_unknown_preset_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        enron_order.cli(["--preset", "paper"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'paper'" in capsys.readouterr().err
