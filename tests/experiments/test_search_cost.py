"""Search cost: Random Search's composed ε, the best-of-m excess, m*(k), an end-to-end run."""

import dataclasses
import itertools
import json
import pathlib

import dp_accounting
import numpy as np
import pytest

from dpmix_jax.pipeline import report
from experiments import search_cost
from experiments.configs import search_cost as configs

ROOT = pathlib.Path(__file__).resolve().parents[2]
DELTA = 1e-5


@pytest.fixture(scope="module")
def finetune():
    return search_cost.demo_finetune_ledger(1.0, DELTA)


def test_one_finetuning_is_the_demos_dp_sgd_calibrated_to_epsilon(finetune):
    _, event = finetune
    assert event["num_units"] == round(0.7 * event["train_size"])  # D_ft: 1 - ρ of train
    assert event["sampling_rate"] == pytest.approx(128 / event["num_units"])
    assert event["steps"] == 60
    assert event["epsilon"] == pytest.approx(1.0, abs=0.01)


@pytest.mark.parametrize("count", [1, 4, 32])
def test_composed_epsilon_matches_an_independent_pld_accountant(finetune, count):
    ledger, event = finetune
    step = dp_accounting.PoissonSampledDpEvent(
        event["sampling_rate"], dp_accounting.GaussianDpEvent(event["noise_multiplier"])
    )
    independent = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for _ in range(count):  # one fine-tuning after another on the same D_ft
        independent.compose(step, event["steps"])
    expected = independent.get_epsilon(DELTA)
    composed = search_cost.random_search_epsilon(ledger, count, DELTA)
    # The library's PLD grid is 1e-4·max(1, ε): an upper bound within a hair of the finer one.
    assert expected - 1e-6 <= composed <= expected * 1.002 + 1e-4
    if count > 1:
        assert composed < count * event["epsilon"]  # tighter than basic composition


def test_expected_best_of_matches_enumeration():
    values = np.array([0.3, 0.1, 0.7, 0.1, 0.5])
    for count in (1, 2, 3):
        draws = itertools.product(values, repeat=count)
        enumerated = np.mean([min(d) for d in draws])
        assert search_cost.expected_best_of(values, count) == pytest.approx(enumerated)
    assert search_cost.expected_best_of(values, 10_000) == pytest.approx(0.1)


def test_smallest_count_is_the_first_to_reach_the_target():
    best = {1: 0.5, 2: 0.2, 4: 0.1}
    assert search_cost.smallest_count(best, 0.2, (1, 2, 4)) == 2
    assert search_cost.smallest_count(best, 0.05, (1, 2, 4)) is None


def test_config_refuses_bad_candidate_settings():
    with pytest.raises(ValueError, match="candidate_counts"):
        configs.SearchCostConfig(candidate_counts=(4, 2))
    with pytest.raises(ValueError, match="candidate_pool"):
        configs.SearchCostConfig(candidate_pool=100)
    with pytest.raises(ValueError, match="solver"):
        configs.SearchCostConfig(solver="adam")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("search_cost")
    config = dataclasses.replace(configs.get_config("tiny"), progress=False)
    return out, search_cost.main(config, out, reproducible=True)


def test_m_star_does_not_fall_as_k_grows(tiny_run):
    _, results = tiny_run
    needed = [row["m_star"] or np.inf for row in results["per_k"]]  # None: beyond the largest m
    assert needed == sorted(needed)
    for row in results["per_k"]:
        if row["m_star"] is not None:
            best = row["best_of"][str(row["m_star"])]["mean"]
            assert best <= row["dp_mixmin_excess"]["mean"]
            assert row["random_search_epsilon"] == results["composed_epsilon"][str(row["m_star"])]
        assert row["dp_mixmin_epsilon"] == pytest.approx(1.0, abs=0.01)


def test_tiny_run_writes_its_files(tiny_run):
    out, _ = tiny_run
    assert {p.name for p in out.iterdir()} >= {"results.json", "results.md", "search_cost.png"}
    stored = json.loads((out / "results.json").read_text())
    assert stored["noise_seeded"] is True and stored["provenance"]["command"]
    assert (out / "results.md").read_text().startswith("# ")


def test_the_page_table_matches_the_stored_result():
    page = ROOT / "docs" / "search-cost.md"
    assert "<!-- table:search_cost markdown -->" in page.read_text()
    assert report.check_markdown(page, ROOT / "docs" / "results") == []
