"""BandMF correlated noise: the strategy, the noise, cyclic sampling, accounting, the Trainer.

Every property is checked against an independent computation: dense matrices and triangular
solves for the noise, brute force over participation patterns for the sensitivity, direct
`dp_accounting` compositions for ε, the existing samplers and DP-SGD Trainer for one band, an
uninterrupted run for a resumed one, and a one-run audit with and without noise.
"""

import itertools
import json
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.linalg
from dp_accounting.rdp import RdpAccountant
from flax import nnx

from dpmix_jax.mixing import objectives, solvers
from dpmix_jax.privacy import (
    audit,
    correlated_noise,
    cyclic_sampling,
    gaussian_noise,
    noise,
    sampling,
)
from dpmix_jax.privacy.plan import DpSgdConfig, plan_dp_sgd
from dpmix_jax.train import Checkpointer, TrainConfig, engine, losses
from tests.tiny_trainer import TinyMLP, tiny_data

# ------------------------------------------------------------------------------ the strategy


@pytest.mark.parametrize("bands", [1, 2, 5, 9])
def test_sqrt_prefix_sum_squares_to_the_prefix_sum_on_its_bands(bands):
    strategy = correlated_noise.sqrt_prefix_sum(bands)
    r = np.asarray(strategy.coefficients) / strategy.coefficients[0]
    # The untruncated square root R of A (all ones below the diagonal): (R R)[k] = 1 for all k.
    np.testing.assert_allclose(np.convolve(r, r)[:bands], np.ones(bands), rtol=1e-12)
    expected = [math.comb(2 * j, j) / 4**j for j in range(bands)]
    np.testing.assert_allclose(r, expected, rtol=1e-12)
    assert strategy.max_column_norm() == pytest.approx(1.0, abs=1e-12)


def test_strategy_matrix_and_column_norms_match_a_dense_loop():
    strategy = correlated_noise.BandedToeplitzStrategy(coefficients=(2.0, -0.5, 0.25))
    steps = 6
    dense = np.zeros((steps, steps))
    for i in range(steps):
        for j in range(steps):
            if 0 <= i - j < 3:
                dense[i, j] = strategy.coefficients[i - j]
    np.testing.assert_array_equal(strategy.strategy_matrix(steps), dense)
    np.testing.assert_allclose(strategy.column_norms(steps), np.linalg.norm(dense, axis=0))
    np.testing.assert_allclose(strategy.strategy_matrix(2), dense[:2, :2])


def _brute_force_sensitivity(matrix: np.ndarray, separation: int) -> float:
    steps = matrix.shape[0]
    best = 0.0
    for pattern in itertools.product([0, 1], repeat=steps):
        where = np.flatnonzero(pattern)
        if len(where) > 1 and np.min(np.diff(where)) < separation:
            continue
        best = max(best, float(np.linalg.norm(matrix @ np.asarray(pattern, float))))
    return best


@pytest.mark.parametrize("steps,bands", [(1, 1), (5, 1), (7, 2), (8, 3), (9, 4), (10, 5), (6, 6)])
def test_sensitivity_is_the_worst_separated_participation_pattern(steps, bands):
    strategy = correlated_noise.sqrt_prefix_sum(bands)
    brute = _brute_force_sensitivity(strategy.strategy_matrix(steps), bands)
    assert strategy.sensitivity(steps) == pytest.approx(brute, rel=1e-12)
    # One participation costs exactly the normalised column norm 1.
    assert _brute_force_sensitivity(strategy.strategy_matrix(bands), bands) == pytest.approx(1.0)


def test_bad_strategies_are_refused_in_one_line():
    for coefficients in [(), (0.0, 1.0), (-1.0,), (1.0, math.nan)]:
        with pytest.raises(ValueError, match="coefficients"):
            correlated_noise.BandedToeplitzStrategy(coefficients=coefficients)
    for bands in [0, 1.5, True, None]:
        with pytest.raises(ValueError, match="bands"):
            correlated_noise.sqrt_prefix_sum(bands)


# ------------------------------------------------------------------------------ the noise


def _noises(transformation, params, steps):
    state = transformation.init(params)
    zero = jax.tree.map(jnp.zeros_like, params)
    out = []
    for _ in range(steps):
        added, state = transformation.update(zero, state)
        out.append(added)
    return out, state


