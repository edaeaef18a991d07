"""Tests of the audit statistics (against exact binomial and Gaussian computations) and of the
DP-SGD canary audit (no violation with noise, clear leakage without)."""

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import optimize, stats

from dpmix_jax.privacy import audit, audit_runs, clipping
from dpmix_jax.privacy.ghost import ghost_clipped_grad_sum
from experiments import audit as runner
from experiments.configs.audit import get_config

ALPHA = 0.05


def exact_lower(k, n, alpha):
    """p with P[Binomial(n, p) >= k] = alpha, by root finding on the binomial tail."""
    return 0.0 if k == 0 else optimize.brentq(lambda p: stats.binom.sf(k - 1, n, p) - alpha, 0, 1)


def exact_upper(k, n, alpha):
    """p with P[Binomial(n, p) <= k] = alpha."""
    return 1.0 if k == n else optimize.brentq(lambda p: stats.binom.cdf(k, n, p) - alpha, 0, 1)


def naive_bonferroni(with_, without, delta, confidence):
    """Loop over every threshold and both directions, with binomial roots for the bounds."""
    alpha = 1 - confidence
    a_w, a_o = alpha / (4 * len(with_)), alpha / (4 * len(without))
    best = 0.0
    for tau in set(with_) | set(without):
        for sign in (1, -1):
            member_w = [(s >= tau) if sign == 1 else (s < tau) for s in with_]
            member_o = [(s >= tau) if sign == 1 else (s < tau) for s in without]
            tpr = exact_lower(sum(member_w), len(with_), a_w)
            fpr = exact_upper(sum(member_o), len(without), a_o)
            if tpr - delta > 0:
                best = max(best, math.log((tpr - delta) / fpr))
            if 1 - fpr - delta > 0:
                best = max(best, math.log((1 - fpr - delta) / (1 - tpr)))
    return best


def gaussian_epsilon(mu, delta):
    """Exact ε(δ) of N(μ, 1) vs N(0, 1) (the μ-GDP privacy profile), by root finding."""

    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2
        )

    return optimize.brentq(lambda e: excess(e) - delta, 0, 60)


@pytest.mark.parametrize("n", [1, 5, 12])
def test_clopper_pearson_matches_binomial_tails(n):
    k = np.arange(n + 1)
    lower, upper = audit.clopper_pearson(k, n, alpha=ALPHA)
    for ki in range(n + 1):
        assert lower[ki] == pytest.approx(exact_lower(ki, n, ALPHA), abs=1e-9)
        assert upper[ki] == pytest.approx(exact_upper(ki, n, ALPHA), abs=1e-9)
    assert np.all(np.diff(lower) > 0) and np.all(np.diff(upper) > 0)


def test_bonferroni_bound_matches_naive_enumeration():
    rng = np.random.default_rng(0)
    for mu, n_w, n_o in [(3.0, 15, 15), (1.0, 12, 9), (-2.0, 10, 14)]:
        with_ = np.round(rng.normal(mu, 1, n_w), 1)  # rounding creates ties
        without = np.round(rng.normal(0, 1, n_o), 1)
        got = audit.epsilon_lower_bound(with_, without, delta=1e-3, method="bonferroni")
        assert got.epsilon == pytest.approx(naive_bonferroni(with_, without, 1e-3, 0.95), abs=1e-9)


def test_perfect_separation_by_hand():
    n = 10
    level = ALPHA / (4 * n)
    tpr_low = level ** (1 / n)  # Clopper-Pearson lower bound for 10 successes out of 10
    expected = math.log((tpr_low - 1e-5) / (1 - tpr_low))
    got = audit.epsilon_lower_bound(
        np.arange(n) + 100.0, np.arange(n, dtype=float), delta=1e-5, method="bonferroni"
    )
    assert got.epsilon == pytest.approx(expected, rel=1e-9)
    assert got.direction == "greater" and 9 < got.threshold <= 100
    # The split method evaluates the one chosen test on 20 + 20 held-out scores at α/2 per bound.
    split = audit.epsilon_lower_bound(np.arange(40) + 100.0, np.arange(40.0), delta=1e-5)
    tpr_half = (ALPHA / 2) ** (1 / 20)
    assert split.epsilon == pytest.approx(math.log((tpr_half - 1e-5) / (1 - tpr_half)), rel=1e-9)


