"""The `dpmix` command: parses, builds a config, calls the library.

dpmix demo [image|text] [--out DIR] [--epsilons 1 2 5] [--seeds 0 1 2] [--methods ...]
dpmix run EXPERIMENT [--distributed] [experiment arguments ...]
dpmix audit [arguments ...]          (= dpmix run audit ...)
dpmix bench [arguments ...]          (= dpmix run bench_grads ...)
dpmix experiments                    (lists the experiments)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pathlib
import runpy
import sys
import time

EXPERIMENTS = {
    "quickstart": "DP-SGD on scikit-learn digits with the privacy core only",
    "nih_chexpert": "NIH ChestX-ray14 with CheXpert as public data (14 tasks, macro AUC)",
    "nih_mimic": "NIH ChestX-ray14 with MIMIC-CXR as public data (14 tasks, macro AUC)",
    "enron": "Enron sent mail, user-level DP, Common Pile domains as public data",
    "openwebmath": "OpenWebMath, example-level DP",
    "k_scaling": "excess MixMin loss against the number of public sources k",
    "ablations": "ρ, proxy epochs, and parallel vs sequential composition",
    "clip_study": "clipping bias: excess loss against C, with and without the gradient shift",
    "audit": "canary audits of the released λ and of DP-SGD",
    "hot_pate": "Hot PATE: coordinated vs independent ensembles, private generation",
    "bench_grads": "per-example gradient throughput against non-private steps and Opacus",
}

_SHORTCUTS = {"audit": "audit", "bench": "bench_grads"}  # dpmix NAME ... = dpmix run TARGET ...


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dpmix",
        description="Differentially private learning with public data: DP-MixMin and Hot PATE.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo",
        help="end-to-end DP-MixMin against the baselines on an embedded default data set",
        description=(
            "Runs DP-MixMin, Uniform, Random Init, Random Search and non-private MixMin at each "
            "ε and seed on an embedded default (offline, a few minutes on 2 CPU cores) and "
            "writes results.json, results.md and plots to --out. Finished stages are stored "
            "under --out/stages, so an interrupted demo resumes."
        ),
    )
    demo.add_argument("dataset", nargs="?", choices=("image", "text"), default="image")
    demo.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/demo"))
    demo.add_argument("--epsilons", type=_positive_float, nargs="+", default=[1.0, 2.0, 5.0])
    demo.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    demo.add_argument(
        "--methods",
        nargs="+",
        default=None,
        help="subset of: dp_mixmin uniform random_init random_search nonprivate_mixmin",
    )
    demo.add_argument("--quiet", action="store_true", help="no progress bar")

    run = commands.add_parser(
        "run",
        help="run a paper experiment (see `dpmix experiments`)",
        description="Runs `python -m experiments.EXPERIMENT` with the remaining arguments.",
    )
    run.add_argument("experiment", choices=sorted(EXPERIMENTS), metavar="EXPERIMENT")
    run.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() first (TPU pods, multi-host GPU)",
    )
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the experiment")

    for name, target in _SHORTCUTS.items():
        # Every argument goes to the experiment (collected by `main`: argparse's REMAINDER
        # does not take options as a subcommand's first argument).
        sub = commands.add_parser(name, help=EXPERIMENTS[target], add_help=False)
        sub.set_defaults(experiment=target, distributed=False)
    commands.add_parser("experiments", help="list the experiments")
    return parser


def _demo(args: argparse.Namespace) -> int:
    from dpmix_jax.pipeline import METHODS, run_comparison
    from dpmix_jax.pipeline.common import use_compilation_cache

    methods = args.methods or list(METHODS)
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise SystemExit(f"dpmix demo: unknown method(s) {unknown}; choose from {list(METHODS)}")
    start = time.time()
    use_compilation_cache(args.out / "xla_cache")
    if args.dataset == "image":
        from dpmix_jax.pipeline.image import ImagePipeline
        from dpmix_jax.pipeline.presets import digit_task, image_demo_config

        task = digit_task()
        pipeline = ImagePipeline(task, image_demo_config(), args.out / "stages")
        metric, higher = "test AUC", True
    else:
        from dpmix_jax.pipeline.text import TextPipeline
        from dpmix_jax.pipeline.text_presets import text_demo_config, text_task

        task = text_task()
        pipeline = TextPipeline(task, text_demo_config(), args.out / "stages")
        metric, higher = "test perplexity", False
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
    )
    print((args.out / "results.md").read_text())
    print(f"{len(results['runs'])} runs in {time.time() - start:.0f} s; outputs in {args.out}/")
    return 0


def _initialize_distributed() -> None:
    from dpmix_jax import parallel

    def env_int(name: str) -> int | None:
        return int(os.environ[name]) if name in os.environ else None

    parallel.initialize(
        parallel.MeshConfig(
            distributed=True,
            coordinator_address=os.environ.get("JAX_COORDINATOR_ADDRESS"),
            num_processes=env_int("JAX_NUM_PROCESSES"),
            process_id=env_int("JAX_PROCESS_ID"),
        )
    )


def _run_experiment(args: argparse.Namespace) -> int:
    module = f"experiments.{args.experiment}"
    if importlib.util.find_spec(module) is None:
        raise SystemExit(
            f"dpmix run: {module} is not importable; run dpmix from the project checkout "
            "(the experiments/ folder) or install the project with `pip install -e .`."
        )
    if args.distributed:
        _initialize_distributed()
    sys.argv = [module, *args.args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if args.command in _SHORTCUTS:
        args.args = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "demo":
        return _demo(args)
    if args.command == "experiments":
        width = max(map(len, EXPERIMENTS))
        for name, text in EXPERIMENTS.items():
            print(f"{name:<{width}}  {text}")
        return 0
    return _run_experiment(args)


if __name__ == "__main__":
    sys.exit(main())
