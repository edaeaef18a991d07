"""Canary audits of every release, in one run and over many, and the white-box tightness check.

Every audit runs the library's own mechanism (DP-SGD from `privacy.noise`/`privacy.clipping`,
DP-MixMin's `run_mirror_descent`, the Hot PATE aggregators) and compares ε lower bounds with the
accountant's ε for what ran. Each has a no-noise control (σ = 0, or the aggregator's noise scale
shrunk to ~0) scored the same way, whose bound must exceed the private run's claim: proof that
the audit would catch a mechanism that leaks more than it claims.

- `tightness`: a white-box adversary sees every noisy step (the λ iterates of DP-MixMin, the
  parameters after each DP-SGD step) of a run on the worst-case neighbouring pair: a dirac
  canary whose clipped gradient is C along one direction that no other unit's gradient touches.
  Projected on that direction, the transcript is y_t = b_t + N(0, σ²), b_t ~ Bernoulli(q) with
  the canary and 0 without: the Poisson-subsampled Gaussian mechanism the accountant analyses,
  in its worst case. The likelihood-ratio statistic Σ_t log(1 - q + q·exp((2y_t - 1) / 2σ²))
  is the optimal test; its threshold is chosen on draws of the claimed mechanism and evaluated
  once on the implementation's runs (`epsilon_lower_bound_at`). ε_LB / ε near 1 means the code
  spends no more noise than it claims and the accountant is tight.
- `dpsgd_one_run`: m dirac canaries (each on its own otherwise-unused coordinate of a logistic
  regression on digits), each inserted with probability 1/2 into ONE DP-SGD run, example level
  (canary examples) or user level (canary users of G examples each); scored by their
  coordinate, bounded by `one_run_epsilon_lower_bound` (Steinke et al. and f-DP).
- `dpsgd_user_level`: one canary user with G dirac examples, many runs, user-level sampling.
- `ghost_cancelling_one_run`: the default (ghost-clipping) path in ONE DP-SGD run of a taped
  dense layer with m numerical canaries (`audit.cancelling_canary`: two positions whose
  gradients of norm 1e4·C cancel to 3·C, lost in rounding by a float32 Gram-form norm), each on
  its own output coordinates and present with probability 1/2, scored by the projection of the
  released change on its gradient's direction; also reports the largest norm a canary alone
  adds to the clipped sum (<= C when the norm bound is certified).
- `pipeline`: the end-to-end DP-MixMin pipeline at small scale (keyed split of digits units,
  DP-MixMin over k public proxy models, the λ-mixed model DP-fine-tuned on D_ft), with one
  canary unit landing in D_mix (scored on λ) and one in D_ft (scored on the model), many runs
  each; `pipeline_one_run`: m dirac canary units that the split sends to D_ft, each present
  with probability 1/2 in ONE pipeline run, scored on the fine-tuned model.
- `pate`: each aggregator run many times on two neighbouring vote histograms (one teacher's
  vote moved), and once over m queries with a canary teacher per query for the one-run bound.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

from dpmix_jax.mixing import audit as mixmin_audit
from dpmix_jax.mixing import mixmin, prepare_examples
from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pate import aggregators
from dpmix_jax.privacy import audit, audit_runs, plan
from dpmix_jax.privacy.ghost import ghost_clipped_grad_sum
from experiments.configs.audit import AuditConfig, DpSgdAuditConfig, ReleaseAuditConfig

# --------------------------------------------------------------------------------------------
# Shared.
# --------------------------------------------------------------------------------------------


def digits_task() -> tuple[np.ndarray, np.ndarray]:
    """The audits' task: scikit-learn's digits, 1797 inputs in [0, 1]^64, label 1 for digits
    >= 5 (also the DP-SGD audit's of `experiments.audit`)."""
    digits = load_digits()
    return (digits.data / 16.0).astype(np.float32), (digits.target >= 5).astype(np.float32)


def _sgd_settings(release, steps: int, batch: float, learning_rate: float) -> DpSgdAuditConfig:
    return DpSgdAuditConfig(
        epsilons=(release.epsilon,),
        delta=release.delta,
        steps=steps,
        batch_size=batch,
        clip_norm=release.clip_norm,
        learning_rate=learning_rate,
        canary_scale=1.0,
    )


def _plan(epsilon, delta, clip_norm, batch, steps, units, max_examples_per_user=None):
    return plan.plan_dp_sgd(
        plan.DpSgdConfig(
            epsilon=epsilon,
            delta=delta,
            clip_norm=clip_norm,
            batch_size=batch,
            steps=steps,
            max_examples_per_user=max_examples_per_user,
        ),
        num_units=units,
    )


def dirac_loss(clip_norm: float, offset: int):
    """Logistic loss; an example flagged `is_canary` has gradient -C·e at w[offset + coord]."""

    def loss(params, example):
        canary = -clip_norm * params["w"][offset + example["coord"]]
        return jnp.where(example["is_canary"], canary, audit_runs.logistic_loss(params, example))

    return loss


# --------------------------------------------------------------------------------------------
# Tightness: the full transcript of the worst-case pair.
# --------------------------------------------------------------------------------------------


def _dpsgd_transcripts(release, noise_multiplier, expected_batch, present, seeds, rng):
    """y_t `(trials, T)` of DP-SGD runs (`present[i]`: trial i has the canary): ordinary
    examples with a zero feature, and a dirac canary on it."""
    units, steps, rate = release.tight_units, release.tight_steps, release.tight_rate
    x = np.zeros((units, 3), np.float32)
    x[:, :2] = np.random.default_rng(0).normal(size=(units, 2))
    data = {
        "x": x,
        "y": (np.arange(units) % 2).astype(np.float32),
        "is_canary": np.arange(units) == units - 1,
        "coord": np.zeros(units, np.int32),
    }
    settings = _sgd_settings(release, steps, expected_batch, release.tight_learning_rate)
    run = audit_runs.dpsgd_trials(
        dirac_loss(release.clip_norm, offset=2),
        clip_norm=settings.clip_norm,
        learning_rate=settings.learning_rate,
        noise_multiplier=noise_multiplier,
        expected_batch_size=expected_batch,
    )
    params0 = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    out, start = [], 0
    for part in audit_runs.seed_chunks(seeds, release.chunk):
        masks = audit_runs.poisson_masks(rng, len(part), steps, units, rate)
        masks[..., -1] &= present[start : start + len(part), None]
        start += len(part)
        batches = np.broadcast_to(np.arange(units, dtype=np.int32), masks.shape)
        history = run(jax.tree.map(jnp.asarray, data), params0, batches, masks, jnp.asarray(part))
        coordinate = np.concatenate([np.zeros((len(part), 1)), np.asarray(history["w"][..., 2])], 1)
        out.append(np.diff(coordinate, axis=1) * expected_batch / settings.learning_rate)
    return np.concatenate(out) / release.clip_norm


def _mixmin_transcripts(release, noise_multiplier, expected_batch, present, seeds, rng):
    """y_t of DP-MixMin runs: neutral rows (equal proxy outputs: zero shifted gradient) and a
    max-clip canary, read off the released iterates' centred log-weights."""
    units, steps, rate, k = release.tight_units, release.tight_steps, release.tight_rate, 4
    canary = audit.max_clip_nll_canary(np.full(k, 1 / k), clip_norm=release.clip_norm)
    preds = np.vstack([np.full((units - 1, k), 0.5), canary])
    direction = audit.logit_direction(-canary * k)
    examples = prepare_examples(preds)
    out, start = [], 0
    for part in audit_runs.seed_chunks(seeds, release.chunk):
        masks = audit_runs.poisson_masks(rng, len(part), steps, units, rate)
        masks[..., -1] &= present[start : start + len(part), None]
        start += len(part)
        batches = np.broadcast_to(np.arange(units, dtype=np.int32), masks.shape)
        trace = mixmin_audit.mixmin_trials(
            examples,
            jnp.asarray(batches),
            jnp.asarray(masks),
            jnp.asarray(part, dtype=jnp.uint32),
            noise_multiplier,
            expected_batch,
            release.tight_learning_rate,
            clip_norm=release.clip_norm,
            shift="mean",
        )
        history = np.concatenate(
            [np.full((len(part), 1, k), 1 / k), np.asarray(trace.history, np.float64)], axis=1
        )
        scores = audit.logit_score(history, direction)
        out.append(np.diff(scores, axis=1) * expected_batch / release.tight_learning_rate)
    return np.concatenate(out) / release.clip_norm


TRANSCRIPTS = {"DP-SGD": _dpsgd_transcripts, "DP-MixMin λ": _mixmin_transcripts}


def tightness(config: AuditConfig) -> list[dict]:
    """ε_LB of the white-box transcript audit and its ratio to the claimed ε, per mechanism.

    The test (threshold on the likelihood ratio) is chosen on `tight_pilot` draws per world of
    the *claimed* mechanism (numpy, independent of the runs) and evaluated once on
    `tight_trials` runs per world of the implementation. The no-noise control runs the
    implementation with σ = 0 (`tight_control_trials` per world, `epsilon_lower_bound`).
    """
    release = config.releases
    rng = np.random.default_rng(config.seed + 7)
    rows = []
    for name, transcripts in TRANSCRIPTS.items():
        for eps in release.tight_epsilons:
            units, rate, steps = release.tight_units, release.tight_rate, release.tight_steps
            dp_plan = _plan(eps, release.delta, release.clip_norm, rate * units, steps, units)
            sigma, batch = dp_plan.noise_multiplier, dp_plan.expected_batch_size
            row = {"release": name, "claimed_epsilon": dp_plan.spent().epsilon, "sigma": sigma}
            for label, noise in (("", sigma), ("no_noise_", 0.0)):
                trials = release.tight_trials if noise else release.tight_control_trials
                present = np.arange(2 * trials) < trials  # the first half has the canary
                seeds = rng.integers(2**31 - 1, size=2 * trials).astype(np.uint32)
                y = transcripts(release, noise, batch, present, seeds, rng)
                llr = audit_runs.transcript_llr(y, rate=rate, noise_multiplier=sigma)
                runs = (llr[:trials], llr[trials:])
                if noise:
                    claimed = audit_runs.claimed_transcripts(
                        rng, release.tight_pilot, steps, rate=rate, noise_multiplier=sigma
                    )
                    pilot = tuple(
                        audit_runs.transcript_llr(c, rate=rate, noise_multiplier=sigma)
                        for c in claimed
                    )
                    bound = audit_runs.pilot_then_bound(
                        pilot, runs, release.delta, config.confidence
                    )
                else:
                    bound = audit.epsilon_lower_bound(*runs, delta=release.delta)
                row[f"{label}epsilon_lb"] = bound.epsilon
            row["ratio"] = row["epsilon_lb"] / row["claimed_epsilon"]
            rows.append(row)
    return rows


# --------------------------------------------------------------------------------------------
# DP-SGD: one run with m canaries (example and user level), and a canary user over many runs.
# --------------------------------------------------------------------------------------------


def _with_canaries(x: np.ndarray, y: np.ndarray, num_canaries: int, examples_per_canary: int):
    """Features `x` padded with one zero column per canary; canary rows (G per canary) appended
    and flagged, with their coordinate. Real examples form users of G consecutive rows.
    Returns (data, user id per row, real rows, real features)."""
    n, dim = x.shape
    rows = num_canaries * examples_per_canary
    data = {
        "x": np.zeros((n + rows, dim + num_canaries), np.float32),
        "y": np.append(y, np.zeros(rows, np.float32)),
        "is_canary": np.arange(n + rows) >= n,
        "coord": np.append(
            np.zeros(n), np.repeat(np.arange(num_canaries), examples_per_canary)
        ).astype(np.int32),
    }
    data["x"][:n, :dim] = x
    users = np.append(
        np.arange(n) // examples_per_canary, n + np.arange(rows) // examples_per_canary
    )
    return data, users, n, dim


def _user_batches(users: np.ndarray, included_users: np.ndarray, masks_users: np.ndarray, group):
    """`(trials, T, U, G)` example indices and masks from per-user inclusion masks."""
    members = [np.flatnonzero(users == u)[:group] for u in np.unique(users)]
    table = np.full((len(members), group), -1, np.int32)
    for i, m in enumerate(members):
        table[i, : len(m)] = m
    masks = masks_users[..., None] & (table >= 0) & included_users[:, None]
    return np.broadcast_to(table, masks.shape), masks


def dpsgd_one_run(config: AuditConfig, *, user_level: bool) -> dict:
    """One DP-SGD run with m dirac canaries (or canary users of G examples) each present w.p.
    1/2; ε_LB from the one-run bounds, with noise and without."""
    release = config.releases
    rng = np.random.default_rng(config.seed + (11 if user_level else 13))
    group = release.examples_per_user if user_level else 1
    m = release.one_run_canaries
    data, users, n, dim = _with_canaries(*digits_task(), m, group)
    included = rng.random(m) < 0.5
    unit_ids = np.unique(users) if user_level else np.arange(len(users))
    unit_canary = unit_ids >= n if user_level else np.arange(len(users)) >= n
    present = np.ones(len(unit_ids), bool)
    present[np.flatnonzero(unit_canary)] = included
    num_units = int(present.sum())
    batch = release.one_run_batch_size
    dp_plan = _plan(
        release.epsilon,
        release.delta,
        release.clip_norm,
        batch,
        release.one_run_steps,
        num_units,
        group if user_level else None,
    )
    row = {
        "release": f"DP-SGD {'user' if user_level else 'example'} level",
        "claimed_epsilon": dp_plan.spent().epsilon,
        "canaries": m,
    }
    params0 = {"w": jnp.zeros(dim + m, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    settings = _sgd_settings(
        release, release.one_run_steps, dp_plan.expected_batch_size, release.learning_rate
    )
    for label, noise in (("", dp_plan.noise_multiplier), ("no_noise_", 0.0)):
        run = audit_runs.dpsgd_trials(
            dirac_loss(release.clip_norm, offset=dim),
            clip_norm=settings.clip_norm,
            learning_rate=settings.learning_rate,
            noise_multiplier=noise,
            expected_batch_size=dp_plan.expected_batch_size,
            user_level=user_level,
        )
        step_masks = audit_runs.poisson_masks(
            rng, 1, release.one_run_steps, len(unit_ids), dp_plan.sampling_rate
        )
        if user_level:
            batches, masks = _user_batches(users, present, step_masks, group)
        else:
            masks = step_masks & present
            batches = np.broadcast_to(np.arange(len(unit_ids), dtype=np.int32), masks.shape)
        seed = rng.integers(2**31 - 1, size=1).astype(np.uint32)
        history = run(jax.tree.map(jnp.asarray, data), params0, batches, masks, jnp.asarray(seed))
        scores = np.asarray(history["w"][0, -1, dim:], np.float64)
        for method in audit.ONE_RUN_METHODS:
            bound = audit.one_run_epsilon_lower_bound(
                scores, included, delta=release.delta, confidence=config.confidence, method=method
            )
            row[f"{label}one_run_{method}"] = bound.epsilon
    return row


def dpsgd_user_level(config: AuditConfig) -> dict:
    """One canary user (G dirac examples on one unused coordinate), many runs per world."""
    release = config.releases
    rng = np.random.default_rng(config.seed + 17)
    group = release.examples_per_user
    x, y = digits_task()
    limit = release.user_examples
    data, users, n, dim = _with_canaries(x[:limit], y[:limit], 1, group)
    unit_ids = np.unique(users)
    steps = release.user_steps
    dp_plan = _plan(
        release.epsilon,
        release.delta,
        release.clip_norm,
        release.user_batch_size,
        steps,
        len(unit_ids),
        group,
    )
    params0 = {"w": jnp.zeros(dim + 1, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    settings = _sgd_settings(release, steps, dp_plan.expected_batch_size, release.learning_rate)
    row = {"release": "DP-SGD user level", "claimed_epsilon": dp_plan.spent().epsilon}
    scores_by_world = {}
    for label, noise in (("", dp_plan.noise_multiplier), ("no_noise_", 0.0)):
        run = audit_runs.dpsgd_trials(
            dirac_loss(release.clip_norm, offset=dim),
            clip_norm=settings.clip_norm,
            learning_rate=settings.learning_rate,
            noise_multiplier=noise,
            expected_batch_size=dp_plan.expected_batch_size,
            user_level=True,
        )
        scores = {}
        for present in (True, False):
            worlds = np.ones(len(unit_ids), bool)
            worlds[-1] = present
            seeds = rng.integers(2**31 - 1, size=config.trials).astype(np.uint32)
            parts = []
            for part in audit_runs.seed_chunks(seeds, config.chunk):
                step_masks = audit_runs.poisson_masks(
                    rng, len(part), steps, len(unit_ids), dp_plan.sampling_rate
                )
                batches, masks = _user_batches(users, worlds, step_masks, group)
                history = run(
                    jax.tree.map(jnp.asarray, data), params0, batches, masks, jnp.asarray(part)
                )
                parts.append(np.asarray(history["w"][:, -1, dim], np.float64))
            scores[present] = np.concatenate(parts)
        scores_by_world[label] = scores
        bound = audit.epsilon_lower_bound(
            scores[True],
            scores[False],
            delta=release.delta,
            confidence=config.confidence,
            method=config.method,
            seed=config.seed,
        )
        row[f"{label}many_runs"] = bound.epsilon
    row["auroc"] = audit.auroc(scores_by_world[""][True], scores_by_world[""][False])
    return row


# --------------------------------------------------------------------------------------------
# The ghost-clipping path: one run with m cancelling (numerical) canaries.
# --------------------------------------------------------------------------------------------


def taped_dense_loss(params, batch, tape):
    """Σ_t <y_t, v_t> of a taped dense layer y_t = x_t W: example j's gradient is Σ_t x_jt ⊗ v_jt
    whatever W is (`batch`: inputs x `(B, T, d_in)`, output gradients v `(B, T, d_out)`)."""
    x = batch["x"]
    y = tape.linear("fc", x, x @ params["w"], kernel="w")
    return jnp.sum(y * batch["v"], axis=(1, 2))


def cancelling_canary_data(
    num_examples: int, num_canaries: int, *, d_in: int, block: int, clip_norm: float, seed: int
):
    """Ordinary examples and m cancelling canaries (`audit.cancelling_canary`, seeds `seed + i`)
    for `taped_dense_loss`, two positions each, with d_out = block·(m + 1).

    Output coordinates come in blocks: the ordinary examples' output gradients (standard
    normal) fill block 0, canary i's fill block i + 1, so the canaries' gradients are orthogonal
    to each other and to every other example's. Canary rows follow the ordinary ones. Returns
    (data, directions `(m, d_in, block)`: each canary's exact (float64) gradient Σ_t x_t ⊗ v_t
    in its block, normalised)."""
    d_out = block * (num_canaries + 1)
    rng = np.random.default_rng(seed)
    x = np.zeros((num_examples + num_canaries, 2, d_in), np.float32)
    v = np.zeros((num_examples + num_canaries, 2, d_out), np.float32)
    x[:num_examples] = rng.standard_normal((num_examples, 2, d_in))
    v[:num_examples, :, :block] = rng.standard_normal((num_examples, 2, block))
    directions = np.zeros((num_canaries, d_in, block))
    for i in range(num_canaries):
        cx, cv = audit.cancelling_canary(d_in, block, clip_norm=clip_norm, seed=seed + i)
        row, cols = num_examples + i, slice(block * (i + 1), block * (i + 2))
        x[row], v[row, :, cols] = cx, cv
        g = cx.astype(np.float64).T @ cv.astype(np.float64)
        directions[i] = g / np.linalg.norm(g)
    return {"x": x, "v": v}, directions


def ghost_cancelling_one_run(
    config: AuditConfig, *, make_grad_sum=ghost_clipped_grad_sum, d_in: int = 8, block: int = 8
) -> dict:
    """ONE DP-SGD run of the ghost-clipping path with m cancelling canaries, each present w.p. 1/2.

    A taped dense layer (`taped_dense_loss`, W of d_in x block·(m + 1)) on `ghost_examples`
    ordinary examples and m canaries from `cancelling_canary_data`: each canary's two positions
    have gradients of norm 1e4·C that cancel to 3·C, which a float32 Gram-form norm loses in
    rounding. DP-SGD (the clipped sum of `make_grad_sum`, default `ghost_clipped_grad_sum`,
    plus N(0, σ²C²)) runs `one_run_steps` steps at expected batch `ghost_batch_size`; each
    canary is scored by the projection of the released change of W on its gradient's direction
    (in units of C per expected batch), and the scores are bounded by
    `one_run_epsilon_lower_bound` with noise and without (the control). The row's
    `max_canary_contribution` is the largest norm / C of the clipped sum of a batch holding one
    canary alone (<= 1 when the clipping is sound).
    """
    release = config.releases
    rng = np.random.default_rng(config.seed + 37)
    n, m, steps = release.ghost_examples, release.one_run_canaries, release.one_run_steps
    data, directions = cancelling_canary_data(
        n, m, d_in=d_in, block=block, clip_norm=release.clip_norm, seed=config.seed + 41
    )
    included = rng.random(m) < 0.5
    present = np.append(np.ones(n, bool), included)
    batch = release.ghost_batch_size
    dp_plan = _plan(
        release.epsilon, release.delta, release.clip_norm, batch, steps, int(present.sum())
    )
    grad_sum = make_grad_sum(taped_dense_loss, clip_norm=release.clip_norm)
    params0 = {"w": jnp.zeros((d_in, block * (m + 1)), jnp.float32)}
    contributions = audit_runs.canary_contributions(grad_sum, params0, data, range(n, n + m))
    row = {
        "release": "DP-SGD ghost, cancelling canaries",
        "claimed_epsilon": dp_plan.spent().epsilon,
        "canaries": m,
        "max_canary_contribution": float(contributions.max() / release.clip_norm),
    }
    settings = _sgd_settings(release, steps, dp_plan.expected_batch_size, release.learning_rate)
    scale = dp_plan.expected_batch_size / (settings.learning_rate * release.clip_norm)
    for label, sigma in (("", dp_plan.noise_multiplier), ("no_noise_", 0.0)):
        masks = audit_runs.poisson_masks(rng, 1, steps, n + m, dp_plan.sampling_rate)[0] & present
        seed = int(rng.integers(2**31 - 1))
        final = audit_runs.dpsgd_run(
            grad_sum,
            learning_rate=settings.learning_rate,
            noise_multiplier=sigma,
            expected_batch_size=dp_plan.expected_batch_size,
            data=data,
            params0=params0,
            masks=masks,
            seed=seed,
        )
        w = np.asarray(final["w"], np.float64)[:, block:].reshape(d_in, m, block)
        scores = -scale * np.einsum("imj,mij->m", w, directions)
        for method in audit.ONE_RUN_METHODS:
            row[f"{label}one_run_{method}"] = audit.one_run_epsilon_lower_bound(
                scores, included, delta=release.delta, confidence=config.confidence, method=method
            ).epsilon
    return row


# --------------------------------------------------------------------------------------------
# Hot PATE aggregators on neighbouring teacher ensembles.
# --------------------------------------------------------------------------------------------


def _gnmax_sigma(epsilon: float, delta: float) -> float:
    """σ1 = σ2 = σ with one confident-GNMax call's accountant ε at δ equal to `epsilon`."""
    low, high = 0.05, 200.0
    for _ in range(40):
        mid = math.sqrt(low * high)
        spent = pate_accounting.epsilon_of_steps(
            pate_accounting.confident_gnmax_event(mid, mid), steps=1, delta=delta
        )
        low, high = (mid, high) if spent > epsilon else (low, mid)
    return high


def pate_mechanisms(release: ReleaseAuditConfig, *, private: bool):
    """Per aggregator: (call(key, counts), histogram without, histogram with, claimed ε, δ).

    Neighbouring histograms differ by one teacher's vote moving between two tokens. DPARGMAX and
    confident-GNMax: (h, h+1) vs (h+1, h), so the noiseless argmax flips. DPWS: (t, t) vs
    (t+1, t-1) with t the smallest count its noiseless keep rule keeps, so token 1 straddles the
    stability threshold. The no-noise control (`private=False`) shrinks the noise ~10⁶-fold and
    is audited against the private call's claim.
    """
    eps, delta, h = release.epsilon, release.delta, release.pate_votes
    scale = 1.0 if private else 1e-6
    sigma = _gnmax_sigma(eps, delta)
    dpws_eps = eps / scale
    t = math.floor(aggregators.dpws_threshold(dpws_eps, delta)) + 1
    claimed_dpws = pate_accounting.epsilon_of_steps(
        pate_accounting.dpws_event(eps), steps=1, delta=delta
    )
    return {
        "Hot PATE DPARGMAX": (
            lambda key, c: aggregators.dpargmax_laplace(key, c, -1e9, eps / scale),
            (h, h + 1),
            (h + 1, h),
            pate_accounting.epsilon_of_steps(
                pate_accounting.dpargmax_laplace_event(eps), steps=1, delta=delta
            ),
        ),
        "Hot PATE confident-GNMax": (
            lambda key, c: aggregators.confident_gnmax(key, c, 0.0, sigma * scale, sigma * scale),
            (h, h + 1),
            (h + 1, h),
            pate_accounting.epsilon_of_steps(
                pate_accounting.confident_gnmax_event(sigma, sigma), steps=1, delta=delta
            ),
        ),
        "Hot PATE DPWS": (
            lambda key, c: aggregators.dpws(key, c, dpws_eps, delta, 1e9),
            (t, t),
            (t + 1, t - 1),
            claimed_dpws,
        ),
    }


def _pate_scores(call, counts: jax.Array, keys: jax.Array) -> np.ndarray:
    """One call per histogram row and key: +1 for token 0 (favoured by the 'with' histogram),
    -1 for token 1, 0 for FAIL."""
    out = np.asarray(jax.jit(jax.vmap(call))(keys, counts))
    return np.where(out == 0, 1.0, np.where(out == 1, -1.0, 0.0))


def pate(config: AuditConfig) -> list[dict]:
    """Many-run and one-run bounds per aggregator, with the no-noise control."""
    release = config.releases
    rows = {}
    key = jax.random.key(config.seed + 19)
    for private in (True, False):
        label = "" if private else "no_noise_"
        for name, (call, without, with_, claimed) in pate_mechanisms(
            release, private=private
        ).items():
            row = rows.setdefault(name, {"release": name, "claimed_epsilon": claimed})
            n, m = release.pate_trials, release.pate_queries
            included = np.random.default_rng(config.seed + 23).random(m) < 0.5
            worlds = np.concatenate([np.ones(n, bool), np.zeros(n, bool), included])
            counts = np.where(worlds[:, None], np.array(with_), np.array(without))
            key, calls = jax.random.split(key)
            scores = _pate_scores(call, jnp.asarray(counts), jax.random.split(calls, 2 * n + m))
            row[f"{label}many_runs"] = audit.epsilon_lower_bound(
                scores[:n],
                scores[n : 2 * n],
                delta=release.delta,
                confidence=config.confidence,
                method=config.method,
                seed=config.seed,
            ).epsilon
            one = scores[2 * n :]
            # The f-DP bound is read in the Gaussian family; the Laplace aggregators are not
            # Gaussian, so only confident-GNMax gets it.
            methods = audit.ONE_RUN_METHODS if "GNMax" in name else ("steinke",)
            for method in methods:
                row[f"{label}one_run_{method}"] = audit.one_run_epsilon_lower_bound(
                    one, included, delta=release.delta, confidence=config.confidence, method=method
                ).epsilon
    return list(rows.values())


# --------------------------------------------------------------------------------------------
# The end-to-end DP-MixMin pipeline at small scale.
# --------------------------------------------------------------------------------------------


def _public_sources(num_sources: int, start: int):
    """k logistic models fitted on public digits (rows >= `start`), source s on the digits with
    class ≡ s (mod k) over-represented: `(k, 64)` weights and `(k,)` biases."""
    x, y = digits_task()
    digits = load_digits().target
    weights, biases = [], []
    for s in range(num_sources):
        rows = np.arange(start, len(x))
        keep = rows[(digits[rows] % num_sources == s) | (rows % num_sources == 0)]
        model = LogisticRegression(max_iter=500).fit(x[keep], y[keep])
        weights.append(model.coef_[0])
        biases.append(model.intercept_[0])
    return np.asarray(weights, np.float32), np.asarray(biases, np.float32)


def pipeline_setup(release: ReleaseAuditConfig, seed: int) -> dict:
    """The sensitive set, its keyed split, the proxies' outputs and the canaries.

    Sensitive units are digits rows 0..n-1 with ids 0..n-1 (plus a zero feature for the D_ft
    canary); the split key is fixed (the end-to-end claim holds for every key). Canary ids are
    the first ids >= n that the keyed hash sends to D_mix and to D_ft; the one-run audit's m
    canaries are the first m ids >= n that it sends to D_ft.
    """
    from dpmix_jax.privacy import assign_parts

    n, k = release.pipeline_units, release.pipeline_sources
    x, y = digits_task()
    weights, biases = _public_sources(k, start=n)
    x, y = x[:n], y[:n]
    probs = 1 / (1 + np.exp(-(x @ weights.T + biases)))
    preds = np.where(y[:, None] == 1, probs, 1 - probs)
    fractions = (release.pipeline_mix_fraction, 1 - release.pipeline_mix_fraction)
    parts = assign_parts(np.arange(n), fractions, key=seed)
    m = release.one_run_canaries
    candidates = np.arange(n, n + 64 + math.ceil(4 * m / fractions[1]))
    candidate_parts = assign_parts(candidates, fractions, key=seed)
    ft_ids = candidates[candidate_parts == 1]
    if len(ft_ids) < m:
        raise ValueError(
            f"one_run_canaries: only {len(ft_ids)} of {len(candidates)} candidate ids land in "
            f"D_ft, fewer than m = {m}."
        )
    reference = np.asarray(mixmin(preds[parts == 0]))
    return {
        "preds": preds[parts == 0],
        "x": np.hstack([x[parts == 1], np.zeros((int((parts == 1).sum()), 1), np.float32)]),
        "y": y[parts == 1],
        "sources": (weights, biases),
        "mix_canary_id": int(candidates[candidate_parts == 0][0]),
        "ft_canary_id": int(ft_ids[0]),
        "one_run_canary_ids": ft_ids[:m],
        "mix_canary": audit.max_clip_nll_canary(reference, clip_norm=release.clip_norm),
        "reference": reference,
    }


def pipeline_trials(setup, release, *, canary: str, present: np.ndarray, noise, plans, seeds, rng):
    """End-to-end runs: DP-MixMin on D_mix -> λ; initial model Σ_s λ_s θ_s (the public sources
    mixed by λ); DP-SGD on D_ft, with the other units' batches shared by all runs. Returns the
    canary's score per run (on λ for the D_mix canary,
    on the fine-tuned model's canary coordinate for the D_ft one)."""
    mix_plan, ft_plan = plans
    preds = np.vstack([setup["preds"], setup["mix_canary"]]) if canary == "mix" else setup["preds"]
    x, y = setup["x"], setup["y"]
    ft_data = {
        "x": np.vstack([x, np.zeros((1, x.shape[1]), np.float32)]) if canary == "ft" else x,
        "y": np.append(y, 0.0).astype(np.float32) if canary == "ft" else y,
    }
    ft_units = len(ft_data["y"])
    ft_data["is_canary"] = np.arange(ft_units) == (ft_units - 1 if canary == "ft" else -1)
    ft_data["coord"] = np.zeros(ft_units, np.int32)
    direction = audit.logit_direction(-setup["mix_canary"] / setup["reference"].max())
    settings = _sgd_settings(
        release, release.pipeline_ft_steps, ft_plan.expected_batch_size, release.learning_rate
    )
    run_ft = audit_runs.dpsgd_trials(
        dirac_loss(release.clip_norm, offset=x.shape[1] - 1),
        clip_norm=settings.clip_norm,
        learning_rate=settings.learning_rate,
        noise_multiplier=noise * ft_plan.noise_multiplier,
        expected_batch_size=ft_plan.expected_batch_size,
        params_per_trial=True,
    )
    examples = prepare_examples(preds)
    # The other units' batches are drawn once and shared by every run: the adversary knows
    # them, and only the canary's inclusion and the noise are random (the accountant's analysis
    # conditions on the other units' inclusions, so it covers this adversary).
    known = (
        audit_runs.poisson_masks(
            rng, 1, release.pipeline_mix_steps, len(preds), mix_plan.sampling_rate
        ),
        audit_runs.poisson_masks(
            rng, 1, release.pipeline_ft_steps, ft_units, ft_plan.sampling_rate
        ),
    )
    scores, start = [], 0
    for part in audit_runs.seed_chunks(seeds, release.pipeline_chunk):
        world = present[start : start + len(part)]
        start += len(part)
        mix_masks = np.repeat(known[0], len(part), axis=0)
        ft_masks = np.repeat(known[1], len(part), axis=0)
        masks, plan_ = (mix_masks, mix_plan) if canary == "mix" else (ft_masks, ft_plan)
        steps = masks.shape[1]
        masks[..., -1] = world[:, None] & (rng.random((len(part), steps)) < plan_.sampling_rate)
        lam, tuned = _end_to_end(
            setup, release, examples, ft_data, (mix_masks, ft_masks), part, mix_plan, noise, run_ft
        )
        scores.append(audit.logit_score(lam, direction) if canary == "mix" else tuned[:, -1])
    return np.concatenate(scores)


def _end_to_end(setup, release, examples, ft_data, masks, seeds, mix_plan, noise, run_ft):
    """End-to-end runs, one per seed, on given Poisson masks `(mix masks, fine-tuning masks)`:
    DP-MixMin on D_mix (`examples`) -> λ; initial model Σ_s λ_s θ_s (zero on the features the
    sources lack); `run_ft` (DP-SGD) on D_ft (`ft_data`). Returns λ `(runs, k)` and the
    fine-tuned weights `(runs, features)`.

    Privacy: an audit tool; each run is the pipeline on the given (audit) data.
    """
    mix_masks, ft_masks = masks
    trace = mixmin_audit.mixmin_trials(
        examples,
        jnp.asarray(
            np.broadcast_to(np.arange(mix_masks.shape[-1], dtype=np.int32), mix_masks.shape)
        ),
        jnp.asarray(mix_masks),
        jnp.asarray(seeds),
        noise * mix_plan.noise_multiplier,
        mix_plan.expected_batch_size,
        release.pipeline_mix_learning_rate,
        clip_norm=release.clip_norm,
        shift="mean",
    )
    lam = np.asarray(trace.weights, np.float64)
    weights, biases = setup["sources"]
    extra = ft_data["x"].shape[1] - weights.shape[1]
    params0 = {
        "w": jnp.asarray(np.hstack([lam @ weights, np.zeros((len(seeds), extra))]), jnp.float32),
        "b": jnp.asarray(lam @ biases, jnp.float32),
    }
    batches = np.broadcast_to(np.arange(ft_masks.shape[-1], dtype=np.int32), ft_masks.shape)
    history = run_ft(
        jax.tree.map(jnp.asarray, ft_data), params0, batches, ft_masks, jnp.asarray(seeds + 1)
    )
    return lam, np.asarray(history["w"][:, -1], np.float64)


def _pipeline_plans(release: ReleaseAuditConfig, mix_units: int, ft_units: int) -> tuple:
    """The DP plans of the pipeline's two stages (D_mix and D_ft) at the release's ε and δ."""
    return (
        _plan(
            release.epsilon,
            release.delta,
            release.clip_norm,
            release.pipeline_mix_batch,
            release.pipeline_mix_steps,
            mix_units,
        ),
        _plan(
            release.epsilon,
            release.delta,
            release.clip_norm,
            release.pipeline_ft_batch,
            release.pipeline_ft_steps,
            ft_units,
        ),
    )


def pipeline(config: AuditConfig) -> dict:
    """The end-to-end audit: claimed ε = max(ε_mix, ε_ft) (parallel composition over the keyed
    split); a canary unit landing in D_mix and one landing in D_ft, many runs each."""
    release = config.releases
    setup = pipeline_setup(release, config.seed)
    rng = np.random.default_rng(config.seed + 29)
    mix_units, ft_units = len(setup["preds"]) + 1, len(setup["y"]) + 1
    plans = _pipeline_plans(release, mix_units, ft_units)
    row = {
        "release": "end-to-end pipeline",
        "claimed_epsilon": max(p.spent().epsilon for p in plans),
        "mix_canary_id": setup["mix_canary_id"],
        "ft_canary_id": setup["ft_canary_id"],
    }
    for label, noise in (("", 1.0), ("no_noise_", 0.0)):
        for canary in ("mix", "ft"):
            present = np.arange(2 * config.trials) < config.trials
            seeds = rng.integers(2**31 - 2, size=2 * config.trials).astype(np.uint32)
            scores = pipeline_trials(
                setup,
                release,
                canary=canary,
                present=present,
                noise=noise,
                plans=plans,
                seeds=seeds,
                rng=rng,
            )
            row[f"{label}{canary}"] = audit.epsilon_lower_bound(
                scores[present],
                scores[~present],
                delta=release.delta,
                confidence=config.confidence,
                method=config.method,
                seed=config.seed,
            ).epsilon
        row[f"{label}many_runs"] = max(row[f"{label}mix"], row[f"{label}ft"])
    return row


def pipeline_one_run(config: AuditConfig) -> dict:
    """ONE end-to-end run with m dirac canaries in D_ft, each present with probability 1/2.

    The canaries are the units with ids `setup["one_run_canary_ids"]` (the keyed split sends
    each to D_ft), each with its own zero feature; DP-MixMin runs on D_mix, then DP-SGD
    fine-tunes the λ-mixed model on D_ft with the present canaries. Each canary is scored by its
    coordinate of the fine-tuned model and the scores are bounded by
    `one_run_epsilon_lower_bound` (Steinke et al. and f-DP: the canaries reach the release only
    through DP-SGD, a Gaussian mechanism). Claimed ε = max(ε_mix, ε_ft) for the units present.
    The no-noise control runs both stages with σ = 0.
    """
    release = config.releases
    setup = pipeline_setup(release, config.seed)
    rng = np.random.default_rng(config.seed + 31)
    m = release.one_run_canaries
    included = rng.random(m) < 0.5
    ft_data, _, n, dim = _with_canaries(setup["x"][:, :-1], setup["y"], m, 1)
    present = np.append(np.ones(n, bool), included)
    mix_units = len(setup["preds"])
    mix_plan, ft_plan = _pipeline_plans(release, mix_units, int(present.sum()))
    row = {
        "release": "end-to-end pipeline",
        "claimed_epsilon": max(mix_plan.spent().epsilon, ft_plan.spent().epsilon),
        "canaries": m,
    }
    settings = _sgd_settings(
        release, release.pipeline_ft_steps, ft_plan.expected_batch_size, release.learning_rate
    )
    examples = prepare_examples(setup["preds"])
    for label, noise in (("", 1.0), ("no_noise_", 0.0)):
        run_ft = audit_runs.dpsgd_trials(
            dirac_loss(release.clip_norm, offset=dim),
            clip_norm=settings.clip_norm,
            learning_rate=settings.learning_rate,
            noise_multiplier=noise * ft_plan.noise_multiplier,
            expected_batch_size=ft_plan.expected_batch_size,
            params_per_trial=True,
        )
        masks = (
            audit_runs.poisson_masks(
                rng, 1, release.pipeline_mix_steps, mix_units, mix_plan.sampling_rate
            ),
            audit_runs.poisson_masks(
                rng, 1, release.pipeline_ft_steps, n + m, ft_plan.sampling_rate
            )
            & present,
        )
        seed = rng.integers(2**31 - 2, size=1).astype(np.uint32)
        _, tuned = _end_to_end(
            setup, release, examples, ft_data, masks, seed, mix_plan, noise, run_ft
        )
        for method in audit.ONE_RUN_METHODS:
            row[f"{label}one_run_{method}"] = audit.one_run_epsilon_lower_bound(
                tuned[0, dim:],
                included,
                delta=release.delta,
                confidence=config.confidence,
                method=method,
            ).epsilon
    return row
