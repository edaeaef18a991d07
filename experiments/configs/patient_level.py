"""Settings of the privacy-unit study: image against patient as the unit of (ε, δ), at equal ε,
on the chest X-ray pipeline's CPU stand-in.

Command (the stored run, docs/patient-level.md):
    python -m experiments.patient_level --reproducible --out runs/patient_level

Real NIH data is not shipped, so the study runs the image pipeline on the embedded digits task,
whose 1,200 train images are grouped into synthetic patients (geometric sizes of design mean 3.6,
the NIH mean; a fixed public seed). Both units run DP-MixMin, Uniform and Random Init at ε in
{1, 4}, three seeds: the image unit with the demo's settings, the patient unit at user level in
both private stages (up to G = 4 images per sampled patient) with both expected batches divided
by 3.6, so that both units sample about the same fraction of their units per step.

Measured (docs/results/patient_level.json, 3 min 18 s on 2 CPU cores; 296 patients, 4.05 images
each): at ε = 1 the patient unit costs DP-MixMin 0.218 test AUC (0.8796 against 0.6612, its λ's
cosine to λ* falling from 0.863 to 0.469) and Uniform and Random Init about 0.034; at ε = 4 the
cost is at most 0.04 for every method (DP-MixMin 0.010).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.pipeline import image, presets


@dataclasses.dataclass(frozen=True, kw_only=True)
class PatientLevelConfig:
    """Public settings of the study.

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


def get_config() -> PatientLevelConfig:
    """The stored run's settings: the image demo's pipeline, ε in {1, 4}, three seeds."""
    return PatientLevelConfig()
