"""Trial runners of canary audits: many jitted runs of a mechanism with and without a canary.

`privacy.audit` turns scores into ε lower bounds and builds canaries; this module runs the
mechanisms that produce the scores, vmapped over trials, on the caller's data and loss
(`mixing.audit` does the same for DP-MixMin's λ):

- `sample_trial_batches`, `poisson_masks`: the Poisson batches of many trials, with or without
  the canary unit (optionally with the other units' batches known to the adversary).
- `dpsgd_trials`, `dpsgd_run`: DP-SGD from the privacy core (`clipping`, `noise`) on a given
  per-example loss, example or user level, over trials or once with a given clipped sum;
  `canary_contributions` measures what one row alone adds to a clipped sum; `logistic_loss` is
  the audits' reference model (binary logistic regression).
- `transcript_llr`, `claimed_transcripts`, `pilot_then_bound`: the white-box transcript audit of
  a Poisson-subsampled Gaussian mechanism (a likelihood-ratio test chosen on draws of the claimed
  mechanism, evaluated once on the implementation's runs).

Example (a DP-SGD audit of a user's loss; `data` holds n units and the canary as unit n, and
`score` maps final parameters to a real number):

    run = dpsgd_trials(loss, clip_norm=C, learning_rate=lr, noise_multiplier=σ,
                       expected_batch_size=b)
    for present in (True, False):
        batches, masks = sample_trial_batches(seeds, rate=q, num_units=n + 1, steps=T,
                                              canary=n, present=present)
        history = run(data, params0, batches, masks, jnp.asarray(seeds, jnp.uint32))
        scores[present] = score(jax.tree.map(lambda h: h[:, -1], history))
    bound = audit.epsilon_lower_bound(scores[True], scores[False], delta=δ)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dpmix_jax.privacy import clipping, noise, sampling
from dpmix_jax.privacy.audit import LowerBound, clopper_pearson, epsilon_lower_bound_at

PAD_MULTIPLE = 32

# --------------------------------------------------------------------------------------------
# Poisson batches of many trials.
# --------------------------------------------------------------------------------------------


def sample_trial_batches(
    seeds: Sequence[int],
    *,
    rate: float,
    num_units: int,
    steps: int,
    canary: int,
    present: bool,
    known_batches_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Poisson batches `(trials, T, B)` and masks for audit trials with or without the canary.

    By default trial i is drawn as `dp_mixmin(seed=seeds[i])` draws its batches:
    `PoissonSampler(rate).sample_steps(default_rng(seed), num_units, steps)`, padded with -1 to
    the largest batch of all trials; without the canary (`present=False`), the `canary` unit is
    masked out of every batch (the same mechanism, at the same public rate, on the data set
    without it).

    With `known_batches_seed`, the other units' batches are drawn once from that seed and shared
    by every trial, and only the canary's inclusion (Bernoulli(rate) per step, from the trial's
    seed) and the noise vary: an adversary who knows every other unit's sampling. The
    Poisson-subsampled Gaussian accountant covers this adversary too: its analysis conditions on
    the other units' inclusions, and only the differing unit's is secret.
    """
    sampler = sampling.PoissonSampler(sampling_rate=rate, pad_multiple=PAD_MULTIPLE)
    if known_batches_seed is None:
        draws = [sampler.sample_steps(np.random.default_rng(s), num_units, steps) for s in seeds]
        size = max(d.indices.shape[1] for d in draws)
        indices = np.full((len(draws), steps, size), sampling.PADDING_INDEX, dtype=np.int32)
        for row, draw in zip(indices, draws, strict=True):
            row[:, : draw.indices.shape[1]] = draw.indices
        if not present:
            indices[indices == canary] = sampling.PADDING_INDEX
        return indices, indices != sampling.PADDING_INDEX
    others = sampler.sample_steps(np.random.default_rng(known_batches_seed), num_units, steps)
    others = np.where(others.indices == canary, sampling.PADDING_INDEX, others.indices)
    included = np.stack([np.random.default_rng(s).random(steps) < rate for s in seeds])
    column = np.where(included & present, canary, sampling.PADDING_INDEX)
    indices = np.concatenate(
        [np.broadcast_to(others, (len(seeds), *others.shape)), column[..., None]], axis=-1
    ).astype(np.int32)
    return indices, indices != sampling.PADDING_INDEX


def seed_chunks(seeds: np.ndarray, size: int) -> list[np.ndarray]:
    """`seeds` in consecutive slices of at most `size` (one jitted call of trials each)."""
    return [seeds[i : i + size] for i in range(0, len(seeds), size)]


def poisson_masks(rng: np.random.Generator, trials: int, steps: int, units: int, rate: float):
    """`(trials, steps, units)` Poisson inclusion masks (each unit, each step, probability q)."""
    return rng.random((trials, steps, units)) < rate


# --------------------------------------------------------------------------------------------
# DP-SGD.
# --------------------------------------------------------------------------------------------


def logistic_loss(params, example):
    """Binary cross-entropy of a logistic regression on one example."""
    logit = example["x"] @ params["w"] + params["b"]
    return jax.nn.softplus(logit) - example["y"] * logit


