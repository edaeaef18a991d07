"""Throughput of per-example clipping for any model and loss: non-private against every DP path.

Research code times its own model and loss, in one process and on one fixed batch:

    from dpmix_jax import bench
    rows = bench.throughput(make_model, per_example_loss, batch)
    print(bench.table(rows))

`make_model()` returns a fresh Flax NNX module (each method trains its own), `loss(model, batch)`
the per-example losses `(B,)`, and `batch` a dict of arrays with the examples on axis 0. Each
method is a full training step on that batch:

- nonprivate: `jax.value_and_grad` of the mean loss + optax SGD;
- dp_vmap / dp_microbatch / dp_ghost: `privacy.make_dp_sgd_step` (clipped sum, Gaussian noise,
  division by the batch size, SGD) with the clipped sum of `train.ghost_models` (per-example
  gradients by `vmap`, the same in chunks of `microbatch_size`, or ghost clipping);
- dp_bandmf: the ghost clipped sum with BandMF correlated noise of `bands` bands;
- trainer_dp: the `train.Trainer`'s private step as the pipelines run it (its default clipping;
  the index batch gathered on the host, then clipped sum, noise and SGD in one jitted call);
- lora_nonprivate / lora_dp: rank-r LoRA adapters (`models.lora`) on every attention and MLP
  projection of a GPT-2 or Llama-family model, the base frozen: the Trainer's public and private
  steps.

Every method is warmed up (it compiles there), then all are timed interleaved: `rounds` rounds of
`steps_per_round` individually timed steps each. A row holds the median step time, examples per
second, the min-max of the per-round medians, XLA's static memory estimate of the compiled step
(`compiled.memory_analysis()`: arguments + outputs + temporaries - aliased bytes; None where a
backend has none), the compiles after warm-up (0: no recompilation) and the trainable parameters.
`ratios(rows)` divides each DP path's step time by the non-private one's.

From the command line, `dpmix bench --model MODULE:FACTORY` imports MODULE, calls FACTORY() for
a `Target` (the model factory, the loss, the batch and the methods) and times it
(`load_target`).

Privacy:
    Timing only: the noise keys are fixed and nothing here is a private release.
"""

from __future__ import annotations

import dataclasses
import importlib
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpmix_jax.models import lora
from dpmix_jax.privacy import correlated_noise, noise, validation
from dpmix_jax.train import TrainConfig, engine
from dpmix_jax.train.ghost_models import model_clipped_grad_sum

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "Runner",
    "Target",
    "ThroughputSettings",
    "build_runner",
    "load_target",
    "ratios",
    "table",
    "throughput",
    "time_runners",
]

METHODS = (
    "nonprivate", "dp_vmap", "dp_microbatch", "dp_ghost", "dp_bandmf", "trainer_dp",
    "lora_nonprivate", "lora_dp",
)  # fmt: skip
DEFAULT_METHODS = ("nonprivate", "dp_vmap", "dp_ghost", "trainer_dp")
# The clipped sum of each direct DP-SGD method ("dp_bandmf" clips as "dp_ghost" does).
_CLIPPING = {"dp_vmap": "vmap", "dp_microbatch": "vmap", "dp_ghost": "ghost", "dp_bandmf": "ghost"}
_TRAINER_METHODS = ("trainer_dp", "lora_nonprivate", "lora_dp")

