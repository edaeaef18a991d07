"""The image pipeline end to end on a tiny preset: stages, disjointness, budgets, resume."""

import dataclasses
import json
import shutil

import dp_accounting
import numpy as np
import pytest

from dpmix_jax.pipeline import ImagePipeline, MixtureConfig, presets, run_comparison
from dpmix_jax.pipeline.budget import end_to_end_budget
from dpmix_jax.pipeline.results import METHODS, RunResult
from dpmix_jax.pipeline.splits import derived_seed, dirichlet_candidates, split_mixture
from dpmix_jax.privacy import SEEDED_NOTE, accounting
from dpmix_jax.train import TrainConfig

QUIET = {"progress": False, "log_every": None}


@pytest.fixture(scope="module")
def task():
    return presets.digit_task(image_size=8)


def tiny_config(**overrides):
    settings = dict(
        mix_fraction=0.3,
        model=presets.ModelSpec(kind="mlp", mlp_hidden=(16,)),
        proxy=TrainConfig(steps=30, batch_size=64, learning_rate=1e-2, **QUIET),
        mixture=MixtureConfig(steps=20, batch_size=60, clip_norm=5.0, learning_rate=0.4),
        pretrain=TrainConfig(steps=20, batch_size=64, learning_rate=1e-2, **QUIET),
        finetune=TrainConfig(
            steps=4,
            batch_size=64,
            learning_rate=1e-3,
            private=True,
            clip_norm=1.0,
            epsilon=1.0,
            delta=1e-5,
            **QUIET,
        ),
        random_search_candidates=2,
    )
    settings.update(overrides)
    return presets.image_demo_config(**settings)


def test_dp_mixmin_run_stores_its_stages_and_composes_budgets_in_parallel(task, tmp_path):
    stages = []
    pipeline = ImagePipeline(task, tiny_config(), tmp_path, on_stage=stages.append)
    result = pipeline.run("dp_mixmin", 1.0, seed=0)

    mix, ft = pipeline.split(0)
    assert len(np.intersect1d(mix, ft)) == 0
    assert np.array_equal(np.sort(np.concatenate([mix, ft])), np.arange(len(task.train)))
    n = len(task.train)  # a Binomial(n, ρ) part size (units are hashed into parts)
    assert len(mix) == pytest.approx(0.3 * n, abs=5 * np.sqrt(n * 0.3 * 0.7))

    store = pipeline.stage_folder(0)
    mixture = json.loads((store / "mixture_parallel_eps1.0.json").read_text())
    # The mixture stage's ε is the accountant's for the σ, rate and steps it ran.
    expected_mix = accounting.epsilon(
        accounting.dpsgd_event(
            noise_multiplier=mixture["noise_multiplier"],
            sampling_rate=mixture["sampling_rate"],
            steps=20,
        ),
        delta=1e-5,
    )
    assert mixture["sampling_rate"] == pytest.approx(60 / len(mix))
    assert result.stages["mixture"].epsilon == pytest.approx(expected_mix)
    assert accounting.PrivacyLedger.from_state_dict(mixture["ledger"]).count == 20
    assert result.spent.epsilon == max(s.epsilon for s in result.stages.values())
    assert 0.99 <= result.spent.epsilon <= 1.0
    assert len(result.weights) == task.k and sum(result.weights) == pytest.approx(1.0)
    assert {"split", "proxy", "proxy_outputs", "mixture", "finetune"} <= set(stages)
    assert any(s.startswith("pretrain_") for s in stages)
    assert (store / "run_dp_mixmin_parallel_eps1.0.json").exists()


def _stored_ledgers(store, pattern):
    """The ledgers that the stages matching `pattern` stored, read back independently."""
    ledgers = []
    for folder in sorted(store.glob(pattern)):
        if folder.is_dir():  # a fine-tuning's final checkpoint: its metadata holds the ledger
            (meta,) = (p for p in (folder / "final").rglob("metadata") if p.parent.name == "meta")
            state = json.loads(meta.read_text())["ledger"]
            ledgers.append(accounting.PrivacyLedger.from_state_dict(state))
        else:
            ledgers.append(
                accounting.PrivacyLedger.from_state_dict(json.loads(folder.read_text())["ledger"])
            )
    return ledgers


def _direct_composition(ledgers, delta):
    """dp_accounting's PLD accountant on every recorded event, composed one by one."""
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    for ledger in ledgers:
        for event, count in ledger.entries:
            direct.compose(event, count)
    return direct.get_epsilon(delta)


