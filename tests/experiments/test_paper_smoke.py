"""The paper presets' `--smoke` modes end to end, on small folders in the real data layouts.

`paper_fixtures` writes NIH ChestX-ray14, CheXpert, MIMIC-CXR-JPG, an Enron maildir, Common Pile
domain folders and OpenWebMath parquet shards as the real downloads lay them out; the fast tests
check that the paper presets' loaders read them and that `--smoke` keeps the paper's settings,
the slow ones run each preset's smoke mode through to its results table.

The chest X-ray presets run exactly as `--preset paper --smoke` (ResNet-50 proxy, ResNet-18
downstream, 224x224, k = 14, all five methods). The text presets run their smoke config with one
labelled change, `ci_scale`: GPT-2 small (proxies) and medium (downstream) are replaced by 2-layer,
64-wide GPT-2s (the paper's GPT-2 tokenizer and vocabulary, 1024-token rows, k = 16 domains,
G, ρ, methods and every stage unchanged). One step of GPT-2 small at 1024 tokens is about 0.75
TFLOP, and the smoke mode trains 16 proxies, scores D_mix under each and pretrains and
fine-tunes GPT-2 medium for every method: tens of TFLOP, far past a CI budget on 2 CPU cores.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.data import cxr
from dpmix_jax.data.text import iter_documents, load_domains, load_enron
from dpmix_jax.models.gpt2 import GPT2Config
from dpmix_jax.models.resnet import ResNet, ResNetConfig
from dpmix_jax.pipeline.compare import METHOD_NAMES
from dpmix_jax.pipeline.compilation_cache import use_compilation_cache
from experiments import cxr as cxr_experiment
from experiments import enron
from experiments.configs import enron as enron_configs
from experiments.configs import nih as nih_configs
from experiments.configs import openwebmath as openwebmath_configs
from tests import paper_fixtures as fixtures

METHODS = ("dp_mixmin", "uniform", "random_init", "random_search", "nonprivate_mixmin")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> pathlib.Path:
    """Every data set of the paper presets, in its published layout, under one folder."""
    root = tmp_path_factory.mktemp("paper_data")
    fixtures.write_nih(root / "nih")
    fixtures.write_chexpert(root / "chexpert")
    fixtures.write_mimic(root / "mimic")
    fixtures.write_enron(root / "enron")
    fixtures.write_common_pile(root / "common_pile")
    fixtures.write_openwebmath(root / "openwebmath")
    return root


# ------------------------------------------------------------------------------------------
# Fast: the layouts load, the smoke configs keep the paper's settings
# ------------------------------------------------------------------------------------------


def test_nih_layout_loads_with_official_splits(data):
    splits = cxr.nih_official_splits(data / "nih", image_size=(224, 224))
    test_names = set((data / "nih" / "test_list.txt").read_text().split())
    assert {p.name for p in splits["test"].paths} == test_names
    train_val = {*splits["train"].paths, *splits["val"].paths}
    assert len(train_val) == 56 and not train_val & set(splits["test"].paths)
    assert not set(splits["train"].patient_ids) & set(splits["val"].patient_ids)
    effusion = cxr.NIH_LABELS.index("Effusion")
    for part in splits.values():  # both classes everywhere (AUC and random search need them)
        assert 0 < part.labels[:, effusion].sum() < len(part)
    first = splits["train"].image(0)  # the RGBA PNG is read as grayscale too
    assert first.shape == (224, 224, 1) and 0 <= first.min() <= first.max() <= 1


def test_chexpert_paths_resolve_in_a_renamed_folder(data):
    # The CSV's paths start with "CheXpert-v1.0-small/"; the folder is called "chexpert".
    frontal = cxr.load_chexpert(data / "chexpert", split="train", image_size=(224, 224))
    assert len(frontal) == 12 and set(frontal.views) == {"frontal"}
    assert frontal.paths[0] == data / "chexpert/train/patient00001/study1/view1_frontal.jpg"
    assert len(cxr.load_chexpert(data / "chexpert", split="valid", views="all")) == 4
    assert frontal.image(3).shape == (224, 224, 1)


def test_mimic_reads_the_published_gzip_csvs(data):
    train = cxr.load_mimic_cxr(data / "mimic", split="train", image_size=(224, 224))
    # 11 train subjects with one PA image each; the blank-ViewPosition images are counted.
    assert len(train) == 11 and set(train.views) == {"frontal"}
    assert train.skipped == {"other_view": 11}
    assert train.paths[0].parent.parent.parent.name == "p10"
    assert len(cxr.load_mimic_cxr(data / "mimic", split="validate", views="all")) == 2


def test_truncated_mimic_csv_gz_is_named(tmp_path):
    fixtures.write_mimic(tmp_path)
    labels = tmp_path / "mimic-cxr-2.0.0-chexpert.csv.gz"
    labels.write_bytes(labels.read_bytes()[:-20])
    with pytest.raises(ValueError, match="chexpert.csv.gz: not a complete gzip file"):
        cxr.load_mimic_cxr(tmp_path)


def test_text_layouts_load(data):
    mail = load_enron(data / "enron" / "maildir")
    assert len(mail.users) == 20 and len(mail) == 40
    assert mail.skipped == {"users_without_messages": 1}
    assert not any("Original Message" in t or "Forwarded by" in t for t in mail.texts)
    domains = load_domains(data / "common_pile", max_documents_per_domain=4)
    assert list(domains) == sorted(fixtures.COMMON_PILE_SOURCES)
    assert all(len(docs) == 4 for docs in domains.values())
    assert len(list(iter_documents(data / "openwebmath"))) == 60


def test_resnet_imagenet_stem_trains():
    # The 3x3 max-pool of the ImageNet stem must have a gradient (the paper's ResNets use it).
    config = ResNetConfig(stage_sizes=(1,), width=8, groups=4, in_channels=1)
    model = ResNet(config, 2, rngs=nnx.Rngs(0))
    images = jax.random.uniform(jax.random.key(0), (2, 16, 16, 1))

    def loss(model):
        return jnp.sum(model(images) ** 2)

    grads = jax.jit(nnx.grad(loss))(model)
    norms = [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grads)]
    assert all(np.isfinite(norms)) and max(norms) > 0


def test_smoke_configs_keep_the_paper_settings(tmp_path):
    for public in ("chexpert", "mimic"):
        paper = nih_configs.get_config(public, "paper")
        smoke = nih_configs.get_config(public, "paper", smoke=True)
        assert (smoke.public, smoke.image_size, smoke.methods) == (public, 224, METHODS)
        assert smoke.pipeline.model == paper.pipeline.model
        assert smoke.pipeline.proxy_model == paper.pipeline.proxy_model
        for field in ("delta", "mix_fraction", "composition"):
            assert getattr(smoke.pipeline, field) == getattr(paper.pipeline, field)
        assert smoke.pipeline.mixture.clip_norm == paper.pipeline.mixture.clip_norm
        assert smoke.pipeline.finetune.clip_norm == paper.pipeline.finetune.clip_norm
        assert smoke.pipeline.finetune.steps <= 2 and smoke.pipeline.proxy.steps <= 2
    for configs in (enron_configs, openwebmath_configs):
        paper = configs.get_config("paper", data_root=tmp_path, weights_root=tmp_path)
        smoke = configs.get_config(
            "paper", data_root=tmp_path, weights_root=tmp_path, smoke_test=True
        )
        assert smoke.methods == paper.methods and smoke.data == paper.data
        assert smoke.input_paths() == paper.input_paths()
        for field in ("model", "proxy_model", "tokenizer", "level", "finetune_last_blocks"):
            assert getattr(smoke.pipeline, field) == getattr(paper.pipeline, field)
        assert (
            smoke.pipeline.model.seq_len == 1024 and smoke.mix_fractions[0] in paper.mix_fractions
        )
        assert smoke.pipeline.finetune.steps <= 2 and smoke.pipeline.pretrain.steps <= 2


@pytest.mark.parametrize("module", ["nih_chexpert", "enron"])
def test_smoke_needs_the_paper_preset(module, capsys):
    runner = {
        "nih_chexpert": lambda argv: cxr_experiment.cli("chexpert", argv),
        "enron": lambda argv: enron.cli(enron_configs, argv),
    }[module]
    with pytest.raises(SystemExit):
        runner(["--preset", "cpu", "--smoke"])
    assert "--smoke applies to --preset paper" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# Slow: each paper preset's smoke mode through to its results table
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compilation_cache(tmp_path_factory):
    """One persistent XLA cache for the module: both X-ray presets compile the same steps."""
    use_compilation_cache(tmp_path_factory.mktemp("xla_cache"))


def _check_runs(results: dict, methods: tuple[str, ...], candidates: int) -> None:
    """Every method ran once at ε = 1, within its budget as the accountant reports it (random
    search fine-tunes each of its candidates on D_ft: their composition, at most the sum)."""
    runs = results["runs"]
    assert sorted(r["method"] for r in runs) == sorted(methods)
    for run in runs:
        assert run["epsilon"] == 1.0 and np.isfinite(run["utility"])
        budget = candidates if run["method"] == "random_search" else 1.0
        assert 0 < run["spent_epsilon"] <= budget * (1 + 1e-6)
        if run["method"] != "random_init":
            weights = np.asarray(run["weights"])
            assert weights.min() >= 0 and abs(weights.sum() - 1) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("public", ["chexpert", "mimic"])
def test_nih_smoke_writes_the_macro_table(public, data, tmp_path, compilation_cache):
    out = tmp_path / "out"
    argv = ["--preset", "paper", "--smoke", "--reproducible", "--out", str(out)]
    argv += ["--nih-root", str(data / "nih"), "--public-root", str(data / public)]
    macro = cxr_experiment.cli(public, argv)
    assert sorted(macro) == sorted(f"{m} eps=1" for m in METHODS)
    assert all(0 <= row["macro_auc"] <= 1 and row["tasks"] == 1 for row in macro.values())
    table = (out / "results.md").read_text()
    assert all(f"| {METHOD_NAMES[m]} | " in table for m in METHODS)
    results = json.loads((out / "task0" / "results.json").read_text())
    _check_runs(results, METHODS, candidates=2)
    dp_mixmin = next(r for r in results["runs"] if r["method"] == "dp_mixmin")
    assert len(dp_mixmin["weights"]) == 14  # λ over CheXpert's / MIMIC's 14 observations


def ci_scale(config: enron_configs.TextExperimentConfig, weights: pathlib.Path):
    """The smoke config with 2-layer, 64-wide GPT-2s for GPT-2 small and medium (CI compute
    only; see the module docstring). Everything else, the 1024-token rows included, is kept."""
    pipeline = config.pipeline
    small = GPT2Config.tiny(vocab_size=50257, n_positions=pipeline.proxy_model.seq_len)
    downstream = GPT2Config.tiny(vocab_size=50257, n_positions=pipeline.model.seq_len)
    if not (weights / "config.json").exists():
        fixtures.write_gpt2_weights(weights, small)
    return dataclasses.replace(
        config,
        pipeline=dataclasses.replace(
            pipeline,
            proxy_model=dataclasses.replace(pipeline.proxy_model, config=small),
            model=dataclasses.replace(pipeline.model, config=downstream),
        ),
    )


@pytest.mark.slow
@pytest.mark.parametrize("configs", [enron_configs, openwebmath_configs], ids=lambda m: m.__name__)
def test_text_smoke_writes_the_results_table(configs, data, tmp_path, compilation_cache):
    weights_root = tmp_path / "weights"
    smoke = configs.get_config("paper", data_root=data, weights_root=weights_root, smoke_test=True)
    config = ci_scale(smoke, weights_root / "gpt2")
    out = tmp_path / "out"
    results = enron.main(config, out, reproducible=True)
    (rho,) = smoke.mix_fractions
    assert list(results) == [rho]
    _check_runs(results[rho], smoke.methods, candidates=2)
    dp_mixmin = next(r for r in results[rho]["runs"] if r["method"] == "dp_mixmin")
    assert len(dp_mixmin["weights"]) == 16  # one coordinate per Common Pile domain folder
    table = (out / "results.md").read_text()
    assert table.endswith((out / f"rho{rho:g}" / "results.md").read_text())
    assert table.startswith("Test perplexity against ρ")
    summary = json.loads((out / "results.json").read_text())
    assert summary["per_rho"][f"{rho:g}"] == json.loads(
        (out / f"rho{rho:g}" / "results.json").read_text()
    )
    assert all(f"| {METHOD_NAMES[m]}" in table for m in smoke.methods)
    summary["provenance"]["command"] = "the computing run"
    (out / "results.json").write_text(json.dumps(summary))
    enron.main(config, out, reproducible=True)  # every stage read back: the origin stays
    assert json.loads((out / "results.json").read_text())["provenance"]["command"] == (
        "the computing run"
    )
