"""DP-MixMin's gap to non-private MixMin on the digits stand-in: fine-tuning data or noise in λ.

See `experiments/configs/mixmin_gap.py` for the command, the conditions and what the run is
expected to show. At every condition (ρ, fine-tuning steps) and seed, on one split, four arms
fine-tune at the same ε: Uniform on D_ft, DP-MixMin (its λ on D_mix, fine-tuned on D_ft),
non-private MixMin's λ fine-tuned on D_ft, and non-private MixMin as the pipeline runs it
(fine-tuned on the whole train split). At the base condition, DP-MixMin's λ is also computed at
larger mixture ε. Every stage is stored under `--out/stages`, so an interrupted study resumes
where it stopped. Writes results.json, results.md and mixmin_gap.png.

    python -m experiments.mixmin_gap --reproducible --quiet --out runs/mixmin_gap
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.mixing import cosine_similarity
from dpmix_jax.pipeline import ImagePipeline, presets
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.stage_store import weights_key
from experiments.common_args import experiment_main
from experiments.configs import mixmin_gap as configs
from experiments.harness import Command, finish

ARM_LABELS = {
    "uniform": "Uniform (D_ft)",
    "dp_mixmin": "DP-MixMin",
    "nonprivate_ft": "non-private λ (D_ft)",
    "nonprivate_all": "non-private MixMin (all of train)",
}


def mixture_arm(epsilon: float) -> str:
    """The arm name of DP-MixMin's λ at mixture ε `epsilon`, fine-tuned at the run's ε."""
    return f"dp_mixmin_mix{epsilon:g}"


def _finetune_on_dft(pipeline: ImagePipeline, weights: np.ndarray, epsilon: float, seed: int):
    """Pretrains on `weights` and DP fine-tunes on D_ft at `epsilon`: (test AUC, spent ε)."""
    init = pipeline.pretrained(weights, seed)
    model, spent = pipeline.finetune(init, weights_key(weights), "ft", epsilon, seed)
    return pipeline.utility(model, "test"), spent.epsilon


def _condition_runs(
    config: configs.MixMinGapConfig, pipeline: ImagePipeline, condition, seed: int
) -> list[dict]:
    """Every arm of `condition` at `seed`, one row each."""
    epsilon = config.epsilon
    mix, ft = pipeline.split(seed)
    truth = pipeline.task.true_weights
    nonprivate = pipeline.nonprivate_weights(seed)
    outcomes = {}
    uniform = np.full(pipeline.k, 1.0 / pipeline.k)
    outcomes["uniform"] = (*_finetune_on_dft(pipeline, uniform, epsilon, seed), uniform, None)
    run = pipeline.run("dp_mixmin", epsilon, seed)
    outcomes["dp_mixmin"] = (run.utility, run.spent.epsilon, np.asarray(run.weights), epsilon)
    outcomes["nonprivate_ft"] = (
        *_finetune_on_dft(pipeline, nonprivate, epsilon, seed), nonprivate, None
    )  # fmt: skip
    run = pipeline.run("nonprivate_mixmin", epsilon, seed)
    outcomes["nonprivate_all"] = (run.utility, run.spent.epsilon, nonprivate, None)
    if condition == config.base:
        for mixture_epsilon in config.mixture_epsilons:
            weights, mixture_spent = pipeline.mixture(mixture_epsilon, seed)
            utility, finetune_spent = _finetune_on_dft(pipeline, weights, epsilon, seed)
            # Parallel composition: D_mix and D_ft are disjoint, end to end the larger ε.
            spent = max(mixture_spent.epsilon, finetune_spent)
            outcomes[mixture_arm(mixture_epsilon)] = (utility, spent, weights, mixture_epsilon)
    rows = []
    for arm, (utility, spent, weights, mixture_epsilon) in outcomes.items():
        rows.append(
            {
                "condition": condition.label,
                "mix_fraction": condition.mix_fraction,
                "finetune_steps": condition.finetune_steps,
                "arm": arm,
                "seed": seed,
                "utility": utility,
                "spent_epsilon": spent,
                "mixture_epsilon": mixture_epsilon,
                "finetune_rows": len(ft) if arm != "nonprivate_all" else len(mix) + len(ft),
                "mixture_examples": len(mix),
                "weights": [float(w) for w in weights],
                "cosine_true": cosine_similarity(weights, truth),
                "cosine_nonprivate": cosine_similarity(weights, nonprivate),
            }
        )
    return rows


def _paired(runs: list[dict], condition: str, high: str, low: str) -> tuple[float, float | None]:
    """Mean over seeds of `high` minus `low` at `condition`, and its standard error (None for
    one seed)."""
    by_seed = {(r["arm"], r["seed"]): r["utility"] for r in runs if r["condition"] == condition}
    seeds = sorted({seed for arm, seed in by_seed if arm == low})
    gaps = np.array([by_seed[high, seed] - by_seed[low, seed] for seed in seeds])
    error = float(gaps.std(ddof=1) / np.sqrt(len(gaps))) if len(gaps) > 1 else None
    return float(gaps.mean()), error


def summarize(config: configs.MixMinGapConfig, runs: list[dict]) -> list[dict]:
    """Per condition and arm: test AUC (mean, population std over seeds), λ's mean cosines, and
    the paired gaps to non-private MixMin's λ fine-tuned on D_ft."""
    summary = []
    for condition in config.conditions:
        here = [r for r in runs if r["condition"] == condition.label]
        for arm in dict.fromkeys(r["arm"] for r in here):
            rows = [r for r in here if r["arm"] == arm]
            utility = np.array([r["utility"] for r in rows])
            gap, error = _paired(runs, condition.label, "nonprivate_ft", arm)
            summary.append(
                {
                    "condition": condition.label,
                    "mix_fraction": condition.mix_fraction,
                    "finetune_steps": condition.finetune_steps,
                    "arm": arm,
                    "seeds": len(rows),
                    "mixture_epsilon": rows[0]["mixture_epsilon"],
                    "mixture_examples": float(np.mean([r["mixture_examples"] for r in rows])),
                    "utility_mean": float(utility.mean()),
                    "utility_std": float(utility.std()),
                    "spent_epsilon": max(r["spent_epsilon"] for r in rows),
                    "cosine_true": float(np.mean([r["cosine_true"] for r in rows])),
                    "cosine_nonprivate": float(np.mean([r["cosine_nonprivate"] for r in rows])),
                    "gap_to_nonprivate_ft": gap,
                    "gap_to_nonprivate_ft_se": error,
                }
            )
    return summary


