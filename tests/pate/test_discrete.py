"""Hot PATE aggregators with exact discrete noise: output laws, DP by enumeration, accounting.

Method. For a tiny vocabulary the exact output law of an aggregator with discrete noise is
Σ_z Pr[z] · Pr[output | counts + z], enumerated over every noise vector z on [-B, B]^V (B such
that the mass left out is < 1e-9; the test margins include it), with the aggregator itself
(jitted, vmapped over the grid) deciding the output, or for DPWS's final weighted draw its exact
conditional probabilities. The enumerated law is checked (a) against draws through the decoding
path (host-side discrete noise, chi-square with a fixed seed, p > 1e-4) and (b) for DP over every
histogram and neighbour (one vote moved), and the same check with half the noise must fail.
"""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpmix_jax.pate import accounting, aggregators, generation
from dpmix_jax.pate.teachers import TableTeachers
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import discrete_noise as dn
from tests.pate.test_aggregators import all_histograms, neighbours


def noise_grid(pmf_1d, bound, vocab):
    """All noise vectors in [-bound, bound]^vocab and their probabilities."""
    support = np.arange(-bound, bound + 1)
    grid = np.array(list(itertools.product(support, repeat=vocab)), dtype=np.int32)
    weights = np.prod(pmf_1d(grid), axis=1)
    return grid, weights


def dpargmax_law(counts, threshold, epsilon, scale, bound):
    """Exact Pr[output] over (tokens..., FAIL) of DPARGMAX with discrete Laplace noise."""
    vocab = len(counts)
    grid, weights = noise_grid(lambda z: dn.discrete_laplace_pmf(z, scale), bound, vocab)
    run = jax.jit(
        jax.vmap(
            lambda z: aggregators.dpargmax_laplace(
                None, jnp.asarray(counts), threshold, epsilon, noise=z
            )
        )
    )
    outputs = np.asarray(run(jnp.asarray(grid)))
    return np.bincount(np.where(outputs == aggregators.FAIL, vocab, outputs), weights, vocab + 1)


def worst_over_neighbours(law_of, n, vocab, epsilon):
    """(max hockey-stick divergence at ε, max log-ratio on outputs of mass > 1e-6)."""
    table = {c: law_of(c) for c in all_histograms(n, vocab)}
    worst, ratio = 0.0, 0.0
    for c, p in table.items():
        for d in neighbours(c):
            q = table[d]
            worst = max(worst, float(np.maximum(p - math.exp(epsilon) * q, 0).sum()))
            big = (p > 1e-6) & (q > 0)
            ratio = max(ratio, float(np.max(np.log(p[big]) - np.log(q[big]))))
    return worst, ratio


def test_dpargmax_discrete_law_matches_decoding_path_draws():
    counts, threshold, epsilon = (3, 1, 0), 3.0, 1.0
    scale = float(accounting.discrete_laplace_scale(epsilon))
    law = dpargmax_law(counts, threshold, epsilon, scale, bound=44)
    assert abs(law.sum() - 1) < 1e-8
    config = generation.GenerationConfig(
        aggregator="dpargmax_laplace", epsilon=epsilon, threshold=threshold, noise="discrete"
    )
    step = generation.make_step(config)
    histogram = jnp.asarray(counts, jnp.int32)

    def draw(key, size):
        return jnp.broadcast_to(histogram, (size, 3))

    outputs = np.array([int(step(k, draw)[0]) for k in jax.random.split(jax.random.key(0), 4000)])
    observed = np.bincount(np.where(outputs == aggregators.FAIL, 3, outputs), minlength=4)
    assert stats.chisquare(observed, law * outputs.size).pvalue > 1e-4
    # Power: the law of twice the noise scale is rejected on the same draws.
    wrong = dpargmax_law(counts, threshold, epsilon, 2 * scale, bound=88)
    assert stats.chisquare(observed, wrong * outputs.size).pvalue < 1e-6


def test_dpargmax_discrete_is_epsilon_dp_by_enumeration():
    epsilon, n, vocab, threshold = 1.0, 3, 2, 2.0
    scale = float(accounting.discrete_laplace_scale(epsilon))

    def law(c, noise_scale=scale):
        return dpargmax_law(c, threshold, epsilon, noise_scale, bound=60)

    worst, ratio = worst_over_neighbours(law, n, vocab, epsilon)
    assert worst <= 1e-9 and ratio <= epsilon + 1e-6
    reported = accounting.epsilon_of_steps(
        accounting.dpargmax_discrete_laplace_event(epsilon), steps=1, delta=1e-9
    )
    assert ratio - 1e-6 <= reported <= epsilon + 1e-6
    # Power: with half the noise scale the same check fails.
    _, ratio_half = worst_over_neighbours(lambda c: law(c, scale / 2), n, vocab, epsilon)
    assert ratio_half > epsilon + 0.1


