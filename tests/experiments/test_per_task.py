"""The per-task experiment: gains, grouping, the multi-task digits default, and an end-to-end
run on a tiny config."""

import json

import numpy as np
import pytest

from dpmix_jax.data import builtin
from dpmix_jax.pipeline import MixtureConfig, presets
from dpmix_jax.train import TrainConfig
from experiments import per_task
from experiments.configs.per_task import PerTaskConfig, get_config


def _runs(aucs):
    """results.json-like runs from {method: [AUC of seed 0, seed 1, ...]}."""
    return [
        {"method": m, "seed": s, "utility": auc}
        for m, values in aucs.items()
        for s, auc in enumerate(values)
    ]


def test_gains_are_relative_to_random_init_of_the_same_seed():
    gains = per_task.task_gains(
        _runs(
            {
                "random_init": [0.5, 0.6],
                "dp_mixmin": [0.6, 0.66],  # +20% and +10%
                "uniform": [0.55, 0.6],  # +10% and 0%
                "random_search": [0.45, 0.66],  # -10% and +10%
            }
        )
    )
    assert gains["dp_mixmin"]["gain"]["mean"] == pytest.approx(0.15)
    assert gains["dp_mixmin"]["gain"]["std"] == pytest.approx(0.05)
    assert gains["uniform"]["gain_per_seed"] == pytest.approx({0: 0.1, 1: 0.0})
    assert gains["random_search"]["gain"]["mean"] == pytest.approx(0.0)
    assert gains["random_init"]["auc"]["mean"] == pytest.approx(0.55)
    assert "gain" not in gains["random_init"]
    assert per_task.relative_gain(0.707, 0.636) == pytest.approx(0.1116, abs=1e-4)


def test_gains_need_random_init_for_every_seed():
    with pytest.raises(ValueError, match="random_init"):
        per_task.task_gains(_runs({"dp_mixmin": [0.6]}))
    with pytest.raises(ValueError, match="seeds"):
        per_task.task_gains(_runs({"random_init": [0.5, 0.5], "dp_mixmin": [0.6]}))


def test_groups_split_tasks_by_prevalence():
    assert per_task.prevalence_groups([0.4, 0.1, 0.3, 0.005]) == ["A", "B", "A", "B"]
    assert per_task.prevalence_groups([0.2, 0.3, 0.1]) == ["B", "A", "B"]
    with pytest.raises(ValueError):
        per_task.prevalence_groups([0.3])


def test_summary_means_over_tasks_and_compares_with_uniform():
    def row(dp, uniform, rs, ri):
        aucs = {"random_init": [ri], "dp_mixmin": [dp], "uniform": [uniform], "random_search": [rs]}
        return {"methods": per_task.task_gains(_runs(aucs))}

    rows = [row(0.8, 0.7, 0.65, 0.5), row(0.66, 0.6, 0.6, 0.6)]
    summary = per_task.summarize_tasks(rows)
    assert summary["gain"]["dp_mixmin"] == pytest.approx((0.6 + 0.1) / 2)
    assert summary["gain"]["uniform"] == pytest.approx((0.4 + 0.0) / 2)
    assert summary["gain_ratio"]["uniform"] == pytest.approx(0.35 / 0.2)
    assert summary["vs_uniform"]["absolute"] == pytest.approx(0.08)
    assert summary["vs_uniform"]["relative"] == pytest.approx((0.1 / 0.7 + 0.1) / 2)
    assert summary["auc"]["random_init"] == pytest.approx(0.55)


def test_prevalence_scales_thin_positives_and_leave_the_default_unchanged():
    plain = builtin.load_digit_mixture_task(seed=0, image_size=8, num_tasks=2)
    ones = builtin.load_digit_mixture_task(
        seed=0, image_size=8, num_tasks=2, prevalence_scales=(1.0, 1.0)
    )
    thinned = builtin.load_digit_mixture_task(
        seed=0, image_size=8, num_tasks=2, prevalence_scales=(1.0, 0.1)
    )
    for split in ("train", "val", "test"):
        np.testing.assert_array_equal(plain.sensitive[split].labels, ones.sensitive[split].labels)
        a, b = plain.sensitive[split], thinned.sensitive[split]
        np.testing.assert_array_equal(a.labels[:, 0], b.labels[:, 0])
        np.testing.assert_allclose(b.label_probs[:, 1], 0.1 * a.label_probs[:, 1], rtol=1e-6)
        assert np.all(b.labels[:, 1] <= a.labels[:, 1])  # positives only removed
    with pytest.raises(ValueError, match="prevalence_scales"):
        builtin.load_digit_mixture_task(num_tasks=2, prevalence_scales=(1.0, 0.0))
    with pytest.raises(ValueError, match="prevalence_scales"):
        builtin.load_digit_mixture_task(num_tasks=2, prevalence_scales=(1.0,))


