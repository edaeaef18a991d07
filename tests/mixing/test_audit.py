"""Tests of the λ audit: the canaries against the DP-MixMin solver's own gradients and clipping,
the vmapped trials against `dp_mixmin` itself, and the audit's verdicts (no violation at ε = 1,
clear leakage without noise)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.mixing import audit as mixmin_audit
from dpmix_jax.mixing import dp_mixmin, prepare_examples
from dpmix_jax.mixing.solvers import SHIFTS, shifted_example_loss
from dpmix_jax.privacy import audit, audit_runs, clipping
from experiments import audit as runner
from experiments.configs.audit import get_config


@pytest.mark.parametrize("shift", SHIFTS)
def test_max_clip_canary_clipped_gradient_has_norm_c_towards_top_source(shift):
    rng = np.random.default_rng(0)
    k, clip_norm = 6, 1.5
    for _ in range(5):
        weights = rng.dirichlet(np.ones(k))
        row = audit.max_clip_nll_canary(weights, clip_norm=clip_norm)
        source = int(np.argmax(weights))
        np.testing.assert_array_equal(row, np.eye(k)[source])
        example = jax.tree.map(lambda x: x[0], prepare_examples(row[None]))
        grad = jax.grad(shifted_example_loss("nll", shift))(
            jnp.asarray(weights, jnp.float32), example
        )
        clipped, norm = clipping.clip_to_norm(grad, clip_norm, jnp.array(True))
        assert float(norm) >= clip_norm
        assert float(jnp.linalg.norm(clipped)) == pytest.approx(clip_norm, rel=1e-5)
        # Its action on the centred logits is C times the unit vector towards the vertex.
        vertex = (np.eye(k)[source] - 1 / k) / np.sqrt(1 - 1 / k)
        np.testing.assert_allclose(audit.logit_direction(np.asarray(grad)), vertex, atol=1e-5)


def test_max_clip_canary_rejects_unreachable_clip_norm():
    weights = np.array([0.9, 0.05, 0.05])
    with pytest.raises(ValueError, match="clip_norm"):
        audit.max_clip_nll_canary(weights, clip_norm=1.0)  # sqrt(2/3) / 0.9 < 1
    with pytest.raises(ValueError, match="sum to 1"):
        audit.max_clip_nll_canary(np.array([0.5, 0.6]), clip_norm=0.1)


def test_logit_score_measures_push_along_direction():
    direction = audit.logit_direction(np.array([-2.0, 0.0, 0.0]))
    np.testing.assert_allclose(direction, np.array([2.0, -1.0, -1.0]) / np.sqrt(6))
    logits = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 3.0, 0.0]])
    weights = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    scores = audit.logit_score(weights, direction)
    centred = logits - logits.mean(1, keepdims=True)
    np.testing.assert_allclose(scores, centred @ direction, atol=1e-12)
    assert scores[1] > scores[0] > scores[2]
    with pytest.raises(ValueError, match="constant"):
        audit.logit_direction(np.ones(3))


def test_natural_canary_is_a_seeded_row_index():
    picks = {audit.natural_canary(50, seed=s) for s in range(200)}
    assert picks <= set(range(50)) and len(picks) > 40
    assert audit.natural_canary(50, seed=7) == audit.natural_canary(50, seed=7)


def test_vmapped_trials_are_dp_mixmin_runs_and_without_world_ignores_canary():
    settings = dataclasses.replace(
        get_config("cpu").mixmin, steps=20, sensitive_size=600, batch_size=30
    )  # 61 units, q < 1
    preds = runner.synthetic_proxy_outputs(settings.mixture_size, 5, seed=0)
    canaries, _ = mixmin_audit.lambda_canaries(preds, clip_norm=settings.clip_norm, seed=0)
    canary = canaries[1]
    seeds = np.array([3, 11, 12345])
    kwargs = dict(
        delta=1e-5,
        steps=settings.steps,
        batch_size=settings.batch_size,
        clip_norm=settings.clip_norm,
        learning_rate=settings.learning_rate,
        noise_multiplier=0.7,
    )
    reference = [dp_mixmin(canary.preds, seed=int(s), **kwargs) for s in seeds]
    common = dict(
        steps=settings.steps,
        learning_rate=settings.learning_rate,
        clip_norm=settings.clip_norm,
        shift=settings.shift,
        noise_multiplier=0.7,
        rate=reference[0].sampling_rate,
        expected_batch_size=reference[0].expected_batch_size,
        seeds=seeds,
        chunk=2,
    )
    scores, weights = mixmin_audit.lambda_scores(canary, present=True, **common)
    np.testing.assert_allclose(weights, np.stack([r.weights for r in reference]), atol=1e-5)
    np.testing.assert_allclose(scores, audit.logit_score(weights, canary.direction))
    # Without the canary the result cannot depend on the canary's row.
    _, without = mixmin_audit.lambda_scores(canary, present=False, **common)
    changed = dataclasses.replace(canary, preds=np.vstack([preds, np.full(5, 0.3)]))
    _, without_changed = mixmin_audit.lambda_scores(changed, present=False, **common)
    np.testing.assert_array_equal(without, without_changed)
    assert np.abs(without - weights).max() > 1e-4


def test_known_batches_share_other_units_and_randomise_only_the_canary():
    seeds = np.arange(200)
    kwargs = dict(rate=0.3, num_units=50, steps=7, canary=49, known_batches_seed=5)
    with_idx, with_mask = audit_runs.sample_trial_batches(seeds, present=True, **kwargs)
    without_idx, without_mask = audit_runs.sample_trial_batches(seeds, present=False, **kwargs)
    others = np.where(with_mask[..., :-1], with_idx[..., :-1], -1)
    assert np.all(others == others[0]) and not np.any(others == 49)
    np.testing.assert_array_equal(without_idx[..., :-1], with_idx[..., :-1])
    assert not np.any(without_mask[..., -1]) and not np.any(without_idx == 49)
    inclusion = with_mask[..., -1]
    assert np.all(with_idx[..., -1][inclusion] == 49)
    assert abs(inclusion.mean() - 0.3) < 0.05  # Bernoulli(q) per trial and step


@pytest.mark.parametrize(
    ("known_batches", "steps", "leakage"),
    [(False, 300, 2.5), (True, 50, 3.5)],
)
def test_lambda_audit_no_violation_with_noise_and_leakage_without(known_batches, steps, leakage):
    config = get_config("cpu")
    config = dataclasses.replace(
        config,
        trials=300,
        chunk=300,
        known_batches=known_batches,
        mixmin=dataclasses.replace(config.mixmin, num_tasks=1, steps=steps),
    )
    (row,) = runner.audit_lambda(config)
    assert row["accounted_epsilon"] <= 1.0
    for canary in ("natural", "max_clip"):
        assert 0.0 <= row[canary] <= row["accounted_epsilon"]
    assert row["max_clip_reach"] > 0.9
    # 150 held-out trials per world certify at most ln(1 / (1 - 0.025^(1/150))) ≈ 3.7.
    assert row["no_noise_max_clip"] > leakage
