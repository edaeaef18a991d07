"""LoRA fine-tuning of GPT-2: DP step time over the non-private step, memory against full tuning.

For every GPT-2 row of a preset (the models, batch sizes and sequence lengths of
`experiments/configs/bench_grads.py`: tiny from "cpu", small from "cpu_small") this times, on one
fixed synthetic batch and interleaved as `experiments.bench_grads` does, the Trainer's jitted
steps (the programs `train.Trainer` runs, on a batch already on the device):

- full_nonprivate / full_dp: every parameter trained, an ordinary step and a DP-SGD step (clipped
  sum by the Trainer's default clipping, Gaussian noise, SGD);
- lora_nonprivate / lora_dp: rank-r adapters on every attention and MLP projection
  (`models.lora`), only they trained.

Memory is XLA's static peak estimate of each compiled step (`compiled.memory_analysis()`:
arguments + outputs + temporaries - aliased bytes). The noise key is fixed: the data are
synthetic, nothing here is private.

Usage: `python -m experiments.lora_bench --preset cpu --out runs/lora_bench` (writes
`lora_bench.json` and `lora_bench.md`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.cli import experiment_main, experiment_parser
from dpmix_jax.models import GPT2, GPT2Config, lora
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.train import engine
from experiments.bench_grads import CLIP_NORM, LEARNING_RATE, NOISE_MULTIPLIER, _lm_loss, _memory
from experiments.configs.bench_grads import ModelBench, get_config

METHODS = ("full_nonprivate", "full_dp", "lora_nonprivate", "lora_dp")
PRESETS = ("micro", "cpu")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraBenchConfig:
    """Settings of the LoRA benchmark.

    Attributes:
        models: GPT-2 rows (model, batch sizes, sequence length).
        rank: r of the adapters; alpha is 2r.
        warmup_steps: untimed steps per method (compilation happens here).
        rounds: interleaved rounds (every method once per round).
        steps_per_round: individually timed steps per method and round.
    """

    models: tuple[ModelBench, ...]
    rank: int = 8
    warmup_steps: int = 1
    rounds: int = 2
    steps_per_round: int = 3

    def __post_init__(self) -> None:
        if not self.models or any(not m.model.startswith("gpt2") for m in self.models):
            raise ValueError(f"models must be GPT-2 rows, got {self.models!r}.")
        for name in ("rank", "warmup_steps", "rounds", "steps_per_round"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")


def get_lora_config(preset: str = "cpu") -> LoraBenchConfig:
    """micro: seconds, for tests; cpu: the GPT-2 rows of the "cpu" and "cpu_small" presets."""
    if preset == "micro":
        return LoraBenchConfig(models=get_config("micro").models, rank=2, rounds=1,
                               steps_per_round=1)  # fmt: skip
    if preset == "cpu":
        rows = [m for p in ("cpu", "cpu_small") for m in get_config(p).models]
        return LoraBenchConfig(models=tuple(m for m in rows if m.model.startswith("gpt2")))
    raise ValueError(f"unknown preset {preset!r}; choose from {PRESETS}.")


def _step(method: str, spec: ModelBench, batch: dict, rank: int):
    """`(run, memory_bytes, trainable_parameters, clipping)` of one method's jitted step."""
    config = GPT2Config.tiny() if spec.model == "gpt2_tiny" else GPT2Config.small()
    model = GPT2(config, rngs=nnx.Rngs(0))
    mask = None
    if method.startswith("lora"):
        lora.add_lora(model, lora.LoraConfig(rank=rank, alpha=2.0 * rank), rngs=nnx.Rngs(1))
        mask = lora.trainable_mask(model)
    batch_size = batch["ids"].shape[0]
    private = method.endswith("_dp")
    dp = dict(
        private=True, clip_norm=CLIP_NORM, delta=1e-5, noise_multiplier=NOISE_MULTIPLIER,
        pad_multiple=batch_size,
    ) if private else {}  # fmt: skip
    train_config = engine.TrainConfig(
        steps=1000, batch_size=batch_size, learning_rate=LEARNING_RATE, optimizer="sgd",
        progress=False, log_every=None, **dp,
    )  # fmt: skip
    trainer = engine.Trainer(
        train_config, model, _lm_loss, trainable_mask=mask,
        num_units=10 * batch_size if private else None,
        noise_key=jax.random.key(1) if private else None,
    )  # fmt: skip
    unit_mask = jnp.ones(batch_size, bool)
    holder = {"state": trainer.init_state()}
    if private:
        args = (trainer.frozen, trainer.rest, batch, unit_mask)
        jitted = trainer._step_fn
    else:
        args = (trainer.frozen, trainer.rest, batch)
        jitted = trainer._public_fn
    memory = _memory(jitted, holder["state"], *args)

    def run():
        holder["state"] = jitted(holder["state"], *args)[0]
        jax.block_until_ready(holder["state"].params)

    count = sum(x.size for x in jax.tree.leaves(holder["state"].params))
    return run, memory, int(count), getattr(trainer, "clipping", None)