Loss = Callable[[nnx.Module, Mapping[str, jax.Array]], jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ThroughputSettings:
    """How `throughput` builds and times the steps.

    Attributes:
        warmup_steps: untimed steps per method before timing (compilation happens here).
        rounds: interleaved rounds (every method once per round); the spread is over rounds.
        steps_per_round: individually timed steps per method and round.
        clip_norm, noise_multiplier, learning_rate: the DP-SGD step's C, σ and SGD step size.
        microbatch_size: the chunk of "dp_microbatch" (must divide the batch size; None: the
            method is refused).
        bands: b of "dp_bandmf" (b - 1 noise vectors in its state).
        lora: the adapters of the "lora_*" methods.
        memory_analysis: compile each JAX step once more ahead of time to read XLA's memory
            estimate (doubles compile time).
    """

    warmup_steps: int = 2
    rounds: int = 3
    steps_per_round: int = 3
    clip_norm: float = 1.0
    noise_multiplier: float = 1.0
    learning_rate: float = 0.01
    microbatch_size: int | None = None
    bands: int = 4
    lora: lora.LoraConfig = lora.LoraConfig(rank=8, alpha=16.0)
    memory_analysis: bool = True

    def __post_init__(self) -> None:
        for name in ("warmup_steps", "rounds", "steps_per_round", "bands"):
            validation.check_steps(getattr(self, name), name)
        for name in ("clip_norm", "noise_multiplier", "learning_rate"):
            validation.check_positive(getattr(self, name), name)
        if self.microbatch_size is not None:
            validation.check_steps(self.microbatch_size, "microbatch_size")


@dataclasses.dataclass
class Runner:
    """One method on one batch: `step()` runs one full step and waits for it; `params()` gives
    the parameters it trains as they stand (None for a runner outside JAX)."""

    method: str
    step: Callable[[], None]
    peak_memory_bytes: int | None
    traces: Callable[[], int | None]
    trainable_parameters: int | None = None
    params: Callable[[], Any] = lambda: None
    times: list[list[float]] = dataclasses.field(default_factory=list)


def _memory(jitted, *args) -> int | None:
    try:
        analysis = jitted.lower(*args).compile().memory_analysis()
    except Exception:  # memory_analysis is not implemented on every backend
        return None
    if analysis is None:
        return None
    total = (
        analysis.argument_size_in_bytes
        + analysis.output_size_in_bytes
        + analysis.temp_size_in_bytes
    )
    return int(total - analysis.alias_size_in_bytes)


def _batch_size(batch: Mapping[str, Any]) -> int:
    sizes = {np.shape(value)[0] for value in batch.values()}
    if len(sizes) != 1:
        raise ValueError(f"batch arrays must share their first axis, got sizes {sorted(sizes)}")
    return sizes.pop()


def _trainer_runner(
    method: str, make_model: Callable[[], nnx.Module], loss: Loss, batch: Mapping[str, Any],
    settings: ThroughputSettings,
) -> Runner:  # fmt: skip
    """A `Trainer` step on the whole batch (no padding, one jitted call): the private step
    (trainer_dp, lora_dp; the index batch gathered on the host) or the public one
    (lora_nonprivate; the batch moved to the device each step)."""
    model = make_model()
    mask = None
    if method.startswith("lora"):
        lora.add_lora(model, settings.lora, rngs=nnx.Rngs(1))
        mask = lora.trainable_mask(model)
    batch_size = _batch_size(batch)
    private = method != "lora_nonprivate"
    dp = dict(
        private=True, clip_norm=settings.clip_norm, delta=1e-5,
        noise_multiplier=settings.noise_multiplier, pad_multiple=batch_size,
    ) if private else {}  # fmt: skip
    config = TrainConfig(
        steps=1000, batch_size=batch_size, learning_rate=settings.learning_rate,
        optimizer="sgd", progress=False, **dp,
    )  # fmt: skip
    trainer = engine.Trainer(
        config, model, loss, trainable_mask=mask,
        num_units=10 * batch_size if private else None,
        noise_key=jax.random.key(1) if private else None,
    )  # fmt: skip
    state = {"state": trainer.init_state()}
    indices, unit_mask = np.arange(batch_size), np.ones(batch_size, bool)
    jitted = trainer.jitted_step(state["state"])
    memory = None
    if settings.memory_analysis:
        args = (trainer.frozen, trainer.rest, jax.tree.map(jnp.asarray, dict(batch)))
        memory = _memory(jitted, state["state"], *args, *([jnp.asarray(unit_mask)] * private))

    def gather(idx):
        return {k: np.asarray(v)[idx] for k, v in batch.items()}

    def run():
        if private:
            new = trainer.noisy_step(state["state"], gather, indices, unit_mask)
        else:
            new, _ = trainer.public_step(state["state"], lambda rng: dict(batch), None)
        jax.block_until_ready(new.params)
        state["state"] = new

    count = sum(x.size for x in jax.tree.leaves(state["state"].params))
    # Compiled programs of the jitted step (clipped sum, noise and update in one call).
    return Runner(
        method, run, memory, lambda: jitted._cache_size(), int(count),
        params=lambda: state["state"].params,
    )  # fmt: skip


def build_runner(
    method: str,
    make_model: Callable[[], nnx.Module],
    loss: Loss,
    batch: Mapping[str, Any],
    settings: ThroughputSettings,
) -> Runner:
    """The `Runner` of `method` (one of `METHODS`) for a fresh model from `make_model`."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if method in _TRAINER_METHODS:
        return _trainer_runner(method, make_model, loss, batch, settings)
    batch_size = _batch_size(batch)
    microbatch = settings.microbatch_size if method == "dp_microbatch" else None
    if method == "dp_microbatch" and (microbatch is None or batch_size % microbatch):
        raise ValueError(
            f"dp_microbatch needs a microbatch_size dividing the batch size {batch_size}, got "
            f"{microbatch}"
        )
    model = make_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    device_batch = jax.tree.map(jnp.asarray, dict(batch))
    mask = jnp.ones(batch_size, bool)
    traces = [0]
    if method == "nonprivate":
        optimizer = optax.sgd(settings.learning_rate)

        def mean_loss(p, b):
            return jnp.mean(loss(nnx.merge(graphdef, p, rest), b))

        def step(p, state, b, m):
            traces[0] += 1
            del m
            _, grads = jax.value_and_grad(mean_loss)(p, b)
            updates, state = optimizer.update(grads, state, p)
            return optax.apply_updates(p, updates), state, None
    else:
        grad_sum = model_clipped_grad_sum(
            model, loss, clip_norm=settings.clip_norm, method=_CLIPPING[method],
            microbatch_size=microbatch,
        )  # fmt: skip
        bandmf = method == "dp_bandmf"
        optimizer = noise.private_optimizer(
            optax.sgd(settings.learning_rate), noise_multiplier=settings.noise_multiplier,
            sensitivity=grad_sum.sensitivity(), expected_batch_size=float(batch_size),
            key=jax.random.key(1),
            strategy=correlated_noise.sqrt_prefix_sum(settings.bands) if bandmf else None,
        )  # fmt: skip
        dp_step = noise.make_dp_sgd_step(grad_sum, optimizer)

        def step(p, state, b, m):
            traces[0] += 1
            return dp_step(p, state, b, m)

    jitted = jax.jit(step)
    state = {"params": params, "opt": optimizer.init(params)}
    memory = None
    if settings.memory_analysis:
        memory = _memory(jitted, params, state["opt"], device_batch, mask)

    def run():
        p, s, _ = jitted(state["params"], state["opt"], device_batch, mask)
        jax.block_until_ready(p)
        state["params"], state["opt"] = p, s

    count = sum(x.size for x in jax.tree.leaves(params))
    return Runner(method, run, memory, lambda: traces[0], int(count), lambda: state["params"])


def time_runners(
    runners: Sequence[Runner], settings: ThroughputSettings, *, batch_size: int
) -> list[dict]:
    """Times warmed-up `runners` interleaved (`settings.rounds` rounds of `steps_per_round`
    steps each) and returns one row per runner."""
    warm_traces = {r.method: r.traces() for r in runners}
    for _ in range(settings.rounds):
        for runner in runners:
            times = []
            for _ in range(settings.steps_per_round):
                start = time.perf_counter()
                runner.step()
                times.append(time.perf_counter() - start)
            runner.times.append(times)
    rows = []
    for runner in runners:
        all_times = [t for rnd in runner.times for t in rnd]
        medians = [statistics.median(rnd) for rnd in runner.times]
        traces = runner.traces()
        rows.append({
            "batch_size": batch_size,
            "method": runner.method,
            "examples_per_second": batch_size / statistics.median(all_times),
            "median_step_seconds": statistics.median(all_times),
            "round_median_range_seconds": [min(medians), max(medians)],
            "peak_memory_bytes": runner.peak_memory_bytes,
            "trainable_parameters": runner.trainable_parameters,
            "compiles": None if traces is None else traces - warm_traces[runner.method],
            "compiles_warmup": warm_traces[runner.method],
        })  # fmt: skip
    return rows


def throughput(
    make_model: Callable[[], nnx.Module],
    loss: Loss,
    batch: Mapping[str, Any],
    *,
    methods: Sequence[str] = DEFAULT_METHODS,
    settings: ThroughputSettings | None = None,
) -> list[dict]:
    """Times one training step of every method in `methods` on `batch` (module docstring).

    Args:
        make_model: returns a fresh model (called once per method).
        loss: `loss(model, batch) -> (B,)` per-example losses.
        batch: arrays with the B examples on axis 0 (one fixed batch, reused every step).
        methods: a subset of `METHODS` ("lora_*" need a GPT-2 or Llama-family model).
        settings: timing and step settings (default `ThroughputSettings()`).

    Returns:
        One row per method, in the order of `methods` (see `time_runners`).

    Raises:
        ValueError: one line naming the method or setting that cannot run.
    """
    settings = ThroughputSettings() if settings is None else settings
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise ValueError(f"methods must be a non-empty subset of {', '.join(METHODS)}")
    batch_size = _batch_size(batch)
    runners = []
    for method in methods:
        runner = build_runner(method, make_model, loss, batch, settings)
        for _ in range(settings.warmup_steps):
            runner.step()
        runners.append(runner)
    return time_runners(runners, settings, batch_size=batch_size)


def ratios(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each method's median step time over the non-private step's (the rows of one batch)."""
    steps = {row["method"]: row["median_step_seconds"] for row in rows}
    if "nonprivate" not in steps:
        raise ValueError("ratios need the nonprivate row")
    return {m: t / steps["nonprivate"] for m, t in steps.items() if m != "nonprivate"}


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a markdown table, with each method's step time over non-private's."""
    over = ratios(rows) if any(r["method"] == "nonprivate" for r in rows) else {}
    lines = [
        "| method | batch | examples/s | median step (s) | / non-private | memory (MiB) | "
        "compiles after warm-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio, memory = over.get(row["method"]), row["peak_memory_bytes"]
        cells = [
            row["method"], str(row["batch_size"]), f"{row['examples_per_second']:.1f}",
            f"{row['median_step_seconds']:.4f}", "-" if ratio is None else f"{ratio:.2f}",
            "-" if memory is None else f"{memory / 2**20:.1f}", str(row["compiles"]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """A model to time: what the FACTORY of `dpmix bench --model MODULE:FACTORY` returns.

    Attributes:
        make_model: returns a fresh model (called once per method).
        loss: `loss(model, batch) -> (B,)` per-example losses.
        batch: arrays with the B examples on axis 0.
        methods: the methods to time (a subset of `METHODS`).
        name: how the report names the model.
    """

    make_model: Callable[[], nnx.Module]
    loss: Loss
    batch: Mapping[str, Any]
    methods: Sequence[str] = DEFAULT_METHODS
    name: str = "model"

    def __post_init__(self) -> None:
        if not callable(self.make_model) or not callable(self.loss):
            raise ValueError("make_model and loss must be callables")
        if not isinstance(self.batch, Mapping) or not self.batch:
            raise ValueError("batch must be a non-empty dict of arrays")
        _batch_size(self.batch)
        if not self.methods or any(m not in METHODS for m in self.methods):
            raise ValueError(f"methods must be a non-empty subset of {', '.join(METHODS)}")


def load_target(spec: str) -> Target:
    """The `Target` that `MODULE:FACTORY` names: `FACTORY()` of the imported MODULE.

    Raises:
        ValueError: one line: not of the form MODULE:FACTORY, a module that does not import,
            no such factory, or a factory that does not return a `Target`.
    """
    module_name, sep, factory_name = spec.partition(":")
    if not sep or not module_name or not factory_name:
        raise ValueError(f"--model takes MODULE:FACTORY (e.g. my_models:tiny), got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--model {spec}: module {module_name} does not import ({err})") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: {module_name} has no callable {factory_name}")
    target = factory()
    if not isinstance(target, Target):
        raise ValueError(
            f"--model {spec}: {factory_name}() returned a {type(target).__name__}, not a "
            "dpmix_jax.bench.Target"
        )
    return target