@pytest.mark.parametrize("method", ["split", "bonferroni"])
def test_null_scores_give_positive_bound_at_most_alpha_often(method):
    rng = np.random.default_rng(1)
    repeats = 300
    positive = sum(
        audit.epsilon_lower_bound(
            rng.normal(size=100), rng.normal(size=100), delta=1e-5, method=method, seed=r
        ).epsilon
        > 0
        for r in range(repeats)
    )
    # Valid at 95% means P[ε_LB > 0 = true ε] <= 0.05; allow a 1e-4 binomial tail.
    assert positive <= stats.binom.ppf(1 - 1e-4, repeats, ALPHA)


def test_gaussian_scores_stay_below_true_epsilon_and_approach_it():
    mu, delta = 2.0, 0.01
    true_eps = gaussian_epsilon(mu, delta)
    assert true_eps == pytest.approx(6.0, abs=0.01)  # sanity check of the closed form
    rng = np.random.default_rng(2)
    above = 0
    for r in range(40):
        bound = audit.epsilon_lower_bound(
            rng.normal(mu, 1, 1000), rng.normal(0, 1, 1000), delta=delta, seed=r
        )
        above += bound.epsilon > true_eps
    assert above <= 2  # 95% bounds: expect about 0 of 40 above
    bounds = [
        audit.epsilon_lower_bound(
            rng.normal(mu, 1, n), rng.normal(0, 1, n), delta=delta, seed=0
        ).epsilon
        for n in (300, 3000, 100_000)
    ]
    assert bounds[0] < bounds[1] < bounds[2] < true_eps
    assert bounds[2] > 0.8 * true_eps
    # At δ = 1e-5 the same pair has ε ≈ 10: the bound must still be below it.
    small = audit.epsilon_lower_bound(rng.normal(mu, 1, 5000), rng.normal(0, 1, 5000), delta=1e-5)
    assert 0 < small.epsilon < gaussian_epsilon(mu, 1e-5)


def test_bound_monotone_invariant_and_symmetric():
    rng = np.random.default_rng(3)
    base_w, base_o = rng.normal(size=200), rng.normal(size=200)

    def bound(with_, without, **kw):
        kw = {"delta": 1e-5, "method": "bonferroni", **kw}
        return audit.epsilon_lower_bound(with_, without, **kw).epsilon

    by_shift = [bound(base_w + mu, base_o) for mu in (0.5, 1.0, 2.0, 3.0, 5.0)]
    assert all(a <= b for a, b in itertools.pairwise(by_shift)) and by_shift[-1] > by_shift[0]
    by_conf = [bound(base_w + 2, base_o, confidence=c) for c in (0.5, 0.9, 0.99, 0.999)]
    assert all(a >= b for a, b in itertools.pairwise(by_conf)) and by_conf[0] > by_conf[-1]
    by_delta = [bound(base_w + 2, base_o, delta=d) for d in (1e-6, 1e-3, 0.05, 0.2)]
    assert all(a >= b for a, b in itertools.pairwise(by_delta)) and by_delta[0] > by_delta[-1]
    # Only the order of the scores matters, and the two worlds play symmetric roles.
    assert bound(np.exp(base_w + 2), np.exp(base_o)) == pytest.approx(bound(base_w + 2, base_o))
    assert bound(base_o, base_w + 2) == pytest.approx(bound(base_w + 2, base_o))
    assert bound(-(base_w + 2), -base_o) == pytest.approx(bound(base_w + 2, base_o))


def test_bound_rejects_bad_input():
    good = np.arange(10.0)
    with pytest.raises(ValueError, match="non-finite"):
        audit.epsilon_lower_bound(np.append(good, np.nan), good, delta=1e-5)
    with pytest.raises(ValueError, match="1-D"):
        audit.epsilon_lower_bound(good.reshape(2, 5), good, delta=1e-5)
    with pytest.raises(ValueError, match="delta"):
        audit.epsilon_lower_bound(good, good, delta=0.0)
    with pytest.raises(ValueError, match="confidence"):
        audit.epsilon_lower_bound(good, good, delta=1e-5, confidence=1.0)
    with pytest.raises(ValueError, match="method"):
        audit.epsilon_lower_bound(good, good, delta=1e-5, method="max")
    with pytest.raises(ValueError, match="at least 4"):
        audit.epsilon_lower_bound(good[:3], good, delta=1e-5)
    with pytest.raises(ValueError, match="successes"):
        audit.clopper_pearson(np.array([3]), 2, alpha=0.05)


