"""DP Frank-Wolfe with the exponential-mechanism oracle: its law against exact enumeration, the
sensitivity of its scores, its accounting, and what it does on a mixture problem."""

import functools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special, stats

from dpmix_jax.mixing import exponential_oracle, metrics, objectives, solvers
from dpmix_jax.mixing.exponential_oracle import (
    calibrate_step_epsilon,
    dp_exponential_frank_wolfe,
    exponential_frank_wolfe_event,
    run_exponential_frank_wolfe,
    score_range_bound,
    select_vertex,
    vertex_scores,
)
from dpmix_jax.mixing.synthetic import mixture_problem
from dpmix_jax.privacy import accounting, validation

PREDS = np.random.default_rng(5).uniform(0.05, 0.95, size=(300, 6))
DRAWS = 200_000
# A chi-square statistic above this has probability 1e-6 under the law (3 degrees of freedom).
CHI2_CRITICAL = float(stats.chi2.isf(1e-6, df=3))


def _exact_log_law(scores, step_epsilon, clip_norm):
    """log p_j for p_j ∝ exp(ε_0 u_j / (√2 C)), written out here rather than taken from the
    module."""
    logits = step_epsilon * np.asarray(scores, np.float64) / (math.sqrt(2.0) * clip_norm)
    return logits - special.logsumexp(logits)


def _exact_law(scores, step_epsilon, clip_norm):
    return np.exp(_exact_log_law(scores, step_epsilon, clip_norm))


def _chi2(counts, law):
    expected = counts.sum() * law
    return float(((counts - expected) ** 2 / expected).sum())


@functools.partial(jax.jit, static_argnames="draws")
def _draws(key, scores, step_epsilon, score_range, draws):
    keys = jax.random.split(key, draws)
    pick = functools.partial(select_vertex, step_epsilon=step_epsilon, score_range=score_range)
    return jax.vmap(pick, in_axes=(0, None))(keys, scores)


@pytest.mark.parametrize(
    ("scores", "step_epsilon", "clip_norm"),
    [([0.0, -1.5, 0.7, -0.3], 1.0, 1.0), ([12.0, 10.0, 11.0, 4.0], 0.8, 2.5)],
)
def test_the_selection_law_is_the_exponential_mechanisms(scores, step_epsilon, clip_norm):
    scores = jnp.asarray(scores, jnp.float32)
    picks = _draws(jax.random.key(0), scores, step_epsilon, score_range_bound(clip_norm), DRAWS)
    counts = np.bincount(np.asarray(picks), minlength=4)
    law = _exact_law(scores, step_epsilon, clip_norm)
    assert _chi2(counts, law) < CHI2_CRITICAL
    # The test has the power to see a scale off by 2x either way.
    for wrong in (2.0, 0.5):
        assert _chi2(counts, _exact_law(scores, wrong * step_epsilon, clip_norm)) > CHI2_CRITICAL


def test_the_first_step_draws_from_the_law_of_the_datas_clipped_sum():
    preds = np.array([[0.9, 0.2, 0.4], [0.1, 0.8, 0.5], [0.7, 0.6, 0.05], [0.3, 0.3, 0.9]])
    clip, step_epsilon = 0.6, 2.0
    # Scores at uniform λ, written out: mean-shifted nll gradients, clipped, summed, negated.
    grads = -preds / (preds @ np.full(3, 1 / 3))[:, None]
    grads -= grads.mean(axis=1, keepdims=True)
    grads *= np.minimum(1.0, clip / np.linalg.norm(grads, axis=1))[:, None]
    law = _exact_law(-grads.sum(axis=0), step_epsilon, clip)

    examples = objectives.prepare_examples(preds)
    run = functools.partial(
        run_exponential_frank_wolfe,
        examples,
        jnp.ones(4, bool),
        kind="nll",
        clip_norm=clip,
        step_epsilon=step_epsilon,
        steps=1,
        shift="mean",
    )
    keys = jax.random.split(jax.random.key(1), 50_000)
    first = jax.jit(jax.vmap(lambda key: run(key).weights))(keys)
    # λ_1 = λ_0/3 + (2/3) e_j: the picked vertex holds the largest weight.
    counts = np.bincount(np.asarray(jnp.argmax(first, axis=1)), minlength=3)
    critical = stats.chi2.isf(1e-6, df=2)
    assert _chi2(counts, law) < critical
    assert _chi2(counts, _exact_law(-grads.sum(axis=0), 2 * step_epsilon, clip)) > critical


