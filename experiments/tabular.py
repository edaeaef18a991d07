"""Tabular DP-MixMin under covariate shift: DP-MixMin, Uniform, Random Init and the
density-ratio variant on the statsmodels `fair` table, over ε and a covariate-shift knob.

Non-private MixMin (λ not private, only its fine-tuning is DP) runs beside them as a reference:
whether the mixture matters at all when λ costs no budget.

The public sources are age bands of a public pool of the table; the sensitive rows are a draw
from the rest with a fixed age mix and a tilt towards low marriage ratings of strength `shift`
(`data.tabular`). At shift 0 the sensitive covariates are a mixture of the sources' (MixMin's
assumption); as the shift grows no mixture reproduces them. Every method runs through
`pipeline.tabular.TabularPipeline` at every (shift, ε, seed); the variant `dp_mixmin_ratio`
spends the D_mix side's ε on a DP domain classifier and DP-MixMin together (one calibrated σ,
the accountant's ε of their composition at the target) and pretrains on rows reweighted by the
estimated density ratio.

Writes `results.json` (config, provenance, whether the noise was seeded, every run, the table)
and `results.md` and `utility_vs_epsilon.png` to `--out`.

    python -m experiments.tabular --reproducible --out runs/tabular
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.data.tabular import TILT_COLUMN, load_fair_task
from dpmix_jax.pipeline.compare import REFERENCE_NOTES, provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.tabular import RATIO_METHOD, TabularPipeline
from dpmix_jax.privacy import SEEDED_NOTE
from experiments.common_args import experiment_main
from experiments.configs.tabular import TabularStudyConfig, get_config
from experiments.harness import Command, finish
from experiments.run_files import as_json


def task_summary(task) -> dict:
    """Public description of a task: source sizes and the sensitive splits' sizes.

    Privacy: the sensitive splits' label rate and mean tilt covariate are evaluation
    statistics of this study's data, printed to describe the shift, not released by a method.
    """
    train = task.train.gather(np.arange(len(task.train)))
    column = task.feature_names.index(TILT_COLUMN)
    return {
        "source_sizes": [len(s) for s in task.sources],
        "train": len(task.train),
        "val": len(task.val),
        "test": len(task.test),
        "train_positive_rate": float(train["labels"].mean()),
        "train_mean_tilt": float(train["features"][:, column].mean()),
    }


def run_one(pipeline: TabularPipeline, method: str, epsilon: float, seed: int):
    """One method at one ε and seed (the variant through its own entry point)."""
    if method == RATIO_METHOD:
        return pipeline.run_density_ratio(epsilon, seed)
    return pipeline.run(method, epsilon, seed)


def main(
    config: TabularStudyConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
    quiet: bool = False,
) -> dict:
    """Runs the grid; writes `results.json`, `results.md` and the plot to `out` (with `quiet`,
    no line per run: only the table is printed)."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    use_compilation_cache(out / "xla_cache")
    runs, tasks = [], {}
    for shift in config.shifts:
        task = load_fair_task(dataclasses.replace(config.task, shift=shift))
        tasks[f"{shift:g}"] = task_summary(task)
        pipeline = TabularPipeline(task, config.pipeline, out / "stages", reproducible=reproducible)
        for seed in config.seeds:
            for epsilon in config.epsilons:
                for method in config.methods:
                    result = run_one(pipeline, method, epsilon, seed)
                    runs.append({"shift": shift, **result.to_json()})
                    if not quiet:
                        print(
                            f"shift {shift:g} seed {seed} ε {epsilon:g} {method}: AUC "
                            f"{result.utility:.4f}, spent ε {result.spent.epsilon:.4f}",
                            flush=True,
                        )
    results = {
        "study": "tabular",
        "table_source": "statsmodels.datasets.fair (bundled CSV)",
        "source_names": list(task.source_names),
        "tasks": tasks,
        "config": as_json(dataclasses.asdict(config)),
        "provenance": provenance(),
        "noise_seeded": reproducible,
        "runs": runs,
        "table": table_rows(runs, config),
        "differences": differences(runs, config),
        "wall_s": time.time() - start,
    }
    return finish(out, results, markdown(results), plots={"utility_vs_epsilon.png": plot})


def _select(runs: list[dict], **match) -> list[dict]:
    return sorted(
        (r for r in runs if all(r[key] == value for key, value in match.items())),
        key=lambda r: r["seed"],
    )


def table_rows(runs: list[dict], config: TabularStudyConfig) -> list[dict]:
    """Per shift, ε and method: mean ± std test AUC over seeds, the max spent ε and the mean λ."""
    rows = []
    for shift in config.shifts:
        for epsilon in config.epsilons:
            for method in config.methods:
                chosen = _select(runs, shift=shift, epsilon=epsilon, method=method)
                utility = [r["utility"] for r in chosen]
                weights = [r["weights"] for r in chosen if r["weights"] is not None]
                rows.append(
                    {
                        "shift": shift,
                        "epsilon": epsilon,
                        "method": method,
                        "auc": [float(np.mean(utility)), float(np.std(utility))],
                        "spent_epsilon": max(r["spent_epsilon"] for r in chosen),
                        "mean_weights": np.mean(weights, axis=0).tolist() if weights else None,
                    }
                )
    return rows