def test_end_to_end_budget_is_the_max_or_the_composed_events():
    def ledger(sigma, rate, steps):
        out = accounting.PrivacyLedger()
        out.record(
            accounting.dpsgd_event(noise_multiplier=sigma, sampling_rate=rate, steps=1), steps
        )
        return out

    stages = {"mixture": ledger(3.0, 0.05, 100), "finetune": ledger(1.5, 0.02, 300)}
    mixture, finetune = (stages[k].epsilon(1e-5) for k in ("mixture", "finetune"))
    parallel = end_to_end_budget(stages, "parallel", delta=1e-5)
    assert parallel == accounting.PrivacyBudget(max(mixture, finetune), 1e-5)
    sequential = end_to_end_budget(stages, "sequential", delta=1e-5)
    direct = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    direct.compose(stages["mixture"].event()).compose(stages["finetune"].event())
    assert direct.get_epsilon(1e-5) <= sequential.epsilon <= direct.get_epsilon(1e-5) * 1.001
    assert max(mixture, finetune) < sequential.epsilon < mixture + finetune
    assert sequential.delta == 1e-5
    with pytest.raises(ValueError, match="composition"):
        end_to_end_budget(stages, "serial", delta=1e-5)
    with pytest.raises(ValueError, match="at least one"):
        end_to_end_budget({}, "sequential", delta=1e-5)


def test_sequential_composition_uses_all_data_and_composes_the_stage_events(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(composition="sequential"), tmp_path)
    result = pipeline.run("dp_mixmin", 2.0, seed=0)
    mix, ft = pipeline.split(0)
    assert np.array_equal(mix, ft) and len(mix) == len(task.train)
    mixture, finetune = result.stages["mixture"].epsilon, result.stages["finetune"].epsilon
    assert mixture <= 0.2 and finetune <= 1.8
    # The end-to-end ε is the accountant's for both stages' events together: below the sum of
    # the stage budgets the noise was calibrated to, above either stage alone.
    store = pipeline.stage_folder(0)
    ledgers = _stored_ledgers(store, "mixture_sequential_*.json")
    ledgers += _stored_ledgers(store, "finetune_*_ft_sequential_*")
    assert len(ledgers) == 2
    direct = _direct_composition(ledgers, 1e-5)
    assert direct <= result.spent.epsilon <= direct * (1 + 1e-3)
    assert max(mixture, finetune) < result.spent.epsilon < mixture + finetune <= 2.0
    assert result.spent.delta == 1e-5
    stored = json.loads((store / "run_dp_mixmin_sequential_eps2.0.json").read_text())
    assert stored["spent_epsilon"] == result.spent.epsilon


def test_resume_skips_finished_stages_and_reports_the_same_budget(task, tmp_path):
    first = ImagePipeline(task, tiny_config(), tmp_path).run("dp_mixmin", 1.0, seed=1)
    store = ImagePipeline(task, tiny_config(), tmp_path).stage_folder(1)
    (store / "run_dp_mixmin_parallel_eps1.0.json").unlink()
    for finetune_dir in store.glob("finetune_*"):
        shutil.rmtree(finetune_dir)  # a run killed during fine-tuning

    stages = []
    again = ImagePipeline(task, tiny_config(), tmp_path, on_stage=stages.append)
    second = again.run("dp_mixmin", 1.0, seed=1)
    assert stages == ["finetune"]
    assert second.weights == first.weights
    assert second.spent == first.spent
    assert second.utility == pytest.approx(first.utility, abs=1e-6)
    stages.clear()
    assert again.run("dp_mixmin", 1.0, seed=1) == second and stages == []


def test_baselines_are_labelled_and_accounted(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(), tmp_path)
    uniform = pipeline.run("uniform", 1.0, seed=0)
    assert uniform.weights == pytest.approx([1 / task.k] * task.k)
    assert set(uniform.stages) == {"finetune"} and uniform.private
    random_init = pipeline.run("random_init", 1.0, seed=0)
    assert random_init.weights is None and random_init.private
    search = pipeline.run("random_search", 1.0, seed=0)
    assert not search.private
    scores = search.extra["validation_utilities"]
    assert len(scores) == 2 and search.extra["selected_validation_utility"] == max(scores)
    # Two candidates, each fine-tuned on the same D_ft at ε = 1: the accountant's ε of the
    # two fine-tunings' events composed, more than one and less than their sum, at δ itself.
    store = pipeline.stage_folder(0)
    ledgers = _stored_ledgers(store, "finetune_*_ft_parallel_eps1.0")
    candidates = dirichlet_candidates(task.k, 2, seed=derived_seed(0, "candidates"))
    assert len(ledgers) == len(candidates) == 2
    direct = _direct_composition(ledgers, 1e-5)
    assert direct <= search.spent.epsilon <= direct * (1 + 1e-3)
    single = max(ledger.epsilon(1e-5) for ledger in ledgers)
    assert 0.99 <= single <= 1.0
    assert single < search.spent.epsilon < 0.8 * 2 * single and search.spent.delta == 1e-5
    stored = json.loads((store / "run_random_search_parallel_eps1.0.json").read_text())
    assert stored["spent_epsilon"] == search.spent.epsilon
    assert not pipeline.run("nonprivate_mixmin", 1.0, seed=0).private


