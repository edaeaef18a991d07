"""Experiment plots redrawn from their stored results: each plot function takes the results dict
read back from JSON, and its figure says what its reference lines, markers and error bars are,
with display names rather than ids."""

import dataclasses
import json
import re

import matplotlib
import numpy as np
import pytest
from matplotlib.collections import PathCollection
from matplotlib.container import BarContainer
from matplotlib.figure import Figure

from experiments import audit, clip_study, k_scaling, per_task, rho_guide, small_eps
from experiments.configs import k_scaling as k_configs
from experiments.configs import rho_guide as rho_configs
from experiments.configs.clip_study import ClipStudyConfig
from experiments.plot_labels import display_name

matplotlib.use("Agg")
SNAKE_CASE = re.compile(r"\b[a-z]+_[a-z_]+\b")


@pytest.fixture
def figures(monkeypatch):
    """The figures the code saves, kept instead of written."""
    saved = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *args, **kwargs: saved.append(fig))
    return saved


def round_trip(results: dict) -> dict:
    """`results` as a plot reads it back from its JSON file."""
    return json.loads(json.dumps(results, default=float))


def texts(fig: Figure) -> dict[str, list[str]]:
    """The figure's words by kind: legend entries, titles, axis labels and tick labels."""
    out = {"legend": [], "title": [], "label": [], "tick": []}
    for ax in fig.axes:
        legend = ax.get_legend()
        if legend is not None:
            out["legend"] += [t.get_text() for t in legend.get_texts()]
        out["title"].append(ax.get_title())
        out["label"] += [ax.get_xlabel(), ax.get_ylabel()]
        out["tick"] += [t.get_text() for t in ax.get_xticklabels() + ax.get_yticklabels()]
    return out


def assert_no_ids(words: dict[str, list[str]]) -> None:
    for kind in ("legend", "tick", "title", "label"):
        ids = [w for w in words[kind] if SNAKE_CASE.search(w)]
        assert not ids, f"{kind} shows ids: {ids}"


def test_display_names():
    assert display_name("dp_mixmin") == "DP-MixMin"
    assert display_name("nonprivate_mixmin") == "non-private MixMin"
    assert display_name("frank_wolfe") == "Frank-Wolfe"
    assert display_name("mirror_descent") == "mirror descent"
    assert display_name("some_new_id") == "some new id"


def audit_results() -> dict:
    summary = [
        {
            "release": "DP-MixMin λ",
            "claimed_epsilon": 1.0,
            "many_runs": 0.2,
            "no_noise_many_runs": 3.4,
            "tightness": "0.80, 0.76",
        },
        {
            "release": "DP-SGD example level",
            "claimed_epsilon": 1.0,
            "many_runs": 0.1,
            "one_run_steinke": 0.08,
            "one_run_fdp": 0.1,
            "no_noise_many_runs": 4.0,
            "no_noise_one_run_steinke": 3.8,
            "no_noise_one_run_fdp": 6.5,
        },
        {"release": "Hot PATE DPWS", "claimed_epsilon": 2.0, "many_runs": 0.4},
    ]
    tightness = [
        {"release": release, "claimed_epsilon": eps, "epsilon_lb": 0.8 * eps}
        | {"no_noise_epsilon_lb": 7.6, "ratio": 0.8, "sigma": 1.0}
        for release in ("DP-SGD", "DP-MixMin λ")
        for eps in (1.0, 4.0)
    ]
    return {"summary": summary, "releases": {"tightness": tightness}}


