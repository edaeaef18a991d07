"""Ctrl-C that always stops a run, at a step or stage boundary when it can.

Python raises `KeyboardInterrupt` at the next bytecode after SIGINT. When that bytecode runs in
a callback that native code calls (JAX's garbage-collection callback, a compilation hook), the
exception is printed as "Exception ignored ..." or dropped and the run goes on, and an
exception thrown through a compilation can leave the process to crash at exit. Under
`stop_on_interrupt` a Ctrl-C is recorded instead, and `raise_if_interrupted`, called at the
safe points of long work (every training step, every pipeline stage, every run of a
comparison), raises it. Work that reaches no safe point within `GRACE_SECONDS`, and a second
Ctrl-C, get the interrupt at once, again every `GRACE_SECONDS` until one reaches the command.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator

GRACE_SECONDS = 3.0  # how long a Ctrl-C waits for a safe point before it is raised anywhere

_requested = threading.Event()  # Ctrl-C arrived and the block has not ended
_block_ended = threading.Event()
_last_raised = [0.0]  # time.monotonic() of the last KeyboardInterrupt raised for it


def raise_if_interrupted() -> None:
    """Raises `KeyboardInterrupt` if Ctrl-C arrived under `stop_on_interrupt` (a safe point)."""
    if _requested.is_set():
        _raise()


def _raise() -> None:
    _last_raised[0] = time.monotonic()
    raise KeyboardInterrupt


def _on_sigint(signum: int, frame: object) -> None:
    if _requested.is_set():  # a second Ctrl-C, or no safe point came in time: stop here
        _raise()
    _requested.set()
    threading.Thread(target=_raise_if_no_safe_point, daemon=True).start()


def _raise_if_no_safe_point() -> None:
    while not _block_ended.wait(GRACE_SECONDS):
        if time.monotonic() - _last_raised[0] >= GRACE_SECONDS:
            _thread.interrupt_main()  # runs `_on_sigint` in the main thread, which raises


def _ignore_lost_interrupt(unraisable: sys.UnraisableHookArgs, previous) -> None:
    # An interrupt raised where it cannot propagate: still recorded, raised again later.
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        previous(unraisable)


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[None]:
    """Within the block, Ctrl-C raises `KeyboardInterrupt` at the next safe point
    (`raise_if_interrupted`), or anywhere after `GRACE_SECONDS` or a second Ctrl-C; nothing is
    printed for an interrupt lost in a callback. Outside the main thread, and nested in
    another such block, it changes nothing."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is _on_sigint
    ):
        yield
        return
    previous_handler = signal.signal(signal.SIGINT, _on_sigint)
    previous_hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: _ignore_lost_interrupt(unraisable, previous_hook)
    _requested.clear()
    _block_ended.clear()
    try:
        yield
    finally:
        _block_ended.set()
        sys.unraisablehook = previous_hook
        signal.signal(signal.SIGINT, previous_handler)
        _requested.clear()
