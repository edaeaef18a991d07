"""The `dpmix` command: parses, builds a config, calls the library.

dpmix demo [image|text] [--out DIR] [--epsilons 1 2 5] [--seeds 0 1 2] [--delta 1e-5]
           [--noise independent|bandmf --bands B] ...
dpmix run EXPERIMENT [--mesh data=D,model=M] [--distributed] [experiment arguments ...]
dpmix audit [arguments ...]          (= dpmix run audit ...)
dpmix bench [arguments ...]          (= dpmix run bench_grads ...)
dpmix experiments                    (lists the experiments)
dpmix report [--add NAME=RUN_DIR ...] [--check]   (README tables from docs/results/*.json)
dpmix generate [--documents DIR] [--model DIR] [--epsilon 1] [--out DIR] ...   (Hot PATE text)

One module per command (`demo`, `generate`, `report`, `run`); `arguments` holds what every
command and experiment parser shares, `errors` how they end on bad input or Ctrl-C. No option
may be abbreviated.
"""

from __future__ import annotations

import argparse
import sys

from dpmix_jax import checkout
from dpmix_jax.cli import arguments, demo, errors, generate, report, run


def build_parser() -> argparse.ArgumentParser:
    """The parser of `dpmix` and all its commands."""
    parser = arguments.ArgumentParser(
        prog="dpmix",
        description="Differentially private learning with public data: DP-MixMin and Hot PATE.",
        epilog=arguments.examples(
            "dpmix",
            "demo                      # DP-MixMin vs baselines on the image default",
            "demo text --out runs/demo_text",
            "run quickstart            # DP-SGD in a few lines, seconds",
            "run k_scaling --preset cpu",
            "audit --preset cpu",
            "experiments               # list the experiments",
            "COMMAND --help            # the options of one command",
        ),
        formatter_class=arguments.HelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {arguments.version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo.add_command(commands)
    run.add_commands(commands)
    report.add_command(commands)
    generate.add_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command line `argv` (default: `sys.argv[1:]`); returns the exit status.

    Bad input and Ctrl-C end with one line on stderr and no traceback
    (`errors.one_line_errors`).
    """
    parser = build_parser()
    try:
        # Ctrl-C while the demo's arguments are checked (loading the library) also ends here.
        # The results name the code the run started from.
        with errors.one_line_errors(parser.prog), checkout.pinned_commit():
            args, extra = parser.parse_known_args(argv)
            if args.command in run.SHORTCUTS:
                args.args = extra
            elif extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            if args.command == "demo":
                try:
                    demo.check_arguments(args)
                except ValueError as err:
                    parser.error(str(err))
            return _run_command(args)
    finally:
        parallel = sys.modules.get("dpmix_jax.parallel")  # not loaded: no mesh was set
        if parallel is not None:
            parallel.set_active_mesh(None)  # the mesh belongs to this command only


def _run_command(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return demo.run(args)
    if args.command == "generate":
        return generate.run(args)
    if args.command == "report":
        return report.run(args)
    if args.command == "experiments":
        return run.list_experiments()
    return run.run(args)