def test_audit_summary_plot(figures, tmp_path):
    results = round_trip(audit_results())
    audit.summary_plot(results, tmp_path / "results.png")
    (fig,) = figures
    left, right = fig.axes
    words = texts(fig)
    assert_no_ids(words)
    # One column per release, named by it; every point inside its release's column.
    assert [t.get_text() for t in left.get_xticklabels()] == [
        r["release"] for r in results["summary"]
    ]
    points = np.concatenate(
        [c.get_offsets() for c in left.collections if isinstance(c, PathCollection)]
    )
    assert len(points) == 9  # 5 calibrated-noise audits and 4 no-noise controls
    columns = np.round(points[:, 0])
    assert np.all(np.abs(points[:, 0] - columns) < 0.4)
    assert "side by side" in left.get_title()
    legend = " | ".join(words["legend"])
    for meaning in ("many runs", "one run (Steinke)", "one run (f-DP)", "no-noise control"):
        assert meaning in legend
    assert "claimed ε" in legend
    # The y = x line is drawn and labelled; the tightness points sit at their claimed ε.
    (diagonal,) = [line for line in right.get_lines() if line.get_label().startswith("y = x")]
    assert "claimed ε = ε_LB" in diagonal.get_label()
    np.testing.assert_allclose(diagonal.get_xdata(), diagonal.get_ydata())
    stars = np.concatenate([c.get_offsets() for c in right.collections])
    assert sorted(stars[:, 0]) == [1.0] * 4 + [4.0] * 4
    assert any("white-box tightness" in w for w in words["legend"])


def per_task_results() -> dict:
    rng = np.random.default_rng(0)
    rows = []
    for index, prevalence in enumerate((0.4, 0.3, 0.1, 0.02)):
        runs = [
            {"method": method, "seed": seed, "utility": 0.6 + 0.1 * rng.random()}
            for method in per_task.METHODS
            for seed in (0, 1)
        ]
        rows.append(
            {
                "index": index,
                "name": f"task {index}",
                "prevalence": prevalence,
                "test_positives": 10,
                "methods": per_task.task_gains(runs),
                "cosine_to_nonprivate": {"dp_mixmin": {"mean": 0.9, "std": 0.05}},
            }
        )
    return {"epsilon": 1.0, "seeds": [0, 1], "tasks": rows, **per_task.analyse(rows)}


def test_per_task_plot(figures, tmp_path):
    results = round_trip(per_task_results())
    per_task.plot(results, tmp_path / "per_task_gains.png")
    (fig,) = figures
    left, right = fig.axes
    words = texts(fig)
    assert_no_ids(words)
    assert "DP-MixMin" in words["legend"] and "Random Search" in words["legend"]
    assert "std over 2 seeds" in left.get_title()
    assert "± std over tasks" in right.get_title()
    # The macro DP-MixMin bar's error bar is the std over tasks of the per-task mean gains.
    bars = next(c for c in right.containers if isinstance(c, BarContainer))
    (segments,) = bars.errorbar.lines[2]
    low, high = segments.get_segments()[0][:, 1]
    gains = [t["methods"]["dp_mixmin"]["gain"]["mean"] for t in results["tasks"]]
    np.testing.assert_allclose((high - low) / 2, 100 * np.std(gains), rtol=1e-6)


def test_small_eps_plot(figures, tmp_path):
    summary = [
        {"epsilon": eps, "count": 6, "cosine_mean": c, "cosine_std": 0.05}
        | {"uniform_mean": 0.5, "uniform_std": 0.02}
        for eps, c in ((0.2, 0.7), (1.0, 0.9))
    ]
    results = round_trip({"defaults": {"image": {"summary": summary}}})
    small_eps.plot(results, tmp_path / "cosine_vs_epsilon.png")
    (fig,) = figures
    words = texts(fig)
    assert_no_ids(words)
    assert "mean ± std over 6 runs (tasks × seeds)" in words["title"][0]


