"""The text DP-MixMin pipeline end to end on a tiny preset: stages, user-disjoint splits, budgets,
resume, baselines, and the paper presets' input checks."""

import dataclasses
import json

import jax
import numpy as np
import pytest
import scipy.special

from dpmix_jax.data.text import UserDocuments
from dpmix_jax.data.tokenizer import train_bpe_tokenizer
from dpmix_jax.models.gpt2 import GPT2Config
from dpmix_jax.pipeline.splits import derived_seed, dirichlet_candidates
from dpmix_jax.pipeline.stage_store import weights_key
from dpmix_jax.pipeline.text import (
    DomainTextTask,
    LanguageModelSpec,
    TextPipeline,
    TextPipelineConfig,
)
from dpmix_jax.pipeline.text_presets import text_demo_config, text_task
from dpmix_jax.privacy import accounting, plan
from dpmix_jax.train import TrainConfig
from experiments import enron as enron_experiment
from experiments.configs import enron as enron_configs
from experiments.configs import openwebmath as owm_configs

TINY = LanguageModelSpec(config=GPT2Config.tiny(n_layer=1, n_embd=32, n_head=2, n_positions=32))


def tiny_config(level="user", **overrides) -> TextPipelineConfig:
    quiet = {"progress": False, "log_every": None}
    base = text_demo_config(level=level)
    settings = dict(
        vocab_size=300,
        proxy_model=TINY,
        model=TINY,
        proxy=TrainConfig(steps=12, batch_size=8, learning_rate=3e-3, **quiet),
        shared_proxies=False,
        # About 14 train users: expected batches well below D_mix's and D_ft's units (q < 1).
        mixture=dataclasses.replace(base.mixture, steps=20, batch_size=2 if level == "user" else 4),
        pretrain=TrainConfig(steps=12, batch_size=8, learning_rate=3e-3, **quiet),
        finetune=dataclasses.replace(base.finetune, steps=3, batch_size=4),
        finetune_last_blocks=0,
        random_search_candidates=2,
    )
    settings.update(overrides)
    return dataclasses.replace(base, **settings)


def three_domains(task: DomainTextTask) -> DomainTextTask:
    """The same sensitive users against 3 of the public domains (fewer proxies to train)."""
    kept = {name: task.public_domains[name] for name in task.source_names[-3:]}
    return dataclasses.replace(task, public_domains=kept, true_weights=None)


@pytest.fixture(scope="module")
def task():
    return three_domains(text_task(num_users=24, documents_per_user=(2, 4), max_chars=400))


@pytest.fixture(scope="module")
def finished(task, tmp_path_factory):
    """A dp_mixmin run at ε = 1 (parallel composition), with the stages it computed."""
    root = tmp_path_factory.mktemp("text_pipeline")
    computed = []
    # Seeded, so that the split (a keyed hash of the users) is the same on every test run.
    pipeline = TextPipeline(task, tiny_config(), root, on_stage=computed.append, reproducible=True)
    result = pipeline.run("dp_mixmin", 1.0, 0)
    return pipeline, result, computed


def _user_names(documents: UserDocuments, positions) -> set[str]:
    return {documents.users[documents.user_ids[p]] for p in positions}


def test_stages_are_stored_and_the_split_is_user_disjoint(task, finished):
    pipeline, result, computed = finished
    seed_dir = pipeline.stage_folder(0)
    assert (seed_dir.parent / "tokenizer.json").is_file()
    for name in ("split", "proxy_outputs_parallel", "mixture_parallel_eps1.0"):
        assert (seed_dir / f"{name}.json").is_file(), name
    assert (seed_dir / "run_dp_mixmin_parallel_eps1.0.json").is_file()
    assert sorted(p.name for p in seed_dir.glob("proxy_*") if p.is_dir()) == [
        f"proxy_{i}" for i in range(task.k)
    ]
    assert len(list(seed_dir.glob("pretrain_*/"))) == 1
    assert len(list(seed_dir.glob("finetune_*_ft_parallel_eps1.0"))) == 1
    assert computed.count("proxy") == task.k
    assert {"tokenizer", "split", "proxy_outputs", "mixture", "finetune"} <= set(computed)

    mix, ft = pipeline.split(0)
    assert len(mix) and len(ft)
    assert sorted(np.concatenate([mix, ft]).tolist()) == list(range(len(task.train)))
    assert not _user_names(task.train, mix) & _user_names(task.train, ft)
    # The held-out users are none of the training users.
    train_users = _user_names(task.train, range(len(task.train)))
    assert not train_users & _user_names(task.test, range(len(task.test)))

    weights = np.asarray(result.weights)
    assert weights.shape == (task.k,) and abs(weights.sum() - 1) < 1e-4 and weights.min() >= 0
    assert np.isfinite(result.utility) and 1 < result.utility < pipeline.tokenizer.vocab_size