def dpsgd_trials(
    loss: Callable,
    *,
    clip_norm: float,
    learning_rate: float,
    noise_multiplier: float,
    expected_batch_size,
    user_level: bool = False,
    params_per_trial: bool = False,
) -> Callable:
    """A jitted `(data, params0, batches, masks, seeds) -> params after each step` over trials.

    Each trial is DP-SGD from the privacy core: clipped gradient sum (C = `clip_norm`), noise
    N(0, σ²C²) with key `jax.random.key(seed)`, division by the public b, plain SGD at
    `learning_rate`. Batches are `(trials, T, B)` example indices, or `(trials, T, U, G)`
    per-user example indices with `user_level` (each user's mean gradient is clipped). `params0`
    is shared, or one per trial (leading axis) with `params_per_trial`. Returns params with
    leading axes `(trials, T)`.

    Privacy: an audit tool; each trial is one DP-SGD run on the given (audit) data.
    """
    make_sum = clipping.user_clipped_grad_sum if user_level else clipping.clipped_grad_sum
    grad_sum = make_sum(loss, clip_norm=clip_norm)

    def one(data, params, indices, mask, seed):
        optimizer = noise.private_optimizer(
            optax.sgd(learning_rate),
            noise_multiplier=noise_multiplier,
            sensitivity=grad_sum.sensitivity(),
            expected_batch_size=expected_batch_size,
            key=jax.random.key(seed),
        )
        step = noise.make_dp_sgd_step(grad_sum, optimizer)

        def body(carry, xs):
            params, state = carry
            batch = jax.tree.map(lambda x: x[jnp.maximum(xs[0], 0)], data)
            params, state, _ = step(params, state, batch, xs[1])
            return (params, state), params

        _, history = jax.lax.scan(body, (params, optimizer.init(params)), (indices, mask))
        return history

    return jax.jit(jax.vmap(one, in_axes=(None, 0 if params_per_trial else None, 0, 0, 0)))


def dpsgd_run(
    grad_sum,
    *,
    learning_rate: float,
    noise_multiplier: float,
    expected_batch_size: float,
    data,
    params0,
    masks,
    seed: int,
):
    """Parameters after one DP-SGD run over the full-data `(T, units)` Poisson `masks`: as
    `dpsgd_trials`, with a given clipped sum (such as the ghost one).

    Privacy: an audit tool; one DP-SGD run on the given (audit) data.
    """
    optimizer = noise.private_optimizer(
        optax.sgd(learning_rate),
        noise_multiplier=noise_multiplier,
        sensitivity=grad_sum.sensitivity(),
        expected_batch_size=expected_batch_size,
        key=jax.random.key(seed),
    )
    step = noise.make_dp_sgd_step(grad_sum, optimizer)

    @jax.jit
    def run(data, params, masks):
        def body(carry, mask):
            params, state, _ = step(*carry, data, mask)
            return (params, state), None

        (params, _), _ = jax.lax.scan(body, (params, optimizer.init(params)), masks)
        return params

    return run(jax.tree.map(jnp.asarray, data), params0, jnp.asarray(masks))


def canary_contributions(grad_sum, params, data, rows) -> np.ndarray:
    """||clipped sum of a batch holding only row j|| (float64) for each j in `rows`."""
    fn = jax.jit(grad_sum)
    out = []
    for j in rows:
        alone = {name: jnp.asarray(a[j : j + 1]) for name, a in data.items()}
        total, _ = fn(params, alone, jnp.ones(1, bool))
        out.append(np.linalg.norm(np.asarray(total["w"], np.float64)))
    return np.asarray(out)


# --------------------------------------------------------------------------------------------
# The white-box transcript audit.
# --------------------------------------------------------------------------------------------


def transcript_llr(observations: np.ndarray, *, rate: float, noise_multiplier: float):
    """Log-likelihood ratio of `(trials, T)` observations y_t ~ N(b_t, σ²), b_t ~ Bern(q) vs 0."""
    z = (2 * observations - 1) / (2 * noise_multiplier**2)
    with np.errstate(divide="ignore"):
        return np.logaddexp(np.log1p(-rate), math.log(rate) + z).sum(axis=-1)


def claimed_transcripts(rng, trials: int, steps: int, *, rate: float, noise_multiplier: float):
    """`(trials, T)` draws of the claimed mechanism's transcript with and without the canary."""
    noise = noise_multiplier * rng.normal(size=(2, trials, steps))
    return (rng.random((trials, steps)) < rate) + noise[0], noise[1]


def pilot_then_bound(pilot, main, delta: float, confidence: float) -> LowerBound:
    """Chooses the test on pilot scores, then evaluates it once on the main scores.

    Each candidate threshold (pilot quantiles, both directions) is scored by the bound it would
    give if the main sample had the pilot's TPR and FPR; the best one is evaluated on `main`
    with `epsilon_lower_bound_at`. The choice sees only the pilot, so the bound stays valid.
    """
    with_, without = (np.sort(np.asarray(s, np.float64)) for s in pilot)
    n_with, n_without = (len(s) for s in main)
    alpha = (1 - confidence) / 2
    thresholds = np.unique(np.quantile(np.concatenate([with_, without]), np.linspace(0, 1, 4001)))
    best = (-np.inf, None, None)
    for direction in ("greater", "less"):
        tpr = 1 - np.searchsorted(with_, thresholds, side="left") / len(with_)
        fpr = 1 - np.searchsorted(without, thresholds, side="left") / len(without)
        if direction == "less":
            tpr, fpr = 1 - tpr, 1 - fpr
        tpr_low, _ = clopper_pearson(np.round(tpr * n_with), n_with, alpha=alpha)
        _, fpr_high = clopper_pearson(np.round(fpr * n_without), n_without, alpha=alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            projected = np.log(np.maximum(tpr_low - delta, 0) / fpr_high)
        i = int(np.nanargmax(projected))
        if projected[i] > best[0]:
            best = (projected[i], thresholds[i], direction)
    return epsilon_lower_bound_at(
        *main, threshold=best[1], direction=best[2], delta=delta, confidence=confidence
    )
