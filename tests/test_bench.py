"""The throughput benchmark runs end to end on the micro preset and writes valid JSON."""

import json

import pytest

from experiments import bench_grads
from experiments.configs.bench_grads import METHODS, PRESETS, BenchConfig, ModelBench, get_config


@pytest.mark.slow
def test_micro_preset_writes_valid_json(tmp_path):
    path = tmp_path / "bench.json"
    bench_grads.main(["--preset", "micro", "--json", str(path)])
    report = json.loads(path.read_text())
    config = get_config("micro")
    rows = report["results"]
    assert {(r["model"], r["batch_size"], r["method"]) for r in rows} == {
        (spec.model, b, m) for spec in config.models for b in spec.batch_sizes for m in METHODS
    }
    for row in rows:
        assert isinstance(row["examples_per_second"], float) and row["examples_per_second"] > 0
        assert row["peak_memory_bytes"] is None or isinstance(row["peak_memory_bytes"], int)
        if row["method"].startswith("opacus"):
            assert row["compiles"] is None
        else:  # traced once in warm-up, never again in the timed loops
            assert row["compiles"] == 0 and row["compiles_warmup"] == 1
    (summary,) = report["summary"]  # one model at one batch size
    dp = {r["method"]: r["examples_per_second"] for r in rows if r["method"].startswith("dp")}
    by_method = {r["method"]: r["examples_per_second"] for r in rows}
    assert dp[summary["fastest_dp"]] == max(dp.values())
    assert summary["dp_over_nonprivate_time"] == pytest.approx(
        by_method["nonprivate"] / max(dp.values())
    )
    assert summary["ours_over_opacus_throughput"] == pytest.approx(
        max(dp.values()) / by_method["opacus_dp"]
    )
    assert {r["sources"] for r in report["mixmin"]} == set(config.mixmin_sources)
    assert {r["method"] for r in report["pate"]} == {
        "independent",
        "coordinated_full",
        "coordinated_top_k",
        "read_logits",
        "independent_step",
        "coordinated_top_k_step",
    }
    steps = [r for r in report["pate"] if r["method"].endswith("_step")]
    assert all(r["histograms"] == 1 for r in steps)


def test_config_validation():
    with pytest.raises(ValueError, match="microbatch_size"):
        ModelBench(model="gpt2_tiny", batch_sizes=(6,), microbatch_size=4)
    with pytest.raises(ValueError, match="model"):
        ModelBench(model="vgg", batch_sizes=(4,), microbatch_size=2)
    spec = ModelBench(model="gpt2_tiny", batch_sizes=(4,), microbatch_size=2)
    with pytest.raises(ValueError, match="unknown methods"):
        BenchConfig(models=(spec,), methods=("nonprivate", "jit"))
    with pytest.raises(ValueError, match="preset"):
        get_config("tpu-pod")
    for preset in PRESETS:
        assert get_config(preset).models
