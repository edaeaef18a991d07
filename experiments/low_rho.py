"""DP-MixMin against Uniform at ρ = 0.1 on the text stand-in: the noise in λ with few users.

See `experiments/configs/low_rho.py` for the command, the conditions and what the run is expected
to show. Part one runs the mixture stage alone over many noise draws per seed and setting, and
scores each λ by its cosine to the population mixture λ*. Part two runs the whole pipeline per
seed (each seed one split and one noise stream for all arms): Uniform, DP-MixMin and non-private
MixMin at the studied ρ, DP-MixMin's λ at larger mixture ε fine-tuned at the run's ε, and
DP-MixMin at the reference ρ. Every pipeline stage is stored under `--out/stages`, so an
interrupted study resumes where it stopped. Writes results.json, results.md and low_rho.png.

    python -m experiments.low_rho --reproducible --quiet --out runs/low_rho
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.mixing import cosine_similarity
from dpmix_jax.mixing.solvers import dp_mixmin
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.stage_store import weights_key
from dpmix_jax.pipeline.text import TextPipeline
from dpmix_jax.pipeline.text_presets import text_task
from experiments.common_args import experiment_main
from experiments.configs import low_rho as configs
from experiments.harness import Command, finish

ARM_LABELS = {
    "uniform": "Uniform",
    "dp_mixmin": "DP-MixMin",
    "nonprivate_mixmin": "non-private MixMin",
}


def mixture_arm(epsilon: float) -> str:
    """The arm name of DP-MixMin's λ at mixture ε `epsilon`, fine-tuned at the run's ε."""
    return f"dp_mixmin_mix{epsilon:g}"


def reference_arm(mix_fraction: float) -> str:
    """The arm name of DP-MixMin at the reference ρ `mix_fraction`."""
    return f"dp_mixmin_rho{mix_fraction:g}"


def arm_label(arm: str) -> str:
    """How tables name `arm`."""
    if arm in ARM_LABELS:
        return ARM_LABELS[arm]
    if arm.startswith("dp_mixmin_mix"):
        return f"DP-MixMin, λ at ε = {arm.removeprefix('dp_mixmin_mix')}"
    return f"DP-MixMin at ρ = {arm.removeprefix('dp_mixmin_rho')}"


def _lambda_rows(
    config: configs.LowRhoConfig,
    pipelines: dict[float, TextPipeline],
    condition: configs.LambdaCondition,
    truth: np.ndarray,
) -> list[dict]:
    """The mixture stage alone at `condition`: one row per seed and noise draw."""
    pipeline = pipelines[condition.mix_fraction]
    settings = pipeline.config.mixture
    batch = settings.batch_size if condition.batch_size is None else condition.batch_size
    label = condition.label(config.pipeline)
    rows = []
    for seed in config.seeds:
        inputs = pipeline.mixture_inputs(seed)
        for draw in range(config.lambda_draws):
            result = dp_mixmin(
                **inputs,
                max_examples_per_user=settings.max_examples_per_user,
                epsilon=condition.epsilon,
                delta=pipeline.config.delta,
                steps=settings.steps,
                batch_size=batch,
                clip_norm=settings.clip_norm,
                learning_rate=settings.learning_rate,
                seed=pipeline.private_seed(seed, "low_rho_lambda", label, draw),
                shift=settings.shift,
                accountant=settings.accountant,
            )
            rows.append(
                {
                    "condition": label,
                    "mix_fraction": condition.mix_fraction,
                    "mixture_epsilon": condition.epsilon,
                    "batch_size": batch,
                    "seed": seed,
                    "draw": draw,
                    "users": result.num_units,
                    "sampling_rate": result.sampling_rate,
                    "noise_multiplier": result.noise_multiplier,
                    "spent_epsilon": result.epsilon,
                    # The standard deviation of the noise summed into one logit over the run.
                    "logit_noise": settings.learning_rate
                    * result.noise_multiplier
                    * settings.clip_norm
                    * np.sqrt(settings.steps)
                    / result.expected_batch_size,
                    "cosine_last": cosine_similarity(result.weights, truth),
                    "cosine_average": cosine_similarity(result.average_weights, truth),
                }
            )
    return rows


def _pipeline_rows(
    config: configs.LowRhoConfig, pipelines: dict[float, TextPipeline], seed: int, truth
) -> list[dict]:
    """Every pipeline arm at `seed`, one row each."""
    epsilon = config.epsilon
    pipeline = pipelines[config.mix_fraction]
    nonprivate = pipeline.nonprivate_weights(seed)
    outcomes = {}
    for arm in configs.ARMS:
        run = pipeline.run(arm, epsilon, seed)
        outcomes[arm] = (pipeline, run.utility, run.spent.epsilon, np.asarray(run.weights), None)
    for mixture_epsilon in config.mixture_epsilons:
        weights, mixture_spent = pipeline.mixture(mixture_epsilon, seed)
        init = pipeline.pretrained(weights, seed)
        model, spent = pipeline.finetune(init, weights_key(weights), "ft", epsilon, seed)
        # Parallel composition: D_mix and D_ft are disjoint, end to end the larger ε.
        spent = max(mixture_spent.epsilon, spent.epsilon)
        outcomes[mixture_arm(mixture_epsilon)] = (
            pipeline, pipeline.utility(model, "test"), spent, weights, mixture_epsilon
        )  # fmt: skip
    reference = pipelines[config.reference_mix_fraction]
    run = reference.run("dp_mixmin", epsilon, seed)
    outcomes[reference_arm(config.reference_mix_fraction)] = (
        reference, run.utility, run.spent.epsilon, np.asarray(run.weights), None
    )  # fmt: skip
    rows = []
    for arm, (source, utility, spent, weights, mixture_epsilon) in outcomes.items():
        mix, _ = source.split(seed)
        rows.append(
            {
                "arm": arm,
                "seed": seed,
                "mix_fraction": source.config.mix_fraction,
                "utility": utility,
                "spent_epsilon": spent,
                "mixture_epsilon": mixture_epsilon,
                "mixture_examples": len(mix),
                "weights": [float(w) for w in weights],
                "cosine_true": cosine_similarity(weights, truth),
                "cosine_nonprivate": cosine_similarity(weights, nonprivate),
            }
        )
    return rows


def summarize_lambdas(rows: list[dict], uniform_cosine: float) -> list[dict]:
    """Per λ condition: the mean users, σ, q and logit noise, the mean cosines to λ* of the
    last and the average iterate, and the shares of λs below Uniform's cosine."""
    summary = []
    for condition in dict.fromkeys(r["condition"] for r in rows):
        here = [r for r in rows if r["condition"] == condition]
        last = np.array([r["cosine_last"] for r in here])
        average = np.array([r["cosine_average"] for r in here])
        summary.append(
            {
                "condition": condition,
                "mix_fraction": here[0]["mix_fraction"],
                "mixture_epsilon": here[0]["mixture_epsilon"],
                "batch_size": here[0]["batch_size"],
                "draws": len(here),
                "users": float(np.mean([r["users"] for r in here])),
                "sampling_rate": float(np.mean([r["sampling_rate"] for r in here])),
                "noise_multiplier": float(np.mean([r["noise_multiplier"] for r in here])),
                "logit_noise": float(np.mean([r["logit_noise"] for r in here])),
                "cosine_last": float(last.mean()),
                "cosine_average": float(average.mean()),
                "below_uniform_last": float(np.mean(last < uniform_cosine)),
                "below_uniform_average": float(np.mean(average < uniform_cosine)),
            }
        )
    return summary


