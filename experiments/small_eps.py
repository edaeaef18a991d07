"""Small ε: λ's cosine to non-private MixMin at ε = 0.2 and 1, against the uniform reference.

Runs only the mixture stage of the pipelines (split, proxy, proxy outputs on D_mix, DP-MixMin
and exact MixMin on the same D_mix) for the image and text defaults, and a sweep of the image
default's mixture settings (T, η, b, C, ρ) on other draws of its data. See
`experiments/configs/small_eps.py` for the commands and the paper's numbers. Writes
`results.json`, `results.md` and `cosine_vs_epsilon.png`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from collections.abc import Iterable, Iterator

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax.mixing import cosine_similarity, dp_mixmin, uniform_cosine  # noqa: E402
from dpmix_jax.pipeline import ImagePipeline, TextPipeline  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache  # noqa: E402
from dpmix_jax.pipeline.default_pipelines import default_pipeline  # noqa: E402
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE  # noqa: E402
from experiments.common_args import (  # noqa: E402
    add_chest_xray_roots,
    chest_xray_tasks,
    experiment_main,
)
from experiments.configs import small_eps as configs  # noqa: E402
from experiments.configs.enron import TextExperimentConfig  # noqa: E402
from experiments.configs.nih import PAPER_IMAGE_SIZE  # noqa: E402
from experiments.harness import Command, finish  # noqa: E402
from experiments.run_files import as_json  # noqa: E402

# The papers' cosines to non-private MixMin (Tables 11, 14, 15): (DP-MixMin, uniform reference).
PAPER = {
    "image": {
        0.2: ("0.70 ± 0.08 (CheXpert), 0.58 ± 0.17 (MIMIC-CXR)", "0.75, 0.80"),
        1.0: ("0.97 ± 0.01 (CheXpert), 0.93 ± 0.04 (MIMIC-CXR)", "0.75, 0.80"),
    },
    "text": {
        0.2: ("0.08 ± 0.11 (Enron); 0.92 ± 0.02 (OpenWebMath)", "0.40 (Enron)"),
        1.0: ("1.00 ± 0.00 (OpenWebMath)", "-"),
        2.0: ("0.92 ± 0.05 (Enron)", "0.40 (Enron)"),
    },
}


def measure(
    pipeline: MixturePipeline, task_name: str, epsilons: Iterable[float], seeds: Iterable[int]
) -> list[dict]:
    """Per seed: non-private MixMin's λ on D_mix, the uniform reference's cosine to it, and per ε
    DP-MixMin's λ (the pipeline's mixture stage), its cosine and the accountant's spent ε.

    Privacy: the cosines compare private releases with a non-private λ of the same sensitive
    D_mix; they are diagnostics of this study, not releases.
    """
    rows = []
    for seed in seeds:
        reference = pipeline.nonprivate_weights(seed)
        users = pipeline.mixture_inputs(seed).get("user_ids")
        row = {
            "task": task_name,
            "seed": seed,
            # The privacy units in D_mix: users at user level, else examples.
            "num_units": len(pipeline.split(seed)[0]) if users is None else len(set(users)),
            "nonprivate_weights": reference.tolist(),
            "uniform_cosine": uniform_cosine(reference),
            "runs": [],
        }
        for epsilon in epsilons:
            weights, spent = pipeline.mixture(epsilon, seed)
            row["runs"].append(
                {
                    "epsilon": epsilon,
                    "weights": weights.tolist(),
                    "cosine": cosine_similarity(weights, reference),
                    "spent_epsilon": spent.epsilon,
                    "spent_delta": spent.delta,
                }
            )
        cosines = ", ".join(f"ε={r['epsilon']:g}: {r['cosine']:.3f}" for r in row["runs"])
        print(
            f"{task_name} seed {seed}: uniform {row['uniform_cosine']:.3f}, {cosines}", flush=True
        )
        rows.append(row)
    return rows


def summarize(rows: list[dict], epsilons: Iterable[float]) -> list[dict]:
    """Mean ± std over tasks and seeds per ε: DP-MixMin's and the uniform reference's cosines,
    how many runs fell below the uniform reference, and the largest spent ε."""
    uniform = np.array([r["uniform_cosine"] for r in rows])
    summary = []
    for epsilon in epsilons:
        runs = [run for r in rows for run in r["runs"] if run["epsilon"] == epsilon]
        cosines = np.array([run["cosine"] for run in runs])
        summary.append(
            {
                "epsilon": epsilon,
                "count": len(runs),
                "cosine_mean": float(cosines.mean()),
                "cosine_std": float(cosines.std()),
                "uniform_mean": float(uniform.mean()),
                "uniform_std": float(uniform.std()),
                "below_uniform": int(np.sum(cosines < uniform)),
                "max_spent_epsilon": max(run["spent_epsilon"] for run in runs),
                "mean_units": float(np.mean([r["num_units"] for r in rows])),
            }
        )
    return summary


def sweep(config: configs.SmallEpsConfig, root: pathlib.Path, *, reproducible: bool) -> list[dict]:
    """Every sweep point at `sweep_epsilon` on the image default's other data draws
    (`sweep_seeds`), `sweep_draws` noise draws each, every run with a σ = 0 twin on the same
    batches. Draw d of a data seed uses the same random stream at every point (common random
    numbers), so that `delta` (the mean paired difference to the first point, with its standard
    error) compares settings, not noise draws.

    Privacy: the sweep reads only data seeds disjoint from the reported task's (data seed 0);
    its DP runs are accounted like the mixture stage, and the twins (σ = 0) are not private.
    """
    pipelines: dict[tuple[int, float], MixturePipeline] = {}
    results = []
    for point in config.sweep:
        cells = []
        for seed in config.sweep_seeds:
            key = (seed, point.mix_fraction)
            if key not in pipelines:
                pipelines[key] = default_pipeline(
                    dataclasses.replace(config.image, mix_fraction=point.mix_fraction),
                    root / f"data{seed}",
                    seed=seed,
                    reproducible=reproducible,
                )
            pipeline = pipelines[key]
            inputs = pipeline.mixture_inputs(seed)
            reference = pipeline.nonprivate_weights(seed)
            for draw in range(config.sweep_draws):
                settings = dict(
                    delta=config.image.delta,
                    steps=point.steps,
                    batch_size=point.batch_size,
                    clip_norm=point.clip_norm,
                    learning_rate=point.learning_rate,
                    seed=pipeline.private_seed(seed, "sweep", draw),
                    shift=config.image.mixture.shift,
                    accountant=config.image.mixture.accountant,
                )
                private = dp_mixmin(**inputs, epsilon=config.sweep_epsilon, **settings)
                no_noise = dp_mixmin(**inputs, noise_multiplier=0.0, **settings)
                cells.append(
                    {
                        "seed": seed,
                        "draw": draw,
                        "num_units": private.num_units,
                        "noise_multiplier": private.noise_multiplier,
                        "sampling_rate": private.sampling_rate,
                        "spent_epsilon": private.epsilon,
                        "cosine": cosine_similarity(private.weights, reference),
                        "average_cosine": cosine_similarity(private.average_weights, reference),
                        "no_noise_cosine": cosine_similarity(no_noise.weights, reference),
                        "uniform_cosine": uniform_cosine(reference),
                    }
                )

        first = results[0]["cells"] if results else cells
        paired = np.array([c["cosine"] - f["cosine"] for c, f in zip(cells, first, strict=True)])
        mean_units = float(np.mean([c["num_units"] for c in cells]))
        sigma = float(np.mean([c["noise_multiplier"] for c in cells]))
        result = {
            **dataclasses.asdict(point),
            "label": point.label(),
            "cells": cells,
            "cosine": _mean_std(cells, "cosine"),
            "average_cosine": _mean_std(cells, "average_cosine"),
            "no_noise_cosine": _mean_std(cells, "no_noise_cosine"),
            "uniform_cosine": _mean_std(cells, "uniform_cosine"),
            "delta": (float(paired.mean()), float(paired.std() / np.sqrt(len(paired)))),
            "mean_units": mean_units,
            "noise_multiplier": sigma,
            # Standard deviation of one coordinate of the noisy mean gradient, σC/b.
            "noise_per_step": sigma * point.clip_norm / point.batch_size,
            "max_spent_epsilon": max(c["spent_epsilon"] for c in cells),
        }
        results.append(result)
        print(
            f"sweep {point.label():<40} cos {result['cosine'][0]:.3f} ± {result['cosine'][1]:.3f}"
            f" (σ = 0: {result['no_noise_cosine'][0]:.3f}), Δ {result['delta'][0]:+.3f}"
            f" ± {result['delta'][1]:.3f}, σ = {sigma:.2f}",
            flush=True,
        )
    return results


def _mean_std(cells: list[dict], name: str) -> tuple[float, float]:
    values = np.array([c[name] for c in cells])
    return float(values.mean()), float(values.std())


def markdown(results: dict) -> str:
    """The results as markdown: the cosine table beside the paper's, then the sweep."""
    seeded = results["noise_seeded"]
    lines = [
        "# λ's cosine to non-private MixMin on the same D_mix (mixture stage only)",
        "",
        "Mean ± std over tasks × seeds; `below uniform`: runs whose cosine is below the uniform "
        "reference's on the same D_mix; ε spent: the accountant's, max over runs.",
        "",
        "| default | ε | runs | units in D_mix | DP-MixMin | uniform reference | below uniform"
        " | ε spent | paper DP-MixMin | paper uniform |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, part in results["defaults"].items():
        for s in part["summary"]:
            paper, paper_uniform = PAPER[name].get(s["epsilon"], ("-", "-"))
            lines.append(
                f"| {name} | {s['epsilon']:g} | {s['count']} | {s['mean_units']:.0f} | "
                f"{s['cosine_mean']:.3f} ± {s['cosine_std']:.3f} | "
                f"{s['uniform_mean']:.3f} ± {s['uniform_std']:.3f} | "
                f"{s['below_uniform']}/{s['count']} | {s['max_spent_epsilon']:.3f} | "
                f"{paper} | {paper_uniform} |"
            )
    lines += ["", *(f"- {name}: {part['task']}" for name, part in results["defaults"].items())]
    if results["sweep"]:
        config = results["config"]
        lines += [
            "",
            f"## Sweep of the image default's mixture settings at ε = {config['sweep_epsilon']:g}",
            "",
            f"On data seeds {config['sweep_seeds'][0]}-{config['sweep_seeds'][-1]} of the image "
            "default's generator (other public/sensitive splits, λ* and labels; never data seed "
            f"0, whose results are above), {config['sweep_draws']} noise draws each; mean ± std "
            "over all runs. Draw d of a data seed uses the same random stream at every setting, "
            "so Δ, the mean paired difference of the cosine to the first row (± its standard "
            "error), compares settings rather than noise draws. σ = 0: the same batches without "
            "noise (optimisation and clipping error only). σC/b: the noise's standard deviation "
            "per coordinate of the mean gradient. Average iterate: the mean of λ_1..λ_T of the "
            "same private run (post-processing, no extra ε); the pipeline releases λ_T.",
            "",
            "| T | η | b | C | ρ | units in D_mix | σ | σC/b | DP-MixMin cos | average iterate "
            "cos | Δ vs first row | σ = 0 cos | uniform cos | ε spent |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["sweep"]:
            lines.append(
                f"| {r['steps']} | {r['learning_rate']:g} | {r['batch_size']:g} | "
                f"{r['clip_norm']:g} | {r['mix_fraction']:g} | {r['mean_units']:.0f} | "
                f"{r['noise_multiplier']:.2f} | {r['noise_per_step']:.3f} | "
                f"{r['cosine'][0]:.3f} ± {r['cosine'][1]:.3f} | "
                f"{r['average_cosine'][0]:.3f} ± {r['average_cosine'][1]:.3f} | "
                f"{r['delta'][0]:+.3f} ± {r['delta'][1]:.3f} | "
                f"{r['no_noise_cosine'][0]:.3f} ± {r['no_noise_cosine'][1]:.3f} | "
                f"{r['uniform_cosine'][0]:.3f} | {r['max_spent_epsilon']:.3f} |"
            )
    lines += [
        "",
        SEEDED_NOTE if seeded else "Private randomness secret (operating system).",
        f"Command: `{results['command']}`, {results['wall_s']:.0f} s.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Cosine to non-private MixMin against ε: DP-MixMin (mean ± std over tasks × seeds) and the
    uniform reference, one panel per default. Draws from `results` alone (`results.json` read
    back will do)."""
    names = list(results["defaults"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        summary = results["defaults"][name]["summary"]
        eps = [s["epsilon"] for s in summary]
        ax.errorbar(
            eps,
            [s["cosine_mean"] for s in summary],
            yerr=[s["cosine_std"] for s in summary],
            marker="o",
            capsize=3,
            label="DP-MixMin",
        )
        ax.errorbar(
            eps,
            [s["uniform_mean"] for s in summary],
            yerr=[s["uniform_std"] for s in summary],
            marker="s",
            linestyle="--",
            capsize=3,
            label="uniform reference",
        )
        ax.set(xscale="log", xlabel="ε (mixture stage)", ylabel="cosine to non-private λ")
        ax.minorticks_off()
        ax.set_xticks(eps, [f"{e:g}" for e in eps])
        ax.set_ylim(min(0.0, ax.get_ylim()[0]), 1.02)
        runs = sorted({s["count"] for s in summary})
        ax.set_title(
            f"{name} default: mean ± std over {'/'.join(map(str, runs))} runs (tasks × seeds)",
            fontsize=10,
        )
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pipelines(
    config: configs.SmallEpsConfig, root: pathlib.Path, roots: dict, reproducible: bool
) -> Iterator[tuple[str, str, MixturePipeline]]:
    """(default name, task name, pipeline) of every task the study measures: the embedded
    defaults, or NIH's findings with CheXpert and Enron."""
    if config.data == "builtin":
        for name, settings, folder in (
            ("image", config.image, "image0"),
            ("text", config.text, "text"),
        ):
            if settings is not None:
                pipeline = default_pipeline(settings, root / folder, reproducible=reproducible)
                yield name, pipeline.task.name, pipeline
        return
    if config.image is not None:
        tasks = chest_xray_tasks(roots, public="chexpert", image_size=PAPER_IMAGE_SIZE)
        for index, task in enumerate(tasks):
            pipeline = ImagePipeline(
                task, config.image, root / f"image{index}", reproducible=reproducible
            )
            yield "image", task.name, pipeline
    if config.text is not None:
        data_root = pathlib.Path(roots["data_root"])
        task = TextExperimentConfig(
            data="enron",
            pipeline=config.text,
            enron_root=str(data_root / "enron" / "maildir"),
            public_root=str(data_root / "common_pile"),
        ).task()
        yield (
            "text",
            task.name,
            TextPipeline(task, config.text, root / "text", reproducible=reproducible),
        )


def main(
    config: configs.SmallEpsConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
    run_sweep: bool = True,
    **roots: pathlib.Path,
) -> dict:
    """Runs the study; writes `results.json`, `results.md` and `cosine_vs_epsilon.png` to `out`.

    Args:
        config: the settings.
        out: the output folder (with `stages/` and `xla_cache/`).
        reproducible: seed the splits, noise and sampling with the run seeds.
        run_sweep: run `config.sweep` (False skips it).
        roots: with the paper preset, `nih_root`, `public_root` and `data_root`.
    """
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    use_compilation_cache(out / "xla_cache")
    rows: dict[str, list[dict]] = {}
    tasks: dict[str, list[str]] = {}
    for name, task_name, pipeline in _pipelines(config, out / "stages", roots, reproducible):
        rows.setdefault(name, []).extend(
            measure(pipeline, task_name, config.epsilons, config.seeds)
        )
        tasks.setdefault(name, []).append(task_name)
    defaults = {
        name: {
            "task": "; ".join(tasks[name]),
            "summary": summarize(part, config.epsilons),
            "rows": part,
        }
        for name, part in rows.items()
    }
    swept = sweep(config, out / "stages" / "sweep", reproducible=reproducible) if run_sweep else []
    results = {
        "config": as_json(dataclasses.asdict(config)),
        "command": " ".join(["python -m experiments.small_eps", *sys.argv[1:]]),
        "noise_seeded": reproducible,
        "defaults": defaults,
        "sweep": swept,
        "paper": {name: {str(e): v for e, v in cells.items()} for name, cells in PAPER.items()},
        "wall_s": time.time() - start,
        "provenance": provenance(),
    }
    return finish(out, results, markdown(results), plots={"cosine_vs_epsilon.png": plot})


def _options(parser) -> None:
    parser.add_argument(
        "--no-sweep", action="store_true", help="skip the sweep of the image mixture settings"
    )
    add_chest_xray_roots(parser, public="chexpert")
    parser.add_argument(
        "--data-root",
        type=pathlib.Path,
        default=pathlib.Path("data"),
        metavar="DIR",
        help="paper preset: holds enron/maildir and common_pile/<domain>/",
    )
    parser.add_argument(
        "--weights-root",
        type=pathlib.Path,
        default=pathlib.Path("weights"),
        metavar="DIR",
        help="paper preset: holds gpt2/ (the proxies' starting weights)",
    )


cli = Command(
    name="small_eps",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, cosine_vs_epsilon.png, stages/",
    examples=("--preset cpu", "--preset cpu --no-sweep --reproducible"),
    presets=configs.PRESETS,
    options=_options,
    quiet=True,
    config=lambda args: configs.get_config(args.preset, weights_root=str(args.weights_root)),
    run=lambda config, args: main(
        config,
        args.out,
        reproducible=args.reproducible,
        run_sweep=not args.no_sweep,
        nih_root=args.nih_root,
        public_root=args.public_root,
        data_root=args.data_root,
    ),
)


if __name__ == "__main__":
    with experiment_main("small_eps"):
        cli()
