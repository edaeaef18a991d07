"""Amin et al. 2024 peer: exact step distribution, privacy analysis, calibration, decoding."""

from __future__ import annotations

import dataclasses
import itertools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, optimize, special, stats

from dpmix_jax.pate.peers import amin
from dpmix_jax.pate.teachers import TableTeachers

ORDERS = np.array([1.001, 1.1, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0, 100.0, 1000.0])


def _config(**overrides) -> amin.AminConfig:
    settings_ = dict(
        num_teachers=3,
        max_new_tokens=8,
        max_private_tokens=8,
        clip_bound=1.5,
        temperature=1.2,
        public_temperature=0.8,
        threshold=0.6,
        svt_noise=0.3,
        delta=1e-3,
    )
    settings_.update(overrides)
    return amin.AminConfig(**settings_)


def _clip_naive(row: np.ndarray, c: float) -> np.ndarray:
    top = max(row)
    return np.array([max(-c, z - top + c) for z in row])


def _em_distribution(rows: np.ndarray, c: float, tau: float) -> np.ndarray:
    averaged = sum(_clip_naive(row, c) for row in rows) / len(rows)
    return special.softmax(averaged / tau)


def _renyi(p: np.ndarray, q: np.ndarray, alpha: float) -> float:
    return special.logsumexp(alpha * np.log(p) + (1 - alpha) * np.log(q)) / (alpha - 1)


# --------------------------------------------------------------------------------------------
# (a) The jitted step against the exact distribution.
# --------------------------------------------------------------------------------------------


def _probability_private(d: float, theta: float, sigma: float) -> float:
    """Pr[d + Laplace(2σ) >= θ + Laplace(σ)], integrating over the threshold noise."""

    def integrand(u):
        return stats.laplace.pdf(u, scale=sigma) * stats.laplace.sf(theta + u - d, scale=2 * sigma)

    edge = 60 * sigma  # Laplace(σ) mass beyond it: e^-60
    return integrate.quad(integrand, -edge, edge, points=[0.0, d - theta], limit=200)[0]


def test_step_matches_exact_distribution_with_both_branches():
    config = _config()
    rng = np.random.default_rng(3)
    teacher_logits = rng.normal(size=(3, 4)) * 2.0
    public_logits = np.array([2.0, -1.0, 0.5, 0.0])
    mean = np.mean([special.softmax(row) for row in teacher_logits], axis=0)
    d = float(np.sum(np.abs(mean - special.softmax(public_logits))))
    p_private = _probability_private(d, config.threshold, config.svt_noise)
    assert 0.1 < p_private < 0.9  # both branches matter
    exact = np.concatenate(
        [
            (1 - p_private) * special.softmax(public_logits / config.public_temperature),
            p_private * _em_distribution(teacher_logits, config.clip_bound, config.temperature),
        ]
    )

    def one(key):
        threshold_key, step_key = jax.random.split(key)
        noisy = amin.draw_threshold(threshold_key, config.threshold, config.svt_noise)
        token, private, _ = amin.step(
            step_key,
            jnp.asarray(teacher_logits, jnp.float32),
            jnp.asarray(public_logits, jnp.float32),
            noisy,
            clip_bound=config.clip_bound,
            temperature=config.temperature,
            public_temperature=config.public_temperature,
            threshold=config.threshold,
            svt_noise=config.svt_noise,
        )
        return token + 4 * private

    draws = 60_000
    outcomes = jax.vmap(one)(jax.random.split(jax.random.key(0), draws))
    empirical = np.bincount(np.asarray(outcomes), minlength=8) / draws
    assert 0.5 * np.abs(empirical - exact).sum() < 0.01
    chi2 = stats.chisquare(empirical * draws, exact * draws)
    assert chi2.pvalue > 1e-4


