"""Gradient shift: DP-MixMin's λ with each per-unit gradient shift, at the preset's C and a tuned C.

Runs only the mixture stage of the image and text defaults (`pipeline.default_pipelines`, as
`experiments.small_eps` does): for every shift of `mixing.SHIFTS`, a clip norm is tuned on other
draws of the default's data, then DP-MixMin runs at ε = 1 with the preset's C and the tuned C on
the reported data, all shifts and clip norms of a seed on the same batches and noise draws. See
`experiments/configs/shift_study.py`. Writes `results.json`, `results.md` and
`cosine_vs_clip_norm.png`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax.mixing import cosine_similarity, dp_mixmin, excess_loss, uniform_cosine  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache  # noqa: E402
from dpmix_jax.pipeline.default_pipelines import default_pipeline  # noqa: E402
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import shift_study as configs  # noqa: E402
from experiments.harness import Command, finish  # noqa: E402
from experiments.run_files import as_json  # noqa: E402

# The stage folders of the reported draw of each default (those of `experiments.small_eps`).
REPORTED_STAGES = {"image": "image0", "text": "text"}


def run_cells(
    pipeline: MixturePipeline,
    seed: int,
    cells: list[tuple[str, float]],
    *,
    epsilon: float,
    draw: int = 0,
) -> list[dict[str, Any]]:
    """DP-MixMin on run `seed`'s D_mix at every (shift, C) of `cells`, on one random stream.

    The mixture settings are the pipeline's, except the shift, C and η = η_preset·C_preset/C.
    Every cell of a (seed, draw) uses the same private stream, so the cells see the same
    Poisson batches and the same standard-normal noise (scaled by their own σC): their
    differences compare settings, not noise draws.

    Privacy: each cell is a full DP-MixMin run on D_mix, accounted for its own σ, q and T (its
    `spent_epsilon`); the cosines and excess losses compare it with non-private MixMin on the
    same D_mix and are diagnostics of this study, not releases.
    """
    settings = pipeline.config.mixture
    inputs = pipeline.mixture_inputs(seed)
    reference = pipeline.nonprivate_weights(seed)
    loss_inputs = {name: value for name, value in inputs.items() if name != "user_ids"}
    user_level = inputs.get("user_ids") is not None
    stream = pipeline.private_seed(seed, "shift_study", epsilon, draw, pipeline.config_key)
    rows = []
    for shift, clip_norm in cells:
        result = dp_mixmin(
            **inputs,
            max_examples_per_user=settings.max_examples_per_user if user_level else None,
            epsilon=epsilon,
            delta=pipeline.config.delta,
            steps=settings.steps,
            batch_size=settings.batch_size,
            clip_norm=clip_norm,
            learning_rate=scaled_learning_rate(settings, clip_norm),
            seed=stream,
            solver=settings.solver,
            shift=shift,
            accountant=settings.accountant,
            allow_large_delta=pipeline.config.allow_large_delta,
            noise=settings.noise,
            bands=settings.bands,
            adaptive_clipping=settings.adaptive_clipping,
        )
        rows.append(
            {
                "seed": seed,
                "draw": draw,
                "shift": shift,
                "clip_norm": clip_norm,
                "learning_rate": scaled_learning_rate(settings, clip_norm),
                "num_units": result.num_units,
                "noise_multiplier": result.noise_multiplier,
                "sampling_rate": result.sampling_rate,
                "spent_epsilon": result.epsilon,
                "weights": np.asarray(result.weights).tolist(),
                "cosine": cosine_similarity(result.weights, reference),
                "excess_loss": excess_loss(result.weights, reference, **loss_inputs),
                "uniform_cosine": uniform_cosine(reference),
            }
        )
    return rows


def scaled_learning_rate(settings: Any, clip_norm: float) -> float | None:
    """η_preset · C_preset / C (None for Frank-Wolfe, which has no η)."""
    if settings.learning_rate is None:
        return None
    return settings.learning_rate * settings.clip_norm / clip_norm


def grid(pipeline: MixturePipeline, config: configs.ShiftStudyConfig) -> list[float]:
    """The tuning grid: `clip_factors` times the preset's C."""
    return [pipeline.config.mixture.clip_norm * f for f in config.clip_factors]


