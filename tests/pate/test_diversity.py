"""The (τ, β, γ) diversity-preservation guarantee, measured on our sampler + aggregator."""

import jax
import numpy as np
import pytest

from dpmix_jax.pate import diversity

N = 32


def measure(probs, sampler, aggregator, draws=20_000, seed=0):
    return diversity.output_distribution(
        jax.random.key(seed), probs, sampler=sampler, aggregator=aggregator, num_draws=draws
    )


def test_identical_teachers_transfer_their_distribution_exactly():
    # Identical teachers always vote together: the histogram is n·e_J with J ~ p, so TWS_{T,1}
    # outputs exactly p (T <= n). The estimate must agree within its standard errors.
    p = np.array([0.5, 0.25, 0.125, 0.0625, 0.0625])
    est = measure(np.tile(p, (N, 1)), "coordinated", diversity.tws_aggregator(N / 2, 1.0))
    expected = np.append(p, 0.0)
    assert np.all(np.abs(est.probs - expected) <= 5 * est.stderr + 1e-12)
    assert est.probs[-1] == 0.0


def test_attained_beta_and_gamma_match_a_direct_computation():
    # Token 0: teacher probabilities (0.5, 0.2, 0.2, 0); token 1 the rest. τ = 2.
    probs = np.array([[0.5, 0.5], [0.2, 0.8], [0.2, 0.8], [0.0, 1.0]])
    est = diversity.OutputEstimate(
        probs=np.array([0.1, 0.5, 0.4]), stderr=np.array([0.01, 0.0, 0.0]), num_draws=100
    )
    got = diversity.attained(probs, est, tau=2, z=2.0)
    # Direct: for q in (0, 0.2] c_{0,q} = 3, for q in (0.2, 0.5] c = 1 < τ: worst q = 0.2, m = 3,
    # demand 3/4·0.2 = 0.15. Token 1: q = 0.8 gives m = 3 (0.6), q = 1 m = 1 < τ, q = 0.5 m = 4
    # (0.5): demand 0.6.
    assert got.beta == pytest.approx(min(0.1 / 0.15, 0.5 / 0.6))
    assert got.beta_token == 0
    assert got.beta_lower == pytest.approx((0.1 - 0.02) / 0.15)
    assert got.gamma == pytest.approx(max(0.1 / 0.225, 0.5 / 0.775))
    assert got.gamma_upper == pytest.approx(max(0.12 / 0.225, 0.5 / 0.775))


def test_attained_flags_output_on_a_token_no_teacher_supports():
    probs = np.array([[1.0, 0.0], [1.0, 0.0]])
    est = diversity.OutputEstimate(probs=np.array([0.9, 0.1, 0.0]), stderr=np.zeros(3), num_draws=9)
    assert diversity.attained(probs, est, tau=1).gamma == np.inf


@pytest.mark.slow
def test_dpws_transfers_at_the_theorem_tau_with_gamma_one():
    # DPWS_{(ε,δ)}: at τ = 4ε⁻¹ln(1/δ) the coordinated β stays a constant (measured about 0.5 at
    # worst here; checked >= 0.2 at 4 standard errors) and the relevance factor stays 1.
    epsilon, delta = 2.0, 1e-3
    tau = diversity.dpws_tau(epsilon, delta)
    n = 48
    for ensemble in diversity.adversarial_ensembles(n, tau):
        est = measure(
            ensemble.probs, "coordinated", diversity.dpws_aggregator(epsilon, delta, 1.0), 20_000
        )
        got = diversity.attained(ensemble.probs, est, tau)
        assert got.beta_lower >= 0.2, (ensemble.name, got)
        assert got.gamma_lower <= 1.0, (ensemble.name, got)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="sampler"):
        measure(np.full((2, 2), 0.5), "hot", diversity.tws_aggregator(1, 1.0))
    with pytest.raises(ValueError, match="rows of distributions"):
        measure(np.full((2, 2), 0.4), "coordinated", diversity.tws_aggregator(1, 1.0))
    with pytest.raises(ValueError, match="tau"):
        diversity.adversarial_ensembles(8, 9)
