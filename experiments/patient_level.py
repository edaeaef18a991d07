"""Image vs patient privacy unit at equal ε: the utility cost of protecting whole patients.

Real NIH ChestX-ray14 data is not used here (it is not shipped); the study runs the chest X-ray
pipeline on its CPU stand-in, the embedded digits task, whose train images are grouped into
synthetic patients: patient sizes are drawn once from a geometric law with the NIH mean of 3.6
images per patient (a fixed public seed), and images are assigned to patients at random, so a
patient's images are not alike as a real patient's are. The D_mix / D_ft split is by patient for
both units. Each unit runs DP-MixMin, Uniform and Random Init at every ε and seed:

- image: the paper's unit, the pipeline defaults (example-level DP in both private stages);
- patient: user-level DP in both private stages, up to G images per sampled patient, with the
  expected batch (mixture and fine-tuning) divided by the design mean of images per patient, so
  that both units sample about the same fraction of their units per step (about the same rate q,
  hence about the same σ at the same ε and T; the drawn patients' mean differs from the design
  mean by chance).

Writes `results.json` (config, command, commit, date, wall time, whether the noise was seeded,
the table) and `results.md`, with each unit's comparison under `image/` and `patient/`.

    python -m experiments.patient_level --reproducible --out runs/patient_level

Settings and measured results: `experiments/configs/patient_level.py`.
"""

from __future__ import annotations

import dataclasses
import pathlib
import time

import numpy as np

from dpmix_jax.data.sources import ArraySource
from dpmix_jax.pipeline import ImagePipeline, SharedInputTask, image, presets, run_comparison
from dpmix_jax.pipeline.compare import provenance, summarize
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from dpmix_jax.privacy import SEEDED_NOTE
from experiments.common_args import experiment_main
from experiments.configs.patient_level import PatientLevelConfig, get_config
from experiments.harness import Command, finish
from experiments.run_files import as_json


def with_synthetic_patients(
    task: SharedInputTask, *, mean_images: float, seed: int
) -> SharedInputTask:
    """`task` whose train images belong to synthetic patients (their `user_ids` and
    `group_ids`): geometric sizes (1, 2, ...) of mean `mean_images`, images assigned at random.

    Privacy: the grouping depends only on the public `seed` and the split's size.
    """
    rng = np.random.default_rng(seed)
    count = len(task.train)
    sizes = rng.geometric(1 / mean_images, size=count)
    patients = np.repeat(np.arange(count), sizes)[:count]
    patients = patients[rng.permutation(count)]
    rows = task.train.gather(np.arange(count))
    train = ArraySource(rows, user_ids=patients, group_ids=patients)
    return dataclasses.replace(task, name=f"{task.name}, synthetic patients", train=train)


