"""The order of DP-MixMin, Uniform and Random Search on the Enron stand-in: pretraining or DP
fine-tuning, candidates or selection.

See `experiments/configs/enron_order.py` for the command and what the run is expected to show.
Per seed, on one split of the text default: Uniform (fine-tuned on the whole train split) and
DP-MixMin (its λ on D_mix at ε, fine-tuned on D_ft at ε) at every fine-tuning ε, and Random
Search's candidates fine-tuned on D_ft at the first ε; every model is also scored as pretrained,
before fine-tuning. Every stage is stored under `--out/stages` (the pipeline's own stage names),
so an interrupted study resumes where it stopped. Writes results.json and results.md.

    python -m experiments.enron_order --reproducible --quiet --out runs/enron_order
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.mixing import cosine_similarity
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.splits import derived_seed, dirichlet_candidates
from dpmix_jax.pipeline.stage_store import weights_key
from dpmix_jax.pipeline.text import TextPipeline
from dpmix_jax.pipeline.text_presets import text_task
from dpmix_jax.privacy import accounting
from experiments.common_args import experiment_main
from experiments.configs import enron_order as configs
from experiments.harness import Command, finish


def _scored(pipeline: TextPipeline, model) -> tuple[float, float]:
    """Test and validation perplexity of `model`."""
    return pipeline.utility(model, "test"), pipeline.utility(model, "val")


def _seed_runs(
    config: configs.EnronOrderConfig, pipeline: TextPipeline, seed: int
) -> tuple[list[dict], list[dict]]:
    """Every λ of `seed`, pretrained and fine-tuned: the rows, and the Random Search rows (the
    best of the first m candidates on validation perplexity, for every m of `selections`)."""
    truth = pipeline.task.true_weights
    delta, accountant = pipeline.config.delta, pipeline.config.finetune.accountant
    uniform = np.full(pipeline.k, 1.0 / pipeline.k)
    plan = [("uniform", uniform, None, "all", epsilon, None) for epsilon in config.epsilons]
    for epsilon in config.epsilons:
        weights, mixture_spent = pipeline.mixture(epsilon, seed)
        plan.append(("dp_mixmin", weights, None, "ft", epsilon, mixture_spent.epsilon))
    candidates = dirichlet_candidates(
        pipeline.k, config.candidates, seed=derived_seed(seed, "candidates")
    )
    for index, weights in enumerate(candidates):
        plan.append(("candidate", weights, index, "ft", config.epsilons[0], None))
    rows, ledgers = [], []
    for arm, weights, index, part, epsilon, mixture_epsilon in plan:
        init = pipeline.pretrained(weights, seed)
        pretrained_test, pretrained_val = _scored(pipeline, init)
        model, ledger = pipeline.finetune_with_ledger(
            init, weights_key(weights), part, epsilon, seed
        )
        test, val = _scored(pipeline, model)
        spent = ledger.budget(delta, accountant).epsilon
        if arm == "candidate":
            ledgers.append(ledger)
        rows.append(
            {
                "seed": seed,
                "arm": arm,
                "candidate": index,
                "epsilon": epsilon,
                "finetune_rows": part,
                # Parallel composition: D_mix and D_ft are disjoint, end to end the larger ε.
                "spent_epsilon": spent if mixture_epsilon is None else max(spent, mixture_epsilon),
                "weights": [float(w) for w in weights],
                "cosine_true": cosine_similarity(weights, truth),
                "pretrained_test": pretrained_test,
                "pretrained_val": pretrained_val,
                "test": test,
                "val": val,
            }
        )
    scored = [r for r in rows if r["arm"] == "candidate"]
    searches = []
    for m in config.selections:
        pick = min(range(m), key=lambda i: scored[i]["val"])
        # The m candidates were fine-tuned on the same D_ft: the m-fold composition, accounted
        # as one; the selection on validation users is not accounted.
        spent = accounting.compose_ledgers(*ledgers[:m]).budget(delta, accountant)
        searches.append(
            {
                "seed": seed,
                "candidates": m,
                "picked": pick,
                "epsilon": config.epsilons[0],
                "spent_epsilon": spent.epsilon,
                "test": scored[pick]["test"],
                "cosine_true": scored[pick]["cosine_true"],
            }
        )
    return rows, searches


def _mean_std(values: dict[int, float]) -> tuple[float, float]:
    """Mean and population standard deviation of per-seed (or per-candidate) values."""
    array = np.array(list(values.values()))
    return float(array.mean()), float(array.std())


def summarize(config: configs.EnronOrderConfig, runs: list[dict], searches: list[dict]) -> dict:
    """Per ε: Uniform and DP-MixMin, pretrained and fine-tuned, the fine-tuning's change and
    DP-MixMin's gain over Uniform (percent, paired by seed); per m: Random Search against
    Uniform at the first ε (paired by seed); the candidates against Uniform."""

    def by_seed(arm: str, epsilon: float, key: str) -> dict[int, float]:
        return {r["seed"]: r[key] for r in runs if (r["arm"], r["epsilon"]) == (arm, epsilon)}

    per_epsilon = []
    for epsilon in config.epsilons:
        row = {"epsilon": epsilon}
        for arm in ("uniform", "dp_mixmin"):
            tuned, raw = by_seed(arm, epsilon, "test"), by_seed(arm, epsilon, "pretrained_test")
            row[f"{arm}_test"] = _mean_std(tuned)
            row[f"{arm}_pretrained_test"] = _mean_std(raw)
            row[f"{arm}_finetune_change"] = _mean_std({s: tuned[s] - raw[s] for s in tuned})
            row[f"{arm}_spent_epsilon"] = max(by_seed(arm, epsilon, "spent_epsilon").values())
        for key, prefix in (
            ("gain_percent", "test"),
            ("pretrained_gain_percent", "pretrained_test"),
        ):
            dp, uniform = by_seed("dp_mixmin", epsilon, prefix), by_seed("uniform", epsilon, prefix)
            row[key] = _mean_std({s: 100 * (dp[s] / uniform[s] - 1) for s in dp})
        row["dp_mixmin_cosine_true"] = float(
            np.mean(list(by_seed("dp_mixmin", epsilon, "cosine_true").values()))
        )
        per_epsilon.append(row)
    epsilon = config.epsilons[0]
    uniform = by_seed("uniform", epsilon, "test")
    random_search = []
    for m in config.selections:
        here = {s["seed"]: s for s in searches if s["candidates"] == m}
        random_search.append(
            {
                "candidates": m,
                "epsilon": epsilon,
                "test": _mean_std({seed: s["test"] for seed, s in here.items()}),
                "minus_uniform": _mean_std(
                    {seed: s["test"] - uniform[seed] for seed, s in here.items()}
                ),
                "below_uniform": sum(s["test"] < uniform[seed] for seed, s in here.items()),
                "spent_epsilon": max(s["spent_epsilon"] for s in here.values()),
                "cosine_true": float(np.mean([s["cosine_true"] for s in here.values()])),
            }
        )
    candidates = [r for r in runs if r["arm"] == "candidate"]
    return {
        "per_epsilon": per_epsilon,
        "random_search": random_search,
        "candidates": {
            "count": len(candidates),
            "below_uniform": sum(r["test"] < uniform[r["seed"]] for r in candidates),
            "minus_uniform": _mean_std(
                {i: r["test"] - uniform[r["seed"]] for i, r in enumerate(candidates)}
            ),
            "cosine_true": float(np.mean([r["cosine_true"] for r in candidates])),
        },
        "uniform_cosine_true": float(
            np.mean(list(by_seed("uniform", epsilon, "cosine_true").values()))
        ),
    }


def main(
    config: configs.EnronOrderConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs every λ of every seed, pretrained and fine-tuned; writes the results to `out` (the
    stages under `out/stages`, read back by a rerun) and returns them.

    Privacy: Uniform's and DP-MixMin's spent ε are their accountants' for what ran (DP-MixMin:
    parallel composition of the disjoint D_mix and D_ft); Random Search's is the composition of
    its m fine-tunings, its selection on validation users not accounted (a reference, as in the
    pipeline); the pretrained-only scores read no sensitive training data. With `reproducible`
    the seeds drive the private randomness.
    """
    out = pathlib.Path(out)
    use_compilation_cache(out / "xla_cache")
    task = text_task(level=config.pipeline.level)
    pipeline = TextPipeline(task, config.pipeline, out / "stages", reproducible=reproducible)
    start = time.perf_counter()
    runs, searches = [], []
    for seed in config.seeds:
        rows, picked = _seed_runs(config, pipeline, seed)
        runs += rows
        searches += picked
        if config.progress:
            print(f"[{time.perf_counter() - start:5.0f}s] seed {seed}: done", flush=True)
    truth = np.asarray(task.true_weights)
    results = {
        "dataset": task.name,
        "metric": "test perplexity",
        "config": dataclasses.asdict(config),
        "delta": config.pipeline.delta,
        "mix_fraction": config.pipeline.mix_fraction,
        "seeds": list(config.seeds),
        "true_weights": [float(w) for w in truth],
        "zero_domains": int(np.sum(truth == 0)),
        "noise_seeded": reproducible,
        "runs": runs,
        "random_search": searches,
        "summary": summarize(config, runs, searches),
        "seconds": time.perf_counter() - start,
        "provenance": provenance(),
    }
    return finish(out, results, markdown(results))