def test_tokenizer_is_trained_on_public_text_only(task, finished):
    pipeline, _, _ = finished
    public = [doc for docs in task.public_domains.values() for doc in docs]
    reference = train_bpe_tokenizer(public, vocab_size=300)
    for text in task.train.texts[:20]:
        assert pipeline.tokenizer.encode(text) == reference.encode(text)


def test_proxy_outputs_against_direct_log_probabilities(task, finished):
    pipeline, _, _ = finished
    log_probs, counts = pipeline.proxy_outputs(0)
    mix, _ = pipeline.split(0)
    assert log_probs.shape == (len(mix), task.k)
    seq_len = TINY.seq_len
    expected = [min(len(pipeline.tokenizer.encode(task.train.texts[j])), seq_len - 1) for j in mix]
    np.testing.assert_array_equal(counts, expected)
    proxies = pipeline.proxies(0)
    eos = pipeline.tokenizer.eos_id
    for row in (0, len(mix) - 1):
        ids = [eos, *pipeline.tokenizer.encode(task.train.texts[mix[row]])[: seq_len - 1]]
        for i in (0, task.k - 1):
            logits = np.asarray(proxies[i](jax.numpy.asarray([ids]))[0], np.float64)
            direct = scipy.special.log_softmax(logits, axis=-1)
            total = sum(direct[t - 1, ids[t]] for t in range(1, len(ids)))
            assert log_probs[row, i] == pytest.approx(total, rel=1e-4)


def test_parallel_budget_is_the_max_of_the_stage_accountants(task, finished):
    pipeline, result, _ = finished
    config = pipeline.config
    stored = json.loads((pipeline.stage_folder(0) / "mixture_parallel_eps1.0.json").read_text())
    mix, ft = pipeline.split(0)
    assert stored["num_units"] == len(_user_names(task.train, mix))  # user-level sampling
    mix_eps = accounting.epsilon(
        accounting.dpsgd_event(
            noise_multiplier=stored["noise_multiplier"],
            sampling_rate=stored["sampling_rate"],
            steps=config.mixture.steps,
        ),
        delta=config.delta,
    )
    ft_config = dataclasses.replace(config.finetune, epsilon=1.0, delta=config.delta)
    ft_plan = plan.plan_dp_sgd(
        ft_config.dp_sgd_config(), num_units=len(_user_names(task.train, ft))
    )
    ft_eps = ft_plan.spent().epsilon
    assert result.stages["mixture"].epsilon == pytest.approx(mix_eps, rel=1e-6)
    assert result.stages["finetune"].epsilon == pytest.approx(ft_eps, rel=1e-6)
    assert result.spent.epsilon == pytest.approx(max(mix_eps, ft_eps), rel=1e-9)
    assert result.spent.epsilon <= 1.0 + 1e-6 and result.composition == "parallel"
    assert result.private


def test_resume_recomputes_nothing_and_reports_the_same_budget(task, finished):
    pipeline, result, _ = finished
    (pipeline.stage_folder(0) / "run_dp_mixmin_parallel_eps1.0.json").unlink()
    computed = []
    again = TextPipeline(
        task, pipeline.config, pipeline.root, on_stage=computed.append, reproducible=True
    )
    resumed = again.run("dp_mixmin", 1.0, 0)
    assert computed == []
    assert resumed.spent == result.spent and dict(resumed.stages) == dict(result.stages)
    assert resumed.utility == pytest.approx(result.utility, rel=1e-6)
    assert resumed.weights == result.weights


def test_sequential_composition_composes_the_stage_events(task, finished):
    pipeline, _, _ = finished
    config = dataclasses.replace(pipeline.config, composition="sequential")
    computed = []
    sequential = TextPipeline(
        task, config, pipeline.root, on_stage=computed.append, reproducible=True
    )
    result = sequential.run("dp_mixmin", 2.0, 0)
    assert "proxy" not in computed  # the proxies are reused
    mix, ft = sequential.split(0)
    assert len(mix) == len(ft) == len(task.train)
    mixture, finetune = result.stages["mixture"].epsilon, result.stages["finetune"].epsilon
    assert mixture <= 0.2 + 1e-6  # share 0.1 of ε = 2
    assert finetune <= 1.8 + 1e-6
    # The accountant's ε of both stages' events composed: above either, below their sum.
    assert max(mixture, finetune) < result.spent.epsilon < mixture + finetune
    assert result.spent.delta == config.delta and result.composition == "sequential"


def test_baselines_share_stages_and_random_search_composes_sequentially(task, finished):
    pipeline, _, _ = finished
    uniform = pipeline.run("uniform", 1.0, 0)
    assert uniform.weights == pytest.approx([1 / task.k] * task.k)
    assert set(uniform.stages) == {"finetune"} and uniform.private
    search = pipeline.run("random_search", 1.0, 0)
    candidates = dirichlet_candidates(task.k, 2, seed=derived_seed(0, "candidates"))
    assert any(np.allclose(search.weights, c) for c in candidates)
    scores = search.extra["validation_utilities"]
    assert search.extra["selected_validation_utility"] == min(scores)  # perplexity: lower wins
    single = pipeline.finetune(
        pipeline.pretrained(candidates[0], 0), weights_key(candidates[0]), "ft", 1.0, 0
    )[1]
    # Two fine-tunings on the same D_ft, composed by the accountant: more than one, less than
    # the sum of their budgets, at δ itself.
    assert single.epsilon < search.spent.epsilon < 2 * single.epsilon
    assert search.spent.delta == single.delta
    assert not search.private
    reference = pipeline.run("nonprivate_mixmin", 1.0, 0)
    assert not reference.private and set(reference.stages) == {"finetune"}
    random_init = pipeline.run("random_init", 1.0, 0)
    assert random_init.weights is None
    # No pretraining is worse than pretraining on public text.
    assert random_init.utility > min(uniform.utility, reference.utility)


