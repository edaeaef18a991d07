"""Exact discrete noise for Hot PATE's vote counts: sampler speed and ε against continuous noise.

For a GPT-2 vocabulary (V = 50,257 counts) it times the exact samplers of
`dpmix_jax.privacy.discrete_noise` (discrete Laplace, discrete Gaussian; integer arithmetic
only) against numpy's floating-point Laplace and Gaussian draws, and compares, from dp-accounting,
the ε of one aggregator call with discrete and with continuous noise of the same scale: DPARGMAX /
DPWS (Laplace scale 2/ε) and the noisy argmax of confident-GNMax (Gaussian σ, two counts moved by
one vote). Writes `discrete_noise.json` and `discrete_noise.md` to `--out`.

    python -m experiments.discrete_noise --out DIR
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time

import dp_accounting
import numpy as np

from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pipeline.compare import provenance
from dpmix_jax.privacy import SEEDED_NOTE, accounting, discrete_noise, validation
from experiments.common_args import (
    add_reproducible_flag,
    add_seeds_option,
    experiment_main,
    experiment_parser,
    with_common_options,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiscreteNoiseConfig:
    """Settings of the study (see the module docstring).

    Attributes:
        vocab_size: counts noised per call.
        repeats: timed calls per sampler (the median is reported).
        laplace_epsilons: per-call ε of DPARGMAX / DPWS (Laplace scale 2/ε).
        gaussian_sigmas: σ of the Gaussian noisy argmax (integers: σ² is an exact integer).
        delta: δ of the ε comparison.
        seed: the samplers' seed with `--reproducible`.
    """

    vocab_size: int = 50_257
    repeats: int = 7
    laplace_epsilons: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0)
    gaussian_sigmas: tuple[int, ...] = (1, 2, 5, 10, 40)
    delta: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        validation.check_steps(self.vocab_size, "vocab_size")
        validation.check_steps(self.repeats, "repeats")
        for epsilon in self.laplace_epsilons:
            validation.check_epsilon(epsilon, "laplace_epsilons")
        for sigma in self.gaussian_sigmas:
            validation.check_positive(sigma, "gaussian_sigmas")
        validation.check_delta(self.delta)


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
    text = markdown(results)
    print(text)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "discrete_noise.json").write_text(json.dumps(results, indent=1) + "\n")
        (out / "discrete_noise.md").write_text(text + "\n")
    return results


def cli(argv: list[str] | None = None) -> dict:
    parser = experiment_parser(
        "discrete_noise", __doc__.splitlines()[0], examples=("--out runs/discrete_noise",)
    )
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs/discrete_noise"),
        metavar="DIR",
        help="output folder: discrete_noise.json, discrete_noise.md",
    )
    add_reproducible_flag(parser, seeds="--seeds")
    add_seeds_option(parser, single=True, default="the study's")
    args = parser.parse_args(argv)
    return main(
        with_common_options(DiscreteNoiseConfig(), args), args.out, reproducible=args.reproducible
    )


if __name__ == "__main__":
    with experiment_main("discrete_noise"):
        cli()