def dpws_law(counts, epsilon, delta, gamma, bound, keep_at=None):
    """Exact Pr[output] of DPWS with discrete Laplace noise (V = len(counts), last = FAIL);
    `keep_at` overrides the keep threshold."""
    counts = np.asarray(counts)
    scale = float(accounting.discrete_laplace_scale(epsilon))
    grid, weights = noise_grid(lambda z: dn.discrete_laplace_pmf(z, scale), bound, len(counts))
    if keep_at is None:
        keep_at = aggregators.dpws_threshold(epsilon, delta, discrete=True)
    noisy = counts + grid
    kept = np.where((counts > 0) & (noisy >= keep_at), noisy, 0).astype(float)
    probs = kept / np.maximum(kept.sum(axis=1, keepdims=True), counts.sum() / gamma)
    per_noise = np.concatenate([probs, 1 - probs.sum(axis=1, keepdims=True)], axis=1)
    return weights @ per_noise


def test_dpws_discrete_threshold_is_minimal_and_bounds_one_vote_passing():
    for epsilon, delta in [(1.0, 1e-6), (0.5, 1e-3), (4.0, 0.1)]:
        keep_at = aggregators.dpws_threshold(epsilon, delta, discrete=True)
        k = int(keep_at) - 1
        assert keep_at == int(keep_at) and k >= 1
        support = np.arange(k - 1, k + 4000)
        tail = dn.discrete_laplace_pmf(support, 2 / epsilon)
        assert tail[1:].sum() <= delta / 2  # Pr[1 + Z >= keep_at] = Pr[Z >= k]
        if k > 1:
            assert tail.sum() > delta / 2  # k - 1 would not do


def test_dpws_discrete_law_and_dp_by_enumeration():
    epsilon, delta, gamma, n, vocab = 2.0, 0.05, 1.0, 3, 2
    # The aggregator's own output frequencies agree with the enumerated law.
    counts = (3, 0)
    law = dpws_law(counts, epsilon, delta, gamma, bound=30)
    rng = np.random.default_rng(5)
    noise = dn.discrete_laplace((3000, 2), accounting.discrete_laplace_scale(epsilon), rng)
    keys = jax.random.split(jax.random.key(1), noise.shape[0])
    run = jax.jit(
        jax.vmap(
            lambda k, z: aggregators.dpws(k, jnp.asarray(counts), epsilon, delta, gamma, noise=z)
        )
    )
    outputs = np.asarray(run(keys, jnp.asarray(noise, jnp.int32)))
    observed = np.bincount(np.where(outputs == aggregators.FAIL, vocab, outputs), minlength=3)
    assert stats.chisquare(observed[law > 0], law[law > 0] * outputs.size).pvalue > 1e-4
    # (ε, δ)-DP over every histogram and neighbour, tokens entering the support included.
    worst, _ = worst_over_neighbours(
        lambda c: dpws_law(c, epsilon, delta, gamma, bound=30), n, vocab, epsilon
    )
    assert worst <= delta + 1e-9
    # Power: a keep threshold two lower lets a token entering the support through too often.
    keep_at = aggregators.dpws_threshold(epsilon, delta, discrete=True)
    worst_low, _ = worst_over_neighbours(
        lambda c: dpws_law(c, epsilon, delta, gamma, bound=30, keep_at=keep_at - 2),
        n,
        vocab,
        epsilon,
    )
    assert worst_low > delta


def test_confident_gnmax_discrete_noise_path_and_epsilon():
    # The noise argument replaces the float draws: a large check noise fails, none passes.
    counts = jnp.array([5, 2, 0])
    assert (
        int(
            aggregators.confident_gnmax(
                None, counts, 4.0, 1.0, 1.0, noise=(jnp.int32(-2), jnp.array([0, 4, 0]))
            )
        )
        == aggregators.FAIL
    )
    assert (
        int(
            aggregators.confident_gnmax(
                None, counts, 4.0, 1.0, 1.0, noise=(jnp.int32(0), jnp.array([0, 4, 0]))
            )
        )
        == 1
    )
    # ε: dp-accounting's discrete Gaussian PLDs against brute force (σ1 = σ2 = 2, one lattice).
    sigma, delta = 2.0, 1e-5
    bound = 200
    x = np.arange(-bound, bound + 1)
    p = dn.discrete_gaussian_pmf(x, sigma**2)
    numerators = (x - 1) ** 2 - x**2  # loss · 2σ², one coordinate moved by 1
    dense = np.bincount(numerators - numerators.min(), weights=p)
    law = np.convolve(np.convolve(dense, dense), dense)  # check + two argmax coordinates
    losses = (3 * numerators.min() + np.arange(law.size)) / (2 * sigma**2)

    def hockey(eps):
        return float(np.sum(law * np.maximum(0.0, -np.expm1(eps - losses))))

    reported = accounting.confident_gnmax_discrete_epsilon(sigma, sigma, steps=1, delta=delta)
    assert hockey(reported) <= delta * (1 + 1e-6)
    assert hockey(reported - 2e-3) > delta
    continuous = accounting.epsilon_of_steps(
        accounting.confident_gnmax_event(sigma, sigma), steps=1, delta=delta
    )
    # Close to the continuous Gaussian of the same σ (not below it in general: at σ = 1 the
    # discrete one's ε is larger; see docs/discrete-noise.md).
    assert reported == pytest.approx(continuous, rel=0.01)


