"""Hot PATE's ablations: teacher temperature, aggregators, privacy cost, API-only teachers.

(e) Temperature: the hotter the teachers, the more diverse their votes; independent histograms
    then flatten below any useful threshold while coordinated ones keep their peaks.
(f) Aggregators: TARGMAX against TWS (and their DP versions) on a homogeneous ensemble, where
    the argmax of a coordinated histogram already follows the teachers' average, and on a
    heterogeneous one (disjoint groups), where only weighted sampling reaches the small groups.
(g) Privacy cost: the largest threshold each sampler's histograms pass at a given coverage,
    priced by DPWS: per-call ε, ε of a fixed number of calls, calls within a budget.
(h) API-only teachers: distributions estimated from m sampled answers each; m = 1 is
    independent sampling in disguise, coordination returns as m grows.
(i) Steps with no output: a stream in which few steps can be answered, at one total (ε, δ):
    DPARGMAX charged on every step against the sparse vector gate (`pate.sparse`), which
    charges only the steps it answers.
(j) Individual accounting: a heterogeneous stream (one user per teacher) where the teachers
    mostly agree with a public model and, at a few steps, a small random group knows a token the
    public model lacks. A teacher whose vote (under the shared Gumbel noise) equals the public
    model's abstains, and a Rényi filter (`pate.individual`) charges each teacher only for the
    steps it votes in, up to its own budget M: at the same per-teacher (ε, δ) the stream runs to
    its end, where charging every teacher at every step stops it after M steps (or needs a σ
    that drowns the groups).

All teachers are synthetic with a known ground truth; nothing here reads sensitive data. The
draws are seeded by the config's seed with `--reproducible`, otherwise secret.

Command and settings: see `experiments/configs/hot_pate_ablations.py`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax.pate import (  # noqa: E402
    accounting,
    aggregators,
    diversity,
    individual,
    metrics,
    samplers,
    sparse,
)
from dpmix_jax.pate.teachers import sampled_logits  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, randomness  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import hot_pate_ablations as configs  # noqa: E402
from experiments.harness import Command, finish, progress_log  # noqa: E402

TITLE = "Hot PATE ablations: temperature, aggregators, privacy cost, API-only teachers"
SAMPLERS = ("coordinated", "independent")
AGGREGATORS = ("TARGMAX", "TWS", "DPARGMAX", "DPWS")
STREAM_METHODS = {"dpargmax": "DPARGMAX, every step charged", "sparse": "sparse vector gate"}
ACCOUNTINGS = {
    "individual": "individual (filter)",
    "standard_stop": "standard, stops at M",
    "standard_sigma": "standard, σ for the stream",
}


def _histograms(sampler: str, key: jax.Array, logits: jax.Array, r: int, temperature=1.0):
    draw = (
        samplers.coordinated_histograms
        if sampler == "coordinated"
        else samplers.independent_histograms
    )
    return draw(key, logits, r, temperature=temperature, batch_size=256)


def _ensemble(config: configs.AblationsConfig, key: jax.Array, set_size: int):
    return diversity.secret_set_logits(
        key,
        num_teachers=config.num_teachers,
        vocab_size=config.vocab_size,
        set_size=set_size,
        private_mass=config.private_mass,
        heterogeneity=config.heterogeneity,
        background_mass=config.background_mass,
    )


def _probabilities(logits: jax.Array) -> np.ndarray:
    """softmax(logits) per teacher in float64 (rows summing to 1 for `output_distribution`)."""
    logits = np.asarray(logits, np.float64)
    weights = np.exp(logits - logits.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)


def secret_share(histograms: jax.Array, secret: jax.Array, threshold: float) -> float | None:
    """The share of the votes on tokens with >= T votes that fall on the secret tokens (pooled
    over histograms); None when no token reaches T."""
    counts = np.asarray(histograms)
    passing = np.where(counts >= threshold, counts, 0)
    total = passing.sum()
    return None if total == 0 else float(passing[:, np.asarray(secret)].sum() / total)


def _histogram_row(config, histograms, secret) -> dict:
    n = config.num_teachers
    level = config.coverage_level
    threshold = metrics.threshold_at_coverage(histograms, level)
    half = float(metrics.coverage(histograms, jnp.asarray([n / 2]))[0])
    row = {"coverage_at_half": half, "threshold": threshold}
    if secret is not None:
        row["secret_share"] = secret_share(histograms, secret, threshold) if threshold else None
    return row


# --------------------------------------------------------------------------------------------
# (e) Temperature.
# --------------------------------------------------------------------------------------------


def run_temperature(config: configs.AblationsConfig, key: jax.Array, log) -> list[dict]:
    rows = []
    for k in config.temperature_set_sizes:
        key, key_logits = jax.random.split(key)
        logits, secret = _ensemble(config, key_logits, k)
        for temperature in config.temperatures:
            key, key_hist = jax.random.split(key)
            row = {"k": k, "temperature": temperature}
            for sampler in SAMPLERS:
                hist = _histograms(sampler, key_hist, logits, config.num_histograms, temperature)
                row[sampler] = _histogram_row(config, hist, secret)
            rows.append(row)
            log(
                f"(e) k = {k}, t = {temperature:g}: T at coverage {config.coverage_level:g}"
                f" coordinated {row['coordinated']['threshold']:.0f},"
                f" independent {row['independent']['threshold']:.0f}"
            )
    return rows


# --------------------------------------------------------------------------------------------
# (f) Aggregators on homogeneous and heterogeneous ensembles.
# --------------------------------------------------------------------------------------------


def group_ensemble(group_sizes: tuple[int, ...]) -> np.ndarray:
    """Disjoint groups: every teacher of group g gives 0.6 to token 2g and 0.4 to token 2g + 1."""
    probs = np.zeros((sum(group_sizes), 2 * len(group_sizes)))
    group = np.repeat(np.arange(len(group_sizes)), group_sizes)
    probs[np.arange(probs.shape[0]), 2 * group] = 0.6
    probs[np.arange(probs.shape[0]), 2 * group + 1] = 0.4
    return probs


def _aggregator(name: str, config: configs.AblationsConfig, threshold: float):
    if name == "TARGMAX":
        return diversity.targmax_aggregator(threshold)
    if name == "TWS":
        return diversity.tws_aggregator(threshold, 1.0)
    if name == "DPARGMAX":
        return diversity.dpargmax_aggregator(threshold, config.aggregator_epsilon)
    return diversity.dpws_aggregator(
        config.aggregator_epsilon, config.aggregator_delta, 1.0, threshold=threshold
    )


def _keep_threshold(name: str, config: configs.AblationsConfig, threshold: float) -> float:
    """The count a token needs: DPWS never keeps one below its stability threshold."""
    if name != "DPWS":
        return threshold
    stable = aggregators.dpws_threshold(config.aggregator_epsilon, config.aggregator_delta)
    return max(threshold, stable)


def total_variation_given_yield(output: np.ndarray, reference: np.ndarray) -> float | None:
    """TV distance between the output law given a token (last entry of `output` is ⊥) and the
    `reference` law over the vocabulary; None when nothing is ever output."""
    yielded = 1.0 - output[-1]
    if yielded <= 0:
        return None
    return float(0.5 * np.abs(output[:-1] / yielded - reference).sum())


def run_aggregators(config: configs.AblationsConfig, key: jax.Array, log) -> list[dict]:
    key, key_logits = jax.random.split(key)
    logits, secret = _ensemble(config, key_logits, config.homogeneous_set_size)
    homogeneous = _probabilities(logits)
    shared = np.zeros(config.vocab_size)
    shared[np.asarray(secret)] = homogeneous[:, np.asarray(secret)].mean(axis=0)
    heterogeneous = group_ensemble(config.group_sizes)
    cases = (
        ("homogeneous", homogeneous, shared / shared.sum(), config.num_teachers / 2),
        ("heterogeneous", heterogeneous, heterogeneous.mean(axis=0), min(config.group_sizes) / 2),
    )
    rows = []
    for ensemble, probs, reference, threshold in cases:
        for name in AGGREGATORS:
            for sampler in SAMPLERS:
                key, key_draws = jax.random.split(key)
                estimate = diversity.output_distribution(
                    key_draws,
                    probs,
                    sampler=sampler,
                    aggregator=_aggregator(name, config, threshold),
                    num_draws=config.aggregator_draws,
                )
                output = estimate.probs
                row = {
                    "ensemble": ensemble,
                    "aggregator": name,
                    "sampler": sampler,
                    "threshold": _keep_threshold(name, config, threshold),
                    "yield": float(1.0 - output[-1]),
                    "total_variation": total_variation_given_yield(output, reference),
                    "tokens_out": int((output[:-1] * config.aggregator_draws >= 1).sum()),
                }
                if ensemble == "heterogeneous":
                    row["groups_transferred"] = groups_transferred(output, config.group_sizes)
                rows.append(row)
                log(
                    f"(f) {ensemble} {name} {sampler}: yield {row['yield']:.2f},"
                    f" TV {_number(row['total_variation'], 3)}"
                )
    return rows


def groups_transferred(output: np.ndarray, group_sizes: tuple[int, ...]) -> int:
    """Groups whose tokens come out, given a yield, with at least half their share of teachers."""
    yielded = 1.0 - output[-1]
    if yielded <= 0:
        return 0
    per_group = output[:-1].reshape(len(group_sizes), 2).sum(axis=1) / yielded
    share = np.asarray(group_sizes) / sum(group_sizes)
    return int((per_group >= 0.5 * share).sum())


# --------------------------------------------------------------------------------------------
# (g) Privacy cost at equal coverage.
# --------------------------------------------------------------------------------------------


def price_threshold(config: configs.AblationsConfig, threshold: float) -> dict:
    """DPWS's cost of aggregating at keep threshold T: per call, of `calls` calls, and the calls
    that fit in `budget_epsilon` (dp-accounting PLD; each call's δ added on top)."""
    if threshold <= 1:
        return {"epsilon_per_call": None, "epsilon_of_calls": None, "calls_in_budget": 0}
    per_call = aggregators.dpws_epsilon_at(threshold, config.call_delta)
    event = accounting.dpws_event(per_call)
    return {
        "epsilon_per_call": per_call,
        "epsilon_of_calls": accounting.epsilon_of_steps(
            event, steps=config.calls, delta=config.composition_delta
        ),
        "calls_in_budget": accounting.max_steps(
            event, epsilon=config.budget_epsilon, delta=config.composition_delta
        ),
    }


def run_privacy_cost(config: configs.AblationsConfig, key: jax.Array, log) -> list[dict]:
    rows = []
    for k in config.cost_set_sizes:
        key, key_logits, key_hist = jax.random.split(key, 3)
        logits, secret = _ensemble(config, key_logits, k)
        probs = _probabilities(logits)
        row = {"k": k}
        for sampler in SAMPLERS:
            hist = _histograms(sampler, key_hist, logits, config.num_histograms)
            threshold = metrics.threshold_at_coverage(hist, config.coverage_level)
            cost = price_threshold(config, threshold)
            measured = None
            if cost["epsilon_per_call"] is not None:
                key, key_yield = jax.random.split(key)
                estimate = diversity.output_distribution(
                    key_yield,
                    probs,
                    sampler=sampler,
                    aggregator=diversity.dpws_aggregator(
                        cost["epsilon_per_call"], config.call_delta, 1.0
                    ),
                    num_draws=config.yield_draws,
                )
                measured = float(1.0 - estimate.probs[-1])
            row[sampler] = {"threshold": threshold, **cost, "dpws_yield": measured}
        rows.append(row)
        hot, cold = row["coordinated"], row["independent"]
        log(
            f"(g) k = {k}: T {hot['threshold']:.0f} vs {cold['threshold']:.0f}; calls within"
            f" ε = {config.budget_epsilon:g}: {hot['calls_in_budget']} vs {cold['calls_in_budget']}"
        )
    return rows


# --------------------------------------------------------------------------------------------
# (h) API-only teachers.
# --------------------------------------------------------------------------------------------


def run_api_teachers(config: configs.AblationsConfig, key: jax.Array, log) -> list[dict]:
    rows = []
    for k in config.temperature_set_sizes:
        key, key_logits, key_hist = jax.random.split(key, 3)
        logits, secret = _ensemble(config, key_logits, k)
        cases = [(m, "coordinated") for m in config.api_samples]
        cases += [(None, "coordinated"), (None, "independent")]
        for m, sampler in cases:
            key, key_answers = jax.random.split(key)
            estimate = logits if m is None else sampled_logits(key_answers, logits, m)
            hist = _histograms(sampler, key_hist, estimate, config.num_histograms)
            row = {"k": k, "samples": m, "sampler": sampler}
            row.update(_histogram_row(config, hist, secret))
            rows.append(row)
            log(
                f"(h) k = {k}, m = {m or 'exact'} {sampler}: coverage at n/2"
                f" {row['coverage_at_half']:.2f}, T {row['threshold']:.0f}"
            )
    return rows


# --------------------------------------------------------------------------------------------
# (i) Steps with no output.
# --------------------------------------------------------------------------------------------


def largest_epsilon(cost: Callable[[float], float], target: float) -> float:
    """The largest per-answer ε (to 0.1%) whose run `cost(ε)` stays <= `target`; cost grows
    with ε."""
    low, high = 1e-4, target
    if cost(low) > target:
        raise ValueError(f"even ε = {low} per answer costs more than {target}.")
    while high / low > 1.001:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if cost(middle) <= target else (low, middle)
    return low


def _stream(config, key, steps):
    """`steps` coordinated histograms, `answerable_steps` of them from the answerable ensemble
    (one token shared by all), in a random order; returns them, the answerable mask and the
    shared token."""
    key_a, key_b, key_ha, key_hb, key_order = jax.random.split(key, 5)
    answerable = config.answerable_steps
    logits_a, secret = _ensemble(config, key_a, 1)
    logits_b, _ = diversity.secret_set_logits(
        key_b,
        num_teachers=config.num_teachers,
        vocab_size=config.vocab_size,
        set_size=1,
        private_mass=0.99,
        heterogeneity=config.heterogeneity,
        background_mass=config.background_mass,
    )
    hist = jnp.concatenate(
        [
            _histograms("coordinated", key_ha, logits_a, answerable),
            _histograms("coordinated", key_hb, logits_b, steps - answerable),
        ]
    )
    mask = np.arange(steps) < answerable
    order = np.asarray(jax.random.permutation(key_order, steps))
    return hist[order], mask[order], int(secret[0])


@jax.jit
def _every_step(key, histograms, threshold, epsilon):
    keys = jax.random.split(key, histograms.shape[0])
    return jax.vmap(aggregators.dpargmax_laplace, in_axes=(0, 0, None, None))(
        keys, histograms, threshold, epsilon
    )


@jax.jit(static_argnums=2)
def _sparse_stream(key, histograms, config: sparse.SparseConfig):
    key_start, key_steps = jax.random.split(key)

    def body(state, inputs):
        step_key, counts = inputs
        token, state = sparse.step(step_key, state, counts, config)
        return state, token

    keys = jax.random.split(key_steps, histograms.shape[0])
    _, tokens = jax.lax.scan(body, sparse.start(key_start, config), (keys, histograms))
    return tokens


def _stream_row(steps, method, tokens, answerable, secret, **accounting_fields) -> dict:
    tokens = np.asarray(tokens)
    return {
        "steps": steps,
        "method": method,
        **accounting_fields,
        "answered": float((tokens[answerable] >= 0).mean()),
        "correct": float((tokens[answerable] == secret).mean()),
        "answered_unanswerable": float((tokens[~answerable] >= 0).mean()),
    }


def run_stream(config: configs.AblationsConfig, key: jax.Array, log) -> list[dict]:
    rows = []
    threshold = config.num_teachers / 2
    target, delta = config.stream_epsilon, config.stream_delta

    def gate(select_epsilon):
        return sparse.SparseConfig(
            threshold=threshold,
            max_answers=config.max_answers,
            gate_epsilon=config.gate_epsilon,
            threshold_share=config.gate_threshold_share,
            select_epsilon=select_epsilon,
        )

    select = largest_epsilon(lambda e: sparse.epsilon(gate(e), delta), target)
    for steps in config.stream_steps:
        key, key_stream, key_every, key_sparse = jax.random.split(key, 4)
        histograms, answerable, secret = _stream(config, key_stream, steps)

        def every_step_cost(epsilon, steps=steps):
            event = accounting.dpargmax_laplace_event(epsilon)
            return accounting.epsilon_of_steps(event, steps=steps, delta=delta)

        per_call = largest_epsilon(every_step_cost, target)
        tokens = _every_step(key_every, histograms, threshold, per_call)
        rows.append(
            _stream_row(
                steps,
                "dpargmax",
                tokens,
                answerable,
                secret,
                epsilon=every_step_cost(per_call),
                per_answer_epsilon=per_call,
                max_answers=None,
            )
        )
        tokens = _sparse_stream(key_sparse, histograms, gate(select))
        rows.append(
            _stream_row(
                steps,
                "sparse",
                tokens,
                answerable,
                secret,
                epsilon=sparse.epsilon(gate(select), delta),
                per_answer_epsilon=select,
                max_answers=config.max_answers,
            )
        )
        for row in rows[-2:]:
            log(
                f"(i) {steps} steps, {row['method']}: ε {row['epsilon']:.3f}, answered"
                f" {row['answered']:.2f} ({row['correct']:.2f} correct) of the answerable,"
                f" {row['answered_unanswerable']:.3f} of the others"
            )
    return rows


# --------------------------------------------------------------------------------------------
# (j) Individual accounting.
# --------------------------------------------------------------------------------------------


def group_stream(config: configs.AblationsConfig, key: jax.Array, steps: int) -> dict:
    """The public description of a heterogeneous stream of `steps` steps: the group steps
    (`individual_group_share` of them, at random), each one's group (`individual_group_size`
    random teachers) as an `(steps, n)` mask (all False off the group steps), a token per step
    (the group's, at a group step), the teachers' fixed jitter directions `(n, V)` and the keys
    of the public model's logits."""
    key_steps, key_groups, key_tokens, key_jitter, key_public = jax.random.split(key, 5)
    n, vocab = config.num_teachers, config.vocab_size
    group_steps = max(1, round(config.individual_group_share * steps))
    is_group = np.zeros(steps, bool)
    is_group[np.asarray(jax.random.permutation(key_steps, steps))[:group_steps]] = True
    size = config.individual_group_size
    chosen = jax.vmap(lambda k: jax.random.permutation(k, n)[:size])(
        jax.random.split(key_groups, steps)
    )
    members = np.zeros((steps, n), bool)
    members[np.repeat(np.arange(steps), size), np.asarray(chosen).ravel()] = True
    return {
        "is_group": is_group,
        "members": members & is_group[:, None],
        "tokens": np.asarray(jax.random.randint(key_tokens, (steps,), 0, vocab)),
        "jitter": jax.random.normal(key_jitter, (n, vocab), jnp.float32),
        "public_keys": jax.random.split(key_public, steps),
    }


@jax.jit(static_argnames=("mechanism", "logit_scale", "group_mass"))
def _individual_scan(
    key,
    public_keys,
    tokens,
    members,
    jitter,
    heterogeneity,
    budget,
    *,
    mechanism,
    logit_scale,
    group_mass,
):
    """`individual.individual_step` over a stream built step by step from `group_stream`'s
    arrays: the public logits logit_scale·N(0, 1) with the step's token at their minimum, every
    teacher at the public logits + heterogeneity·jitter, and the group's teachers with
    `group_mass` on the step's token. Returns (tokens, from_public, final charges)."""
    vocab = jitter.shape[1]
    index = jnp.arange(vocab)

    def body(charges, inputs):
        step_key, public_key, token, group = inputs
        public = logit_scale * jax.random.normal(public_key, (vocab,), jnp.float32)
        public = jnp.where(index == token, public.min(), public)
        rest = jax.nn.logsumexp(jnp.where(index == token, -jnp.inf, public))
        boost = jnp.log(group_mass / (1.0 - group_mass)) + rest
        teachers = public[None] + heterogeneity * jitter
        teachers = jnp.where(group[:, None] & (index == token)[None], boost, teachers)
        out, charges, info = individual.individual_step(
            step_key, teachers, public, charges, mechanism, budget
        )
        return charges, (out, info.from_public)

    keys = jax.random.split(key, tokens.shape[0])
    charges = jnp.zeros(jitter.shape[0], jnp.int32)
    charges, (out, from_public) = jax.lax.scan(body, charges, (keys, public_keys, tokens, members))
    return out, from_public, charges


def _accounting_row(config, stream, method, mechanism, heterogeneity, key, run) -> dict:
    """Runs the first `run` steps of `stream` under `mechanism`; the row of `method`."""
    out, from_public, charges = _individual_scan(
        key,
        stream["public_keys"][:run],
        jnp.asarray(stream["tokens"][:run]),
        jnp.asarray(stream["members"][:run]),
        stream["jitter"],
        jnp.float32(heterogeneity),
        mechanism.budget,
        mechanism=mechanism,
        logit_scale=config.individual_logit_scale,
        group_mass=config.individual_group_mass,
    )
    out, from_public, charges = map(np.asarray, (out, from_public, charges))
    is_group = stream["is_group"][:run]
    correct = is_group & (out == stream["tokens"][:run])
    steps = len(stream["tokens"])
    if method == "individual":
        ledger = individual.IndividualLedger.start(mechanism, config.num_teachers)
        ledger.record(charges, steps=run)
        mean_charge, max_charge, epsilon = ledger.mean_charge, ledger.max_charge, ledger.epsilon
        exhausted = int((charges == mechanism.budget).sum())
    else:  # every teacher charged at every step run
        mean_charge, max_charge = float(run), run
        epsilon = individual.rdp_epsilon(mechanism.sigma, run, mechanism.delta)
        exhausted = config.num_teachers if run == mechanism.budget else 0
    return {
        "steps": steps,
        "heterogeneity": heterogeneity,
        "method": method,
        "sigma": mechanism.sigma,
        "threshold": mechanism.threshold,
        "budget": mechanism.budget,
        "steps_run": run,
        "group_steps": int(stream["is_group"].sum()),
        "group_correct": int(correct.sum()),
        "other_histogram_tokens": int((~from_public & ~correct).sum()),
        "fallback_tokens": int(from_public.sum()),
        "mean_charge": mean_charge,
        "max_charge": max_charge,
        "teachers_exhausted": exhausted,
        "epsilon": epsilon,
        "delta": mechanism.delta,
    }


def run_individual(config: configs.AblationsConfig, key: jax.Array, log) -> list[dict]:
    target, delta, vocab = config.stream_epsilon, config.stream_delta, config.vocab_size

    def mechanism(sigma):
        return individual.IndividualConfig(
            sigma=sigma,
            threshold=individual.threshold_for(sigma, vocab, config.individual_eta),
            epsilon=target,
            delta=delta,
        )

    filtered = mechanism(config.individual_sigma)
    rows = []
    for steps in config.stream_steps:
        key, key_stream, key_run = jax.random.split(key, 3)
        stream = group_stream(config, key_stream, steps)
        wide = mechanism(individual.sigma_for_steps(steps, target, delta))
        for heterogeneity in config.individual_heterogeneity:
            cases = (
                ("individual", filtered, steps),
                ("standard_stop", filtered, min(steps, filtered.budget)),
                ("standard_sigma", wide, steps),
            )
            for method, mech, run in cases:
                row = _accounting_row(config, stream, method, mech, heterogeneity, key_run, run)
                rows.append(row)
                log(
                    f"(j) {steps} steps, h = {heterogeneity:g}, {ACCOUNTINGS[method]}:"
                    f" {row['steps_run']} run, {row['group_correct']}/{row['group_steps']} group"
                    f" tokens, {row['fallback_tokens']} fallback, charges mean"
                    f" {row['mean_charge']:.1f} max {row['max_charge']} (M = {row['budget']}),"
                    f" ε {row['epsilon']:.3f}"
                )
    return rows


# --------------------------------------------------------------------------------------------
# The run and its report.
# --------------------------------------------------------------------------------------------

PARTS = {
    "temperature": run_temperature,
    "aggregators": run_aggregators,
    "privacy_cost": run_privacy_cost,
    "api_teachers": run_api_teachers,
    "stream": run_stream,
    "individual": run_individual,
}


def main(
    config: configs.AblationsConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs the six parts; returns (and, with `out`, writes) the results."""
    start = time.time()
    log = progress_log(config.progress, start)

    key = randomness.prng_key(config.seed if reproducible else randomness.secret_seed())
    results: dict = {"config": dataclasses.asdict(config)}
    for (name, run), part_key in zip(PARTS.items(), jax.random.split(key, len(PARTS)), strict=True):
        part_start = time.time()
        results[name] = run(config, part_key, log)
        results.setdefault("part_seconds", {})[name] = time.time() - part_start
    results.update(noise_seeded=reproducible, seconds=time.time() - start, provenance=provenance())
    return finish(out, results, markdown(config, results), plots={"hot_pate_ablations.png": plot})


def _number(value: float | None, digits: int = 2, missing: str = "-") -> str:
    return missing if value is None else f"{value:.{digits}f}"


def _epsilon(value: float | None) -> str:
    return "no ε" if value is None else f"{value:.3g}"


def markdown(config: configs.AblationsConfig, results: dict) -> str:
    """The tables and their settings as a titled markdown page."""
    n, level = config.num_teachers, config.coverage_level
    lines = [
        f"# {TITLE}",
        "",
        f"(e) Teacher temperature: coverage at T = n/2, the largest T with coverage >= {level:g},"
        " and the share of the votes passing that T that fall on the secret tokens.",
        "",
        "| k | t | coverage at n/2 coord. | indep. | T at coverage coord. | indep. | secret share"
        " coord. | indep. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["temperature"]:
        hot, cold = row["coordinated"], row["independent"]
        lines.append(
            f"| {row['k']} | {row['temperature']:g} | {hot['coverage_at_half']:.2f} |"
            f" {cold['coverage_at_half']:.2f} | {hot['threshold']:.0f} | {cold['threshold']:.0f}"
            f" | {_number(hot['secret_share'])} | {_number(cold['secret_share'])} |"
        )
    lines += [
        "",
        "(f) Aggregators: yield, total variation between the output given a yield and the"
        " teachers' average over the shared tokens, and tokens output (heterogeneous: groups"
        f" transferred of {len(config.group_sizes)}).",
        "",
        "| ensemble | aggregator | T | yield coord. | indep. | TV coord. | indep. | tokens coord."
        " | indep. |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    rows = results["aggregators"]
    for first in (r for r in rows if r["sampler"] == "coordinated"):
        second = next(
            r
            for r in rows
            if (r["ensemble"], r["aggregator"]) == (first["ensemble"], first["aggregator"])
            and r["sampler"] == "independent"
        )

        def tokens(row):
            if "groups_transferred" in row:
                return f"{row['tokens_out']} ({row['groups_transferred']} groups)"
            return str(row["tokens_out"])

        threshold = f"{first['threshold']:.3g}"
        lines.append(
            f"| {first['ensemble']} | {first['aggregator']} | {threshold} | {first['yield']:.2f}"
            f" | {second['yield']:.2f} | {_number(first['total_variation'], 3)} |"
            f" {_number(second['total_variation'], 3)} | {tokens(first)} | {tokens(second)} |"
        )
    lines += [
        "",
        f"(g) Privacy cost at coverage {level:g}: the largest T each sampler passes, priced by"
        f" DPWS (δ = {config.call_delta:g} per call): per-call ε, the ε of {config.calls} calls,"
        f" the calls within ε = {config.budget_epsilon:g}, and DPWS's measured yield at that"
        " per-call ε.",
        "",
        f"| k | T coord. | indep. | ε per call coord. | indep. | ε of {config.calls} calls coord."
        f" | indep. | calls in ε = {config.budget_epsilon:g} coord. | indep. | DPWS yield coord."
        " | indep. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["privacy_cost"]:
        hot, cold = row["coordinated"], row["independent"]
        lines.append(
            f"| {row['k']} | {hot['threshold']:.0f} | {cold['threshold']:.0f} |"
            f" {_epsilon(hot['epsilon_per_call'])} | {_epsilon(cold['epsilon_per_call'])} |"
            f" {_epsilon(hot['epsilon_of_calls'])} | {_epsilon(cold['epsilon_of_calls'])} |"
            f" {hot['calls_in_budget']} | {cold['calls_in_budget']} |"
            f" {_number(hot['dpws_yield'])} | {_number(cold['dpws_yield'])} |"
        )
    lines += [
        "",
        "(h) API-only teachers known through m sampled answers each: coordinated sampling on the"
        " estimates, beside the exact distributions.",
        "",
        f"| k | teachers | sampler | coverage at n/2 | T at coverage {level:g} | secret share |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["api_teachers"]:
        what = "exact" if row["samples"] is None else f"m = {row['samples']}"
        lines.append(
            f"| {row['k']} | {what} | {row['sampler']} | {row['coverage_at_half']:.2f} |"
            f" {row['threshold']:.0f} | {_number(row['secret_share'])} |"
        )
    lines += [
        "",
        f"(i) Steps with no output: streams with {config.answerable_steps} answerable steps, at"
        f" a total (ε, δ) = ({config.stream_epsilon:g}, {config.stream_delta:g}), T = n/2.",
        "",
        "| steps | method | ε per answer | answers c | ε spent | answered (answerable) | correct"
        " token | answered (others) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["stream"]:
        name = STREAM_METHODS[row["method"]]
        cap = "-" if row["max_answers"] is None else str(row["max_answers"])
        lines.append(
            f"| {row['steps']} | {name} | {row['per_answer_epsilon']:.3g} | {cap} |"
            f" {row['epsilon']:.3f} | {row['answered']:.2f} | {row['correct']:.2f} |"
            f" {row['answered_unanswerable']:.3f} |"
        )
    lines += [
        "",
        f"(j) Individual accounting: heterogeneous streams of n = {n} teachers, each teacher at"
        f" (ε, δ) = ({config.stream_epsilon:g}, {config.stream_delta:g}); group tokens released"
        " among the group steps, other tokens from the noisy histogram, tokens from the public"
        " fallback, and the charges per teacher (M: the charges the budget allows).",
        "",
        "| steps | h | accounting | σ | T | steps run | group tokens | other histogram tokens |"
        " public fallback | mean charge | max charge | M | ε |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results["individual"]:
        lines.append(
            f"| {row['steps']} | {row['heterogeneity']:g} | {ACCOUNTINGS[row['method']]} |"
            f" {row['sigma']:.3g} | {row['threshold']:.3g} | {row['steps_run']} |"
            f" {row['group_correct']} / {row['group_steps']} | {row['other_histogram_tokens']} |"
            f" {row['fallback_tokens']} | {row['mean_charge']:.1f} | {row['max_charge']} |"
            f" {row['budget']} | {row['epsilon']:.3f} |"
        )
    groups = ", ".join(str(g) for g in config.group_sizes)
    lines += [
        "",
        f"Setting: n = {n} teachers. Secret-set ensembles (e, g, h; V = {config.vocab_size}):"
        f" {1 - config.private_mass - config.background_mass:g} of each teacher's mass on k"
        f" shared secret tokens (logit jitter {config.heterogeneity:g}), {config.private_mass:g}"
        f" on a private token of its own, {config.background_mass:g} spread over V;"
        f" r = {config.num_histograms} histograms per setting. (f): homogeneous = k ="
        f" {config.homogeneous_set_size} secret tokens shared by all, T = n/2; heterogeneous ="
        f" groups of {groups} identical teachers, each over its own 2 tokens (0.6, 0.4),"
        f" T = {min(config.group_sizes) / 2:g}; DPARGMAX at ε = {config.aggregator_epsilon:g},"
        f" DPWS at (ε, δ) = ({config.aggregator_epsilon:g}, {config.aggregator_delta:g}) keeping"
        " noisy counts above T or its stability threshold, whichever is larger,"
        f" {config.aggregator_draws} draws each. (g): ε composed by dp-accounting's PLD"
        f" accountant at δ = {config.composition_delta:g}, each call's δ added on top; 'no ε':"
        " coverage needs T = 1, which no DPWS reaches. (i): answerable steps from the k = 1"
        " ensemble, the others from teachers with 0.99 of their mass on a private token;"
        " DPARGMAX charged on every step at the per-call ε whose dp-accounting composition"
        " over each stream is the total; the sparse gate"
        f" (`pate.sparse`, gate ε = {config.gate_epsilon:g} of which"
        f" {config.gate_threshold_share:g} on the threshold, c = {config.max_answers})"
        " charged for its c answers only, its selections' ε the largest that keeps the run's"
        " ε (dp-accounting PLD) at the total. (j): public logits"
        f" {config.individual_logit_scale:g}·N(0, 1) over V = {config.vocab_size}, fresh each"
        " step; every teacher at the public logits plus a fixed jitter h·N(0, 1) of its own; at"
        f" {config.individual_group_share:g} of the steps a random group of"
        f" {config.individual_group_size} teachers puts {config.individual_group_mass:g} of its"
        " mass on the public model's least likely token. One mechanism (`pate.individual`):"
        " votes under shared Gumbel noise, a teacher agreeing with the public vote abstains,"
        " Gaussian noise σ on every count, a token with noisy count >= T ="
        f" σ·sqrt(2·ln(V/{config.individual_eta:g})) drawn in proportion to it, else the public"
        " vote. Individual: a Rényi filter charges a teacher only when it votes, at most M times;"
        " standard: every teacher charged at every step, so the run stops after M steps, or σ is"
        " the smallest whose M covers the stream. ε: dp-accounting's RDP of M (individual) or"
        " of the steps run (standard) Gaussian compositions; the charges are measured.",
        SEEDED_NOTE if results.get("noise_seeded") else "Draws secret.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """T at coverage vs temperature, calls within the budget vs k, coverage vs m, and (j)'s
    group tokens released vs the stream's length.

    Draws from `results` alone (`results.json` read back will do).
    """
    config = results["config"]
    fig, (temp_ax, cost_ax, api_ax, individual_ax) = plt.subplots(1, 4, figsize=(20, 4.5))
    styles = {"coordinated": "-", "independent": "--"}
    for index, k in enumerate(config["temperature_set_sizes"]):
        rows = [r for r in results["temperature"] if r["k"] == k]
        for sampler, style in styles.items():
            temp_ax.plot(
                [r["temperature"] for r in rows],
                [r[sampler]["threshold"] for r in rows],
                style,
                marker="o",
                color=f"C{index}",
                label=f"k = {k}, {sampler}",
            )
    temp_ax.set(
        xlabel="teacher temperature t",
        ylabel=f"largest T with coverage >= {config['coverage_level']:g}",
    )
    temp_ax.legend(fontsize=8)
    cost = results["privacy_cost"]
    for sampler, style in styles.items():
        cost_ax.plot(
            [r["k"] for r in cost],
            [max(r[sampler]["calls_in_budget"], 0.5) for r in cost],
            style,
            marker="o",
            color="k",
            label=sampler,
        )
    cost_ax.set(
        xscale="log",
        yscale="log",
        xlabel="k (secret tokens)",
        ylabel=f"DPWS calls within ε = {config['budget_epsilon']:g} (0 drawn at 0.5)",
    )
    cost_ax.legend(fontsize=8)
    for index, k in enumerate(config["temperature_set_sizes"]):
        rows = [r for r in results["api_teachers"] if r["k"] == k]
        sampled = [r for r in rows if r["samples"] is not None]
        api_ax.plot(
            [r["samples"] for r in sampled],
            [r["coverage_at_half"] for r in sampled],
            marker="o",
            color=f"C{index}",
            label=f"k = {k}, m answers",
        )
        for row in rows:
            if row["samples"] is None:
                api_ax.axhline(
                    row["coverage_at_half"],
                    color=f"C{index}",
                    linestyle=styles[row["sampler"]],
                    linewidth=0.8,
                    label=f"k = {k}, exact, {row['sampler']}",
                )
    api_ax.set(xscale="log", xlabel="answers per teacher m", ylabel="coverage at T = n/2")
    api_ax.legend(fontsize=7)
    for index, method in enumerate(ACCOUNTINGS):
        for position, heterogeneity in enumerate(config["individual_heterogeneity"]):
            style = ("-", "--", ":", "-.")[position % 4]
            rows = [
                r
                for r in results["individual"]
                if r["method"] == method and r["heterogeneity"] == heterogeneity
            ]
            individual_ax.plot(
                [r["steps"] for r in rows],
                [r["group_correct"] / r["group_steps"] for r in rows],
                style,
                marker="o",
                color=f"C{index}",
                label=f"{ACCOUNTINGS[method]}, h = {heterogeneity:g}",
            )
    individual_ax.set(
        xscale="log",
        xlabel="stream length (steps)",
        ylabel="group tokens released / group steps",
        ylim=(-0.02, 1.02),
    )
    individual_ax.legend(fontsize=7)
    fig.suptitle(
        f"Hot PATE ablations, n = {config['num_teachers']} synthetic teachers;"
        f" r = {config['num_histograms']} histograms per point",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="hot_pate_ablations",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, hot_pate_ablations.png",
    examples=("--out runs/hot_pate_ablations --reproducible", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    seeds="one",
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("hot_pate_ablations"):
        cli()