def test_every_step_uses_its_own_key_and_the_frank_wolfe_step():
    examples = objectives.prepare_examples(PREDS)
    mask = jnp.asarray(np.arange(300) % 7 != 0)  # a data set of 257 of the 300 rows
    key, clip, step_epsilon, steps = jax.random.key(3), 4.0, 0.5, 4
    trace = run_exponential_frank_wolfe(
        examples,
        mask,
        key,
        kind="nll",
        clip_norm=clip,
        step_epsilon=step_epsilon,
        steps=steps,
        shift="none",
    )
    weights = np.full(6, 1 / 6)
    keys = jax.random.split(key, steps)
    for t in range(1, steps + 1):
        rows = PREDS[np.asarray(mask)]
        grads = -rows / (rows @ weights)[:, None]
        grads *= np.minimum(1.0, clip / np.linalg.norm(grads, axis=1))[:, None]
        gumbel = np.asarray(jax.random.gumbel(keys[t - 1], (6,), jnp.float32))
        vertex = np.argmax(-grads.sum(axis=0) + math.sqrt(2.0) * clip / step_epsilon * gumbel)
        gamma = 2 / (t + 2)
        weights = (1 - gamma) * weights + gamma * np.eye(6)[vertex]
        np.testing.assert_allclose(trace.history[t - 1], weights, rtol=1e-5)


def test_the_run_is_one_scan_whatever_the_number_of_steps():
    examples = objectives.prepare_examples(PREDS)
    jaxprs = [
        str(
            jax.make_jaxpr(
                functools.partial(
                    run_exponential_frank_wolfe,
                    kind="nll",
                    clip_norm=1.0,
                    step_epsilon=1.0,
                    steps=steps,
                )
            )(examples, jnp.ones(300, bool), jax.random.key(0))
        )
        for steps in (2, 50)
    ]
    assert all(j.count("scan[") == 1 for j in jaxprs) and "length=50" in jaxprs[1]
    assert jaxprs[0].count("\n") == jaxprs[1].count("\n")  # not unrolled


# --------------------------------------------------------------------------------------------
# Sensitivity of the scores under add/remove of one example.
# --------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("clip_norm", "shift"))
def _score_change(examples, mask, removed, weights, clip_norm, shift):
    """Scores of the data set `mask` minus those of the same set without row `removed`."""
    scores = functools.partial(vertex_scores, kind="nll", clip_norm=clip_norm, shift=shift)
    neighbour = mask.at[removed].set(False)
    return scores(weights, examples, mask) - scores(weights, examples, neighbour)


def _worst_case(preds, weights, clip_norm, shift):
    examples = objectives.prepare_examples(np.asarray(preds, np.float32))
    n = len(preds)
    change = _score_change(
        examples, jnp.ones(n, bool), n - 1, jnp.asarray(weights, jnp.float32), clip_norm, shift
    )
    return np.asarray(change, np.float64)


def test_one_example_can_move_a_score_by_the_clip_norm_and_no_more():
    # A certain proxy 0 for the added example: its gradient -e_0/λ_0 has norm 1/λ_0 = 5 > C, so
    # it is clipped to -C e_0 and score 0 moves by exactly C (the coordinate bound is reached).
    preds = np.vstack([PREDS[:20, :5], [[1.0, 0.0, 0.0, 0.0, 0.0]]])
    change = _worst_case(preds, np.full(5, 0.2), 1.5, "none")
    # (The clip norm is lowered by a relative ~1e-6 for the float32 rounding of the sum.)
    np.testing.assert_allclose(change, [1.5, 0, 0, 0, 0], rtol=1e-5, atol=1e-6)


