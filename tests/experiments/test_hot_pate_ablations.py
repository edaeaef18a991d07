"""Hot PATE's ablations (`experiments/hot_pate_ablations.py`): the library pieces they add, a tiny
run, and the paper's claims checked on the stored run (`docs/results/hot_pate_ablations.json`)."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.pate import accounting, aggregators, diversity, metrics, samplers
from dpmix_jax.pate.teachers import sampled_logits
from experiments import hot_pate_ablations as ablations
from experiments.configs import hot_pate_ablations as configs

ROOT = pathlib.Path(__file__).resolve().parents[2]
STORED = ROOT / "docs" / "results" / "hot_pate_ablations.json"


# --------------------------------------------------------------------------------------------
# Library pieces.
# --------------------------------------------------------------------------------------------


def test_one_answer_per_teacher_makes_coordinated_sampling_independent():
    """m = 1: every teacher is a point mass at its one answer, so the coordinated histogram is
    the bincount of the answers whatever the shared noise."""
    logits = jax.random.normal(jax.random.key(0), (40, 30))
    estimate = sampled_logits(jax.random.key(1), logits, 1)
    finite = np.isfinite(np.asarray(estimate))
    assert (finite.sum(axis=1) == 1).all()
    answers = np.argmax(finite, axis=1)
    expected = np.bincount(answers, minlength=30)
    for seed in range(3):
        hist = samplers.coordinated_histograms(jax.random.key(seed), estimate, 4)
        assert (np.asarray(hist) == expected).all()


def test_many_answers_estimate_the_distribution():
    logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]]))
    m = 40_000
    estimate = np.exp(np.asarray(sampled_logits(jax.random.key(2), logits, m, temperature=1.0)))
    np.testing.assert_allclose(estimate.sum(axis=1), 1.0, rtol=1e-6)
    assert estimate[0, 3] == 0.0  # a token of probability 0 is never answered
    np.testing.assert_allclose(estimate, np.exp(np.asarray(logits)), atol=5 / np.sqrt(m))
    hot = np.exp(np.asarray(sampled_logits(jax.random.key(3), logits, m, temperature=2.0)))
    tempered = np.sqrt(np.asarray([[0.5, 0.3, 0.2, 0.0], [0.1, 0.1, 0.1, 0.7]]))
    np.testing.assert_allclose(hot, tempered / tempered.sum(1, keepdims=True), atol=5 / np.sqrt(m))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_samples": 0}, "num_samples"),
        ({"num_samples": 2.5}, "num_samples"),
        ({"num_samples": 2, "temperature": 0.0}, "temperature"),
    ],
)
def test_sampled_logits_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        sampled_logits(jax.random.key(0), jnp.zeros((2, 3)), **kwargs)


def test_threshold_at_coverage_matches_a_scan_of_every_threshold():
    rng = np.random.default_rng(0)
    for _ in range(100):
        r, vocab, n = rng.integers(1, 6), rng.integers(1, 7), rng.integers(2, 15)
        hist = np.stack([rng.multinomial(n, rng.dirichlet(np.full(vocab, 0.3))) for _ in range(r)])
        level = rng.uniform(0.05, 1.0)
        scanned = [
            t
            for t in range(1, n + 1)
            if np.mean([h[h >= t].sum() / n for h in hist]) >= level - 1e-12
        ]
        assert metrics.threshold_at_coverage(hist, level) == (max(scanned) if scanned else 0.0)
        grid = np.array([1.5, 2.0, n / 2])
        on_grid = [t for t in grid if np.mean([h[h >= t].sum() / n for h in hist]) >= level]
        assert metrics.threshold_at_coverage(hist, level, grid) == (
            max(on_grid) if on_grid else 0.0
        )
    with pytest.raises(ValueError, match="level"):
        metrics.threshold_at_coverage(np.ones((2, 2), int), 0.0)
    for bad, message in (
        (np.array([[3, 1], [2, 1]]), "same n"),  # rows of different sizes
        (np.array([[5, -1], [2, 2]]), "integers >= 0"),
        (np.array([[1.5, 2.5], [2.0, 2.0]]), "integers >= 0"),
    ):
        with pytest.raises(ValueError, match=message):
            metrics.threshold_at_coverage(bad, 0.5)


def test_dpws_epsilon_at_inverts_the_keep_threshold():
    for threshold in (1.5, 12.0, 480.0):
        for delta in (1e-8, 1e-5):
            epsilon = aggregators.dpws_epsilon_at(threshold, delta)
            assert aggregators.dpws_threshold(epsilon, delta) == pytest.approx(threshold)
    with pytest.raises(ValueError, match="threshold > 1"):
        aggregators.dpws_epsilon_at(1.0, 1e-6)


def test_max_steps_is_the_last_count_within_the_budget():
    event = accounting.dpws_event(0.3)
    steps = accounting.max_steps(event, epsilon=5.0, delta=1e-6)

    def independent(count):  # dp-accounting's own PLD accountant, built here
        accountant = dp_accounting.pld.PLDAccountant()
        accountant.compose(dp_accounting.LaplaceDpEvent(1 / 0.3), count)
        return accountant.get_epsilon(1e-6)

    assert independent(steps) <= 5.0 + 1e-9 < independent(steps + 1)
    assert accounting.max_steps(accounting.dpws_event(6.0), epsilon=5.0, delta=1e-6) == 0
    assert accounting.max_steps(event, epsilon=50.0, delta=1e-6, limit=10) == 10


def test_one_hot_aggregators_match_the_aggregators():
    counts = jnp.asarray([5, 9, 0, 2])
    for threshold in (3.0, 10.0):
        out = diversity.targmax_aggregator(threshold)(jax.random.key(0), counts)
        token = int(aggregators.targmax(counts, threshold))
        assert int(np.argmax(out)) == (4 if token < 0 else token)
    key = jax.random.key(5)
    out = diversity.dpargmax_aggregator(8.0, 1.0)(key, counts)
    token = int(aggregators.dpargmax_laplace(key, counts, 8.0, 1.0))
    assert int(np.argmax(out)) == (4 if token < 0 else token) and out.sum() == 1


def test_secret_set_logits_put_the_stated_masses():
    logits, secret = diversity.secret_set_logits(
        jax.random.key(0),
        num_teachers=50,
        vocab_size=300,
        set_size=4,
        private_mass=0.2,
        heterogeneity=0.0,
        background_mass=0.01,
    )
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    assert len(set(np.asarray(secret).tolist())) == 4
    on_secret = probs[:, np.asarray(secret)]
    np.testing.assert_allclose(on_secret.sum(1), 0.79, atol=0.01)
    np.testing.assert_allclose(on_secret, np.broadcast_to(on_secret[:, :1], (50, 4)), rtol=1e-5)
    elsewhere = probs.copy()
    elsewhere[:, np.asarray(secret)] = 0.0
    np.testing.assert_allclose(elsewhere.max(1), 0.2, atol=0.01)  # the private token
    np.testing.assert_allclose(np.sort(elsewhere, 1)[:, -2], 0.01 / 300, rtol=0.01)


def test_group_ensemble_and_its_measures():
    probs = ablations.group_ensemble((3, 2, 1))
    np.testing.assert_allclose(probs.sum(1), 1.0)
    assert probs.shape == (6, 6) and probs[3, 2] == 0.6 and probs[5, 5] == 0.4
    # Output only group 0's tokens half the time, nothing otherwise.
    output = np.array([0.3, 0.2, 0, 0, 0, 0, 0.5])
    assert ablations.groups_transferred(output, (3, 2, 1)) == 1
    reference = probs.mean(axis=0)
    tv = 0.5 * np.abs(output[:-1] / 0.5 - reference).sum()
    assert ablations.total_variation_given_yield(output, reference) == pytest.approx(tv)
    assert ablations.total_variation_given_yield(np.r_[np.zeros(6), 1.0], reference) is None


def test_secret_share_pools_the_passing_votes():
    hist = np.array([[5, 3, 2], [1, 1, 8]])
    assert ablations.secret_share(hist, np.array([0]), 3) == pytest.approx(5 / 16)
    assert ablations.secret_share(hist, np.array([0]), 9) is None


def test_group_stream_has_its_groups_on_its_group_steps():
    config = configs.get_config("tiny")
    stream = ablations.group_stream(config, jax.random.key(0), 200)
    is_group, members = stream["is_group"], stream["members"]
    assert is_group.sum() == round(config.individual_group_share * 200)
    assert (members[is_group].sum(axis=1) == config.individual_group_size).all()
    assert not members[~is_group].any()
    assert stream["jitter"].shape == (config.num_teachers, config.vocab_size)
    assert ((stream["tokens"] >= 0) & (stream["tokens"] < config.vocab_size)).all()


def test_the_config_refuses_inconsistent_settings():
    with pytest.raises(ValueError, match="group_sizes"):
        configs.AblationsConfig(num_teachers=100)
    with pytest.raises(ValueError, match="individual_group_size"):
        configs.AblationsConfig(individual_group_size=0)
    with pytest.raises(ValueError, match="individual_heterogeneity"):
        configs.AblationsConfig(individual_heterogeneity=(-0.1,))
    with pytest.raises(ValueError, match="temperatures"):
        configs.AblationsConfig(temperatures=(1.0, 0.0))
    with pytest.raises(ValueError, match="call_delta"):
        configs.AblationsConfig(call_delta=1.0)


# --------------------------------------------------------------------------------------------
# A tiny run.
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tiny_run_writes_its_report_and_shows_the_contrasts(tmp_path):
    config = dataclasses.replace(configs.get_config("tiny"), progress=False)
    results = ablations.main(config, tmp_path, reproducible=True)
    assert {p.name for p in tmp_path.iterdir()} == {
        "results.json",
        "results.md",
        "hot_pate_ablations.png",
    }
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["provenance"]["commit"] and stored["noise_seeded"] is True
    table = (tmp_path / "results.md").read_text()
    assert table == ablations.markdown(config, stored) + "\n"
    hetero = {
        (r["aggregator"], r["sampler"]): r
        for r in results["aggregators"]
        if r["ensemble"] == "heterogeneous"
    }
    assert hetero["TWS", "coordinated"]["groups_transferred"] == len(config.group_sizes)
    assert hetero["TARGMAX", "coordinated"]["groups_transferred"] == 1
    for row in results["temperature"]:
        assert row["coordinated"]["threshold"] >= row["independent"]["threshold"]
    # (j): the filter keeps answering the groups where charging every teacher at every step
    # stops after M steps, and no teacher is charged more than M times.
    rows = {(r["steps"], r["heterogeneity"], r["method"]): r for r in results["individual"]}
    longest = max(config.stream_steps)
    for h in config.individual_heterogeneity:
        mine, stop, wide = (rows[longest, h, method] for method in ablations.ACCOUNTINGS)
        assert mine["steps_run"] == longest and stop["steps_run"] == stop["budget"] < longest
        assert mine["group_correct"] > stop["group_correct"]
        assert mine["group_correct"] > wide["group_correct"]
        assert mine["group_correct"] >= 0.5 * mine["group_steps"]
    for row in results["individual"]:
        assert row["max_charge"] <= row["budget"]
        assert row["epsilon"] <= config.stream_epsilon
        assert row["other_histogram_tokens"] + row["fallback_tokens"] <= row["steps_run"]


# --------------------------------------------------------------------------------------------
# The paper's claims on the stored run.
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored():
    return json.loads(STORED.read_text())


def test_stored_run_is_the_cpu_preset_and_its_table(stored):
    config = configs.get_config("cpu")
    mine = json.loads(json.dumps(dataclasses.asdict(config)))
    assert {k: v for k, v in stored["config"].items() if k != "progress"} == {
        k: v for k, v in mine.items() if k != "progress"
    }
    assert "+modified" not in stored["provenance"]["commit"]
    page = (ROOT / "docs" / "results" / "hot_pate_ablations.md").read_text()
    assert page == ablations.markdown(config, stored) + "\n"


def test_the_plot_draws_from_the_stored_run_alone(stored, tmp_path):
    ablations.plot(stored, tmp_path / "hot_pate_ablations.png")
    assert (tmp_path / "hot_pate_ablations.png").stat().st_size > 10_000


def test_presets_are_the_commands_choices():
    assert list(configs.PRESETS) == ["cpu", "tiny"]
    for name in configs.PRESETS:
        assert isinstance(configs.get_config(name), configs.AblationsConfig)
    flags = {a.dest: a for a in ablations.cli.parser()._actions}
    assert flags["preset"].choices == tuple(configs.PRESETS) and flags["preset"].default == "cpu"


def test_coordination_advantage_grows_with_temperature(stored):
    """The paper: Hot PATE's advantage grows with diversity (temperature): at every k the ratio
    of the thresholds the two samplers pass is larger at the hottest than at the coldest t."""
    for k in configs.get_config("cpu").temperature_set_sizes:
        rows = sorted(
            (r for r in stored["temperature"] if r["k"] == k), key=lambda r: r["temperature"]
        )
        ratios = [r["coordinated"]["threshold"] / r["independent"]["threshold"] for r in rows]
        assert all(r["coordinated"]["threshold"] > r["independent"]["threshold"] for r in rows)
        assert ratios[-1] > ratios[0], (k, ratios)


def test_argmax_suffices_on_homogeneous_ensembles_weighted_sampling_on_heterogeneous(stored):
    rows = {(r["ensemble"], r["aggregator"], r["sampler"]): r for r in stored["aggregators"]}
    groups = len(configs.get_config("cpu").group_sizes)
    for name in ("TARGMAX", "TWS", "DPARGMAX", "DPWS"):
        homogeneous = rows["homogeneous", name, "coordinated"]
        assert homogeneous["yield"] > 0.5 and homogeneous["total_variation"] < 0.05
        assert rows["homogeneous", name, "independent"]["yield"] < 0.01
    assert rows["heterogeneous", "TARGMAX", "coordinated"]["groups_transferred"] == 1
    assert rows["heterogeneous", "DPARGMAX", "coordinated"]["groups_transferred"] == 1
    assert rows["heterogeneous", "TWS", "coordinated"]["groups_transferred"] == groups
    assert (
        rows["heterogeneous", "TWS", "coordinated"]["total_variation"]
        < 0.1
        < rows["heterogeneous", "TARGMAX", "coordinated"]["total_variation"]
    )


def test_coordination_buys_orders_of_magnitude_more_calls(stored):
    """The budget that pays for the coordinated DPWS calls pays for ever fewer independent ones
    as diversity grows: alike at k = 1, >= 10x fewer from k = 5, >= 100x fewer at k = 50."""
    ratios = []
    for row in sorted(stored["privacy_cost"], key=lambda r: r["k"]):
        hot, cold = row["coordinated"], row["independent"]
        ratios.append(hot["calls_in_budget"] / max(cold["calls_in_budget"], 1))
        if row["k"] == 1:
            assert 0.5 < hot["threshold"] / cold["threshold"] < 2
        if row["k"] >= 5:
            assert ratios[-1] >= 10
        if row["k"] >= 50:
            assert ratios[-1] >= 100
        if hot["dpws_yield"] is not None:
            assert hot["dpws_yield"] > 0.1  # the priced ε really yields at that threshold
    assert ratios == sorted(ratios)


def test_api_teachers_recover_coordination_with_more_answers(stored):
    for k in configs.get_config("cpu").temperature_set_sizes:
        rows = [r for r in stored["api_teachers"] if r["k"] == k]
        sampled = sorted((r for r in rows if r["samples"]), key=lambda r: r["samples"])
        exact = {r["sampler"]: r for r in rows if r["samples"] is None}
        coverage = [r["coverage_at_half"] for r in sampled]
        assert coverage == sorted(coverage)
        one = sampled[0]
        assert one["samples"] == 1
        assert abs(one["coverage_at_half"] - exact["independent"]["coverage_at_half"]) < 0.05
        assert exact["coordinated"]["coverage_at_half"] - coverage[-1] < 0.1


def test_a_sparse_gate_makes_steps_with_no_output_free(stored):
    """DPARGMAX charged on every step spends its budget on the unanswerable steps: its per-call
    ε falls with the stream's length and its answers become noise. The sparse gate's cost does
    not depend on the length: from 1000 steps on it gives more right tokens and almost no
    answers to the unanswerable steps, where DPARGMAX answers most of them."""
    config = configs.get_config("cpu")
    rows = {(r["steps"], r["method"]): r for r in stored["stream"]}
    for steps in config.stream_steps:
        gate, every = rows[steps, "sparse"], rows[steps, "dpargmax"]
        assert gate["epsilon"] <= config.stream_epsilon + 1e-3
        assert every["epsilon"] <= config.stream_epsilon + 1e-3
        assert gate["correct"] >= every["correct"] and gate["answered_unanswerable"] < 0.05
        if steps >= 1000:
            assert gate["correct"] > every["correct"] + 0.2
            assert every["answered_unanswerable"] > 0.5
    per_call = [rows[s, "dpargmax"]["per_answer_epsilon"] for s in config.stream_steps]
    assert per_call == sorted(per_call, reverse=True)
    assert len({rows[s, "sparse"]["per_answer_epsilon"] for s in config.stream_steps}) == 1


def test_individual_accounting_answers_the_groups_to_the_end(stored):
    """At the same per-teacher (ε, δ), the Rényi filter charges a teacher only for the steps in
    which it votes against the public model: the groups are answered all along the stream. The
    standard accounting charges every teacher every step: it stops after M steps, or, with the σ
    that covers the stream, drowns the groups from 1000 steps on. No teacher is ever charged more
    than M times."""
    config = configs.get_config("cpu")
    rows = {(r["steps"], r["heterogeneity"], r["method"]): r for r in stored["individual"]}
    for row in stored["individual"]:
        assert row["max_charge"] <= row["budget"]
        assert row["epsilon"] <= config.stream_epsilon
    for steps in config.stream_steps:
        for h in config.individual_heterogeneity:
            mine, stop, wide = (rows[steps, h, method] for method in ablations.ACCOUNTINGS)
            assert mine["steps_run"] == steps and stop["steps_run"] == min(steps, stop["budget"])
            assert mine["group_correct"] >= 0.5 * mine["group_steps"]
            if steps >= 1000:
                assert mine["group_correct"] > 5 * max(stop["group_correct"], 1)
                assert wide["group_correct"] <= 0.05 * wide["group_steps"]