def time_model(config: LoraBenchConfig, spec: ModelBench, batch_size: int) -> list[dict]:
    """Every method on one (model, batch size): warm-up, then interleaved timed rounds."""
    vocab = (GPT2Config.tiny() if spec.model == "gpt2_tiny" else GPT2Config.small()).vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, (batch_size, spec.seq_len + 1))
    batch = {"ids": jnp.asarray(ids, jnp.int32)}
    steps = {method: _step(method, spec, batch, config.rank) for method in METHODS}
    for run, *_ in steps.values():
        for _ in range(config.warmup_steps):
            run()
    times = {method: [] for method in METHODS}
    for _ in range(config.rounds):
        for method, (run, *_) in steps.items():
            for _ in range(config.steps_per_round):
                start = time.perf_counter()
                run()
                times[method].append(time.perf_counter() - start)
    return [
        {
            "model": spec.model,
            "batch_size": batch_size,
            "seq_len": spec.seq_len,
            "method": method,
            "median_step_seconds": statistics.median(times[method]),
            "peak_memory_bytes": memory,
            "trainable_parameters": count,
            "clipping": clipping,
        }  # fmt: skip
        for method, (_, memory, count, clipping) in steps.items()
    ]


def summary(rows: list[dict]) -> list[dict]:
    """Per (model, batch size): LoRA DP / LoRA non-private step time (the target is <= 1.2),
    full DP / full non-private, and LoRA DP's memory over full DP's and full non-private's."""
    by_key = {(r["model"], r["batch_size"], r["method"]): r for r in rows}
    out = []
    for model, batch_size in dict.fromkeys((r["model"], r["batch_size"]) for r in rows):

        def ratio(a, b, field, model=model, batch_size=batch_size):
            x, y = by_key[model, batch_size, a][field], by_key[model, batch_size, b][field]
            return None if x is None or y is None else x / y

        out.append({
            "model": model,
            "batch_size": batch_size,
            "lora_dp_over_lora_nonprivate_time": ratio("lora_dp", "lora_nonprivate",
                                                       "median_step_seconds"),
            "full_dp_over_full_nonprivate_time": ratio("full_dp", "full_nonprivate",
                                                       "median_step_seconds"),
            "lora_dp_over_full_dp_time": ratio("lora_dp", "full_dp", "median_step_seconds"),
            "lora_dp_over_full_dp_memory": ratio("lora_dp", "full_dp", "peak_memory_bytes"),
            "lora_dp_over_full_nonprivate_memory": ratio("lora_dp", "full_nonprivate",
                                                         "peak_memory_bytes"),
        })  # fmt: skip
    return out


def markdown(report: dict) -> str:
    """The rows and the summary as markdown tables (numbers as stored in the JSON, rounded)."""
    lines = [
        "| model | B | T | method | clipping | trainable params | step ms | memory MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        mem = "-" if r["peak_memory_bytes"] is None else f"{r['peak_memory_bytes'] / 2**20:.1f}"
        lines.append(
            f"| {r['model']} | {r['batch_size']} | {r['seq_len']} | {r['method']} | "
            f"{r['clipping'] or '-'} | {r['trainable_parameters']:,} | "
            f"{1e3 * r['median_step_seconds']:.1f} | {mem} |"
        )
    names = [k for k in report["summary"][0] if k not in ("model", "batch_size")]
    lines += ["", "| model | B | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for s in report["summary"]:
        cells = ["-" if s[n] is None else f"{s[n]:.2f}" for n in names]
        lines.append(f"| {s['model']} | {s['batch_size']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = experiment_parser(
        "lora_bench", __doc__.splitlines()[0], examples=("--preset cpu --out runs/lora_bench",)
    )
    parser.add_argument(
        "--preset", default="cpu", choices=PRESETS,
        help="micro: seconds, for tests; cpu: GPT-2 tiny and small on CPU",
    )  # fmt: skip
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("runs/lora_bench"), metavar="DIR",
        help="output folder: lora_bench.json, lora_bench.md",
    )  # fmt: skip
    args = parser.parse_args(argv)
    config = get_lora_config(args.preset)
    start = time.time()
    rows = []
    for spec in config.models:
        for batch_size in spec.batch_sizes:
            rows.extend(time_model(config, spec, batch_size))
            print(f"{spec.model} B={batch_size}: done", flush=True)
    report = {
        "provenance": provenance(),
        "preset": args.preset,
        "rank": config.rank,
        "alpha": 2.0 * config.rank,
        "wall_seconds": time.time() - start,
        "noise_seeded": True,
        "results": rows,
        "summary": summary(rows),
    }
    table = markdown(report)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lora_bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "lora_bench.md").write_text(table + "\n")
    return report


if __name__ == "__main__":
    with experiment_main("lora_bench"):
        main(sys.argv[1:])
