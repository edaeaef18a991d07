"""Enron (user level) and, through `experiments.openwebmath`, OpenWebMath (example level): DP-MixMin
against its baselines on text, one comparison per ρ. See `experiments/configs/enron.py`.

    python -m experiments.enron --preset cpu --out DIR

Writes, per ρ, `rho<ρ>/results.json`, `results.md` and plots (`pipeline.compare`), and at the top
`results.json` (every ρ's results, the run time and the provenance) and `results.md` (the
utility against ρ, then every ρ's tables).
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from types import ModuleType

import numpy as np

from dpmix_jax.pipeline import run_comparison
from dpmix_jax.pipeline.compare import METHOD_NAMES, keep_provenance_of_computing_run, provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.text import TextPipeline, require_paths
from experiments.common_args import experiment_main
from experiments.configs import enron as configs
from experiments.configs.enron import TextExperimentConfig
from experiments.harness import Command, UsageError, finish


def main(
    config: TextExperimentConfig,
    out_dir: str | pathlib.Path,
    *,
    reproducible: bool = False,
    progress: bool = True,
) -> dict:
    """Runs the comparison for every ρ; returns `{ρ: results.json content}`.

    Every input path (data, weights) is checked first: a missing one is a ValueError naming it,
    before anything is trained.
    """
    out_dir = pathlib.Path(out_dir)
    start = time.time()
    task = config.task()
    use_compilation_cache(out_dir / "xla_cache")
    results, tables = {}, []
    for rho in config.mix_fractions:
        pipeline_config = dataclasses.replace(config.pipeline, mix_fraction=rho)
        run_dir = out_dir / f"rho{rho:g}"
        results[rho] = run_comparison(
            TextPipeline(task, pipeline_config, run_dir / "stages", reproducible=reproducible),
            dataset=f"{task.name}, ρ = {rho:g}",
            metric="test perplexity",
            higher_is_better=False,
            methods=config.methods,
            epsilons=config.epsilons,
            seeds=config.seeds,
            out_dir=run_dir,
            true_weights=task.true_weights,
            progress=progress,
        )
        tables.append((run_dir / "results.md").read_text())
    summary = {
        "dataset": task.name,
        "metric": "test perplexity",
        "mix_fractions": list(config.mix_fractions),
        "per_rho": {f"{rho:g}": result for rho, result in results.items()},
        "noise_seeded": reproducible,
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    keep_provenance_of_computing_run(summary, out_dir / "results.json", key="per_rho")
    finish(out_dir, summary, rho_markdown(summary) + "\n\n" + "\n".join(tables))
    return results


def rho_markdown(summary: dict) -> str:
    """Test perplexity (mean ± std over seeds) per method and ε, one column per ρ."""
    rhos = [f"{rho:g}" for rho in summary["mix_fractions"]]
    cells: dict[tuple[str, float], dict[str, str]] = {}
    for rho in rhos:
        runs = summary["per_rho"][rho]["runs"]
        for method, epsilon in dict.fromkeys((r["method"], r["epsilon"]) for r in runs):
            values = [
                r["utility"] for r in runs if (r["method"], r["epsilon"]) == (method, epsilon)
            ]
            spread = f" ± {np.std(values):.2f}" if len(values) > 1 else ""
            cells.setdefault((method, epsilon), {})[rho] = f"{np.mean(values):.2f}{spread}"
    lines = [
        f"Test perplexity against ρ ({summary['dataset']}; mean ± std over seeds):",
        "",
        "| method | ε | " + " | ".join(f"ρ = {rho}" for rho in rhos) + " |",
        "|---|---|" + "---|" * len(rhos),
    ]
    for (method, epsilon), row in cells.items():
        label = "-" if epsilon is None else f"{epsilon:g}"
        lines.append(
            f"| {METHOD_NAMES.get(method, method)} | {label} | "
            + " | ".join(row.get(rho, "-") for rho in rhos)
            + " |"
        )
    return "\n".join(lines)


def cli(configs_module: ModuleType, argv: list[str] | None = None) -> dict:
    """The command line of the text experiment whose settings are `configs_module`
    (`experiments.configs.enron` or `.openwebmath`); returns `{ρ: results}`."""
    name = configs_module.__name__.rsplit(".", 1)[-1]

    def options(parser) -> None:
        parser.add_argument(
            "--data-root",
            default="data",
            metavar="DIR",
            help=f"paper preset: the data folder (layout in experiments/configs/{name}.py)",
        )
        parser.add_argument(
            "--weights-root",
            default="weights",
            metavar="DIR",
            help="paper preset: the folder of the GPT-2 weights (transformers format)",
        )
        parser.add_argument(
            "--smoke",
            action="store_true",
            help="with --preset paper: the paper's data layout, models, sequence length, k and "
            "methods, but 1-2 steps of one or two units per stage, one ρ, one seed and ε = 1 (a "
            "test that the paper path runs on a small folder; its perplexities mean nothing)",
        )

    def config(args) -> TextExperimentConfig:
        if args.smoke and args.preset != "paper":
            raise UsageError("--smoke applies to --preset paper")
        chosen = configs_module.get_config(
            args.preset,
            data_root=args.data_root,
            weights_root=args.weights_root,
            smoke_test=args.smoke,
        )
        try:
            require_paths(chosen.input_paths())
        except ValueError as err:
            raise ValueError(f"{err} (see {configs_module.__name__})") from None
        return chosen

    command = Command(
        name=name,
        description=(configs_module.__doc__ or "").splitlines()[0],
        writes="one rho<ρ>/ per ρ (results.json, results.md, plots, stages/), results.json with "
        "every ρ and results.md with the utility against ρ and every table",
        examples=(
            "--preset cpu",
            "--preset paper --data-root DATA --weights-root WEIGHTS --out runs/" + name + "_paper",
            "--preset paper --smoke --data-root FIXTURE --weights-root WEIGHTS --out DIR",
        ),
        presets=configs_module.PRESETS,
        options=options,
        quiet=True,
        config=config,
        run=lambda config, args: main(
            config, args.out, reproducible=args.reproducible, progress=not args.quiet
        ),
    )
    return command(argv)


if __name__ == "__main__":
    with experiment_main("enron"):
        cli(configs)
