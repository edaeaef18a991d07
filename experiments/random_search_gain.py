"""DP-MixMin's gain over Random Init against Random Search's: its candidates, budget and λ*.

See `experiments/configs/random_search_gain.py` for the command, the conditions and what the run
is expected to show. For every sparsity of λ*, task and seed, on one split: Random Init, Uniform
and DP-MixMin as the pipeline runs them, and Random Search with the first m of that seed's
Dirichlet(1) candidates, each fine-tuned on D_ft at ε (charged) or at the ε whose m-fold
composition is ε (calibrated), the best kept on validation data. Every stage is stored under
`--out/stages`, so an interrupted study resumes where it stopped. Writes results.json,
results.md and random_search_gain.png.

    python -m experiments.random_search_gain --reproducible --quiet --out runs/random_search_gain
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.pipeline import ImagePipeline, SharedInputTask, presets
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.splits import derived_seed, dirichlet_candidates
from dpmix_jax.pipeline.stage_store import weights_key
from dpmix_jax.privacy import accounting
from experiments.common_args import experiment_main
from experiments.configs import random_search_gain as configs
from experiments.harness import Command, finish
from experiments.per_task import check_both_classes

FIXED_ARMS = ("dp_mixmin", "uniform", "random_init")


def search_arm(candidates: int, budget: str) -> str:
    """The arm name of Random Search with `candidates` candidates at `budget`."""
    return f"random_search_m{candidates}_{budget}"


def candidate_epsilon(pipeline: ImagePipeline, epsilon: float, candidates: int, seed: int) -> float:
    """The ε of one fine-tuning on D_ft whose `candidates`-fold composition is `epsilon`.

    The m runs share q and σ, so their composition is one DP-SGD run of m·T steps: σ is
    calibrated for it, and the returned ε is one run's at that σ.
    """
    if candidates == 1:
        return epsilon
    finetune = pipeline.config.finetune
    _, ft = pipeline.split(seed)
    rate = finetune.batch_size / len(ft)
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=epsilon,
        delta=pipeline.config.delta,
        sampling_rate=rate,
        steps=candidates * finetune.steps,
        accountant=finetune.accountant,
    )
    event = accounting.dpsgd_event(noise_multiplier=sigma, sampling_rate=rate, steps=finetune.steps)
    return accounting.epsilon(event, delta=pipeline.config.delta, accountant=finetune.accountant)


def _search_runs(
    config: configs.RandomSearchGainConfig, pipeline: ImagePipeline, seed: int
) -> list[dict]:
    """Random Search at every candidate count and budget: one row each (no task fields)."""
    pool = dirichlet_candidates(
        pipeline.k, max(config.candidate_counts), seed=derived_seed(seed, "candidates")
    )
    scored = {}

    def score(index: int, epsilon: float):
        if (index, epsilon) not in scored:
            weights = pool[index]
            init = pipeline.pretrained(weights, seed)
            model, ledger = pipeline.finetune_with_ledger(
                init, weights_key(weights), "ft", epsilon, seed
            )
            scored[index, epsilon] = (
                pipeline.utility(model, "val"),
                pipeline.utility(model, "test"),
                ledger,
            )
        return scored[index, epsilon]

    rows = []
    for m in config.candidate_counts:
        for budget in configs.BUDGETS:
            each = config.epsilon
            if budget == "calibrated":
                each = candidate_epsilon(pipeline, config.epsilon, m, seed)
            results = [score(i, each) for i in range(m)]
            pick = max(range(m), key=lambda i: results[i][0])
            spent = accounting.compose_ledgers(*(r[2] for r in results)).budget(
                pipeline.config.delta, pipeline.config.finetune.accountant
            )
            rows.append(
                {
                    "arm": search_arm(m, budget),
                    "candidates": m,
                    "budget": budget,
                    "candidate_epsilon": each,
                    "utility": results[pick][1],
                    "spent_epsilon": spent.epsilon,
                    "weights": [float(w) for w in pool[pick]],
                }
            )
    return rows


def _task_runs(
    config: configs.RandomSearchGainConfig, pipeline: ImagePipeline, seed: int
) -> list[dict]:
    """Every arm on one task at `seed`: one row each (no task fields)."""
    rows = []
    for method in FIXED_ARMS:
        run = pipeline.run(method, config.epsilon, seed)
        rows.append(
            {
                "arm": method,
                "candidates": None,
                "budget": None,
                "candidate_epsilon": None,
                "utility": run.utility,
                "spent_epsilon": run.spent.epsilon,
                "weights": run.weights,
            }
        )
    return rows + _search_runs(config, pipeline, seed)


def arms(config: configs.RandomSearchGainConfig) -> list[str]:
    """Every arm of the study, the fixed ones first."""
    searched = [search_arm(m, b) for m in config.candidate_counts for b in configs.BUDGETS]
    return [*FIXED_ARMS, *searched]


def _gains(runs: list[dict], arm: str, tasks: list[int], seeds) -> np.ndarray:
    """`arm`'s relative gains over Random Init in `runs` (one task set), (task, seed)."""
    auc = {(r["arm"], r["task"], r["seed"]): r["utility"] for r in runs}
    return np.array(
        [
            [(auc[arm, t, s] - auc["random_init", t, s]) / auc["random_init", t, s] for s in seeds]
            for t in tasks
        ]
    )


