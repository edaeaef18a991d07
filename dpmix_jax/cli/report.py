"""`dpmix report`: the results tables and the numbers of README.md and docs/ from stored runs."""

from __future__ import annotations

import argparse
import pathlib
import sys
import textwrap
from collections import Counter

from dpmix_jax.cli import arguments


def add_command(commands: argparse._SubParsersAction) -> None:
    """Adds `dpmix report` and its options."""
    report = commands.add_parser(
        "report",
        help="rebuild the results tables of README.md and docs/ from docs/results/*.json",
        description=textwrap.fill(
            "Every results table in README.md and docs/*.md sits between "
            "`<!-- table:NAME VIEW -->` and `<!-- /table -->` and is rendered from "
            "docs/results/NAME.json, a copy of the "
            "results.json a run wrote. --add copies a finished run's results.json and plots "
            "there first; --check changes nothing and fails if a table differs from its file. "
            "Numbers in the prose are derived from the same files by hidden "
            "`<!-- numbers NAME ... -->` blocks (see dpmix_jax.pipeline.numbers); both modes "
            "list every one the stored runs do not give, and exit 1 then."
        ),
        epilog=arguments.examples(
            "dpmix report",
            "                           # rebuild the tables from docs/results/*.json",
            "--add demo-image=runs/demo demo-text=runs/demo_text",
            "--check",
        ),
        formatter_class=arguments.HelpFormatter,
    )
    report.add_argument(
        "--add",
        nargs="+",
        default=[],
        metavar="NAME=RUN_DIR",
        help="copy RUN_DIR/results.json to docs/results/NAME.json (and its plots beside it)",
    )
    report.add_argument(
        "--readme",
        type=pathlib.Path,
        nargs="+",
        default=None,
        metavar="PATH",
        help="the markdown files whose tables are rebuilt (default: README.md and docs/*.md)",
    )
    report.add_argument(
        "--results",
        type=pathlib.Path,
        default=pathlib.Path("docs/results"),
        metavar="DIR",
        help="the folder of the checked-in results files",
    )
    report.add_argument(
        "--check", action="store_true", help="only compare; exit 1 if a table is out of date"
    )


def run(args: argparse.Namespace) -> int:
    from dpmix_jax.pipeline import numbers, report

    for item in args.add:
        name, sep, run_dir = item.partition("=")
        if not sep or not name or not run_dir:
            raise SystemExit(f"dpmix report: --add takes NAME=RUN_DIR, got {item!r}")
        copied = report.add_results(name, pathlib.Path(run_dir), args.results)
        print(f"copied {', '.join(str(p) for p in copied)}")
    documents = args.readme or report.documents(pathlib.Path("."))
    problems, counts = [], Counter()
    for path in documents:
        if args.check:
            problems += report.stale_tables(path, args.results)
        else:
            updated = report.update_markdown(path, args.results)
            if updated:
                print(f"rebuilt {len(updated)} table(s) in {path}: {', '.join(updated)}")
        prose_problems, prose_counts = numbers.check_file(path, args.results)
        problems += prose_problems
        counts += prose_counts
    print(
        f"numbers in the prose: {counts['derived']} derived from stored runs or formulas, "
        f"{counts['paper']} are the papers', {counts['setting']} settings, {counts['unstored']} "
        "measured outside a stored run"
    )
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0