def _cell(pair: list[float] | tuple[float, float], digits: int = 2, sign: str = "") -> str:
    """`mean ± std` of a (mean, std) pair."""
    mean, std = pair
    return f"{mean:{sign}.{digits}f} ± {std:.{digits}f}"


def markdown(results: dict) -> str:
    """The ε table (pretrained, fine-tuned, the fine-tuning's change, the gain) and the Random
    Search table (per m, against Uniform)."""
    summary = results["summary"]
    seeds = len(results["seeds"])
    lines = [
        f"Test perplexity on {results['dataset']} (ρ = {results['mix_fraction']:g}, "
        f"δ = {results['delta']:g}; lower is better), mean ± std over {seeds} seed(s), each seed "
        "one split and one noise stream for all arms. Pretrained: the model before fine-tuning; "
        "change: fine-tuned minus pretrained, and gain: 100 (DP-MixMin / Uniform - 1), both "
        "paired by seed:",
        "",
        "| ε | Uniform pretrained | Uniform fine-tuned | Uniform change | DP-MixMin pretrained | "
        "DP-MixMin fine-tuned | DP-MixMin change | gain, fine-tuned (%) | gain, pretrained (%) | "
        "cos(λ_DP, λ*) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["per_epsilon"]:
        lines.append(
            f"| {row['epsilon']:g} | {_cell(row['uniform_pretrained_test'])} | "
            f"{_cell(row['uniform_test'])} | {_cell(row['uniform_finetune_change'], 2, '+')} | "
            f"{_cell(row['dp_mixmin_pretrained_test'])} | {_cell(row['dp_mixmin_test'])} | "
            f"{_cell(row['dp_mixmin_finetune_change'], 2, '+')} | "
            f"{_cell(row['gain_percent'], 1, '+')} | "
            f"{_cell(row['pretrained_gain_percent'], 1, '+')} | "
            f"{row['dp_mixmin_cosine_true']:.3f} |"
        )
    candidates = summary["candidates"]
    epsilon = summary["random_search"][0]["epsilon"]
    lines += [
        "",
        f"Random Search at ε = {epsilon:g}: the best of the first m Dirichlet(1) candidates on "
        "validation perplexity (m = 1: one random λ, no selection), each fine-tuned on D_ft; "
        "minus Uniform paired by seed; spent ε: the accountant's composition of the m "
        f"fine-tunings (the selection is not accounted). λ* leaves {results['zero_domains']} of "
        f"{len(results['true_weights'])} domains at zero; Uniform's cos(λ, λ*) is "
        f"{summary['uniform_cosine_true']:.3f}:",
        "",
        "| m | test perplexity | minus Uniform | seeds below Uniform | spent ε | cos(λ, λ*) |",
        "|---|---|---|---|---|---|",
    ]
    for row in summary["random_search"]:
        lines.append(
            f"| {row['candidates']} | {_cell(row['test'])} | "
            f"{_cell(row['minus_uniform'], 2, '+')} | {row['below_uniform']}/{seeds} | "
            f"{row['spent_epsilon']:.3f} | {row['cosine_true']:.3f} |"
        )
    lines += [
        "",
        f"Every candidate ({candidates['count']}): {candidates['below_uniform']} below Uniform, "
        f"minus Uniform {_cell(candidates['minus_uniform'], 2, '+')}, mean cos(λ, λ*) "
        f"{candidates['cosine_true']:.3f}.",
    ]
    return "\n".join(lines)


cli = Command(
    name="enron_order",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, stages/",
    examples=("--reproducible --quiet --out runs/enron_order", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("enron_order"):
        cli()
