"""The tail every experiment shares: its command line, and what its run leaves behind.

An experiment module holds its computation, its table and its plots; its settings live in
`experiments/configs/NAME.py`. `Command` turns them into the program `python -m
experiments.NAME` (its options, its config, its run), and `finish` ends the run (its files, its
plots, its printed table):

    def main(config, out, *, reproducible=False):
        results = ...  # the computation
        return finish(out, results, markdown(results), plots={"curve.png": plot})

    cli = Command(
        name="NAME",
        description=__doc__.splitlines()[0],
        writes="results.json, results.md, curve.png",
        presets=configs.PRESETS,
        config=lambda args: configs.get_config(args.preset),
        run=lambda config, args: main(config, args.out, reproducible=args.reproducible),
    )

    if __name__ == "__main__":
        with experiment_main("NAME"):
            cli()

Only the standard library and `experiments.common_args` are imported here, so that an experiment
answers `--help` before its heavy imports.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from experiments.common_args import (
    add_out_option,
    add_preset_option,
    add_quiet_flag,
    add_reproducible_flag,
    add_seeds_option,
    experiment_parser,
    with_common_options,
)


class UsageError(Exception):
    """Options that contradict each other: `Command` ends the program as argparse ends a bad
    option (the usage, then `PROG: error: MESSAGE`, status 2)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Command:
    """The command line of `experiments.NAME`; calling it parses, builds the config and runs.

    The parser has, in this order: `--preset` (with `presets`), `--out DIR` (default `runs/NAME`),
    the experiment's own `options`, `--reproducible`, `--seeds` and `--quiet` (each unless turned
    off); `--seeds` and `--quiet` reach the config through `with_common_options`.

    Attributes:
        name: the module's name under `experiments/`.
        description: the first lines of the help.
        writes: what the `--out` folder receives, for its help.
        config: the settings from the parsed arguments; it raises `UsageError` for options that
            contradict each other.
        run: runs the settings (given with `--seeds` and `--quiet` applied) with the parsed
            arguments; its value is the command's.
        examples: command lines (arguments after the program name) shown in the help.
        presets: `--preset`'s choices (name -> what it runs), the first the default; None: no
            `--preset`.
        options: adds the experiment's own options to the parser.
        seeds: "many" (one run per seed), "one" (the run's one seed), or None (no `--seeds`).
        seeds_default: whose seeds run without `--seeds`, for the help.
        quiet: adds `--quiet` (no progress bars).
        reproducible: adds `--reproducible` (the private randomness seeded with `--seeds`).
    """

    name: str
    description: str
    writes: str
    config: Callable[[argparse.Namespace], Any]
    run: Callable[[Any, argparse.Namespace], Any]
    examples: tuple[str, ...] = ()
    presets: Mapping[str, str] | None = None
    options: Callable[[argparse.ArgumentParser], None] | None = None
    seeds: Literal["many", "one"] | None = "many"
    seeds_default: str = "the preset's"
    quiet: bool = False
    reproducible: bool = True

    def parser(self) -> argparse.ArgumentParser:
        """The experiment's argument parser."""
        parser = experiment_parser(self.name, self.description, examples=self.examples)
        if self.presets is not None:
            add_preset_option(parser, self.presets)
        add_out_option(parser, self.name, self.writes)
        if self.options is not None:
            self.options(parser)
        if self.reproducible:
            add_reproducible_flag(parser, seeds="--seeds")
        if self.seeds is not None:
            add_seeds_option(parser, single=self.seeds == "one", default=self.seeds_default)
        if self.quiet:
            add_quiet_flag(parser)
        return parser

    def __call__(self, argv: Sequence[str] | None = None) -> Any:
        """Parses `argv` (default: the program's arguments), then runs the config they give."""
        parser = self.parser()
        args = parser.parse_args(argv)
        try:
            config = self.config(args)
        except UsageError as err:
            parser.error(str(err))
        return self.run(with_common_options(config, args), args)


def progress_log(enabled: bool, start: float) -> Callable[[str], None]:
    """A progress printer for an experiment's run: each line prefixed by the seconds since
    `start` (a `time.time()`), printed only when `enabled` (the config's `progress`)."""

    def log(message: str) -> None:
        if enabled:
            print(f"[{time.time() - start:5.0f}s] {message}", flush=True)

    return log


def finish(
    out: pathlib.Path | None,
    results: dict[str, Any],
    markdown: str | None,
    *,
    name: str = "results",
    plots: Mapping[str, Callable[[dict[str, Any], pathlib.Path], None]] | None = None,
) -> dict[str, Any]:
    """Ends a run: writes `results` to `out/NAME.json` and `markdown` to `out/NAME.md`
    (`run_files.write_results`), draws every plot into `out`, and prints `markdown`.

    Args:
        out: the run's folder; None writes nothing (the table is still printed).
        results: the run's results.
        markdown: its tables; None: no markdown file, nothing printed.
        name: the name of the two files.
        plots: file name -> `plot(results, path)`, each drawing from `results` alone.

    Returns:
        `results`.
    """
    from experiments.run_files import write_results

    if out is not None:
        write_results(out, results, markdown, name=name)
        for file_name, plot in (plots or {}).items():
            plot(results, pathlib.Path(out) / file_name)
    if markdown is not None:
        print(markdown)
    return results