def test_step_redraws_threshold_only_after_a_private_token():
    config = _config()
    logits = jnp.zeros((3, 4))
    public = jnp.array([5.0, 0.0, 0.0, 0.0])
    keys = jax.random.split(jax.random.key(1), 4000)
    kwargs = dict(
        clip_bound=config.clip_bound,
        temperature=config.temperature,
        public_temperature=config.public_temperature,
        threshold=config.threshold,
        svt_noise=config.svt_noise,
    )
    _, private, kept = jax.vmap(lambda k: amin.step(k, logits, public, 10.0, **kwargs))(keys)
    assert not np.any(private) and np.all(np.asarray(kept) == 10.0)
    _, private, redrawn = jax.vmap(lambda k: amin.step(k, logits, public, -10.0, **kwargs))(keys)
    assert np.all(private)
    ks = stats.kstest(
        np.asarray(redrawn), stats.laplace(loc=config.threshold, scale=config.svt_noise).cdf
    )
    assert ks.pvalue > 1e-3


def test_clip_logits_matches_equation_one():
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(5, 6)) * 8
    clipped = np.asarray(amin.clip_logits(jnp.asarray(rows), 3.0))
    naive = np.stack([_clip_naive(row, 3.0) for row in rows])
    np.testing.assert_allclose(clipped, naive, atol=1e-5)
    assert np.allclose(clipped.max(axis=1), 3.0) and clipped.min() >= -3.0


# --------------------------------------------------------------------------------------------
# (b) The privacy analysis against independent computations.
# --------------------------------------------------------------------------------------------


def _assert_em_within_zcdp(rows, replacement, index, c, tau):
    config = _config(num_teachers=len(rows), clip_bound=c, temperature=tau)
    neighbour = np.array(rows, dtype=float)
    neighbour[index] = replacement
    p = _em_distribution(np.asarray(rows, float), c, tau)
    q = _em_distribution(neighbour, c, tau)
    rho = amin.em_rho(config)
    for alpha in ORDERS:
        assert _renyi(p, q, alpha) <= alpha * rho * (1 + 1e-9) + 1e-12
        assert _renyi(q, p, alpha) <= alpha * rho * (1 + 1e-9) + 1e-12
    return max(_renyi(p, q, alpha) / alpha for alpha in ORDERS)


@pytest.mark.parametrize(
    "c, tau, n, beats_add_remove", [(0.2, 1.0, 1, True), (1.0, 2.0, 2, True), (3.0, 0.7, 4, False)]
)
def test_em_renyi_divergence_on_worst_case_neighbours(c, tau, n, beats_add_remove):
    vocab = 5
    low_high = np.full(vocab, -100.0)
    low_high[0] = 0.0  # clips to (c, -c, ..., -c)
    high_low = np.full(vocab, -100.0)
    high_low[1] = 0.0  # clips to (-c, c, -c, ...)
    rows = np.tile(low_high, (n, 1))
    worst = _assert_em_within_zcdp(rows, high_low, 0, c, tau)
    config = _config(num_teachers=n, clip_bound=c, temperature=tau)
    # For small c/(nτ) the replace-one bound is needed: the add/remove value (a quarter) fails.
    assert (worst > amin.em_rho(config) / 4) == beats_add_remove


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.lists(st.floats(-30, 30), min_size=4, max_size=4),
        min_size=1,
        max_size=4,
    ),
    st.lists(st.floats(-30, 30), min_size=4, max_size=4),
    st.floats(0.05, 5.0),
    st.floats(0.3, 3.0),
)
def test_em_renyi_divergence_property(rows, replacement, c, tau):
    _assert_em_within_zcdp(np.array(rows), np.array(replacement), len(rows) - 1, c, tau)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.floats(-20, 20), min_size=4, max_size=4), min_size=1, max_size=4),
    st.lists(st.floats(-20, 20), min_size=4, max_size=4),
    st.lists(st.floats(-20, 20), min_size=4, max_size=4),
)
def test_distance_sensitivity_is_two_over_n(rows, replacement, public):
    rows = np.array(rows, np.float32)
    neighbour = rows.copy()
    neighbour[0] = replacement
    public = jnp.asarray(public, jnp.float32)
    change = abs(float(amin.distance(rows, public)) - float(amin.distance(neighbour, public)))
    assert change <= 2.0 / len(rows) + 1e-5


def _laplace_cdf(x: float, scale: float) -> float:
    return 0.5 * math.exp(x / scale) if x < 0 else 1 - 0.5 * math.exp(-x / scale)