def test_cpu_preset_has_a_prevalence_range_and_a_rare_task():
    config = get_config("cpu")
    tasks = per_task.build_tasks(config, {})
    prevalences = [
        np.concatenate(
            [per_task.split_labels(getattr(t, s), t.task_index) for s in ("train", "val", "test")]
        ).mean()
        for t in tasks
    ]
    assert len(tasks) == len(config.prevalence_scales) >= 6
    assert len({t.name for t in tasks}) == len(tasks)
    for task in tasks:  # one shared input set
        assert task.public.arrays["image"] is tasks[0].public.arrays["image"]
        assert task.test.arrays["image"] is tasks[0].test.arrays["image"]
    rare = int(np.argmin(prevalences))
    assert 0 < prevalences[rare] < 0.01
    assert max(prevalences) > 0.35 and sorted(prevalences)[1] < 0.15


def test_config_rejects_bad_settings():
    pipeline = presets.image_demo_config()
    with pytest.raises(ValueError, match="data"):
        PerTaskConfig(data="cifar", pipeline=pipeline)
    with pytest.raises(ValueError, match="two prevalence_scales"):
        PerTaskConfig(data="digits", pipeline=pipeline, prevalence_scales=(1.0,))
    with pytest.raises(ValueError, match="digits data only"):
        PerTaskConfig(data="chexpert", pipeline=pipeline, prevalence_scales=(1.0, 0.5))
    with pytest.raises(ValueError, match="preset"):
        get_config("gpu")


@pytest.mark.slow  # trains 2 tasks x 4 methods end to end
def test_runs_end_to_end_on_a_tiny_config(tmp_path):
    quick = dict(batch_size=32, learning_rate=1e-2, progress=False, log_every=None)
    pipeline = presets.image_demo_config(
        proxy=TrainConfig(steps=20, **quick),
        pretrain=TrainConfig(steps=10, **quick),
        mixture=MixtureConfig(steps=10, batch_size=60, clip_norm=5.0, learning_rate=0.4),
        finetune=TrainConfig(
            steps=3, private=True, clip_norm=1.0, epsilon=1.0, delta=1e-5, **quick
        ),
        random_search_candidates=2,
    )
    config = PerTaskConfig(
        data="digits",
        pipeline=pipeline,
        seeds=(0,),
        prevalence_scales=(1.0, 0.02),
        image_size=8,
    )
    report = per_task.main(config, tmp_path, reproducible=True, progress=False)
    for name in ("results.md", "results.json", "per_task_gains.png"):
        assert (tmp_path / name).stat().st_size > 0
    stored = json.loads((tmp_path / "results.json").read_text())
    assert [t["group"] for t in stored["tasks"]] == ["A", "B"]
    assert stored["rare_task"]["index"] == 1 and stored["rare_task"]["prevalence"] < 0.02
    assert len(stored["runs"]) == 2 * len(per_task.METHODS)
    for task in stored["tasks"]:
        auc = {r["method"]: r["utility"] for r in stored["runs"] if r["task"] == task["index"]}
        gain = (auc["dp_mixmin"] - auc["random_init"]) / auc["random_init"]
        assert task["methods"]["dp_mixmin"]["gain"]["mean"] == pytest.approx(gain)
        assert 0 <= task["cosine_to_nonprivate"]["dp_mixmin"]["mean"] <= 1 + 1e-9
    assert stored["spent_epsilon"]["dp_mixmin"] <= 1.0 + 1e-6
    # Two fine-tunings on the same data, composed by the accountant: between one and their sum.
    assert 1.0 < stored["spent_epsilon"]["random_search"] < 2.0
    text = (tmp_path / "results.md").read_text()
    assert "paper, CheXpert -> NIH, macro" in text and "Hernia" in text
    assert report["macro"]["tasks"] == 2


def test_split_labels_reads_nih_labels_without_images(tmp_path):
    from dpmix_jax.data.cxr import NIH_LABELS, CxrDataset
    from dpmix_jax.data.sources import ArraySource

    labels = np.zeros((3, len(NIH_LABELS)), np.float32)
    labels[1, NIH_LABELS.index("Hernia")] = 1
    nih = CxrDataset(
        paths=[tmp_path / f"missing{i}.png" for i in range(3)],  # never opened
        labels=labels,
        label_names=NIH_LABELS,
        patient_ids=np.arange(3),
        views=["frontal"] * 3,
        image_size=(8, 8),
    )
    hernia = per_task.split_labels(nih, NIH_LABELS.index("Hernia"))
    np.testing.assert_array_equal(hernia, [0, 1, 0])
    with pytest.raises(ValueError, match="labels"):
        per_task.split_labels(ArraySource({"image": np.zeros((2, 4))}), 0)