def test_one_example_can_spread_the_scores_by_root_two_clip_norms_and_no_more():
    # Two sources, mean shift: the added example's gradient (-2, 0) becomes (-1, 1), of norm
    # √2 > C = 1, is clipped to (-1, 1)/√2, and the scores' range moves by √2·C =
    # score_range_bound(C), the 2Δ the mechanism is calibrated with (the range bound is reached;
    # each score moves by C/√2 < C).
    preds = np.vstack([PREDS[:20, :2], [[1.0, 0.0]]])
    change = _worst_case(preds, np.full(2, 0.5), 1.0, "mean")
    assert change.max() - change.min() == pytest.approx(score_range_bound(1.0), rel=1e-5)
    assert np.abs(change).max() == pytest.approx(1.0 / math.sqrt(2.0), rel=1e-5)


@pytest.mark.filterwarnings("ignore:proxy output column")  # all-zero sources are fair inputs
@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    k=st.integers(2, 5),
    shift=st.sampled_from(solvers.SHIFTS),
    clip_norm=st.sampled_from([0.3, 3.0]),
)
def test_no_example_moves_a_score_by_more_than_c_or_their_range_by_more_than_2_delta(
    data, k, shift, clip_norm
):
    probability = st.floats(0.0, 1.0, allow_nan=False, width=32)
    row = st.lists(probability, min_size=k, max_size=k)
    preds = np.array(data.draw(st.lists(row, min_size=6, max_size=6)))
    preds[:, 0] = np.maximum(preds[:, 0], 1e-3)  # every row mixes to a positive probability
    raw = np.array(data.draw(st.lists(st.floats(1e-3, 1.0), min_size=k, max_size=k)))
    removed = data.draw(st.integers(0, 5))
    examples = objectives.prepare_examples(preds.astype(np.float32))
    change = np.asarray(
        _score_change(
            examples,
            jnp.ones(6, bool),
            removed,
            jnp.asarray(raw / raw.sum(), jnp.float32),
            clip_norm,
            shift,
        ),
        np.float64,
    )
    assert np.abs(change).max() <= clip_norm * (1 + 1e-6)
    assert change.max() - change.min() <= score_range_bound(clip_norm) * (1 + 1e-6)


# --------------------------------------------------------------------------------------------
# The mechanism's privacy, by exact enumeration of its law on neighbouring scores.
# --------------------------------------------------------------------------------------------


def _privacy_losses(scores, change, step_epsilon, clip_norm):
    """log p(j) / p'(j) for every outcome j, scores u against u - d, and both log-laws."""
    log_p = _exact_log_law(scores, step_epsilon, clip_norm)
    log_q = _exact_log_law(np.asarray(scores) - change, step_epsilon, clip_norm)
    return log_p - log_q, log_p, log_q


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    k=st.integers(2, 5),
    step_epsilon=st.floats(0.01, 3.0),
    clip_norm=st.floats(0.1, 10.0),
)
def test_each_selection_is_epsilon_zero_dp_bounded_range_and_zcdp(data, k, step_epsilon, clip_norm):
    scores = np.array(data.draw(st.lists(st.floats(-20, 20), min_size=k, max_size=k)))
    direction = np.array(data.draw(st.lists(st.floats(-1, 1), min_size=k, max_size=k)))
    if np.linalg.norm(direction) < 1e-6:
        direction = np.eye(k)[0]
    radius = data.draw(st.floats(0.0, 1.0))
    change = clip_norm * radius * direction / np.linalg.norm(direction)  # ‖d‖ <= C
    losses, log_p, log_q = _privacy_losses(scores, change, step_epsilon, clip_norm)
    slack = 1e-9 + 1e-9 * step_epsilon
    assert np.abs(losses).max() <= step_epsilon + slack  # ε_0-DP
    assert losses.max() - losses.min() <= step_epsilon + slack  # ε_0-bounded-range
    for alpha in (1.5, 2.0, 4.0, 16.0, 64.0):  # ε_0²/8-zCDP: D_α <= α ε_0² / 8 both ways
        for a, b in ((log_p, log_q), (log_q, log_p)):
            renyi = special.logsumexp(alpha * a + (1 - alpha) * b) / (alpha - 1)
            assert renyi <= alpha * step_epsilon**2 / 8 + slack


