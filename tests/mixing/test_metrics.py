"""Mixture-quality metrics against closed forms."""

import numpy as np
import pytest

from dpmix_jax.mixing import metrics, objectives


def test_cosine_and_l1_closed_forms():
    a, b = np.array([0.2, 0.3, 0.5]), np.array([0.5, 0.5, 0.0])
    assert metrics.cosine_similarity(a, b) == pytest.approx(0.25 / (np.sqrt(0.38) * np.sqrt(0.5)))
    assert metrics.cosine_similarity(a, a) == pytest.approx(1.0)
    assert metrics.cosine_similarity(np.array([1.0, 0]), np.array([0, 1.0])) == pytest.approx(0.0)
    assert metrics.l1_distance(a, b) == pytest.approx(0.3 + 0.2 + 0.5)
    assert metrics.l1_distance(a, a) == 0.0


def test_excess_loss_is_the_difference_of_objectives():
    preds = np.random.default_rng(1).uniform(0.05, 0.95, size=(50, 3))
    w, ref = np.array([0.6, 0.3, 0.1]), np.array([1 / 3, 1 / 3, 1 / 3])
    expected = np.mean(-np.log(preds @ w)) - np.mean(-np.log(preds @ ref))
    assert metrics.excess_loss(w, ref, preds) == pytest.approx(expected, rel=1e-4, abs=1e-6)
    assert metrics.excess_loss(ref, ref, preds) == 0.0
    assert float(objectives.mixmin_loss(w, preds)) == pytest.approx(
        np.mean(-np.log(preds @ w)), rel=1e-5
    )


def test_metric_inputs_are_validated():
    with pytest.raises(ValueError, match="equal shape"):
        metrics.cosine_similarity(np.ones(2), np.ones(3))
    with pytest.raises(ValueError, match="zero vector"):
        metrics.cosine_similarity(np.zeros(2), np.ones(2))
    with pytest.raises(ValueError, match="finite"):
        metrics.l1_distance(np.array([np.nan, 1.0]), np.ones(2))
    with pytest.raises(ValueError, match="sum to 1"):
        metrics.excess_loss(np.ones(2), np.array([0.5, 0.5]), np.full((3, 2), 0.5))


def test_uniform_cosine_is_one_over_root_k_norm():
    # cos(1/k, λ) = Σλ / (√k ‖λ‖) = 1 / (√k ‖λ‖) for a mixture λ.
    assert metrics.uniform_cosine(np.full(5, 0.2)) == pytest.approx(1.0)
    assert metrics.uniform_cosine(np.eye(4)[2]) == pytest.approx(0.5)
    weights = np.array([0.5, 0.3, 0.2, 0.0])
    expected = 1.0 / (2.0 * np.sqrt(0.25 + 0.09 + 0.04))
    assert metrics.uniform_cosine(weights) == pytest.approx(expected)
