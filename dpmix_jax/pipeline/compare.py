"""Methods × ε × seeds through one pipeline: `results.json`, a markdown table and plots.

`results.json` has the shape
`{"dataset", "metric", "higher_is_better", "runs": [{"method", "epsilon", "delta", "seed",
"utility", "weights", ...}], "true_weights", "reference_weights"}`; every ε in it is the ε the
accountants reported for what ran (`spent_epsilon`), beside the target (`epsilon`).
"""

from __future__ import annotations

import itertools
import json
import pathlib
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import tqdm

from dpmix_jax.mixing import cosine_similarity, l1_distance
from dpmix_jax.pipeline import common


class Pipeline(Protocol):
    def run(self, method: common.Method, epsilon: float, seed: int) -> common.RunResult: ...


def run_comparison(
    pipeline: Pipeline,
    *,
    dataset: str,
    metric: str,
    higher_is_better: bool,
    methods: Sequence[str],
    epsilons: Sequence[float],
    seeds: Sequence[int],
    out_dir: str | pathlib.Path,
    true_weights: np.ndarray | None = None,
    source_names: Sequence[str] | None = None,
    reference_method: str | None = "nonprivate_mixmin",
    progress: bool = True,
) -> dict[str, Any]:
    """Runs every (method, ε, seed), then writes `results.json`, `results.md` and plots.

    Args:
        pipeline: anything with `run(method, epsilon, seed) -> RunResult` (stages stored, so an
            interrupted comparison resumes).
        dataset, metric, higher_is_better: describe the utility in the outputs.
        methods, epsilons, seeds: the grid.
        out_dir: where the outputs go.
        true_weights: the λ* that generated the sensitive data, when known.
        source_names: names of the k public sources (for the weights plot).
        reference_method: whose λ DP-MixMin's is compared with per seed (cosine, L1).
        progress: show a progress bar.

    Returns:
        The `results.json` content.
    """
    for method in methods:
        if method not in common.METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {common.METHODS}.")
    if not epsilons or not seeds or not methods:
        raise ValueError("methods, epsilons and seeds must be non-empty.")
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grid = list(itertools.product(seeds, epsilons, methods))
    runs = []
    bar = tqdm.tqdm(grid, disable=not progress, desc=dataset)
    for seed, epsilon, method in bar:
        bar.set_postfix_str(f"{method} ε={epsilon:g} seed={seed}")
        runs.append(pipeline.run(method, float(epsilon), int(seed)).to_json())
    results = {
        "dataset": dataset,
        "metric": metric,
        "higher_is_better": higher_is_better,
        "runs": runs,
        "true_weights": None if true_weights is None else np.asarray(true_weights).tolist(),
        "methods": {m: common.METHOD_NOTES[m] for m in methods},
        "source_names": None if source_names is None else list(source_names),
    }
    _add_weight_quality(results, reference_method)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "results.md").write_text(markdown_table(results))
    plot_results(results, out_dir)
    return results


def _add_weight_quality(results: dict[str, Any], reference_method: str | None) -> None:
    """Cosine and L1 of each run's λ to λ* and to the reference method's λ of the same seed."""
    reference = {
        (r["seed"], r["epsilon"]): r["weights"]
        for r in results["runs"]
        if r["method"] == reference_method and r["weights"] is not None
    }
    for run in results["runs"]:
        if run["weights"] is None:
            continue
        quality = {}
        if results["true_weights"] is not None:
            quality["cosine_true"] = cosine_similarity(run["weights"], results["true_weights"])
            quality["l1_true"] = l1_distance(run["weights"], results["true_weights"])
        ref = reference.get((run["seed"], run["epsilon"]))
        if ref is not None:
            quality["cosine_reference"] = cosine_similarity(run["weights"], ref)
            quality["l1_reference"] = l1_distance(run["weights"], ref)
        run["weight_quality"] = {k: float(v) for k, v in quality.items()}


def summarize(results: dict[str, Any]) -> dict[tuple[str, float], dict[str, float]]:
    """Mean and standard deviation of utility (and λ quality) per (method, ε) over seeds."""
    table: dict[tuple[str, float], dict[str, float]] = {}
    keys = sorted({(r["method"], r["epsilon"]) for r in results["runs"]}, key=lambda x: x[1])
    for method, eps in keys:
        runs = [r for r in results["runs"] if r["method"] == method and r["epsilon"] == eps]
        utility = np.array([r["utility"] for r in runs])
        row = {
            "mean": float(utility.mean()),
            "std": float(utility.std()),
            "seeds": len(runs),
            "spent": max(r["spent_epsilon"] for r in runs),
        }
        for quality in ("cosine_true", "cosine_reference"):
            values = [
                r["weight_quality"][quality] for r in runs if quality in r.get("weight_quality", {})
            ]
            if values:
                row[quality] = float(np.mean(values))
        table[(method, eps)] = row
    return table


