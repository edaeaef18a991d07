"""The ablations experiment: the ρ study's mixture batch keeps the Poisson rate and fits D_mix,
the command end to end on the tiny preset, and docs/ablations.md against its stored results."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import numpy as np
import pytest

from dpmix_jax import cli
from dpmix_jax.mixing import dp_mixmin
from dpmix_jax.pipeline import ImagePipeline, presets, report
from experiments.configs.ablations import AblationConfig, get_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
VIEWS = ("ablation_rho", "ablation_proxy", "ablation_composition")


def test_rho_study_keeps_the_base_rate_and_every_batch_fits_its_mixture_split(tmp_path):
    config = get_config("cpu")
    base, task = config.pipeline, presets.digit_task()
    rho_rows = [s for s in config.settings() if s.study == "rho"]
    assert [s.pipeline.mix_fraction for s in rho_rows] == list(config.mix_fractions)
    base_rate = base.mixture.batch_size / base.mix_fraction
    for setting in rho_rows:
        mixture = setting.pipeline.mixture
        assert mixture.batch_size / setting.pipeline.mix_fraction == pytest.approx(base_rate)
        assert dataclasses.replace(mixture, batch_size=base.mixture.batch_size) == base.mixture
        pipeline = ImagePipeline(task, setting.pipeline, tmp_path, reproducible=True)
        for seed in config.seeds:
            assert len(pipeline.split(seed)[0]) > 2 * mixture.batch_size
    # At ρ_0 the setting is the base pipeline itself (one run shared with the other studies).
    assert rho_rows[-1].pipeline == base
    # The base batch on the smallest split is what the Poisson-rate check refuses.
    smallest = ImagePipeline(task, rho_rows[0].pipeline, tmp_path, reproducible=True)
    rows = len(smallest.split(0)[0])
    assert rows <= base.mixture.batch_size
    with pytest.raises(ValueError, match="Poisson rate would be 1"):
        dp_mixmin(
            np.full((rows, 3), 0.5),
            epsilon=1.0,
            delta=1e-5,
            steps=2,
            batch_size=base.mixture.batch_size,
            clip_norm=1.0,
            learning_rate=0.1,
            seed=0,
        )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"data": "mimic"}, "data"),
        ({"mix_fractions": (0.1, 1.0)}, "mix_fractions"),
        ({"proxy_steps": (0,)}, "proxy_steps"),
        ({"seeds": ()}, "seeds"),
        ({"epsilon": -1.0}, "epsilon"),
    ],
)
def test_config_refuses_bad_settings(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(get_config("tiny"), **change)
    with pytest.raises(ValueError, match="preset"):
        get_config("gpu")
    assert isinstance(get_config("paper"), AblationConfig)


@pytest.mark.slow
def test_tiny_command_runs_every_study_end_to_end(tmp_path):
    out = tmp_path / "run"
    argv = ["run", "ablations", "--preset", "tiny", "--reproducible", "--out", str(out)]
    assert cli.main(argv) == 0
    stored = json.loads((out / "ablations.json").read_text())
    config = get_config("tiny")
    labels = [s.label for s in config.settings()]
    assert [s["setting"] for s in stored["settings"]] == labels
    assert len(stored["runs"]) == len(labels) * len(config.seeds)
    assert stored["noise_seeded"] is True and "--preset tiny" in stored["provenance"]["command"]
    runs = {r["setting"]: r for r in stored["runs"]}
    for run in stored["runs"]:
        assert run["noise_seeded"] and run["spent_epsilon"] <= 1.0
        stages = run["stage_epsilons"]
        if run["composition"] == "sequential":
            # Both stages on all of D, calibrated to ε_mix + ε_ft = ε; the accountant's ε of the
            # two composed lies between the larger stage and the sum.
            assert stages["mixture"] == pytest.approx(0.1, rel=1e-3)
            total = stages["mixture"] + stages["finetune"]
            assert max(stages.values()) < run["spent_epsilon"] <= total * (1 + 1e-9)
        else:  # disjoint D_mix and D_ft: the max
            assert 0.99 < run["spent_epsilon"] == max(stages.values())
    # ρ = ρ_0, the base proxy budget and parallel composition are one setting: read back twice.
    assert stored["reused_runs"] == 2
    for label in ("3 proxy steps", "parallel"):
        assert runs[label]["utility"] == runs["ρ = 0.3"]["utility"]
    assert runs["ρ = 0.1"]["mixture_examples"] < runs["ρ = 0.3"]["mixture_examples"]
    batches = {s["setting"]: s["mixture_batch_size"] for s in stored["settings"]}
    assert batches["ρ = 0.1"] == pytest.approx(40) and batches["ρ = 0.3"] == 120
    tables = "\n".join(report.render(view, stored, "ablations.json") for view in VIEWS)
    assert (out / "ablations.md").read_text() == tables
    assert f"| ρ = 0.1 | {runs['ρ = 0.1']['mixture_examples']:.1f} | 40 |" in tables


def test_docs_page_tables_match_the_stored_results():
    page = ROOT / "docs" / "ablations.md"
    assert page in report.documents(ROOT)
    markers = report.MARKER.finditer(page.read_text())
    views = [m["view"] for m in markers if m["name"] == "ablations"]
    assert views == list(VIEWS)
    assert report.check_markdown(page, ROOT / "docs" / "results") == []
    stored = json.loads((ROOT / "docs" / "results" / "ablations.json").read_text())
    assert stored["noise_seeded"] is True and "--preset cpu" in stored["provenance"]["command"]
    assert "+modified" not in stored["provenance"]["commit"]


def test_report_check_covers_the_docs_page(tmp_path, monkeypatch, capsys):
    for name in ("README.md", "docs/ablations.md", "docs/results"):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copyfile
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        copy(ROOT / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", "--check"]) == 0
    page = tmp_path / "docs" / "ablations.md"
    text = page.read_text()
    stored = json.loads((tmp_path / "docs/results/ablations.json").read_text())
    parallel = [r["utility"] for r in stored["runs"] if r["setting"] == "parallel"]
    row = f"| parallel | 1.000 | 1.000 | {np.mean(parallel):.4f} ± {np.std(parallel):.4f} |"
    assert text.count(row) == 1
    page.write_text(text.replace(row, "| parallel | 1.000 | 1.000 | 0.5000 ± 0.0000 |"))
    assert cli.main(["report", "--check"]) == 1
    assert "docs/ablations.md: table ablations (ablation_composition)" in capsys.readouterr().err
    assert cli.main(["report"]) == 0
    assert page.read_text() == text


def test_ablation_views_refuse_another_results_file():
    other = json.loads((ROOT / "docs" / "results" / "demo-image.json").read_text())
    with pytest.raises(ValueError, match=r"demo-image\.json has no 'settings'"):
        report.render("ablation_proxy", other, "docs/results/demo-image.json")
