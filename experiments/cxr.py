"""NIH ChestX-ray14 experiments (shared by `nih_chexpert` and `nih_mimic`): one DP-MixMin
comparison per finding, then macro AUC over the findings. See `experiments/configs/nih.py`.

`--privacy-unit` chooses what each (ε, δ) protects: one image (the paper's unit, the default) or
one patient with all of their images (user-level DP in both private stages, up to
`--max-images-per-patient` images of a sampled patient per step). Every output names it.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.pipeline import ImagePipeline, image, presets, run_comparison
from dpmix_jax.pipeline.compare import (
    METHOD_NAMES,
    keep_provenance_of_computing_run,
    provenance,
    summarize,
)
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.pipeline.results import METHODS as METHOD_ORDER
from dpmix_jax.privacy import SEEDED_NOTE
from experiments.common_args import add_chest_xray_roots, chest_xray_tasks
from experiments.configs.nih import PRESETS, CxrExperimentConfig, get_config
from experiments.harness import Command, UsageError, finish

# G of `--privacy-unit patient` unless given: a NIH patient has 3.6 images on average.
DEFAULT_MAX_IMAGES_PER_PATIENT = 4


def macro_table(per_task: dict[str, dict], privacy_unit: str) -> dict[str, dict]:
    """Macro AUC per (method, ε): the mean over tasks of each task's mean over seeds; each row
    names what its ε protects (`privacy_unit`, e.g. "per image")."""
    cells: dict[tuple[str, float], list[float]] = {}
    for results in per_task.values():
        for (method, eps), row in summarize(results).items():
            cells.setdefault((method, eps), []).append(row["mean"])
    return {
        f"{m} eps={e:g}": {
            "method": m,
            "epsilon": e,
            "macro_auc": float(np.mean(v)),
            "tasks": len(v),
            "privacy_unit": privacy_unit,
        }
        for (m, e), v in sorted(cells.items())
    }


def macro_markdown(summary: dict) -> str:
    """The macro AUC table, one row per method and one column per ε, with its caption."""
    macro, unit = summary["macro"], summary["privacy_unit"]
    epsilons = sorted({row["epsilon"] for row in macro.values()})
    methods = list(dict.fromkeys(row["method"] for row in macro.values()))
    cells = {(row["method"], row["epsilon"]): row for row in macro.values()}
    tasks = max(row["tasks"] for row in macro.values())
    lines = [
        f"Macro test AUC over {tasks} tasks ({summary['dataset']}; each task's mean over "
        f"{summary['seeds']} seeds; higher is better):",
        "",
        "| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
        "|---|" + "---|" * len(epsilons),
    ]
    for method in sorted(methods, key=METHOD_ORDER.index):
        row = [cells.get((method, e)) for e in epsilons]
        values = [f"{r['macro_auc']:.4f}" if r else "" for r in row]
        lines.append(f"| {METHOD_NAMES[method]} | " + " | ".join(values) + " |")
    lines += ["", f"Each ε is an (ε, δ = {summary['delta']:g}) guarantee {unit}."]
    return "\n".join(lines)


def main(
    config: CxrExperimentConfig,
    out_dir: pathlib.Path,
    *,
    reproducible: bool = False,
    progress: bool = True,
    **roots: pathlib.Path,
) -> dict:
    """Runs every task's comparison (under `out_dir/task<i>/`) and writes `results.json` (the
    macro AUCs, the run time and the provenance) and `results.md` to `out_dir`, each naming the
    privacy unit of its ε (`image.privacy_unit_label`); returns the macro AUCs."""
    out_dir = pathlib.Path(out_dir)
    start = time.time()
    if config.public == "digits":
        tasks = presets.digit_tasks(image_size=config.image_size, num_tasks=config.tasks)
    else:
        tasks = chest_xray_tasks(
            roots, public=config.public, image_size=config.image_size, findings=config.tasks
        )
    use_compilation_cache(out_dir / "xla_cache")
    unit = image.privacy_unit_label(config.pipeline)
    per_task = {}
    for index, task in enumerate(tasks):
        task_dir = out_dir / f"task{index}"
        per_task[task.name] = run_comparison(
            ImagePipeline(task, config.pipeline, task_dir / "stages", reproducible=reproducible),
            dataset=task.name,
            metric="test AUC",
            higher_is_better=True,
            methods=config.methods,
            epsilons=config.epsilons,
            seeds=config.seeds,
            out_dir=task_dir,
            true_weights=task.true_weights,
            source_names=task.source_names,
            privacy_unit=unit,
            progress=progress,
        )
    summary = {
        "dataset": "digits stand-in" if config.public == "digits" else f"NIH <- {config.public}",
        "metric": "macro test AUC",
        "macro": macro_table(per_task, unit),
        "privacy_unit": unit,
        "delta": config.pipeline.delta,
        "seeds": len(config.seeds),
        "tasks": list(per_task),
        "noise_seeded": reproducible,
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    keep_provenance_of_computing_run(summary, out_dir / "results.json", key="macro")
    randomness = SEEDED_NOTE if reproducible else "Private randomness secret (operating system)."
    return finish(out_dir, summary, f"{macro_markdown(summary)}\n\n{randomness}")["macro"]


def cli(public: str, argv: list[str] | None = None) -> dict:
    """The command line of `experiments.nih_PUBLIC` (`public`: "chexpert" or "mimic"); returns
    the macro AUCs."""

    def options(parser) -> None:
        add_chest_xray_roots(parser, public=public)
        parser.add_argument(
            "--smoke",
            action="store_true",
            help="with --preset paper: the paper's models, image size, k and methods, but 1-2 "
            "steps of batch 2 per stage, one seed, ε = 1 and one finding (a test that the paper "
            "path runs on a small folder of the real layouts; its AUCs mean nothing)",
        )
        parser.add_argument(
            "--privacy-unit",
            choices=image.PRIVACY_UNITS,
            default="image",
            help="what each (ε, δ) protects: image (example-level DP, the paper's unit) or "
            "patient (user-level DP: both private stages sample patients and clip the mean "
            "gradient of up to --max-images-per-patient of their images; needs --preset paper)",
        )
        parser.add_argument(
            "--max-images-per-patient",
            type=int,
            default=None,
            metavar="G",
            help="with --privacy-unit patient: the images a sampled patient contributes per step "
            f"(default {DEFAULT_MAX_IMAGES_PER_PATIENT}; a patient's other images are left out "
            "of that step)",
        )

    def config(args) -> CxrExperimentConfig:
        if args.smoke and args.preset != "paper":
            raise UsageError("--smoke applies to --preset paper")
        if args.privacy_unit == "patient" and args.preset != "paper":
            raise UsageError("--privacy-unit patient needs NIH patient ids: use --preset paper")
        limit = args.max_images_per_patient
        if limit is not None and args.privacy_unit != "patient":
            raise UsageError("--max-images-per-patient applies to --privacy-unit patient")
        if limit is not None and limit < 1:
            raise UsageError(f"--max-images-per-patient must be an integer >= 1, got {limit}")
        if args.privacy_unit == "patient" and limit is None:
            limit = DEFAULT_MAX_IMAGES_PER_PATIENT
        chosen = get_config(public, args.preset, smoke=args.smoke)
        pipeline = image.with_privacy_unit(chosen.pipeline, args.privacy_unit, limit)
        return dataclasses.replace(chosen, pipeline=pipeline)

    command = Command(
        name=f"nih_{public}",
        description=f"NIH ChestX-ray14 with {public} as public data: DP-MixMin against its "
        "baselines per finding, macro AUC over the findings.",
        writes="task<i>/ (one comparison per finding), results.json, results.md",
        examples=(
            "--preset cpu",
            f"--preset paper --nih-root data/nih --public-root data/{public}",
            f"--preset paper --smoke --nih-root FIXTURE/nih --public-root FIXTURE/{public}",
            f"--preset paper --privacy-unit patient --max-images-per-patient 4 "
            f"--nih-root data/nih --public-root data/{public}",
        ),
        presets=PRESETS,
        options=options,
        quiet=True,
        config=config,
        run=lambda config, args: main(
            config,
            args.out,
            nih_root=args.nih_root,
            public_root=args.public_root,
            reproducible=args.reproducible,
            progress=not args.quiet,
        ),
    )
    return command(argv)