def main(
    config: configs.MixMinGapConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
) -> dict:
    """Runs every arm of every condition for every seed; writes the results to `out` (the
    stages under `out/stages`, read back by a rerun) and returns them.

    Privacy: every arm's spent ε is its accountants' for what ran (parallel composition of the
    disjoint D_mix and D_ft); non-private MixMin's λ is not private (a reference, as in the
    pipeline). With `reproducible` the seeds drive the private randomness.
    """
    out = pathlib.Path(out)
    use_compilation_cache(out / "xla_cache")
    task = presets.digit_task(image_size=config.image_size)
    start = time.perf_counter()
    runs = []
    for condition in config.conditions:
        pipeline = ImagePipeline(
            task, config.pipeline_for(condition), out / "stages", reproducible=reproducible
        )
        for seed in config.seeds:
            runs += _condition_runs(config, pipeline, condition, seed)
        if config.progress:
            print(f"[{time.perf_counter() - start:5.0f}s] {condition.label}: done", flush=True)
    results = {
        "dataset": task.name,
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
    return finish(out, results, markdown(results), plots={"mixmin_gap.png": plot})


def _arm_label(arm: str) -> str:
    if arm in ARM_LABELS:
        return ARM_LABELS[arm]
    return f"DP-MixMin, λ at ε = {arm.removeprefix('dp_mixmin_mix')}"


def _gap_cell(row: dict, sign: float = 1.0) -> str:
    """A summary row's paired gap to non-private MixMin's λ on D_ft (times `sign`), ± its
    standard error."""
    mean, error = sign * row["gap_to_nonprivate_ft"], row["gap_to_nonprivate_ft_se"]
    return f"{mean:+.4f}" if error is None else f"{mean:+.4f} ± {error:.4f}"


def markdown(results: dict) -> str:
    """The test AUC of every arm per condition, the paired gaps, and the mixture-ε arms."""
    summary = results["summary"]
    seeds = len(results["seeds"])
    lines = [
        f"Test AUC on {results['dataset']}, every arm fine-tuned by DP-SGD at ε = "
        f"{results['epsilon']:g} (δ = {results['delta']:g}); mean ± std over {seeds} seed(s), "
        "each seed one split, one set of proxies and one noise stream for all arms:",
        "",
        "| condition | D_mix examples (mean) | "
        + " | ".join(ARM_LABELS.values())
        + " | λ gap (non-private λ − DP-MixMin, D_ft) | data gap (all − D_ft, non-private λ) |",
        "|---|---|" + "---|" * (len(ARM_LABELS) + 2),
    ]
    conditions = list(dict.fromkeys(row["condition"] for row in summary))
    for condition in conditions:
        rows = {row["arm"]: row for row in summary if row["condition"] == condition}
        cells = [
            f"{rows[a]['utility_mean']:.4f} ± {rows[a]['utility_std']:.4f}" for a in ARM_LABELS
        ]
        lines.append(
            f"| {condition} | {rows['dp_mixmin']['mixture_examples']:.1f} | "
            + " | ".join(cells)
            + f" | {_gap_cell(rows['dp_mixmin'])} | {_gap_cell(rows['nonprivate_all'], -1.0)} |"
        )
    lines += [
        "",
        "Gaps: paired over seeds, mean ± standard error. λ quality: mean cosine over seeds of "
        "DP-MixMin's λ to the task's λ* and to non-private MixMin's λ (non-private MixMin's own "
        "cosine to λ* beside it):",
        "",
        "| condition | cos(λ_DP, λ*) | cos(λ_DP, λ_non-private) | cos(λ_non-private, λ*) |",
        "|---|---|---|---|",
    ]
    for condition in conditions:
        rows = {row["arm"]: row for row in summary if row["condition"] == condition}
        dp, nonprivate = rows["dp_mixmin"], rows["nonprivate_ft"]
        lines.append(
            f"| {condition} | {dp['cosine_true']:.3f} | {dp['cosine_nonprivate']:.3f} | "
            f"{nonprivate['cosine_true']:.3f} |"
        )
    extra = [row for row in summary if row["arm"] not in ARM_LABELS]
    if extra:
        lines += [
            "",
            f"The noise in λ, at {extra[0]['condition']}: DP-MixMin's λ computed at a larger "
            f"mixture ε, fine-tuned on D_ft at ε = {results['epsilon']:g} (end to end the larger "
            "of the two, parallel composition):",
            "",
            "| λ | spent ε | test AUC | λ gap (non-private λ − this, D_ft) | cos(λ, λ*) | "
            "cos(λ, λ_non-private) |",
            "|---|---|---|---|---|---|",
        ]
        base = [r for r in summary if r["condition"] == extra[0]["condition"]]
        for row in [r for r in base if r["arm"] == "dp_mixmin"] + extra:
            lines.append(
                f"| {_arm_label(row['arm'])} | {row['spent_epsilon']:.3f} | "
                f"{row['utility_mean']:.4f} ± {row['utility_std']:.4f} | "
                f"{_gap_cell(row)} | "
                f"{row['cosine_true']:.3f} | {row['cosine_nonprivate']:.3f} |"
            )
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Test AUC of the four arms against ρ (at the base fine-tuning budget), and the λ gap
    against the mixture ε at the base condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = results["summary"]
    base_steps = results["config"]["pipeline"]["finetune"]["steps"]
    base_rho = results["config"]["pipeline"]["mix_fraction"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for arm, label in ARM_LABELS.items():
        rows = sorted(
            (r for r in summary if r["arm"] == arm and r["finetune_steps"] == base_steps),
            key=lambda r: r["mix_fraction"],
        )
        left.errorbar(
            [r["mix_fraction"] for r in rows],
            [r["utility_mean"] for r in rows],
            yerr=[r["utility_std"] for r in rows],
            marker="o",
            capsize=3,
            label=label,
        )
    left.set_xlabel("ρ (share of the train split in D_mix)")
    left.set_ylabel("test AUC")
    left.set_title(f"{base_steps} fine-tuning steps", fontsize=9)
    left.legend(fontsize=8)
    here = [
        r
        for r in summary
        if r["mix_fraction"] == base_rho
        and r["finetune_steps"] == base_steps
        and (r["arm"] == "dp_mixmin" or r["arm"] not in ARM_LABELS)
    ]
    right.errorbar(
        [r["mixture_epsilon"] for r in here],
        [r["gap_to_nonprivate_ft"] for r in here],
        yerr=[r["gap_to_nonprivate_ft_se"] or 0.0 for r in here],
        marker="o",
        capsize=3,
    )
    right.axhline(0.0, color="grey", lw=0.8)
    right.set_xscale("log", base=2)
    right.set_xlabel("mixture ε (fine-tuning at ε = 1)")
    right.set_ylabel("AUC gap: non-private λ − DP λ (D_ft)")
    right.set_title(f"ρ = {base_rho:g}", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


cli = Command(
    name="mixmin_gap",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, mixmin_gap.png, stages/",
    examples=("--reproducible --quiet --out runs/mixmin_gap", "--preset tiny --out runs/tiny"),
    presets=configs.PRESETS,
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("mixmin_gap"):
        cli()
