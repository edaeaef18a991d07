"""Per-task gains of DP-MixMin, Uniform and Random Search over Random Initialisation, tasks
grouped by prevalence, and the rare-label task's mixture weights.

See `experiments/configs/per_task.py` for the commands and the paper's numbers.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpmix_jax.data.sources import ArraySource, Source
from dpmix_jax.mixing import cosine_similarity
from dpmix_jax.pipeline import ImagePipeline, SharedInputTask, presets, run_comparison
from dpmix_jax.pipeline.compare import (
    METHOD_NAMES,
    provenance,
    provenance_line,
    randomness_line,
)
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.privacy.accounting import format_epsilon
from experiments.common_args import add_chest_xray_roots, chest_xray_tasks, experiment_main
from experiments.configs.per_task import PRESETS, PerTaskConfig, get_config
from experiments.harness import Command, finish

METHODS = ("dp_mixmin", "uniform", "random_search", "random_init")
BASELINE = "random_init"
GAINED = ("dp_mixmin", "uniform", "random_search")
LABELS = {method: METHOD_NAMES[method] for method in METHODS}

# The paper's numbers at ε = 1 (NIH ChestX-ray14, 14 findings): Figure 3's macro relative gains
# over Random Init, Tables 7 and 8's macro AUC, Table 10's groups against Uniform (CheXpert) and
# Table 12's Hernia cosines (CheXpert, ρ = 0.1).
PAPER = {
    "gain_over_random_init": {
        "chexpert": {"dp_mixmin": 0.1148, "uniform": 0.0542, "random_search": 0.0474},
        "mimic": {"dp_mixmin": 0.1229, "uniform": 0.0687, "random_search": 0.0522},
    },
    "macro_auc": {
        "chexpert": {
            "dp_mixmin": 0.707,
            "uniform": 0.670,
            "random_search": 0.667,
            "random_init": 0.636,
        },
        "mimic": {
            "dp_mixmin": 0.712,
            "uniform": 0.679,
            "random_search": 0.670,
            "random_init": 0.636,
        },
    },
    "groups_vs_uniform": {
        "A": {"tasks": 7, "absolute": 0.040, "relative": 0.056},
        "B": {"tasks": 7, "absolute": 0.034, "relative": 0.060},
    },
    "rare_task": {
        "name": "Hernia",
        "prevalence": 0.0020,
        "cosine_dp_mixmin": 0.99,
        "cosine_uniform": 0.64,
    },
}


def relative_gain(auc: float, reference: float) -> float:
    """(auc - reference) / reference: the paper's relative AUC gain over a reference method."""
    if not reference > 0:
        raise ValueError(f"the reference AUC must be > 0, got {reference!r}.")
    return (auc - reference) / reference


