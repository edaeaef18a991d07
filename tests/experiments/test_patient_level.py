"""Patient-level privacy on the chest X-ray pipeline: patients are the unit of both private stages.

On the NIH fixture (its published layout, tiny images) whose train images are regrouped into
patients of 1 to 5 images, a patient-level run must: sample whole patients (every sampled
patient's images, at most G of them), clip each patient's mean gradient (the sum equals a naive
loop), calibrate and account both stages for the number of patients (ε from dp_accounting directly),
and name the unit in every output; the image unit stays the default and unchanged.
"""

from __future__ import annotations

import csv
import dataclasses
import json

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant

import experiments.cxr as cxr_experiment
from dpmix_jax.data import cxr
from dpmix_jax.data.sources import ArraySource
from dpmix_jax.pipeline import (
    ImagePipeline,
    ImagePipelineConfig,
    MixtureConfig,
    ModelSpec,
    SharedInputTask,
    image,
    run_comparison,
)
from dpmix_jax.pipeline.stage_store import epsilon_name
from dpmix_jax.privacy import randomness, summation
from dpmix_jax.train import TrainConfig
from experiments.configs.nih import CxrExperimentConfig
from tests import paper_fixtures as fixtures

IMAGE_SIZE = (8, 8)
PATIENT_SIZES = (1, 2, 3, 5)  # images per regrouped patient, cycling
DELTA = 1e-3
QUIET = dict(progress=False, log_every=None)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("patient_level")
    fixtures.write_nih(root / "nih", patients=40)
    fixtures.write_chexpert(root / "chexpert")
    return root


def regrouped(train: cxr.CxrDataset) -> cxr.CxrDataset:
    """The train images with patients of PATIENT_SIZES images (1, 2, 3, 5, 1, ...), so that some
    patients have more images than G."""
    sizes = np.resize(PATIENT_SIZES, len(train))
    patients = np.repeat(np.arange(len(sizes)), sizes)[: len(train)]
    return cxr.CxrDataset(
        paths=train.paths,
        labels=train.labels,
        label_names=train.label_names,
        patient_ids=1000 + patients,
        views=train.views,
        image_size=train.image_size,
    )


@pytest.fixture(scope="module")
def task(roots):
    nih = cxr.nih_official_splits(roots / "nih", image_size=IMAGE_SIZE)
    public = cxr.load_chexpert(roots / "chexpert", image_size=IMAGE_SIZE)
    return SharedInputTask(
        name="tiny NIH Effusion <- CheXpert",
        public=public,
        source_names=tuple(public.label_names),
        train=regrouped(nih["train"]),
        val=nih["val"],
        test=nih["test"],
        task_index=cxr.NIH_LABELS.index("Effusion"),
    )


def tiny_config(unit: str = "image", limit: int | None = None) -> ImagePipelineConfig:
    public = TrainConfig(steps=3, batch_size=16, learning_rate=1e-2, **QUIET)
    config = ImagePipelineConfig(
        delta=DELTA,
        mix_fraction=0.3,
        model=ModelSpec(kind="mlp", mlp_hidden=(8,)),
        proxy=public,
        mixture=MixtureConfig(steps=4, batch_size=2, clip_norm=5.0, learning_rate=0.4),
        pretrain=public,
        finetune=TrainConfig(
            steps=3,
            batch_size=4,
            learning_rate=1e-2,
            private=True,
            clip_norm=1.0,
            epsilon=1.0,
            delta=DELTA,
            pad_multiple=8,
            **QUIET,
        ),
        random_search_candidates=2,
        eval_batch_size=64,
    )
    return image.with_privacy_unit(config, unit, limit)


def direct_epsilon(sampling_rate: float, sigma: float, steps: int) -> float:
    """ε of T Poisson-sampled Gaussian steps from dp_accounting's PLD accountant directly."""
    accountant = PLDAccountant(value_discretization_interval=1e-4)
    step = dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(step, steps)
    return accountant.get_epsilon(DELTA)


