"""Aggregators: exact output distributions, and DP checked by exact enumeration of neighbours.

Method of the privacy checks. For tiny (n, V) every histogram (Σc = n) and every neighbour (one
vote moved from one token to another) is enumerated. Each mechanism's output distribution over
V ∪ {FAIL} is computed exactly:
* Laplace DPARGMAX: Pr[j] = ∫_T^∞ f(x - c_j) Π_{l≠j} F(x - c_l) dx by adaptive quadrature (scipy
  quad, relative tolerance 1e-11, split at the density kinks) and Pr[FAIL] = Π_l F(T - c_l);
* confident-GNMax: Pr[FAIL] = Φ((T - max c)/σ1) in closed form, and the noisy-argmax part
  ∫ φ(z) Π_{l≠j} Φ((c_j - c_l)/σ2 + z) dz by quadrature;
* DPWS (V = 2): the joint law of the two noisy counts by composite Gauss-Legendre quadrature
  (48 nodes per piece, pieces split at every kink of the integrand, tails cut at 80 noise scales,
  mass < e^-80), checked against a quadrature of twice the order.
Since the output space is finite, the hockey-stick divergence Σ_o max(0, P(o) - e^ε Q(o)) is then
exact up to the quadrature error (< 1e-9, the margin allowed). The same check on the mechanism with
half the noise scale must fail (power).
"""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate, stats

from dpmix_jax.pate import accounting, aggregators

QUAD = {"epsabs": 0.0, "epsrel": 1e-11, "limit": 200}
MARGIN = 1e-9


def all_histograms(n, vocab):
    for cut in itertools.combinations(range(n + vocab - 1), vocab - 1):
        bounds = (-1, *cut, n + vocab - 1)
        yield tuple(bounds[i + 1] - bounds[i] - 1 for i in range(vocab))


def neighbours(counts):
    for a, b in itertools.permutations(range(len(counts)), 2):
        if counts[a] > 0:
            moved = list(counts)
            moved[a] -= 1
            moved[b] += 1
            yield tuple(moved)


def worst_hockey_stick(output_probs, n, vocab, epsilon):
    """max over ordered neighbour pairs of Σ_o max(0, P(o) - e^ε Q(o)), and the max log-ratio."""
    table = {c: output_probs(c) for c in all_histograms(n, vocab)}
    for p in table.values():
        assert np.all(p >= -1e-12) and abs(p.sum() - 1) < 1e-9
    worst, ratio = 0.0, -math.inf
    for c, p in table.items():
        for d in neighbours(c):
            q = table[d]
            worst = max(worst, float(np.maximum(p - math.exp(epsilon) * q, 0).sum()))
            with np.errstate(divide="ignore"):
                ratio = max(ratio, float(np.max(np.log(p[p > 0]) - np.log(q[p > 0]))))
    return worst, ratio


def laplace_argmax_probs(counts, threshold, scale):
    lap = stats.laplace(scale=scale)
    probs = []
    for j, cj in enumerate(counts):
        others = [cl for i, cl in enumerate(counts) if i != j]

        def density(x, cj=cj, others=others):
            return lap.pdf(x - cj) * np.prod([lap.cdf(x - cl) for cl in others])

        edges = [threshold, *sorted({float(c) for c in counts if c > threshold})]
        edges.append(max(counts) + 80 * scale)
        probs.append(
            sum(integrate.quad(density, a, b, **QUAD)[0] for a, b in itertools.pairwise(edges))
        )
    probs.append(float(np.prod([lap.cdf(threshold - c) for c in counts])))
    return np.array(probs)


def gnmax_probs(counts, threshold, sigma1, sigma2):
    fail = stats.norm.cdf((threshold - max(counts)) / sigma1)
    probs = []
    for j, cj in enumerate(counts):
        gaps = [(cj - cl) / sigma2 for i, cl in enumerate(counts) if i != j]
        density = lambda z, gaps=gaps: stats.norm.pdf(z) * np.prod(stats.norm.cdf(np.add(gaps, z)))
        probs.append((1 - fail) * integrate.quad(density, -40, 40, points=[0.0], **QUAD)[0])
    return np.array([*probs, fail])


def _gauss_legendre(edges, order):
    """Composite Gauss-Legendre nodes and weights; `edges` (rows, E) sorted, one rule per row."""
    nodes, weights = np.polynomial.legendre.leggauss(order)
    edges = np.atleast_2d(edges)
    lo, hi = edges[:, :-1, None], edges[:, 1:, None]
    x = (lo + hi) / 2 + (hi - lo) / 2 * nodes
    w = (hi - lo) / 2 * weights
    return x.reshape(len(edges), -1), w.reshape(len(edges), -1)


