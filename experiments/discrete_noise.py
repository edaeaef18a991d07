"""Exact discrete noise for Hot PATE's vote counts: sampler speed and ε against continuous noise.

For a GPT-2 vocabulary (V = 50,257 counts) it times the exact samplers of
`dpmix_jax.privacy.discrete_noise` (discrete Laplace, discrete Gaussian; integer arithmetic
only) against numpy's floating-point Laplace and Gaussian draws, and compares, from dp-accounting,
the ε of one aggregator call with discrete and with continuous noise of the same scale: DPARGMAX /
DPWS (Laplace scale 2/ε) and the noisy argmax of confident-GNMax (Gaussian σ, two counts moved by
one vote). Writes `discrete_noise.json` and `discrete_noise.md` to `--out`.

    python -m experiments.discrete_noise --out DIR

Settings and measured results: `experiments/configs/discrete_noise.py`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time

import dp_accounting
import numpy as np

from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import SEEDED_NOTE, accounting, discrete_noise
from experiments.common_args import experiment_main
from experiments.configs.discrete_noise import DiscreteNoiseConfig, get_config
from experiments.harness import Command, finish


def _rate(draw, size: int, repeats: int) -> float:
    """Samples per second of `draw()` (median over `repeats` calls, after one warm-up)."""
    draw()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        draw()
        times.append(time.perf_counter() - start)
    return size / float(np.median(times))


def speed_rows(config: DiscreteNoiseConfig, rng: np.random.Generator) -> list[dict]:
    """Samples/s of each sampler for one vector of `vocab_size` counts."""
    size, repeats = config.vocab_size, config.repeats
    rows = []
    for epsilon in config.laplace_epsilons[:1] + config.laplace_epsilons[-1:]:
        scale = pate_accounting.discrete_laplace_scale(epsilon)
        rows.append(
            {
                "noise": f"Laplace, scale 2/ε = {float(scale):g}",
                "exact_per_s": _rate(
                    lambda s=scale: discrete_noise.discrete_laplace(size, s, rng), size, repeats
                ),
                "float_per_s": _rate(
                    lambda s=scale: rng.laplace(0.0, float(s), size), size, repeats
                ),
            }
        )
    for sigma in config.gaussian_sigmas[:1] + config.gaussian_sigmas[-1:]:
        rows.append(
            {
                "noise": f"Gaussian, σ = {sigma:g}",
                "exact_per_s": _rate(
                    lambda s=sigma: discrete_noise.discrete_gaussian(size, s * s, rng),
                    size,
                    repeats,
                ),
                "float_per_s": _rate(lambda s=sigma: rng.normal(0.0, s, size), size, repeats),
            }
        )
    return rows


def epsilon_rows(config: DiscreteNoiseConfig) -> list[dict]:
    """ε at `delta` of one call, discrete against continuous noise of the same scale."""
    rows = []
    for epsilon in config.laplace_epsilons:
        rows.append(
            {
                "mechanism": f"DPARGMAX / DPWS, ε = {epsilon:g} (Laplace scale {2 / epsilon:g})",
                "discrete": accounting.epsilon(
                    pate_accounting.dpargmax_discrete_laplace_event(epsilon), delta=config.delta
                ),
                "continuous": accounting.epsilon(
                    pate_accounting.dpargmax_laplace_event(epsilon), delta=config.delta
                ),
            }
        )
    for sigma in config.gaussian_sigmas:
        rows.append(
            {
                "mechanism": f"GNMax noisy argmax, σ = {sigma:g}",
                "discrete": discrete_noise.discrete_gaussian_epsilon(
                    sigma * sigma, (1, 1), delta=config.delta
                ),
                "continuous": accounting.epsilon(
                    dp_accounting.GaussianDpEvent(sigma / math.sqrt(2)), delta=config.delta
                ),
            }
        )
    return rows


def markdown(results: dict) -> str:
    """The two tables of the docs page, from the results."""
    lines = [
        f"Samplers, one vector of V = {results['config']['vocab_size']:,} counts "
        f"(median of {results['config']['repeats']} calls):",
        "",
        "| noise | exact discrete (samples/s) | numpy float (samples/s) |",
        "|---|---|---|",
    ]
    for row in results["speed"]:
        lines.append(f"| {row['noise']} | {row['exact_per_s']:.3g} | {row['float_per_s']:.3g} |")
    lines += [
        "",
        f"ε of one call at δ = {results['config']['delta']:g} (dp-accounting PLD), one vote "
        "moved (two counts change by 1):",
        "",
        "| mechanism | discrete noise | continuous noise |",
        "|---|---|---|",
    ]
    for row in results["epsilon"]:
        lines.append(f"| {row['mechanism']} | {row['discrete']:.4f} | {row['continuous']:.4f} |")
    lines += ["", SEEDED_NOTE if results["noise_seeded"] else "Noise from secret randomness."]
    return "\n".join(lines)


def main(
    config: DiscreteNoiseConfig, out: pathlib.Path | None = None, *, reproducible: bool = False
) -> dict:
    """Runs the study; returns the results (also written to `out` when given)."""
    start = time.time()
    rng = discrete_noise.make_rng(np.random.default_rng(config.seed) if reproducible else None)
    results = {
        "config": dataclasses.asdict(config),
        **provenance(),
        "noise_seeded": reproducible,
        "speed": speed_rows(config, rng),
        "epsilon": epsilon_rows(config),
    }
    results["wall_s"] = time.time() - start
    return finish(out, results, markdown(results), name="discrete_noise")


cli = Command(
    name="discrete_noise",
    description=__doc__.splitlines()[0],
    writes="discrete_noise.json, discrete_noise.md",
    examples=("--out runs/discrete_noise",),
    seeds="one",
    seeds_default="the study's",
    config=lambda args: get_config(),
    run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
)


if __name__ == "__main__":
    with experiment_main("discrete_noise"):
        cli()
