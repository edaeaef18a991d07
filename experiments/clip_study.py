"""Clipping bias of DP-MixMin and the per-example gradient shift: excess loss vs clip norm.

On the synthetic exact-mixture problem of `mixing.synthetic` (k = 8, n = 20,000), DP-MixMin
(mirror descent) runs for each clip norm C and each shift ("none", "mean", "weighted"), once
without noise (σ = 0: pure clipping bias) and once at ε = 1, δ = 1e-5. The step size is η0 / C,
so that a step moves the logits by at most about η0 whatever C is. Reported: the excess MixMin
loss over non-private MixMin (mean over seeds), that of uniform weights, and the fraction of
examples clipped at the non-private optimum. Writes `clip_study.md`, `clip_study.json` and
`clip_study.png`.

    python -m experiments.clip_study --out DIR

Settings and measured results: `experiments/configs/clip_study.py`.
"""

from __future__ import annotations

import dataclasses
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import mixing  # noqa: E402
from dpmix_jax.mixing.scaling import gradient_norms  # noqa: E402
from dpmix_jax.mixing.synthetic import mixture_problem  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, accounting, randomness  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs.clip_study import ClipStudyConfig, get_config  # noqa: E402
from experiments.harness import Command, finish  # noqa: E402
from experiments.plot_labels import SHIFT_NAMES, counted  # noqa: E402


def main(
    config: ClipStudyConfig, out: pathlib.Path | None = None, *, reproducible: bool = False
) -> dict:
    """Runs the study; returns (and, with `out`, writes) the excess per (noise, shift, C).

    The seeds make the data; the DP runs' noise and sampling are secret unless `reproducible`
    (one stream per data seed, shared by every setting so that they are compared paired).
    """
    q = config.batch_size / config.num_examples
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=config.epsilon, delta=config.delta, sampling_rate=q, steps=config.steps
    )
    settings = {"σ = 0": 0.0, f"ε = {config.epsilon}": sigma}
    excess = {(noise, shift): [] for noise in settings for shift in config.shifts}
    clipped = {shift: [] for shift in config.shifts}
    uniform = []
    for seed in config.seeds:
        preds, _ = mixture_problem(
            num_examples=config.num_examples, num_sources=config.num_sources, seed=seed
        )
        reference = np.asarray(mixing.mixmin(preds, steps=2000, learning_rate=2.0))
        noise_seed = seed if reproducible else randomness.secret_seed()
        uniform.append(
            mixing.excess_loss(
                np.full(config.num_sources, 1 / config.num_sources), reference, preds
            )
        )
        for shift in config.shifts:
            norms = gradient_norms(preds, reference, shift=shift)
            clipped[shift].append([float(np.mean(norms > c)) for c in config.clip_norms])
            for noise, sig in settings.items():
                row = []
                for c in config.clip_norms:
                    result = mixing.dp_mixmin(
                        preds,
                        noise_multiplier=sig,
                        delta=config.delta,
                        steps=config.steps,
                        batch_size=config.batch_size,
                        clip_norm=c,
                        learning_rate=config.step_scale / c,
                        seed=noise_seed,
                        shift=shift,
                    )
                    row.append(mixing.excess_loss(result.weights, reference, preds))
                excess[noise, shift].append(row)
                print(
                    f"seed {seed} {shift:8s} {noise}: " + " ".join(f"{e:.1e}" for e in row),
                    flush=True,
                )
    means = {key: np.mean(v, axis=0) for key, v in excess.items()}
    clipped_means = {s: np.mean(v, axis=0) for s, v in clipped.items()}
    table = markdown(config, means, clipped_means, float(np.mean(uniform)), sigma)
    table += "\n" + (SEEDED_NOTE if reproducible else "DP noise and sampling secret.")
    results = {
        "config": dataclasses.asdict(config),
        "curves": [
            {
                "setting": noise,
                "noise_multiplier": settings[noise],
                "shift": shift,
                "mean": np.mean(values, axis=0).tolist(),
                "std": np.std(values, axis=0).tolist(),
            }
            for (noise, shift), values in excess.items()
        ],
        "uniform_excess": float(np.mean(uniform)),
        "noise_multiplier": sigma,
        "noise_seeded": reproducible,
        "provenance": provenance(),
    }
    return finish(out, results, table, name="clip_study", plots={"clip_study.png": plot})


def markdown(config, means, clipped_means, uniform: float, sigma: float) -> str:
    """Excess loss per (noise, shift) against C, plus clipped fractions at the optimum."""
    head = "| setting | " + " | ".join(f"C={c:g}" for c in config.clip_norms) + " |"
    lines = [head, "|---" * (len(config.clip_norms) + 1) + "|"]
    for (noise, shift), row in means.items():
        lines.append(f"| {noise}, shift={shift} | " + " | ".join(f"{e:.1e}" for e in row) + " |")
    for shift, row in clipped_means.items():
        lines.append(
            f"| clipped at λ_opt, shift={shift} | " + " | ".join(f"{f:.0%}" for f in row) + " |"
        )
    lines.append(
        f"\nuniform weights: excess {uniform:.1e}; ε = {config.epsilon} uses σ = {sigma:.3f};"
        f" k = {config.num_sources}, n = {config.num_examples}, T = {config.steps},"
        f" b = {config.batch_size}, η = {config.step_scale}/C"
    )
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Excess loss against C per setting and shift (mean ± std over seeds), beside uniform weights.

    Draws from `results` alone (`clip_study.json` read back will do).
    """
    config = results["config"]
    seeds = counted(len(config["seeds"]), "seed")
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for curve in results["curves"]:
        ax.errorbar(
            config["clip_norms"],
            curve["mean"],
            yerr=curve["std"],
            marker="o",
            capsize=2,
            linestyle="-" if curve["noise_multiplier"] == 0 else "--",
            label=f"{curve['setting']}, {SHIFT_NAMES[curve['shift']]}",
        )
    ax.axhline(
        results["uniform_excess"],
        color="gray",
        linestyle=":",
        label=f"uniform weights (mean over {seeds})",
    )
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="clip norm C",
        ylabel=f"excess MixMin loss (mean ± std over {seeds})",
    )
    ax.minorticks_off()
    ax.set_xticks(config["clip_norms"], [f"{c:g}" for c in config["clip_norms"]])
    ax.set_title(
        f"k = {config['num_sources']}, n = {config['num_examples']:,}: error bars ± std over"
        f" {seeds} (data and noise drawn per seed)",
        fontsize=9,
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="clip_study",
    description=__doc__.splitlines()[0],
    writes="clip_study.md, clip_study.json, clip_study.png",
    examples=("",),
    config=lambda args: get_config(),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("clip_study"):
        cli()
