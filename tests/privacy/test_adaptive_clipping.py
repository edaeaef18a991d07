"""Adaptive clipping: the noise split, the count of unclipped units, the clip-norm update, the
Trainer integration (checkpoints, ledger) and a one-run audit of a private run that uses it."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from dp_accounting.pld import privacy_loss_distribution
from flax import nnx

from dpmix_jax.privacy import accounting, audit, clipping
from dpmix_jax.privacy.adaptive_clipping import (
    AdaptiveClipping,
    AdaptiveClipState,
    adaptive_gaussian_noise,
    centred_count,
    current_clip_norm,
    split_noise_multiplier,
)
from dpmix_jax.privacy.ghost import ghost_clipped_grad_sum, ghost_user_clipped_grad_sum
from dpmix_jax.train import Checkpointer, TrainConfig, engine, losses
from tests.tiny_trainer import TinyMLP, tiny_data

# ---------------------------------------------------------------------------------------------
# Settings and the noise split.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(target_quantile=1.5),
        dict(target_quantile=-0.1),
        dict(target_quantile=True),
        dict(learning_rate=0.0),
        dict(count_noise_stddev=0.0),
        dict(count_noise_stddev=math.nan),
    ],
)
def test_settings_are_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        AdaptiveClipping(**kw)


def test_split_refuses_count_noise_at_or_below_half_sigma():
    with pytest.raises(ValueError, match="count_noise_stddev"):
        split_noise_multiplier(2.0, 1.0)
    with pytest.raises(ValueError, match="count_noise_stddev"):
        AdaptiveClipping(count_noise_stddev=0.4).gradient_noise_multiplier(1.0, 100.0)
    assert split_noise_multiplier(0.0, 1.0) == 0.0  # the no-noise control
    # Default σ_b = max(b / 20, σ): never refused.
    assert AdaptiveClipping().count_stddev(200.0, 1.0) == pytest.approx(10.0)
    assert AdaptiveClipping().count_stddev(20.0, 3.0) == 3.0
    assert AdaptiveClipping().gradient_noise_multiplier(3.0, 20.0) == pytest.approx(
        3.0 * 2 / math.sqrt(3)
    )


def _pld_epsilon(sensitivity, stddev, rate, steps, delta):
    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=stddev,
        sensitivity=sensitivity,
        sampling_prob=rate,
        value_discretization_interval=1e-4,
    )
    return pld.self_compose(steps).get_epsilon_for_delta(delta)


@pytest.mark.parametrize("sigma, sigma_b", [(1.0, 5.0), (0.8, 0.5), (2.0, 1.2)])
def test_the_pair_is_one_gaussian_mechanism_of_multiplier_sigma(sigma, sigma_b):
    # The sensitivity of (sum, centred count), measured on the code's own clipped sum and count
    # (one unit of norm far above C_t removed), whitened by the noise the code really adds.
    clip_t = jnp.float32(0.37)
    grad_sum = clipping.clipped_grad_sum(lambda w, ex: jnp.vdot(w, ex["g"]), clip_norm=1.0)
    rng = np.random.default_rng(0)
    batch = {"g": rng.normal(size=(6, 5)).astype(np.float32)}
    batch["g"][2] *= 100.0  # clipped
    batch["g"][4] *= 1e-3  # unclipped
    full = np.ones(6, bool)
    total, stats = grad_sum(jnp.zeros(5), batch, full, clip_t)
    sigma_delta = split_noise_multiplier(sigma, sigma_b)
    for unit in range(6):
        without = full.copy()
        without[unit] = False
        total_w, stats_w = grad_sum(jnp.zeros(5), batch, without, clip_t)
        d_sum = float(np.linalg.norm(np.asarray(total, np.float64) - np.asarray(total_w)))
        d_count = abs(
            float(centred_count(stats["unclipped"], full))
            - float(centred_count(stats_w["unclipped"], without))
        )
        assert d_count == 0.5
        assert d_sum <= float(clip_t)
        mu = math.hypot(d_sum / (sigma_delta * float(clip_t)), d_count / sigma_b)
        assert mu <= (1.0 + 1e-6) / sigma
    # The worst case (a unit at full norm C_t) has whitened sensitivity exactly 1/σ, so the PLD
    # of the pair equals the PLD of DP-SGD with σ, subsampled and composed.
    mu = math.hypot(1.0 / sigma_delta, 0.5 / sigma_b)
    assert mu == pytest.approx(1.0 / sigma, rel=1e-12)
    pair = _pld_epsilon(mu, 1.0, 0.05, 50, 1e-5)
    dpsgd = accounting.epsilon(
        accounting.dpsgd_event(noise_multiplier=sigma, sampling_rate=0.05, steps=50), delta=1e-5
    )
    assert pair == pytest.approx(dpsgd, rel=2e-3)
    # With the count noise alone at multiplier 1 (sensitivity 1 instead of 1/2) the same σ_Δ
    # would spend more: the factor 2 is what the centring buys.
    unsound = _pld_epsilon(math.hypot(1.0 / sigma_delta, 1.0 / sigma_b), 1.0, 0.05, 50, 1e-5)
    assert unsound > 1.01 * dpsgd


def test_noise_has_the_stated_stddevs():
    # Sum noise: σ_Δ·C_t per coordinate; count noise σ_b, read back from the clip-norm update.
    config = AdaptiveClipping(target_quantile=0.5, learning_rate=0.5, count_noise_stddev=3.0)
    sigma, batch_size = 1.3, 40.0
    transform = adaptive_gaussian_noise(
        config, noise_multiplier=sigma, initial_clip_norm=2.0, expected_batch_size=batch_size
    )
    sigma_delta = config.gradient_noise_multiplier(sigma, batch_size)

    def one(key, count):
        state = AdaptiveClipState(key, jnp.float32(2.0))
        noisy, new = transform.update(jnp.zeros(4000), state, centred_count=count)
        return noisy, new.clip_norm

    keys = jax.random.split(jax.random.key(0), 3000)
    noisy, clips = jax.jit(jax.vmap(one, in_axes=(0, None)))(keys, jnp.float32(1.5))
    assert np.std(np.asarray(noisy[0])) == pytest.approx(sigma_delta * 2.0, rel=0.05)
    # b̃ = γ - log(C_{t+1}/C_t) / η = 1/2 + (count + noise) / b.
    fraction = 0.5 - np.log(np.asarray(clips, np.float64) / 2.0) / 0.5
    count_noise = (fraction - 0.5) * batch_size - 1.5
    assert np.mean(count_noise) == pytest.approx(0.0, abs=4 * 3.0 / math.sqrt(3000))
    assert np.std(count_noise) == pytest.approx(3.0, rel=0.05)
    # The sum noise and the count noise are independent draws.
    assert abs(np.corrcoef(np.asarray(noisy[:, 0]), count_noise)[0, 1]) < 0.08


# ---------------------------------------------------------------------------------------------
# The count of unclipped units, on every clipped-sum path.
# ---------------------------------------------------------------------------------------------


def _dense_example(params, example):
    return jnp.sum((example["x"] @ params["w"]) * example["v"])


def _dense_taped(params, batch, tape):
    y = tape.linear("fc", batch["x"], batch["x"] @ params["w"], kernel="w")
    return jnp.sum(y * batch["v"], axis=tuple(range(1, y.ndim)))


def _naive(params, units, mask, clip_norm, user_level):
    """A loop over units: certified norm bound, clipped sum and count of bounds <= C."""
    total, count = np.zeros((4, 3)), 0
    for i in range(mask.shape[0]):
        rows = np.flatnonzero(mask[i]) if user_level else ([i] if mask[i] else [])
        if not len(rows):
            continue
        grads = [jax.grad(_dense_example)(params, {k: v[i][r] if user_level else v[i]
                                                   for k, v in units.items()})["w"]
                 for r in rows]  # fmt: skip
        grad = {"w": sum(grads) / len(grads)}
        norm = float(clipping.norm_upper_bound(grad))
        count += norm <= clip_norm
        clipped, _ = clipping.clip_to_norm(grad, clip_norm, jnp.array(True))
        total += np.asarray(clipped["w"], np.float64)
    return total, count


@pytest.mark.parametrize("path", ["vmap", "microbatch", "ghost"])
@pytest.mark.parametrize("user_level", [False, True])
def test_count_and_sum_match_a_naive_loop_at_a_traced_clip_norm(path, user_level):
    rng = np.random.default_rng(1)
    shape = (8, 3) if user_level else (8,)
    units = {
        "x": rng.normal(size=(*shape, 4)).astype(np.float32),
        "v": rng.normal(size=(*shape, 3)).astype(np.float32)
        * rng.choice([0.01, 1.0, 10.0], size=(*shape, 1)).astype(np.float32),
    }
    mask = rng.random(shape) < 0.8
    params = {"w": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32)}
    if path == "ghost":
        build = ghost_user_clipped_grad_sum if user_level else ghost_clipped_grad_sum
        grad_sum = build(_dense_taped, clip_norm=100.0)
    else:
        build = clipping.user_clipped_grad_sum if user_level else clipping.clipped_grad_sum
        micro = 4 if path == "microbatch" else None
        grad_sum = build(_dense_example, clip_norm=100.0, microbatch_size=micro)
    call = jax.jit(lambda p, b, m, c: grad_sum(p, b, m, c))
    norms = None
    for clip_t in (0.3, 2.0, 9.0):
        total, stats = call(params, units, mask, jnp.float32(clip_t))
        want_total, want_count = _naive(params, units, mask, clip_t, user_level)
        np.testing.assert_allclose(np.asarray(total["w"]), want_total, rtol=2e-4, atol=1e-5)
        got_count = int(np.sum(np.asarray(stats["unclipped"])))
        assert got_count == want_count
        real = mask.reshape(8, -1).any(axis=1)
        assert float(centred_count(stats["unclipped"], mask)) == got_count - real.sum() / 2
        norms = np.asarray(stats["grad_norm"])
    # The thresholds split the units: the test exercised both outcomes.
    assert 0 < np.sum(norms <= 2.0) < np.sum(real)
    # The fixed clip norm is the same code path: a call without C equals a call with it.
    fixed = build(_dense_taped if path == "ghost" else _dense_example, clip_norm=2.0)
    a, stats_a = fixed(params, units, mask)
    b, stats_b = fixed(params, units, mask, 2.0)
    np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
    np.testing.assert_array_equal(stats_a["unclipped"], stats_b["unclipped"])


def _norm64(tree):
    return math.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("path", ["vmap", "ghost"])
def test_adversarial_units_stay_within_the_adaptive_clip_norm(path):
    # Positions whose gradients nearly cancel (the ghost Gram form's worst case), huge, tiny and
    # non-finite units: each unit alone adds at most C_t at a traced C_t, and removing one moves
    # the sum by at most C_t (1e-4 slack for other cancelling units' rounding, as for fixed C).
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 2, 8))
    v = 1e3 * rng.standard_normal((8, 2, 8))
    x[:, 1] = x[:, 0] + 1e-4 * rng.standard_normal(x[:, 1].shape)
    v[:, 1] = -v[:, 0] + 0.3 * rng.standard_normal(v[:, 1].shape)
    v[5] *= 1e-6
    v[6, 0, 0] = np.inf
    batch = {"x": x.astype(np.float32), "v": v.astype(np.float32)}
    params = {"w": jnp.zeros((8, 8))}
    if path == "ghost":
        grad_sum = ghost_clipped_grad_sum(_dense_taped, clip_norm=1.0)
    else:
        grad_sum = clipping.clipped_grad_sum(
            lambda p, ex: _dense_example(p, {"x": ex["x"], "v": ex["v"]}), clip_norm=1.0
        )
    call = jax.jit(lambda m, c: grad_sum(params, batch, m, c)[0])
    for clip_t in (0.0123, 0.37, 41.0):
        c = jnp.float32(clip_t)
        full = np.ones(8, bool)
        total = call(full, c)
        for j in range(8):
            alone = np.arange(8) == j
            without = full & ~alone
            assert _norm64(call(alone, c)) <= clip_t
            moved = _norm64(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b,
                                         total, call(without, c)))  # fmt: skip
            assert moved <= clip_t * (1 + 1e-4)


# ---------------------------------------------------------------------------------------------
# The clip-norm update.
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.9])
def test_clip_norm_converges_to_the_target_quantile_without_count_noise(quantile):
    # σ_b = 0 is allowed here only: the pure update with the exact unclipped fraction.
    norms = np.random.default_rng(0).lognormal(mean=0.0, sigma=1.0, size=2000)
    config = AdaptiveClipping(target_quantile=quantile, learning_rate=0.2)
    update = jax.jit(config.next_clip_norm)
    clip = jnp.float32(100.0)  # start far above every norm
    for _ in range(400):
        clip = update(clip, jnp.float32(np.mean(norms <= float(clip))))
    assert clip.dtype == jnp.float32
    assert np.mean(norms <= float(clip)) == pytest.approx(quantile, abs=0.02)
    assert float(clip) == pytest.approx(np.quantile(norms, quantile), rel=0.1)


@pytest.mark.parametrize("quantile", [0.3, 0.7])
def test_clip_norm_tracks_the_quantile_with_count_noise_and_poisson_batches(quantile):
    norms = jnp.asarray(np.random.default_rng(1).lognormal(0.0, 1.0, size=4000), jnp.float32)
    rate, steps = 0.05, 600
    config = AdaptiveClipping(target_quantile=quantile, learning_rate=0.2)  # σ_b = b/20 = 10
    transform = adaptive_gaussian_noise(
        config, noise_multiplier=1.0, initial_clip_norm=0.01, expected_batch_size=rate * 4000,
        key=jax.random.key(5),
    )  # fmt: skip

    def body(state, key):
        mask = jax.random.uniform(key, norms.shape) < rate
        count = centred_count(norms <= state.clip_norm, mask)
        _, state = transform.update(jnp.zeros(1), state, centred_count=count)
        return state, state.clip_norm

    _, clips = jax.lax.scan(body, transform.init(None), jax.random.split(jax.random.key(6), steps))
    late = np.asarray(clips[steps // 2 :])
    fractions = np.mean(np.asarray(norms)[None, :] <= late[:, None], axis=1)
    assert np.mean(fractions) == pytest.approx(quantile, abs=0.03)
    assert np.all(np.abs(fractions - quantile) < 0.2)
    assert float(clips[0]) < 0.02 < float(np.min(late))  # it moved from the start


def test_clip_norm_stays_finite_and_positive():
    config = AdaptiveClipping(learning_rate=50.0)
    assert float(config.next_clip_norm(jnp.float32(1.0), jnp.float32(-1e6))) == 2.0**64
    assert float(config.next_clip_norm(jnp.float32(1.0), jnp.float32(1e6))) == 2.0**-64


# ---------------------------------------------------------------------------------------------
# The Trainer.
# ---------------------------------------------------------------------------------------------


DATA = tiny_data(80, num_users=16)
gather = DATA.gather
ADAPTIVE = AdaptiveClipping(target_quantile=0.5, learning_rate=0.3, count_noise_stddev=2.0)
CONFIG = TrainConfig(
    steps=6, batch_size=16, learning_rate=0.05, optimizer="adam", private=True, clip_norm=5.0,
    delta=1e-5, noise_multiplier=1.2, pad_multiple=8, checkpoint_every=2, log_every=None,
    progress=False, adaptive_clipping=ADAPTIVE,
)  # fmt: skip


def new_trainer(config=CONFIG, key=42):
    num_units = 16 if config.level == "user" else 80
    return engine.Trainer(
        config, TinyMLP(nnx.Rngs(0)), losses.softmax_cross_entropy(), num_units=num_units,
        noise_key=jax.random.key(key),
    )  # fmt: skip


def test_config_rejects_adaptive_clipping_in_public_runs_and_wrong_types():
    with pytest.raises(ValueError, match="adaptive_clipping"):
        TrainConfig(steps=1, batch_size=4, learning_rate=0.1, adaptive_clipping=ADAPTIVE)
    with pytest.raises(ValueError, match="adaptive_clipping"):
        dataclasses.replace(CONFIG, adaptive_clipping={"target_quantile": 0.5})
    with pytest.raises(ValueError, match="count_noise_stddev"):  # σ_b = 0.5 <= σ/2 = 0.6
        new_trainer(
            dataclasses.replace(CONFIG, adaptive_clipping=AdaptiveClipping(count_noise_stddev=0.5))
        )


def test_trainer_step_matches_the_mechanism_by_hand():
    # One fused step = clipped sum at C_0 + N(0, (σ_Δ C_0)²), centred count + N(0, σ_b²) from the
    # same key stream, C_1 from the update; then the optimizer on the noisy mean.
    trainer = new_trainer(dataclasses.replace(CONFIG, optimizer="sgd", learning_rate=0.1))
    state = trainer.init_state()
    params0 = jax.tree.map(np.asarray, state.params)
    indices = np.array([0, 5, 9, 17, 33, 60, -1, -1])
    mask = indices >= 0
    after = trainer.noisy_step(state, gather, indices, mask)
    grad_sum = trainer._grad_sum(trainer.frozen, trainer.rest)
    batch = jax.tree.map(jnp.asarray, gather(indices))
    total, stats = grad_sum(params0, batch, mask, jnp.float32(5.0))
    count = float(centred_count(stats["unclipped"], mask))
    _, noise_key, count_key = jax.random.split(jax.random.key(42), 3)
    sigma_delta = ADAPTIVE.gradient_noise_multiplier(1.2, trainer.plan.expected_batch_size)
    from dpmix_jax.privacy.gaussian_noise import gaussian_noise_tree
    from dpmix_jax.privacy.randomness import normal

    noise = gaussian_noise_tree(noise_key, total, sigma_delta * 5.0)
    b = trainer.plan.expected_batch_size
    for name in params0:
        want = params0[name] - 0.1 * (np.asarray(total[name]) + np.asarray(noise[name])) / b
        np.testing.assert_allclose(np.asarray(after.params[name]), want, rtol=1e-5, atol=1e-6)
    fraction = 0.5 + (count + 2.0 * float(normal(count_key, 1)[0])) / b
    want_clip = 5.0 * math.exp(-0.3 * (fraction - 0.5))
    assert float(current_clip_norm(after.opt_state)) == pytest.approx(want_clip, rel=1e-5)


@pytest.mark.parametrize("level", ["example", "user"])
def test_chunked_and_fused_steps_agree_and_ghost_matches_vmap(level):
    extra = dict(level="user", max_examples_per_user=4, batch_size=4) if level == "user" else {}
    runs = {}
    for name, kw in {
        "fused": dict(clipping="vmap"),
        "chunked": dict(clipping="vmap", chunk_size=8),
        "ghost": dict(clipping="ghost"),
    }.items():
        config = dataclasses.replace(CONFIG, checkpoint_every=None, **extra, **kw)
        result = engine.fit(new_trainer(config), DATA, rng=np.random.default_rng(3))
        runs[name] = result
    clips = {k: float(current_clip_norm(r.state.opt_state)) for k, r in runs.items()}
    assert clips["fused"] != 5.0  # the clip norm moved
    assert clips["chunked"] == pytest.approx(clips["fused"], rel=1e-5)
    assert clips["ghost"] == pytest.approx(clips["fused"], rel=1e-4)
    for name in runs["fused"].state.params:
        for other in ("chunked", "ghost"):
            np.testing.assert_allclose(
                np.asarray(runs[other].state.params[name]),
                np.asarray(runs["fused"].state.params[name]),
                rtol=1e-3,
                atol=1e-5,
            )


def test_resume_is_exact_and_the_ledger_reports_the_epsilon_of_sigma(tmp_path):
    reference = engine.fit(new_trainer(), DATA, rng=np.random.default_rng(7))
    first = engine.fit(
        new_trainer(), DATA, rng=np.random.default_rng(7), checkpointer=Checkpointer(tmp_path),
        until=3,
    )  # fmt: skip
    assert first.ledger.count == 3
    resumed = engine.fit(
        new_trainer(), DATA, rng=np.random.default_rng(999), checkpointer=Checkpointer(tmp_path)
    )
    for name, value in reference.state.params.items():
        assert np.asarray(value).tobytes() == np.asarray(resumed.state.params[name]).tobytes()
    ref_clip = current_clip_norm(reference.state.opt_state)
    assert ref_clip.dtype == jnp.float32
    assert (
        np.asarray(ref_clip).tobytes()
        == np.asarray(current_clip_norm(resumed.state.opt_state)).tobytes()
    )
    assert float(ref_clip) != 5.0
    # ε: the plain DP-SGD event with the run's σ, from dp_accounting directly.
    want = accounting.epsilon(
        accounting.dpsgd_event(noise_multiplier=1.2, sampling_rate=16 / 80, steps=6), delta=1e-5
    )
    assert resumed.ledger.epsilon(1e-5) == pytest.approx(want, rel=1e-9)
    assert reference.ledger.epsilon(1e-5) == pytest.approx(want, rel=1e-9)


# ---------------------------------------------------------------------------------------------
# One-run audit with dirac gradient canaries.
# ---------------------------------------------------------------------------------------------

AUDIT_DIM, AUDIT_CANARIES, AUDIT_ORDINARY = 6, 1000, 1000
CANARY_GRADIENT = 1e3  # the canary's gradient norm: clipped to C_t at every step


class CanaryModel(nnx.Module):
    """Logistic regression on AUDIT_DIM features plus one weight per canary."""

    def __init__(self):
        self.w = nnx.Param(jnp.zeros(AUDIT_DIM + AUDIT_CANARIES, jnp.float32))
        self.b = nnx.Param(jnp.zeros((), jnp.float32))


def canary_loss(model, batch):
    """Ordinary rows: logistic loss. Canary j: gradient -CANARY_GRADIENT·e_j on its weight."""
    logits = batch["x"] @ model.w[:AUDIT_DIM] + model.b
    ordinary = optax.sigmoid_binary_cross_entropy(logits, batch["y"])
    canary = -CANARY_GRADIENT * model.w[AUDIT_DIM + batch["coord"]]
    return jnp.where(batch["is_canary"], canary, ordinary)


def _audit_run(noise_multiplier, included, seed):
    rng = np.random.default_rng(seed)
    coords = np.flatnonzero(included)
    n = AUDIT_ORDINARY + len(coords)
    x = np.zeros((n, AUDIT_DIM), np.float32)
    x[:AUDIT_ORDINARY] = rng.normal(size=(AUDIT_ORDINARY, AUDIT_DIM))
    data = {
        "x": x,
        "y": (rng.random(n) < 0.5).astype(np.float32),
        "is_canary": np.arange(n) >= AUDIT_ORDINARY,
        "coord": np.concatenate([np.zeros(AUDIT_ORDINARY, np.int32), coords.astype(np.int32)]),
    }

    def gather_rows(idx):
        rows = np.maximum(idx, 0)
        return {k: v[rows] for k, v in data.items()}

    config = TrainConfig(
        steps=40, batch_size=300, learning_rate=1.0, optimizer="sgd", private=True,
        clip_norm=1.0, delta=1e-5, noise_multiplier=noise_multiplier, pad_multiple=64,
        clipping="vmap", progress=False, log_every=None, allow_large_delta=True,
        adaptive_clipping=AdaptiveClipping(target_quantile=0.5, learning_rate=0.2),
    )  # fmt: skip
    trainer = engine.Trainer(
        config, CanaryModel(), canary_loss, num_units=n, noise_key=jax.random.key(seed)
    )
    result = engine.fit(
        trainer, engine.IndexedData(gather=gather_rows, num_examples=n),
        rng=np.random.default_rng(seed + 1),
    )  # fmt: skip
    scores = np.asarray(result.model.w.value[AUDIT_DIM:], np.float64)
    final_clip = float(current_clip_norm(result.state.opt_state))
    return scores, result.ledger.epsilon(1e-5), final_clip


def test_one_run_audit_of_a_private_run_with_adaptive_clipping():
    included = np.random.default_rng(11).random(AUDIT_CANARIES) < 0.5
    scores, claimed, final_clip = _audit_run(2.5, included, seed=5)
    assert final_clip != 1.0  # the clip norm adapted during the audited run
    bound = audit.one_run_epsilon_lower_bound(scores, included, delta=1e-5)
    assert bound.epsilon < claimed, (bound.epsilon, claimed)
    # The control: the same run without noise must be caught (a broken mechanism would look
    # like it), so the audit can detect a claim that is too small.
    control_scores, control_claim, _ = _audit_run(0.0, included, seed=5)
    assert control_claim == math.inf
    control = audit.one_run_epsilon_lower_bound(control_scores, included, delta=1e-5)
    assert control.epsilon > claimed, (control.epsilon, claimed)


# ---------------------------------------------------------------------------------------------
# DP-MixMin.
# ---------------------------------------------------------------------------------------------


def _mixmin_preds():
    rng = np.random.default_rng(0)
    return rng.uniform(0.05, 0.95, size=(3000, 4)).astype(np.float32)


@pytest.mark.parametrize("solver", ["mirror_descent", "frank_wolfe"])
def test_dp_mixmin_with_adaptive_clipping_tracks_the_quantile_at_the_same_epsilon(solver):
    from dpmix_jax.mixing import dp_mixmin, solvers

    preds = _mixmin_preds()
    kw = dict(
        epsilon=2.0, delta=1e-5, steps=60, batch_size=300, seed=0, solver=solver,
        learning_rate=0.5 if solver == "mirror_descent" else None,
    )  # fmt: skip
    adaptive = AdaptiveClipping(target_quantile=0.5, learning_rate=0.3)
    fixed = dp_mixmin(preds, clip_norm=100.0, **kw)
    result = dp_mixmin(preds, clip_norm=100.0, adaptive_clipping=adaptive, **kw)
    assert fixed.clip_norms is None and result.clip_norms.shape == (60,)
    assert result.epsilon == fixed.epsilon <= 2.0
    assert result.noise_multiplier == fixed.noise_multiplier
    assert np.all(np.isfinite(result.weights)) and result.weights.sum() == pytest.approx(1.0)
    # Started 100x above the norms, C_t falls to their median at the final iterates' λ.
    examples = solvers.objectives.prepare_examples(preds, kind="nll")
    loss = solvers.shifted_example_loss("nll", solvers.DEFAULT_SHIFT)
    norms = np.asarray(
        jax.vmap(lambda ex: clipping.norm_upper_bound(jax.grad(loss)(result.history[-2], ex)))(
            examples
        )
    )
    final = result.clip_norms[-1]
    assert final < 10.0
    assert np.mean(norms <= final) == pytest.approx(0.5, abs=0.2)


def test_the_solver_noises_the_sum_with_split_noise_multiplier(monkeypatch):
    # The jitted solver core takes its σ_Δ from `split_noise_multiplier`, traced σ and all:
    # every draw's stddev is σ_Δ·C_t for the σ_b of `count_stddev`.
    from dpmix_jax.mixing import solvers
    from dpmix_jax.privacy import gaussian_noise

    stddevs, clip_norms = [], []
    draw = gaussian_noise.gaussian_noise_tree

    def recording(key, like, stddev):
        stddevs.append(float(stddev))
        return draw(key, like, stddev)

    monkeypatch.setattr(gaussian_noise, "gaussian_noise_tree", recording)
    examples = solvers.objectives.prepare_examples(_mixmin_preds()[:64], kind="nll")
    steps, sigma, batch, clip = 3, 1.3, 16.0, 2.0
    batches = jnp.arange(steps * 16).reshape(steps, 16) % 64
    adaptive = AdaptiveClipping(target_quantile=0.5, learning_rate=0.3)
    with jax.disable_jit():
        trace = solvers._run_private(
            jnp.zeros(4), lambda state, noisy, t: state - 0.1 * noisy, jax.nn.softmax,
            examples, batches, jnp.ones((steps, 16), bool), jax.random.key(1), kind="nll",
            clip_norm=clip, noise_multiplier=jnp.float32(sigma), shift=solvers.DEFAULT_SHIFT,
            strategy=(1.0,), adaptive_clipping=adaptive, expected_batch_size=batch,
        )  # fmt: skip
    clip_norms = [clip, *np.asarray(trace.clip_norms)[:-1]]
    sigma_delta = split_noise_multiplier(sigma, adaptive.count_stddev(batch, sigma))
    np.testing.assert_allclose(stddevs, sigma_delta * np.asarray(clip_norms), rtol=1e-6)


def test_dp_mixmin_refuses_count_noise_below_half_sigma():
    from dpmix_jax.mixing import dp_mixmin

    with pytest.raises(ValueError, match="count_noise_stddev"):
        dp_mixmin(
            _mixmin_preds(), epsilon=0.5, delta=1e-5, steps=60, batch_size=300, clip_norm=1.0,
            learning_rate=0.5, seed=0, adaptive_clipping=AdaptiveClipping(count_noise_stddev=0.1),
        )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Command line.
# ---------------------------------------------------------------------------------------------


def test_demo_flags_reach_the_fine_tuning_and_mixture_stages():
    from dpmix_jax import cli
    from dpmix_jax.cli import demo

    for dataset in ("image", "text"):
        args = cli.build_parser().parse_args(
            ["demo", dataset, "--adaptive-clipping", "--target-quantile", "0.7"]
        )
        config = demo.demo_config(args)
        assert config.finetune.adaptive_clipping == AdaptiveClipping(target_quantile=0.7)
        assert config.mixture.adaptive_clipping == AdaptiveClipping(target_quantile=0.7)
        plain = demo.demo_config(cli.build_parser().parse_args(["demo", dataset]))
        assert plain.finetune.adaptive_clipping is None is plain.mixture.adaptive_clipping
    with pytest.raises(ValueError, match="--adaptive-clipping"):
        demo.demo_config(cli.build_parser().parse_args(["demo", "--target-quantile", "0.7"]))
    with pytest.raises(ValueError, match="target_quantile"):
        demo.demo_config(
            cli.build_parser().parse_args(["demo", "--adaptive-clipping", "--target-quantile", "2"])
        )