def test_one_band_is_gaussian_noise_bit_for_bit():
    params = {"a": jnp.zeros((3, 4)), "b": jnp.zeros(5, jnp.bfloat16)}
    strategy = correlated_noise.sqrt_prefix_sum(1)
    key = jax.random.key(3)
    correlated, _ = _noises(correlated_noise.add_correlated_noise(0.7, strategy, key), params, 4)
    independent, _ = _noises(gaussian_noise.add_gaussian_noise(0.7, key), params, 4)
    for c, i in zip(correlated, independent, strict=True):
        for name in params:
            assert c[name].dtype == i[name].dtype == jnp.float32
            assert np.asarray(c[name]).tobytes() == np.asarray(i[name]).tobytes()


def test_noise_is_the_inverse_strategy_applied_to_the_gaussian_draws():
    # z_t is drawn as add_gaussian_noise draws it: replay it with the same key and solve C W = Z.
    strategy = correlated_noise.sqrt_prefix_sum(3)
    steps, key, params = 7, jax.random.key(11), jnp.zeros(6)
    correlated, state = _noises(
        correlated_noise.add_correlated_noise(2.0, strategy, key), params, steps
    )
    z, _ = _noises(gaussian_noise.add_gaussian_noise(2.0, key), params, steps)
    expected = scipy.linalg.solve_triangular(
        strategy.strategy_matrix(steps), np.stack(z).astype(np.float64), lower=True
    )
    np.testing.assert_allclose(np.stack(correlated), expected, rtol=1e-5, atol=1e-5)
    assert len(state.history) == 2  # b - 1 past noise vectors, newest first
    np.testing.assert_array_equal(state.history[0], correlated[-1])
    np.testing.assert_array_equal(state.history[1], correlated[-2])


def test_noise_covariance_over_steps_is_sigma2_inverse_of_ct_c():
    # Many independent coordinates of a vector are many draws of the (steps,) noise process.
    sigma, steps, draws = 1.5, 6, 40_000
    strategy = correlated_noise.sqrt_prefix_sum(3)
    transformation = correlated_noise.add_correlated_noise(sigma, strategy, jax.random.key(5))
    noises, _ = _noises(transformation, jnp.zeros(draws), steps)
    w = np.stack(noises).astype(np.float64)  # (steps, draws)
    empirical = w @ w.T / draws
    c = strategy.strategy_matrix(steps)
    expected = sigma**2 * np.linalg.inv(c.T @ c)
    # Var of a sample covariance entry of Gaussians: (Σ_ii Σ_jj + Σ_ij²) / N; 5 standard errors.
    stderr = np.sqrt((np.outer(np.diag(expected), np.diag(expected)) + expected**2) / draws)
    assert np.all(np.abs(empirical - expected) < 5 * stderr), np.max(
        np.abs(empirical - expected) / stderr
    )
    # The correlation is real: the independent-noise covariance σ² I is rejected.
    assert np.max(np.abs(empirical - sigma**2 * np.eye(steps)) / stderr) > 20


# ------------------------------------------------------------------------------ cyclic sampling


def test_one_band_draws_the_poisson_samplers_batches():
    parts = cyclic_sampling.cyclic_parts(np.arange(90), bands=1, key=b"k")
    cyclic = cyclic_sampling.CyclicPoissonSampler(sampling_rate=0.2, bands=1, pad_multiple=8)
    plain = sampling.PoissonSampler(sampling_rate=0.2, pad_multiple=8)
    rng_a, rng_b = np.random.default_rng(4), np.random.default_rng(4)
    for step in range(5):
        a, b = cyclic.sample(rng_a, parts, step), plain.sample(rng_b, 90)
        np.testing.assert_array_equal(a.indices, b.indices)
        np.testing.assert_array_equal(a.mask, b.mask)
    users = sampling.group_by_user(np.random.default_rng(0).integers(0, 30, size=120))
    user_parts = cyclic_sampling.cyclic_parts(np.arange(len(users)), bands=1, key=b"k")
    cyclic_users = cyclic_sampling.CyclicUserPoissonSampler(
        sampling_rate=0.3, bands=1, max_examples_per_user=3, pad_multiple=4
    )
    plain_users = sampling.UserPoissonSampler(
        sampling_rate=0.3, max_examples_per_user=3, pad_multiple=4
    )
    for step in range(5):
        a = cyclic_users.sample(rng_a, users, user_parts, step)
        b = plain_users.sample(rng_b, users)
        for x, y in zip(a, b, strict=True):
            np.testing.assert_array_equal(x, y)


