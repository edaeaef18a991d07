"""Coordinated and independent vote-histogram samplers: distributions, coupling, fast path."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpmix_jax.pate import samplers

NEG_INF = -np.inf


def probs_to_logits(p):
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore"):
        return jnp.asarray(np.log(p), jnp.float32)


def chi_square_pvalue(observed, probs):
    probs = np.asarray(probs)
    keep = probs > 0
    assert np.all(np.asarray(observed)[~keep] == 0)
    return stats.chisquare(np.asarray(observed)[keep], probs[keep] * np.sum(observed)).pvalue


def p_minhash(p, q):
    """Agreement probability of the shared-Gumbel coupling: Σ_j 1 / Σ_l max(p_l/p_j, q_l/q_j)."""
    total = 0.0
    for j in range(len(p)):
        if p[j] > 0 and q[j] > 0:
            total += 1.0 / sum(max(p[k] / p[j], q[k] / q[j]) for k in range(len(p)))
    return total


@pytest.mark.parametrize(
    "sampler", [samplers.coordinated_histograms, samplers.independent_histograms]
)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_each_teachers_marginal_is_its_distribution(sampler, temperature):
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    logits = probs_to_logits(p)[None]
    hist = np.asarray(sampler(jax.random.key(0), logits, 20000, temperature=temperature))
    tempered = p ** (1 / temperature) / np.sum(p ** (1 / temperature))
    assert chi_square_pvalue(hist.sum(axis=0), tempered) > 1e-3


@pytest.mark.parametrize(
    "sampler", [samplers.coordinated_histograms, samplers.independent_histograms]
)
def test_expected_counts_are_sums_of_teacher_probabilities(sampler):
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.2, 0.3, 0.1, 0.4], [0.0, 0.0, 0.5, 0.5]])
    hist = np.asarray(sampler(jax.random.key(1), probs_to_logits(p), 20000))
    assert hist.dtype == np.int32 and hist.shape == (20000, 4)
    assert np.all(hist.sum(axis=1) == 3)
    # Each count is a sum of 3 Bernoullis: standard error of the mean <= sqrt(3 * 0.25 / r).
    np.testing.assert_allclose(hist.mean(axis=0), p.sum(axis=0), atol=4 * np.sqrt(0.75 / 20000))


def test_coordinated_agreement_is_p_minhash_not_weighted_jaccard():
    p = [0.5, 0.3, 0.2, 0.0]
    q = [0.2, 0.3, 0.1, 0.4]
    hist = samplers.coordinated_histograms(jax.random.key(2), probs_to_logits([p, q]), 40000)
    agree = float(np.mean(np.asarray(hist).max(axis=1) == 2))
    exact = p_minhash(p, q)
    jaccard = sum(map(min, p, q)) / sum(map(max, p, q))
    se = np.sqrt(exact * (1 - exact) / 40000)
    assert abs(agree - exact) < 4 * se
    assert abs(agree - jaccard) > 10 * se and exact >= jaccard


def test_independent_agreement_is_product_of_marginals():
    p = [0.5, 0.3, 0.2, 0.0]
    q = [0.2, 0.3, 0.1, 0.4]
    hist = samplers.independent_histograms(jax.random.key(3), probs_to_logits([p, q]), 40000)
    agree = float(np.mean(np.asarray(hist).max(axis=1) == 2))
    exact = float(np.dot(p, q))
    assert abs(agree - exact) < 4 * np.sqrt(exact * (1 - exact) / 40000)


def test_identical_teachers_always_vote_unanimously():
    row = jax.random.normal(jax.random.key(4), (50,)) * 2
    logits = jnp.tile(row, (16, 1))
    hist = np.asarray(samplers.coordinated_histograms(jax.random.key(5), logits, 500))
    assert np.all(hist.max(axis=1) == 16)
    independent = np.asarray(samplers.independent_histograms(jax.random.key(5), logits, 500))
    assert np.mean(independent.max(axis=1) == 16) < 0.1


@pytest.mark.parametrize(
    "sampler", [samplers.coordinated_histograms, samplers.independent_histograms]
)
def test_zero_probability_tokens_never_get_votes(sampler):
    logits = jax.random.normal(jax.random.key(6), (8, 30))
    banned = np.zeros((8, 30), bool)
    banned[:, ::3] = True
    banned[:, -1] = True  # the last token too (inverse-CDF edge case)
    banned[0, :] = True
    banned[0, 4] = False  # teacher 0 has a single possible token
    logits = jnp.where(jnp.asarray(banned), NEG_INF, logits)
    hist = np.asarray(sampler(jax.random.key(7), logits, 3000))
    assert np.all(hist[:, banned.all(axis=0)] == 0)
    assert np.all(hist[:, 4] >= 1)
    assert np.all(hist.sum(axis=1) == 8)


def lm_like_logits(key, n, vocab, sharpness=3.0):
    """Zipf-like shared distribution with per-teacher perturbations."""
    base = -1.2 * jnp.log1p(jnp.arange(vocab, dtype=jnp.float32))
    base = base[jax.random.permutation(jax.random.key(11), vocab)]
    return sharpness * base + 0.7 * jax.random.normal(key, (n, vocab))


@pytest.mark.parametrize(
    "make_logits",
    [
        lambda k: lm_like_logits(k, 48, 3000),  # every teacher certified
        # per histogram: none, a few or most teachers fail the certificate (all three paths)
        lambda k: lm_like_logits(k, 48, 3000, sharpness=1.5),
        lambda k: 2.0 * jax.random.normal(k, (48, 3000)),  # diffuse: the certificate often fails
        lambda k: jnp.round(lm_like_logits(k, 48, 3000)),  # many tied logits
        lambda k: (
            jnp.where(
                jax.random.uniform(k, (48, 3000)) < 0.99, NEG_INF, jax.random.normal(k, (48, 3000))
            )
            .at[:, 0]
            .set(0.0)
        ),  # fewer finite tokens than K for most teachers
    ],
)
@pytest.mark.parametrize("top_k,fallback_rows", [(16, 1), (16, 8), (64, 48)])
def test_top_k_fast_path_is_identical_to_full_scan(make_logits, top_k, fallback_rows):
    logits = make_logits(jax.random.key(8))
    key = jax.random.key(9)
    full = samplers.coordinated_histograms(key, logits, 64, temperature=0.8)
    fast = samplers.coordinated_histograms(
        key, logits, 64, temperature=0.8, top_k=top_k, fallback_rows=fallback_rows
    )
    np.testing.assert_array_equal(np.asarray(full), np.asarray(fast))


def test_batch_size_does_not_change_histograms():
    logits = lm_like_logits(jax.random.key(10), 8, 200, sharpness=1.5)
    key = jax.random.key(12)
    coordinated_top_k = functools.partial(samplers.coordinated_histograms, top_k=8)
    for sampler in (
        samplers.coordinated_histograms,
        coordinated_top_k,
        samplers.independent_histograms,
    ):
        a = sampler(key, logits, 30, batch_size=1)
        b = sampler(key, logits, 30, batch_size=7)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fresh_noise_per_histogram():
    logits = jnp.zeros((4, 1000))
    hist = np.asarray(samplers.coordinated_histograms(jax.random.key(13), logits, 50))
    winners = hist.argmax(axis=1)
    assert len(set(winners.tolist())) > 40
    assert all(a != b for a, b in itertools.pairwise(winners.tolist()))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logits": jnp.zeros((3,)), "num_histograms": 2}, "shape"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 0}, "num_histograms"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 2, "temperature": 0.0}, "temperature"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 2, "top_k": 4}, "top_k"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 2, "batch_size": 0}, "batch_size"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        samplers.coordinated_histograms(jax.random.key(0), **kwargs)