def test_rho_guide_plot(figures, tmp_path):
    config = rho_configs.RhoGuideConfig(sizes=(200, 800, 3200), epsilons=(0.5, 1.0), seeds=(0, 1))
    rows = [
        {
            "seed": seed,
            "n": n,
            "epsilon_target": eps,
            "epsilon_spent": eps,
            "dp_excess": (1 + seed) / n,
            "nonprivate_excess": 0.1 / n,
            "bound": 10 / n,
            "limited_by": "privacy",
        }
        for seed in config.seeds
        for n in config.sizes
        for eps in config.epsilons
    ]
    results = round_trip(
        {
            "config": dataclasses.asdict(config),
            "clip_norm": 2.0,
            "summary": rho_guide.summarise(config, rows, 2.0),
        }
    )
    rho_guide.plot(results, tmp_path / "rho_guide.png")
    (fig,) = figures
    words = texts(fig)
    assert_no_ids(words)
    assert "± std over 2 seeds" in words["title"][0]
    assert any("mean ± std over 2 seeds" in w for w in words["legend"])


def k_scaling_results() -> dict:
    config = dataclasses.replace(
        k_configs.get_config("cpu", "synthetic"),
        ks=(2, 8, 32, 128),
        seeds=(0, 1),
        slope_min_k=8,
        solvers=("mirror_descent", "frank_wolfe"),
    )
    rows = [
        {
            "k": k,
            "seed": seed,
            "task": 0,
            "clip_norm": 1.0,
            "clipped_at_optimum": 0.1,
            "uniform_excess": 0.5,
        }
        | {
            f"{solver}_{key}": value
            for solver, scale in (("mirror_descent", 1e-3), ("frank_wolfe", 3e-3))
            for key, value in (
                ("excess", scale * k**0.5),
                ("bias", 0.5 * scale * k**0.5),
                ("noise", 0.5 * scale * k**0.5),
                ("steps", 100),
                ("epsilon", 1.0),
            )
        }
        for k in config.ks
        for seed in config.seeds
    ]
    summary = k_scaling.summarise(config, rows)
    return {
        "config": dataclasses.asdict(config),
        "proxies": "synthetic",
        "rows": rows,
        **summary,
    }


def test_k_scaling_plot(figures, tmp_path):
    results = json.loads(json.dumps(k_scaling_results(), default=str))
    k_scaling.plot(results, tmp_path / "k_scaling.png")
    (fig,) = figures
    words = texts(fig)
    assert_no_ids(words)
    assert words["title"][0].startswith("mirror descent") and "Frank-Wolfe" in words["title"][1]
    assert all("± std over 2 runs (seeds × tasks)" in t for t in words["title"])
    for ax, solver in zip(fig.axes, ("mirror_descent", "frank_wolfe"), strict=True):
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert "total (fitted slope 0.50)" in legend
        (reference,) = [line for line in ax.get_lines() if "0.49" in line.get_label()]
        assert "the paper's" in reference.get_label()
        ks, values = reference.get_xdata(), reference.get_ydata()
        # Through the solver's total at the first k of the fit, with slope 0.49 in log-log.
        assert ks[0] == 8
        np.testing.assert_allclose(values[0], results["excess"][solver]["mean"][1])
        slope = np.polyfit(np.log(ks), np.log(values), 1)[0]
        np.testing.assert_allclose(slope, k_scaling.PAPER_SLOPE)


def test_clip_study_plot(figures, tmp_path):
    config = ClipStudyConfig(clip_norms=(0.1, 1.0, 10.0), seeds=(0, 1, 2))
    curves = [
        {"setting": setting, "noise_multiplier": sigma, "shift": shift}
        | {"mean": [0.1, 0.01, 0.05], "std": [0.02, 0.002, 0.01]}
        for setting, sigma in (("σ = 0", 0.0), ("ε = 1.0", 2.0))
        for shift in config.shifts
    ]
    results = round_trip(
        {"config": dataclasses.asdict(config), "curves": curves, "uniform_excess": 0.3}
    )
    clip_study.plot(results, tmp_path / "clip_study.png")
    (fig,) = figures
    words = texts(fig)
    assert_no_ids(words)
    assert "mean ± std over 3 seeds" in words["label"][1]
    assert "σ = 0, no shift" in words["legend"] and "ε = 1.0, weighted shift" in words["legend"]
    (ax,) = fig.axes
    assert len(ax.containers) == len(curves)  # one error-bar curve per setting and shift