def test_dirac_canary_gradient_survives_clipping():
    params = {"b": jnp.zeros(()), "w": jnp.full(5, 0.1)}
    canary = audit.dirac_canary_gradient(params, index=3, clip_norm=2.5)
    assert float(canary["w"][2]) == -2.5 and float(jnp.sum(jnp.abs(canary["w"]))) == 2.5
    assert float(canary["b"]) == 0.0
    loss = audit.with_gradient_canary(audit_runs.logistic_loss, canary)
    batch = {
        "x": jnp.array([[1.0, 2, 3, 4, 5], [0, 0, 0, 0, 0]]),
        "y": jnp.array([0.0, 0.0]),
        "is_canary": jnp.array([False, True]),
    }
    total, stats_ = clipping.clipped_grad_sum(loss, clip_norm=2.5)(params, batch, jnp.ones(2, bool))
    normal = jax.grad(audit_runs.logistic_loss)(params, jax.tree.map(lambda x: x[0], batch))
    scale = 2.5 / float(jnp.linalg.norm(jnp.append(normal["w"], normal["b"])))
    assert scale < 1  # the ordinary example is clipped, the canary is not
    assert float(stats_["grad_norm"][1]) == pytest.approx(2.5)
    for leaf in ("b", "w"):
        # rtol covers the clipping slack C·(1 - 2⁻²⁰) that keeps float32 rounding within C.
        np.testing.assert_allclose(total[leaf], scale * normal[leaf] + canary[leaf], rtol=1e-5)
    with pytest.raises(ValueError, match="index"):
        audit.dirac_canary_gradient(params, index=6, clip_norm=1.0)


def test_outlier_input_lies_along_least_variance():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(500, 4)) * np.array([3.0, 2.0, 0.1, 1.0])
    outlier = audit.outlier_input(x, scale=7.0)
    assert np.linalg.norm(outlier) == pytest.approx(7.0)
    eigvals, eigvecs = np.linalg.eigh(np.cov(x.T))
    assert abs(outlier @ eigvecs[:, 0]) == pytest.approx(7.0, rel=1e-6)
    assert eigvals[0] < 0.02


def test_dpsgd_audit_no_violation_with_noise_and_leakage_without():
    config = get_config("cpu")
    config = dataclasses.replace(
        config, trials=300, chunk=300, dpsgd=dataclasses.replace(config.dpsgd, steps=60)
    )
    (row,) = runner.audit_dpsgd(config)
    assert row["accounted_epsilon"] <= 1.0
    for canary in ("gradient", "input"):
        assert 0.0 <= row[canary] <= row["accounted_epsilon"]
        # 150 held-out trials per world certify at most ln(1 / (1 - 0.025^(1/150))) ≈ 3.7.
        assert row[f"no_noise_{canary}"] > 3.0


def test_presets_validate_and_bad_settings_raise():
    cpu, paper = get_config("cpu"), get_config("paper")
    assert paper.trials * 2 == 2000 and paper.mixmin.num_sources == 14
    assert paper.mixmin.mixture_fraction == 0.1 and paper.mixmin.epsilons == (1.0,)
    assert cpu.trials < paper.trials
    with pytest.raises(ValueError, match="preset"):
        get_config("tpu")
    with pytest.raises(ValueError, match="method"):
        dataclasses.replace(cpu, method="best")
    with pytest.raises(ValueError, match="epsilon"):
        dataclasses.replace(cpu.dpsgd, epsilons=(0.0,))
    with pytest.raises(ValueError, match="mixture split"):
        dataclasses.replace(cpu.mixmin, sensitive_size=50)


def test_cancelling_canary_is_clipped_to_c_by_the_ghost_path():
    # Float32 Gram norms once let many of these canaries add their whole 3·C.
    def taped(params, batch, tape):
        y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
        return jnp.sum(y * batch["v"], axis=(1, 2))

    grad_sum = jax.jit(ghost_clipped_grad_sum(taped, clip_norm=1.0).function)
    worst = 0.0
    for seed in range(32):
        x, v = audit.cancelling_canary(8, 8, clip_norm=1.0, seed=seed)
        assert np.linalg.norm(np.outer(x[0], v[0])) == pytest.approx(1e4, rel=1e-5)
        gradient = np.einsum("ti,tj->ij", x.astype(np.float64), v.astype(np.float64))
        assert np.linalg.norm(gradient) == pytest.approx(3.0, rel=1e-2)
        total, _ = grad_sum(
            {"w": jnp.zeros((8, 8))}, {"x": x[None], "v": v[None]}, np.ones(1, bool)
        )
        worst = max(worst, float(np.linalg.norm(np.asarray(total["w"], np.float64))))
    assert worst <= 1.0
