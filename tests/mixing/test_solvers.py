"""MixMin solvers: recovery of a known mixture, naive one-step comparisons, accounting, tracing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.mixing import metrics, objectives, solvers
from dpmix_jax.mixing.synthetic import mixture_problem
from dpmix_jax.privacy import accounting, gaussian_noise

PREDS = np.random.default_rng(3).uniform(0.05, 0.95, size=(400, 5))


def test_mixmin_and_dp_mixmin_recover_a_known_mixture():
    preds, true_weights = mixture_problem(num_examples=20_000, num_sources=8, seed=0)
    exact = np.asarray(solvers.mixmin(preds))
    assert metrics.cosine_similarity(exact, true_weights) >= 0.98  # measured 0.9998
    reference = np.asarray(solvers.mixmin(preds, steps=1000, learning_rate=2.0))
    result = solvers.dp_mixmin(
        preds,
        epsilon=1.0,
        delta=1e-5,
        steps=200,
        batch_size=1000,
        clip_norm=10.0,
        learning_rate=0.3,
        seed=0,
    )
    assert result.epsilon <= 1.0
    # Measured: cosine 0.9998, excess 3.5e-4 (uniform weights: 0.18).
    assert metrics.cosine_similarity(result.weights, reference) >= 0.97
    assert metrics.excess_loss(result.weights, reference, preds) <= 5e-3
    uniform = np.full(8, 1 / 8)
    assert metrics.excess_loss(uniform, reference, preds) >= 0.05


def test_mixmin_matches_naive_exponentiated_gradient():
    weights = np.full(5, 0.2)
    for _ in range(7):
        grad = np.mean(-PREDS / (PREDS @ weights)[:, None], axis=0)
        weights = weights * np.exp(-0.5 * grad)
        weights /= weights.sum()
    got = solvers.mixmin(PREDS, steps=7, learning_rate=0.5)
    np.testing.assert_allclose(got, weights, rtol=1e-4)


@pytest.mark.parametrize("shift", solvers.SHIFTS)
def test_shifted_loss_has_the_shifted_gradient(shift):
    weights = jnp.array([0.1, 0.2, 0.3, 0.15, 0.25])
    example = jax.tree.map(lambda x: x[0], objectives.prepare_examples(PREDS))
    loss = solvers.shifted_example_loss("nll", shift)
    g = -PREDS[0] / (PREDS[0] @ np.asarray(weights))
    c = {"none": 0.0, "mean": g.mean(), "weighted": np.asarray(weights) @ g}[shift]
    np.testing.assert_allclose(jax.grad(loss)(weights, example), g - c, rtol=1e-5, atol=1e-6)
    assert float(loss(weights, example)) == pytest.approx(-np.log(PREDS[0] @ np.asarray(weights)))


def _clip(v, c):
    return v * min(1.0, c / np.linalg.norm(v))


def test_example_level_step_matches_per_example_loop():
    """One step of the core equals a hand-written loop that clips single examples."""
    indices = np.array([[3, 17, 5, 250, -1, -1, -1, -1]])
    mask = indices >= 0
    key, sigma, clip, b, lr = jax.random.key(7), 0.8, 1.5, 6.0, 2.0
    trace = solvers.run_mirror_descent(
        objectives.prepare_examples(PREDS),
        jnp.asarray(indices),
        jnp.asarray(mask),
        key,
        kind="nll",
        clip_norm=clip,
        noise_multiplier=sigma,
        expected_batch_size=b,
        learning_rate=lr,
        shift="mean",
    )
    weights = np.full(5, 0.2)
    total = np.zeros(5)
    for j in indices[0][mask[0]]:
        g = -PREDS[j] / (PREDS[j] @ weights)
        total += _clip(g - g.mean(), clip)
    step_key = jax.random.split(key, 1)[0]
    total += np.asarray(gaussian_noise.gaussian_noise_tree(step_key, jnp.zeros(5), sigma * clip))
    logits = -lr * total / b
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(trace.weights, expected, rtol=1e-5)
    np.testing.assert_allclose(trace.history[0], expected, rtol=1e-5)


def test_user_level_step_averages_within_users_before_clipping():
    indices = np.array([[[0, 1, 2], [10, -1, -1], [-1, -1, -1]]])
    mask = indices >= 0
    key, sigma, clip, b, lr = jax.random.key(1), 0.5, 0.3, 2.0, 1.0
    trace = solvers.run_mirror_descent(
        objectives.prepare_examples(PREDS),
        jnp.asarray(indices),
        jnp.asarray(mask),
        key,
        kind="nll",
        clip_norm=clip,
        noise_multiplier=sigma,
        expected_batch_size=b,
        learning_rate=lr,
        shift="none",
    )
    weights = np.full(5, 0.2)
    total = np.zeros(5)
    for user in indices[0]:
        rows = user[user >= 0]
        if len(rows):
            total += _clip(np.mean(-PREDS[rows] / (PREDS[rows] @ weights)[:, None], axis=0), clip)
    total += np.asarray(
        gaussian_noise.gaussian_noise_tree(jax.random.split(key, 1)[0], jnp.zeros(5), sigma * clip)
    )
    logits = -lr * total / b
    np.testing.assert_allclose(trace.weights, np.exp(logits) / np.exp(logits).sum(), rtol=1e-5)


def test_frank_wolfe_step_moves_towards_the_noisy_argmin_vertex():
    indices = np.array([[4, 8, 15, 16, 23, 42, -1, -1], [1, 2, -1, -1, -1, -1, -1, -1]])
    key, sigma, clip = jax.random.key(3), 0.7, 2.0
    trace = solvers.run_frank_wolfe(
        objectives.prepare_examples(PREDS),
        jnp.asarray(indices),
        jnp.asarray(indices >= 0),
        key,
        kind="nll",
        clip_norm=clip,
        noise_multiplier=sigma,
        shift="none",
    )
    weights = np.full(5, 0.2)
    keys = jax.random.split(key, 2)
    for t in (1, 2):
        rows = indices[t - 1][indices[t - 1] >= 0]
        total = sum(_clip(-PREDS[j] / (PREDS[j] @ weights), clip) for j in rows)
        total = total + np.asarray(
            gaussian_noise.gaussian_noise_tree(keys[t - 1], jnp.zeros(5), sigma * clip)
        )
        gamma = 2 / (t + 2)
        weights = (1 - gamma) * weights + gamma * np.eye(5)[np.argmin(total)]
        np.testing.assert_allclose(trace.history[t - 1], weights, rtol=1e-5)


def test_reported_epsilon_is_the_accountants_for_the_run():
    result = solvers.dp_mixmin(
        PREDS,
        noise_multiplier=1.1,
        delta=1e-5,
        steps=30,
        batch_size=40,
        clip_norm=1.0,
        learning_rate=1.0,
        seed=0,
    )
    assert result.sampling_rate == pytest.approx(40 / 400)
    assert result.expected_batch_size == pytest.approx(40)
    event = accounting.dpsgd_event(noise_multiplier=1.1, sampling_rate=0.1, steps=30)
    assert result.epsilon == accounting.epsilon(event, delta=1e-5)
    assert result.ledger.count == 30
    assert result.history.shape == (30, 5)
    np.testing.assert_allclose(result.average_weights, result.history.mean(axis=0))


@pytest.mark.slow
def test_calibrated_epsilon_meets_the_target():
    calibrated = solvers.dp_mixmin(
        PREDS,
        epsilon=2.0,
        delta=1e-5,
        steps=30,
        batch_size=40,
        clip_norm=1.0,
        solver="frank_wolfe",
        seed=0,
    )
    event = accounting.dpsgd_event(
        noise_multiplier=calibrated.noise_multiplier, sampling_rate=0.1, steps=30
    )
    assert calibrated.epsilon == accounting.epsilon(event, delta=1e-5) <= 2.0
    assert calibrated.epsilon > 1.9


def test_user_level_accounting_uses_the_user_sampling_rate():
    user_ids = np.arange(400) % 50
    result = solvers.dp_mixmin(
        PREDS,
        user_ids=user_ids,
        max_examples_per_user=4,
        noise_multiplier=1.3,
        delta=1e-5,
        steps=20,
        batch_size=10,
        clip_norm=0.5,
        learning_rate=1.0,
        seed=0,
    )
    assert result.user_level and result.num_units == 50
    assert result.sampling_rate == pytest.approx(10 / 50)
    event = accounting.dpsgd_event(noise_multiplier=1.3, sampling_rate=0.2, steps=20)
    assert result.epsilon == accounting.epsilon(event, delta=1e-5)


def test_delta_of_one_over_n_or_more_is_refused_unless_explicitly_allowed():
    settings = dict(noise_multiplier=1.0, steps=3, batch_size=40, clip_norm=1.0, learning_rate=0.1)
    with pytest.raises(ValueError, match=r"delta = 0.0025 >= 1/n = 0.0025 for n = 400 examples"):
        solvers.dp_mixmin(PREDS, delta=1 / 400, **settings)
    user_ids = np.arange(400) // 4  # 100 users
    with pytest.raises(ValueError, match=r"delta = 0.01 >= 1/n = 0.01 for n = 100 users"):
        solvers.dp_mixmin(PREDS, user_ids=user_ids, max_examples_per_user=4, delta=0.01, **settings)
    allowed = solvers.dp_mixmin(PREDS, delta=0.5, allow_large_delta=True, seed=0, **settings)
    assert allowed.allow_large_delta and allowed.delta == 0.5
    assert not solvers.dp_mixmin(PREDS, delta=1e-3, seed=0, **settings).allow_large_delta


def test_no_noise_control_reports_infinite_epsilon():
    result = solvers.dp_mixmin(
        PREDS,
        noise_multiplier=0.0,
        delta=1e-5,
        steps=10,
        batch_size=400,
        clip_norm=100.0,
        learning_rate=1.0,
        seed=0,
    )
    assert result.epsilon == np.inf and not result.is_private
    # Full batch (q = 1), no clipping, no noise: exactly non-private MixMin.
    np.testing.assert_allclose(result.weights, solvers.mixmin(PREDS, steps=10), rtol=1e-4)


@pytest.mark.slow
def test_paper_settings_are_reachable():
    rng = np.random.default_rng(0)
    images = rng.uniform(0.01, 0.99, size=(5000, 14))
    r = solvers.dp_mixmin(
        images,
        epsilon=1.0,
        delta=1e-5,
        steps=20,
        batch_size=1000,
        clip_norm=13.0,
        learning_rate=1.0,
        seed=0,
    )
    assert np.isfinite(r.epsilon) and r.epsilon <= 1.0
    logprobs, lengths = -rng.uniform(50, 500, size=(600, 16)), rng.integers(20, 200, 600)
    enron = solvers.dp_mixmin(
        logprobs,
        kind="sequence",
        lengths=lengths,
        user_ids=rng.integers(0, 148, 600),
        max_examples_per_user=15,
        epsilon=1.0,
        delta=1e-5,
        steps=200,
        batch_size=20,
        clip_norm=0.01,
        learning_rate=5.0,
        seed=0,
    )
    assert enron.user_level and np.isfinite(enron.epsilon) and enron.epsilon <= 1.0
    math = solvers.dp_mixmin(
        logprobs,
        kind="sequence",
        lengths=lengths,
        epsilon=1.0,
        delta=1e-5,
        steps=200,
        batch_size=60,
        clip_norm=0.2,
        learning_rate=5.0,
        seed=0,
    )
    assert np.isfinite(math.epsilon) and math.epsilon <= 1.0
    for result in (r, enron, math):
        assert np.all(np.isfinite(result.weights)) and result.weights.sum() == pytest.approx(
            1, abs=1e-5
        )


def test_scan_compiles_once_per_run(monkeypatch):
    calls = []
    original = objectives.example_loss

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(objectives, "example_loss", counting)
    preds = np.random.default_rng(5).uniform(0.1, 0.9, size=(333, 7))  # shapes unique to this test
    kwargs = dict(
        noise_multiplier=1.0, delta=1e-5, batch_size=50, clip_norm=1.0, learning_rate=1.0, seed=0
    )
    before = solvers.run_mirror_descent._cache_size()
    solvers.dp_mixmin(preds, steps=40, **kwargs)
    assert solvers.run_mirror_descent._cache_size() == before + 1
    traces = len(calls)
    assert 1 <= traces <= 2  # traced once for the scan body, not once per step
    solvers.dp_mixmin(preds, steps=40, **kwargs)  # same shapes: no new trace
    assert len(calls) == traces and solvers.run_mirror_descent._cache_size() == before + 1


def test_core_vmaps_over_keys():
    examples = objectives.prepare_examples(PREDS)
    batches = jnp.tile(jnp.arange(32)[None], (5, 1))
    masks = jnp.ones_like(batches, dtype=bool)
    keys = jax.random.split(jax.random.key(0), 4)
    settings = dict(
        kind="nll",
        clip_norm=1.0,
        noise_multiplier=2.0,
        expected_batch_size=32.0,
        learning_rate=1.0,
        shift="mean",
    )
    run = lambda k: solvers.run_mirror_descent(examples, batches, masks, k, **settings)
    batched = jax.vmap(run)(keys)
    for i in range(4):
        np.testing.assert_allclose(batched.weights[i], run(keys[i]).weights, rtol=1e-5)
    assert not np.allclose(batched.weights[0], batched.weights[1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(user_ids=np.array([], dtype=int), max_examples_per_user=2), "one id per example"),
        (dict(user_ids=np.arange(400)), "max_examples_per_user"),
        (dict(max_examples_per_user=3), "only used with user_ids"),
        (dict(epsilon=1.0), "exactly one of"),
        (dict(noise_multiplier=None), "exactly one of"),
        (dict(solver="frank_wolfe"), "learning_rate must be None"),
        (dict(learning_rate=None), "needs a learning_rate"),
        (dict(solver="adam"), "solver must be"),
        (dict(shift="median"), "shift must be"),
        (dict(noise_multiplier=-1.0), "noise_multiplier"),
        (dict(clip_norm=0.0), "clip_norm"),
    ],
)
def test_invalid_settings_raise(kwargs, message):
    settings = dict(
        noise_multiplier=1.0,
        delta=1e-5,
        steps=3,
        batch_size=10,
        clip_norm=1.0,
        learning_rate=1.0,
        seed=0,
    )
    with pytest.raises(ValueError, match=message):
        solvers.dp_mixmin(PREDS, **{**settings, **kwargs})


def test_invalid_proxy_outputs_raise_in_dp_mixmin():
    with pytest.raises(ValueError, match="at least 2 sources"):
        solvers.dp_mixmin(
            PREDS[:, :1],
            noise_multiplier=1.0,
            delta=1e-5,
            steps=3,
            batch_size=10,
            clip_norm=1.0,
            learning_rate=1.0,
            seed=0,
        )
    with pytest.raises(ValueError, match="non-finite"):
        solvers.mixmin(np.where(PREDS > 0.9, np.nan, PREDS))


def test_non_finite_weights_are_an_error_naming_the_step():
    # A learning rate of 1e38 used to return an all-NaN λ with an ε.
    with pytest.raises(ValueError, match="non-finite mixture weights at step 1 of 5"):
        solvers.dp_mixmin(
            PREDS,
            epsilon=1.0,
            delta=1e-5,
            steps=5,
            batch_size=100,
            clip_norm=1.0,
            learning_rate=1e38,
            seed=0,
        )