def finetune_trainer(task, config, rows, tmp_path):
    pipeline = ImagePipeline(task, config, tmp_path / "stages", reproducible=True)
    init = config.model.build(task.image_shape, 1, seed=0)
    finetune = dataclasses.replace(config.finetune, epsilon=1.0, delta=config.delta)
    return pipeline.finetune_trainer(init, finetune, rows, randomness.prng_key(0))


# ------------------------------------------------------------------------------------------
# Data and settings
# ------------------------------------------------------------------------------------------


def test_nih_splits_give_each_image_its_patient_as_user_id(roots):
    with open(roots / "nih" / "Data_Entry_2017.csv", newline="") as handle:
        patient_of = {row["Image Index"]: int(row["Patient ID"]) for row in csv.DictReader(handle)}
    splits = cxr.nih_official_splits(roots / "nih", image_size=IMAGE_SIZE)
    for split in splits.values():
        expected = [patient_of[path.name] for path in split.paths]
        np.testing.assert_array_equal(split.user_ids, expected)
        np.testing.assert_array_equal(split.user_ids, split.group_ids)


def test_the_unit_sets_both_private_stages():
    image_level = tiny_config()
    assert image_level.privacy_unit == "image" and image_level.max_images_per_patient is None
    assert image_level.finetune.level == "example"
    assert image_level.mixture.max_examples_per_user is None
    patient_level = tiny_config("patient", 3)
    assert patient_level.finetune.level == "user"
    assert patient_level.finetune.max_examples_per_user == 3
    assert patient_level.mixture.max_examples_per_user == 3
    assert image.privacy_unit_label(image_level) == "per image"
    assert image.privacy_unit_label(patient_level) == "per patient (user-level, up to 3 images)"
    assert ImagePipelineConfig.__dataclass_fields__["privacy_unit"].default == "image"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(privacy_unit="study"), "privacy_unit must be 'image' or 'patient'"),
        (dict(max_images_per_patient=0), "max_images_per_patient must be an integer >= 1"),
        (dict(max_images_per_patient=None), "max_images_per_patient must be an integer >= 1"),
        (dict(privacy_unit="image"), "max_images_per_patient is for privacy_unit='patient'"),
    ],
)
def test_bad_unit_settings_are_one_line_errors(change, message):
    with pytest.raises(ValueError, match=message) as error:
        dataclasses.replace(tiny_config("patient", 2), **change)
    assert "\n" not in str(error.value)


def test_a_stage_at_another_level_is_refused():
    config = tiny_config("patient", 2)
    with pytest.raises(ValueError, match="finetune.level is 'example' but privacy_unit"):
        dataclasses.replace(
            config,
            finetune=dataclasses.replace(
                config.finetune, level="example", max_examples_per_user=None
            ),
        )
    with pytest.raises(ValueError, match="mixture.max_examples_per_user is 3"):
        dataclasses.replace(
            config, mixture=dataclasses.replace(config.mixture, max_examples_per_user=3)
        )
    with pytest.raises(ValueError, match="max_images_per_patient is for the patient unit"):
        image.with_privacy_unit(config, "image", 2)


def test_the_unit_and_g_key_the_stored_stages(task, tmp_path):
    units = [("image", None), ("patient", 2), ("patient", 3)]
    pipelines = [ImagePipeline(task, tiny_config(*unit), tmp_path) for unit in units]
    assert len({p.settings_folder() for p in pipelines}) == len(units)
    assert len({p.config_key for p in pipelines}) == len(units)


def test_patient_level_needs_patient_ids(task, tmp_path):
    anonymous = ArraySource(task.train.gather(np.arange(len(task.train))))
    with pytest.raises(ValueError, match="privacy_unit 'patient' needs the patient of every"):
        ImagePipeline(
            dataclasses.replace(task, train=anonymous), tiny_config("patient", 2), tmp_path
        )


# ------------------------------------------------------------------------------------------
# Sampling and clipping per patient
# ------------------------------------------------------------------------------------------