def test_example_level_mixture_samples_documents(tmp_path):
    task = three_domains(
        text_task(level="example", num_users=16, documents_per_user=(2, 3), max_chars=300)
    )
    assert len(task.train.users) == len(task.train) + len(task.val) + len(task.test)
    pipeline = TextPipeline(task, tiny_config(level="example"), tmp_path, reproducible=True)
    weights, budget = pipeline.mixture(1.0, 0)
    stored = json.loads((pipeline.stage_folder(0) / "mixture_parallel_eps1.0.json").read_text())
    mix, _ = pipeline.split(0)
    assert stored["num_units"] == len(mix)
    assert budget.epsilon <= 1.0 + 1e-6 and abs(np.sum(weights) - 1) < 1e-4


def test_the_demo_default_puts_enough_users_in_the_mixture_stage(tmp_path):
    """The text demo is sized for about 36 users in D_mix (200 users x 0.6 train x ρ = 0.3); with
    fewer than 30 its λ is noise-limited and the seed spread hides DP-MixMin's gain."""
    task = text_task()
    assert len(task.train.users) == 200
    pipeline = TextPipeline(task, text_demo_config(), tmp_path, reproducible=True)
    for seed in (0, 1, 2):
        mix, ft = pipeline.split(seed)
        mix_users = np.unique(task.train.user_ids[mix])
        assert len(mix_users) >= 30, f"seed {seed}: only {len(mix_users)} users in D_mix"
        assert not set(mix_users) & set(task.train.user_ids[ft])
        assert pipeline.config.mixture.batch_size < len(mix_users) / 4


def test_invalid_settings_and_tasks_are_rejected(task):
    with pytest.raises(ValueError, match="finetune.level"):
        tiny_config(level="user", finetune=text_demo_config(level="example").finetune)
    with pytest.raises(ValueError, match="max_examples_per_user"):
        tiny_config(level="example", mixture=text_demo_config(level="user").mixture)
    with pytest.raises(ValueError, match="finetune_last_blocks"):
        tiny_config(finetune_last_blocks=5)
    with pytest.raises(ValueError, match="user-disjoint"):
        DomainTextTask(
            name="overlap",
            public_domains=task.public_domains,
            train=task.train,
            val=task.train,
            test=task.test,
        )
    with pytest.raises(ValueError, match="GPT-2 weights"):
        LanguageModelSpec(config=TINY.config, weights="/nonexistent/gpt2").build(300, seed=0)


@pytest.mark.parametrize("configs", [enron_configs, owm_configs])
def test_paper_presets_build_and_name_missing_inputs(configs, tmp_path):
    config = configs.get_config("paper", data_root=tmp_path / "data", weights_root=tmp_path / "w")
    assert config.pipeline.tokenizer == "gpt2" and config.pipeline.mixture.steps == 200
    assert config.pipeline.mixture.learning_rate == 5.0
    with pytest.raises(ValueError, match="missing input paths") as err:
        enron_experiment.main(config, tmp_path / "out")
    assert str(tmp_path / "data" / "common_pile") in str(err.value)
    assert str(tmp_path / "w" / "gpt2") in str(err.value)
    assert not (tmp_path / "out").exists()
    argv = ["--preset", "paper", "--out", str(tmp_path / "o"), "--data-root", str(tmp_path)]
    with pytest.raises(ValueError, match="missing input paths"):
        enron_experiment.cli(configs, argv)


def test_stored_stages_are_keyed_by_the_documents_and_their_authors(task, tmp_path):
    def folder(data):
        return TextPipeline(data, tiny_config(), tmp_path).settings_folder()

    train = task.train
    edited = UserDocuments(
        texts=(train.texts[0] + ".", *train.texts[1:]), user_ids=train.user_ids, users=train.users
    )
    regrouped = UserDocuments(
        texts=train.texts, user_ids=np.roll(train.user_ids, 1), users=train.users
    )
    domain = task.source_names[0]
    public = {**task.public_domains, domain: [*task.public_domains[domain][1:], "x"]}
    variants = [
        dataclasses.replace(task, train=edited),
        dataclasses.replace(task, train=regrouped),
        dataclasses.replace(task, public_domains=public),
    ]
    original = folder(task)
    assert folder(dataclasses.replace(task)) == original
    assert len({original, *map(folder, variants)}) == 4
