"""k-scaling study: excess MixMin loss of DP-MixMin (ε = 1) against the number of sources k.

A synthetic binary task with a known optimum (`mixture_problem`): k sigmoid proxies on shared
inputs, labels drawn from an exact mixture Σ_i λ*_i f_i(x) of a few of them. For every k and seed,
DP-MixMin (mirror descent and Frank-Wolfe; C_k from public gradient norms, η_k = step_size / C_k,
T and b fixed) is compared with non-private MixMin on the same split, and rerun with σ = 0 to split
the excess into optimisation + clipping bias and noise; the log-log slope of the mean excess over
k >= `slope_min_k` is fitted (theory for DP-SCO: 0.5). Writes `k_scaling.json`, `k_scaling.md`
and `k_scaling.png`.

    python -m experiments.k_scaling --preset cpu --out DIR
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import mixing  # noqa: E402
from dpmix_jax.cli import add_reproducible_flag, experiment_parser  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE, accounting, randomness  # noqa: E402
from experiments.configs import k_scaling as configs  # noqa: E402


def mixture_problem(
    *,
    num_examples: int,
    num_sources: int,
    seed: int,
    num_features: int = 16,
    support: int = 4,
    proxy_scale: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic `nll` problem whose true conditional is an exact mixture of the proxies.

    Proxy i predicts f_i(x) = sigmoid(w_i·x + b_i) for x ~ N(0, I_d); λ* puts Dirichlet(1)
    weights on `support` random sources (0 elsewhere); y ~ Bernoulli(Σ_i λ*_i f_i(x)). Since the
    log loss is proper, λ* minimises the population MixMin objective.

    Returns:
        `preds` `(n, k)` float32 with P[j, i] = p_i(y_j | x_j), and λ* `(k,)`.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, num_features))
    w = rng.normal(size=(num_features, num_sources)) * proxy_scale / np.sqrt(num_features)
    f = 1.0 / (1.0 + np.exp(-(x @ w + rng.normal(size=num_sources))))
    true_weights = np.zeros(num_sources)
    chosen = rng.choice(num_sources, min(support, num_sources), replace=False)
    true_weights[chosen] = rng.dirichlet(np.ones(len(chosen)))
    labels = rng.random(num_examples) < f @ true_weights
    preds = np.where(labels[:, None], f, 1.0 - f).astype(np.float32)
    return preds, true_weights


def loglog_slope(ks: np.ndarray, values: np.ndarray, min_k: int) -> float:
    """Least-squares slope of log(values) on log(k) over k >= min_k (values floored at 1e-12)."""
    keep = ks >= min_k
    return float(np.polyfit(np.log(ks[keep]), np.log(np.maximum(values[keep], 1e-12)), 1)[0])


def gradient_norms(preds: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Norms `(n,)` of the per-example gradients at `weights`, shifted as DP-MixMin shifts them.

    Privacy: not private; call it on public data, or only to report diagnostics.
    """
    grad = jax.grad(mixing.shifted_example_loss("nll", mixing.DEFAULT_SHIFT))
    examples = mixing.prepare_examples(preds)
    return np.linalg.norm(np.asarray(jax.vmap(grad, in_axes=(None, 0))(weights, examples)), axis=1)


def public_clip_norm(config: configs.KScalingConfig, num_sources: int) -> float:
    """C_k from public data only: `clip_scale` × a quantile of gradient norms at uniform λ.

    The norms come from a fresh problem of the same family (`public_seed`), standing in for the
    public or proxy data a practitioner has; the sensitive split is never read.
    """
    preds, _ = mixture_problem(
        num_examples=config.public_examples,
        num_sources=num_sources,
        seed=config.public_seed,
        num_features=config.num_features,
        support=config.support,
        proxy_scale=config.proxy_scale,
    )
    norms = gradient_norms(preds, np.full(num_sources, 1.0 / num_sources))
    return config.clip_scale * float(np.quantile(norms, config.clip_quantile))