def test_cyclic_batches_come_from_the_active_partition_at_rate_q():
    n, bands, q, steps = 400, 4, 0.3, 400
    parts = cyclic_sampling.cyclic_parts(np.arange(n), bands=bands, key=b"secret")
    np.testing.assert_array_equal(
        parts, cyclic_sampling.cyclic_parts(np.arange(n), bands=bands, key=b"secret")
    )
    sampler = cyclic_sampling.CyclicPoissonSampler(sampling_rate=q, bands=bands, pad_multiple=8)
    rng = np.random.default_rng(1)
    counts, last_seen = np.zeros(n), np.full(n, -(10**9))
    for step in range(steps):
        batch = sampler.sample(rng, parts, step)
        units = batch.indices[batch.mask]
        assert np.all(parts[units] == step % bands)
        assert np.all(step - last_seen[units] >= bands)  # b-min-separated participation
        last_seen[units] = step
        counts[units] += 1
    # Each unit is active steps / b times and included w.p. q each time: a binomial, 5 sd.
    active = steps / bands
    assert abs(counts.mean() - q * active) < 5 * math.sqrt(q * (1 - q) * active / n)
    users = sampling.group_by_user(np.repeat(np.arange(50), 2))
    user_parts = cyclic_sampling.cyclic_parts(np.arange(50), bands=3, key=b"u")
    user_sampler = cyclic_sampling.CyclicUserPoissonSampler(
        sampling_rate=0.5, bands=3, max_examples_per_user=2, pad_multiple=4
    )
    for step in range(6):
        batch = user_sampler.sample(rng, users, user_parts, step)
        chosen = batch.users[batch.users >= 0]
        assert np.all(user_parts[chosen] == step % 3)


# ------------------------------------------------------------------------------ accounting


def _direct_rdp_epsilon(sigma, rate, steps, delta):
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    return RdpAccountant().compose(event).get_epsilon(delta)


def test_bandmf_epsilon_is_dp_sgd_over_the_cycles_at_the_partition_rate():
    config = DpSgdConfig(
        epsilon=None, noise_multiplier=1.1, delta=1e-5, clip_norm=1.0, batch_size=20,
        steps=50, noise="bandmf", bands=4, accountant="rdp",
    )  # fmt: skip
    plan = plan_dp_sgd(config, num_units=1000)
    assert plan.sampling_rate == pytest.approx(20 * 4 / 1000)
    assert plan.expected_batch_size == pytest.approx(20)
    direct = _direct_rdp_epsilon(1.1, 0.08, math.ceil(50 / 4), 1e-5)
    assert plan.spent().epsilon == pytest.approx(direct, rel=1e-12)
    assert plan.spent(9).epsilon == pytest.approx(_direct_rdp_epsilon(1.1, 0.08, 3, 1e-5))
    event = correlated_noise.amplified_bandmf_event(
        noise_multiplier=1.1, sampling_rate=0.08, steps=50, bands=4
    )
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.08, dp_accounting.GaussianDpEvent(1.1)), 13
    )
    assert [plan.event_due(t) for t in range(9)] == [t % 4 == 0 for t in range(9)]


def test_bandmf_calibration_meets_the_target_with_the_cycles_and_rate():
    config = DpSgdConfig(
        epsilon=2.0, delta=1e-5, clip_norm=1.0, batch_size=25, steps=60, noise="bandmf", bands=3
    )
    plan = plan_dp_sgd(config, num_units=3000)
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                0.025, dp_accounting.GaussianDpEvent(plan.noise_multiplier)
            ),
            20,
        )
    )
    direct = pld.get_epsilon(1e-5)
    assert direct == pytest.approx(2.0, rel=2e-3)
    assert plan.spent().epsilon <= 2.0 + 1e-9
    # More bands at the same batch size: higher rate but fewer accounted steps.
    dp_sgd = plan_dp_sgd(
        DpSgdConfig(epsilon=2.0, delta=1e-5, clip_norm=1.0, batch_size=25, steps=60),
        num_units=3000,
    )
    assert dp_sgd.noise_multiplier != plan.noise_multiplier


