"""Diversity-transfer metrics against naive loops, and the summary the experiment reports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.pate import metrics, samplers


def random_histograms(seed, r=40, n=32, vocab=12):
    rng = np.random.default_rng(seed)
    alpha = rng.gamma(0.3, size=vocab)
    return np.stack(
        [
            np.bincount(rng.choice(vocab, n, p=alpha / alpha.sum()), minlength=vocab)
            for _ in range(r)
        ]
    ).astype(np.int32)


def test_metrics_match_naive_loops():
    hist = random_histograms(0)
    n = 32
    grid = metrics.threshold_grid(n, 7)
    cov = np.asarray(metrics.coverage(jnp.asarray(hist), grid))
    sup = np.asarray(metrics.transferred_support(jnp.asarray(hist), grid))
    yld = np.asarray(metrics.targmax_yield(jnp.asarray(hist), grid))
    tws = np.asarray(metrics.tws_yield(jnp.asarray(hist), grid, 2.0))
    for k, t in enumerate(grid):
        masses = [sum(c for c in row if c >= t) for row in hist]
        assert cov[k] == pytest.approx(np.mean(masses) / n, abs=1e-6)
        assert sup[k] == len({j for row in hist for j, c in enumerate(row) if c >= t})
        assert yld[k] == pytest.approx(np.mean([max(row) >= t for row in hist]), abs=1e-6)
        assert tws[k] == pytest.approx(np.mean([min(1, 2 * m / n) for m in masses]), abs=1e-6)
    margins = np.asarray(metrics.top_margin(jnp.asarray(hist)))
    assert margins.tolist() == [sorted(row)[-1] - sorted(row)[-2] for row in hist]


def test_threshold_grid_spans_n_over_16_to_n_over_2():
    grid = metrics.threshold_grid(512, 20)
    assert grid[0] == pytest.approx(32) and grid[-1] == pytest.approx(256)
    np.testing.assert_allclose(grid, 2 ** np.linspace(5, 8, 20))
    with pytest.raises(ValueError):
        metrics.threshold_grid(1)


def test_max_passing_threshold_over_groups_of_tries():
    hist = random_histograms(1, r=30)
    tops = hist.max(axis=1)
    for k in (1, 5, 10):
        mean, se = metrics.max_passing_threshold(jnp.asarray(hist), k)
        groups = tops[: (30 // k) * k].reshape(-1, k).max(axis=1)
        assert mean == pytest.approx(groups.mean())
        assert se == pytest.approx(groups.std(ddof=1) / np.sqrt(len(groups)))
    assert (
        metrics.max_passing_threshold(jnp.asarray(hist), 10)[0]
        >= metrics.max_passing_threshold(jnp.asarray(hist), 1)[0]
    )
    with pytest.raises(ValueError, match="tries"):
        metrics.max_passing_threshold(jnp.asarray(hist), 31)


def test_summary_reports_transferred_support_and_passing_thresholds():
    # Coordinated votes of 64 teachers over 8 equally plausible tokens (the claims module compares
    # them with independent votes).
    n, vocab = 64, 200
    key_private, key = jax.random.split(jax.random.key(0))
    logits = jnp.full((vocab,), -jnp.inf).at[:8].set(0.0)
    logits = logits + 0.3 * jax.random.normal(key_private, (n, vocab))
    hot = samplers.coordinated_histograms(key, logits, 300)
    summary = metrics.summarize(hot, np.array([n / 16, n / 2]))
    assert summary["support"][1] == int(metrics.transferred_support(hot, jnp.array([n / 2]))[0])
    assert set(summary["max_passing_threshold"]) == {"1", "5", "10"}
