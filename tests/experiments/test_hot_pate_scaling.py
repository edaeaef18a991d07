"""Hot PATE's scaling study (`experiments/hot_pate_scaling.py`): its pricing of a threshold, a
tiny run, and the paper's claims checked on the stored run
(`docs/results/hot_pate_scaling.json`)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import dp_accounting
import numpy as np
import pytest

from dpmix_jax.pate import accounting, aggregators
from dpmix_jax.privacy import accounting as privacy_accounting
from experiments import hot_pate_scaling as scaling
from experiments.configs import hot_pate_scaling as configs

ROOT = pathlib.Path(__file__).resolve().parents[2]
STORED = ROOT / "docs" / "results" / "hot_pate_scaling.json"


# --------------------------------------------------------------------------------------------
# Pricing a threshold.
# --------------------------------------------------------------------------------------------


def test_dpws_calls_are_the_last_count_within_the_budget():
    config = configs.get_config("tiny")
    for threshold in (12.0, 60.0, 900.0):
        priced = scaling.dpws_calls(config, threshold)
        assert aggregators.dpws_threshold(
            priced["epsilon_per_call"], config.call_delta
        ) == pytest.approx(threshold)
        event = accounting.dpws_event(priced["epsilon_per_call"])

        def epsilon(steps, event=event):
            return accounting.epsilon_of_steps(event, steps=steps, delta=config.budget_delta)

        calls = priced["calls"]
        assert calls >= 1 and epsilon(calls) <= config.budget_epsilon < epsilon(calls + 1)
        assert priced["delta_total"] == config.budget_delta + calls * config.call_delta
    assert scaling.dpws_calls(config, 1.0) == {
        "epsilon_per_call": None,
        "calls": 0,
        "delta_total": 0.0,
    }


def test_gaussian_calls_compose_to_one_call_at_the_budget():
    """c Gaussian calls of multiplier s are one call of multiplier s/√c: the count found fits
    the budget (dp-accounting PLD on the composition) and one more call does not."""
    config = configs.get_config("tiny")
    multiplier = scaling.gaussian_multiplier(config)
    for threshold in (10.0, 40.0):
        priced = scaling.gaussian_calls(config, threshold, multiplier)
        calls, noise = priced["calls"], priced["sigma"] / math.sqrt(2.0)
        assert priced["sigma"] * math.sqrt(2 * math.log(config.vocab_size / 0.01)) == (
            pytest.approx(threshold)
        )

        def epsilon(count, noise=noise):
            event = dp_accounting.GaussianDpEvent(noise)
            return privacy_accounting.epsilon(
                dp_accounting.SelfComposedDpEvent(event, count), delta=config.budget_delta
            )

        assert calls >= 1
        assert epsilon(calls) <= config.budget_epsilon * (1 + 1e-3)
        assert epsilon(calls + 1) > config.budget_epsilon
    assert scaling.gaussian_calls(config, 0.5, multiplier)["calls"] == 0


def test_log_log_slope_fits_the_points_with_a_value():
    counts = [16, 32, 64, 128]
    fit = scaling.log_log_slope(counts, [0, 0, 4 * 64**2, 4 * 128**2])
    assert fit == {
        "slope": pytest.approx(2.0),
        "slope_top": pytest.approx(2.0),
        "first_n": 64,
        "points": 2,
    }
    assert scaling.log_log_slope(counts, [0, 0, 0, 3]) == {
        "slope": None,
        "slope_top": None,
        "first_n": 128,
        "points": 1,
    }


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"teacher_counts": (64, 32)}, "teacher_counts"),
        ({"teacher_counts": (64,)}, "teacher_counts"),
        ({"set_sizes": (0,)}, "set_sizes"),
        ({"call_delta": 1.0}, "call_delta"),
        ({"budget_epsilon": 0.0}, "budget_epsilon"),
        ({"private_mass": 0.9, "background_mass": 0.2}, "private_mass"),
        ({"quantiles": (0.5, 1.5)}, "quantiles"),
        ({"shape_set_size": 5000}, "set size"),
    ],
)
def test_the_config_refuses_inconsistent_settings(changes, message):
    with pytest.raises(ValueError, match=message):
        configs.ScalingConfig(**changes)


def test_presets_are_the_commands_choices():
    assert list(configs.PRESETS) == ["cpu", "tiny"]
    for name in configs.PRESETS:
        assert isinstance(configs.get_config(name), configs.ScalingConfig)
    flags = {a.dest: a for a in scaling.cli.parser()._actions}
    assert flags["preset"].choices == tuple(configs.PRESETS) and flags["preset"].default == "cpu"
    with pytest.raises(ValueError, match="preset"):
        configs.get_config("paper")


# --------------------------------------------------------------------------------------------
# A tiny run.
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_run_writes_its_report_and_shows_the_contrasts(tmp_path):
    config = dataclasses.replace(configs.get_config("tiny"), progress=False)
    results = scaling.main(config, tmp_path, reproducible=True)
    assert {p.name for p in tmp_path.iterdir()} == {
        "results.json",
        "results.md",
        "hot_pate_scaling.png",
    }
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["provenance"]["commit"] and stored["noise_seeded"] is True
    assert (tmp_path / "results.md").read_text() == scaling.markdown(config, stored) + "\n"
    rows = results["queries"]["rows"]
    assert len(rows) == 2 * len(config.set_sizes) * len(config.teacher_counts)
    for hot, cold in zip(rows[::2], rows[1::2], strict=True):
        assert (hot["sampler"], cold["sampler"]) == ("coordinated", "independent")
        assert hot["threshold"] >= cold["threshold"] and hot["threshold"] <= hot["n"]
        for name in scaling.AGGREGATORS:
            assert hot[name]["calls"] >= cold[name]["calls"]
    for k in config.set_sizes:  # more teachers, more queries
        for sampler in scaling.SAMPLERS:
            for name in scaling.AGGREGATORS:
                calls = [r[name]["calls"] for r in rows if r["k"] == k and r["sampler"] == sampler]
                assert calls == sorted(calls) and calls[-1] > calls[0]
    shape = {(r["ensemble"], r["sampler"]): r for r in results["shape"]}
    for ensemble in scaling.ENSEMBLES:
        hot, cold = shape[ensemble, "coordinated"], shape[ensemble, "independent"]
        assert hot["top"]["mean"] > cold["top"]["mean"]
        assert hot["margin"]["mean"] > cold["margin"]["mean"]
        for row in (hot, cold):
            assert sum(row["top"]["histogram"]) == config.shape_histograms
            assert row["top"]["quantiles"] == sorted(row["top"]["quantiles"])


# --------------------------------------------------------------------------------------------
# The paper's claims on the stored run.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored():
    return json.loads(STORED.read_text())


def _fit(stored, k, sampler):
    return next(f for f in stored["queries"]["fits"] if (f["k"], f["sampler"]) == (k, sampler))


def _row(stored, k, n, sampler):
    return next(
        r for r in stored["queries"]["rows"] if (r["k"], r["n"], r["sampler"]) == (k, n, sampler)
    )


def test_stored_run_is_the_cpu_preset_and_its_table(stored):
    config = configs.get_config("cpu")
    mine = json.loads(json.dumps(dataclasses.asdict(config)))
    assert {k: v for k, v in stored["config"].items() if k != "progress"} == {
        k: v for k, v in mine.items() if k != "progress"
    }
    assert stored["noise_seeded"] is True
    page = (ROOT / "docs" / "results" / "hot_pate_scaling.md").read_text()
    assert page == scaling.markdown(config, stored) + "\n"


def test_the_plot_draws_from_the_stored_run_alone(stored, tmp_path):
    scaling.plot(stored, tmp_path / "hot_pate_scaling.png")
    assert (tmp_path / "hot_pate_scaling.png").stat().st_size > 10_000


def test_coordinated_queries_grow_about_quadratically_in_n(stored):
    """T stays near n, so the Gaussian release's calls grow as n² over the whole grid and
    DPWS's reach the same local slope at the largest n (smaller n: per-call ε near 1, where
    composition is about linear in the calls)."""
    largest = max(stored["config"]["teacher_counts"])
    for k in stored["config"]["set_sizes"]:
        fit = _fit(stored, k, "coordinated")
        assert fit["threshold"]["slope"] == pytest.approx(1.0, abs=0.05)
        assert _row(stored, k, largest, "coordinated")["threshold"] >= 0.9 * largest
        assert fit["gaussian"]["slope"] == pytest.approx(2.0, abs=0.1)
        assert fit["dpws"]["slope_top"] >= 1.9 and fit["dpws"]["slope"] >= 1.5
        assert fit["dpws"]["first_n"] == min(stored["config"]["teacher_counts"])


def test_independent_queries_fall_by_the_square_of_the_threshold_ratio(stored):
    """At k = 1 the samplers are close; for diverse teachers independent's T is k-fold lower,
    its queries orders of magnitude fewer at the largest n, and under DPWS they grow with a
    clearly smaller slope at k = 20."""
    largest = max(stored["config"]["teacher_counts"])
    ratios = {}
    for k in stored["config"]["set_sizes"]:
        hot, cold = _row(stored, k, largest, "coordinated"), _row(stored, k, largest, "independent")
        ratios[k] = {
            name: hot[name]["calls"] / max(cold[name]["calls"], 1) for name in scaling.AGGREGATORS
        }
        assert ratios[k]["gaussian"] == pytest.approx(
            (hot["threshold"] / cold["threshold"]) ** 2, rel=0.02
        )
    assert ratios[1]["dpws"] < 2 and ratios[1]["gaussian"] < 2
    assert ratios[5]["dpws"] > 10 and ratios[5]["gaussian"] > 10
    assert ratios[20]["dpws"] > 100 and ratios[20]["gaussian"] > 100
    hot, cold = _fit(stored, 20, "coordinated"), _fit(stored, 20, "independent")
    assert cold["dpws"]["slope"] < hot["dpws"]["slope"] - 0.4
    assert cold["dpws"]["slope_top"] < 1.5 and cold["dpws"]["first_n"] > hot["dpws"]["first_n"]
    assert _fit(stored, 20, "independent")["gaussian"]["slope"] > 1.6


def test_coordinated_top_counts_sit_far_above_independent_ones(stored):
    for ensemble in scaling.ENSEMBLES:
        rows = {r["sampler"]: r for r in stored["shape"] if r["ensemble"] == ensemble}
        hot, cold = rows["coordinated"], rows["independent"]
        assert hot["top"]["quantiles"][0] > cold["top"]["quantiles"][-1]  # 5% above 95%
        assert hot["top"]["quantiles"][2] > 5 * cold["top"]["quantiles"][2]
        assert hot["margin"]["quantiles"][2] > 10 * cold["margin"]["quantiles"][2]
        # Independent votes concentrate near n times the average distribution's top probability.
        assert cold["top"]["quantiles"][-1] < 2 * cold["average_top_probability"]
        assert np.isclose(sum(hot["top"]["histogram"]), stored["config"]["shape_histograms"])