def test_the_sampler_draws_whole_patients_up_to_g(task, tmp_path):
    limit = 2
    rows = np.arange(len(task.train))
    trainer, data = finetune_trainer(task, tiny_config("patient", limit), rows, tmp_path)
    patients = np.asarray(task.train.user_ids)[rows]
    images_of = {p: set(np.flatnonzero(patients == p)) for p in np.unique(patients)}
    assert trainer.plan.num_units == len(images_of)
    assert trainer.plan.sampling_rate == pytest.approx(4 / len(images_of))
    rng = np.random.default_rng(0)
    draws, included = 3000, np.zeros(len(images_of))
    order = sorted(images_of)
    for _ in range(draws):
        batch = trainer.sampler.sample(rng, data.users)
        seen = []
        for row, mask in zip(batch.indices, batch.mask, strict=True):
            picked = row[mask]
            if not len(picked):
                continue
            owners = set(patients[picked])
            assert len(owners) == 1, "a batch row mixes patients"
            (owner,) = owners
            own = images_of[owner]
            assert len(set(picked)) == len(picked) == min(limit, len(own))
            assert set(picked) <= own
            seen.append(owner)
        assert len(seen) == len(set(seen)), "a patient sampled twice in one step"
        included[[order.index(p) for p in seen]] += 1
    rate = trainer.plan.sampling_rate
    spread = 5 * np.sqrt(rate * (1 - rate) / draws)
    assert np.all(np.abs(included / draws - rate) < spread)


def naive_patient_sum(trainer, params, data, indices, mask, clip_norm):
    """Σ over sampled patients of clip(mean of their images' gradients), one image at a time."""

    def image_loss(p, index):
        model = trainer.split.merge(p, trainer.frozen, trainer.rest)
        return trainer.loss_fn(model, data.gather(np.array([index])))[0]

    total = jax.tree.map(jnp.zeros_like, params)
    norms = []
    for row, row_mask in zip(indices, mask, strict=True):
        images = row[row_mask]
        if not len(images):
            continue
        grads = [jax.grad(image_loss)(params, int(i)) for i in images]
        mean = jax.tree.map(lambda *g: sum(g) / len(g), *grads)
        norm = float(jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(mean))))
        norms.append(norm)
        scale = min(1.0, clip_norm / norm)
        total = jax.tree.map(lambda t, g, s=scale: t + s * g, total, mean)
    return total, np.array(norms)


@pytest.mark.parametrize("clipping", ["ghost", "vmap"])
def test_clipped_sums_are_per_patient(task, tmp_path, clipping):
    limit = 3
    rows = np.arange(len(task.train))
    config = tiny_config("patient", limit)
    config = dataclasses.replace(
        config, finetune=dataclasses.replace(config.finetune, clipping=clipping)
    )
    probe, data = finetune_trainer(task, config, rows, tmp_path / "probe")
    params = probe.init_state().params
    users = data.users
    indices = np.full((len(users), limit), -1)
    for u, images in enumerate(users):  # every patient, its first G images
        indices[u, : min(limit, len(images))] = images[:limit]
    mask = indices >= 0
    _, norms = naive_patient_sum(probe, params, data, indices, mask, np.inf)
    clip_norm = float(np.median(norms))  # half the patients are clipped
    config = dataclasses.replace(
        config, finetune=dataclasses.replace(config.finetune, clip_norm=clip_norm)
    )
    trainer, data = finetune_trainer(task, config, rows, tmp_path / "clipped")
    assert trainer.clipping == clipping
    # Each patient is clipped to C' (its share of the rounding of the sum over all patients).
    unit_clip = summation.effective_clip_norm(clip_norm, len(users), 2.0**-24, len(users))
    expected, _ = naive_patient_sum(trainer, params, data, indices, mask, unit_clip)
    got = trainer.clipped_sum(params, data.gather, indices, mask)
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-6)
    # Clipping each image instead of each patient's mean gives another sum.
    per_image, _ = naive_patient_sum(
        trainer, params, data, indices.reshape(-1, 1), mask.reshape(-1, 1), clip_norm
    )
    assert any(not np.allclose(per_image[name], expected[name], rtol=1e-3) for name in expected)