def _mean_std(values: Sequence[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "std": float(np.std(values))}


def task_gains(runs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: AUC over seeds and the relative gain over Random Init paired by seed.

    Args:
        runs: one task's `results.json` runs (one ε), each with "method", "seed", "utility".

    Returns:
        method -> {"auc": {mean, std}, "gain": {mean, std}, "gain_per_seed": {seed: gain}}
        ("gain" only for the methods other than Random Init).
    """
    auc = {(r["method"], r["seed"]): r["utility"] for r in runs}
    seeds = sorted({seed for method, seed in auc if method == BASELINE})
    if not seeds:
        raise ValueError(f"the runs hold no {BASELINE} run to measure gains against.")
    table: dict[str, dict[str, Any]] = {}
    for method in sorted({m for m, _ in auc}, key=METHODS.index):
        missing = [s for s in seeds if (method, s) not in auc]
        if missing:
            raise ValueError(f"{method} has no run for seeds {missing}.")
        row: dict[str, Any] = {"auc": _mean_std([auc[method, s] for s in seeds])}
        if method != BASELINE:
            gains = {s: relative_gain(auc[method, s], auc[BASELINE, s]) for s in seeds}
            row["gain"] = _mean_std(list(gains.values()))
            row["gain_per_seed"] = gains
        table[method] = row
    return table


def prevalence_groups(prevalences: Sequence[float]) -> list[str]:
    """Group "A" for the more prevalent half of the tasks, "B" for the rest (ties: the earlier
    task is the more prevalent); with an odd count, B has one task more."""
    if len(prevalences) < 2:
        raise ValueError("grouping by prevalence needs at least two tasks.")
    order = sorted(range(len(prevalences)), key=lambda i: (-prevalences[i], i))
    groups = ["B"] * len(prevalences)
    for i in order[: len(prevalences) // 2]:
        groups[i] = "A"
    return groups


def summarize_tasks(tasks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Macro (mean over tasks) AUC and gains of `tasks` (rows of `task_row`), DP-MixMin's gain
    over the baselines' (ratio), and its gain over Uniform (Table 10: absolute and relative)."""
    summary: dict[str, Any] = {"tasks": len(tasks)}
    for method in METHODS:
        summary.setdefault("auc", {})[method] = float(
            np.mean([t["methods"][method]["auc"]["mean"] for t in tasks])
        )
    for method in GAINED:
        summary.setdefault("gain", {})[method] = float(
            np.mean([t["methods"][method]["gain"]["mean"] for t in tasks])
        )
    dp = summary["gain"]["dp_mixmin"]
    summary["gain_ratio"] = {
        m: (dp / summary["gain"][m] if summary["gain"][m] > 0 else None)
        for m in ("uniform", "random_search")
    }
    pairs = [
        (t["methods"]["dp_mixmin"]["auc"]["mean"], t["methods"]["uniform"]["auc"]["mean"])
        for t in tasks
    ]
    summary["vs_uniform"] = {
        "absolute": float(np.mean([d - u for d, u in pairs])),
        "relative": float(np.mean([relative_gain(d, u) for d, u in pairs])),
    }
    return summary


def split_labels(source: Source, task_index: int) -> np.ndarray:
    """One task's 0/1 labels over a split, read without its images.

    Privacy: a statistic of sensitive labels, used only to group tasks in the report (as the
    paper's Table 9 publishes each finding's prevalence); it is not part of any private release.
    """
    labels = getattr(source, "labels", None)  # CxrDataset
    if labels is None and isinstance(source, ArraySource):
        labels = source.arrays.get("labels")
    if labels is None:
        raise ValueError(f"cannot read the labels of a {type(source).__name__} without images.")
    return np.asarray(labels)[:, task_index]


def check_both_classes(tasks: Sequence[SharedInputTask]) -> None:
    """Stops before any training when a task's validation or test split holds one class only
    (AUC, and Random Search's choice on validation AUC, need both).

    Privacy: reads sensitive labels for a yes/no input check; nothing of it is released.
    """
    for task in tasks:
        for split in ("val", "test"):
            labels = split_labels(getattr(task, split), task.task_index)
            if labels.min() == labels.max():
                raise ValueError(
                    f"{task.name}: its {split} split has only label {labels[0]:g}; AUC needs "
                    "both classes (raise the task's prevalence or change the data seed)."
                )


def _digit_tasks(config: PerTaskConfig) -> list[SharedInputTask]:
    tasks = presets.digit_tasks(
        seed=config.data_seed,
        image_size=config.image_size,
        num_tasks=len(config.prevalence_scales),
        prevalence_scales=config.prevalence_scales,
    )
    count = len(tasks)
    return [
        dataclasses.replace(
            task, name=f"digits multi-task default, task {t} of {count} (s = {scale:g})"
        )
        for t, (task, scale) in enumerate(zip(tasks, config.prevalence_scales, strict=True))
    ]


def build_tasks(config: PerTaskConfig, roots: Mapping[str, pathlib.Path]) -> list[SharedInputTask]:
    """The digit tasks (one per prevalence scale) or one task per NIH finding."""
    if config.data == "digits":
        return _digit_tasks(config)
    return chest_xray_tasks(
        roots, public=config.data, image_size=config.image_size, findings=config.findings
    )


def task_row(
    index: int, task: SharedInputTask, results: Mapping[str, Any], reference: Mapping[int, Any]
) -> dict[str, Any]:
    """One task's line of the report: prevalence, AUCs and gains, λ's cosines.

    Args:
        index: the task's number.
        task: the task.
        results: its `run_comparison` results (one ε).
        reference: seed -> non-private MixMin's λ on that seed's D_mix (analysis only).
    """
    labels = [split_labels(getattr(task, s), task.task_index) for s in ("train", "val", "test")]
    everything = np.concatenate(labels)
    runs = results["runs"]
    k = task.k
    cosines: dict[str, list[float]] = {"dp_mixmin": [], "uniform": []}
    for run in runs:
        if run["method"] == "dp_mixmin":
            cosines["dp_mixmin"].append(cosine_similarity(run["weights"], reference[run["seed"]]))
    for seed in sorted(reference):
        cosines["uniform"].append(cosine_similarity(np.full(k, 1.0 / k), reference[seed]))
    row = {
        "index": index,
        "name": task.name,
        "prevalence": float(everything.mean()),
        "positives": int(everything.sum()),
        "test_positives": int(labels[2].sum()),
        "methods": task_gains(runs),
        "cosine_to_nonprivate": {m: _mean_std(v) for m, v in cosines.items()},
        "spent_epsilon": {
            m: max(r["spent_epsilon"] for r in runs if r["method"] == m) for m in METHODS
        },
    }
    if task.true_weights is not None:
        row["cosine_dp_mixmin_to_true"] = _mean_std(
            [
                cosine_similarity(r["weights"], task.true_weights)
                for r in runs
                if r["method"] == "dp_mixmin"
            ]
        )
    return row


def analyse(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Groups (A / B by prevalence), the macro summary and the rare-label task (the least
    prevalent); adds each row's "group"."""
    groups = prevalence_groups([r["prevalence"] for r in rows])
    for row, group in zip(rows, groups, strict=True):
        row["group"] = group
    rare = min(rows, key=lambda r: r["prevalence"])
    return {
        "macro": summarize_tasks(rows),
        "groups": {g: summarize_tasks([r for r in rows if r["group"] == g]) for g in ("A", "B")},
        "rare_task": {
            "index": rare["index"],
            "name": rare["name"],
            "prevalence": rare["prevalence"],
            "test_positives": rare["test_positives"],
            "cosine_to_nonprivate": rare["cosine_to_nonprivate"],
        },
    }


def _pct(value: float | None, signed: bool = True) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f}%" if signed else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(report: Mapping[str, Any]) -> str:
    """`results.md`: the per-task table, macro and group rows beside the paper's, the rare task."""
    rows, seeds = report["tasks"], len(report["seeds"])
    gained = ", ".join(LABELS[m] for m in GAINED)
    lines = [
        f"# Per-task gains over Random Init at ε = {report['epsilon']:g} "
        f"(δ = {report['delta']:.0e}), {len(rows)} tasks, {seeds} seeds".replace("e-0", "e-"),
        "",
        f"Test AUC (mean ± std over seeds) and relative gain over Random Init, "
        f"(AUC - AUC_RI) / AUC_RI paired by seed, for {gained}; cos: DP-MixMin's λ against "
        "non-private MixMin's λ on the same D_mix (mean over seeds). Tasks by prevalence; group "
        "A: the more prevalent half.",
        "",
        "| task | prevalence (positives, in test) | group | "
        + " | ".join(f"AUC {LABELS[m]}" for m in METHODS)
        + " | "
        + " | ".join(f"gain {LABELS[m]}" for m in GAINED)
        + " | cos DP-MixMin | cos uniform |",
        "|---|---|---|" + "---|" * (len(METHODS) + len(GAINED) + 2),
    ]
    for row in sorted(rows, key=lambda r: -r["prevalence"]):
        methods = row["methods"]
        aucs = [
            f"{methods[m]['auc']['mean']:.3f} ± {methods[m]['auc']['std']:.3f}" for m in METHODS
        ]
        gains = [_pct(methods[m]["gain"]["mean"]) for m in GAINED]
        cos = row["cosine_to_nonprivate"]
        lines.append(
            f"| {row['index']} | {_pct(row['prevalence'], signed=False)} ({row['positives']}, "
            f"{row['test_positives']}) | {row['group']} | "
            + " | ".join(aucs + gains)
            + f" | {cos['dp_mixmin']['mean']:.3f} | {cos['uniform']['mean']:.3f} |"
        )
    paper_gain, paper_auc = PAPER["gain_over_random_init"], PAPER["macro_auc"]
    lines += [
        "",
        "Macro (mean over tasks) and prevalence groups; DP-MixMin against Uniform as in Table 10; "
        "the paper's rows are NIH ChestX-ray14 at ε = 1:",
        "",
        "| rows | tasks | macro AUC (DP-MixMin / Uniform / Random Search / Random Init) | "
        "gain DP-MixMin | gain Uniform | gain Random Search | DP-MixMin gain / Uniform's | "
        "/ Random Search's | DP-MixMin - Uniform | relative |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def summary_line(name: str, s: Mapping[str, Any]) -> str:
        aucs = " / ".join(f"{s['auc'][m]:.3f}" for m in METHODS)
        ratios = s["gain_ratio"]
        return (
            f"| {name} | {s['tasks']} | {aucs} | "
            + " | ".join(_pct(s["gain"][m]) for m in GAINED)
            + f" | {_ratio(ratios['uniform'])} | {_ratio(ratios['random_search'])}"
            + f" | {s['vs_uniform']['absolute']:+.3f} | {_pct(s['vs_uniform']['relative'])} |"
        )

    lines.append(summary_line("ours, macro", report["macro"]))
    for group in ("A", "B"):
        lines.append(summary_line(f"ours, group {group}", report["groups"][group]))
    for public, name in (("chexpert", "CheXpert"), ("mimic", "MIMIC-CXR")):
        gain, auc = paper_gain[public], paper_auc[public]
        lines.append(
            f"| paper, {name} -> NIH, macro | 14 | "
            + " / ".join(f"{auc[m]:.3f}" for m in METHODS)
            + " | "
            + " | ".join(_pct(gain[m]) for m in GAINED)
            + f" | {_ratio(gain['dp_mixmin'] / gain['uniform'])}"
            + f" | {_ratio(gain['dp_mixmin'] / gain['random_search'])}"
            + f" | {auc['dp_mixmin'] - auc['uniform']:+.3f} | - |"
        )
    for group, paper in PAPER["groups_vs_uniform"].items():
        lines.append(
            f"| paper, CheXpert, group {group} | {paper['tasks']} | - | - | - | - | - | - | "
            f"{paper['absolute']:+.3f} | {_pct(paper['relative'])} |"
        )
    rare, paper_rare = report["rare_task"], PAPER["rare_task"]
    cos = rare["cosine_to_nonprivate"]
    lines += [
        "",
        "Rare-label task: λ's cosine to non-private MixMin's λ on the same D_mix "
        "(mean ± std over seeds):",
        "",
        "| task | prevalence (in test) | DP-MixMin | uniform |",
        "|---|---|---|---|",
        f"| ours, task {rare['index']} | {_pct(rare['prevalence'], signed=False)} "
        f"({rare['test_positives']}) | {cos['dp_mixmin']['mean']:.3f} ± "
        f"{cos['dp_mixmin']['std']:.3f} | {cos['uniform']['mean']:.3f} |",
        f"| paper, {paper_rare['name']} (CheXpert, ρ = 0.1) | "
        f"{_pct(paper_rare['prevalence'], signed=False)} | {paper_rare['cosine_dp_mixmin']:.2f} | "
        f"{paper_rare['cosine_uniform']:.2f} |",
        "",
        "Spent ε (the accountants', max over tasks and seeds): "
        + ", ".join(
            f"{LABELS[m]} {format_epsilon(report['spent_epsilon'][m], '.3f')}" for m in METHODS
        )
        + ". Random Search fine-tunes its candidates on the same data and picks the best on "
        "validation data without privacy: a reference point, not a private method.",
        "",
        randomness_line(report),
    ]
    line = provenance_line(report)
    if line:
        lines += ["", line]
    return "\n".join(lines) + "\n"


def plot(report: Mapping[str, Any], path: pathlib.Path) -> None:
    """Per-task gain bars (tasks by prevalence, groups A | B) and the macro and group means beside
    the paper's Figure 3."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    rows = sorted(report["tasks"], key=lambda r: -r["prevalence"])
    colors = {"dp_mixmin": "tab:blue", "uniform": "tab:orange", "random_search": "tab:green"}
    width = 0.8 / len(GAINED)
    fig, (left, right) = plt.subplots(
        1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [max(3, len(rows)), 5]}
    )
    x = np.arange(len(rows))
    for j, method in enumerate(GAINED):
        means = [100 * r["methods"][method]["gain"]["mean"] for r in rows]
        stds = [100 * r["methods"][method]["gain"]["std"] for r in rows]
        left.bar(
            x + j * width,
            means,
            width,
            yerr=stds,
            capsize=2,
            color=colors[method],
            label=LABELS[method]
            + (" (non-private selection)" if method == "random_search" else ""),
        )
    split = sum(r["group"] == "A" for r in rows)
    left.axvline(split - 0.5 + width, color="gray", linestyle="--", linewidth=0.8)
    left.set_xticks(x + width, [f"{r['index']}\n{100 * r['prevalence']:.1f}%" for r in rows])
    left.set_xlabel("task (prevalence); group A | group B")
    left.set_ylabel("relative AUC gain over Random Init (%)")
    left.axhline(0, color="black", linewidth=0.6)
    left.set_title(
        f"per task, ε = {report['epsilon']:g}: mean ± std over {len(report['seeds'])} seeds",
        fontsize=10,
    )
    left.legend(fontsize=8)
    groups = {"macro": rows, **{g: [r for r in rows if r["group"] == g] for g in ("A", "B")}}
    columns = [
        ("ours\nmacro", report["macro"]["gain"], groups["macro"]),
        ("ours\ngroup A", report["groups"]["A"]["gain"], groups["A"]),
        ("ours\ngroup B", report["groups"]["B"]["gain"], groups["B"]),
        ("paper\nCheXpert", PAPER["gain_over_random_init"]["chexpert"], None),
        ("paper\nMIMIC", PAPER["gain_over_random_init"]["mimic"], None),
    ]
    x = np.arange(len(columns))
    for j, method in enumerate(GAINED):
        spread = [
            np.nan
            if tasks is None
            else 100 * float(np.std([t["methods"][method]["gain"]["mean"] for t in tasks]))
            for _, _, tasks in columns
        ]
        right.bar(
            x + j * width,
            [100 * gains[method] for _, gains, _ in columns],
            width,
            yerr=spread,
            capsize=2,
            color=colors[method],
            hatch=["", "", "", "//", "//"],
            label=LABELS[method],
        )
    right.set_xticks(x + width, [name for name, _, _ in columns], fontsize=8)
    right.set_ylabel("relative AUC gain over Random Init (%)")
    right.axhline(0, color="black", linewidth=0.6)
    right.set_title(
        "mean over tasks ± std over tasks (of each task's mean over seeds);\n"
        "hatched: the paper's Figure 3 (NIH, no error bars)",
        fontsize=9,
    )
    paper = Patch(facecolor="white", edgecolor="gray", hatch="//", label="the paper (NIH)")
    right.legend(handles=[*right.get_legend_handles_labels()[0], paper], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(
    config: PerTaskConfig,
    out_dir: pathlib.Path,
    *,
    reproducible: bool = False,
    progress: bool = True,
    **roots: pathlib.Path,
) -> dict[str, Any]:
    """Runs every task's comparison at one ε, then writes `results.json`, `results.md` and
    `per_task_gains.png` to `out_dir` (each task's own outputs under `task<i>/`)."""
    start = time.perf_counter()
    tasks = build_tasks(config, roots)
    check_both_classes(tasks)
    use_compilation_cache(out_dir / "xla_cache")
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    reused = 0
    for index, task in enumerate(tasks):
        task_dir = out_dir / f"task{index}"
        pipeline = ImagePipeline(
            task, config.pipeline, task_dir / "stages", reproducible=reproducible
        )
        results = run_comparison(
            pipeline,
            dataset=task.name,
            metric="test AUC",
            higher_is_better=True,
            methods=METHODS,
            epsilons=(config.epsilon,),
            seeds=config.seeds,
            out_dir=task_dir,
            true_weights=task.true_weights,
            source_names=task.source_names,
            reference_method=None,
            progress=progress,
        )
        runs += [{"task": index, **run} for run in results["runs"]]
        reused += results["reused_runs"]
        reference = {seed: pipeline.nonprivate_weights(seed) for seed in config.seeds}
        rows.append(task_row(index, task, results, reference))
    report: dict[str, Any] = {
        "epsilon": config.epsilon,
        "delta": config.pipeline.delta,
        "seeds": list(config.seeds),
        "data": config.data,
        "methods": list(METHODS),
        "tasks": rows,
        **analyse(rows),
        "spent_epsilon": {m: max(r["spent_epsilon"][m] for r in rows) for m in METHODS},
        "paper": PAPER,
        "noise_seeded": any(run["noise_seeded"] for run in runs),
        "runs": runs,
        "reused_runs": reused,
        "seconds": time.perf_counter() - start,
        "provenance": provenance(),
    }
    return finish(out_dir, report, markdown(report), plots={"per_task_gains.png": plot})


cli = Command(
    name="per_task",
    description="Per-task relative AUC gains of DP-MixMin, Uniform and Random Search over Random "
    "Initialisation at one ε, tasks grouped by prevalence, and the rare-label task's λ.",
    writes="results.md, results.json, per_task_gains.png, task<i>/",
    examples=(
        "--preset cpu --reproducible",
        "--preset paper --nih-root data/nih --public-root data/chexpert",
        "--preset paper_mimic --nih-root data/nih --public-root data/mimic",
    ),
    presets=PRESETS,
    options=lambda parser: add_chest_xray_roots(parser, public=None),
    quiet=True,
    config=lambda args: get_config(args.preset),
    run=lambda config, args: main(
        config,
        args.out,
        reproducible=args.reproducible,
        progress=not args.quiet,
        nih_root=args.nih_root,
        public_root=args.public_root or pathlib.Path(f"data/{config.data}"),
    ),
)


if __name__ == "__main__":
    with experiment_main("per_task"):
        cli()
