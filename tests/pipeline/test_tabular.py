"""The tabular task (`data.tabular`), the tabular pipeline's density-ratio variant and its
accounting (`pipeline.tabular`), the study (`experiments.tabular`) in a tiny form, and the docs
page against the stored results."""

from __future__ import annotations

import json
import pathlib

import dp_accounting
import numpy as np
import pytest

from dpmix_jax.data import tabular as data
from dpmix_jax.pipeline import tabular
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.train import TrainConfig
from experiments import tabular as study
from experiments.configs import tabular as configs

ROOT = pathlib.Path(__file__).parents[2]
SMALL = data.TabularTaskConfig(num_sensitive=400, val_size=50, test_size=100)


def tiny_pipeline() -> tabular.TabularPipelineConfig:
    quiet = dict(progress=False, log_every=None)
    short = TrainConfig(steps=5, batch_size=32, learning_rate=3e-3, **quiet)
    return configs.pipeline_config(
        proxy=short,
        pretrain=short,
        mixture=MixtureConfig(steps=5, batch_size=20, clip_norm=5.0, learning_rate=0.4),
        finetune=TrainConfig(
            steps=3,
            batch_size=32,
            learning_rate=1e-3,
            private=True,
            clip_norm=1.0,
            epsilon=1.0,
            delta=1e-5,
            **quiet,
        ),
        density_ratio=tabular.DensityRatioConfig(steps=5, batch_size=64),
    )


def all_rows(source) -> dict[str, np.ndarray]:
    return source.gather(np.arange(len(source)))


def test_task_shapes_sources_and_disjoint_rows():
    task = data.load_fair_task(data.TabularTaskConfig())
    table = data.load_fair_table()
    assert task.k == 4 and task.source_names == tuple(n for n, _ in data.AGE_SOURCES)
    assert task.num_features == 6 + 2 * len(data.OCCUPATION_CODES) == 18
    assert (len(task.train), len(task.val), len(task.test)) == (950, 150, 400)
    ids = [np.asarray(s.group_ids) for s in (*task.sources, task.train, task.val, task.test)]
    merged = np.concatenate(ids)
    assert len(np.unique(merged)) == len(merged)  # no table row is in two places
    assert sum(len(s) for s in task.sources) == round(0.35 * len(table))
    for index, source in enumerate(task.sources):
        rows = all_rows(source)
        ages = table["age"].to_numpy()[np.asarray(source.group_ids)]
        assert np.isin(ages, data.AGE_SOURCES[index][1]).all()
        assert rows["features"].shape == (len(source), 18) and rows["features"].dtype == np.float32
        assert set(np.unique(rows["labels"])) <= {0.0, 1.0}
        one_hot = rows["features"][:, 6:]
        np.testing.assert_array_equal(one_hot.reshape(len(source), 2, 6).sum(axis=2), 1.0)
    train = all_rows(task.train)
    truth = (table["affairs"].to_numpy()[np.asarray(task.train.group_ids)] > 0).astype(np.float32)
    np.testing.assert_array_equal(train["labels"][:, 0], truth)
    public = np.concatenate([all_rows(s)["features"][:, :6] for s in task.sources])
    np.testing.assert_allclose(public.mean(axis=0), 0.0, atol=1e-5)
    np.testing.assert_allclose(public.std(axis=0), 1.0, atol=1e-4)