def main(
    config: configs.KScalingConfig, out: pathlib.Path | None = None, *, reproducible: bool = False
) -> dict:
    """Runs the study; returns (and, with `out`, writes) the results.

    Each DP run is repeated with σ = 0 (same C, η, T, b, batches): that run's excess is the
    optimisation + clipping bias, and the rest of the DP run's excess is the noise part. The
    seeds make the data; the DP runs' noise and sampling are secret unless `reproducible`.
    """
    q = min(1.0, config.batch_size / config.num_examples)
    # One σ for every run: the rate, steps and target are the same for all k and seeds.
    sigma = accounting.calibrate_noise_multiplier(
        target_epsilon=config.epsilon, delta=config.delta, sampling_rate=q, steps=config.steps
    )
    print(
        f"σ = {sigma:.4f} for ε = {config.epsilon}, δ = {config.delta}, q = {q}, T = {config.steps}"
    )
    rows = []
    start = time.time()
    for k in config.ks:
        clip_norm = public_clip_norm(config, k)
        for seed in config.seeds:
            preds, true_weights = mixture_problem(
                num_examples=config.num_examples,
                num_sources=k,
                seed=seed,
                num_features=config.num_features,
                support=config.support,
                proxy_scale=config.proxy_scale,
            )
            reference = np.asarray(
                mixing.mixmin(
                    preds,
                    steps=config.reference_steps,
                    learning_rate=config.reference_learning_rate,
                )
            )
            uniform = np.full(k, 1.0 / k)
            # One stream per (k, seed), shared by the σ > 0 run and its σ = 0 twin.
            noise_seed = seed if reproducible else randomness.secret_seed()
            row = {
                "k": k,
                "seed": seed,
                "clip_norm": clip_norm,
                "learning_rate": config.step_size / clip_norm,
                "clipped_at_optimum": float(np.mean(gradient_norms(preds, reference) > clip_norm)),
                "uniform_excess": mixing.excess_loss(uniform, reference, preds),
                "true_weights_excess": mixing.excess_loss(true_weights, reference, preds),
            }
            for solver in config.solvers:
                excess = {}
                for part, noise_multiplier in (("excess", sigma), ("bias", 0.0)):
                    result = mixing.dp_mixmin(
                        preds,
                        noise_multiplier=noise_multiplier,
                        delta=config.delta,
                        steps=config.steps,
                        batch_size=config.batch_size,
                        clip_norm=clip_norm,
                        learning_rate=row["learning_rate"] if solver == "mirror_descent" else None,
                        seed=noise_seed,
                        solver=solver,
                    )
                    excess[part] = mixing.excess_loss(result.weights, reference, preds)
                    if part == "excess":
                        row[f"{solver}_epsilon"] = result.epsilon
                        row[f"{solver}_cosine"] = mixing.cosine_similarity(
                            result.weights, reference
                        )
                row[f"{solver}_excess"] = excess["excess"]
                row[f"{solver}_bias"] = excess["bias"]
                row[f"{solver}_noise"] = excess["excess"] - excess["bias"]
            rows.append(row)
            parts = ", ".join(
                f"{s} {row[f'{s}_excess']:.2e} (bias {row[f'{s}_bias']:.1e})"
                for s in config.solvers
            )
            print(
                f"k = {k:4d} seed {seed}: C = {clip_norm:.1f}, clipped at optimum"
                f" {row['clipped_at_optimum']:.1%}, excess {parts} [{time.time() - start:.0f}s]",
                flush=True,
            )

    summary = summarise(config, rows)
    results = {
        "config": dataclasses.asdict(config),
        "noise_multiplier": sigma,
        "noise_seeded": reproducible,
        "rows": rows,
        **summary,
    }
    print(markdown(config, results))
    if out is not None:
        write(out, config, results)
    return results


def summarise(config: configs.KScalingConfig, rows: list[dict]) -> dict:
    """Per k: mean/std of the excess and its bias and noise parts, C, clipped fraction; slopes.

    `slopes[name]` fits the mean total excess; `part_slopes[name]` fits the mean bias and the
    mean noise part separately (a mean <= 0 is floored at 1e-12 and makes that slope meaningless).
    """
    ks = np.array(config.ks)

    def stats(key: str) -> dict:
        per_k = [[r[key] for r in rows if r["k"] == k] for k in config.ks]
        return {
            "mean": [float(np.mean(v)) for v in per_k],
            "std": [float(np.std(v)) for v in per_k],
        }

    table = {name: stats(f"{name}_excess") for name in (*config.solvers, "uniform")}
    parts = {s: {p: stats(f"{s}_{p}") for p in ("bias", "noise")} for s in config.solvers}
    slopes = {
        s: loglog_slope(ks, np.array(table[s]["mean"]), config.slope_min_k) for s in config.solvers
    }
    part_slopes = {
        s: {
            p: loglog_slope(ks, np.array(parts[s][p]["mean"]), config.slope_min_k)
            for p in ("bias", "noise")
        }
        for s in config.solvers
    }
    return {
        "ks": list(config.ks),
        "clip_norms": [next(r["clip_norm"] for r in rows if r["k"] == k) for k in config.ks],
        "clipped_at_optimum": stats("clipped_at_optimum"),
        "excess": table,
        "parts": parts,
        "slopes": slopes,
        "part_slopes": part_slopes,
    }


