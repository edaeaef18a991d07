"""BandMF correlated noise against DP-SGD's independent noise, at equal ε.

Three measurements, each for independent noise and BandMF with several band counts b (cyclic
Poisson sampling over b partitions, accounted as DP-SGD with ceil(T / b) steps at the
partition's rate, σ calibrated to the same target ε):

- fine-tuning: the image demo's private fine-tuning on the digits default (`presets.digit_task`,
  `image_demo_config`) from a random initialisation ("random_init", all of the train split) for
  several epochs; test macro AUC, mean ± std over seeds;
- DP-MixMin: mirror descent on the synthetic exact-mixture problem of `experiments.k_scaling`;
  excess MixMin loss over non-private MixMin and cosine of λ to it, mean ± std over seeds;
- the noise step: time of one jitted noise transformation update on a parameter vector.

    python -m experiments.correlated_noise --out DIR [--reproducible]
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax import mixing
from dpmix_jax.cli import add_reproducible_flag, experiment_main, experiment_parser
from dpmix_jax.pipeline import presets
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.pipeline.image import ImagePipeline
from dpmix_jax.privacy import SEEDED_NOTE, accounting, correlated_noise, noise, randomness
from experiments.k_scaling import mixture_problem


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrelatedNoiseConfig:
    """Settings of the study (see the module docstring); `bands` lists BandMF's b values (the
    independent-noise baseline is always run)."""

    bands: tuple[int, ...] = (2, 8)
    epsilons: tuple[float, ...] = (1.0, 4.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    finetune_steps: int = 150
    mixmin_examples: int = 20_000
    mixmin_sources: int = 8
    mixmin_steps: int = 300
    mixmin_batch_size: int = 1000
    mixmin_clip_norm: float = 10.0
    mixmin_learning_rate: float = 0.2
    delta: float = 1e-5
    bench_size: int = 1_000_000
    bench_repeats: int = 20

    def __post_init__(self) -> None:
        for b in self.bands:
            correlated_noise.check_bands(b)
        for epsilon in self.epsilons:
            accounting.check_epsilon(epsilon)
        accounting.check_delta(self.delta)
        accounting.check_steps(self.finetune_steps, "finetune_steps")
        accounting.check_steps(self.mixmin_steps, "mixmin_steps")
        accounting.check_steps(self.bench_repeats, "bench_repeats")
        if not self.seeds:
            raise ValueError("seeds must name at least one seed.")


def _settings(config: CorrelatedNoiseConfig) -> list[tuple[str, dict]]:
    """(label, noise settings) of every compared mechanism."""
    settings = [("DP-SGD", {"noise": "independent", "bands": None})]
    return settings + [(f"BandMF b={b}", {"noise": "bandmf", "bands": b}) for b in config.bands]


def _mean_std(values: list[float]) -> list[float]:
    return [statistics.fmean(values), statistics.pstdev(values)]


def finetune_rows(config: CorrelatedNoiseConfig, root: pathlib.Path, reproducible: bool) -> list:
    """Test AUC of private fine-tuning from a random initialisation, per mechanism and ε."""
    task = presets.digit_task()
    rows = []
    for label, settings in _settings(config):
        demo = presets.image_demo_config()
        pipeline_config = dataclasses.replace(
            demo,
            finetune=dataclasses.replace(demo.finetune, steps=config.finetune_steps, **settings),
        )
        folder = root / label.replace(" ", "_").replace("=", "")
        pipeline = ImagePipeline(task, pipeline_config, folder, reproducible=reproducible)
        for epsilon in config.epsilons:
            runs = [pipeline.run("random_init", epsilon, seed) for seed in config.seeds]
            examples = len(pipeline.task.train)
            rows.append(
                {
                    "mechanism": label,
                    "epsilon": epsilon,
                    "test_auc": _mean_std([r.utility for r in runs]),
                    "max_spent_epsilon": max(r.spent.epsilon for r in runs),
                    "epochs": config.finetune_steps * demo.finetune.batch_size / examples,
                }
            )
            print(rows[-1], flush=True)
    return rows


def mixmin_rows(config: CorrelatedNoiseConfig, reproducible: bool) -> list:
    """Excess loss and cosine of DP-MixMin's λ to non-private MixMin, per mechanism and ε."""
    problems = []
    for seed in config.seeds:
        preds, _ = mixture_problem(
            num_examples=config.mixmin_examples, num_sources=config.mixmin_sources, seed=seed
        )
        reference = np.asarray(mixing.mixmin(preds, steps=2000, learning_rate=2.0))
        noise_seed = seed if reproducible else randomness.secret_seed()
        problems.append((preds, reference, noise_seed))
    rows = []
    for label, settings in _settings(config):
        for epsilon in config.epsilons:
            excess, cosine, spent, sigma = [], [], [], None
            for preds, reference, noise_seed in problems:
                result = mixing.dp_mixmin(
                    preds,
                    epsilon=epsilon,
                    delta=config.delta,
                    steps=config.mixmin_steps,
                    batch_size=config.mixmin_batch_size,
                    clip_norm=config.mixmin_clip_norm,
                    learning_rate=config.mixmin_learning_rate,
                    seed=noise_seed,
                    **settings,
                )
                excess.append(mixing.excess_loss(result.weights, reference, preds))
                cosine.append(mixing.cosine_similarity(result.weights, reference))
                spent.append(result.epsilon)
                sigma = result.noise_multiplier
            rows.append(
                {
                    "mechanism": label,
                    "epsilon": epsilon,
                    "noise_multiplier": sigma,
                    "excess_loss": _mean_std(excess),
                    "cosine": _mean_std(cosine),
                    "max_spent_epsilon": max(spent),
                }
            )
            print(rows[-1], flush=True)
    return rows


