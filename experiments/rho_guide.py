"""ρ guide: measured excess loss of DP-MixMin against the error bound over mixture-split sizes n.

For every ε, n and seed: a synthetic problem with a known optimum λ*
(`mixing.synthetic.mixture_problem`), DP-MixMin and non-private MixMin on its first n
examples, and the population excess F(λ) - F(λ*) on held-out examples, beside the bound of
`mixing.excess_loss_bound` (B = 1, C = the run's clip norm) and its regime; the sufficient n
for α comes from `mixing.sufficient_mixture_size`. Writes `rho_guide.json`, `rho_guide.md` and
`rho_guide.png`.
See `experiments/configs/rho_guide.py` for the command and the paper's operating points.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import mixing  # noqa: E402
from dpmix_jax.mixing.scaling import gradient_norms, loglog_slope  # noqa: E402
from dpmix_jax.mixing.synthetic import mixture_problem  # noqa: E402
from dpmix_jax.pipeline.compare import provenance  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, randomness  # noqa: E402
from experiments.common_args import experiment_main  # noqa: E402
from experiments.configs import rho_guide as configs  # noqa: E402
from experiments.harness import Command, finish  # noqa: E402
from experiments.plot_labels import counted  # noqa: E402

# The paper's operating points (appendix A.2, ρ = 0.1, ε = 1): (setting, k, α, units, what a
# unit is, the mixture stage's clip norm).
PAPER_POINTS = (
    ("vision (NIH, ρ = 0.1)", 14, 1e-2, 8_970, "examples", 13.0),
    ("language (OpenWebMath, ρ = 0.1)", 16, 1e-3, 2_800_000, "tokens", 0.2),
)


def _problem(config: configs.RhoGuideConfig, seed: int, num_examples: int):
    return mixture_problem(
        num_examples=num_examples,
        num_sources=config.num_sources,
        seed=seed,
        num_features=config.num_features,
        support=config.support,
        proxy_scale=config.proxy_scale,
    )


def public_clip_norm(config: configs.RhoGuideConfig) -> float:
    """C = clip_scale × a quantile of gradient norms at uniform λ on a public stand-in problem
    (`public_seed`); the sensitive examples are never read."""
    preds, _ = _problem(config, config.public_seed, 5000)
    k = config.num_sources
    norms = gradient_norms(preds, np.full(k, 1.0 / k))
    return config.clip_scale * float(np.quantile(norms, config.clip_quantile))


def paper_points() -> list[dict]:
    """The bound at the paper's operating points: the sufficient units for α with B = C = 1, the
    bound at the paper's units (B = C = 1, and B = 1 with the paper's C), and the common scale
    B = C that makes those units exactly sufficient."""
    rows = []
    for name, k, alpha, units, unit, clip_norm in PAPER_POINTS:
        guide = mixing.sufficient_mixture_size(k=k, alpha=alpha, epsilon=1.0, delta=1e-5)
        at_paper = mixing.excess_loss_bound(units, k=k, epsilon=1.0, delta=1e-5)
        with_clip = mixing.excess_loss_bound(
            units, k=k, epsilon=1.0, delta=1e-5, clip_norm=clip_norm
        )
        rows.append(
            {
                "setting": name,
                "k": k,
                "alpha": alpha,
                "paper_units": units,
                "unit": unit,
                "sufficient_units_b1": guide.num_units,
                "limited_by": guide.limited_by,
                "bound_at_paper_units_b1": at_paper.total,
                "paper_clip_norm": clip_norm,
                "bound_at_paper_units_paper_clip": with_clip.total,
                "loss_scale_matching_paper": alpha / at_paper.total,
            }
        )
    return rows


def main(
    config: configs.RhoGuideConfig, out: pathlib.Path | None = None, *, reproducible: bool = False
) -> dict:
    """Runs the grid; returns (and, with `out`, writes) the results.

    The seeds make the data; DP-MixMin's noise and sampling are secret unless `reproducible`.
    """
    clip_norm = public_clip_norm(config)
    learning_rate = config.step_size / clip_norm
    k = config.num_sources
    start = time.time()
    rows = []
    for seed in config.seeds:
        preds, true_weights = _problem(config, seed, max(config.sizes) + config.held_out)
        held_out = preds[-config.held_out :]
        for n in config.sizes:
            train = preds[:n]
            reference = np.asarray(
                mixing.mixmin(
                    train,
                    steps=config.reference_steps,
                    learning_rate=config.reference_learning_rate,
                )
            )
            nonprivate_excess = mixing.excess_loss(reference, true_weights, held_out)
            for epsilon in config.epsilons:
                result = mixing.dp_mixmin(
                    train,
                    epsilon=epsilon,
                    delta=config.delta,
                    steps=config.steps,
                    batch_size=max(1, round(config.batch_fraction * n)),
                    clip_norm=clip_norm,
                    learning_rate=learning_rate,
                    seed=seed if reproducible else randomness.secret_seed(),
                )
                terms = mixing.excess_loss_bound(
                    n, k=k, epsilon=epsilon, delta=config.delta, clip_norm=clip_norm
                )
                row = {
                    "seed": seed,
                    "n": n,
                    "epsilon_target": epsilon,
                    "epsilon_spent": result.epsilon,
                    "noise_multiplier": result.noise_multiplier,
                    "dp_excess": mixing.excess_loss(result.weights, true_weights, held_out),
                    "nonprivate_excess": nonprivate_excess,
                    "bound_statistical": terms.statistical,
                    "bound_privacy": terms.privacy,
                    "bound": terms.total,
                    "limited_by": terms.limited_by,
                }
                rows.append(row)
                print(
                    f"seed {seed} n = {n:6d} ε = {epsilon:g} (spent {result.epsilon:.3f},"
                    f" σ = {result.noise_multiplier:.2f}): excess DP {row['dp_excess']:.2e},"
                    f" non-private {nonprivate_excess:.2e}, bound {terms.total:.2e}"
                    f" ({terms.limited_by}) [{time.time() - start:.0f}s]",
                    flush=True,
                )
    results = {
        "config": dataclasses.asdict(config),
        "clip_norm": clip_norm,
        "learning_rate": learning_rate,
        "noise_seeded": reproducible,
        "rows": rows,
        "summary": summarise(config, rows, clip_norm),
        "paper_points": paper_points(),
        "seconds": time.time() - start,
        "provenance": provenance(),
    }
    return finish(
        out,
        results,
        markdown(config, results),
        name="rho_guide",
        plots={"rho_guide.png": plot},
    )


def summarise(config: configs.RhoGuideConfig, rows: list[dict], clip_norm: float) -> list[dict]:
    """Per ε: per-n means/stds, the bound, the fitted log-log slope of the mean DP excess in n,
    the guide's sufficient n for α and the smallest grid n whose mean DP excess is <= α."""
    summary = []
    sizes = np.array(config.sizes)
    for epsilon in config.epsilons:
        per_n = [[r for r in rows if r["n"] == n and r["epsilon_target"] == epsilon] for n in sizes]
        dp = np.array([[r["dp_excess"] for r in group] for group in per_n])
        nonprivate = np.array([[r["nonprivate_excess"] for r in group] for group in per_n])
        bound = [group[0]["bound"] for group in per_n]
        guide = mixing.sufficient_mixture_size(
            k=config.num_sources,
            alpha=config.alpha,
            epsilon=epsilon,
            delta=config.delta,
            clip_norm=clip_norm,
        )
        reached = [int(n) for n, m in zip(sizes, dp.mean(axis=1), strict=True) if m <= config.alpha]
        summary.append(
            {
                "epsilon": epsilon,
                "sizes": sizes.tolist(),
                "dp_mean": dp.mean(axis=1).tolist(),
                "dp_std": dp.std(axis=1).tolist(),
                "nonprivate_mean": nonprivate.mean(axis=1).tolist(),
                "bound": bound,
                "limited_by": [group[0]["limited_by"] for group in per_n],
                "epsilon_spent_max": max(r["epsilon_spent"] for g in per_n for r in g),
                "dp_slope": loglog_slope(sizes, dp.mean(axis=1), int(sizes.min())),
                "sufficient_n": guide.num_units,
                "sufficient_limited_by": guide.limited_by,
                "crossover_n": guide.crossover_units,
                "first_grid_n_reaching_alpha": reached[0] if reached else None,
            }
        )
    return summary


