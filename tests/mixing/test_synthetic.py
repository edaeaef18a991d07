"""The synthetic mixture problem: its shapes and λ*, and its seed (MixMin recovering λ* is in
test_mixing_solvers)."""

import numpy as np
import pytest

from dpmix_jax.mixing.synthetic import mixture_problem


def test_true_weights_are_a_sparse_mixture_and_preds_are_probabilities():
    preds, true_weights = mixture_problem(num_examples=300, num_sources=10, seed=0, support=3)
    assert preds.shape == (300, 10) and preds.dtype == np.float32
    assert ((preds > 0) & (preds < 1)).all()
    assert np.count_nonzero(true_weights) == 3 and true_weights.sum() == pytest.approx(1.0)
    _, small = mixture_problem(num_examples=10, num_sources=2, seed=0, support=4)
    assert np.count_nonzero(small) == 2  # the support is capped at k


def test_the_seed_draws_the_problem():
    first, weights = mixture_problem(num_examples=100, num_sources=6, seed=3)
    again, same = mixture_problem(num_examples=100, num_sources=6, seed=3)
    other, _ = mixture_problem(num_examples=100, num_sources=6, seed=4)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_array_equal(weights, same)
    assert not np.array_equal(first, other)
