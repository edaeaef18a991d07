"""DP-MixMin's λ under canary audits: many jitted runs with and without a canary.

`lambda_canaries` builds the natural and max-clip canaries of a proxy-output matrix at the
non-private MixMin optimum; `mixmin_trials` vmaps `run_mirror_descent` over trials (trial i is
`dp_mixmin(seed=seeds[i])` on the same batches); `lambda_scores` runs `len(seeds)` trials with or
without the canary (batches from `privacy.audit_runs.sample_trial_batches`) and scores the
released λ along the canary's logit direction, ready for `privacy.audit.epsilon_lower_bound`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.mixing.objectives import per_example_grads, prepare_examples
from dpmix_jax.mixing.solvers import mixmin, run_mirror_descent
from dpmix_jax.privacy.audit import (
    logit_direction,
    logit_score,
    max_clip_nll_canary,
    natural_canary,
)
from dpmix_jax.privacy.audit_runs import sample_trial_batches, seed_chunks


@functools.partial(jax.jit, static_argnames=("clip_norm", "shift"))
def mixmin_trials(
    examples: dict[str, jax.Array],
    batches: jax.Array,
    masks: jax.Array,
    seeds: jax.Array,
    noise_multiplier: float,
    expected_batch_size: float,
    learning_rate: float,
    *,
    clip_norm: float,
    shift: str,
):
    """`run_mirror_descent` vmapped over trials: batches/masks `(trials, T, B)`, seeds `(trials,)`.

    Trial i's noise key is `jax.random.key(seeds[i])`, as in `dp_mixmin(seed=seeds[i])`.

    Privacy: an audit tool; each trial is one DP-MixMin run on the given (audit) data.
    """

    def one(indices, mask, seed):
        return run_mirror_descent(
            examples,
            indices,
            mask,
            jax.random.key(seed),
            kind="nll",
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            expected_batch_size=expected_batch_size,
            learning_rate=learning_rate,
            shift=shift,
        )

    return jax.vmap(one)(batches, masks, seeds)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LambdaCanary:
    """A λ-audit canary: the "with" data set, the canary's row index in it, its logit direction."""

    name: str
    preds: np.ndarray
    index: int
    direction: np.ndarray


def lambda_canaries(
    preds: np.ndarray, *, clip_norm: float, seed: int
) -> tuple[list[LambdaCanary], np.ndarray]:
    """The natural and max-clip canaries for a proxy-output matrix, and the reference λ*.

    Both directions are taken at λ* = non-private MixMin on `preds` (the audit's adversary knows
    every other example).

    Privacy: not private (an audit tool, it reads the whole data set).
    """
    reference = np.asarray(mixmin(preds))
    natural = natural_canary(len(preds), seed=seed)
    natural_grad = per_example_grads(
        reference, prepare_examples(preds[natural : natural + 1]), kind="nll"
    )
    max_clip = max_clip_nll_canary(reference, clip_norm=clip_norm)
    source = int(np.argmax(max_clip))
    canaries = [
        LambdaCanary(
            name="natural",
            preds=preds,
            index=natural,
            direction=logit_direction(np.asarray(natural_grad[0])),
        ),
        LambdaCanary(
            name="max_clip",
            preds=np.vstack([preds, max_clip]),
            index=len(preds),
            direction=logit_direction(-max_clip / reference[source]),
        ),
    ]
    return canaries, reference


def lambda_scores(
    canary: LambdaCanary,
    *,
    steps: int,
    learning_rate: float,
    clip_norm: float,
    shift: str,
    noise_multiplier: float,
    rate: float,
    expected_batch_size: float,
    seeds: np.ndarray,
    present: bool,
    chunk: int,
    known_batches_seed: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Scores of `len(seeds)` DP-MixMin runs with (`present`) or without the canary.

    Each run is `mixmin_trials` with T = `steps`, η = `learning_rate`, C = `clip_norm` and the
    gradient `shift`, over `chunk` trials at a time; batches come from `sample_trial_batches`
    (see there for `known_batches_seed`). Returns the scores and the released weights
    `(trials, k)`.

    Privacy: an audit tool; each trial is one DP-MixMin run on the (audit) data `canary.preds`.
    """
    examples = prepare_examples(canary.preds)
    weights = []
    for part in seed_chunks(seeds, chunk):
        batches, masks = sample_trial_batches(
            part,
            rate=rate,
            num_units=len(canary.preds),
            steps=steps,
            canary=canary.index,
            present=present,
            known_batches_seed=known_batches_seed,
        )
        trace = mixmin_trials(
            examples,
            jnp.asarray(batches),
            jnp.asarray(masks),
            jnp.asarray(part, dtype=jnp.uint32),
            noise_multiplier,
            expected_batch_size,
            learning_rate,
            clip_norm=clip_norm,
            shift=shift,
        )
        weights.append(np.asarray(trace.weights))
    weights = np.concatenate(weights)
    return logit_score(weights, canary.direction), weights
