"""What every command of `dpmix` and every experiment's parser share: a parser that takes no
abbreviated option, the help formatter, `--mesh`/`--distributed` and the mesh they set, seeds,
the output folder's checks and lock, and the program name an experiment shows.

Only the standard library is imported at module level, so that `--help` answers at once; the
library (and JAX) is imported by the functions that need it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

MAX_SEED = 2**32 - 1
# The program name of the experiment that `dpmix run` is running (`experiment_program`).
_experiment_prog: str | None = None


class ArgumentParser(argparse.ArgumentParser):
    """A parser that takes no abbreviation of an option (`--epsilon` is not `--epsilons`): a
    shortened option is one error line naming the options it could mean, never a silent change
    of what runs.

    `options(parser)`, when given, adds the options the first time this parser parses or shows
    its help: a command whose choices come from the library (and so import JAX) costs nothing
    to the other commands.
    """

    def __init__(self, *args: Any, options: Callable[[Any], None] | None = None, **kwargs: Any):
        super().__init__(*args, allow_abbrev=False, **kwargs)
        self._pending_options = options

    def _add_pending_options(self) -> None:
        if self._pending_options is not None:
            add, self._pending_options = self._pending_options, None
            add(self)

    def format_help(self) -> str:
        self._add_pending_options()
        return super().format_help()

    def parse_known_args(self, args=None, namespace=None):
        self._add_pending_options()
        args = sys.argv[1:] if args is None else list(args)
        known = [option for action in self._actions for option in action.option_strings]
        for word in args:
            if word == "--":
                break
            name = word.split("=", 1)[0]
            matches = [option for option in known if option.startswith(name)]
            if name.startswith("--") and name not in known and matches:
                self.error(
                    f"{name} is not an option (abbreviations are not accepted); did you mean "
                    f"{' or '.join(matches)}?"
                )
        return super().parse_known_args(args, namespace)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows every option's default and keeps the line breaks of descriptions and epilogs. An
    option whose default is None says in its help what leaving it out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def examples(prog: str, *lines: str) -> str:
    """An epilog of example command lines (arguments after `prog`)."""
    return "examples:\n" + "\n".join(f"  {prog} {line}".rstrip() for line in lines)


def version() -> str:
    """The installed package's version (for `dpmix --version`)."""
    try:
        return importlib.metadata.version("dpmix_jax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed; run `pip install -e .`)"


def add_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds `--mesh` and `--distributed` (applied by `use_mesh`)."""
    parser.add_argument(
        "--mesh",
        default=None,
        metavar="data=D,model=M",
        help="device mesh of the training runs: D devices split each batch, M devices split "
        "large parameters (FSDP); default: every device on data",
    )
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="multi-process run (TPU pods, GPU clusters): every process runs the same command; "
        "jax.distributed.initialize() reads JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and "
        "JAX_PROCESS_ID (or detects them on TPU/SLURM); process 0 writes the outputs",
    )


def use_mesh(args: argparse.Namespace) -> None:
    """Starts the multi-process runtime if asked and makes `--mesh` the run's mesh."""
    import jax

    from dpmix_jax import parallel

    out = str(getattr(args, "out", None) or "")
    if "://" in out or out.startswith("gs:/"):
        raise ValueError(
            f"--out {out}: outputs go to a local or mounted folder, not a URL; mount the bucket "
            "(e.g. with gcsfuse) and give its path"
        )
    if args.distributed:
        _initialize_distributed()
    if not args.mesh and jax.device_count() == 1:
        parallel.set_active_mesh(None)  # one device: nothing to shard
        return
    config = parallel.parse_mesh(args.mesh) if args.mesh else parallel.MeshConfig()
    parallel.set_active_mesh(parallel.make_mesh(config), config.fsdp_min_size)


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


def experiment_program(name: str) -> str:
    """The name the parser of `experiments.NAME` shows: `dpmix audit`, `dpmix run enron`, or
    (when the module is run directly) `python -m experiments.enron`."""
    return _experiment_prog or f"python -m experiments.{name}"


@contextlib.contextmanager
def experiment_program_as(prog: str) -> Iterator[None]:
    """Makes `experiment_program` return `prog` (`dpmix run enron`) inside the block."""
    global _experiment_prog
    previous, _experiment_prog = _experiment_prog, prog
    try:
        yield
    finally:
        _experiment_prog = previous


def parse_seed(text: str) -> int:
    """A `--seeds` value: an integer from 0 to 2**32 - 1."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_SEED}, got {text}")
    return value


def check_out_dir(out: pathlib.Path) -> None:
    """A file at `out`, or a folder where `out` cannot be written or created, is a one-line
    error. Nothing is created here: the folder's lock creates it (`output_lock`)."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder; give a folder path for the outputs")
    existing = next(folder for folder in (out, *out.absolute().parents) if folder.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(f"{existing} is a file")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise ValueError(
            f"--out {out} cannot be written ({err.strerror or err}); choose a folder you can "
            "write to"
        ) from err


def output_lock(out: pathlib.Path) -> contextlib.AbstractContextManager:
    """The lock of the output folder `out` (`folders.folder_lock`), held by process 0 of a
    multi-process run; taken before the data and the proxies, a second run on the folder stops
    at once."""
    from dpmix_jax import parallel
    from dpmix_jax.pipeline import folders

    return folders.folder_lock(out) if parallel.is_main_process() else contextlib.nullcontext()