def _svt_output_probabilities(queries, theta, sigma):
    """Pr[first query above the noisy threshold is k] for k = 1..m, then Pr[none]."""

    def density_of(k):
        def integrand(u):
            t = theta + u
            below = math.prod(_laplace_cdf(t - q, 2 * sigma) for q in queries[:k])
            above = 1.0 if k == len(queries) else 1 - _laplace_cdf(t - queries[k], 2 * sigma)
            return math.exp(-abs(u) / sigma) / (2 * sigma) * below * above

        return integrand

    edge = 60 * sigma
    bounds = [0.0] + [q - theta for q in queries]
    return np.array(
        [
            integrate.quad(density_of(k), -edge, edge, points=bounds, limit=400)[0]
            for k in range(len(queries) + 1)
        ]
    )


def test_svt_epsilon_against_numerical_integration():
    config = _config(num_teachers=4, svt_noise=0.4, threshold=0.5)
    sensitivity = 2.0 / config.num_teachers
    eps = amin.svt_epsilon(config)
    assert eps == pytest.approx(2 * sensitivity / config.svt_noise)
    worst = 0.0
    for base in ([0.5, 0.5, 0.5], [0.0, 0.2, 0.9], [0.9, 0.1, 0.5]):
        for signs in itertools.product((-1, 0, 1), repeat=3):
            q = np.array(base)
            q_neighbour = q + sensitivity * np.array(signs)
            p = _svt_output_probabilities(q, config.threshold, config.svt_noise)
            p_neighbour = _svt_output_probabilities(q_neighbour, config.threshold, config.svt_noise)
            assert p.sum() == pytest.approx(1.0, abs=1e-6)
            ratios = np.maximum(p / p_neighbour, p_neighbour / p)
            assert np.all(ratios <= math.exp(eps) * (1 + 1e-6))
            worst = max(worst, float(np.log(ratios.max())))
    assert worst > eps / 2  # the bound is not vacuous on these inputs


def _paper_delta(rho: float, eps: float) -> float:
    """Theorem 1 of the paper: δ = inf_α e^{(α-1)(αρ-ε)}/(α-1) · (1-1/α)^α."""

    def log_delta(alpha):
        return (
            (alpha - 1) * (alpha * rho - eps) - math.log(alpha - 1) + alpha * math.log1p(-1 / alpha)
        )

    result = optimize.minimize_scalar(log_delta, bounds=(1.0001, 1e5), method="bounded")
    return math.exp(result.fun)


@pytest.mark.parametrize("private_tokens, svt_runs", [(5, 5), (20, 21), (0, 3), (7, 0)])
def test_epsilon_against_dp_accounting_and_theorem_one(private_tokens, svt_runs):
    config = _config(num_teachers=50, clip_bound=2.0, svt_noise=0.5, delta=1e-5)
    rho_em = 2 * (2.0 / (50 * config.temperature)) ** 2
    rho_svt = (4 / (50 * 0.5)) ** 2 / 2
    assert amin.em_rho(config) == pytest.approx(rho_em)
    rho = private_tokens * rho_em + svt_runs * rho_svt
    eps = amin.epsilon(config, private_tokens=private_tokens, svt_runs=svt_runs, delta=1e-5)
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.ZCDpEvent(rho))
    assert eps == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
    assert eps <= rho + math.sqrt(4 * rho * math.log(1e5))
    assert _paper_delta(rho, eps) <= 1e-5 * (1 + 1e-6)
    assert _paper_delta(rho, eps * 0.98) > 1e-5  # within 2% of the exact conversion


def test_epsilon_golden_values():
    config = _config(num_teachers=100, clip_bound=3.0, temperature=1.0, svt_noise=0.5, delta=1e-6)
    # ρ = 10 · 2(3/100)² + 10 · (4/(100 · 0.5))²/2 = 0.018 + 0.032 = 0.05; Theorem 1's exact
    # conversion gives ε = 1.47159 at δ = 1e-6, dp-accounting's order grid a hair more.
    eps = amin.epsilon(config, private_tokens=10, svt_runs=10, delta=1e-6)
    assert 1.47159 <= eps <= 1.4718
    em, svt = amin.dp_event(config, private_tokens=10, svt_runs=10).events
    assert (em.count, svt.count) == (10, 10)
    assert em.event.rho == pytest.approx(0.0018) and svt.event.rho == pytest.approx(0.0032)
    assert amin.dp_event(config, private_tokens=0, svt_runs=0) == dp_accounting.NoOpDpEvent()