def test_image_level_finetuning_is_per_image(task, tmp_path):
    rows = np.arange(len(task.train))
    trainer, data = finetune_trainer(task, tiny_config(), rows, tmp_path)
    assert data.user_ids is None and trainer.config.level == "example"
    assert trainer.plan.num_units == len(rows)


# ------------------------------------------------------------------------------------------
# Budgets of a whole run
# ------------------------------------------------------------------------------------------


def test_both_stages_are_accounted_for_the_patients(task, tmp_path):
    config = tiny_config("patient", 2)
    pipeline = ImagePipeline(task, config, tmp_path / "stages", reproducible=True)
    result = pipeline.run("dp_mixmin", 1.0, 0)
    patients = np.asarray(task.train.user_ids)
    mix, ft = pipeline.split(0)
    assert not set(patients[mix]) & set(patients[ft]), "a patient in both D_mix and D_ft"
    # DP-MixMin: users are the D_mix patients.
    stored = json.loads(
        (pipeline.stage_folder(0) / f"mixture_parallel_eps{epsilon_name(1.0)}.json").read_text()
    )
    mix_patients = len(np.unique(patients[mix]))
    assert stored["num_units"] == mix_patients < len(mix)
    assert stored["sampling_rate"] == pytest.approx(config.mixture.batch_size / mix_patients)
    mixture_eps = direct_epsilon(stored["sampling_rate"], stored["noise_multiplier"], 4)
    assert result.stages["mixture"].epsilon == pytest.approx(mixture_eps, rel=1e-3)
    # Fine-tuning: the D_ft patients; σ calibrated for their number, the ledger's ε is theirs.
    trainer, _ = finetune_trainer(task, config, ft, tmp_path / "again")
    ft_patients = len(np.unique(patients[ft]))
    assert trainer.plan.sampling_rate == pytest.approx(config.finetune.batch_size / ft_patients)
    sigma = trainer.plan.noise_multiplier
    finetune_eps = direct_epsilon(trainer.plan.sampling_rate, sigma, config.finetune.steps)
    assert result.stages["finetune"].epsilon == pytest.approx(finetune_eps, rel=1e-3)
    assert 0.9 < finetune_eps <= 1.0 + 1e-6
    # Accounting for images instead would report another ε for that σ.
    per_image = direct_epsilon(config.finetune.batch_size / len(ft), sigma, config.finetune.steps)
    assert per_image < 0.8 * finetune_eps
    assert result.spent.epsilon == max(budget.epsilon for budget in result.stages.values())


def test_delta_is_checked_against_the_patients(task, tmp_path):
    config = tiny_config("patient", 2)
    pipeline = ImagePipeline(task, config, tmp_path / "stages", reproducible=True)
    mix, _ = pipeline.split(0)
    mix_patients = len(np.unique(np.asarray(task.train.user_ids)[mix]))
    assert mix_patients < 1 / DELTA
    delta = 1.2 / mix_patients  # fine for the images of D_mix, not for its patients
    assert delta * len(mix) > 1
    large = dataclasses.replace(
        config,
        delta=delta,
        finetune=dataclasses.replace(config.finetune, delta=delta),
    )
    pipeline = ImagePipeline(task, large, tmp_path / "stages", reproducible=True)
    with pytest.raises(ValueError, match=f"for n = {mix_patients} patients in D_mix"):
        pipeline.check_delta(0)


# ------------------------------------------------------------------------------------------
# Outputs name the unit
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("unit, limit", [("image", None), ("patient", 2)])
def test_results_name_the_unit(task, tmp_path, unit, limit):
    config = tiny_config(unit, limit)
    pipeline = ImagePipeline(task, config, tmp_path / "stages", reproducible=True)
    label = image.privacy_unit_label(config)
    results = run_comparison(
        pipeline,
        dataset=task.name,
        metric="test AUC",
        higher_is_better=True,
        methods=("dp_mixmin",),
        epsilons=(1.0,),
        seeds=(0,),
        out_dir=tmp_path / "out",
        progress=False,
        privacy_unit=label,
    )
    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["privacy_unit"] == stored["privacy_unit"] == label
    text = (tmp_path / "out" / "results.md").read_text()
    assert "(higher is better); (ε, δ = " in text and f") {label}:" in text