def test_comparison_writes_results_in_the_documented_shape(task, tmp_path):
    results = run_comparison(
        ImagePipeline(task, tiny_config(), tmp_path / "stages"),
        dataset="digits",
        metric="test AUC",
        higher_is_better=True,
        methods=["dp_mixmin", "uniform", "nonprivate_mixmin"],
        epsilons=[1.0],
        seeds=[0],
        out_dir=tmp_path,
        true_weights=task.true_weights,
        progress=False,
    )
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert {"dataset", "metric", "higher_is_better", "runs", "true_weights"} <= set(on_disk)
    for run in on_disk["runs"]:
        assert run["method"] in METHODS
        assert isinstance(run["utility"], float) and 0 <= run["utility"] <= 1
        assert {"epsilon", "delta", "seed", "weights"} <= set(run)
    dp = next(r for r in on_disk["runs"] if r["method"] == "dp_mixmin")
    assert -1 <= dp["weight_quality"]["cosine_true"] <= 1
    assert "cosine_reference" in dp["weight_quality"]
    assert (tmp_path / "results.md").read_text().count("| DP-MixMin |") == 2
    assert (tmp_path / "utility_vs_epsilon.png").stat().st_size > 0
    assert (tmp_path / "weights.png").stat().st_size > 0


def test_group_ids_give_a_group_disjoint_split():
    groups = np.repeat(np.arange(30), 4)
    mix, ft = split_mixture(groups, 0.2, key=0)
    assert not set(groups[mix]) & set(groups[ft])
    assert len(mix) + len(ft) == len(groups)


def test_split_is_by_unit_id_so_adding_or_removing_a_unit_moves_no_other():
    ids = [f"user{i}" for i in range(200)]
    mix, _ = split_mixture(ids, 0.3, key=7)
    in_mix = {ids[i] for i in mix}
    fewer = ids[:50] + ids[51:]  # one unit removed from the middle
    mix_fewer, _ = split_mixture(fewer, 0.3, key=7)
    assert {fewer[i] for i in mix_fewer} == in_mix - {ids[50]}
    more = ["newcomer", *ids]
    mix_more, _ = split_mixture(more, 0.3, key=7)
    assert {more[i] for i in mix_more} - {"newcomer"} == in_mix


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mix_fraction": 0.0}, "mix_fraction"),
        ({"composition": "interleaved"}, "composition"),
        ({"sequential_mixture_share": 1.5, "composition": "sequential"}, "mixture_share"),
    ],
)
def test_bad_pipeline_settings_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_config(**kwargs)


def test_bad_run_arguments_are_rejected(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(), tmp_path)
    with pytest.raises(ValueError, match="method"):
        pipeline.run("best_guess", 1.0, seed=0)
    with pytest.raises(ValueError, match="epsilon"):
        pipeline.run("uniform", 0.0, seed=0)
    with pytest.raises(ValueError, match="private"):
        dataclasses.replace(
            tiny_config(), finetune=TrainConfig(steps=1, batch_size=8, learning_rate=0.1)
        )


def test_a_runs_secret_is_drawn_once_kept_owner_only_and_reused_on_resume(task, tmp_path):
    first = ImagePipeline(task, tiny_config(), tmp_path)
    split_key = first.private_seed(0, "split")
    resumed = ImagePipeline(task, tiny_config(), tmp_path)  # a rerun on the same store
    assert resumed.private_seed(0, "split") == split_key
    assert first.private_seed(0, "mixture", "1") != split_key  # one stream per use
    assert first.private_seed(1, "split") != split_key  # one secret per run
    elsewhere = ImagePipeline(task, tiny_config(), tmp_path / "elsewhere")
    assert elsewhere.private_seed(0, "split") != split_key
    secret_file = first.stage_folder(0) / "secret_randomness.json"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    seeded = ImagePipeline(task, tiny_config(), tmp_path / "seeded", reproducible=True)
    assert seeded.private_seed(0, "split") == derived_seed(0, "split")
    assert not (seeded.stage_folder(0) / "secret_randomness.json").exists()


