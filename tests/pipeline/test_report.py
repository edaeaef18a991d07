"""Comparison outputs: tables and plots that mark reference methods, progress, generated tables."""

from __future__ import annotations

import json
import pathlib

import matplotlib
import numpy as np
import pytest

from dpmix_jax.pipeline import compare, report
from dpmix_jax.pipeline.results import METHOD_NOTES, METHODS, RunResult
from dpmix_jax.privacy import accounting

matplotlib.use("Agg")


def fake_results(seeds=(0, 1, 2), epsilons=(1.0, 2.0, 5.0)) -> dict:
    """A results.json of the documented shape with known numbers (no training)."""
    rng = np.random.default_rng(0)
    k, runs = 4, []
    for seed in seeds:
        for eps in epsilons:
            for method in METHODS:
                spent = 4 * eps if method == "random_search" else eps
                runs.append(
                    {
                        "method": method,
                        "epsilon": eps,
                        "delta": 1e-5,
                        "seed": seed,
                        "utility": 0.5 + 0.01 * seed + 0.1 * METHODS.index(method) / 5,
                        "weights": None
                        if method == "random_init"
                        else rng.dirichlet(np.ones(k)).tolist(),
                        "spent_epsilon": spent,
                        "spent_delta": 1e-5,
                        "stage_epsilons": {"finetune": spent},
                        "composition": "parallel",
                        "private": method not in ("random_search", "nonprivate_mixmin"),
                        "extra": {},
                    }
                )
    results = {
        "dataset": "toy",
        "metric": "test AUC",
        "higher_is_better": True,
        "runs": runs,
        "true_weights": [0.4, 0.3, 0.2, 0.1],
        "methods": dict(METHOD_NOTES),
        "source_names": ["a", "b", "c", "d"],
        "seconds": 12.0,
        "reused_runs": 0,
        "provenance": {"command": "dpmix demo", "date": "2026-01-01", "commit": "abc1234"},
    }
    compare._add_weight_quality(results, "nonprivate_mixmin")
    return results


def test_tables_name_reference_methods_and_explain_the_error_bars():
    results = fake_results()
    text = compare.markdown_table(results)
    assert "mean ± std over 3 seeds" in text
    assert "| Random Search (non-private selection, spends 4ε) |" in text
    assert "| non-private MixMin (λ not private, only its fine-tuning is DP) |" in text
    assert "| DP-MixMin | 0.5100 ± 0.0082 |" in text  # utilities 0.50, 0.51, 0.52
    assert "`dpmix demo`" in text and "abc1234" in text and "2026-01-01" in text