def tune(
    name: str, pipelines: list[MixturePipeline], seeds: tuple[int, ...], config
) -> dict[str, Any]:
    """Mean cosine (and excess loss) of every (shift, C) of the grid on the tuning draws, and
    per shift the C with the highest mean cosine.

    Privacy: the tuning pipelines hold other draws of the default (data seeds disjoint from the
    reported one), so choosing C here reads nothing of the reported D_mix.
    """
    clip_norms = grid(pipelines[0], config)
    cells = [(s, c) for s in config.shifts for c in clip_norms]
    runs = []
    for pipeline, seed in zip(pipelines, seeds, strict=True):
        for draw in range(config.tuning_draws):
            runs += run_cells(pipeline, seed, cells, epsilon=config.epsilon, draw=draw)
    table = []
    for shift, clip_norm in cells:
        chosen = [r for r in runs if r["shift"] == shift and r["clip_norm"] == clip_norm]
        table.append(
            {
                "shift": shift,
                "clip_norm": clip_norm,
                "cosine": _mean_std(chosen, "cosine"),
                "excess_loss": _mean_std(chosen, "excess_loss"),
                "count": len(chosen),
            }
        )
    best = {
        shift: max((t for t in table if t["shift"] == shift), key=lambda t: t["cosine"][0])[
            "clip_norm"
        ]
        for shift in config.shifts
    }
    for shift, clip_norm in best.items():
        print(f"{name}: tuned C for shift {shift!r}: {clip_norm:g}", flush=True)
    return {"seeds": list(seeds), "table": table, "best": best, "runs": runs}


def report(
    pipeline: MixturePipeline, config: configs.ShiftStudyConfig, best: dict[str, float]
) -> dict[str, Any]:
    """Every shift at the preset's C and at its tuned C on the reported data, over the seeds;
    per cell the mean ± std of the cosine and excess loss and the paired difference of the
    cosine to the preset's own cell (preset shift, preset C), with its standard error."""
    preset = pipeline.config.mixture
    cells = []
    for shift in config.shifts:
        cells.append((shift, preset.clip_norm))
        if best[shift] != preset.clip_norm:
            cells.append((shift, best[shift]))
    runs = []
    for seed in config.seeds:
        runs += run_cells(pipeline, seed, cells, epsilon=config.epsilon)
    base = [r for r in runs if r["shift"] == preset.shift and r["clip_norm"] == preset.clip_norm]
    summary = []
    for shift, clip_norm in cells:
        chosen = [r for r in runs if r["shift"] == shift and r["clip_norm"] == clip_norm]
        paired = np.array([c["cosine"] - b["cosine"] for c, b in zip(chosen, base, strict=True)])
        summary.append(
            {
                "shift": shift,
                "clip_norm": clip_norm,
                "tuned": clip_norm == best[shift],
                "preset": clip_norm == preset.clip_norm,
                "learning_rate": chosen[0]["learning_rate"],
                "noise_multiplier": float(np.mean([r["noise_multiplier"] for r in chosen])),
                "cosine": _mean_std(chosen, "cosine"),
                "excess_loss": _mean_std(chosen, "excess_loss"),
                "delta_cosine": (float(paired.mean()), float(paired.std() / np.sqrt(len(paired)))),
                "uniform_cosine": _mean_std(chosen, "uniform_cosine"),
                "max_spent_epsilon": max(r["spent_epsilon"] for r in chosen),
                "mean_units": float(np.mean([r["num_units"] for r in chosen])),
            }
        )
        print(
            f"{shift:>8} C={clip_norm:<8g} cos {summary[-1]['cosine'][0]:.3f} ± "
            f"{summary[-1]['cosine'][1]:.3f}, excess {summary[-1]['excess_loss'][0]:.2e}",
            flush=True,
        )
    return {"summary": summary, "runs": runs}


def _mean_std(rows: list[dict], name: str) -> tuple[float, float]:
    values = np.array([r[name] for r in rows])
    return float(values.mean()), float(values.std())