# --------------------------------------------------------------------------------------------
# (c) Calibration.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, settings_",
    [
        (1.0, dict(num_teachers=100, max_new_tokens=30, svt_noise=2.0)),
        (8.0, dict(num_teachers=16, max_new_tokens=64, max_private_tokens=10, svt_noise=1.0)),
        (3.0, dict(num_teachers=8, max_new_tokens=20, threshold=None, svt_noise=None)),
    ],
)
def test_calibrate_meets_target_tightly(target, settings_):
    config = amin.calibrate(epsilon=target, delta=1e-6, **settings_)
    achieved = amin.worst_case_epsilon(config)
    assert achieved <= target
    assert achieved >= 0.95 * target
    looser = dataclasses.replace(config, clip_bound=config.clip_bound * 1.01)
    assert amin.worst_case_epsilon(looser) > target


def test_calibrate_rejects_a_test_that_alone_exceeds_the_target():
    with pytest.raises(ValueError, match="sparse-vector test alone"):
        amin.calibrate(epsilon=1.0, delta=1e-6, max_new_tokens=50, num_teachers=4, svt_noise=0.2)


# --------------------------------------------------------------------------------------------
# (d) Bad input.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_teachers=0), "num_teachers"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_private_tokens=-1), "max_private_tokens"),
        (dict(clip_bound=0.0), "clip_bound"),
        (dict(temperature=-1.0), "temperature"),
        (dict(public_temperature=math.inf), "public_temperature"),
        (dict(threshold=None), "threshold and svt_noise"),
        (dict(threshold=math.nan), "threshold"),
        (dict(svt_noise=0.0), "svt_noise"),
        (dict(delta=0.5), "delta"),
    ],
)
def test_bad_config_raises_one_clear_error(overrides, field):
    with pytest.raises(ValueError, match=field):
        _config(**overrides)


def test_bad_generate_input_raises():
    teachers = TableTeachers(np.zeros((3, 4, 4)))
    public = lambda prefix: jnp.zeros(4)  # noqa: E731
    with pytest.raises(ValueError, match="num_teachers"):
        amin.generate(teachers, public, prompt=[], config=_config(num_teachers=5))
    with pytest.raises(ValueError, match="public_model"):
        amin.generate(teachers, None, prompt=[], config=_config())
    with pytest.raises(ValueError, match="stop_sequences"):
        amin.generate(teachers, public, prompt=[], config=_config(), stop_sequences=[()])
    with pytest.raises(ValueError, match="svt_runs"):
        amin.dp_event(_config(threshold=None, svt_noise=None), private_tokens=1, svt_runs=1)


# --------------------------------------------------------------------------------------------
# (e) Decoding.
# --------------------------------------------------------------------------------------------


def _peaked(n: int, vocab: int, next_token: dict[int, int], height: float = 30.0):
    table = np.zeros((n, vocab, vocab), np.float32)
    for last, nxt in next_token.items():
        table[:, last, nxt] = height
    return table


def test_agreeing_public_model_gives_public_tokens_and_charges_one_run():
    table = np.random.default_rng(0).normal(size=(3, 5, 5)).astype(np.float32)
    table[:] = table[0]  # every teacher equals the public model
    teachers = TableTeachers(table)
    public = lambda prefix: jnp.asarray(table[0, prefix[-1] if prefix else 0])  # noqa: E731
    config = _config(max_new_tokens=10, max_private_tokens=2, threshold=1.0, svt_noise=0.05)
    result = amin.generate(teachers, public, prompt=[1], config=config, key=jax.random.key(4))
    assert result.sources == ["public"] * 10 and result.private_steps == 0
    assert result.stop_reason == "max_new_tokens"
    assert result.event == amin.dp_event(config, private_tokens=0, svt_runs=1)
    assert result.epsilon == pytest.approx(
        amin.epsilon(config, private_tokens=0, svt_runs=1, delta=config.delta)
    )
    assert result.teacher_forward_passes == 30 and result.public_forward_passes == 10


