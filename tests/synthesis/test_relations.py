"""Each generator's ε under add/remove and replace-one (`synthesis.relations`), against
independent computations."""

import dataclasses
import math

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from dpmix_jax.pate.method import Plan, RunSettings
from dpmix_jax.pate.peers import invisibleink as ink
from dpmix_jax.synthesis import registry, relations

ADD, REPLACE = relations.ADD_OR_REMOVE_ONE, relations.REPLACE_ONE


def run_settings(**overrides):
    base = dict(
        epsilon=1.0, delta=1e-5, num_samples=3, max_new_tokens=8, num_teachers=24, vocab_size=50
    )
    return RunSettings(**{**base, **overrides})


def pld_epsilon(event, delta, relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE):
    accountant = pld_privacy_accountant.PLDAccountant(relation)
    return accountant.compose(event).get_epsilon(delta)


@pytest.mark.parametrize("aggregator", ["confident_gnmax", "dpargmax_laplace", "dpws"])
def test_replace_one_is_every_methods_calibrated_guarantee_and_add_remove_is_smaller(aggregator):
    """The methods are calibrated to replace-one: that column is each plan's ε; add/remove is
    strictly smaller (a table with the relations swapped fails here)."""
    run = run_settings(aggregator=aggregator)
    rows = relations.table(run)
    assert [row["method"] for row in rows] == list(registry.REGISTRY)
    for row in rows:
        plan = registry.REGISTRY[row["method"]].calibrate(run)
        assert row[REPLACE] == pytest.approx(plan.planned_epsilon, rel=1e-6)
        assert row["guarantee"] == REPLACE
        assert 0 < row[ADD] < 0.9 * row[REPLACE]


def test_invisibleink_add_remove_is_a_quarter_of_rho_the_clip_halved():
    """ρ = 2(C/(nτ))² per token under replace-one, ρ/4 under add/remove: the same ε as the
    replace-one analysis at clip C/2, for both settings."""
    run = run_settings()
    for method in (ink.METHOD, ink.DISJOINT_METHOD):
        plan = method.calibrate(run)
        halved = dataclasses.replace(plan.config, clip_norm=plan.config.clip_norm / 2)
        steps = plan.mechanism["max_calls"]
        values = relations.plan_epsilons(plan)
        assert values[ADD] == pytest.approx(ink.epsilon(halved, steps=steps), rel=1e-9)
        rho = steps * 2 * (plan.config.clip_norm / plan.config.num_teachers) ** 2 / 4
        assert values[ADD] <= rho + 2 * math.sqrt(rho * math.log(1 / run.delta))


def test_confident_gnmax_votes_under_add_remove_are_unit_sensitivity_gaussians():
    """A vote dropped moves the histogram by L2 1, a vote moved by √2: the argmax's noise
    multiplier is σ2 under add/remove and σ2/√2 under replace-one (dp-accounting's PLD)."""
    run = run_settings(aggregator="confident_gnmax")
    plan = registry.REGISTRY["coordinated"].calibrate(run)
    sigma1, sigma2 = plan.config.sigma1, plan.config.sigma2
    calls = run.worst_case_tokens

    def composed(argmax_multiplier):
        step = dp_accounting.ComposedDpEvent(
            [
                dp_accounting.GaussianDpEvent(sigma1),
                dp_accounting.GaussianDpEvent(argmax_multiplier),
            ]
        )
        return dp_accounting.SelfComposedDpEvent(step, calls)

    values = relations.plan_epsilons(plan)
    assert values[ADD] == pytest.approx(pld_epsilon(composed(sigma2), run.delta), rel=1e-3)
    expected = pld_epsilon(composed(sigma2 / math.sqrt(2)), run.delta)
    assert values[REPLACE] == pytest.approx(expected, rel=1e-3)


def test_dp_sgd_replace_one_without_sampling_doubles_the_sensitivity():
    """Full batches: replacing an example moves the clipped sum by 2C, adding one by C, so
    replace-one at σ is add/remove at σ/2; with Poisson sampling each column is
    dp-accounting's PLD with that relation."""
    full = relations.dp_sgd_epsilons(noise_multiplier=4.0, sampling_rate=1.0, steps=10, delta=1e-6)
    halved = relations.dp_sgd_epsilons(
        noise_multiplier=2.0, sampling_rate=1.0, steps=10, delta=1e-6
    )
    assert full[REPLACE] == pytest.approx(halved[ADD], rel=1e-3)
    sampled = relations.dp_sgd_epsilons(
        noise_multiplier=1.0, sampling_rate=0.01, steps=100, delta=1e-6
    )
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 100
    )
    replace = dp_accounting.NeighboringRelation.REPLACE_ONE
    assert sampled[ADD] == pytest.approx(pld_epsilon(event, 1e-6), rel=1e-3)
    assert sampled[REPLACE] == pytest.approx(pld_epsilon(event, 1e-6, replace), rel=1e-3)
    assert sampled[ADD] < sampled[REPLACE]


def test_a_plan_without_an_analysis_is_refused():
    plan = registry.REGISTRY["invisibleink"].calibrate(run_settings())
    with pytest.raises(ValueError, match="plan.aggregator 'other' has no analysis"):
        relations.plan_epsilons(dataclasses.replace(plan, aggregator="other"))
    assert isinstance(plan, Plan)