@pytest.mark.slow
def test_private_randomness_is_secret_by_default_and_seeded_only_when_asked(task, tmp_path):
    def compare(root, **options):
        return run_comparison(
            ImagePipeline(task, tiny_config(), root / "stages", **options),
            dataset="digits",
            metric="test AUC",
            higher_is_better=True,
            methods=["dp_mixmin"],
            epsilons=[1.0],
            seeds=[0],
            out_dir=root,
            progress=False,
        )

    secret = [compare(tmp_path / name) for name in ("a", "b")]
    assert not secret[0]["noise_seeded"] and not secret[0]["runs"][0]["noise_seeded"]
    assert secret[0]["runs"][0]["weights"] != secret[1]["runs"][0]["weights"]

    def seed0(name):
        return next((tmp_path / name / "stages").glob("*/seed0"))

    splits = [json.loads((seed0(n) / "split.json").read_text()) for n in "ab"]
    assert splits[0]["mix"] != splits[1]["mix"]  # the split key is secret too
    secret_file = seed0("a") / "secret_randomness.json"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    hidden = json.loads(secret_file.read_text())["secret"]
    written = [p for p in (tmp_path / "a").rglob("*") if p.is_file() and p != secret_file]
    assert not any(hidden in p.read_text(errors="ignore") for p in written)
    assert "private randomness secret" in (tmp_path / "a/results.md").read_text().lower()

    seeded = [compare(tmp_path / name, reproducible=True) for name in ("c", "d")]
    assert seeded[0]["noise_seeded"] and seeded[0]["runs"][0]["noise_seeded"]
    assert seeded[0]["runs"][0]["weights"] == seeded[1]["runs"][0]["weights"]
    assert seeded[0]["runs"][0]["utility"] == seeded[1]["runs"][0]["utility"]
    assert not (seed0("c") / "secret_randomness.json").exists()
    assert SEEDED_NOTE in (tmp_path / "c/results.md").read_text()


def test_stored_stages_are_keyed_by_everything_that_determines_them(task, tmp_path):
    def run(config, epsilon):
        computed = []
        pipeline = ImagePipeline(task, config, tmp_path, on_stage=computed.append)
        return pipeline.run("random_init", epsilon, seed=0), computed

    first, computed = run(tiny_config(), 1.0)
    assert "finetune" in computed
    assert run(tiny_config(), 1.0) == (first, [])  # the same settings read back, nothing runs
    # Another δ, a nearby ε, another stage setting: each computes afresh, none returns `first`.
    other_delta, computed = run(tiny_config(delta=1e-6), 1.0)
    assert "finetune" in computed and other_delta.delta == 1e-6
    near, computed = run(tiny_config(), 1.0000004)
    assert computed == ["finetune"] and near.epsilon == 1.0000004  # same settings folder
    finetune = dataclasses.replace(tiny_config().finetune, steps=5)
    _, computed = run(tiny_config(finetune=finetune), 1.0)
    assert "finetune" in computed
    folders = {p.parent for p in tmp_path.glob("*/settings.json")}
    assert len(folders) == 3  # one per distinct setting, each described by its settings.json
    assert run(tiny_config(), 1.0) == (first, [])  # the first settings are still there


def test_one_output_folder_holds_one_data_set(task, tmp_path):
    def compare(dataset):
        return run_comparison(
            ImagePipeline(task, tiny_config(), tmp_path / "stages"),
            dataset=dataset,
            metric="test AUC",
            higher_is_better=True,
            methods=["random_init"],
            epsilons=[1.0],
            seeds=[0],
            out_dir=tmp_path,
            progress=False,
        )

    compare("digits")
    with pytest.raises(ValueError, match="holds the results of 'digits'"):
        compare("other digits")
    assert json.loads((tmp_path / "results.json").read_text())["dataset"] == "digits"


def test_a_delta_of_one_over_a_stages_units_is_refused_before_any_training(task, tmp_path):
    pipeline = ImagePipeline(task, tiny_config(delta=0.05), tmp_path / "refused")
    with pytest.raises(ValueError, match=r"delta = 0.05 >= 1/n = .* units in D_mix"):
        pipeline.run("uniform", 1.0, seed=0)
    assert not [p for p in (tmp_path / "refused").rglob("*") if "proxy" in p.name]
    config = tiny_config(delta=0.05, allow_large_delta=True)
    allowed = ImagePipeline(task, config, tmp_path / "allowed").run("random_init", 1.0, seed=0)
    assert allowed.allow_large_delta and allowed.to_json()["allow_large_delta"] is True
    assert RunResult.from_json(allowed.to_json()) == allowed
