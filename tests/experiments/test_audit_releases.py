"""Tests of the release audits: the white-box transcript is the claimed Gaussian mechanism,
and every audit (one-run DP-SGD at example and user level, the canary user, the end-to-end
pipeline over many runs and in one run, the Hot PATE aggregators, tightness) stays below its
claim with noise while its no-noise control exceeds it."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

from dpmix_jax.privacy import assign_parts, audit_runs
from experiments import audit_releases as releases
from experiments.configs.audit import ReleaseAuditConfig, get_config


def small_config(trials=120, **release):
    config = get_config("cpu")
    defaults = dict(
        tight_epsilons=(4.0,),
        tight_pilot=200_000,
        tight_control_trials=3000,
        tight_trials=10000,
        chunk=12000,
        one_run_canaries=200,
        one_run_steps=40,
        user_steps=10,
        pate_trials=3000,
        pate_queries=400,
        pipeline_units=300,
        pipeline_mix_steps=40,
        pipeline_ft_steps=20,
        pipeline_chunk=trials,
    )
    defaults.update(release)
    return dataclasses.replace(
        config,
        trials=trials,
        chunk=trials,
        releases=dataclasses.replace(config.releases, **defaults),
    )


def test_transcript_llr_is_the_gaussian_mixture_likelihood_ratio():
    rng = np.random.default_rng(0)
    y, q, sigma = rng.normal(0.3, 2.0, (50, 3)), 0.3, 1.7
    direct = np.log(
        (1 - q) * stats.norm.pdf(y, 0, sigma) + q * stats.norm.pdf(y, 1, sigma)
    ) - np.log(stats.norm.pdf(y, 0, sigma))
    np.testing.assert_allclose(
        audit_runs.transcript_llr(y, rate=q, noise_multiplier=sigma), direct.sum(1), rtol=1e-9
    )


@pytest.mark.parametrize("name", list(releases.TRANSCRIPTS))
def test_transcripts_are_the_claimed_subsampled_gaussian(name):
    release = ReleaseAuditConfig(chunk=4000)
    transcripts, rng = releases.TRANSCRIPTS[name], np.random.default_rng(1)
    sigma, batch, trials = 2.5, release.tight_rate * release.tight_units, 8000
    present = np.arange(trials) < trials // 2
    seeds = np.arange(trials, dtype=np.uint32)
    y = transcripts(release, sigma, batch, present, seeds, rng)
    assert y.shape == (trials, release.tight_steps)
    with_, without = y[present].ravel(), y[~present].ravel()
    # Without the canary: N(0, σ²) (KS test); with it: mean q, variance σ² + q(1 - q).
    assert stats.kstest(without / sigma, "norm").pvalue > 1e-3
    assert abs(with_.mean() - release.tight_rate) < 4 * sigma / np.sqrt(len(with_))
    assert np.std(without) == pytest.approx(sigma, rel=0.03)
    # Without noise the transcript is exactly the canary's Bernoulli(q) inclusions.
    exact = transcripts(release, 0.0, batch, present, seeds, rng)
    np.testing.assert_allclose(exact[~present], 0.0, atol=1e-4)
    assert np.all(
        np.isclose(exact[present], 0.0, atol=1e-3) | np.isclose(exact[present], 1.0, 1e-3)
    )
    assert abs(exact[present].mean() - release.tight_rate) < 0.03


@pytest.mark.slow
def test_tightness_bounds_stay_below_claims_and_controls_exceed_them():
    rows = releases.tightness(small_config())
    assert {r["release"] for r in rows} == set(releases.TRANSCRIPTS)
    for row in rows:
        assert 0 <= row["epsilon_lb"] <= row["claimed_epsilon"]
        assert row["no_noise_epsilon_lb"] > 4.5 > row["claimed_epsilon"]
    assert max(r["ratio"] for r in rows) > 0.2


@pytest.mark.slow
def test_tightness_reaches_half_the_claim_at_preset_size():
    rows = releases.tightness(get_config("cpu"))
    for row in rows:
        assert 0.5 <= row["ratio"] <= 1.0, row


@pytest.mark.parametrize("user_level", [False, True])
def test_one_run_dpsgd_below_claim_and_control_above(user_level):
    row = releases.dpsgd_one_run(small_config(), user_level=user_level)
    assert row["claimed_epsilon"] <= 1.0
    for method in ("steinke", "fdp"):
        assert 0 <= row[f"one_run_{method}"] <= row["claimed_epsilon"]
        assert row[f"no_noise_one_run_{method}"] > 2.0


def test_canary_user_many_runs_below_claim_and_control_above():
    row = releases.dpsgd_user_level(small_config())
    assert 0 <= row["many_runs"] <= row["claimed_epsilon"] <= 1.0
    assert row["no_noise_many_runs"] > 2.0


@pytest.mark.slow
def test_pate_aggregators_below_claim_and_controls_above():
    rows = releases.pate(small_config())
    assert len(rows) == 3
    for row in rows:
        assert row["claimed_epsilon"] == pytest.approx(1.0, abs=1e-3)
        assert 0 <= row["many_runs"] <= row["claimed_epsilon"]
        assert 0 <= row["one_run_steinke"] <= row["claimed_epsilon"]
        assert row["no_noise_many_runs"] > 4.0
        assert row["no_noise_one_run_steinke"] > row["claimed_epsilon"]


@pytest.mark.slow
def test_pipeline_canaries_land_in_their_parts_and_audit_holds():
    config = small_config()
    setup = releases.pipeline_setup(config.releases, config.seed)
    fractions = (config.releases.pipeline_mix_fraction, 1 - config.releases.pipeline_mix_fraction)
    ids = [setup["mix_canary_id"], setup["ft_canary_id"]]
    np.testing.assert_array_equal(assign_parts(ids, fractions, key=config.seed), [0, 1])
    row = releases.pipeline(config)
    assert row["claimed_epsilon"] <= 1.0
    for canary in ("mix", "ft"):
        assert 0 <= row[canary] <= row["claimed_epsilon"]
        assert row[f"no_noise_{canary}"] > 2.0


def test_pipeline_one_run_canaries_in_d_ft_below_claim_and_control_above():
    config = small_config()
    release = config.releases
    ids = releases.pipeline_setup(release, config.seed)["one_run_canary_ids"]
    assert len(set(ids)) == len(ids) == release.one_run_canaries
    assert ids.min() >= release.pipeline_units
    fractions = (release.pipeline_mix_fraction, 1 - release.pipeline_mix_fraction)
    np.testing.assert_array_equal(assign_parts(ids, fractions, key=config.seed), 1)
    row = releases.pipeline_one_run(config)
    assert row["claimed_epsilon"] <= 1.0
    for method in ("steinke", "fdp"):
        assert 0 <= row[f"one_run_{method}"] <= row["claimed_epsilon"]
        assert row[f"no_noise_one_run_{method}"] > 2.0 > row["claimed_epsilon"]


def test_release_config_rejects_bad_settings():
    with pytest.raises(ValueError, match="tight_rate"):
        ReleaseAuditConfig(tight_rate=0.0)
    with pytest.raises(ValueError, match="pipeline_mix_fraction"):
        ReleaseAuditConfig(pipeline_mix_fraction=1.0)
    with pytest.raises(ValueError, match="one_run_canaries"):
        ReleaseAuditConfig(one_run_canaries=1)


def test_ghost_cancelling_canaries_add_at_most_c_and_one_run_audit_holds():
    # Numerical canaries: two positions whose gradients (norm 1e4·C) cancel to 3·C. The ghost
    # path's certified norm bound must keep each one's contribution <= C (a float32 Gram-form
    # norm let about half of them add more, up to 3·C), and the one-run audit of the ghost path
    # must stay below the claim while its no-noise control finds the canaries.
    config = small_config(ghost_examples=200, ghost_batch_size=48)
    release = config.releases
    n, m = release.ghost_examples, release.one_run_canaries
    data, directions = releases.cancelling_canary_data(
        n, m, d_in=8, block=8, clip_norm=release.clip_norm, seed=5
    )
    exact = np.linalg.norm(
        np.einsum("bti,btj->bij", data["x"][n:].astype(np.float64), data["v"][n:]), axis=(1, 2)
    )
    np.testing.assert_allclose(exact, 3.0 * release.clip_norm, rtol=1e-3)
    grad_sum = releases.ghost_clipped_grad_sum(releases.taped_dense_loss, clip_norm=1.0)
    params = {"w": np.zeros((8, 8 * (m + 1)), np.float32)}
    alone = audit_runs.canary_contributions(grad_sum, params, data, range(n, n + 20))
    assert np.all(alone <= release.clip_norm * (1 + 1e-6)), alone.max()
    assert np.all(alone >= 0.5 * release.clip_norm), alone.min()  # clipped, not dropped

    row = releases.ghost_cancelling_one_run(config)
    assert row["max_canary_contribution"] <= 1 + 1e-6
    assert row["claimed_epsilon"] <= 1.0
    for method in ("steinke", "fdp"):
        assert 0 <= row[f"one_run_{method}"] <= row["claimed_epsilon"]
        assert row[f"no_noise_one_run_{method}"] > 2.0 > row["claimed_epsilon"]


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("experiments.audit_releases", "experiments.audit"),  # no cycle between the two
        ("dpmix_jax.mixing.audit", "experiments"),  # the library needs no experiment
        ("dpmix_jax.privacy.audit_runs", "dpmix_jax.mixing"),  # nor privacy/ the layers above
    ],
)
def test_audit_modules_import_without_what_they_must_not_need(module, absent):
    code = (
        f"import sys, {module}; "
        f"assert not [m for m in sys.modules if m.split('.')[:{absent.count('.') + 1}] == "
        f"{absent.split('.')!r}], sorted(sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