def main(
    config: PatientLevelConfig,
    out: pathlib.Path,
    *,
    reproducible: bool = False,
    progress: bool = True,
) -> dict:
    """Runs both units' comparisons; writes `results.json` and `results.md` to `out`."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    use_compilation_cache(out / "xla_cache")
    (task,) = presets.digit_tasks(image_size=config.image_size)
    task = with_synthetic_patients(
        task, mean_images=config.mean_images_per_patient, seed=config.patient_seed
    )
    patients = len(np.unique(task.train.user_ids))
    units = {}
    for unit, pipeline_config in config.unit_pipelines().items():
        label = image.privacy_unit_label(pipeline_config)
        results = run_comparison(
            ImagePipeline(task, pipeline_config, out / "stages", reproducible=reproducible),
            dataset=task.name,
            metric="test AUC",
            higher_is_better=True,
            methods=config.methods,
            epsilons=config.epsilons,
            seeds=config.seeds,
            out_dir=out / unit,
            progress=progress,
            true_weights=task.true_weights,
            source_names=task.source_names,
            privacy_unit=label,
        )
        units[unit] = {
            "privacy_unit": label,
            "mixture_batch_size": pipeline_config.mixture.batch_size,
            "finetune_batch_size": pipeline_config.finetune.batch_size,
            "summary": {
                f"{method} eps={eps:g}": row for (method, eps), row in summarize(results).items()
            },
        }
    results = {
        "study": "patient_level",
        "task": task.name,
        "train_images": len(task.train),
        "train_patients": patients,
        "config": as_json(dataclasses.asdict(config)),
        "provenance": provenance(),
        "noise_seeded": reproducible,
        "units": units,
        "table": table_rows(units, config),
        "wall_s": time.time() - start,
    }
    return finish(out, results, markdown(results))


def table_rows(units: dict, config: PatientLevelConfig) -> list[dict]:
    """Per method and ε: mean ± std test AUC of each unit, the difference, the spent ε, and
    the mean cosine of λ to the true λ* (None for Random Init, which has no λ)."""
    rows = []
    for eps in config.epsilons:
        for method in config.methods:
            cells = {unit: units[unit]["summary"][f"{method} eps={eps:g}"] for unit in units}
            rows.append(
                {
                    "method": method,
                    "epsilon": eps,
                    **{f"{u}_auc": [c["mean"], c["std"]] for u, c in cells.items()},
                    **{f"{u}_spent_epsilon": c["spent"] for u, c in cells.items()},
                    **{f"{u}_cosine_true": c.get("cosine_true") for u, c in cells.items()},
                    "patient_minus_image": cells["patient"]["mean"] - cells["image"]["mean"],
                }
            )
    return rows


def markdown(results: dict) -> str:
    """`results.md`: the AUC of both units per method and ε, and how they were measured."""
    units = results["units"]
    image_label, patient_label = units["image"]["privacy_unit"], units["patient"]["privacy_unit"]
    seeds = len(results["config"]["seeds"])
    lines = [
        f"## Image vs patient privacy unit at equal ε ({results['task']})",
        "",
        f"{results['train_images']} train images of {results['train_patients']} synthetic "
        f"patients. Test AUC, mean ± std over {seeds} seeds; ε spent: the accountants', max "
        "over seeds, for the stated unit; cos(λ, λ*): the mean cosine of the pretraining "
        "mixture to the true one.",
        "",
        f"| method | ε | AUC, (ε, δ) {image_label} | ε spent | AUC, (ε, δ) {patient_label} "
        "| ε spent | patient − image | cos(λ, λ*) image / patient |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in results["table"]:
        cosines = (row["image_cosine_true"], row["patient_cosine_true"])
        cosine = "" if None in cosines else f"{cosines[0]:.3f} / {cosines[1]:.3f}"
        lines.append(
            f"| {row['method']} | {row['epsilon']:g} | "
            f"{row['image_auc'][0]:.4f} ± {row['image_auc'][1]:.4f} | "
            f"{row['image_spent_epsilon']:.3f} | "
            f"{row['patient_auc'][0]:.4f} ± {row['patient_auc'][1]:.4f} | "
            f"{row['patient_spent_epsilon']:.3f} | {row['patient_minus_image']:+.4f} | "
            f"{cosine} |"
        )
    lines += [
        "",
        f"Expected batches: image unit {units['image']['mixture_batch_size']:g} (mixture) and "
        f"{units['image']['finetune_batch_size']} (fine-tuning) images; patient unit "
        f"{units['patient']['mixture_batch_size']:g} and {units['patient']['finetune_batch_size']}"
        f" patients (batches divided by the design mean of "
        f"{results['config']['mean_images_per_patient']:g} images per patient; the drawn "
        f"patients have {results['train_images'] / results['train_patients']:.2f}).",
        "",
        SEEDED_NOTE if results["noise_seeded"] else "Private randomness secret (operating system).",
        f"Command: `{results['provenance']['command']}`, commit {results['provenance']['commit']}"
        f", {results['provenance']['date']}, {results['wall_s']:.0f} s.",
    ]
    return "\n".join(lines) + "\n"


cli = Command(
    name="patient_level",
    description=__doc__.splitlines()[0],
    writes="results.json, results.md, image/ and patient/ comparisons, stages/",
    examples=("--reproducible", "--reproducible --out runs/patient_level"),
    quiet=True,
    config=lambda args: get_config(),
    run=lambda config, args: main(
        config, args.out, reproducible=args.reproducible, progress=not args.quiet
    ),
)


if __name__ == "__main__":
    with experiment_main("patient_level"):
        cli()
