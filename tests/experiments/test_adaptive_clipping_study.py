"""The adaptive clipping study (`experiments.adaptive_clipping`) in a tiny form."""

import json

import pytest

from dpmix_jax.pipeline import presets
from experiments import adaptive_clipping as study
from experiments.configs.adaptive_clipping import AdaptiveClippingStudyConfig


@pytest.mark.slow
def test_tiny_study_writes_its_results(tmp_path):
    config = AdaptiveClippingStudyConfig(
        seeds=(0,), clip_scales=(1.0, 10.0), steps=3, pretrain_steps=2
    )
    results = study.main(config, tmp_path, reproducible=True, task=presets.digit_task(image_size=8))
    stored = json.loads((tmp_path / "adaptive_clipping.json").read_text())
    assert stored["runs"] == results["runs"]
    for key in ("command", "commit", "date", "wall_s", "noise_seeded", "table"):
        assert key in stored
    assert stored["noise_seeded"] is True
    assert (tmp_path / "adaptive_clipping.md").read_text() == stored["table"] + "\n"
    settings = [row["setting"] for row in stored["summary"]]
    assert settings == [
        "fixed C = 1", "fixed C = 10", "adaptive from C = 1", "adaptive from C = 10",
    ]  # fmt: skip
    runs = {r["setting"]: r for r in stored["runs"]}
    # One σ and one ε for every setting; the adaptive runs moved their clip norm.
    assert len({r["noise_multiplier"] for r in stored["runs"]}) == 1
    assert len({r["spent_epsilon"] for r in stored["runs"]}) == 1
    assert runs["fixed C = 10"]["final_clip_norm"] == 10.0
    assert runs["adaptive from C = 10"]["final_clip_norm"] != 10.0
    for row in stored["summary"]:
        assert f"| {row['setting']} | {row['test_auc_mean']:.4f}" in stored["table"]