def test_public_preprocessing_ignores_sensitive_rows():
    table = data.load_fair_table()
    task = data.load_fair_task(SMALL, table=table)
    public = np.concatenate([np.asarray(s.group_ids) for s in task.sources])
    edited = table.copy()
    sensitive = np.setdiff1d(np.arange(len(table)), public)
    for column in ("age", "educ", "children", "yrs_married", "religious"):
        values = edited[column].to_numpy(copy=True)
        values[sensitive] = values[sensitive][::-1] * 3 + 7  # other values, other statistics
        edited[column] = values
    edited.loc[sensitive, "occupation"] = 6.0
    with pytest.raises(ValueError, match="column 'age' row"):
        data.load_fair_task(SMALL, table=edited)  # ages outside every band are refused
    edited["age"] = table["age"]
    other = data.load_fair_task(SMALL, table=edited)
    for before, after in zip(task.sources, other.sources, strict=True):
        np.testing.assert_array_equal(all_rows(before)["features"], all_rows(after)["features"])
        np.testing.assert_array_equal(before.group_ids, after.group_ids)
    # The edit reached the sensitive rows (same rows drawn: the draw reads age and rating only).
    np.testing.assert_array_equal(task.train.group_ids, other.train.group_ids)
    assert not np.array_equal(all_rows(task.train)["features"], all_rows(other.train)["features"])


def test_shift_tilts_the_sensitive_rows_and_bad_settings_are_refused():
    tilts = []
    for shift in (0.0, 1.0, 2.0):
        task = data.load_fair_task(data.TabularTaskConfig(shift=shift))
        tilts.append(all_rows(task.train)["features"][:, 0].mean())
    assert tilts[0] > tilts[1] > tilts[2]
    band = np.repeat(np.arange(4), [10, 30, 30, 30])
    weights = data.sensitive_draw_weights(band, np.zeros(100), (0.1, 0.15, 0.25, 0.5), 0.0)
    np.testing.assert_allclose(np.bincount(band, weights=weights), (0.1, 0.15, 0.25, 0.5))
    for bad, message in (
        (dict(shift=-1.0), "shift must be"),
        (dict(target_mixture=(0.5, 0.5)), "target_mixture must be"),
        (dict(num_sensitive=100, val_size=50, test_size=50), "must leave train rows"),
        (dict(public_fraction=1.0), "public_fraction"),
    ):
        with pytest.raises(ValueError, match=message):
            data.TabularTaskConfig(**bad)
    with pytest.raises(ValueError, match="column 'occupation_husb' row 1 has code 9, not one of"):
        data.one_hot(np.array([[1.0, 2.0], [3.0, 9.0]]))


def test_ratio_row_weights_sum_to_one_per_source():
    logits = np.array([0.0, 1.0, 10.0, -10.0, 2.0])
    sources = np.array([0, 0, 0, 1, 1])
    weights = tabular.ratio_row_weights(logits, sources, max_log_ratio=3.0)
    np.testing.assert_allclose(np.bincount(sources, weights=weights), 1.0)
    np.testing.assert_allclose(weights[:3], np.exp([0.0, 1.0, 3.0]) / np.exp([0, 1, 3]).sum())


def test_density_ratio_accounting_matches_dp_accounting(tmp_path):
    task = data.load_fair_task(SMALL)
    config = tiny_pipeline()
    pipeline = tabular.TabularPipeline(task, config, tmp_path, reproducible=True)
    epsilon, delta = 1.0, config.delta
    stage = pipeline.density_ratio_mixture(epsilon, seed=0)
    plan = stage["plan"]
    mix, _ = pipeline.split(0)
    public = sum(len(s) for s in task.sources)
    assert plan["classifier_rate"] == config.density_ratio.batch_size / (public + len(mix))
    assert plan["mixture_rate"] == config.mixture.batch_size / len(mix)

    def composed(sigma: float) -> float:
        # The composed event written with dp_accounting alone, accounted by its PLD accountant.
        events = [
            dp_accounting.SelfComposedDpEvent(
                dp_accounting.PoissonSampledDpEvent(rate, dp_accounting.GaussianDpEvent(sigma)),
                steps,
            )
            for rate, steps in (
                (plan["classifier_rate"], config.density_ratio.steps),
                (plan["mixture_rate"], config.mixture.steps),
            )
        ]
        accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
        accountant.compose(dp_accounting.ComposedDpEvent(events))
        return accountant.get_epsilon(delta)

    sigma = plan["noise_multiplier"]
    independent = composed(sigma)
    assert stage["spent"]["epsilon"] == pytest.approx(independent, rel=2e-3)
    assert stage["spent"]["epsilon"] <= epsilon + 1e-9
    assert composed(0.98 * sigma) > epsilon  # calibrated: a little less noise overspends
    # Each part alone spends less than their composition, and both recorded all their steps.
    assert max(stage["classifier_epsilon"], stage["mixmin_epsilon"]) < stage["spent"]["epsilon"]
    counts = [entry["count"] for entry in stage["ledger"]["entries"]]
    assert sum(counts) == config.density_ratio.steps + config.mixture.steps
    weights = np.asarray(stage["weights"])
    assert weights.shape == (4,) and weights.sum() == pytest.approx(1.0)
    result = pipeline.run_density_ratio(epsilon, seed=0)
    assert result.method == tabular.RATIO_METHOD and result.private
    assert result.stages["mixture"].epsilon == stage["spent"]["epsilon"]
    assert result.spent.epsilon == max(s.epsilon for s in result.stages.values()) <= epsilon
    assert 0.0 <= result.utility <= 1.0


