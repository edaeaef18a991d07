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
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import time

import numpy as np

from dpmix_jax.data.sources import ArraySource
from dpmix_jax.pipeline import ImagePipeline, SharedInputTask, image, presets, run_comparison
from dpmix_jax.pipeline.common import use_compilation_cache
from dpmix_jax.pipeline.compare import provenance, summarize
from dpmix_jax.privacy import SEEDED_NOTE
from experiments.common_args import (
    add_quiet_flag,
    add_reproducible_flag,
    add_seeds_option,
    experiment_main,
    experiment_parser,
    with_common_options,
)
from experiments.run_files import write_results


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatientLevelConfig:
    """Settings of the study (see the module docstring).

    Attributes:
        pipeline: the image-unit pipeline settings (the patient unit is derived from them).
        max_images_per_patient: G of the patient unit.
        mean_images_per_patient: the mean of the synthetic patient sizes.
        patient_seed: the public seed of the patient sizes and assignment.
        epsilons, seeds, methods: the grid, the same for both units.
        image_size: side of the digit images.
    """

    pipeline: image.ImagePipelineConfig = dataclasses.field(
        default_factory=presets.image_demo_config
    )
    max_images_per_patient: int = 4
    mean_images_per_patient: float = 3.6
    patient_seed: int = 0
    epsilons: tuple[float, ...] = (1.0, 4.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = ("dp_mixmin", "uniform", "random_init")
    image_size: int = 16

    def __post_init__(self) -> None:
        if self.pipeline.privacy_unit != "image":
            raise ValueError("pipeline must be the image-unit settings; the study derives both.")
        if not self.mean_images_per_patient >= 1:
            raise ValueError(
                f"mean_images_per_patient must be >= 1, got {self.mean_images_per_patient!r}."
            )
        if not isinstance(self.max_images_per_patient, int) or self.max_images_per_patient < 1:
            raise ValueError(
                f"max_images_per_patient must be an integer >= 1, got "
                f"{self.max_images_per_patient!r}."
            )

    def unit_pipelines(self) -> dict[str, image.ImagePipelineConfig]:
        """The pipeline settings of each unit: the image unit's as given; the patient unit's with
        both expected batches divided by the design mean of images per patient (about the same
        rate q)."""
        base = self.pipeline
        scale = 1 / self.mean_images_per_patient
        patient = dataclasses.replace(
            base,
            mixture=dataclasses.replace(base.mixture, batch_size=base.mixture.batch_size * scale),
            finetune=dataclasses.replace(
                base.finetune, batch_size=max(1, round(base.finetune.batch_size * scale))
            ),
        )
        return {
            "image": base,
            "patient": image.with_privacy_unit(patient, "patient", self.max_images_per_patient),
        }


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
        "config": json.loads(json.dumps(dataclasses.asdict(config), default=str)),
        "provenance": provenance(),
        "noise_seeded": reproducible,
        "units": units,
        "table": table_rows(units, config),
        "wall_s": time.time() - start,
    }
    text = markdown(results)
    write_results(out, results, text)
    print(text)
    return results


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


def cli(argv: list[str] | None = None) -> dict:
    parser = experiment_parser(
        "patient_level",
        __doc__.splitlines()[0],
        examples=("--reproducible", "--reproducible --out runs/patient_level"),
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs/patient_level"),
        metavar="DIR",
        help="output folder: results.json, results.md, image/ and patient/ comparisons, stages/",
    )
    add_reproducible_flag(parser, seeds="--seeds")
    add_seeds_option(parser)
    add_quiet_flag(parser)
    args = parser.parse_args(argv)
    return main(
        with_common_options(PatientLevelConfig(), args),
        args.out,
        reproducible=args.reproducible,
        progress=not args.quiet,
    )


if __name__ == "__main__":
    with experiment_main("patient_level"):
        cli()
