"""ρ, proxy-budget and composition ablations of DP-MixMin.

See `experiments/configs/ablations.py` for the command and the paper's numbers.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from dpmix_jax.pipeline import ImagePipeline, presets
from dpmix_jax.privacy import SEEDED_NOTE
from experiments.common_args import (
    add_chest_xray_roots,
    add_quiet_flag,
    add_reproducible_flag,
    add_seeds_option,
    experiment_main,
    experiment_parser,
    with_common_options,
)
from experiments.configs.ablations import AblationConfig, get_config
from experiments.configs.nih import CxrExperimentConfig
from experiments.cxr import real_tasks


def _task(config: AblationConfig, roots: dict[str, pathlib.Path]):
    if config.data == "digits":
        return presets.digit_task()
    cxr_config = CxrExperimentConfig(
        public=config.data, pipeline=config.pipeline, tasks=("Atelectasis",)
    )
    (task,) = real_tasks(cxr_config, roots["nih_root"], roots["public_root"])
    return task


def _utilities(pipeline: ImagePipeline, method: str, config: AblationConfig) -> list[float]:
    return [pipeline.run(method, config.epsilon, seed).utility for seed in config.seeds]


def main(
    config: AblationConfig,
    out_dir: pathlib.Path,
    *,
    reproducible: bool = False,
    **roots: pathlib.Path,
) -> dict:
    """Runs the three studies; writes `ablations.json` and `ablations.md` to `out_dir`."""
    task = _task(config, roots)
    rows: list[tuple[str, str, list[float]]] = []

    def study(name: str, setting: str, pipeline_config, method: str = "dp_mixmin") -> None:
        root = out_dir / name / setting.replace(" ", "_").replace("=", "")
        pipeline = ImagePipeline(task, pipeline_config, root, reproducible=reproducible)
        rows.append((name, setting, _utilities(pipeline, method, config)))
        mean = np.mean(rows[-1][2])
        print(f"{name:>12} {setting:<24} {mean:.4f}", flush=True)

    base = config.pipeline
    study("baseline", "uniform", base, method="uniform")
    for rho in config.mix_fractions:
        study("rho", f"rho={rho:g}", dataclasses.replace(base, mix_fraction=rho))
    for steps in config.proxy_steps:
        proxy = dataclasses.replace(base.proxy, steps=steps)
        study("proxy", f"proxy_steps={steps}", dataclasses.replace(base, proxy=proxy))
    study("composition", "parallel", dataclasses.replace(base, composition="parallel"))
    study("composition", "sequential 0.1/0.9", dataclasses.replace(base, composition="sequential"))
    study("composition", "non-private MixMin", base, method="nonprivate_mixmin")

    results = [
        {
            "study": s,
            "setting": t,
            "utilities": u,
            "mean": float(np.mean(u)),
            "std": float(np.std(u)),
        }
        for s, t, u in rows
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "ablations.json").write_text(json.dumps(results, indent=1, default=float))
    lines = [
        f"# DP-MixMin ablations on {task.name}, ε = {config.epsilon:g}, "
        f"{len(config.seeds)} seeds (test AUC)",
        "",
        "| study | setting | AUC (mean ± std) |",
        "|---|---|---|",
    ]
    lines += [
        f"| {r['study']} | {r['setting']} | {r['mean']:.4f} ± {r['std']:.4f} |" for r in results
    ]
    lines += ["", SEEDED_NOTE if reproducible else "Private randomness secret (operating system)."]
    (out_dir / "ablations.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"results": results}


if __name__ == "__main__":
    with experiment_main("ablations"):
        parser = experiment_parser("ablations", __doc__.splitlines()[0], examples=("--preset cpu",))
        parser.add_argument(
            "--preset",
            choices=("cpu", "paper"),
            default="cpu",
            help="cpu: the digit tasks (offline); paper: NIH with CheXpert as public data",
        )
        parser.add_argument(
            "--out",
            type=pathlib.Path,
            default=pathlib.Path("runs/ablations"),
            metavar="DIR",
            help="output folder: ablations.json, ablations.md, stages/",
        )
        add_chest_xray_roots(parser, public="chexpert")
        add_reproducible_flag(parser, seeds="--seeds")
        add_seeds_option(parser)
        add_quiet_flag(parser)
        args = parser.parse_args()
        main(
            with_common_options(get_config(args.preset), args),
            args.out,
            reproducible=args.reproducible,
            nih_root=args.nih_root,
            public_root=args.public_root,
        )