def markdown(results: dict) -> str:
    """The results as markdown: per default, every shift at the preset's and its tuned C."""
    config = results["config"]
    lines = [
        f"# DP-MixMin's gradient shift at ε = {config['epsilon']:g}: λ's cosine to non-private "
        "MixMin (mixture stage only)",
        "",
        f"Mean ± std over {len(config['seeds'])} seeds of the reported data. `tuned`: the C with "
        "the highest mean cosine for that shift on other draws of the default ("
        + "; ".join(
            f"{name}: {what} seeds {_seeds(config[f'{name}_tuning_seeds'])}"
            for name, what in (("image", "data"), ("text", "task"))
            if name in results["defaults"]
        )
        + f"; {config['tuning_draws']} noise draws each; grid "
        f"{', '.join(f'{f:g}' for f in config['clip_factors'])} × the preset's C), never on the "
        "reported data. η = η_preset · C_preset / C. Δ cos: mean paired difference of the cosine "
        "to the preset's own row (same seeds, batches and noise draws) ± its standard error. "
        "Excess: MixMin loss of λ above non-private MixMin's on the same D_mix. ε spent: the "
        "accountant's, max over runs.",
    ]
    for name, part in results["defaults"].items():
        lines += [
            "",
            f"## {name} default: {part['task']}",
            "",
            "| shift | C | C chosen as | η | σ | cos to non-private | Δ cos vs preset | excess "
            "loss | uniform cos | ε spent |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for s in part["summary"]:
            chosen = " and ".join(
                label for label, flag in (("preset", s["preset"]), ("tuned", s["tuned"])) if flag
            )
            rate = "-" if s["learning_rate"] is None else f"{s['learning_rate']:.3g}"
            lines.append(
                f"| {s['shift']} | {s['clip_norm']:g} | {chosen} | {rate} | "
                f"{s['noise_multiplier']:.2f} | {s['cosine'][0]:.3f} ± {s['cosine'][1]:.3f} | "
                f"{s['delta_cosine'][0]:+.3f} ± {s['delta_cosine'][1]:.3f} | "
                f"{s['excess_loss'][0]:.2e} ± {s['excess_loss'][1]:.1e} | "
                f"{s['uniform_cosine'][0]:.3f} | {s['max_spent_epsilon']:.3f} |"
            )
        lines += [
            "",
            f"Tuning on the other draws (mean cosine, {name} default):",
            "",
            "| shift | " + " | ".join(f"C = {c:g}" for c in part["tuning_grid"]) + " |",
            "|---|" + "---|" * len(part["tuning_grid"]),
        ]
        for shift in config["shifts"]:
            row = [t for t in part["tuning"]["table"] if t["shift"] == shift]
            lines.append(
                f"| {shift} | "
                + " | ".join(f"{t['cosine'][0]:.3f} ± {t['cosine'][1]:.3f}" for t in row)
                + " |"
            )
    lines += [
        "",
        SEEDED_NOTE if results["noise_seeded"] else "Private randomness secret (operating system).",
        f"Command: `{results['command']}`, {results['wall_s']:.0f} s.",
    ]
    return "\n".join(lines)


def _seeds(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


def plot(results: dict, path: pathlib.Path) -> None:
    """Tuning curves (mean cosine against C on the other draws, one line per shift) with the
    reported data's cells (mean ± std) on top, one panel per default."""
    names = list(results["defaults"])
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        part = results["defaults"][name]
        for index, shift in enumerate(results["config"]["shifts"]):
            color = f"C{index}"
            row = [t for t in part["tuning"]["table"] if t["shift"] == shift]
            ax.plot(
                [t["clip_norm"] for t in row],
                [t["cosine"][0] for t in row],
                color=color,
                linestyle="--",
                marker=".",
                label=f"{shift}: tuning draws",
            )
            reported = [s for s in part["summary"] if s["shift"] == shift]
            ax.errorbar(
                [s["clip_norm"] for s in reported],
                [s["cosine"][0] for s in reported],
                yerr=[s["cosine"][1] for s in reported],
                color=color,
                marker="o",
                linestyle="none",
                capsize=3,
                label=f"{shift}: reported data",
            )
        ax.set(xscale="log", xlabel="clip norm C", ylabel="cosine to non-private λ")
        ax.minorticks_off()
        ax.set_xticks(part["tuning_grid"], [f"{c:g}" for c in part["tuning_grid"]])
        ax.set_title(f"{name} default, ε = {results['config']['epsilon']:g}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    config: configs.ShiftStudyConfig, out: pathlib.Path, *, reproducible: bool = False
) -> dict:
    """Runs the study; writes `results.json`, `results.md` and `cosine_vs_clip_norm.png` to `out`.

    Args:
        config: the settings.
        out: the output folder (with `stages/` and `xla_cache/`).
        reproducible: seed the splits, noise and sampling with the run seeds.
    """
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    use_compilation_cache(out / "xla_cache")
    defaults = {}
    for name, folder in REPORTED_STAGES.items():
        settings = getattr(config, name)
        if settings is None:
            continue
        pipeline = default_pipeline(settings, out / "stages" / folder, reproducible=reproducible)
        tuning_seeds = getattr(config, f"{name}_tuning_seeds")
        tuning_set = [
            default_pipeline(
                settings,
                out / "stages" / "tuning" / f"{name}{seed}",
                seed=seed,
                reproducible=reproducible,
            )
            for seed in tuning_seeds
        ]
        tuning = tune(name, tuning_set, tuning_seeds, config)
        print(f"{name} default: {pipeline.task.name}", flush=True)
        defaults[name] = {
            "task": pipeline.task.name,
            "preset_shift": pipeline.config.mixture.shift,
            "preset_clip_norm": pipeline.config.mixture.clip_norm,
            "tuning_grid": grid(pipeline, config),
            "tuning": tuning,
            **report(pipeline, config, tuning["best"]),
        }
    results = {
        "config": as_json(dataclasses.asdict(config)),
        "command": " ".join(["python -m experiments.shift_study", *sys.argv[1:]]),
        "noise_seeded": reproducible,
        "defaults": defaults,
        "wall_s": time.time() - start,
        "provenance": provenance(),
    }
    return finish(out, results, markdown(results), plots={"cosine_vs_clip_norm.png": plot})


cli = Command(
    name="shift_study",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, cosine_vs_clip_norm.png, stages/",
    examples=("--reproducible --quiet --out runs/shift_study",),
    quiet=True,
    config=lambda args: configs.get_config(),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("shift_study"):
        cli()
