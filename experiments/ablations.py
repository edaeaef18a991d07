"""ρ, proxy-budget and composition ablations of DP-MixMin.

See `experiments/configs/ablations.py` for the command, the settings and the paper's numbers.
Writes `ablations.json` (every run, with the accountants' spent ε, and the run's provenance) and
`ablations.md` (the three tables, rendered by `pipeline.report`) to `--out`; the stages of every
setting share one store under `--out/stages`, so a setting equal to another is run once.
"""

from __future__ import annotations

import pathlib
import time

import numpy as np

from dpmix_jax.pipeline import ImagePipeline, presets, report
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from experiments.common_args import add_chest_xray_roots, chest_xray_tasks, experiment_main
from experiments.configs.ablations import PRESETS, AblationConfig, Setting, get_config
from experiments.configs.nih import PAPER_IMAGE_SIZE
from experiments.harness import Command, finish

VIEWS = ("ablation_rho", "ablation_proxy", "ablation_composition")


def _task(config: AblationConfig, roots: dict[str, pathlib.Path]):
    if config.data == "digits":
        return presets.digit_task(image_size=config.image_size)
    (task,) = chest_xray_tasks(
        roots, public=config.data, image_size=PAPER_IMAGE_SIZE, findings=("Atelectasis",)
    )
    return task


class _ReuseCounter:
    """Counts the runs a pipeline read back from the stage store (a `ProgressListener`)."""

    def __init__(self) -> None:
        self.count = 0

    def stage(self, name: str) -> None:
        pass

    def step(self, done: int, total: int) -> None:
        pass

    def reused(self, name: str) -> None:
        self.count += 1


def _setting_json(setting: Setting, public_size: int) -> dict:
    pipeline = setting.pipeline
    return {
        "study": setting.study,
        "setting": setting.label,
        "method": setting.method,
        "composition": pipeline.composition,
        "mix_fraction": pipeline.mix_fraction,
        "sequential_mixture_share": pipeline.sequential_mixture_share,
        "mixture_batch_size": pipeline.mixture.batch_size,
        "mixture_steps": pipeline.mixture.steps,
        "proxy_steps": pipeline.proxy.steps,
        "proxy_epochs": pipeline.proxy.steps * pipeline.proxy.batch_size / public_size,
    }


def main(
    config: AblationConfig,
    out_dir: pathlib.Path,
    *,
    reproducible: bool = False,
    **roots: pathlib.Path,
) -> dict:
    """Runs every setting of the three studies for every seed; writes `ablations.json` and
    `ablations.md` to `out_dir` and returns the JSON's content.

    Privacy: every run's spent ε is the one its accountants report for what ran (stored per run
    with its per-stage ε); with `reproducible` the seeds drive the private randomness.
    """
    out_dir = pathlib.Path(out_dir)
    use_compilation_cache(out_dir / "xla_cache")
    task = _task(config, roots)
    start = time.perf_counter()
    counter = _ReuseCounter()
    settings, runs = [], []
    for setting in config.settings():
        settings.append(_setting_json(setting, len(task.public)))
        pipeline = ImagePipeline(
            task, setting.pipeline, out_dir / "stages", reproducible=reproducible
        )
        pipeline.add_listener(counter)
        utilities = []
        for seed in config.seeds:
            run = pipeline.run(setting.method, config.epsilon, seed).to_json()
            mixture_rows = pipeline.split(seed)[0] if setting.method == "dp_mixmin" else None
            runs.append(
                {
                    "study": setting.study,
                    "setting": setting.label,
                    "mixture_examples": None if mixture_rows is None else len(mixture_rows),
                    **run,
                }
            )
            utilities.append(run["utility"])
        print(f"{setting.study:>12} {setting.label:<24} {np.mean(utilities):.4f}", flush=True)
    results = {
        "dataset": task.name,
        "metric": "test AUC",
        "higher_is_better": True,
        "epsilon": config.epsilon,
        "delta": config.pipeline.delta,
        "seeds": list(config.seeds),
        "noise_seeded": reproducible,
        "settings": settings,
        "runs": runs,
        "seconds": time.perf_counter() - start,
        "reused_runs": counter.count,
        "provenance": provenance(),
    }
    tables = "\n".join(report.render(view, results, "ablations.json") for view in VIEWS)
    return finish(out_dir, results, tables, name="ablations")


cli = Command(
    name="ablations",
    description=__doc__.splitlines()[0],
    writes="ablations.json, ablations.md, stages/",
    examples=("--preset cpu",),
    presets=PRESETS,
    options=lambda parser: add_chest_xray_roots(parser, public="chexpert"),
    quiet=True,
    config=lambda args: get_config(args.preset),
    run=lambda config, args: main(
        config,
        args.out,
        reproducible=args.reproducible,
        nih_root=args.nih_root,
        public_root=args.public_root,
    ),
)


if __name__ == "__main__":
    with experiment_main("ablations"):
        cli()