def summarize(config: configs.RandomSearchGainConfig, runs: list[dict]) -> list[dict]:
    """Per sparsity and arm: macro AUC, macro relative gain over Random Init (paired by task and
    seed, averaged over seeds, then tasks; ± its std over seeds), DP-MixMin's macro gain over it
    (ratio) and DP-MixMin's gain minus it (paired by seed: mean ± std over seeds)."""
    summary = []
    for active in config.active_sources:
        here = [r for r in runs if r["active_sources"] == active]
        tasks = sorted({r["task"] for r in here})
        dp = _gains(here, "dp_mixmin", tasks, config.seeds)
        for arm in arms(config):
            rows = [r for r in here if r["arm"] == arm]
            gain = _gains(here, arm, tasks, config.seeds)
            per_seed = gain.mean(axis=0)
            macro = float(gain.mean())
            difference = dp.mean(axis=0) - per_seed
            summary.append(
                {
                    "active_sources": active,
                    "arm": arm,
                    "candidates": rows[0]["candidates"],
                    "budget": rows[0]["budget"],
                    "tasks": len(tasks),
                    "seeds": len(config.seeds),
                    "auc_mean": float(np.mean([r["utility"] for r in rows])),
                    "gain": macro,
                    "gain_seed_std": float(per_seed.std()),
                    "ratio": float(dp.mean() / macro) if macro > 0 else None,
                    "dp_minus_gain": float(difference.mean()),
                    "dp_minus_gain_std": float(difference.std()),
                    "spent_epsilon": max(r["spent_epsilon"] for r in rows),
                    "candidate_epsilon": rows[0]["candidate_epsilon"],
                }
            )
    return summary


def study_tasks(config: configs.RandomSearchGainConfig, active: int) -> list[SharedInputTask]:
    """The digit tasks with `active` sources in each λ*_t, one per prevalence scale, named as
    the per-task study names its tasks (with 3 active sources: its tasks and noise streams)."""
    tasks = presets.digit_tasks(
        seed=config.data_seed,
        image_size=config.image_size,
        num_tasks=len(config.prevalence_scales),
        prevalence_scales=config.prevalence_scales,
        num_active_sources=active,
    )
    count = len(tasks)
    return [
        dataclasses.replace(
            task, name=f"digits multi-task default, task {index} of {count} (s = {scale:g})"
        )
        for index, (task, scale) in enumerate(zip(tasks, config.prevalence_scales, strict=True))
    ]