def markdown_table(results: dict[str, Any]) -> str:
    """Utility (mean ± std over seeds) per method and ε, with spent ε and λ quality."""
    table = summarize(results)
    epsilons = sorted({eps for _, eps in table})
    methods = [m for m in common.METHODS if any(key[0] == m for key in table)]
    arrow = "higher is better" if results["higher_is_better"] else "lower is better"
    lines = [
        f"# {results['dataset']}: {results['metric']} ({arrow})",
        "",
        "| method | " + " | ".join(f"ε = {e:g}" for e in epsilons) + " |",
        "|---|" + "---|" * len(epsilons),
    ]
    for method in methods:
        cells = []
        for eps in epsilons:
            row = table.get((method, eps))
            cells.append("" if row is None else f"{row['mean']:.4f} ± {row['std']:.4f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += ["", "Spent ε (max over seeds, from the accountants) and λ quality (mean cosine):", ""]
    lines += [
        "| method | ε target | ε spent | cos(λ, λ*) | cos(λ, non-private λ) |",
        "|---|---|---|---|---|",
    ]
    for (method, eps), row in sorted(table.items(), key=lambda x: (x[0][1], x[0][0])):
        cos_true = f"{row['cosine_true']:.3f}" if "cosine_true" in row else ""
        cos_ref = f"{row['cosine_reference']:.3f}" if "cosine_reference" in row else ""
        lines.append(f"| {method} | {eps:g} | {row['spent']:.3f} | {cos_true} | {cos_ref} |")
    lines += ["", "Methods:", ""]
    lines += [f"- `{m}`: {note}" for m, note in results["methods"].items()]
    return "\n".join(lines) + "\n"


def plot_results(results: dict[str, Any], out_dir: pathlib.Path) -> None:
    """`utility_vs_epsilon.png` and, when λ* or a reference exists, `weights.png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summarize(results)
    fig, ax = plt.subplots(figsize=(6, 4))
    for method in common.METHODS:
        points = sorted((eps, row) for (m, eps), row in table.items() if m == method)
        if not points:
            continue
        eps = [p[0] for p in points]
        ax.errorbar(
            eps,
            [p[1]["mean"] for p in points],
            yerr=[p[1]["std"] for p in points],
            marker="o",
            capsize=3,
            label=method,
        )
    ax.set_xscale("log")
    all_eps = sorted({eps for _, eps in table})
    ax.set_xticks(all_eps, [f"{e:g}" for e in all_eps])
    ax.minorticks_off()
    ax.set_xlabel("ε (end to end)")
    ax.set_ylabel(results["metric"])
    ax.set_title(results["dataset"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "utility_vs_epsilon.png", dpi=120)
    plt.close(fig)

    dp_runs = [r for r in results["runs"] if r["method"] == "dp_mixmin"]
    reference = [r for r in results["runs"] if r["method"] == "nonprivate_mixmin"]
    if not dp_runs:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    k = len(dp_runs[0]["weights"])
    width = 0.8 / (len(sorted({r["epsilon"] for r in dp_runs})) + 2)
    bars = []
    if results["true_weights"] is not None:
        bars.append(("true λ*", np.asarray(results["true_weights"]).reshape(-1, k)[0]))
    if reference:
        bars.append(("non-private MixMin", np.mean([r["weights"] for r in reference], axis=0)))
    for eps in sorted({r["epsilon"] for r in dp_runs}):
        mean = np.mean([r["weights"] for r in dp_runs if r["epsilon"] == eps], axis=0)
        bars.append((f"DP-MixMin ε={eps:g}", mean))
    for i, (label, values) in enumerate(bars):
        ax.bar(np.arange(k) + i * width, values, width, label=label)
    if results.get("source_names"):
        ax.set_xticks(np.arange(k) + width * (len(bars) - 1) / 2)
        ax.set_xticklabels(results["source_names"], rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("public source")
    ax.set_ylabel("λ (mean over seeds)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "weights.png", dpi=120)
    plt.close(fig)
