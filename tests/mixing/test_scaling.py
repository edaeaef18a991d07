"""DP-MixMin's schedule in k against the hand formulas, C_k from public data, gradient norms
against the per-example gradients, and the fitted log-log slope."""

import jax
import numpy as np
import pytest

from dpmix_jax.mixing import objectives, scaling, solvers
from dpmix_jax.mixing.synthetic import mixture_problem


def test_steps_and_learning_rate_match_the_hand_formulas():
    budget = dict(num_examples=3000, epsilon=1.0, delta=1e-5)
    # (nε)² / (ln k · ln(1/δ)) = 9e6 / (3.4657 · 11.5129) = 225,559.6 at k = 32.
    assert scaling.mirror_descent_steps(32, max_steps=10**7, **budget) == 225_560
    assert scaling.mirror_descent_steps(32, max_steps=1000, **budget) == 1000
    # (nε / (ln k · √ln(1/δ)))^(2/3) = 40.22 at k = 32, 25.40 at k = 1000, 117.6 at k = 2.
    assert scaling.frank_wolfe_steps(32, max_steps=1000, **budget) == 41
    assert scaling.frank_wolfe_steps(1000, max_steps=1000, **budget) == 26
    assert scaling.frank_wolfe_steps(2, max_steps=1000, **budget) == 118
    assert scaling.frank_wolfe_steps(2, max_steps=100, **budget) == 100
    # √(2 ln 32 / 1000) / 20 = 0.0041628.
    rate = scaling.mirror_descent_learning_rate(32, steps=1000, clip_norm=20.0, step_size=1.0)
    assert rate == pytest.approx(0.004162773, rel=1e-6)


def test_schedule_picks_the_solvers_rule():
    budget = dict(num_examples=3000, epsilon=1.0, delta=1e-5, max_steps=1000, step_size=20.0)
    steps, rate = scaling.schedule(32, "mirror_descent", clip_norm=20.0, **budget)
    assert steps == 1000 and rate == pytest.approx(20.0 * 0.004162773, rel=1e-6)
    assert scaling.schedule(1000, "frank_wolfe", clip_norm=20.0, **budget) == (26, None)


def test_gradient_norms_are_those_of_the_shifted_per_example_gradients():
    preds, _ = mixture_problem(num_examples=50, num_sources=4, seed=1)
    weights = np.array([0.1, 0.2, 0.3, 0.4])
    examples = objectives.prepare_examples(preds)
    for shift in solvers.SHIFTS:
        grad = jax.vmap(jax.grad(solvers.shifted_example_loss("nll", shift)), in_axes=(None, 0))
        expected = np.linalg.norm(np.asarray(grad(weights, examples)), axis=1)
        np.testing.assert_allclose(
            scaling.gradient_norms(preds, weights, shift=shift), expected, rtol=1e-6
        )
    np.testing.assert_array_equal(
        scaling.gradient_norms(preds, weights),
        scaling.gradient_norms(preds, weights, shift=solvers.DEFAULT_SHIFT),
    )


def test_public_clip_norm_is_a_scaled_quantile_on_a_quarter_octave_grid():
    public = [mixture_problem(num_examples=400, num_sources=8, seed=s)[0] for s in (5, 6)]
    clip_norm = scaling.public_clip_norm(public, quantile=0.9, scale=4.0)
    norms = np.concatenate([scaling.gradient_norms(p, np.full(8, 1 / 8)) for p in public])
    raw = 4.0 * np.quantile(norms, 0.9)
    assert (4 * np.log2(clip_norm)) == pytest.approx(round(4 * np.log2(clip_norm)))
    assert 2**-0.125 <= clip_norm / raw <= 2**0.125


def test_loglog_slope_recovers_a_power_law_over_the_fitted_range():
    sizes = np.array([2, 8, 32, 128, 512])
    values = 3.0 * sizes**0.5
    values[0] = 100.0  # below min_size: ignored
    assert scaling.loglog_slope(sizes, values, 8) == pytest.approx(0.5)
    assert scaling.loglog_slope(sizes, np.zeros(5), 2) == pytest.approx(0.0)  # floored at 1e-12