def markdown(config: configs.RhoGuideConfig, results: dict) -> str:
    """The measured-vs-bound table, the per-ε guide lines and the paper's operating points."""
    lines = [
        f"Population excess MixMin loss F(λ) - F(λ*) (k = {config.num_sources}, mean ± std over"
        f" {len(config.seeds)} seeds, {config.held_out:,} held-out examples) against the bound"
        " B·sqrt(log k/n) + C·sqrt(log k·log(1/δ))/(nε) with B = 1 and C the run's clip norm"
        f" ({results['clip_norm']:.2f}):",
        "",
        "| ε | n | DP-MixMin excess | non-private MixMin excess | bound (statistical +"
        " privacy) | limited by | measured / bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for item in results["summary"]:
        for i, n in enumerate(item["sizes"]):
            lines.append(
                f"| {item['epsilon']:g} | {n:,} | {item['dp_mean'][i]:.2e} ±"
                f" {item['dp_std'][i]:.1e} | {item['nonprivate_mean'][i]:.2e} |"
                f" {item['bound'][i]:.2e} | {item['limited_by'][i]} |"
                f" {item['dp_mean'][i] / item['bound'][i]:.2f} |"
            )
    lines.append("")
    for item in results["summary"]:
        reached = item["first_grid_n_reaching_alpha"]
        lines.append(
            f"- ε = {item['epsilon']:g} (spent <= {item['epsilon_spent_max']:.3f}): guide's"
            f" sufficient n for α = {config.alpha:g} is {item['sufficient_n']:,}"
            f" ({item['sufficient_limited_by']}-limited; terms cross at"
            f" n = {item['crossover_n']:,.0f}); measured mean excess first <= α at grid"
            f" n = {reached if reached is None else f'{reached:,}'}; fitted slope of the"
            f" measured excess in n: {item['dp_slope']:.2f} (bound: -0.5 statistics-limited,"
            " -1 privacy-limited)."
        )
    lines += [
        "",
        "| paper operating point | k | α | paper's units | sufficient units (B = C = 1) | bound"
        " at the paper's units (B = C = 1) | bound there, B = 1 and the paper's C | B = C making"
        " them sufficient |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in results["paper_points"]:
        lines.append(
            f"| {p['setting']} | {p['k']} | {p['alpha']:g} | {p['paper_units']:,} {p['unit']} |"
            f" {p['sufficient_units_b1']:,} ({p['limited_by']}) |"
            f" {p['bound_at_paper_units_b1']:.2e} | {p['bound_at_paper_units_paper_clip']:.2e}"
            f" (C = {p['paper_clip_norm']:g}) | {p['loss_scale_matching_paper']:.3f} |"
        )
    lines.append("")
    lines.append(
        f"DP-MixMin: mirror descent, C = {results['clip_norm']:.2f} (public stand-in),"
        f" η = {results['learning_rate']:.3f}, T = {config.steps}, expected batch"
        f" {config.batch_fraction:g}·n, δ = {config.delta:g}; every ε from the accountant for"
        " what ran."
        f" {SEEDED_NOTE if results['noise_seeded'] else 'DP noise and sampling secret.'}"
    )
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """Measured excess loss (mean ± std over seeds) and the bound against n, per ε.

    Draws from `results` alone (`rho_guide.json` read back will do).
    """
    config = results["config"]
    seeds = counted(len(config["seeds"]), "seed")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes = np.array(config["sizes"])
    dense = np.geomspace(sizes.min(), sizes.max(), 100)
    for i, item in enumerate(results["summary"]):
        color = f"C{i}"
        epsilon = item["epsilon"]
        ax.errorbar(
            sizes,
            item["dp_mean"],
            yerr=item["dp_std"],
            marker="o",
            capsize=3,
            color=color,
            label=f"DP-MixMin, ε = {epsilon:g} (mean ± std over {seeds})",
        )
        bound = [
            mixing.excess_loss_bound(
                n,
                k=config["num_sources"],
                epsilon=epsilon,
                delta=config["delta"],
                clip_norm=results["clip_norm"],
            ).total
            for n in dense
        ]
        ax.plot(dense, bound, "--", color=color, label=f"bound (B = 1, C), ε = {epsilon:g}")
        ax.axvline(
            item["sufficient_n"],
            color=color,
            lw=0.8,
            ls=":",
            label=f"sufficient n for α, ε = {epsilon:g}",
        )
    ax.plot(
        sizes,
        results["summary"][0]["nonprivate_mean"],
        "k^-",
        label=f"non-private MixMin (mean over {seeds})",
    )
    ax.axhline(config["alpha"], color="grey", lw=0.8, label=f"α = {config['alpha']:g}")
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="mixture-split size n",
        ylabel="population excess loss",
        title=f"k = {config['num_sources']}: measured excess (error bars: ± std over {seeds})"
        " vs bound",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="rho_guide",
    description=__doc__.splitlines()[0],
    writes="rho_guide.json, rho_guide.md, rho_guide.png",
    examples=("--preset cpu", "--preset paper"),
    presets=configs.PRESETS,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("rho_guide"):
        cli()