def summarize_arms(runs: list[dict]) -> list[dict]:
    """Per arm: test perplexity over seeds (mean, population std, median), its paired difference
    to Uniform (mean, standard error) and the share of seeds above Uniform."""
    uniform = {r["seed"]: r["utility"] for r in runs if r["arm"] == "uniform"}
    summary = []
    for arm in dict.fromkeys(r["arm"] for r in runs):
        rows = [r for r in runs if r["arm"] == arm]
        utility = np.array([r["utility"] for r in rows])
        differences = np.array([r["utility"] - uniform[r["seed"]] for r in rows])
        error = differences.std(ddof=1) / np.sqrt(len(rows)) if len(rows) > 1 else None
        summary.append(
            {
                "arm": arm,
                "mix_fraction": rows[0]["mix_fraction"],
                "mixture_epsilon": rows[0]["mixture_epsilon"],
                "seeds": len(rows),
                "mixture_examples": float(np.mean([r["mixture_examples"] for r in rows])),
                "utility_mean": float(utility.mean()),
                "utility_std": float(utility.std()),
                "utility_median": float(np.median(utility)),
                "minus_uniform": float(differences.mean()),
                "minus_uniform_se": None if error is None else float(error),
                "worse_than_uniform": float(np.mean(differences > 0)),
                "spent_epsilon": max(r["spent_epsilon"] for r in rows),
                "cosine_true": float(np.mean([r["cosine_true"] for r in rows])),
            }
        )
    return summary