def test_the_privacy_loss_reaches_epsilon_zero():
    # The range bound is tight: d = C(1, -1)/√2 against a score gap far larger than the noise.
    clip, step_epsilon = 2.0, 0.5
    change = clip * np.array([1.0, -1.0]) / math.sqrt(2.0)
    losses, _, _ = _privacy_losses([100.0, 0.0], change, step_epsilon, clip)
    assert np.abs(losses).max() == pytest.approx(step_epsilon, rel=1e-3)


# --------------------------------------------------------------------------------------------
# Accounting.
# --------------------------------------------------------------------------------------------


def _rdp_epsilon_by_hand(rho, delta):
    """ε of ρ-zCDP at δ: min over α of ρα + log(1 - 1/α) - log(δα)/(α - 1) (Canonne, Kamath
    and Steinke 2020, Prop. 12), on a fine grid of α, without dp_accounting."""
    alpha = np.geomspace(1.02, 5000.0, 400_000)
    return float(np.min(rho * alpha + np.log1p(-1 / alpha) - np.log(delta * alpha) / (alpha - 1)))


def test_the_event_is_t_selections_of_epsilon_zero_squared_over_eight_zcdp():
    event = exponential_frank_wolfe_event(0.2, 41)
    assert event == dp_accounting.SelfComposedDpEvent(dp_accounting.ZCDpEvent(0.2**2 / 8), 41)
    assert exponential_frank_wolfe_event(math.inf, 3) == dp_accounting.SelfComposedDpEvent(
        dp_accounting.NonPrivateDpEvent(), 3
    )


@pytest.mark.parametrize(("step_epsilon", "steps"), [(0.2, 41), (0.05, 1000), (1.0, 5)])
def test_the_composed_epsilon_equals_an_independent_computation(step_epsilon, steps):
    delta = 1e-5
    event = exponential_frank_wolfe_event(step_epsilon, steps)
    got = accounting.epsilon(event, delta=delta, accountant="rdp")
    by_hand = _rdp_epsilon_by_hand(steps * step_epsilon**2 / 8, delta)
    # dp_accounting minimises over its own orders, a subset of the grid: never below the grid.
    assert by_hand * (1 - 1e-6) <= got <= by_hand * 1.01
    # The exponential mechanism's own bound beats advanced composition of T ε_0-DP steps (at
    # the same δ) wherever composition matters.
    advanced = step_epsilon * math.sqrt(2 * steps * math.log(1 / delta)) + steps * (
        step_epsilon * math.expm1(step_epsilon)
    )
    if steps >= 40:
        assert got < 0.5 * advanced


@pytest.mark.parametrize("steps", [1, 41, 1000])
def test_calibration_meets_the_target_and_spends_it(steps):
    step_epsilon = calibrate_step_epsilon(target_epsilon=1.0, delta=1e-5, steps=steps)
    spent = accounting.epsilon(
        exponential_frank_wolfe_event(step_epsilon, steps), delta=1e-5, accountant="rdp"
    )
    assert 1.0 - 1e-3 <= spent <= 1.0
    # More selections, less each.
    assert calibrate_step_epsilon(target_epsilon=1.0, delta=1e-5, steps=2 * steps) < step_epsilon


def test_a_run_reports_the_accountants_epsilon_of_its_event():
    result = dp_exponential_frank_wolfe(
        PREDS, epsilon=2.0, delta=1e-4, steps=30, clip_norm=3.0, seed=0
    )
    assert result.event == exponential_frank_wolfe_event(result.step_epsilon, 30)
    assert result.epsilon == accounting.epsilon(result.event, delta=1e-4, accountant="rdp")
    assert 2.0 * (1 - 1e-3) <= result.epsilon <= 2.0 and result.is_private and result.seeded
    assert result.history.shape == (30, 6) and result.num_units == 300
    np.testing.assert_allclose(result.average_weights, result.history.mean(axis=0))


