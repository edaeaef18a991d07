"""The command-line pieces every experiment shares: its parser, its `__main__` context, and
the options that mean the same in every experiment.

Only the standard library and `dpmix_jax.cli` (itself light) are imported here, so that an
experiment whose heavy imports sit inside its functions answers `--help` at once.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import pathlib
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from dpmix_jax import checkout
from dpmix_jax.cli import arguments, errors

# The locks that the experiment running under `experiment_main` holds until it ends (its --out
# folder's, taken when its arguments are parsed); None outside `experiment_main`.
_experiment_locks: contextlib.ExitStack | None = None


class _ExperimentParser(arguments.ArgumentParser):
    """An experiment's parser: adds `--mesh` and `--distributed` and applies them on parsing;
    like every parser of the command line, it takes no abbreviated option."""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        try:
            arguments.use_mesh(parsed)
        except ValueError as err:
            self.error(str(err))
        out = getattr(parsed, "out", None)
        if _experiment_locks is not None and out is not None:
            _experiment_locks.enter_context(arguments.output_lock(out))
        return parsed, extra


def experiment_parser(
    name: str, description: str, *, examples: tuple[str, ...] = ()
) -> argparse.ArgumentParser:
    """The argument parser of `experiments.NAME`, named as the user invoked it.

    Args:
        name: the experiment's module name under `experiments/`.
        description: the first lines of the help.
        examples: command lines (arguments after the program name) shown in the epilog.
    """
    prog = arguments.experiment_program(name)
    epilog = (
        "examples:\n" + "\n".join(f"  {prog} {e}".rstrip() for e in examples) if examples else None
    )
    parser = _ExperimentParser(
        prog=prog,
        description=textwrap.fill(description, 79),
        epilog=epilog,
        formatter_class=arguments.HelpFormatter,
    )
    arguments.add_scale_arguments(parser)
    return parser


@contextlib.contextmanager
def experiment_main(name: str) -> Iterator[None]:
    """The context of `experiments.NAME`'s `__main__` block, as `with experiment_main("NAME"):`.

    Run directly (`python -m experiments.NAME`) or through `dpmix`, the experiment reports bad
    input and Ctrl-C in one line (`errors.one_line_errors`), and holds the lock of its `--out`
    folder from the moment its arguments are parsed, so that a second run on the folder stops
    before loading any data.
    """
    global _experiment_locks
    with (
        errors.one_line_errors(arguments.experiment_program(name)),
        checkout.pinned_commit(),  # the results name the code the run started from
        contextlib.ExitStack() as locks,
    ):
        previous, _experiment_locks = _experiment_locks, locks
        try:
            yield
        finally:
            _experiment_locks = previous


def add_preset_option(parser: argparse.ArgumentParser, presets: Mapping[str, str]) -> None:
    """Adds `--preset`, one of `presets` (name -> what it runs), the first by default."""
    parser.add_argument(
        "--preset",
        default=next(iter(presets)),
        choices=tuple(presets),
        help="; ".join(f"{name}: {what}" for name, what in presets.items()),
    )


def add_out_option(parser: argparse.ArgumentParser, name: str, contents: str) -> None:
    """Adds `--out DIR`, the output folder (default `runs/NAME`) that receives `contents`."""
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("runs") / name,
        metavar="DIR",
        help=f"output folder: {contents}",
    )


def add_run_options(parser: argparse.ArgumentParser, *, single_seed: bool = False) -> None:
    """Adds `--reproducible` (seeded by `--seeds`), `--seeds` and `--quiet`."""
    add_reproducible_flag(parser, seeds="--seeds")
    add_seeds_option(parser, single=single_seed)
    add_quiet_flag(parser)


def add_reproducible_flag(parser: argparse.ArgumentParser, *, seeds: str) -> None:
    """Adds `--reproducible`: the private mechanisms seeded with `seeds`, not secret randomness."""
    parser.add_argument(
        "--reproducible",
        action="store_true",
        help=(
            f"seed the private mechanisms' noise, sampling and splits with {seeds} (exact "
            "reproduction; not private against anyone who knows them); default: secret "
            "randomness from the operating system"
        ),
    )


def add_chest_xray_roots(parser: argparse.ArgumentParser, *, public: str | None) -> None:
    """Adds `--nih-root` and `--public-root`, the data folders of the chest X-ray paper presets.

    Args:
        parser: the experiment's parser.
        public: "chexpert" or "mimic" (the public folder's default is `data/PUBLIC`), or None
            when the preset chooses the public data set (the default is then the preset's).
    """
    parser.add_argument(
        "--nih-root",
        type=pathlib.Path,
        default=pathlib.Path("data/nih"),
        metavar="DIR",
        help="paper preset: the NIH ChestX-ray14 folder (Data_Entry_2017.csv, the official "
        "split lists, images/)",
    )
    parser.add_argument(
        "--public-root",
        type=pathlib.Path,
        default=None if public is None else pathlib.Path(f"data/{public}"),
        metavar="DIR",
        help="paper preset: the "
        + (
            "CheXpert or MIMIC-CXR folder (default: data/chexpert or data/mimic, by preset)"
            if public is None
            else f"{public} folder"
        )
        + " in its published layout",
    )


def chest_xray_tasks(
    roots: Mapping[str, pathlib.Path],
    *,
    public: str,
    image_size: int,
    findings: Sequence[str] | None = None,
) -> list:
    """The NIH tasks of `pipeline.chest_xray.nih_tasks` from the folders of `--nih-root` and
    `--public-root` (`roots["nih_root"]`, `roots["public_root"]`), each checked first: a missing
    one stops the run naming its option."""
    folders = (
        ("--nih-root", roots["nih_root"], "the NIH ChestX-ray14 folder"),
        ("--public-root", roots["public_root"], f"the {public} folder"),
    )
    for option, path, what in folders:
        if not pathlib.Path(path).exists():
            raise ValueError(
                f"missing {what} ({option}): {path} does not exist (see experiments/configs/nih.py)"
            )
    from dpmix_jax.pipeline.chest_xray import nih_tasks

    return nih_tasks(
        roots["nih_root"],
        roots["public_root"],
        public=public,
        image_size=image_size,
        findings=findings,
    )


def add_seeds_option(
    parser: argparse.ArgumentParser, *, single: bool = False, default: str = "the preset's"
) -> None:
    """Adds `--seeds`: the seeds to run instead of the config's (`with_common_options`).

    Args:
        parser: the experiment's parser.
        single: the experiment runs one seed (its config's `seed`): `--seeds` takes one value.
        default: whose seeds run without the option, for the help.
    """
    what = "the run's seed (one value)" if single else "the repetitions, one run per seed"
    parser.add_argument(
        "--seeds",
        type=arguments.parse_seed,
        nargs="+",
        default=None,
        metavar="SEED",
        help=f"{what} (default: {default} {'seed' if single else 'seeds'})",
    )


def add_quiet_flag(parser: argparse.ArgumentParser) -> None:
    """Adds `--quiet`: no progress bars (`with_common_options`)."""
    parser.add_argument("--quiet", action="store_true", help="no progress bars")


def with_common_options(config: Any, args: argparse.Namespace) -> Any:
    """`config` (a settings dataclass) with the command line's `--seeds` and `--quiet`.

    `--seeds` replaces the config's `seeds`, or its one `seed` (then exactly one must be given);
    `--quiet` turns off every `progress` setting in the config and the settings nested in it.
    """
    seeds = getattr(args, "seeds", None)
    if seeds is not None:
        names = {field.name for field in dataclasses.fields(config)}
        if "seeds" in names:
            config = dataclasses.replace(config, seeds=tuple(seeds))
        elif len(seeds) == 1:
            config = dataclasses.replace(config, seed=seeds[0])
        else:
            raise ValueError(
                f"argument --seeds: this experiment runs one seed; give one value, got {len(seeds)}"
            )
    return _without_progress(config) if getattr(args, "quiet", False) else config


def _without_progress(value: Any) -> Any:
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        return value
    changes = {}
    for field in dataclasses.fields(value):
        current = getattr(value, field.name)
        if field.name == "progress" and current is True:
            changes[field.name] = False
        elif dataclasses.is_dataclass(current):
            quiet = _without_progress(current)
            if quiet is not current:
                changes[field.name] = quiet
    return dataclasses.replace(value, **changes) if changes else value
