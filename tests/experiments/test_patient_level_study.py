"""The image-vs-patient study (`experiments.patient_level`) in a tiny form: both units run, the
synthetic patients are as described, and the table repeats the comparisons' numbers."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np
import pytest

from dpmix_jax.pipeline import presets
from dpmix_jax.train import TrainConfig
from experiments import patient_level
from experiments.configs.patient_level import PatientLevelConfig


def test_synthetic_patients_partition_the_train_images():
    (task,) = presets.digit_tasks(image_size=8)
    grouped = patient_level.with_synthetic_patients(task, mean_images=3.6, seed=0)
    patients = np.asarray(grouped.train.user_ids)
    np.testing.assert_array_equal(patients, grouped.train.group_ids)
    sizes = np.bincount(patients)[np.unique(patients)]
    assert sizes.min() >= 1 and abs(sizes.mean() - 3.6) < 0.5
    rows = np.arange(len(task.train))
    np.testing.assert_array_equal(
        grouped.train.gather(rows)["image"], task.train.gather(rows)["image"]
    )
    again = patient_level.with_synthetic_patients(task, mean_images=3.6, seed=0)
    np.testing.assert_array_equal(again.train.user_ids, patients)


def test_units_sample_the_same_rate():
    config = PatientLevelConfig(mean_images_per_patient=4.0)
    units = config.unit_pipelines()
    assert units["image"] == config.pipeline
    patient = units["patient"]
    assert patient.privacy_unit == "patient" and patient.max_images_per_patient == 4
    assert patient.mixture.batch_size == config.pipeline.mixture.batch_size / 4
    assert patient.finetune.batch_size == round(config.pipeline.finetune.batch_size / 4)
    with pytest.raises(ValueError, match="mean_images_per_patient must be >= 1"):
        PatientLevelConfig(mean_images_per_patient=0.5)


@pytest.mark.slow
def test_tiny_study_writes_both_units(tmp_path):
    quiet = dict(progress=False, log_every=None)
    base = presets.image_demo_config()
    short = TrainConfig(steps=5, batch_size=32, learning_rate=3e-3, **quiet)
    pipeline = dataclasses.replace(
        base,
        proxy=short,
        pretrain=short,
        mixture=dataclasses.replace(base.mixture, steps=5),
        finetune=dataclasses.replace(base.finetune, steps=3),
    )
    config = PatientLevelConfig(
        pipeline=pipeline,
        epsilons=(1.0,),
        seeds=(0,),
        methods=("dp_mixmin",),
        image_size=8,
    )
    results = patient_level.main(config, tmp_path, reproducible=True)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert results["noise_seeded"] and results["wall_s"] > 0
    assert results["provenance"]["command"] and results["provenance"]["date"]
    for unit, label in (
        ("image", "per image"),
        ("patient", "per patient (user-level, up to 4 images)"),
    ):
        comparison = json.loads((tmp_path / unit / "results.json").read_text())
        assert comparison["privacy_unit"] == results["units"][unit]["privacy_unit"] == label
        for row in results["table"]:
            run = next(
                r
                for r in comparison["runs"]
                if r["method"] == row["method"] and r["epsilon"] == row["epsilon"]
            )
            assert row[f"{unit}_auc"][0] == run["utility"]
            assert row[f"{unit}_spent_epsilon"] == run["spent_epsilon"] <= 1.0 + 1e-6
    text = (tmp_path / "results.md").read_text()
    for row in results["table"]:
        assert f"{row['image_auc'][0]:.4f}" in text and f"{row['patient_minus_image']:+.4f}" in text
    assert "AUC, (ε, δ) per patient (user-level, up to 4 images)" in text


def test_docs_page_shows_the_stored_results():
    root = pathlib.Path(__file__).parents[2]
    results = json.loads((root / "docs" / "results" / "patient_level.json").read_text())
    page = (root / "docs" / "patient-level.md").read_text()
    # The page's table is rebuilt from this file by `dpmix report` (checked by test_readme).
    stored_page = (root / "docs" / "results" / "patient_level.md").read_text()
    assert stored_page == patient_level.markdown(results) + "\n"
    assert "<!-- table:patient_level markdown -->" in page
    assert results["noise_seeded"] and results["provenance"]["commit"]
    assert all(
        row["image_spent_epsilon"] <= row["epsilon"] * (1 + 1e-6) for row in results["table"]
    )
    assert all(
        row["patient_spent_epsilon"] <= row["epsilon"] * (1 + 1e-6) for row in results["table"]
    )