def main(
    config: configs.LowRhoConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs both parts for every seed; writes the results to `out` (the pipeline stages under
    `out/stages`, read back by a rerun) and returns them.

    Privacy: every pipeline arm's spent ε is its accountants' for what ran (parallel
    composition of the disjoint D_mix and D_ft); non-private MixMin's λ is not private (a
    reference). The λ-only draws are each (mixture ε, δ)-DP on D_mix; together they are not
    (many releases of one D_mix): they measure the mechanism, nothing is released from them.
    With `reproducible` the seeds drive the private randomness.
    """
    out = pathlib.Path(out)
    use_compilation_cache(out / "xla_cache")
    task = text_task()
    truth = np.asarray(task.true_weights)
    uniform_cosine = cosine_similarity(np.full(len(truth), 1.0 / len(truth)), truth)
    start = time.perf_counter()
    fractions = {config.mix_fraction, config.reference_mix_fraction}
    fractions |= {c.mix_fraction for c in config.lambda_conditions}
    pipelines = {
        rho: TextPipeline(task, config.pipeline_at(rho), out / "stages", reproducible=reproducible)
        for rho in sorted(fractions)
    }
    lambdas = []
    for condition in config.lambda_conditions:
        lambdas += _lambda_rows(config, pipelines, condition, truth)
        if config.progress:
            label = condition.label(config.pipeline)
            print(f"[{time.perf_counter() - start:5.0f}s] λ at {label}: done", flush=True)
    runs = []
    for seed in config.seeds:
        runs += _pipeline_rows(config, pipelines, seed, truth)
        if config.progress:
            print(f"[{time.perf_counter() - start:5.0f}s] seed {seed}: done", flush=True)
    results = {
        "dataset": task.name,
        "metric": "test perplexity",
        "config": dataclasses.asdict(config),
        "epsilon": config.epsilon,
        "delta": config.pipeline.delta,
        "mix_fraction": config.mix_fraction,
        "seeds": list(config.seeds),
        "true_weights": [float(w) for w in truth],
        "uniform_cosine": uniform_cosine,
        "noise_seeded": reproducible,
        "lambdas": lambdas,
        "lambda_summary": summarize_lambdas(lambdas, uniform_cosine),
        "runs": runs,
        "summary": summarize_arms(runs),
        "seconds": time.perf_counter() - start,
        "provenance": provenance(),
    }
    return finish(out, results, markdown(results), plots={"low_rho.png": plot})


def markdown(results: dict) -> str:
    """The λ-only table, then the pipeline arms' perplexities and their differences to Uniform,
    then every seed's perplexity per arm."""
    lambdas = results["lambda_summary"]
    summary = results["summary"]
    seeds = results["seeds"]
    lines = [
        f"DP-MixMin's λ alone on {results['dataset']}: {lambdas[0]['draws']} draws per setting "
        f"({len(seeds)} splits of D_mix × {lambdas[0]['draws'] // len(seeds)} noise draws), "
        f"δ = {results['delta']:g}. Logit noise: η σ C √T / b, the standard deviation of the "
        f"noise summed into one logit over the run. Uniform's cos(λ, λ*) is "
        f"{results['uniform_cosine']:.3f}:",
        "",
        "| setting | D_mix users (mean) | q | σ | logit noise | cos(λ_T, λ*) | "
        "share below Uniform (λ_T) | cos(λ_avg, λ*) | share below Uniform (λ_avg) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in lambdas:
        lines.append(
            f"| {row['condition']} | {row['users']:.1f} | {row['sampling_rate']:.3f} | "
            f"{row['noise_multiplier']:.2f} | {row['logit_noise']:.2f} | "
            f"{row['cosine_last']:.3f} | {row['below_uniform_last']:.2f} | "
            f"{row['cosine_average']:.3f} | {row['below_uniform_average']:.2f} |"
        )
    lines += [
        "",
        f"The whole pipeline, test perplexity (lower is better), every arm at ε = "
        f"{results['epsilon']:g} end to end; mean ± std over {len(seeds)} seeds, each seed one "
        "split and one noise stream for all arms. Differences to Uniform are paired by seed, "
        "mean ± standard error:",
        "",
        "| arm | ρ | spent ε | test perplexity | median | − Uniform | seeds above Uniform | "
        "cos(λ, λ*) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary:
        error = row["minus_uniform_se"]
        difference = f"{row['minus_uniform']:+.2f}" + ("" if error is None else f" ± {error:.2f}")
        lines.append(
            f"| {arm_label(row['arm'])} | {row['mix_fraction']:g} | {row['spent_epsilon']:.3f} | "
            f"{row['utility_mean']:.2f} ± {row['utility_std']:.2f} | "
            f"{row['utility_median']:.2f} | {difference} | "
            f"{round(row['worse_than_uniform'] * row['seeds'])} of {row['seeds']} | "
            f"{row['cosine_true']:.3f} |"
        )
    arms = [row["arm"] for row in summary]
    by_key = {(r["arm"], r["seed"]): r for r in results["runs"]}
    lines += [
        "",
        "Per seed: test perplexity (cos(λ, λ*)):",
        "",
        "| seed | " + " | ".join(arm_label(a) for a in arms) + " |",
        "|---|" + "---|" * len(arms),
    ]
    for seed in seeds:
        cells = [
            f"{by_key[a, seed]['utility']:.2f} ({by_key[a, seed]['cosine_true']:.2f})" for a in arms
        ]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Left: the share of λs below Uniform's cosine per λ setting. Right: every seed's test
    perplexity per arm, Uniform's mean as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lambdas = results["lambda_summary"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    positions = np.arange(len(lambdas))
    left.bar(positions - 0.2, [r["below_uniform_last"] for r in lambdas], 0.4, label="λ_T")
    left.bar(positions + 0.2, [r["below_uniform_average"] for r in lambdas], 0.4, label="λ_avg")
    left.set_xticks(positions, [r["condition"] for r in lambdas], rotation=30, ha="right")
    left.set_ylabel("share of λ below Uniform's cos(λ, λ*)")
    left.legend(fontsize=8)
    arms = [row["arm"] for row in results["summary"]]
    for position, arm in enumerate(arms):
        values = [r["utility"] for r in results["runs"] if r["arm"] == arm]
        right.scatter(np.full(len(values), position), values, s=14)
    uniform = next(row for row in results["summary"] if row["arm"] == "uniform")
    right.axhline(uniform["utility_mean"], color="grey", lw=0.8)
    right.set_xticks(range(len(arms)), [arm_label(a) for a in arms], rotation=30, ha="right")
    right.set_ylabel("test perplexity (per seed)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


cli = Command(
    name="low_rho",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, low_rho.png, stages/",
    examples=("--reproducible --quiet --out runs/low_rho", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("low_rho"):
        cli()