def noise_step_rows(config: CorrelatedNoiseConfig) -> list:
    """Median wall time of one jitted noise update on a float32 vector of `bench_size`."""
    params = jnp.zeros(config.bench_size, jnp.float32)
    key = jax.random.key(0)  # timing only: this noise protects nothing
    transformations = [("DP-SGD", noise.add_gaussian_noise(1.0, key))]
    transformations += [
        (
            f"BandMF b={b}",
            correlated_noise.add_correlated_noise(1.0, correlated_noise.sqrt_prefix_sum(b), key),
        )
        for b in config.bands
    ]
    rows = []
    for label, transformation in transformations:
        update = jax.jit(transformation.update)
        state = transformation.init(params)
        updates, state = update(params, state)  # compile
        jax.block_until_ready(updates)
        times = []
        for _ in range(config.bench_repeats):
            start = time.perf_counter()
            updates, state = update(params, state)
            jax.block_until_ready(updates)
            times.append(time.perf_counter() - start)
        rows.append(
            {
                "mechanism": label,
                "parameters": config.bench_size,
                "median_ms": 1e3 * statistics.median(times),
                "state_copies": len(getattr(state, "history", ())),
            }
        )
        print(rows[-1], flush=True)
    return rows


def markdown(results: dict) -> str:
    """The tables of `results` (numbers as stored in the JSON, rounded for display)."""
    config = results["config"]
    lines = [
        f"Private fine-tuning of the image demo (digits, random initialisation, "
        f"{config['finetune_steps']} steps, {results['finetune'][0]['epochs']:.1f} epochs), "
        f"test macro AUC, mean ± std over {len(config['seeds'])} seeds:",
        "",
        "| mechanism | ε | test AUC | spent ε (max) |",
        "|---|---|---|---|",
    ]
    for r in results["finetune"]:
        auc = r["test_auc"]
        lines.append(
            f"| {r['mechanism']} | {r['epsilon']:g} | {auc[0]:.4f} ± {auc[1]:.4f} | "
            f"{r['max_spent_epsilon']:.3f} |"
        )
    lines += [
        "",
        f"DP-MixMin (mirror descent; k = {config['mixmin_sources']}, n = "
        f"{config['mixmin_examples']}, T = {config['mixmin_steps']}, batch "
        f"{config['mixmin_batch_size']}, C = {config['mixmin_clip_norm']:g}, η = "
        f"{config['mixmin_learning_rate']:g}), against non-private MixMin, mean ± std:",
        "",
        "| mechanism | ε | σ | excess loss | cosine | spent ε (max) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["mixmin"]:
        excess, cosine = r["excess_loss"], r["cosine"]
        lines.append(
            f"| {r['mechanism']} | {r['epsilon']:g} | {r['noise_multiplier']:.3f} | "
            f"{excess[0]:.2e} ± {excess[1]:.1e} | {cosine[0]:.4f} ± {cosine[1]:.4f} | "
            f"{r['max_spent_epsilon']:.3f} |"
        )
    lines += [
        "",
        "One jitted noise update (median wall time):",
        "",
        "| mechanism | parameters | ms | float32 parameter copies in the state |",
        "|---|---|---|---|",
    ]
    for r in results["noise_step"]:
        lines.append(
            f"| {r['mechanism']} | {r['parameters']} | {r['median_ms']:.2f} | {r['state_copies']} |"
        )
    origin = results["provenance"]
    lines += [
        "",
        SEEDED_NOTE if results["noise_seeded"] else "Private randomness secret (operating system).",
        f"Command: `{origin['command']}`, {results['wall_s']:.0f} s on {origin['cpu_count']} "
        f"CPU cores ({origin['backend']}), {origin['date']}, commit {origin['commit']}.",
    ]
    return "\n".join(lines)


def main(config: CorrelatedNoiseConfig, out: pathlib.Path, *, reproducible: bool = False) -> dict:
    """Runs the study; writes `results.json` and `results.md` to `out` (stages under it)."""
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "config": dataclasses.asdict(config),
        "provenance": provenance(),
        "noise_seeded": reproducible,
        "finetune": finetune_rows(config, out / "stages", reproducible),
        "mixmin": mixmin_rows(config, reproducible),
        "noise_step": noise_step_rows(config),
    }
    results["wall_s"] = time.time() - start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    (out / "results.md").write_text(text + "\n")
    print(text)
    return results


def cli(argv: list[str] | None = None) -> dict:
    parser = experiment_parser(
        "correlated_noise", __doc__.splitlines()[0], examples=("--reproducible",)
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs/correlated_noise"),
        metavar="DIR",
        help="output folder: results.json, results.md, stages/",
    )
    add_reproducible_flag(parser, seeds="the config's seeds")
    args = parser.parse_args(argv)
    return main(CorrelatedNoiseConfig(), args.out, reproducible=args.reproducible)


if __name__ == "__main__":
    with experiment_main("correlated_noise"):
        cli()