def _edges(lo, top, kinks, scale):
    """Rows of sorted piece edges on [lo, top]: each kink, and noise-scale steps after it."""
    kinks = np.atleast_2d(np.asarray(kinks, float))  # (rows, k)
    steps = np.array([0.0, 1.0, 3.0, 8.0, 20.0, 40.0, 60.0]) * scale
    starts = np.concatenate([np.full((len(kinks), 1), lo), kinks], axis=1)
    edges = (starts[:, :, None] + steps).reshape(len(kinks), -1)
    return np.sort(np.clip(np.concatenate([edges, np.full((len(kinks), 1), top)], 1), lo, top), 1)


def dpws_probs_two_tokens(counts, keep_at, scale, gamma, order=48):
    """Exact output distribution of DPWS on V = 2 (see the module docstring)."""
    m = sum(counts) / gamma
    laplace_pdf = lambda x: np.exp(-np.abs(x) / scale) / (2 * scale)
    top = max(counts) + m + 80 * scale
    xs, wx = _gauss_legendre(
        _edges(keep_at, top, [*map(float, counts), m, m - keep_at], scale), order
    )
    xs, wx = xs[0], wx[0]
    probs = []
    for j in (0, 1):
        k = 1 - j
        if counts[j] == 0:
            probs.append(0.0)
            continue
        k_pass = 0.0 if counts[k] == 0 else stats.laplace.sf(keep_at - counts[k], scale=scale)
        value = (1 - k_pass) * xs / np.maximum(xs, m)
        if counts[k] > 0:
            kinks = np.stack([np.full_like(xs, counts[k]), m - xs], axis=1)
            ys, wy = _gauss_legendre(_edges(keep_at, top, kinks, scale), order)
            inner = wy * laplace_pdf(ys - counts[k]) * xs[:, None] / np.maximum(xs[:, None] + ys, m)
            value = value + inner.sum(axis=1)
        probs.append(float(np.sum(wx * laplace_pdf(xs - counts[j]) * value)))
    return np.array([*probs, 1 - sum(probs)])


def empirical(samples, vocab):
    samples = np.asarray(samples)
    freq = np.bincount(np.where(samples < 0, vocab, samples), minlength=vocab + 1)
    return freq / len(samples)


def assert_distribution(samples, probs, alpha=1e-3):
    """Chi-square goodness of fit of FAIL-coded samples to `probs` (last entry = FAIL)."""
    vocab = len(probs) - 1
    observed = np.bincount(np.where(np.asarray(samples) < 0, vocab, samples), minlength=vocab + 1)
    assert np.all(observed[np.asarray(probs) == 0] == 0)
    keep = np.asarray(probs) > 0
    expected = np.asarray(probs)[keep] * len(samples)
    assert stats.chisquare(observed[keep], expected).pvalue > alpha


# ------------------------------------------------------------------------------------------
# Thresholded aggregators.
# ------------------------------------------------------------------------------------------


def test_targmax_matches_definition_on_all_small_histograms():
    for counts in all_histograms(6, 3):
        for threshold in range(0, 8):
            best = max(range(3), key=lambda j: (counts[j], -j))
            expected = best if counts[best] >= threshold else -1
            assert int(aggregators.targmax(jnp.array(counts), threshold)) == expected


def test_tws_probabilities_match_formula_on_all_small_histograms():
    for counts in all_histograms(7, 3):
        for threshold, gamma in [(1, 1.0), (2, 1.0), (3, 2.0), (4, 0.5), (8, 3.0)]:
            mass = sum(c for c in counts if c >= threshold)
            denom = max(mass, 7 / gamma)
            expected = [c / denom if c >= threshold else 0.0 for c in counts]
            expected.append(1 - sum(expected))
            got = np.asarray(aggregators.tws_probabilities(jnp.array(counts), threshold, gamma))
            np.testing.assert_allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("counts,threshold,gamma", [((5, 3, 2, 0), 2, 1.0), ((5, 3, 2, 0), 3, 4.0)])
def test_tws_samples_follow_formula(counts, threshold, gamma):
    keys = jax.random.split(jax.random.key(0), 20000)
    sample = jax.vmap(lambda k: aggregators.tws(k, jnp.array(counts), threshold, gamma))(keys)
    probs = np.asarray(aggregators.tws_probabilities(jnp.array(counts), threshold, gamma))
    assert_distribution(sample, probs)


def test_aggregators_reject_bad_shapes():
    with pytest.raises(ValueError, match="histogram"):
        aggregators.targmax(jnp.ones((2, 3)), 1)
    with pytest.raises(ValueError, match="delta"):
        aggregators.dpws(jax.random.key(0), jnp.ones(3), 1.0, 0.0, 1.0)