def markdown(config: configs.KScalingConfig, summary: dict) -> str:
    """The summary as markdown tables (total excess; bias/noise parts) plus the fitted slopes."""
    names = [*config.solvers, "uniform"]
    lines = ["| k | C | clipped at optimum | " + " | ".join(f"{n} excess" for n in names) + " |"]
    lines.append("|---" * (len(names) + 3) + "|")
    for i, k in enumerate(summary["ks"]):
        cells = [
            f"{summary['excess'][n]['mean'][i]:.2e} ± {summary['excess'][n]['std'][i]:.1e}"
            for n in names
        ]
        lines.append(
            f"| {k} | {summary['clip_norms'][i]:.1f} | "
            f"{summary['clipped_at_optimum']['mean'][i]:.1%} | " + " | ".join(cells) + " |"
        )
    heads = [f"{s} {p}" for s in config.solvers for p in ("bias (σ = 0)", "noise")]
    lines += ["", "| k | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
    for i, k in enumerate(summary["ks"]):
        cells = [
            f"{summary['parts'][s][p]['mean'][i]:.2e} ± {summary['parts'][s][p]['std'][i]:.1e}"
            for s in config.solvers
            for p in ("bias", "noise")
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    slopes = "; ".join(
        f"{s}: {summary['slopes'][s]:.2f} (bias {summary['part_slopes'][s]['bias']:.2f},"
        f" noise {summary['part_slopes'][s]['noise']:.2f})"
        for s in config.solvers
    )
    lines.append(f"\nlog-log slope over k >= {config.slope_min_k}: {slopes} (theory 0.5)")
    lines.append(SEEDED_NOTE if summary.get("noise_seeded") else "DP noise and sampling secret.")
    lines.append(
        f"C_k = {config.clip_scale} × q{config.clip_quantile:g} of public gradient norms at"
        f" uniform λ, η_k = {config.step_size}/C_k, T = {config.steps}, b = {config.batch_size},"
        f" n = {config.num_examples}; bias = excess of the same run with σ = 0, noise = the rest."
    )
    return "\n".join(lines)


def write(out: pathlib.Path, config: configs.KScalingConfig, results: dict) -> None:
    """Writes k_scaling.json, k_scaling.md and k_scaling.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "k_scaling.json").write_text(json.dumps(results, indent=2))
    (out / "k_scaling.md").write_text(markdown(config, results) + "\n")
    fig, axes = plt.subplots(1, len(config.solvers), figsize=(5 * len(config.solvers), 4))
    for ax, solver in zip(np.atleast_1d(axes), config.solvers, strict=True):
        curves = {
            f"total (slope {results['slopes'][solver]:.2f})": results["excess"][solver],
            "bias, σ = 0": results["parts"][solver]["bias"],
            "noise part": results["parts"][solver]["noise"],
            "uniform weights": results["excess"]["uniform"],
        }
        for label, stats in curves.items():
            mean = np.array(stats["mean"])
            keep = mean > 0  # a noise part <= 0 cannot be drawn on a log axis
            ax.errorbar(
                np.array(results["ks"])[keep],
                mean[keep],
                yerr=np.array(stats["std"])[keep],
                marker="o",
                label=label,
            )
        ax.set(xscale="log", yscale="log", xlabel="number of sources k", ylabel="excess loss")
        ax.set_title(f"{solver}, ε = {config.epsilon}, n = {config.num_examples}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "k_scaling.png", dpi=120)
    plt.close(fig)


def cli() -> None:
    parser = experiment_parser(
        "k_scaling", __doc__.splitlines()[0], examples=("--preset cpu", "--preset paper")
    )
    parser.add_argument(
        "--preset",
        default="cpu",
        choices=("cpu", "paper"),
        help="cpu: k up to 256 sources, n = 20,000; paper: k up to 1000",
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs/k_scaling"),
        metavar="DIR",
        help="output folder: k_scaling.json, k_scaling.md, k_scaling.png",
    )
    add_reproducible_flag(parser, seeds="the config's seeds")
    args = parser.parse_args()
    main(configs.get_config(args.preset), args.out, reproducible=args.reproducible)


if __name__ == "__main__":
    cli()