@pytest.mark.slow
def test_tiny_study_writes_its_results(tmp_path):
    config = configs.TabularStudyConfig(
        task=SMALL, pipeline=tiny_pipeline(), shifts=(0.0, 2.0), epsilons=(1.0,), seeds=(0,)
    )
    results = study.main(config, tmp_path, reproducible=True, quiet=True)
    assert json.loads((tmp_path / "results.json").read_text()) == results
    assert (tmp_path / "utility_vs_epsilon.png").stat().st_size > 0
    assert results["noise_seeded"] and results["provenance"]["command"]
    assert len(results["runs"]) == 2 * len(configs.METHODS)
    for run in results["runs"]:
        assert run["spent_epsilon"] <= run["epsilon"] * (1 + 1e-6)
    for row in results["table"]:
        (run,) = [
            r
            for r in results["runs"]
            if (r["shift"], r["epsilon"], r["method"])
            == (row["shift"], row["epsilon"], row["method"])
        ]
        assert row["auc"] == [run["utility"], 0.0]
    for row in results["differences"]:
        gap = row["dp_mixmin - uniform"][0]
        by_method = {
            r["method"]: r["utility"] for r in results["runs"] if r["shift"] == row["shift"]
        }
        assert gap == pytest.approx(by_method["dp_mixmin"] - by_method["uniform"])
    text = (tmp_path / "results.md").read_text()
    assert study.markdown(results) == text and "dp_mixmin_ratio" in text


def test_study_config_refuses_unknown_methods():
    with pytest.raises(ValueError, match="methods must be among"):
        configs.TabularStudyConfig(pipeline=tiny_pipeline(), methods=("gsd",))
    with pytest.raises(ValueError, match="composition must be 'parallel'"):
        configs.pipeline_config(composition="sequential")


def test_docs_page_shows_the_stored_results():
    results = json.loads((ROOT / "docs" / "results" / "tabular.json").read_text())
    page = (ROOT / "docs" / "tabular.md").read_text()
    # The page's table is rebuilt from this file by `dpmix report` (checked by test_readme).
    stored_page = (ROOT / "docs" / "results" / "tabular.md").read_text()
    assert stored_page == study.markdown(results) + "\n"
    assert "<!-- table:tabular markdown -->" in page
    assert results["noise_seeded"] and results["provenance"]["commit"]
    assert all(r["spent_epsilon"] <= r["epsilon"] * (1 + 1e-6) for r in results["runs"])
    grid = {(r["shift"], r["epsilon"], r["method"], r["seed"]) for r in results["runs"]}
    config = results["config"]
    assert (
        len(grid)
        == len(results["runs"])
        == (
            len(config["shifts"])
            * len(config["epsilons"])
            * len(config["seeds"])
            * len(config["methods"])
        )
    )
