"""experiments.discrete_noise in a tiny form, and its stored result against the docs page."""

import json
import pathlib

import pytest

from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.privacy import SEEDED_NOTE, accounting, discrete_noise
from experiments import discrete_noise as study
from experiments.configs.discrete_noise import DiscreteNoiseConfig

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_tiny_run_writes_results_from_the_library(tmp_path):
    config = DiscreteNoiseConfig(
        vocab_size=500, repeats=1, laplace_epsilons=(1.0,), gaussian_sigmas=(3,), delta=1e-5
    )
    results = study.main(config, tmp_path, reproducible=True)
    stored = json.loads((tmp_path / "discrete_noise.json").read_text())
    assert stored["noise_seeded"] is True and SEEDED_NOTE in study.markdown(stored)
    assert {"command", "date", "commit", "wall_s"} <= stored.keys()
    assert [r["noise"] for r in stored["speed"]] == [
        "Laplace, scale 2/ε = 2",
        "Laplace, scale 2/ε = 2",
        "Gaussian, σ = 3",
        "Gaussian, σ = 3",
    ]
    assert all(r["exact_per_s"] > 0 and r["float_per_s"] > 0 for r in stored["speed"])
    laplace, gaussian = results["epsilon"]
    assert laplace["discrete"] == accounting.epsilon(
        pate_accounting.dpargmax_discrete_laplace_event(1.0), delta=1e-5
    )
    assert gaussian["discrete"] == discrete_noise.discrete_gaussian_epsilon(9, (1, 1), delta=1e-5)
    assert gaussian["continuous"] == pytest.approx(gaussian["discrete"], rel=0.01)
    assert (tmp_path / "discrete_noise.md").read_text() == study.markdown(stored) + "\n"


def test_docs_page_shows_the_stored_numbers():
    stored = json.loads((ROOT / "docs/results/discrete_noise.json").read_text())
    page = (ROOT / "docs/discrete-noise.md").read_text()
    # The page's table is rebuilt from this file by `dpmix report` (checked by test_readme).
    assert (ROOT / "docs/results/discrete_noise.md").read_text() == study.markdown(stored) + "\n"
    assert "<!-- table:discrete_noise markdown -->" in page
    assert stored["commit"] in page and stored["command"] in page
