"""The throughput benchmark runs end to end on the micro preset and writes valid JSON; its
BandMF and LoRA rows measure what they name; docs/performance.md's and docs/lora.md's tables are the
stored run's."""

import dataclasses
import json
import pathlib

import jax
import pytest
from flax import nnx

from dpmix_jax.models import GPT2, GPT2Config
from experiments import bench_grads
from experiments.configs.bench_grads import (
    GPT2_ONLY_METHODS,
    METHODS,
    PRESETS,
    BenchConfig,
    ModelBench,
    get_config,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
STORED = {p: ROOT / "docs" / "results" / f"bench-{p}.json" for p in ("cpu", "cpu_small", "pate")}


def _tiny_gpt2_parameters() -> int:
    params = nnx.state(GPT2(GPT2Config.tiny(), rngs=nnx.Rngs(0)), nnx.Param)
    return sum(x.size for x in jax.tree.leaves(params))


def _adapter_parameters(rank: int) -> int:
    """r (d_in + d_out) per adapted projection: c_attn, attention c_proj, c_fc, MLP c_proj."""
    tiny = GPT2Config.tiny()
    d, h = tiny.n_embd, tiny.mlp_dim
    return tiny.n_layer * rank * ((d + 3 * d) + (d + d) + (d + h) + (h + d))


@pytest.mark.slow
def test_micro_preset_writes_valid_json(tmp_path):
    path = tmp_path / "bench.json"
    bench_grads.cli(["--preset", "micro", "--out", str(tmp_path)])
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
    dp = {
        r["method"]: r["examples_per_second"] for r in rows if r["method"] in bench_grads.DP_METHODS
    }
    by_method = {r["method"]: r for r in rows}
    speed = {method: r["examples_per_second"] for method, r in by_method.items()}
    assert dp[summary["fastest_dp"]] == max(dp.values())
    assert summary["dp_over_nonprivate_time"] == pytest.approx(
        speed["nonprivate"] / max(dp.values())
    )
    assert summary["ours_over_opacus_throughput"] == pytest.approx(
        max(dp.values()) / speed["opacus_dp"]
    )
    # The new rows' ratios come from their own timings (time ratio = inverse throughput ratio).
    assert summary["bandmf_over_nonprivate_time"] == pytest.approx(
        by_method["dp_bandmf"]["median_step_seconds"]
        / by_method["nonprivate"]["median_step_seconds"]
    )
    assert summary["bandmf_over_ghost_time"] == pytest.approx(
        speed["dp_ghost"] / speed["dp_bandmf"]
    )
    assert summary["lora_dp_over_lora_nonprivate_time"] == pytest.approx(
        by_method["lora_dp"]["median_step_seconds"]
        / by_method["lora_nonprivate"]["median_step_seconds"]
    )
    # LoRA trains the adapters alone; every other JAX row trains the whole model.
    full = _tiny_gpt2_parameters()
    for method in ("nonprivate", "dp_vmap", "dp_ghost", "dp_bandmf", "trainer_dp"):
        assert by_method[method]["trainable_parameters"] == full
    for method in GPT2_ONLY_METHODS:
        assert by_method[method]["trainable_parameters"] == _adapter_parameters(config.lora_rank)
    assert report["provenance"]["command"] and report["provenance"]["date"]
    assert report["noise_seeded"] is True and report["wall_seconds"] > 0
    assert (report["bands"], report["lora_rank"]) == (config.bands, config.lora_rank)
    table = bench_grads.performance_table(report)
    for method in ("nonprivate", "dp_bandmf", "trainer_dp", "opacus_dp"):
        assert f"| {bench_grads._throughput_cell(speed[method])} |" in table
    lora = bench_grads.lora_table(report)
    assert f"| {summary['lora_dp_over_lora_nonprivate_time']:.2f} |" in lora
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


def _row(method: str, seconds: float, memory: int | None, batch_size: int = 8) -> dict:
    return {
        "model": "gpt2_tiny",
        "batch_size": batch_size,
        "method": method,
        "examples_per_second": batch_size / seconds,
        "median_step_seconds": seconds,
        "peak_memory_bytes": memory,
    }


def test_summary_ratios_are_each_rows_own():
    seconds = {
        "nonprivate": 0.010, "dp_vmap": 0.030, "dp_microbatch": 0.040, "dp_ghost": 0.020,
        "dp_bandmf": 0.025, "trainer_dp": 0.022, "lora_nonprivate": 0.008, "lora_dp": 0.012,
        "opacus_dp": 0.050,
    }  # fmt: skip
    memory = {"nonprivate": 100, "dp_ghost": 200, "dp_bandmf": 260, "trainer_dp": 190,
              "lora_nonprivate": 90, "lora_dp": 95}  # fmt: skip
    rows = [_row(m, s, memory.get(m)) for m, s in seconds.items()]
    (summary,) = bench_grads.summary(rows)
    # BandMF is slower than the ghost step but not a DP-SGD clipping path: never "fastest".
    assert summary["fastest_dp"] == "dp_ghost"
    assert summary["dp_over_nonprivate_time"] == pytest.approx(2.0)
    assert summary["bandmf_over_nonprivate_time"] == pytest.approx(2.5)
    assert summary["bandmf_over_ghost_time"] == pytest.approx(1.25)
    assert summary["bandmf_over_ghost_memory"] == pytest.approx(1.3)
    assert summary["lora_dp_over_lora_nonprivate_time"] == pytest.approx(1.5)
    assert summary["lora_dp_over_trainer_dp_memory"] == pytest.approx(95 / 190)
    assert summary["lora_nonprivate_over_nonprivate_memory"] == pytest.approx(0.9)
    assert summary["trainer_over_fastest_dp_time"] == pytest.approx(1.1)
    # A model without LoRA rows (a ResNet) has no LoRA ratios.
    (without,) = bench_grads.summary([r for r in rows if not r["method"].startswith("lora")])
    assert without["lora_dp_over_lora_nonprivate_time"] is None
    assert without["lora_dp_over_trainer_dp_memory"] is None


@pytest.mark.slow
def test_bandmf_memory_holds_the_noise_history():
    """XLA's estimate of the BandMF step exceeds the ghost step's by the b - 1 float32 noise
    vectors of its state, once as arguments and once as outputs (the step donates nothing)."""
    config = dataclasses.replace(
        get_config("micro"), methods=("dp_ghost", "dp_bandmf"), memory_analysis=True, bands=3
    )
    (spec,) = config.models
    rows = {r["method"]: r for r in bench_grads.time_methods(config, spec, spec.batch_sizes[0])}
    history = (config.bands - 1) * 4 * _tiny_gpt2_parameters()
    extra = rows["dp_bandmf"]["peak_memory_bytes"] - rows["dp_ghost"]["peak_memory_bytes"]
    assert 2 * history <= extra <= 1.05 * 2 * history


def test_lora_methods_run_on_gpt2_only():
    spec = ModelBench(model="resnet_tiny", batch_sizes=(2,), microbatch_size=2, image_size=8)
    config = BenchConfig(
        models=(spec,), methods=("nonprivate", "lora_dp"), warmup_steps=1, rounds=1,
        steps_per_round=1, memory_analysis=False,
    )  # fmt: skip
    rows = bench_grads.time_methods(config, spec, 2)
    assert [r["method"] for r in rows] == ["nonprivate"]


@pytest.mark.parametrize("preset", sorted(STORED))
def test_stored_run_is_complete(preset):
    report = json.loads(STORED[preset].read_text())
    assert report["preset"] == preset and report["noise_seeded"] is True
    origin = report["provenance"]
    assert origin["command"].startswith(f"python -m experiments.bench_grads --preset {preset} ")
    assert origin["commit"] and "modified" not in origin["commit"]
    config = get_config(preset)
    expected = {
        (spec.model, b, m)
        for spec in config.models
        for b in spec.batch_sizes
        for m in config.methods
        if m not in GPT2_ONLY_METHODS or spec.model.startswith("gpt2")
    }
    assert {(r["model"], r["batch_size"], r["method"]) for r in report["results"]} == expected
    assert bench_grads.summary(report["results"]) == report["summary"]
    if config.pate_teachers and preset != "cpu":  # the cpu run predates the fourth regime
        assert {r["logits"] for r in report["pate"]} == set(config.pate_regimes)


def test_performance_and_lora_pages_show_the_stored_runs():
    page = (ROOT / "docs" / "performance.md").read_text()
    lora_page = (ROOT / "docs" / "lora.md").read_text()
    report = json.loads(STORED["cpu"].read_text())
    performance = page[page.index("# Performance") : page.index("## Small models on CPU")]
    tables = [bench_grads.performance_table, bench_grads.memory_table, bench_grads.mixmin_table]
    for table in (*tables, bench_grads.pate_table):
        assert table(report) in performance
    small = json.loads(STORED["cpu_small"].read_text())
    small_models = page[page.index("## Small models on CPU") :]
    for table in (bench_grads.performance_table, bench_grads.memory_table):
        assert table(small) in small_models
    samplers_only = json.loads(STORED["pate"].read_text())
    assert bench_grads.pate_table(samplers_only) in performance
    for stored, section in (
        (report, performance),
        (small, small_models),
        (samplers_only, performance),
    ):
        origin = stored["provenance"]
        assert origin["commit"] in section and origin["date"] in section
        if stored["results"]:
            assert bench_grads.lora_table(stored) in lora_page
            assert origin["commit"] in lora_page


def test_config_validation():
    with pytest.raises(ValueError, match="microbatch_size"):
        ModelBench(model="gpt2_tiny", batch_sizes=(6,), microbatch_size=4)
    with pytest.raises(ValueError, match="model"):
        ModelBench(model="vgg", batch_sizes=(4,), microbatch_size=2)
    spec = ModelBench(model="gpt2_tiny", batch_sizes=(4,), microbatch_size=2)
    with pytest.raises(ValueError, match="unknown methods"):
        BenchConfig(models=(spec,), methods=("nonprivate", "jit"))
    for name, value in (("bands", 0), ("bands", 2.0), ("lora_rank", 0), ("lora_alpha", 0.0)):
        with pytest.raises(ValueError, match=name):
            BenchConfig(models=(spec,), **{name: value})
    with pytest.raises(ValueError, match="preset"):
        get_config("tpu-pod")
    with pytest.raises(ValueError, match="pate_regimes"):
        BenchConfig(models=(spec,), pate_regimes=("flat",))
    for preset in PRESETS:  # every preset times something
        config = get_config(preset)
        assert config.models or config.pate_teachers


def test_presets_this_machine_cannot_run_are_refused_before_any_work(monkeypatch):
    monkeypatch.setattr(bench_grads.jax, "default_backend", lambda: "cpu")
    with pytest.raises(ValueError, match="gpu needs an accelerator"):
        bench_grads.check_can_run(get_config("gpu"), "gpu")
    bench_grads.check_can_run(get_config("cpu"), "cpu")  # torch and opacus are installed here
    real_find_spec = bench_grads.importlib.util.find_spec
    monkeypatch.setattr(
        bench_grads.importlib.util,
        "find_spec",
        lambda name: None if name == "opacus" else real_find_spec(name),
    )
    with pytest.raises(ValueError, match=r"need opacus, .*\[compare\]"):
        bench_grads.check_can_run(get_config("cpu"), "cpu")
    without_opacus = dataclasses.replace(get_config("micro"), methods=("nonprivate", "dp_ghost"))
    bench_grads.check_can_run(without_opacus, "micro")
