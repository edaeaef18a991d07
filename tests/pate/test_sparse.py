"""Sparse-vector aggregation (`pate.sparse`): the gate's law against its formula, its ε-DP by
exact integration over every output pattern of neighbouring runs, the cap, and the accounting."""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import integrate

from dpmix_jax.pate import accounting, sparse
from dpmix_jax.pate.aggregators import FAIL


def _config(**overrides):
    settings = dict(threshold=10.0, max_answers=2, gate_epsilon=1.0, select_epsilon=1.0)
    return sparse.SparseConfig(**{**settings, **overrides})


def _laplace_cdf(x, scale):
    return 0.5 * math.exp(x / scale) if x < 0 else 1 - 0.5 * math.exp(-x / scale)


def pattern_probability(config, tops, pattern, shrink: float = 1.0) -> float:
    """Pr[the gate answers `pattern` (True = pass) on top counts `tops`], by integrating over
    the noisy threshold; steps after the c-th pass fail with certainty. `shrink` divides both
    noise scales (a gate with too little noise, to show the check can fail)."""
    b1, b2 = config.threshold_scale / shrink, config.query_scale / shrink

    def given_threshold(noise):
        probability, passes = math.exp(-abs(noise) / b1) / (2 * b1), 0
        for top, passed in zip(tops, pattern, strict=True):
            if passes >= config.max_answers:
                if passed:
                    return 0.0
                continue
            below = _laplace_cdf(config.threshold + noise - top, b2)
            probability *= (1 - below) if passed else below
            passes += passed
        return probability

    scale = 40 * max(b1, b2)
    value, _ = integrate.quad(given_threshold, -scale, scale, limit=400, epsabs=1e-13)
    return value


@pytest.mark.parametrize("share", [0.5, 0.2])
def test_the_gate_is_its_stated_epsilon_on_every_output_pattern(share):
    """c = 2 answers over 3 steps, searched exhaustively: top counts below, at and above the
    threshold in every combination, each moved by at most 1 in every direction (neighbouring
    runs), every output pattern. The worst probability ratio stays within e^(ε1 + ε2), and a
    gate with a quarter of the noise breaks it on the same grid."""
    config = _config(threshold=5.0, gate_epsilon=0.8, threshold_share=share)
    bound = math.exp(config.gate_epsilon) * (1 + 1e-6)
    levels = (3.0, 5.0, 7.0)
    patterns = list(itertools.product((False, True), repeat=3))

    @functools.cache
    def probability(tops, pattern, shrink):
        return pattern_probability(config, tops, pattern, shrink)

    def worst(shrink=1.0):
        ratio = 0.0
        for tops in itertools.product(levels, repeat=3):
            for moves in itertools.product((-1, 0, 1), repeat=3):
                neighbour = tuple(t + m for t, m in zip(tops, moves, strict=True))
                for pattern in patterns:
                    p = probability(tops, pattern, shrink)
                    q = probability(neighbour, pattern, shrink)
                    if p or q:
                        ratio = max(ratio, p / q, q / p)
        return ratio

    assert worst() <= bound
    assert worst(shrink=4.0) > bound  # with a quarter of the noise the check fails


def test_the_gate_follows_its_formula():
    """The first step's pass rate, simulated, against the integral (both noise scales)."""
    for config in (_config(), _config(threshold_share=0.2, max_answers=3, gate_epsilon=2.0)):
        counts = jnp.array([4, 8, 0])
        keys = jax.random.split(jax.random.key(0), 40_000)

        def once(key, config=config, counts=counts):
            key_start, key_step = jax.random.split(key)
            token, _ = sparse.step(key_step, sparse.start(key_start, config), counts, config)
            return token >= 0

        rate = float(jnp.mean(jax.vmap(once)(keys)))
        exact = pattern_probability(config, (8.0,), (True,))
        assert abs(rate - exact) < 4 * math.sqrt(exact * (1 - exact) / len(keys)) + 1e-3


def test_the_gate_closes_after_its_answers():
    config = _config(threshold=0.0, max_answers=3, gate_epsilon=5.0)
    state = sparse.start(jax.random.key(0), config)
    counts = jnp.array([0, 1000, 0])
    step = jax.jit(sparse.step, static_argnums=3)
    tokens = []
    for i in range(8):
        token, state = step(jax.random.key(i + 1), state, counts, config)
        tokens.append(int(token))
    assert tokens == [1, 1, 1] + [FAIL] * 5
    assert int(state.answered) == 3


def test_weighted_selection_uses_dpws():
    config = _config(threshold=0.0, selection="weighted", select_delta=1e-6, gate_epsilon=5.0)
    counts = jnp.array([0, 500, 0, 500])
    state = sparse.start(jax.random.key(0), config)
    seen = set()
    for i in range(30):
        token, _ = sparse.step(jax.random.key(i), state, counts, config)
        seen.add(int(token))
    assert seen == {1, 3}


def test_a_run_costs_the_gate_plus_its_answers():
    config = _config(max_answers=20, gate_epsilon=0.5, select_epsilon=0.1)
    spent = sparse.epsilon(config, 1e-6)
    selections = accounting.epsilon_of_steps(
        accounting.dpargmax_laplace_event(0.1), steps=20, delta=1e-6
    )
    assert selections < spent <= selections + 0.5 + 1e-3
    assert spent < 0.5 + 20 * 0.1  # tighter than basic composition
    more = sparse.epsilon(_config(max_answers=40, gate_epsilon=0.5, select_epsilon=0.1), 1e-6)
    assert more > spent
    weighted = _config(
        max_answers=20, gate_epsilon=0.5, select_epsilon=0.1, selection="weighted",
        select_delta=1e-8,
    )  # fmt: skip
    assert sparse.epsilon(weighted, 1e-6) > spent  # the same ε at a smaller remaining δ
    with pytest.raises(ValueError, match="must exceed"):
        sparse.epsilon(weighted, 1e-7)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"max_answers": 0}, "max_answers"),
        ({"gate_epsilon": 0.0}, "gate_epsilon"),
        ({"threshold_share": 1.0}, "threshold_share"),
        ({"selection": "top"}, "selection"),
        ({"selection": "weighted"}, "select_delta"),
        ({"select_delta": 1e-6}, "select_delta"),
    ],
)
def test_bad_settings_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(**overrides)


def test_noise_scales():
    config = _config(max_answers=4, gate_epsilon=2.0, threshold_share=0.25)
    assert config.threshold_scale == pytest.approx(1 / 0.5)
    assert config.query_scale == pytest.approx(2 * 4 / 1.5)
    draws = np.asarray(
        jax.vmap(lambda k: sparse.start(k, config).noisy_threshold)(
            jax.random.split(jax.random.key(3), 50_000)
        )
    )
    assert np.std(draws) == pytest.approx(math.sqrt(2) * config.threshold_scale, rel=0.03)
