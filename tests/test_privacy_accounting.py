"""Accounting against dp_accounting computed independently, calibration and validation."""

import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import RdpAccountant

from dpmix_jax.privacy import accounting


def test_pld_golden_value_matches_direct_pld_computation():
    eps = accounting.epsilon(
        accounting.dpsgd_event(noise_multiplier=3.0, sampling_rate=0.1, steps=512), delta=1e-6
    )
    direct = (
        privacy_loss_distribution.from_gaussian_mechanism(
            3.0, sampling_prob=0.1, value_discretization_interval=1e-4
        )
        .self_compose(512)
        .get_epsilon_for_delta(1e-6)
    )
    assert eps == pytest.approx(direct, rel=1e-6)
    assert eps == pytest.approx(3.77, abs=0.01)


def test_rdp_golden_value_matches_direct_rdp_computation():
    q, sigma, steps, delta = 256 / 60000, 1.1, 10_000, 1e-5
    eps = accounting.epsilon(
        accounting.dpsgd_event(noise_multiplier=sigma, sampling_rate=q, steps=steps),
        delta=delta,
        accountant="rdp",
    )
    direct = RdpAccountant()
    direct.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    assert eps == pytest.approx(direct.get_epsilon(delta), rel=1e-9)
    assert eps == pytest.approx(2.16, abs=0.01)


def test_pld_is_tighter_than_rdp():
    event = accounting.dpsgd_event(noise_multiplier=1.1, sampling_rate=0.01, steps=1000)
    assert accounting.epsilon(event, delta=1e-5) < accounting.epsilon(
        event, delta=1e-5, accountant="rdp"
    )


def test_full_batch_is_the_plain_gaussian_mechanism():
    eps = accounting.epsilon(
        accounting.dpsgd_event(noise_multiplier=2.0, sampling_rate=1.0, steps=4), delta=1e-5
    )
    # T Gaussian mechanisms of σ compose exactly to one of σ / sqrt(T).
    exact = dp_accounting.get_epsilon_gaussian(2.0 / math.sqrt(4), 1e-5)
    assert eps == pytest.approx(exact, rel=1e-3)


@pytest.mark.parametrize(
    ("target", "rate", "steps", "accountant"),
    [(1.0, 0.1, 512, "pld"), (2.0, 0.02, 100, "pld"), (1.0, 0.01, 1000, "rdp")],
)
def test_calibration_round_trips_without_exceeding_the_target(target, rate, steps, accountant):
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=target, delta=1e-6, sampling_rate=rate, steps=steps, accountant=accountant
    )
    event = accounting.dpsgd_event(noise_multiplier=sigma, sampling_rate=rate, steps=steps)
    eps = accounting.epsilon(event, delta=1e-6, accountant=accountant)
    assert eps <= target
    assert eps >= 0.99 * target
    if (target, rate, steps, accountant) == (1.0, 0.1, 512, "pld"):
        assert sigma == pytest.approx(9.66, abs=0.01)  # dp_accounting's documented value


def test_budgets_compose():
    a, b = accounting.PrivacyBudget(1.0, 1e-5), accounting.PrivacyBudget(2.0, 1e-6)
    assert accounting.compose_parallel(a, b) == accounting.PrivacyBudget(2.0, 1e-5)
    seq = accounting.compose_sequential(a, b)
    assert seq.epsilon == pytest.approx(3.0)
    assert seq.delta == pytest.approx(1.1e-5)
    with pytest.raises(ValueError, match="at least one"):
        accounting.compose_parallel()


def test_ledger_merges_repeats_and_matches_the_composed_event():
    step = accounting.dpsgd_event(noise_multiplier=1.0, sampling_rate=0.01, steps=1)
    other = accounting.dpsgd_event(noise_multiplier=2.0, sampling_rate=0.02, steps=1)
    ledger = accounting.PrivacyLedger()
    for _ in range(100):
        ledger.record(step)
    ledger.record(other, count=50)
    assert ledger.count == 150 and len(ledger.entries) == 2
    direct = accounting.make_accountant()
    direct.compose(
        dp_accounting.ComposedDpEvent(
            [
                dp_accounting.SelfComposedDpEvent(step, 100),
                dp_accounting.SelfComposedDpEvent(other, 50),
            ]
        )
    )
    assert ledger.epsilon(1e-5) == pytest.approx(direct.get_epsilon(1e-5), rel=1e-9)


def test_ledger_state_round_trips_through_json():
    ledger = accounting.PrivacyLedger()
    ledger.record(accounting.dpsgd_event(noise_multiplier=1.0, sampling_rate=0.05, steps=1), 30)
    restored = accounting.PrivacyLedger.from_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored == ledger
    assert restored.epsilon(1e-5) == ledger.epsilon(1e-5)


def test_empty_ledger_spends_nothing():
    assert accounting.PrivacyLedger().epsilon(1e-5) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_epsilon": 0.0}, "target_epsilon"),
        ({"target_epsilon": -1.0}, "target_epsilon"),
        ({"target_epsilon": math.inf}, "target_epsilon"),
        ({"delta": 0.0}, "delta"),
        ({"delta": 1.0}, "delta"),
        ({"sampling_rate": 0.0}, "sampling_rate"),
        ({"sampling_rate": 1.5}, "sampling_rate"),
        ({"steps": 0}, "steps"),
        ({"steps": 2.5}, "steps"),
        ({"accountant": "moments"}, "accountant"),
    ],
)
def test_bad_calibration_input_is_rejected(kwargs, message):
    args = {"target_epsilon": 1.0, "delta": 1e-5, "sampling_rate": 0.1, "steps": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        accounting.calibrate_noise_multiplier(**args)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"noise_multiplier": -1.0}, "noise_multiplier"),
        ({"sampling_rate": -0.1}, "sampling_rate"),
        ({"steps": 0}, "steps"),
    ],
)
def test_bad_event_input_is_rejected(kwargs, message):
    args = {"noise_multiplier": 1.0, "sampling_rate": 0.1, "steps": 10} | kwargs
    with pytest.raises(ValueError, match=message):
        accounting.dpsgd_event(**args)


def test_bad_budget_and_delta_are_rejected():
    with pytest.raises(ValueError, match="epsilon"):
        accounting.PrivacyBudget(-1.0, 1e-5)
    with pytest.raises(ValueError, match="delta"):
        accounting.PrivacyBudget(1.0, 1.5)
    event = accounting.dpsgd_event(noise_multiplier=1.0, sampling_rate=0.1, steps=1)
    with pytest.raises(ValueError, match="delta"):
        accounting.epsilon(event, delta=0.0)
