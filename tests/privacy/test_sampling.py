"""Poisson sampling: rates, padding, user batches and checkpointable state."""

import numpy as np
import pytest
from scipy import stats

from dpmix_jax.privacy import sampling


def test_inclusion_frequency_matches_the_rate():
    sampler = sampling.PoissonSampler(sampling_rate=0.05, pad_multiple=16)
    rng = np.random.default_rng(0)
    n, trials = 400, 500
    counts = np.zeros(n)
    sizes = []
    for _ in range(trials):
        batch = sampler.sample(rng, n)
        counts[batch.indices[batch.mask]] += 1
        sizes.append(int(batch.mask.sum()))
    # Batch sizes are Binomial(n, q); inclusions per example are Binomial(trials, q).
    expected_mean, expected_var = n * 0.05, n * 0.05 * 0.95
    assert abs(np.mean(sizes) - expected_mean) < 5 * np.sqrt(expected_var / trials)
    assert np.var(sizes) == pytest.approx(expected_var, rel=0.2)
    assert abs(counts.mean() / trials - 0.05) < 0.003
    assert stats.chisquare(counts).pvalue > 0.001


def test_batches_are_padded_to_the_multiple_with_minus_one():
    sampler = sampling.PoissonSampler(sampling_rate=0.3, pad_multiple=32)
    batch = sampler.sample(np.random.default_rng(1), 100)
    assert batch.indices.shape[0] % 32 == 0
    assert np.all(batch.indices[~batch.mask] == -1)
    assert np.all(batch.indices[batch.mask] >= 0)
    assert len(np.unique(batch.indices[batch.mask])) == batch.mask.sum()


def test_sample_steps_stacks_independent_batches_to_one_shape():
    sampler = sampling.PoissonSampler(sampling_rate=0.1, pad_multiple=8)
    batches = sampler.sample_steps(np.random.default_rng(2), 200, steps=30)
    assert batches.indices.shape[0] == 30 and batches.indices.shape[1] % 8 == 0
    sizes = batches.mask.sum(axis=1)
    assert sizes.max() <= batches.indices.shape[1] < sizes.max() + 8
    assert len(set(sizes.tolist())) > 1


def test_user_sampler_caps_examples_and_keeps_users_in_one_row():
    user_ids = np.array([0] * 10 + [1] * 2 + [2] * 5 + [3] * 1)
    users = sampling.group_by_user(user_ids)
    sampler = sampling.UserPoissonSampler(
        sampling_rate=1.0, max_examples_per_user=3, pad_multiple=8
    )
    batch = sampler.sample(np.random.default_rng(3), users)
    assert batch.indices.shape == (8, 3)
    for row, user in enumerate(batch.users[batch.users >= 0]):
        examples = batch.indices[row][batch.mask[row]]
        assert len(examples) == min(3, len(users[user]))
        assert set(user_ids[examples]) == {user}
    assert not batch.mask[batch.users < 0].any()


def test_user_sampler_rejects_users_without_examples():
    sampler = sampling.UserPoissonSampler(sampling_rate=0.5, max_examples_per_user=2)
    with pytest.raises(ValueError, match="at least one example"):
        sampler.sample(np.random.default_rng(0), [np.array([0, 1]), np.array([], dtype=int)])


def test_generator_state_round_trips():
    rng = np.random.default_rng(7)
    rng.random(10)
    restored = sampling.restore_generator(sampling.generator_state(rng))
    np.testing.assert_array_equal(rng.random(5), restored.random(5))


@pytest.mark.parametrize("rate", [0.0, -0.5, 1.01])
def test_bad_rates_are_rejected(rate):
    with pytest.raises(ValueError, match="sampling_rate"):
        sampling.PoissonSampler(sampling_rate=rate)


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="pad_multiple"):
        sampling.PoissonSampler(sampling_rate=0.1, pad_multiple=0)
    with pytest.raises(ValueError, match="max_examples_per_user"):
        sampling.UserPoissonSampler(sampling_rate=0.1, max_examples_per_user=0)
    with pytest.raises(ValueError, match="num_units"):
        sampling.PoissonSampler(sampling_rate=0.1).sample(np.random.default_rng(0), 0)