def tiny_experiment(public: str, preset: str, *, smoke: bool = False) -> CxrExperimentConfig:
    """The CLI's config, shrunk: MLP models on 8x8 images, one finding, two methods."""
    assert (public, preset, smoke) == ("chexpert", "paper", False)
    return CxrExperimentConfig(
        public="chexpert",
        pipeline=tiny_config(),
        epsilons=(1.0,),
        seeds=(0,),
        methods=("dp_mixmin", "uniform"),
        tasks=("Effusion",),
        image_size=IMAGE_SIZE[0],
    )


@pytest.mark.parametrize(
    "flags, label",
    [
        ([], "per image"),
        (["--privacy-unit", "patient"], "per patient (user-level, up to 4 images)"),
    ],
)
def test_experiment_command_names_the_unit(roots, tmp_path, monkeypatch, capsys, flags, label):
    monkeypatch.setattr(cxr_experiment, "get_config", tiny_experiment)
    out = tmp_path / "out"
    argv = ["--preset", "paper", "--reproducible", "--out", str(out), *flags]
    argv += ["--nih-root", str(roots / "nih"), "--public-root", str(roots / "chexpert")]
    macro = cxr_experiment.cli("chexpert", argv)
    assert sorted(macro) == ["dp_mixmin eps=1", "uniform eps=1"]
    assert all(row["privacy_unit"] == label for row in macro.values())
    summary = json.loads((out / "results.json").read_text())
    assert summary["macro"] == macro and summary["privacy_unit"] == label
    table = (out / "results.md").read_text()
    assert "| method | ε = 1 |" in table and "| DP-MixMin | " in table
    assert f"guarantee {label}." in table
    assert f"guarantee {label}." in capsys.readouterr().out
    results = json.loads((out / "task0" / "results.json").read_text())
    assert results["privacy_unit"] == label
    assert f") {label}:" in (out / "task0" / "results.md").read_text()
    for run in results["runs"]:
        assert 0 < run["spent_epsilon"] <= 1.0 + 1e-6


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--preset", "cpu", "--privacy-unit", "patient"], "needs NIH patient ids"),
        (["--max-images-per-patient", "2"], "applies to --privacy-unit patient"),
        (
            ["--preset", "paper", "--privacy-unit", "patient", "--max-images-per-patient", "0"],
            "must be an integer >= 1, got 0",
        ),
        (["--privacy-unit", "study"], "invalid choice: 'study'"),
    ],
)
def test_bad_unit_flags_are_one_line_errors(flags, message, capsys):
    with pytest.raises(SystemExit):
        cxr_experiment.cli("chexpert", flags)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_paper_smoke_runs_at_patient_level(roots, tmp_path):
    """`--preset paper --smoke --privacy-unit patient`: the paper's models and all five methods,
    patient level in both private stages, through to results.md."""
    out = tmp_path / "out"
    argv = ["--preset", "paper", "--smoke", "--reproducible", "--out", str(out)]
    argv += ["--privacy-unit", "patient", "--max-images-per-patient", "2"]
    argv += ["--nih-root", str(roots / "nih"), "--public-root", str(roots / "chexpert")]
    macro = cxr_experiment.cli("chexpert", argv)
    label = "per patient (user-level, up to 2 images)"
    assert len(macro) == 5 and all(row["privacy_unit"] == label for row in macro.values())
    assert f"guarantee {label}." in (out / "results.md").read_text()
    results = json.loads((out / "task0" / "results.json").read_text())
    for run in results["runs"]:
        budget = 2 if run["method"] == "random_search" else 1
        assert 0 < run["spent_epsilon"] <= budget * (1 + 1e-6)
