"""Hot PATE scaling: queries within a budget against the number of teachers, and histogram shape.

(1) Queries against n: for secret-set ensembles of n teachers over k shared tokens, the largest
    threshold T(n) whose coverage stays at a target, and the aggregator calls at that T that fit
    in one total (ε, δ), for DPWS and for the Gaussian thresholded release, coordinated against
    independent sampling; the growth is the log-log slope of the calls against n. Both
    aggregators' noise is proportional to T (DPWS's Laplace scale 2/ε = (T - 1)/ln(1/δ_call),
    the Gaussian σ = T/sqrt(2·ln(V/η))). The Gaussian composition of c calls is that of one
    call with noise σ/sqrt(c), so its calls grow as T², hence as n² where T grows as n. DPWS's
    Laplace calls compose the same way only while the per-call ε is small; near ε = 1 per call
    the composed ε grows about linearly in the calls, which then grow about as T.
(2) Histogram shape: over many histograms of one ensemble, the distribution of the top count /
    n and of the top-1 minus top-2 margin / n, coordinated against independent sampling.

All teachers are synthetic; nothing here reads sensitive data. The draws are seeded by the
config's seed with `--reproducible`, otherwise secret.

Command and settings: see `experiments/configs/hot_pate_scaling.py`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time

import matplotlib

matplotlib.use("Agg")

import dp_accounting  # noqa: E402
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax.pate import accounting, aggregators, diversity, individual, metrics  # noqa: E402
from dpmix_jax.pate import samplers as pate_samplers  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, randomness  # noqa: E402
from dpmix_jax.privacy import accounting as privacy_accounting  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import hot_pate_scaling as configs  # noqa: E402
from experiments.harness import Command, finish, progress_log  # noqa: E402

TITLE = "Hot PATE scaling: queries within a budget against n, and histogram shape"
SAMPLERS = {
    "coordinated": pate_samplers.coordinated_histograms,
    "independent": pate_samplers.independent_histograms,
}
AGGREGATORS = {"dpws": "DPWS", "gaussian": "Gaussian"}
ENSEMBLES = {"secret_set": "secret set", "long_tailed": "long-tailed"}


def _histograms(sampler: str, key: jax.Array, logits: jax.Array, r: int) -> np.ndarray:
    return np.asarray(SAMPLERS[sampler](key, logits, r, batch_size=256))


# --------------------------------------------------------------------------------------------
# (1) Queries against the number of teachers.
# --------------------------------------------------------------------------------------------


def dpws_calls(config: configs.ScalingConfig, threshold: float) -> dict:
    """DPWS at keep threshold T: its per-call ε, the calls within the budget (PLD at the budget's
    δ, each call's δ on top) and the δ those calls spend in all; no ε and no calls for T <= 1."""
    if threshold <= 1:
        return {"epsilon_per_call": None, "calls": 0, "delta_total": 0.0}
    per_call = aggregators.dpws_epsilon_at(threshold, config.call_delta)
    event = accounting.dpws_event(per_call)
    limit = 2  # doubled past the answer, so the accountant never composes far more calls
    while accounting.epsilon_of_steps(event, steps=limit, delta=config.budget_delta) <= (
        config.budget_epsilon
    ):
        limit *= 2
    calls = accounting.max_steps(
        event, epsilon=config.budget_epsilon, delta=config.budget_delta, limit=limit
    )
    delta_total = config.budget_delta + calls * config.call_delta if calls else 0.0
    return {"epsilon_per_call": per_call, "calls": calls, "delta_total": delta_total}


def gaussian_multiplier(config: configs.ScalingConfig) -> float:
    """The smallest Gaussian noise multiplier whose one call is within the budget's (ε, δ)
    (dp-accounting PLD, `privacy.accounting.calibrate`)."""
    return privacy_accounting.calibrate(
        dp_accounting.GaussianDpEvent,
        target_epsilon=config.budget_epsilon,
        delta=config.budget_delta,
    )


def gaussian_calls(
    config: configs.ScalingConfig, threshold: float, budget_multiplier: float
) -> dict:
    """The Gaussian thresholded release whose threshold σ·sqrt(2·ln(V/η)) is T: its σ and the
    calls within the budget.

    Under the vote-move relation (L2 sensitivity √2) a call is the Gaussian mechanism with
    multiplier σ/√2, and c calls compose to one with multiplier σ/√(2c): they fit in the budget
    while σ/√(2c) >= `budget_multiplier` (`gaussian_multiplier`), so c = ⌊(σ/√2)² /
    budget_multiplier²⌋.
    """
    if threshold <= 0:
        return {"sigma": None, "calls": 0}
    sigma = threshold / individual.threshold_for(1.0, config.vocab_size, config.gaussian_eta)
    calls = math.floor(sigma**2 / (2.0 * budget_multiplier**2))
    return {"sigma": sigma, "calls": calls}


def log_log_slope(counts, values) -> dict:
    """Least-squares slope of log(value) against log(n) over the points with value >= 1, the
    local slope between the two largest n (None unless both are >= 1), and the smallest n
    with value >= 1 (None if none)."""
    points = [(n, v) for n, v in zip(counts, values, strict=True) if v >= 1]
    slope = None
    if len(points) >= 2:
        x, y = np.log([p[0] for p in points]), np.log([p[1] for p in points])
        slope = float(np.polyfit(x, y, 1)[0])
    (n1, v1), (n2, v2) = zip(counts[-2:], values[-2:], strict=True)
    top = float(math.log(v2 / v1) / math.log(n2 / n1)) if min(v1, v2) >= 1 else None
    return {
        "slope": slope,
        "slope_top": top,
        "first_n": points[0][0] if points else None,
        "points": len(points),
    }


def run_queries(config: configs.ScalingConfig, key: jax.Array, log) -> dict:
    budget_multiplier = gaussian_multiplier(config)
    rows = []
    for k in config.set_sizes:
        for n in config.teacher_counts:
            key, key_logits, key_hist = jax.random.split(key, 3)
            logits, _ = diversity.secret_set_logits(
                key_logits,
                num_teachers=n,
                vocab_size=config.vocab_size,
                set_size=k,
                private_mass=config.private_mass,
                heterogeneity=config.heterogeneity,
                background_mass=config.background_mass,
            )
            for sampler in SAMPLERS:
                hist = _histograms(sampler, key_hist, logits, config.num_histograms)
                threshold = metrics.threshold_at_coverage(hist, config.coverage_level)
                rows.append(
                    {
                        "k": k,
                        "n": n,
                        "sampler": sampler,
                        "threshold": threshold,
                        "dpws": dpws_calls(config, threshold),
                        "gaussian": gaussian_calls(config, threshold, budget_multiplier),
                    }
                )
            hot, cold = rows[-2], rows[-1]
            log(
                f"(1) k = {k}, n = {n}: T {hot['threshold']:.0f} vs {cold['threshold']:.0f};"
                f" DPWS calls {hot['dpws']['calls']} vs {cold['dpws']['calls']}, Gaussian"
                f" {hot['gaussian']['calls']} vs {cold['gaussian']['calls']}"
            )
    fits = []
    counts = list(config.teacher_counts)
    for k in config.set_sizes:
        for sampler in SAMPLERS:
            mine = [r for r in rows if r["k"] == k and r["sampler"] == sampler]
            fit = {"k": k, "sampler": sampler}
            fit["threshold"] = log_log_slope(counts, [r["threshold"] for r in mine])
            for name in AGGREGATORS:
                fit[name] = log_log_slope(counts, [r[name]["calls"] for r in mine])
            fits.append(fit)
    return {"gaussian_budget_multiplier": budget_multiplier, "rows": rows, "fits": fits}


# --------------------------------------------------------------------------------------------
# (2) Histogram shape.
# --------------------------------------------------------------------------------------------


def long_tailed_logits(key: jax.Array, config: configs.ScalingConfig) -> jax.Array:
    """Shared logits `logit_scale`·N(0, 1) over V plus a per-teacher `logit_jitter`·N(0, 1)."""
    key_shared, key_jitter = jax.random.split(key)
    n, vocab = config.shape_teachers, config.vocab_size
    shared = config.logit_scale * jax.random.normal(key_shared, (vocab,))
    return shared + config.logit_jitter * jax.random.normal(key_jitter, (n, vocab))


def distribution(values: np.ndarray, config: configs.ScalingConfig) -> dict:
    """Mean, the config's quantiles and the counts in `bins` equal bins on [0, 1] of `values`."""
    return {
        "mean": float(values.mean()),
        "quantiles": [float(q) for q in np.quantile(values, config.quantiles)],
        "histogram": np.histogram(values, bins=config.bins, range=(0.0, 1.0))[0].tolist(),
    }


def run_shape(config: configs.ScalingConfig, key: jax.Array, log) -> list[dict]:
    key_secret, key_tail, key_hist = jax.random.split(key, 3)
    n = config.shape_teachers
    secret_set, _ = diversity.secret_set_logits(
        key_secret,
        num_teachers=n,
        vocab_size=config.vocab_size,
        set_size=config.shape_set_size,
        private_mass=config.private_mass,
        heterogeneity=config.heterogeneity,
        background_mass=config.background_mass,
    )
    rows = []
    for ensemble, logits in (
        ("secret_set", secret_set),
        ("long_tailed", long_tailed_logits(key_tail, config)),
    ):
        average_top = float(jax.nn.softmax(logits, axis=-1).mean(axis=0).max())
        for sampler in SAMPLERS:
            hist = _histograms(sampler, key_hist, logits, config.shape_histograms)
            top = hist.max(axis=1) / n
            margin = np.asarray(metrics.top_margin(hist)) / n
            rows.append(
                {
                    "ensemble": ensemble,
                    "sampler": sampler,
                    "average_top_probability": average_top,
                    "top": distribution(top, config),
                    "margin": distribution(margin, config),
                }
            )
            log(
                f"(2) {ensemble} {sampler}: mean top count / n {rows[-1]['top']['mean']:.2f},"
                f" mean margin / n {rows[-1]['margin']['mean']:.2f}"
            )
    return rows


# --------------------------------------------------------------------------------------------
# The run and its report.
# --------------------------------------------------------------------------------------------

PARTS = {"queries": run_queries, "shape": run_shape}


def main(
    config: configs.ScalingConfig,
    out: pathlib.Path | None = None,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs both parts; returns (and, with `out`, writes) the results."""
    start = time.time()
    log = progress_log(config.progress, start)

    key = randomness.prng_key(config.seed if reproducible else randomness.secret_seed())
    results: dict = {"config": dataclasses.asdict(config)}
    for (name, run), part_key in zip(PARTS.items(), jax.random.split(key, len(PARTS)), strict=True):
        part_start = time.time()
        results[name] = run(config, part_key, log)
        results.setdefault("part_seconds", {})[name] = time.time() - part_start
    results.update(noise_seeded=reproducible, seconds=time.time() - start, provenance=provenance())
    return finish(out, results, markdown(config, results), plots={"hot_pate_scaling.png": plot})


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _epsilon(value: float | None) -> str:
    return "no ε" if value is None else f"{value:.3g}"


def _first(value: int | None) -> str:
    return "none" if value is None else str(value)


def markdown(config: configs.ScalingConfig, results: dict) -> str:
    """The tables and their settings as a titled markdown page."""
    level, budget = config.coverage_level, config.budget_epsilon
    lines = [
        f"# {TITLE}",
        "",
        f"(1) Queries against n: the largest T with coverage >= {level:g}, DPWS's per-call ε at"
        f" that T, and the calls within ε = {budget:g} of DPWS and of the Gaussian thresholded"
        " release, coordinated (coord.) against independent (indep.) sampling.",
        "",
        "| k | n | T coord. | indep. | DPWS ε per call coord. | indep. | DPWS calls coord. |"
        " indep. | Gaussian calls coord. | indep. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows = results["queries"]["rows"]
    for hot, cold in zip(rows[::2], rows[1::2], strict=True):
        lines.append(
            f"| {hot['k']} | {hot['n']} | {hot['threshold']:.0f} | {cold['threshold']:.0f} |"
            f" {_epsilon(hot['dpws']['epsilon_per_call'])} |"
            f" {_epsilon(cold['dpws']['epsilon_per_call'])} | {hot['dpws']['calls']} |"
            f" {cold['dpws']['calls']} | {hot['gaussian']['calls']} |"
            f" {cold['gaussian']['calls']} |"
        )
    lines += [
        "",
        "Growth with n: the least-squares slope of log against log n over the grid points with"
        " a value >= 1 (from the first such n), and the local slope between the two largest n.",
        "",
        "| k | sampler | T slope | DPWS calls slope | local | first n | Gaussian calls slope |"
        " local | first n |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fit in results["queries"]["fits"]:
        dpws, gaussian = fit["dpws"], fit["gaussian"]
        lines.append(
            f"| {fit['k']} | {fit['sampler']} | {_number(fit['threshold']['slope'])} |"
            f" {_number(dpws['slope'])} | {_number(dpws['slope_top'])} |"
            f" {_first(dpws['first_n'])} | {_number(gaussian['slope'])} |"
            f" {_number(gaussian['slope_top'])} | {_first(gaussian['first_n'])} |"
        )
    quantiles = ", ".join(f"{q:g}" for q in config.quantiles)
    lines += [
        "",
        f"(2) Histogram shape, n = {config.shape_teachers}, r = {config.shape_histograms}: the"
        f" top count / n and the top-1 minus top-2 margin / n at the quantiles {quantiles}, and"
        " the largest probability of the teachers' average distribution.",
        "",
        "| ensemble | sampler | top count / n | margin / n | mean top | mean margin | average"
        " top probability |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results["shape"]:
        top, margin = row["top"], row["margin"]
        lines.append(
            f"| {ENSEMBLES[row['ensemble']]} | {row['sampler']} |"
            f" {' / '.join(f'{q:.2f}' for q in top['quantiles'])} |"
            f" {' / '.join(f'{q:.2f}' for q in margin['quantiles'])} | {top['mean']:.2f} |"
            f" {margin['mean']:.2f} | {row['average_top_probability']:.3f} |"
        )
    largest = max(r["dpws"]["delta_total"] for r in rows)
    lines += [
        "",
        f"Setting: secret-set ensembles over V = {config.vocab_size} tokens:"
        f" {1 - config.private_mass - config.background_mass:g} of each teacher's mass on k"
        f" shared secret tokens (logit jitter {config.heterogeneity:g}), {config.private_mass:g}"
        f" on a private token of its own, {config.background_mass:g} spread over V; a fresh"
        f" ensemble for every (k, n), r = {config.num_histograms} histograms per sampler."
        f" DPWS: δ = {config.call_delta:g} per call, its ε the one whose keep threshold"
        " 1 + (2/ε)·ln(1/δ) is T; the calls composed by dp-accounting's PLD accountant at"
        f" δ = {config.budget_delta:g}, each call's δ on top (at most {largest:.3g} in all on"
        " this grid); 'no ε': T <= 1, which no DPWS reaches. Gaussian: noise σ on every count"
        f" and threshold σ·sqrt(2·ln(V/{config.gaussian_eta:g})) = T, charged on every call"
        " under the vote-move relation (L2 sensitivity √2), PLD at"
        f" (ε, δ) = ({budget:g}, {config.budget_delta:g}). (2): the secret-set ensemble at"
        f" k = {config.shape_set_size}, and a long-tailed one: shared logits"
        f" {config.logit_scale:g}·N(0, 1) over V plus a per-teacher jitter"
        f" {config.logit_jitter:g}·N(0, 1) on every token.",
        SEEDED_NOTE if results.get("noise_seeded") else "Draws secret.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Calls within the budget against n (DPWS, Gaussian), and the distributions of the top
    count / n and of the margin / n.

    Draws from `results` alone (`results.json` read back will do).
    """
    config = results["config"]
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    styles = {"coordinated": "-", "independent": "--"}
    rows = results["queries"]["rows"]
    for ax, (name, label) in zip(axes[:2], AGGREGATORS.items(), strict=True):
        for index, k in enumerate(config["set_sizes"]):
            for sampler, style in styles.items():
                mine = [r for r in rows if r["k"] == k and r["sampler"] == sampler]
                ax.plot(
                    [r["n"] for r in mine],
                    [max(r[name]["calls"], 0.5) for r in mine],
                    style,
                    marker="o",
                    color=f"C{index}",
                    label=f"k = {k}, {sampler}",
                )
        n = np.asarray(config["teacher_counts"], float)
        top = max(max(r[name]["calls"] for r in rows), 1) / 4  # below the lines it guides
        ax.plot(n, top * (n / n[-1]) ** 2, ":", color="grey", label="∝ n²")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="teachers n",
            ylabel=f"{label} calls within ε = {config['budget_epsilon']:g} (0 drawn at 0.5)",
        )
        ax.legend(fontsize=7)
    edges = np.linspace(0.0, 1.0, config["bins"] + 1)
    for ax, field, xlabel in (
        (axes[2], "top", "top count / n"),
        (axes[3], "margin", "top-1 minus top-2 margin / n"),
    ):
        for index, ensemble in enumerate(ENSEMBLES):
            for sampler, style in styles.items():
                row = next(
                    r
                    for r in results["shape"]
                    if r["ensemble"] == ensemble and r["sampler"] == sampler
                )
                counts = np.asarray(row[field]["histogram"], float)
                ax.stairs(
                    counts / counts.sum(),
                    edges,
                    linestyle=style,
                    color=f"C{index}",
                    label=f"{ENSEMBLES[ensemble]}, {sampler}",
                )
        ax.set(xlabel=xlabel, ylabel="share of histograms", yscale="log")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"Hot PATE scaling: secret-set teachers, coverage {config['coverage_level']:g};"
        f" shapes at n = {config['shape_teachers']}, r = {config['shape_histograms']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="hot_pate_scaling",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, hot_pate_scaling.png",
    examples=("--out runs/hot_pate_scaling --reproducible", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    seeds="one",
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("hot_pate_scaling"):
        cli()