# --------------------------------------------------------------------------------------------
# The solver on a mixture problem, randomness, validation.
# --------------------------------------------------------------------------------------------


def test_it_lowers_the_loss_below_uniform_and_stays_on_the_simplex():
    preds, _ = mixture_problem(num_examples=5000, num_sources=8, seed=0)
    reference = np.asarray(solvers.mixmin(preds, steps=1000, learning_rate=2.0))
    result = dp_exponential_frank_wolfe(
        preds, epsilon=20.0, delta=1e-5, steps=100, clip_norm=10.0, seed=0
    )
    uniform = metrics.excess_loss(np.full(8, 1 / 8), reference, preds)
    assert metrics.excess_loss(result.weights, reference, preds) < 0.25 * uniform
    history = result.history
    assert history.min() >= 0 and np.abs(history.sum(axis=1) - 1).max() <= 1e-5


def test_without_noise_it_is_the_exact_frank_wolfe_of_the_clipped_sum():
    control = dp_exponential_frank_wolfe(
        PREDS, step_epsilon=math.inf, delta=1e-4, steps=5, clip_norm=3.0, seed=0
    )
    assert control.epsilon == math.inf and not control.is_private
    weights = np.full(6, 1 / 6)
    for t in range(1, 6):
        grads = -PREDS / (PREDS @ weights)[:, None]
        grads -= grads.mean(axis=1, keepdims=True)
        grads *= np.minimum(1.0, 3.0 / np.linalg.norm(grads, axis=1))[:, None]
        gamma = 2 / (t + 2)
        weights = (1 - gamma) * weights + gamma * np.eye(6)[np.argmin(grads.sum(axis=0))]
    np.testing.assert_allclose(control.weights, weights, rtol=1e-5)


def test_randomness_is_secret_unless_seeded():
    run = functools.partial(
        dp_exponential_frank_wolfe, PREDS, step_epsilon=0.01, delta=1e-4, steps=30, clip_norm=1.0
    )
    first, second = run(), run()
    assert not first.seeded and not second.seeded
    assert not np.array_equal(first.history, second.history)
    np.testing.assert_array_equal(run(seed=7).history, run(seed=7).history)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(epsilon=1.0, step_epsilon=0.1), "exactly one of epsilon"),
        (dict(epsilon=None), "exactly one of epsilon"),
        (dict(epsilon=None, step_epsilon=0.0), "step_epsilon must be a finite number > 0"),
        (dict(epsilon=None, step_epsilon=float("nan")), "step_epsilon must be"),
        (dict(epsilon=1000.0), "target_epsilon must be in"),
        (dict(delta=0.01), "delta = 0.01 >= 1/n"),
        (dict(steps=0), "steps must be an integer >= 1"),
        (dict(clip_norm=-1.0), "clip_norm must be a finite number > 0"),
        (dict(shift="median"), "shift must be one of"),
    ],
)
def test_bad_settings_are_refused_in_one_line_naming_them(overrides, message):
    settings_ = dict(epsilon=1.0, delta=1e-4, steps=10, clip_norm=1.0, seed=0) | overrides
    with pytest.raises(ValueError, match=message) as refused:
        dp_exponential_frank_wolfe(PREDS, **settings_)
    assert "\n" not in str(refused.value)


def test_a_large_delta_runs_when_allowed_and_is_recorded():
    result = dp_exponential_frank_wolfe(
        PREDS, epsilon=1.0, delta=0.01, steps=10, clip_norm=1.0, seed=0, allow_large_delta=True
    )
    assert result.allow_large_delta and result.delta == 0.01
    with pytest.raises(validation.LargeDeltaError):
        dp_exponential_frank_wolfe(PREDS, epsilon=1.0, delta=0.01, steps=10, clip_norm=1.0)


def test_the_module_is_exported():
    from dpmix_jax import mixing

    assert mixing.dp_exponential_frank_wolfe is dp_exponential_frank_wolfe
    assert mixing.exponential_oracle is exponential_oracle
