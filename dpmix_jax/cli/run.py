"""`dpmix run EXPERIMENT`, its shortcuts (`dpmix audit`, `dpmix bench`) and `dpmix experiments`.

The experiments are the modules of the `experiments` package that run as programs: each is
listed with the first line of its docstring, read from its file, so that neither a list kept by
hand nor an import (of JAX) is needed to show them.
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import runpy
import sys

from dpmix_jax.cli import arguments

SHORTCUTS = {"audit": "audit", "bench": "bench_grads"}  # dpmix NAME ... = dpmix run TARGET ...


def experiments() -> dict[str, str]:
    """{name: the first line of its docstring} of every runnable module of `experiments`."""
    spec = importlib.util.find_spec("experiments")
    if spec is None or not spec.submodule_search_locations:
        return {}
    found = {}
    for path in sorted(pathlib.Path(spec.submodule_search_locations[0]).glob("*.py")):
        text = path.read_text()
        if '\nif __name__ == "__main__":' in text and text.startswith('"""'):
            found[path.stem] = text[3:].split("\n", 1)[0].strip().rstrip(".")
    return found


EXPERIMENTS = experiments()


def add_commands(commands: argparse._SubParsersAction) -> None:
    """Adds `dpmix run`, the shortcuts and `dpmix experiments`."""
    width = max(map(len, EXPERIMENTS))
    run = commands.add_parser(
        "run",
        help="run a paper experiment (see `dpmix experiments`)",
        description=(
            "Runs `python -m experiments.EXPERIMENT` with the remaining arguments; "
            "`dpmix run EXPERIMENT --help` shows the experiment's own options.\n\nexperiments:\n"
            + "\n".join(f"  {name:<{width}}  {text}" for name, text in EXPERIMENTS.items())
        ),
        epilog=arguments.examples(
            "dpmix run",
            "k_scaling --preset cpu",
            "enron --preset cpu --out runs/enron",
            "nih_chexpert --preset paper --nih-root data/nih --public-root data/chexpert",
            "audit --help",
        ),
        formatter_class=arguments.HelpFormatter,
    )
    run.add_argument(
        "experiment",
        choices=list(EXPERIMENTS),
        metavar="EXPERIMENT",
        help="one of: " + ", ".join(EXPERIMENTS),
    )
    run.add_argument(
        "args",
        nargs=argparse.REMAINDER,
        help="arguments of the experiment (each also takes --mesh and --distributed)",
    )

    for name, target in SHORTCUTS.items():
        # Every argument goes to the experiment (collected by `main`: argparse's REMAINDER
        # does not take options as a subcommand's first argument).
        sub = commands.add_parser(name, help=EXPERIMENTS[target], add_help=False)
        sub.set_defaults(experiment=target)
    commands.add_parser(
        "experiments", help="list the experiments", formatter_class=arguments.HelpFormatter
    )


def run(args: argparse.Namespace) -> int:
    """Runs `python -m experiments.NAME` with the remaining arguments, named as invoked."""
    module = f"experiments.{args.experiment}"
    if importlib.util.find_spec(module) is None:
        raise SystemExit(
            f"dpmix run: {module} is not importable; run dpmix from the project checkout "
            "(the experiments/ folder) or install the project with `pip install -e .`."
        )
    sys.argv = [module, *args.args]
    shortcut = args.command in SHORTCUTS
    program = f"dpmix {args.command}" if shortcut else f"dpmix run {args.experiment}"
    with arguments.experiment_program_as(program):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def list_experiments() -> int:
    """`dpmix experiments`: one line per experiment."""
    width = max(map(len, EXPERIMENTS))
    for name, text in EXPERIMENTS.items():
        print(f"{name:<{width}}  {text}")
    return 0