# ------------------------------------------------------------------------------------------
# DP aggregators: the sampling code follows the exact distribution used in the privacy checks.
# ------------------------------------------------------------------------------------------


def test_dpargmax_laplace_samples_follow_exact_distribution():
    counts, threshold, epsilon = (3, 1, 0), 2.0, 1.0
    keys = jax.random.split(jax.random.key(1), 20000)
    sample = jax.vmap(
        lambda k: aggregators.dpargmax_laplace(k, jnp.array(counts), threshold, epsilon)
    )(keys)
    assert_distribution(sample, laplace_argmax_probs(counts, threshold, 2 / epsilon))


def test_confident_gnmax_samples_follow_exact_distribution():
    counts, threshold, s1, s2 = (3, 2, 0), 3.0, 1.5, 1.5
    keys = jax.random.split(jax.random.key(2), 20000)
    sample = jax.vmap(
        lambda k: aggregators.confident_gnmax(k, jnp.array(counts), threshold, s1, s2)
    )(keys)
    assert_distribution(sample, gnmax_probs(counts, threshold, s1, s2))


def test_dpws_samples_follow_exact_distribution():
    counts, epsilon, delta, gamma = (7, 3), 2.0, 1e-2, 0.7
    keys = jax.random.split(jax.random.key(3), 20000)
    sample = jax.vmap(lambda k: aggregators.dpws(k, jnp.array(counts), epsilon, delta, gamma))(keys)
    keep_at = aggregators.dpws_threshold(epsilon, delta)
    assert_distribution(sample, dpws_probs_two_tokens(counts, keep_at, 2 / epsilon, gamma))


def test_dpws_quadrature_is_converged():
    for counts, gamma in [((10, 0), 1.0), ((6, 4), 1.0), ((9, 1), 0.6)]:
        coarse = dpws_probs_two_tokens(counts, 4.45, 1.0, gamma)
        fine = dpws_probs_two_tokens(counts, 4.45, 1.0, gamma, order=96)
        np.testing.assert_allclose(coarse, fine, atol=1e-12)


def test_dpws_zero_vote_tokens_never_output():
    counts = jnp.array([0, 40, 0, 0])
    keys = jax.random.split(jax.random.key(4), 2000)
    out = jax.vmap(lambda k: aggregators.dpws(k, counts, 1.0, 1e-3, 1.0))(keys)
    assert set(np.unique(np.asarray(out)).tolist()) <= {-1, 1}


# ------------------------------------------------------------------------------------------
# Exact-enumeration privacy checks and their power.
# ------------------------------------------------------------------------------------------


def test_dpargmax_laplace_is_pure_epsilon_dp_and_halved_noise_is_not():
    epsilon, threshold = 1.0, 3.0
    delta, ratio = worst_hockey_stick(
        lambda c: laplace_argmax_probs(c, threshold, 2 / epsilon), 5, 3, epsilon
    )
    assert delta <= MARGIN and ratio <= epsilon + MARGIN
    delta, ratio = worst_hockey_stick(
        lambda c: laplace_argmax_probs(c, threshold, 1 / epsilon), 5, 3, epsilon
    )
    assert delta > 0.01 and ratio > epsilon + 0.3


def test_confident_gnmax_meets_accountant_guarantee_and_halved_noise_does_not():
    s1 = s2 = 2.0
    threshold, delta = 4.0, 1e-3
    eps = accounting.epsilon_of_steps(
        accounting.confident_gnmax_event(s1, s2), steps=1, delta=delta
    )
    worst, _ = worst_hockey_stick(lambda c: gnmax_probs(c, threshold, s1, s2), 6, 3, eps)
    assert worst <= delta + MARGIN
    worst, _ = worst_hockey_stick(lambda c: gnmax_probs(c, threshold, s1 / 2, s2 / 2), 6, 3, eps)
    assert worst > 5 * delta


@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_dpws_is_epsilon_delta_dp_and_halved_noise_is_not(gamma):
    epsilon, delta, n = 2.0, 1e-3, 10
    keep_at = aggregators.dpws_threshold(epsilon, delta)
    worst, _ = worst_hockey_stick(
        lambda c: dpws_probs_two_tokens(c, keep_at, 2 / epsilon, gamma), n, 2, epsilon
    )
    assert worst <= delta + MARGIN
    # Broken: noise scale halved, and with it the threshold's margin (2/ε)·ln(1/δ).
    broken_keep_at = 1 + (1 / epsilon) * math.log(1 / delta)
    worst, _ = worst_hockey_stick(
        lambda c: dpws_probs_two_tokens(c, broken_keep_at, 1 / epsilon, gamma), n, 2, epsilon
    )
    assert worst > 3 * delta