def test_plots_mark_reference_methods_and_explain_error_bars(monkeypatch, tmp_path):
    from matplotlib.figure import Figure

    figures = []
    save = Figure.savefig

    def keep(self, path, **kwargs):
        figures.append((pathlib.Path(path).name, self))
        save(self, path, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    compare.plot_results(fake_results(), tmp_path)
    (_, utility), (_, weights) = figures
    ax = utility.axes[0]
    assert "mean ± std over 3 seeds" in ax.get_title()
    legend = ax.get_legend()
    # Below the axes, so that it hides no point.
    assert legend.get_window_extent().y1 <= ax.get_window_extent().y0
    styles = {bars.get_label(): bars.lines[0] for bars in ax.containers}
    search = styles["Random Search (non-private selection, spends 4ε)"]
    assert search.get_linestyle() == "--" and search.get_markerfacecolor() == "none"
    dp = styles["DP-MixMin"]
    assert dp.get_linestyle() == "-" and dp.get_markerfacecolor() != "none"
    title = weights.axes[0].get_title()
    assert "mixture weights" in title and "± std over seeds" in title
    assert (tmp_path / "utility_vs_epsilon.png").stat().st_size > 0


class _FakePipeline:
    """Reports a computed stage with steps for new runs and `reused` for stored ones."""

    def __init__(self, root, stored):
        self.root, self.stored, self.listeners = pathlib.Path(root), set(stored), []

    def add_listener(self, listener):
        self.listeners.append(listener)

    def remove_listener(self, listener):
        self.listeners.remove(listener)

    def run(self, method, epsilon, seed):
        for listener in self.listeners:
            if (method, seed) in self.stored:
                listener.reused(f"run_{method}")
            else:
                listener.stage("finetune")
                listener.step(1, 2)
                listener.step(2, 2)
        return RunResult(
            method=method,
            epsilon=epsilon,
            delta=1e-5,
            seed=seed,
            utility=0.5,
            weights=None,
            spent=accounting.PrivacyBudget(epsilon, 1e-5),
            stages={},
            composition="parallel",
            private=True,
            seeded=False,
        )


def test_a_resumed_comparison_says_what_it_reused(tmp_path, capsys):
    fake = _FakePipeline(tmp_path / "stages", stored={("uniform", 0), ("random_init", 0)})
    results = compare.run_comparison(
        fake,
        dataset="toy",
        metric="test AUC",
        higher_is_better=True,
        methods=["uniform", "random_init"],
        epsilons=[1.0],
        seeds=[0, 1],
        out_dir=tmp_path,
        progress=False,
    )
    message = f"reused 2 finished runs (read back from the stage store {tmp_path / 'stages'})"
    assert message in capsys.readouterr().out
    assert results["reused_runs"] == 2 and fake.listeners == []
    assert {"command", "date", "commit", "version"} <= set(results["provenance"])
    text = (tmp_path / "results.md").read_text()
    assert "2 runs in" in text and "2 runs read back from stored stages of unrecorded" in text


def _compare(fake, out_dir, monkeypatch, command, seeds=(0, 1)):
    monkeypatch.setattr(compare, "provenance", lambda: {"command": command, "commit": command})
    return compare.run_comparison(
        fake,
        dataset="toy",
        metric="test AUC",
        higher_is_better=True,
        methods=["uniform", "random_init"],
        epsilons=[1.0],
        seeds=list(seeds),
        out_dir=out_dir,
        progress=False,
    )


def test_a_rerun_that_only_reads_back_keeps_the_provenance_of_the_computing_run(
    tmp_path, monkeypatch
):
    out = tmp_path / "run"
    everything = {(m, s) for m in ("uniform", "random_init") for s in (0, 1)}
    computed = _compare(_FakePipeline(out / "stages", stored=()), out, monkeypatch, "first")
    assert computed["reused_runs"] == 0
    read_back = _compare(
        _FakePipeline(out / "stages", stored=everything), out, monkeypatch, "again"
    )
    assert read_back["provenance"]["command"] == "again" and read_back["reused_runs"] == 4
    assert [r["origin"]["provenance"]["command"] for r in read_back["runs"]] == ["first"] * 4
    line = compare.provenance_line(read_back)
    assert line.startswith("Measured with `first`, 4 runs in") and "again" not in line
    # `dpmix report --add` copies the origin of the numbers, not that of the rerun.
    report.add_results("toy", out, tmp_path / "results")
    copied = json.loads((tmp_path / "results" / "toy.json").read_text())
    assert "`first`, 4 runs" in compare.provenance_line(copied)

    # A rerun that computes a run is a run of its own: it is named beside the earlier one.
    partly = _compare(
        _FakePipeline(out / "stages", stored=everything - {("uniform", 1)}),
        out,
        monkeypatch,
        "resumed",
    )
    line = compare.provenance_line(partly)
    assert "`first`, 3 runs in" in line and "`resumed`, 1 run in" in line


def test_a_smaller_grid_in_between_loses_no_origin(tmp_path, monkeypatch, capsys):
    # A full grid, then one seed of it into the same folder, then the full grid again (all
    # read back): every run is still the first command's, and the replacement was announced.
    out = tmp_path / "run"
    everything = {(m, s) for m in ("uniform", "random_init") for s in (0, 1)}
    _compare(_FakePipeline(out / "stages", stored=()), out, monkeypatch, "full")
    _compare(_FakePipeline(out / "stages", stored=everything), out, monkeypatch, "one", (0,))
    said = capsys.readouterr().out
    assert "replacing" in said and "it holds 4 runs (ε 1; seeds 0 1; 2 methods)" in said
    assert "this command writes 2 (ε 1; seeds 0; 2 methods)" in said
    again = _compare(_FakePipeline(out / "stages", stored=everything), out, monkeypatch, "again")
    assert compare.provenance_line(again).startswith("Measured with `full`, 4 runs in")


def test_runs_read_back_into_a_folder_with_other_results_say_so(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _compare(_FakePipeline(out / "stages", stored=()), out, monkeypatch, "seed 0", seeds=(0,))
    everything = {(m, s) for m in ("uniform", "random_init") for s in (0, 1)}
    # Seed 1's runs come from other commands (stored stages shared): their origin is unknown.
    merged = _compare(_FakePipeline(out / "stages", stored=everything), out, monkeypatch, "both")
    assert merged["provenance"]["command"] == "both" and merged["reused_runs"] == 4
    line = compare.provenance_line(merged)
    assert "`seed 0`, 2 runs in" in line
    assert "2 runs read back from stored stages of unrecorded origin" in line


def test_the_progress_text_names_run_stage_and_step(tmp_path):
    progress = compare._GridProgress(3, "toy", enabled=False, store=tmp_path)
    progress.start_run("dp_mixmin ε=1 seed=0")
    progress.stage("pretrain_0123abcd")
    assert progress._bar.postfix.endswith("pretrain on λ (compiling)")
    progress.step(7, 300)  # the first step after compiling is shown at once
    assert progress._bar.postfix == "dp_mixmin ε=1 seed=0: pretrain on λ step 7/300"
    progress.step(300, 300)
    assert progress._bar.postfix == "dp_mixmin ε=1 seed=0: pretrain on λ step 300/300"


def _markdown(tmp_path, *views):
    blocks = "\n".join(f"<!-- table:toy {view} -->\nold\n<!-- /table -->\n" for view in views)
    path = tmp_path / "README.md"
    path.write_text(f"# Title\n\ntext before\n\n{blocks}\ntext after\n")
    return path


def test_report_rebuilds_tables_from_their_file_and_detects_drift(tmp_path):
    results_dir = tmp_path / "docs" / "results"
    results_dir.mkdir(parents=True)
    (results_dir / "toy.json").write_text(json.dumps(fake_results()))
    readme = _markdown(tmp_path, "utility", "budget", "weights")
    assert len(report.check_markdown(readme, results_dir)) == 3
    assert report.update_markdown(readme, results_dir) == [
        "toy:utility",
        "toy:budget",
        "toy:weights",
    ]
    text = readme.read_text()
    assert text.startswith("# Title\n\ntext before\n") and text.endswith("text after\n")
    assert "from `docs/results/toy.json`" in text and "| DP-MixMin | 0.5100 ± 0.0082 |" in text
    assert report.check_markdown(readme, results_dir) == []
    readme.write_text(text.replace("0.5100 ± 0.0082", "0.5200 ± 0.0082"))
    (stale,) = report.check_markdown(readme, results_dir)
    assert "toy (utility)" in stale


def test_report_names_a_missing_results_file(tmp_path):
    readme = _markdown(tmp_path, "utility")
    with pytest.raises(ValueError, match=r"toy\.json"):
        report.update_markdown(readme, tmp_path / "docs" / "results")


def test_add_results_copies_the_run_and_its_plots(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(fake_results()))
    (run / "weights.png").write_bytes(b"png")
    written = report.add_results("toy", run, tmp_path / "results")
    assert [p.name for p in written] == ["toy.json", "toy_weights.png"]
    with pytest.raises(ValueError, match="results.json does not exist"):
        report.add_results("toy", tmp_path / "nowhere", tmp_path / "results")
    with pytest.raises(ValueError, match="results name"):
        report.add_results("../x", run, tmp_path / "results")


def test_an_experiments_own_markdown_is_stored_and_rebuilt_with_its_provenance(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    results = {"command": "python -m experiments.toy", "commit": "abc1234", "noise_seeded": False}
    (run / "results.json").write_text(json.dumps(results))
    (run / "results.md").write_text("# Toy\n\n## Part\n\n| a | b |\n|---|---|\n| 1 | 0.25 |\n")
    (run / "curve.png").write_bytes(b"png")
    results_dir = tmp_path / "docs" / "results"
    written = report.add_results("toy", run, results_dir)
    assert [p.name for p in written] == ["toy.json", "toy.md", "toy_curve.png"]
    page = _markdown(tmp_path, "markdown")
    report.update_markdown(page, results_dir)
    text = page.read_text()
    assert "### Part\n\n| a | b |\n|---|---|\n| 1 | 0.25 |\n" in text and "# Toy" not in text
    assert "`python -m experiments.toy`" in text and "commit abc1234" in text
    assert "secret" in text and report.check_markdown(page, results_dir) == []
    page.write_text(text.replace("| 1 | 0.25 |", "| 1 | 0.26 |"))
    (stale,) = report.check_markdown(page, results_dir)
    assert "toy (markdown)" in stale
    (results_dir / "toy.md").unlink()
    with pytest.raises(ValueError, match=r"toy\.md"):
        report.update_markdown(page, results_dir)


def test_a_method_far_from_the_others_is_drawn_on_an_axis_of_its_own(monkeypatch, tmp_path):
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: figures.append(self))
    results = fake_results()
    for run in results["runs"]:
        if run["method"] == "random_init":
            run["utility"] = 50.0  # a perplexity-like outlier beside utilities of about 0.5
    compare.plot_results(results, tmp_path)
    main, side = figures[0].axes
    assert [c.get_label() for c in side.containers] == ["Random Init"]
    assert "Random Init" not in [c.get_label() for c in main.containers]
    assert main.get_ylim()[1] < 1.0  # the others keep a readable scale
    assert compare._off_scale({"a": 0.9, "b": 0.8, "c": 0.66, "d": 0.8}) == []


def test_a_table_stored_in_the_results_json_is_rebuilt_with_its_provenance(tmp_path):
    results_dir = tmp_path / "docs" / "results"
    results_dir.mkdir(parents=True)
    stored = {"table": "| a |\n|---|\n| 0.5 |\n", "command": "python -m experiments.toy"}
    (results_dir / "toy.json").write_text(json.dumps(stored))
    page = _markdown(tmp_path, "table")
    report.update_markdown(page, results_dir)
    assert "| a |\n|---|\n| 0.5 |\n\nMeasured with `python -m experiments.toy`." in page.read_text()
    assert report.check_markdown(page, results_dir) == []


def test_results_md_names_the_reference_methods_and_what_each_guarantee_is_about():
    results = fake_results()
    results["privacy_unit"] = "per image"
    text = compare.markdown_table(results)
    # Only the methods whose runs are not private end to end are called references.
    line = next(line for line in text.splitlines() if line.startswith("Reference methods"))
    assert line.startswith("Reference methods (Random Search, non-private MixMin) are not private")
    assert "DP-MixMin" not in line and "Uniform" not in line
    assert "(ε, δ = 1e-05) per image:" in text
