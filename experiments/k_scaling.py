"""k-scaling study: excess MixMin loss of DP-MixMin (ε = 1) against the number of sources k.

A synthetic binary task with a known optimum (`mixture_problem`): k sigmoid proxies on shared
inputs, labels drawn from an exact mixture Σ_i λ*_i f_i(x) of a few of them. For every k and seed,
DP-MixMin (mirror descent and Frank-Wolfe, settings fixed across k) is compared with non-private
MixMin on the same split; the log-log slope of the mean excess loss over k >= `slope_min_k` is
fitted (theory for DP-SCO: 0.5). Writes `k_scaling.json`, `k_scaling.md` and `k_scaling.png`.

    python -m experiments.k_scaling --preset cpu --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax import mixing  # noqa: E402
from dpmix_jax.privacy import accounting  # noqa: E402
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


def main(config: configs.KScalingConfig, out: pathlib.Path | None = None) -> dict:
    """Runs the study; returns (and, with `out`, writes) the results."""
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
            row = {
                "k": k,
                "seed": seed,
                "uniform_excess": mixing.excess_loss(uniform, reference, preds),
                "true_weights_excess": mixing.excess_loss(true_weights, reference, preds),
            }
            for solver in config.solvers:
                result = mixing.dp_mixmin(
                    preds,
                    noise_multiplier=sigma,
                    delta=config.delta,
                    steps=config.steps,
                    batch_size=config.batch_size,
                    clip_norm=config.clip_norm,
                    learning_rate=config.learning_rate if solver == "mirror_descent" else None,
                    seed=seed,
                    solver=solver,
                )
                row[f"{solver}_epsilon"] = result.epsilon
                row[f"{solver}_excess"] = mixing.excess_loss(result.weights, reference, preds)
                row[f"{solver}_cosine"] = mixing.cosine_similarity(result.weights, reference)
            rows.append(row)
            excess = ", ".join(f"{s} {row[f'{s}_excess']:.2e}" for s in config.solvers)
            print(
                f"k = {k:4d} seed {seed}: excess {excess} [{time.time() - start:.0f}s]", flush=True
            )

    summary = summarise(config, rows)
    results = {
        "config": dataclasses.asdict(config),
        "noise_multiplier": sigma,
        "rows": rows,
        **summary,
    }
    print(markdown(config, summary))
    if out is not None:
        write(out, config, results)
    return results


def summarise(config: configs.KScalingConfig, rows: list[dict]) -> dict:
    """Mean and standard deviation of the excess per k and solver, and the fitted slopes."""
    ks = np.array(config.ks)
    table, slopes = {}, {}
    for name in (*config.solvers, "uniform"):
        per_k = [[r[f"{name}_excess"] for r in rows if r["k"] == k] for k in config.ks]
        mean = np.array([np.mean(v) for v in per_k])
        table[name] = {"mean": mean.tolist(), "std": [float(np.std(v)) for v in per_k]}
        if name != "uniform":
            slopes[name] = loglog_slope(ks, mean, config.slope_min_k)
    return {"ks": list(config.ks), "excess": table, "slopes": slopes}


def markdown(config: configs.KScalingConfig, summary: dict) -> str:
    """The summary as a markdown table plus the fitted slopes."""
    names = [*config.solvers, "uniform"]
    lines = ["| k | " + " | ".join(f"{n} excess" for n in names) + " |"]
    lines.append("|---" * (len(names) + 1) + "|")
    for i, k in enumerate(summary["ks"]):
        cells = [
            f"{summary['excess'][n]['mean'][i]:.2e} ± {summary['excess'][n]['std'][i]:.1e}"
            for n in names
        ]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    slopes = ", ".join(f"{n}: {s:.2f}" for n, s in summary["slopes"].items())
    lines.append(f"\nlog-log slope over k >= {config.slope_min_k}: {slopes} (theory 0.5)")
    return "\n".join(lines)


def write(out: pathlib.Path, config: configs.KScalingConfig, results: dict) -> None:
    """Writes k_scaling.json, k_scaling.md and k_scaling.png under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "k_scaling.json").write_text(json.dumps(results, indent=2))
    (out / "k_scaling.md").write_text(markdown(config, results) + "\n")
    fig, ax = plt.subplots(figsize=(5, 4))
    for name, stats in results["excess"].items():
        label = name if name == "uniform" else f"{name} (slope {results['slopes'][name]:.2f})"
        ax.errorbar(results["ks"], stats["mean"], yerr=stats["std"], marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="number of sources k", ylabel="excess MixMin loss")
    ax.set_title(f"DP-MixMin, ε = {config.epsilon}, n = {config.num_examples}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "k_scaling.png", dpi=120)
    plt.close(fig)


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", choices=("cpu", "paper"))
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    main(configs.get_config(args.preset), args.out)


if __name__ == "__main__":
    cli()
