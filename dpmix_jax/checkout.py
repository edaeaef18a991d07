"""The commit of the checkout a run's code comes from, read once when the run starts.

A run records the commit it started from (`pinned_commit`, entered by `dpmix` and by every
experiment's command line before any work), so that editing the tree while it runs does not
relabel its results; child processes inherit the pinned value through the environment, and the
pin ends with the run, so that a later run in the same process reads the commit afresh.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import subprocess
from collections.abc import Iterator

__all__ = ["PINNED_ENV", "commit", "pinned_commit"]

PINNED_ENV = "DPMIX_RUN_COMMIT"


def _read_commit() -> str | None:
    """The checkout's commit (with "+modified" when tracked files differ), or None."""
    here = pathlib.Path(__file__).parent

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        modified = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+modified" if modified else "")


@contextlib.contextmanager
def pinned_commit() -> Iterator[None]:
    """Within the block, `commit()` returns the commit read on entry (for child processes too).
    A commit pinned by an enclosing block or a parent process is kept."""
    if PINNED_ENV in os.environ:
        yield
        return
    os.environ[PINNED_ENV] = _read_commit() or ""
    try:
        yield
    finally:
        os.environ.pop(PINNED_ENV, None)


def commit() -> str | None:
    """The pinned commit, or the checkout's commit now when none is pinned (None outside git)."""
    pinned = os.environ.get(PINNED_ENV)
    if pinned is None:
        return _read_commit()
    return pinned or None