def test_disagreeing_public_model_gives_private_tokens_until_the_budget():
    teachers = TableTeachers(_peaked(3, 5, {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}))
    public = lambda prefix: jnp.array([0.0, 0.0, 30.0, 0.0, 0.0])  # noqa: E731
    config = _config(
        max_new_tokens=10, max_private_tokens=3, clip_bound=10.0, threshold=0.5, svt_noise=0.05
    )
    result = amin.generate(teachers, public, prompt=[], config=config, key=jax.random.key(5))
    assert result.tokens == [1, 1, 1] and result.sources == ["private"] * 3
    assert result.stop_reason == "private_token_budget"
    assert result.event == amin.dp_event(config, private_tokens=3, svt_runs=3)
    assert result.epsilon == pytest.approx(amin.worst_case_epsilon(config))
    assert result.teacher_forward_passes == 9 and result.seeded


def test_generate_stops_on_eos_stop_sequence_and_length_and_is_reproducible():
    teachers = TableTeachers(_peaked(2, 6, {0: 1, 1: 2, 2: 3, 3: 5, 5: 4}))
    config = _config(
        num_teachers=2,
        max_new_tokens=4,
        max_private_tokens=5,
        clip_bound=10.0,
        threshold=None,
        svt_noise=None,
    )
    run = dict(prompt=[0], config=config, key=jax.random.key(7))
    eos = amin.generate(teachers, None, eos_id=3, **run)
    assert eos.tokens == [1, 2, 3] and eos.stop_reason == "eos"
    assert eos.teacher_forward_passes == 6 and eos.public_forward_passes == 0
    assert eos.event == amin.dp_event(config, private_tokens=3, svt_runs=0)
    stop = amin.generate(teachers, None, stop_sequences=[(2, 3)], **run)
    assert stop.tokens == [1, 2, 3] and stop.stop_reason == "stop_sequence"
    full = amin.generate(teachers, None, **run)
    assert full.tokens == [1, 2, 3, 5] and full.stop_reason == "max_new_tokens"

    noisy = TableTeachers(np.random.default_rng(1).normal(size=(2, 6, 6)))
    noisy_config = dataclasses.replace(config, max_new_tokens=12, max_private_tokens=12)
    first = amin.generate(noisy, None, prompt=[0], config=noisy_config, key=jax.random.key(9))
    again = amin.generate(noisy, None, prompt=[0], config=noisy_config, key=jax.random.key(9))
    assert first.tokens == again.tokens and len(first.tokens) == 12
    secret = amin.generate(noisy, None, prompt=[0], config=noisy_config)
    assert not secret.seeded


def test_trailing_public_run_is_charged():
    # Token 1 is private (teachers and public disagree after 0), then public tokens (agreement).
    table = _peaked(3, 4, {0: 1, 1: 2, 2: 2})
    teachers = TableTeachers(table)
    public_table = _peaked(1, 4, {0: 3, 1: 2, 2: 2})[0]
    public = lambda prefix: jnp.asarray(public_table[prefix[-1]])  # noqa: E731
    config = _config(max_new_tokens=4, max_private_tokens=4, clip_bound=10.0, svt_noise=0.05)
    result = amin.generate(teachers, public, prompt=[0], config=config, key=jax.random.key(2))
    assert result.sources == ["private", "public", "public", "public"]
    assert result.event == amin.dp_event(config, private_tokens=1, svt_runs=2)


def test_svt_noise_for_gives_the_test_exactly_its_share():
    sigma = amin.svt_noise_for(epsilon=0.5, delta=1e-5, runs=40, num_teachers=64)
    config = amin.AminConfig(
        num_teachers=64,
        max_new_tokens=40,
        max_private_tokens=40,
        svt_noise=sigma,
        threshold=0.5,
        delta=1e-5,
    )
    alone = amin.epsilon(config, private_tokens=0, svt_runs=40, delta=1e-5)
    assert 0.499 <= alone <= 0.5
    less_noise = dataclasses.replace(config, svt_noise=0.99 * sigma)
    assert amin.epsilon(less_noise, private_tokens=0, svt_runs=40, delta=1e-5) > 0.5
    calibrated = amin.calibrate(
        epsilon=1.0, delta=1e-5, max_new_tokens=40, num_teachers=64, svt_noise=sigma
    )
    assert 0.99 <= amin.worst_case_epsilon(calibrated) <= 1.0
    with pytest.raises(ValueError, match="num_teachers"):
        amin.svt_noise_for(epsilon=0.5, delta=1e-5, runs=40, num_teachers=1)
