"""GSD baseline: gradient subspace distance source selection against DP-MixMin on shared inputs.

For each seed: GSD scores of every public label source (and of a control source with other
inputs) against the sensitive task, under a randomly initialised and a uniform-pretrained
model; every source used alone (pretraining on it, DP fine-tuning on the whole train split);
DP-MixMin, Uniform and Random Initialisation from the same pipeline stages. Writes `gsd.json`,
`gsd.md` and `gsd.png`. See `experiments/configs/gsd.py` for the command and the paper's claim.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from dpmix_jax.pipeline import ImagePipeline, SharedInputTask, presets  # noqa: E402
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache  # noqa: E402
from dpmix_jax.pipeline.gsd import select_source  # noqa: E402
from dpmix_jax.pipeline.stage_store import weights_key  # noqa: E402
from dpmix_jax.privacy import SEEDED_NOTE  # noqa: E402
from experiments.common_args import (  # noqa: E402
    add_chest_xray_roots,
    chest_xray_tasks,
    experiment_main,
)
from experiments.configs import gsd as configs  # noqa: E402
from experiments.configs.nih import PAPER_IMAGE_SIZE  # noqa: E402
from experiments.harness import Command, finish  # noqa: E402

CONTROL = "control: transposed images"
METHODS = ("dp_mixmin", "uniform", "random_init")
PRIVACY_NOTE = (
    "GSD scores and picks are NOT private: they read the sensitive examples' gradients without"
    " DP. The oracle single source is chosen on test AUC (not private either)."
)


def _task(config: configs.GsdConfig, roots: dict[str, pathlib.Path]) -> SharedInputTask:
    if config.data == "digits":
        return presets.digit_task()
    (task,) = chest_xray_tasks(
        roots, public=config.data, image_size=PAPER_IMAGE_SIZE, findings=("Atelectasis",)
    )
    return task


def gradient_sets(task: SharedInputTask, num_examples: int, seed: int):
    """(sources, sensitive): `num_examples` public rows under every label source plus the
    control (the same rows transposed, source 0's labels), and sensitive train rows.

    Privacy: the sensitive part is raw sensitive data (used only by the non-private GSD).
    """
    rng = np.random.default_rng(seed)
    public = task.public.gather(
        rng.choice(len(task.public), min(num_examples, len(task.public)), replace=False)
    )
    sources = {
        name: (public["image"], public["labels"][:, i]) for i, name in enumerate(task.source_names)
    }
    sources[CONTROL] = (np.swapaxes(public["image"], 1, 2), public["labels"][:, 0])
    rows = rng.choice(len(task.train), min(num_examples, len(task.train)), replace=False)
    sensitive = task.train.gather(np.sort(rows))
    return sources, (sensitive["image"], sensitive["labels"][:, task.task_index])


def main(
    config: configs.GsdConfig,
    out_dir: pathlib.Path,
    *,
    reproducible: bool = False,
    **roots: pathlib.Path,
) -> dict:
    """Runs every seed; writes `gsd.json`, `gsd.md` and `gsd.png` to `out_dir`."""
    start = time.time()
    task = _task(config, roots)
    use_compilation_cache(out_dir / "xla_cache")
    pipeline = ImagePipeline(task, config.pipeline, out_dir / "stages", reproducible=reproducible)
    names = list(task.source_names)
    per_seed = []
    for seed in config.seeds:
        sources, sensitive = gradient_sets(task, config.num_examples, seed)
        gradient_models = {
            "random_init": lambda s=seed: pipeline.pretrained(None, s),
            "uniform_pretrained": lambda s=seed: pipeline.pretrained(
                np.full(task.k, 1.0 / task.k), s
            ),
        }
        selections = {
            model_name: select_source(
                gradient_models[model_name](),
                sources,
                sensitive,
                dim=config.dim,
                head_only=config.head_only,
            )
            for model_name in config.gradient_models
        }
        single = {}
        for i, name in enumerate(names):
            weights = np.eye(task.k)[i]
            init = pipeline.pretrained(weights, seed)
            model, budget = pipeline.finetune(
                init, weights_key(weights), "all", config.epsilon, seed
            )
            single[name] = {"auc": pipeline.utility(model, "test"), "epsilon_spent": budget.epsilon}
        methods = {}
        for method in METHODS:
            result = pipeline.run(method, config.epsilon, seed)
            methods[method] = {"auc": result.utility, "epsilon_spent": result.spent.epsilon}
        picks = {}
        for model_name, selection in selections.items():
            # The control has other inputs: it cannot be pretrained on like a label source.
            ranked = {n: selection.distances[n] for n in names}
            picks[model_name] = min(ranked, key=ranked.get)
        per_seed.append(
            {
                "seed": seed,
                "distances": {m: dict(s.distances) for m, s in selections.items()},
                "gsd_pick": picks,
                "single_source": single,
                "methods": methods,
            }
        )
        print(
            f"seed {seed}: GSD picks {picks}, DP-MixMin {methods['dp_mixmin']['auc']:.4f},"
            f" best single {max(v['auc'] for v in single.values()):.4f}"
            f" [{time.time() - start:.0f}s]",
            flush=True,
        )
    results = summarise(config, task, per_seed)
    results.update(
        config=dataclasses.asdict(config),
        task=task.name,
        noise_seeded=reproducible,
        per_seed=per_seed,
        seconds=time.time() - start,
        provenance=provenance(),
    )
    return finish(out_dir, results, markdown(config, results), name="gsd", plots={"gsd.png": plot})


def _mean_std(values) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "std": float(np.std(values))}


def summarise(config: configs.GsdConfig, task: SharedInputTask, per_seed: list[dict]) -> dict:
    """Means over seeds: distances, the spread among the label sources (vs the control's gap),
    single-source AUCs, the GSD picks' and the oracle's AUC, and the methods'."""
    names = list(task.source_names)
    distances, spread = {}, {}
    for model_name in config.gradient_models:
        distances[model_name] = {
            n: float(np.mean([s["distances"][model_name][n] for s in per_seed]))
            for n in (*names, CONTROL)
        }
        labelled = np.array([distances[model_name][n] for n in names])
        spread[model_name] = {
            "min": float(labelled.min()),
            "max": float(labelled.max()),
            "relative_spread": float((labelled.max() - labelled.min()) / labelled.mean()),
            "control": distances[model_name][CONTROL],
        }
    single = {n: _mean_std([s["single_source"][n]["auc"] for s in per_seed]) for n in names}
    oracle = _mean_std([max(v["auc"] for v in s["single_source"].values()) for s in per_seed])
    gsd = {
        m: _mean_std([s["single_source"][s["gsd_pick"][m]]["auc"] for s in per_seed])
        for m in config.gradient_models
    }
    methods = {m: _mean_std([s["methods"][m]["auc"] for s in per_seed]) for m in METHODS}
    spent = max(
        v["epsilon_spent"]
        for s in per_seed
        for v in (*s["single_source"].values(), *s["methods"].values())
    )
    return {
        "source_names": names,
        "true_weights": None if task.true_weights is None else task.true_weights.tolist(),
        "distances": distances,
        "distance_spread": spread,
        "single_source": single,
        "oracle_single_source": oracle,
        "gsd_selected": gsd,
        "methods": methods,
        "epsilon_spent_max": spent,
        "gsd_private": False,
    }


def markdown(config: configs.GsdConfig, results: dict) -> str:
    """The per-source table (distances, single-source AUC) and the method comparison."""
    models = list(config.gradient_models)
    weights = results["true_weights"]
    lines = [
        f"# GSD vs DP-MixMin on {results['task']}, ε = {config.epsilon:g},"
        f" {len(config.seeds)} seeds (test AUC; GSD: d = {config.dim},"
        f" {config.num_examples} gradients per set)",
        "",
        "| source | "
        + " | ".join(f"GSD ({m})" for m in models)
        + " | alone: AUC"
        + (" | λ*" if weights else "")
        + " |",
        "|---" * (len(models) + 2 + bool(weights)) + "|",
    ]
    for i, name in enumerate(results["source_names"]):
        cells = [f"{results['distances'][m][name]:.4f}" for m in models]
        auc = results["single_source"][name]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {auc['mean']:.4f} ± {auc['std']:.4f}"
            + (f" | {weights[i]:.2f}" if weights else "")
            + " |"
        )
    control = [f"{results['distances'][m][CONTROL]:.4f}" for m in models]
    lines.append(f"| {CONTROL} | " + " | ".join(control) + " | |" + (" |" if weights else ""))
    lines.append("")
    for m in models:
        s = results["distance_spread"][m]
        lines.append(
            f"- {m}: the {len(results['source_names'])} label sources lie within"
            f" {s['min']:.4f}-{s['max']:.4f} (spread {s['relative_spread']:.1%} of their mean);"
            f" the control with other inputs is at {s['control']:.4f}."
        )
    lines += ["", "| method | test AUC | private |", "|---|---|---|"]
    rows = [
        ("DP-MixMin", results["methods"]["dp_mixmin"], "yes"),
        ("Uniform", results["methods"]["uniform"], "yes"),
        ("Random initialisation", results["methods"]["random_init"], "yes"),
        *(
            (f"GSD pick ({m})", results["gsd_selected"][m], "no (selection reads D without DP)")
            for m in models
        ),
        ("oracle single source (best test AUC)", results["oracle_single_source"], "no"),
    ]
    lines += [f"| {name} | {v['mean']:.4f} ± {v['std']:.4f} | {p} |" for name, v, p in rows]
    lines += [
        "",
        f"Every fine-tuning and mixture stage at ε = {config.epsilon:g}, δ ="
        f" {config.pipeline.delta:g} (accountants' max {results['epsilon_spent_max']:.3f});"
        " single sources are pretrained on one label source and DP fine-tuned on the whole"
        " train split, like Uniform. " + PRIVACY_NOTE,
        SEEDED_NOTE if results["noise_seeded"] else "Private randomness secret (operating system).",
        f"{results['seconds']:.0f} s.",
    ]
    return "\n".join(lines)


def plot(results: dict, path: pathlib.Path) -> None:
    """GSD per source beside each source's AUC when pretrained on alone, with the methods' AUCs.

    Draws from `results` alone (`gsd.json` read back will do).
    """
    models = results["config"]["gradient_models"]
    names = results["source_names"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    positions = np.arange(len(names) + 1)
    width = 0.8 / len(models)
    for j, m in enumerate(models):
        values = [results["distances"][m][n] for n in (*names, CONTROL)]
        left.bar(positions + j * width, values, width, label=m)
    left.set_xticks(positions + width * (len(models) - 1) / 2)
    left.set_xticklabels([*names, "control"], rotation=60, ha="right", fontsize=7)
    left.set(ylabel="GSD to the sensitive task (lower = picked)", title="GSD per source")
    left.legend(fontsize=8)
    aucs = [results["single_source"][n]["mean"] for n in names]
    right.bar(np.arange(len(names)), aucs, yerr=[results["single_source"][n]["std"] for n in names])
    for k, (label, style) in enumerate(
        (("dp_mixmin", "-"), ("uniform", "--"), ("random_init", ":"))
    ):
        right.axhline(results["methods"][label]["mean"], color=f"C{k + 1}", ls=style, label=label)
    right.set_xticks(np.arange(len(names)))
    right.set_xticklabels(names, rotation=60, ha="right", fontsize=7)
    low = min(min(aucs), results["methods"]["random_init"]["mean"]) - 0.05
    right.set(ylim=(max(low, 0.0), 1.0), ylabel="test AUC", title="pretrain on one source")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


cli = Command(
    name="gsd",
    description=__doc__.splitlines()[0],
    writes="gsd.json, gsd.md, gsd.png, stages/",
    examples=("--preset cpu",),
    presets=configs.PRESETS,
    options=lambda parser: add_chest_xray_roots(parser, public="chexpert"),
    quiet=True,
    config=lambda args: configs.get_config(args.preset),
    run=lambda config, args: main(
        config,
        args.out,
        reproducible=args.reproducible,
        nih_root=args.nih_root,
        public_root=args.public_root,
    ),
)


if __name__ == "__main__":
    with experiment_main("gsd"):
        cli()