def main(
    config: configs.RandomSearchGainConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs every arm of every task set, task and seed; writes the results to `out` (the stages
    under `out/stages`, read back by a rerun) and returns them.

    Privacy: every arm's spent ε is its accountants'; Random Search's is the composition of its
    candidates' fine-tunings on D_ft, and its choice on validation data is not accounted (a
    reference, not a private method, as in the pipeline). With `reproducible` the seeds drive
    the private randomness.
    """
    out = pathlib.Path(out)
    use_compilation_cache(out / "xla_cache")
    start = time.perf_counter()
    runs = []
    for active in config.active_sources:
        tasks = study_tasks(config, active)
        check_both_classes(tasks)
        for index, task in enumerate(tasks):
            stages = out / "stages" / f"active{active}" / f"task{index}"
            pipeline = ImagePipeline(task, config.pipeline, stages, reproducible=reproducible)
            for seed in config.seeds:
                for row in _task_runs(config, pipeline, seed):
                    runs.append({"active_sources": active, "task": index, "seed": seed, **row})
            if config.progress:
                print(
                    f"[{time.perf_counter() - start:5.0f}s] {active} active, task {index}: done",
                    flush=True,
                )
    results = {
        "dataset": "digits multi-task default",
        "metric": "test AUC",
        "config": dataclasses.asdict(config),
        "epsilon": config.epsilon,
        "delta": config.pipeline.delta,
        "seeds": list(config.seeds),
        "noise_seeded": reproducible,
        "runs": runs,
        "summary": summarize(config, runs),
        "seconds": time.perf_counter() - start,
        "provenance": provenance(),
    }
    return finish(out, results, markdown(results), plots={"random_search_gain.png": plot})


def _label(row: dict) -> str:
    names = {"dp_mixmin": "DP-MixMin", "uniform": "Uniform", "random_init": "Random Init"}
    if row["arm"] in names:
        return names[row["arm"]]
    return f"Random Search, m = {row['candidates']}, {row['budget']}"


def markdown(results: dict) -> str:
    """Per sparsity of λ*: every arm's macro AUC and gain, and DP-MixMin's gain against it."""
    seeds = len(results["seeds"])
    lines = [
        f"Macro (mean over tasks) test AUC and relative gain over Random Init, "
        f"(AUC - AUC_RI) / AUC_RI paired by task and seed, at ε = {results['epsilon']:g} "
        f"(δ = {results['delta']:g}), {seeds} seed(s). DP-MixMin's gain / this arm's: the ratio "
        "of the macro gains; DP-MixMin − this: the paired "
        "difference of the gains (mean ± std over seeds). Random Search keeps the best of its "
        "first m candidates on validation data without privacy; charged: each candidate "
        "fine-tuned at ε; calibrated: each at the ε (per candidate) whose m-fold composition "
        "is ε.",
        "",
        "| λ* active sources | arm | per-candidate ε | spent ε | macro AUC | gain | "
        "DP-MixMin gain / this | DP-MixMin − this |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["summary"]:
        each = row["candidate_epsilon"]
        ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        lines.append(
            f"| {row['active_sources']} | {_label(row)} | "
            f"{'-' if each is None else f'{each:.3f}'} | {row['spent_epsilon']:.3f} | "
            f"{row['auc_mean']:.3f} | "
            f"{100 * row['gain']:+.1f}% ± {100 * row['gain_seed_std']:.1f} | "
            + (
                "- | - |"
                if row["arm"] in ("dp_mixmin", "random_init")
                else f"{ratio} | {100 * row['dp_minus_gain']:+.1f} ± "
                f"{100 * row['dp_minus_gain_std']:.1f} pt |"
            )
        )
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """DP-MixMin's macro gain / Random Search's against m, per budget and sparsity of λ*, with
    DP-MixMin's / Uniform's and the paper's (about 2) for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    figure, axis = plt.subplots(figsize=(6, 4))
    for color, active in enumerate(results["config"]["active_sources"]):
        for budget, style in zip(configs.BUDGETS, ("-", "--"), strict=True):
            rows = [r for r in summary if r["active_sources"] == active and r["budget"] == budget]
            axis.plot(
                [r["candidates"] for r in rows],
                [np.nan if r["ratio"] is None else r["ratio"] for r in rows],
                linestyle=style,
                marker="o",
                color=f"C{color}",
                label=f"Random Search, λ* with {active} active, {budget}",
            )
        uniform = [r for r in summary if r["active_sources"] == active and r["arm"] == "uniform"]
        axis.axhline(
            uniform[0]["ratio"], linestyle=":", color=f"C{color}", label=f"Uniform, {active} active"
        )
    axis.axhline(2.0, color="grey", lw=0.8, label="the paper's (about 2)")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("Random Search's candidates m")
    axis.set_ylabel("DP-MixMin's macro gain / the arm's")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


cli = Command(
    name="random_search_gain",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, random_search_gain.png, stages/",
    examples=(
        "--reproducible --quiet --out runs/random_search_gain",
        "--preset tiny --out runs/tiny",
    ),
    presets=configs.PRESETS,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("random_search_gain"):
        cli()