def chain_teachers(n, vocab=12):
    table = np.full((n, vocab, vocab), -30.0, np.float32)
    for t in range(vocab):
        table[:, t, (t + 1) % vocab] = 0.0
    return TableTeachers(table, start_token=0)


@pytest.mark.parametrize(
    "privacy_settings",
    [
        dict(aggregator="dpws", epsilon=1.0, delta=1e-6),
        dict(aggregator="dpargmax_laplace", epsilon=1.0, threshold=40.0),
    ],
)
def test_generation_with_discrete_noise_follows_teachers_and_charges_discrete_events(
    privacy_settings,
):
    config = generation.GenerationConfig(max_new_tokens=5, noise="discrete", **privacy_settings)
    result = generation.generate(chain_teachers(64), [3], config, key=jax.random.key(0))
    again = generation.generate(chain_teachers(64), [3], config, key=jax.random.key(0))
    assert result.tokens == [4, 5, 6, 7, 8] == again.tokens
    event, call_delta = config.charge()
    assert isinstance(event, privacy.dp_events.SelfComposedDpEvent)
    assert event.event == privacy.dp_events.DiscreteLaplaceDpEvent(0.5, 1)
    expected = accounting.epsilon_of_steps(event, steps=result.num_queries, delta=1e-5)
    assert result.epsilon == pytest.approx(expected)
    assert result.delta == pytest.approx(1e-5 + result.num_queries * call_delta)


def test_generation_confident_gnmax_discrete_law_and_zcdp_charge():
    counts, threshold = (4, 2), 4.0
    config = generation.GenerationConfig(
        aggregator="confident_gnmax", threshold=threshold, sigma1=1.0, sigma2=1.0, noise="discrete"
    )
    # Exact law: FAIL iff 4 + z1 < T; else token 1 iff 2 + b > 4 + a (ties to token 0).
    z = np.arange(-14, 15)
    p = dn.discrete_gaussian_pmf(z, 1.0)
    fail = p[z < 0].sum()
    one = float(np.sum(np.outer(p, p)[(2 + z[None, :]) > (4 + z[:, None])]))
    law = np.array([(1 - fail) * (1 - one), (1 - fail) * one, fail])
    step = generation.make_step(config)
    histogram = jnp.asarray(counts, jnp.int32)
    keys = jax.random.split(jax.random.key(2), 3000)
    outputs = np.array([int(step(k, lambda key, size: histogram[None])[0]) for k in keys])
    observed = np.bincount(np.where(outputs == aggregators.FAIL, 2, outputs), minlength=3)
    assert stats.chisquare(observed, law * outputs.size).pvalue > 1e-4
    # The charge: the discrete Gaussians' zCDP, composed by RDP in the ledger.
    config = dataclasses.replace(config, threshold=40.0, sigma1=5.0, sigma2=3.0, max_new_tokens=4)
    result = generation.generate(chain_teachers(64), [3], config, key=jax.random.key(0))
    assert result.tokens == [4, 5, 6, 7] and result.gnmax is None
    rho = result.num_queries * (1 / (2 * 25) + 1 / 9)
    event, _ = config.charge()
    assert [e.rho for e in event.events] == [pytest.approx(1 / 50), pytest.approx(1 / 9)]
    expected = privacy.epsilon(
        privacy.dp_events.SelfComposedDpEvent(event, result.num_queries),
        delta=1e-5,
        accountant="rdp",
    )
    assert result.epsilon == pytest.approx(expected)
    assert result.epsilon <= rho + 2 * math.sqrt(rho * math.log(1e5))  # zCDP -> (ε, δ)
    pld = accounting.confident_gnmax_discrete_epsilon(5.0, 3.0, steps=4, delta=1e-5)
    assert pld <= result.epsilon  # RDP of the zCDP bound is the looser of the two


def test_generation_config_rejects_unsupported_discrete_settings():
    with pytest.raises(ValueError, match="noise must be"):
        generation.GenerationConfig(noise="exact")
    with pytest.raises(ValueError, match="release_order"):
        generation.GenerationConfig(
            aggregator="confident_gnmax", noise="discrete", release_order=8.0
        )
    with pytest.raises(ValueError, match=r"sigma1\*\*2"):
        generation.GenerationConfig(aggregator="confident_gnmax", noise="discrete", sigma1=0.1)