def test_one_band_plan_is_todays_dp_sgd_plan():
    common = dict(epsilon=1.5, delta=1e-5, clip_norm=1.0, batch_size=32, steps=40)
    bandmf = plan_dp_sgd(DpSgdConfig(**common, noise="bandmf", bands=1), num_units=2000)
    dp_sgd = plan_dp_sgd(DpSgdConfig(**common), num_units=2000)
    assert bandmf.sampling_rate == dp_sgd.sampling_rate
    assert bandmf.noise_multiplier == dp_sgd.noise_multiplier
    assert bandmf.step_event() == dp_sgd.step_event()
    assert bandmf.spent() == dp_sgd.spent()
    assert all(bandmf.event_due(t) for t in range(5))
    assert dp_sgd.strategy() is None and bandmf.strategy().coefficients == (1.0,)


def test_bad_noise_settings_are_refused_in_one_line():
    common = dict(epsilon=1.0, delta=1e-5, clip_norm=1.0, batch_size=10, steps=8)
    cases = [
        (dict(bands=2), "bands is for noise='bandmf'"),
        (dict(noise="bandmf"), "needs bands"),
        (dict(noise="bandmf", bands=0), "bands must be an integer"),
        (dict(noise="bandmf", bands=9), "bands must be <= steps"),
        (dict(noise="gaussian"), "noise must be"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            DpSgdConfig(**common, **extra)
    with pytest.raises(ValueError, match="would exceed 1"):
        plan_dp_sgd(DpSgdConfig(**common, noise="bandmf", bands=4), num_units=39)
    with pytest.raises(ValueError, match="bands"):
        TrainConfig(steps=3, batch_size=4, learning_rate=0.1, bands=2)


# ------------------------------------------------------------------------------ the Trainer


DATA = tiny_data(96)
gather = DATA.gather


def _config(**changes):
    settings = dict(
        steps=6, batch_size=8, learning_rate=0.05, optimizer="adam", private=True,
        clip_norm=1.0, delta=1e-5, noise_multiplier=1.2, pad_multiple=8, log_every=None,
        progress=False, noise="bandmf", bands=3,
    )  # fmt: skip
    settings.update(changes)
    return TrainConfig(**settings)


def _trainer(config, key=42):
    return engine.Trainer(
        config,
        TinyMLP(nnx.Rngs(0)),
        losses.softmax_cross_entropy(),
        num_units=96,
        noise_key=jax.random.key(key),
    )


def _assert_same_params(a, b):
    for name, value in a.items():
        assert np.asarray(value).tobytes() == np.asarray(b[name]).tobytes(), name


def test_one_band_trainer_is_dp_sgd_bit_for_bit():
    bandmf = engine.fit(_trainer(_config(bands=1)), DATA, rng=np.random.default_rng(3))
    dp_sgd = engine.fit(
        _trainer(_config(noise="independent", bands=None)), DATA, rng=np.random.default_rng(3)
    )
    _assert_same_params(bandmf.state.params, dp_sgd.state.params)
    assert bandmf.ledger.entries == dp_sgd.ledger.entries
    assert bandmf.rng.bit_generator.state == dp_sgd.rng.bit_generator.state


def test_ledger_records_one_event_per_cycle_and_matches_the_plan():
    trainer = _trainer(_config(steps=7, bands=3))
    result = engine.fit(trainer, DATA, rng=np.random.default_rng(0))
    assert result.ledger.count == 3  # cycles starting at steps 0, 3, 6
    assert result.ledger.entries == [(trainer.plan.step_event(), 3)]
    assert result.ledger.epsilon(1e-5) == pytest.approx(trainer.plan.spent().epsilon)
    assert trainer.plan.sampling_rate == pytest.approx(8 * 3 / 96)
    # Noise state: b - 1 float32 copies of the trainable parameters.
    history = result.state.opt_state[0].history
    assert len(history) == 2
    for copy in history:
        for name, value in result.state.params.items():
            assert copy[name].shape == value.shape and copy[name].dtype == jnp.float32


@pytest.mark.slow
def test_resume_mid_cycle_is_bit_identical_and_counts_each_cycle_once(tmp_path):
    config = _config(steps=8, bands=3, checkpoint_every=2)
    reference = engine.fit(_trainer(config), DATA, rng=np.random.default_rng(7))
    first = engine.fit(
        _trainer(config), DATA, rng=np.random.default_rng(7),
        checkpointer=Checkpointer(tmp_path), until=4,
    )  # fmt: skip
    assert first.ledger.count == 2  # steps 0-2 and the cycle begun at step 3
    resumed = engine.fit(
        _trainer(config), DATA, rng=np.random.default_rng(999), checkpointer=Checkpointer(tmp_path)
    )
    _assert_same_params(reference.state.params, resumed.state.params)
    for ref, res in zip(
        jax.tree.leaves(reference.state.opt_state[0].history),
        jax.tree.leaves(resumed.state.opt_state[0].history),
        strict=True,
    ):
        assert np.asarray(ref).tobytes() == np.asarray(res).tobytes()
    assert resumed.ledger.count == reference.ledger.count == 3
    assert resumed.ledger.epsilon(1e-5) == reference.ledger.epsilon(1e-5)


def test_user_level_bandmf_batches_stay_in_the_active_partition():
    user_ids = np.repeat(np.arange(48), 2)
    data = engine.IndexedData(gather=gather, num_examples=96, user_ids=user_ids)
    config = _config(level="user", max_examples_per_user=2, batch_size=6, bands=2, steps=4)
    trainer = engine.Trainer(
        config, TinyMLP(nnx.Rngs(0)), losses.softmax_cross_entropy(), num_units=48,
        noise_key=jax.random.key(1),
    )  # fmt: skip
    state = trainer.init_state()
    parts = trainer.cycle_parts(state, data)
    assert set(np.unique(parts)) <= {0, 1}
    rng = np.random.default_rng(2)
    for step in range(4):
        batch = trainer.sampler.sample(rng, data.users, parts, step)
        assert np.all(parts[batch.users[batch.users >= 0]] == step % 2)
    result = engine.fit(trainer, data, rng=np.random.default_rng(2), state=state)
    assert result.ledger.count == 2


def test_update_before_noise_stays_within_c_per_unit_for_huge_gradients():
    # One unit with a gradient of norm ~1e6: after one SGD step, the update minus the replayed
    # correlated noise, times the public batch size over the learning rate, is its clipped
    # gradient: norm <= C.
    x = np.full((4, 4), 1e5, np.float32)

    def huge(idx):
        keep = idx >= 0
        return {
            "inputs": x[np.where(keep, idx, 0)] * keep[:, None],
            "label": np.zeros(len(idx), np.int64),
        }

    clip, lr = 0.5, 0.1
    config = _config(
        optimizer="sgd", learning_rate=lr, clip_norm=clip, batch_size=1, bands=2, steps=2,
        pad_multiple=4,
    )  # fmt: skip
    trainer = engine.Trainer(
        config, TinyMLP(nnx.Rngs(0)), lambda m, b: 1e3 * jnp.sum(m(b["inputs"]), axis=1),
        num_units=4, noise_key=jax.random.key(9),
    )  # fmt: skip
    state = trainer.init_state()
    start = jax.tree.map(np.asarray, state.params)
    sensitivity = trainer._grad_sum(trainer.frozen, trainer.rest).sensitivity()
    replay = correlated_noise.add_correlated_noise(
        trainer.plan.noise_multiplier * sensitivity,
        trainer.plan.strategy(),
        jax.random.key(9),
    )
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    noise_state = replay.init(zeros)
    for step in range(2):
        mask = np.zeros(4, bool)
        mask[step] = True
        state = trainer.noisy_step(state, huge, np.arange(4), mask)
        noise_now, noise_state = replay.update(zeros, noise_state)
        end = jax.tree.map(np.asarray, state.params)
        clipped = {
            k: (start[k].astype(np.float64) - end[k]) * trainer.plan.expected_batch_size / lr
            - np.asarray(noise_now[k], np.float64)
            for k in start
        }
        norm = math.sqrt(sum(float(np.sum(v**2)) for v in clipped.values()))
        assert norm <= clip * (1 + 1e-3), (step, norm)
        assert norm > 0.5 * clip  # the huge gradient was clipped to about C, not dropped
        start = end


# ------------------------------------------------------------------------------ the audit


class _Dirac(nnx.Module):
    def __init__(self, size):
        self.w = nnx.Param(jnp.zeros(size, jnp.float32))


def _audit_run(noise_multiplier, *, canaries, included, dim, epsilon, seed):
    """A private BandMF Trainer on Gaussian examples plus the included dirac canaries; returns
    the canaries' scores (their coordinates of the released parameters) and the plan."""
    rng = np.random.default_rng(seed)
    normal = 300
    x = rng.normal(size=(normal, dim)).astype(np.float32)
    canary_ids = np.flatnonzero(included)
    rows_x = np.concatenate([x, np.zeros((len(canary_ids), dim), np.float32)])
    rows_canary = np.concatenate([np.full(normal, -1), canary_ids])
    clip = 1.0

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {"x": rows_x[rows] * keep[:, None], "canary": np.where(keep, rows_canary[rows], -1)}

    def loss_fn(model, batch):
        w = model.w.value
        ordinary = 0.5 * jnp.sum((w[None, :dim] - batch["x"]) ** 2, axis=1) * 0.01
        canary = -clip * w[dim + jnp.maximum(batch["canary"], 0)]
        return jnp.where(batch["canary"] >= 0, canary, ordinary)

    units = len(rows_x)
    bands, steps = 4, 32
    settings = dict(
        steps=steps, batch_size=int(0.5 * units / bands), learning_rate=1.0, optimizer="sgd",
        private=True, clip_norm=clip, delta=1e-5, pad_multiple=64, log_every=None,
        progress=False, noise="bandmf", bands=bands, clipping="vmap",
    )  # fmt: skip
    if noise_multiplier is None:
        settings["epsilon"] = epsilon
    else:
        settings["noise_multiplier"] = noise_multiplier
    trainer = engine.Trainer(
        TrainConfig(**settings), _Dirac(dim + canaries), loss_fn, num_units=units,
        noise_key=jax.random.key(seed),
    )  # fmt: skip
    data = engine.IndexedData(gather=gather, num_examples=units)
    result = engine.fit(trainer, data, rng=rng)
    scores = np.asarray(result.state.params[next(iter(result.state.params))], np.float64)[dim:]
    return scores, trainer.plan, result.ledger


def test_one_run_audit_bounds_bandmf_below_its_claim_and_detects_a_broken_mechanism():
    canaries, dim, epsilon, delta = 1000, 4, 2.0, 1e-5
    included = np.random.default_rng(123).random(canaries) < 0.5
    scores, plan, ledger = _audit_run(
        None, canaries=canaries, included=included, dim=dim, epsilon=epsilon, seed=1
    )
    claimed = plan.spent().epsilon
    assert claimed <= epsilon + 1e-9
    assert ledger.epsilon(delta) == pytest.approx(claimed)
    private_bound = audit.one_run_epsilon_lower_bound(scores, included, delta=delta)
    assert private_bound.epsilon < claimed
    # The same mechanism without noise: the canaries are plain to see, the bound exceeds the claim.
    scores, _, _ = _audit_run(
        0.0, canaries=canaries, included=included, dim=dim, epsilon=epsilon, seed=1
    )
    control_bound = audit.one_run_epsilon_lower_bound(scores, included, delta=delta)
    assert control_bound.epsilon > claimed, (control_bound.epsilon, claimed)


def test_private_optimizer_takes_the_strategy():
    strategy = correlated_noise.sqrt_prefix_sum(2)
    optimizer = noise.private_optimizer(
        optax.sgd(1.0), noise_multiplier=1.0, sensitivity=1.0, expected_batch_size=2.0,
        key=jax.random.key(0), strategy=strategy,
    )  # fmt: skip
    state = optimizer.init(jnp.zeros(3))
    assert isinstance(state[0], correlated_noise.CorrelatedNoiseState)
    replay = correlated_noise.add_correlated_noise(1.0, strategy, jax.random.key(0))
    expected, _ = replay.update(jnp.ones(3), replay.init(jnp.zeros(3)))
    updates, _ = optimizer.update(jnp.ones(3), state, jnp.zeros(3))
    np.testing.assert_allclose(updates, -expected / 2.0, rtol=1e-6)


# ------------------------------------------------------------------------------ DP-MixMin

PREDS = np.random.default_rng(3).uniform(0.05, 0.95, size=(400, 5))
MIXMIN = dict(delta=1e-5, steps=30, batch_size=40, clip_norm=1.0, learning_rate=1.0, seed=0)


def test_one_band_dp_mixmin_is_unchanged_bit_for_bit():
    for level in ({}, {"user_ids": np.arange(400) // 4, "max_examples_per_user": 2}):
        settings = {**MIXMIN, **level, "batch_size": 10 if level else 40}
        bandmf = solvers.dp_mixmin(PREDS, noise_multiplier=1.1, noise="bandmf", bands=1, **settings)
        dp_sgd = solvers.dp_mixmin(PREDS, noise_multiplier=1.1, **settings)
        assert bandmf.history.tobytes() == dp_sgd.history.tobytes()
        assert bandmf.epsilon == dp_sgd.epsilon and bandmf.ledger.count == 30


def test_dp_mixmin_bandmf_epsilon_is_dp_sgd_over_the_cycles():
    result = solvers.dp_mixmin(
        PREDS, noise_multiplier=1.1, noise="bandmf", bands=4, accountant="rdp", **MIXMIN
    )
    assert result.sampling_rate == pytest.approx(4 * 40 / 400)
    assert result.expected_batch_size == pytest.approx(40)
    assert result.ledger.count == 8  # ceil(30 / 4)
    direct = _direct_rdp_epsilon(1.1, 0.4, 8, 1e-5)
    assert result.epsilon == pytest.approx(direct, rel=1e-12)
    assert (result.noise, result.bands) == ("bandmf", 4)
    calibrated = solvers.dp_mixmin(PREDS, epsilon=2.0, noise="bandmf", bands=3, **MIXMIN)
    assert calibrated.epsilon <= 2.0 + 1e-9


def test_mirror_descent_noise_is_the_inverse_strategy_of_the_draws():
    # No unit in any batch: the logits move by -η/b·w_t only, so log λ_t - log λ_t[0] is the
    # running sum of the correlated noise (the softmax ignores the shift by the max).
    steps, k, sigma, clip, lr, b = 6, 5, 0.8, 2.0, 0.5, 10.0
    strategy = correlated_noise.sqrt_prefix_sum(3)
    examples = objectives.prepare_examples(PREDS[:8, :k], kind="nll")
    batches = jnp.zeros((steps, 4), jnp.int32)
    key = jax.random.key(4)
    trace = solvers.run_mirror_descent(
        examples, batches, jnp.zeros((steps, 4), bool), key, kind="nll", clip_norm=clip,
        noise_multiplier=sigma, expected_batch_size=b, learning_rate=lr,
        strategy=strategy.coefficients,
    )  # fmt: skip
    draws = np.stack(
        [
            gaussian_noise.gaussian_noise_tree(step_key, jnp.zeros(k), sigma * clip)
            for step_key in jax.random.split(key, steps)
        ]
    ).astype(np.float64)
    w = scipy.linalg.solve_triangular(strategy.strategy_matrix(steps), draws, lower=True)
    expected = -lr / b * np.cumsum(w, axis=0)
    logs = np.log(np.asarray(trace.history, np.float64))
    np.testing.assert_allclose(logs - logs[:, :1], expected - expected[:, :1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ command line


def test_demo_noise_flags_reach_the_finetune_and_mixture_configs(monkeypatch, tmp_path):
    from dpmix_jax import cli, pipeline

    seen = {}

    def fake_comparison(stages, **kwargs):
        seen["config"] = stages.config
        (kwargs["out_dir"] / "results.md").write_text("")
        return {"runs": []}

    monkeypatch.setattr(pipeline, "run_comparison", fake_comparison)
    argv = ["demo", "--noise", "bandmf", "--bands", "4", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    config = seen["config"]
    assert (config.finetune.noise, config.finetune.bands) == ("bandmf", 4)
    assert (config.mixture.noise, config.mixture.bands) == ("bandmf", 4)
    assert cli.main(["demo", "--out", str(tmp_path / "default")]) == 0
    assert seen["config"].finetune.noise == "independent" and seen["config"].mixture.bands is None


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--bands", "3"], "bands is for noise='bandmf'"),
        (["--noise", "bandmf"], "needs bands"),
        (["--noise", "bandmf", "--bands", "100000"], "bands must be <= steps"),
    ],
)
def test_demo_noise_flags_are_checked_before_any_work(flags, message, capsys):
    from dpmix_jax import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["demo", *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------------------ the experiment


@pytest.mark.slow
def test_tiny_experiment_writes_results_at_equal_epsilon(tmp_path):
    from experiments import correlated_noise as study
    from experiments.configs.correlated_noise import CorrelatedNoiseConfig

    config = CorrelatedNoiseConfig(
        bands=(2,), epsilons=(2.0,), seeds=(0,), finetune_steps=4, long_bands=(4,),
        long_epsilons=(2.0,), long_batch_size=8, long_steps=8,
        long_optimizers=(("adam", None), ("momentum", 0.05)),
        text_steps=3, mixmin_examples=500, mixmin_steps=6, mixmin_batch_size=50,
        bench_size=1000, bench_repeats=2,
    )  # fmt: skip
    results = study.main(config, tmp_path, reproducible=True)
    stored = json.loads((tmp_path / "results.json").read_text())
    assert stored["noise_seeded"] is True and stored["provenance"]["command"]
    assert [r["mechanism"] for r in stored["mixmin"]] == ["DP-SGD", "BandMF b=2"]
    long = stored["long_finetune"]
    assert [(r["optimizer"], r["learning_rate"], r["mechanism"]) for r in long] == [
        ("adam", 1e-3, "DP-SGD"), ("adam", 1e-3, "BandMF b=4"),
        ("momentum", 0.05, "DP-SGD"), ("momentum", 0.05, "BandMF b=4"),
    ]  # fmt: skip
    assert [r["mechanism"] for r in stored["text"]] == ["DP-SGD", "BandMF b=2", "pretrained only"]
    private_text = stored["text"][:-1]
    for row in stored["finetune"] + stored["long_finetune"] + private_text + stored["mixmin"]:
        assert row["max_spent_epsilon"] <= 2.0 + 1e-9
        assert row["max_spent_epsilon"] > 1.5  # calibrated to the target, not far below it
    # b bands sample one partition of n / b units: b times DP-SGD's rate, batch / n.
    train = len(study.presets.digit_task().train)
    independent, banded = long[2:]
    assert independent["sampling_rate"] == pytest.approx(8 / train)
    assert banded["sampling_rate"] == pytest.approx(4 * 8 / train)
    assert independent["epochs"] == pytest.approx(8 * 8 / train)
    users = len(set(study.text_presets.text_task().train.user_ids))
    assert private_text[1]["sampling_rate"] == pytest.approx(2 * private_text[0]["sampling_rate"])
    assert private_text[0]["sampling_rate"] == pytest.approx(8 / users)
    # Fine-tuning moved every model away from the shared pretrained start, differently per noise.
    pretrained = stored["text"][-1]["test_perplexity"][0]
    perplexities = [row["test_perplexity"][0] for row in private_text]
    assert all(1.0 < p < 1000.0 and p != pretrained for p in perplexities)
    assert perplexities[0] != perplexities[1]
    assert private_text[0]["minus_dp_sgd"] == [0.0, 0.0]
    assert private_text[1]["minus_dp_sgd"][0] == pytest.approx(perplexities[1] - perplexities[0])
    assert [r["state_copies"] for r in results["noise_step"]] == [0, 1]
    assert stored["mixmin"][0]["noise_multiplier"] != stored["mixmin"][1]["noise_multiplier"]
    assert (tmp_path / "results.md").read_text().strip() == study.markdown(stored)
    assert f"| momentum | 0.05 | BandMF b=4 | 2 | {32 / train:.3f} |" in study.markdown(stored)


def test_docs_page_shows_the_stored_results_exactly():
    import pathlib

    from experiments import correlated_noise as study

    root = pathlib.Path(__file__).resolve().parents[2]
    stored = json.loads((root / "docs/results/correlated_noise.json").read_text())
    # The page's table is rebuilt from this file by `dpmix report` (checked by test_readme).
    assert (root / "docs/results/correlated_noise.md").read_text() == study.markdown(stored) + "\n"
    assert (
        "<!-- table:correlated_noise markdown -->"
        in (root / "docs/correlated-noise.md").read_text()
    )
