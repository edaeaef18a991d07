"""How `dpmix` and the experiments end on bad input or Ctrl-C: one line on stderr, no traceback.

Bad input (a `ValueError` from the library, an unreadable file, ...) prints `PROG: error: ...`
and exits 2; Ctrl-C prints how to resume (or, for a command that keeps nothing to resume from,
what an interrupt means there: `interrupted_says`) and exits 130. The library's structured
refusals of a setting (δ >= 1/n, a batch too large for its units) are reworded in the command's
own options (`in_command_line_terms`). Only the standard library is imported at module level.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

from dpmix_jax import interrupt

# Set (to anything but 0) to see the traceback of an error that dpmix reports in one line.
DEBUG_ENV = "DPMIX_DEBUG"

INTERRUPTED = (
    "interrupted; to resume, rerun the same command (same --out): its stored stages are read "
    "back and their privacy ledger is kept"
)

# `dpmix generate` writes its outputs only when the run ends, and keeps no stage to resume from.
GENERATE_INTERRUPTED = (
    "interrupted before any output was written: nothing of this run was released, and nothing "
    "is kept to resume from; a rerun starts over with fresh noise (the same noise with the same "
    "--seed) and spends its ε anew"
)

INTERRUPTED_STATUS = 130  # the shell's status for a command ended by Ctrl-C (128 + SIGINT)

_MAX_MESSAGE = 400  # characters of an error message shown; the start names the file


def _input_errors() -> tuple[type[BaseException], ...]:
    """What bad input raises: a `ValueError` from the library, a file that cannot be read or
    written, a document nested too deep to parse, an image too large to decode."""
    from PIL import Image

    return ValueError, OSError, RecursionError, Image.DecompressionBombError


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """Ends bad input and Ctrl-C inside the block with one line on stderr, without a traceback.

    Bad input (`_input_errors`) prints `PROG: error: ...` and exits with status 2; Ctrl-C prints
    `PROG: interrupted; ...` (how to resume, or the command's own message: `interrupted_says`)
    and exits with status 130. A Ctrl-C that lands in a callback Python cannot raise from stops
    the run at its next step or stage (`interrupt.stop_on_interrupt`). Set the environment
    variable DPMIX_DEBUG=1 to see the traceback instead.
    """
    debug = os.environ.get(DEBUG_ENV, "0") != "0"
    try:
        with interrupt.stop_on_interrupt():
            yield
    except KeyboardInterrupt as err:
        if debug:
            raise
        message = err.message if isinstance(err, _Interrupted) else INTERRUPTED
        print(f"{prog}: {message}", file=sys.stderr)
        raise SystemExit(INTERRUPTED_STATUS) from None
    except _input_errors() as err:
        if debug:
            raise
        print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
        raise SystemExit(2) from None


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C in a command that says itself what an interrupt means (`interrupted_says`)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


@contextlib.contextmanager
def interrupted_says(message: str) -> Iterator[None]:
    """Ctrl-C in the block ends the command with `message` instead of `INTERRUPTED` (how to
    resume), for a command that keeps nothing to resume from."""
    try:
        yield
    except KeyboardInterrupt as err:
        if isinstance(err, _Interrupted):
            raise
        raise _Interrupted(message) from None


def _one_line(err: BaseException) -> str:
    if (large := _large_delta(err)) is not None:  # a command without an override flag
        text = large.message(None)
    elif isinstance(err, OSError) and err.filename is not None:
        text = f"{err.strerror or err}: {err.filename}; check the path and its permissions"
    elif isinstance(err, RecursionError):
        text = f"input nested too deeply to read ({err})"
    else:
        text = str(err) or type(err).__name__
    # Readers may quote raw bytes of a corrupt file: show them escaped, and not too many.
    text = " ".join("".join(map(_printable, text)).split())
    return text if len(text) <= _MAX_MESSAGE else text[: _MAX_MESSAGE - 1] + "…"


def _printable(char: str) -> str:
    if char.isprintable() or char.isspace():
        return char
    return repr(char)[1:-1]


def _large_delta(err: BaseException):
    """`err` if it is a `validation.LargeDeltaError` (whose module is then loaded), else None."""
    validation = sys.modules.get("dpmix_jax.privacy.validation")
    return err if validation and isinstance(err, validation.LargeDeltaError) else None


def _weak_release(err: BaseException):
    """`err` if it is a `hot_pate_method.WeakReleaseError` (whose module is then loaded), else
    None."""
    hot_pate = sys.modules.get("dpmix_jax.pate.hot_pate_method")
    return err if hot_pate and isinstance(err, hot_pate.WeakReleaseError) else None


def _batch_too_large(err: BaseException):
    """`err` if it is a `plan.BatchTooLargeError` (whose module is then loaded), else None."""
    plan = sys.modules.get("dpmix_jax.privacy.plan")
    return err if plan and isinstance(err, plan.BatchTooLargeError) else None


@contextlib.contextmanager
def in_command_line_terms(override: str | None, batch_options: str | None) -> Iterator[None]:
    """Reports the library's refusals of a setting in the command's own words: δ >= 1/n as
    `argument --delta: ...` naming the `override` flag (None: the command has none), a batch
    too large for its units naming `batch_options`, Hot PATE's too weak a release naming the
    command's options."""
    try:
        yield
    except ValueError as err:
        if (large := _large_delta(err)) is not None:
            raise ValueError(f"argument --delta: {large.message(override)}") from None
        if batch_options and (batch := _batch_too_large(err)) is not None:
            raise ValueError(batch.message(batch_options)) from None
        if (weak := _weak_release(err)) is not None:
            raise ValueError(f"argument --num-teachers: {weak.message(flags=True)}") from None
        raise