def differences(runs: list[dict], config: TabularStudyConfig) -> list[dict]:
    """Per shift and ε, paired by seed (mean ± std): DP-MixMin - Uniform, DP-MixMin - Random
    Init, the variant - DP-MixMin, and non-private MixMin - Uniform (where both methods ran)."""
    pairs = (
        ("dp_mixmin", "uniform"),
        ("dp_mixmin", "random_init"),
        (RATIO_METHOD, "dp_mixmin"),
        ("nonprivate_mixmin", "uniform"),
    )
    rows = []
    for shift in config.shifts:
        for epsilon in config.epsilons:
            row = {"shift": shift, "epsilon": epsilon}
            for first, second in pairs:
                a = _select(runs, shift=shift, epsilon=epsilon, method=first)
                b = _select(runs, shift=shift, epsilon=epsilon, method=second)
                if a and b:
                    gaps = [x["utility"] - y["utility"] for x, y in zip(a, b, strict=True)]
                    row[f"{first} - {second}"] = [float(np.mean(gaps)), float(np.std(gaps))]
            rows.append(row)
    return rows


def markdown(results: dict) -> str:
    """`results.md`: the AUC table, the paired differences and how they were measured."""
    config = results["config"]
    seeds = len(config["seeds"])
    names = ", ".join(results["source_names"])
    lines = [
        "## Tabular DP-MixMin under covariate shift (statsmodels `fair`)",
        "",
        f"Public sources (age bands): {names}. Test AUC on the held-out sensitive rows, mean ± "
        f"std over {seeds} seeds; ε spent: the accountants' end-to-end ε, max over seeds; λ: "
        "the mean pretraining mixture over seeds.",
        "",
        "| shift | ε | method | test AUC | ε spent | mean λ |",
        "|---|---|---|---|---|---|",
    ]
    for row in results["table"]:
        weights = row["mean_weights"]
        shown = "" if weights is None else "(" + ", ".join(f"{w:.2f}" for w in weights) + ")"
        lines.append(
            f"| {row['shift']:g} | {row['epsilon']:g} | {method_label(row['method'])} | "
            f"{row['auc'][0]:.4f} ± {row['auc'][1]:.4f} | {row['spent_epsilon']:.3f} | {shown} |"
        )
    columns = [key for key in results["differences"][0] if key not in ("shift", "epsilon")]
    lines += [
        "",
        "Paired differences of test AUC (same seed, split and task), mean ± std over seeds:",
        "",
        "| shift | ε | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for row in results["differences"]:
        cells = [f"{row[c][0]:+.4f} ± {row[c][1]:.4f}" for c in columns]
        lines.append(f"| {row['shift']:g} | {row['epsilon']:g} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Sensitive train split per shift (evaluation statistics describing the shift): "
        + "; ".join(
            f"shift {shift}: {t['train']} rows, {t['train_positive_rate']:.1%} positive, mean "
            f"z({TILT_COLUMN}) {t['train_mean_tilt']:+.2f}"
            for shift, t in results["tasks"].items()
        )
        + ".",
        "",
        SEEDED_NOTE if results["noise_seeded"] else "Private randomness secret (operating system).",
        f"Command: `{results['provenance']['command']}`, commit {results['provenance']['commit']}"
        f", {results['provenance']['date']}, {results['wall_s']:.0f} s, "
        f"{results['provenance']['cpu_count']} CPU cores ({results['provenance']['backend']}).",
    ]
    return "\n".join(lines) + "\n"


def method_label(method: str) -> str:
    """The method's name, with why it is only a reference point where it is one."""
    note = REFERENCE_NOTES.get(method)
    return f"{method} ({note})" if note else method


def plot(results: dict, path: pathlib.Path) -> None:
    """Test AUC against ε, one panel per shift, one line per method (± std over seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shifts = results["config"]["shifts"]
    methods = results["config"]["methods"]
    epsilons = results["config"]["epsilons"]
    figure, axes = plt.subplots(1, len(shifts), figsize=(4 * len(shifts), 3.6), sharey=True)
    for axis, shift in zip(np.atleast_1d(axes), shifts, strict=True):
        for method in methods:
            rows = [r for r in results["table"] if r["shift"] == shift and r["method"] == method]
            axis.errorbar(
                [r["epsilon"] for r in rows],
                [r["auc"][0] for r in rows],
                yerr=[r["auc"][1] for r in rows],
                marker="o",
                capsize=3,
                linestyle="--" if method in REFERENCE_NOTES else "-",
                label=method_label(method),
            )
        axis.set_xscale("log")
        axis.set_xticks(epsilons, [f"{e:g}" for e in epsilons])
        axis.minorticks_off()
        axis.set_title(f"shift {shift:g}")
        axis.set_xlabel("ε (end to end)")
    np.atleast_1d(axes)[0].set_ylabel("test AUC")
    handles, labels = np.atleast_1d(axes)[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, 0.16, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)


cli = Command(
    name="tabular",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, utility_vs_epsilon.png, stages/",
    examples=("--reproducible", "--reproducible --out runs/tabular"),
    quiet=True,
    config=lambda args: get_config(),
    run=lambda config, args: main(
        config, args.out, reproducible=args.reproducible, quiet=args.quiet
    ),
)


if __name__ == "__main__":
    with experiment_main("tabular"):
        cli()
