"""The commit of the checkout a run's code comes from, read once when the run starts.

A run records the commit it started from (`pin_commit`, called by `dpmix` and by every
experiment's command line before any work), so that editing the tree while it runs does not
relabel its results; child processes inherit the pinned value through the environment.
"""

from __future__ import annotations

import os
import pathlib
import subprocess

__all__ = ["PINNED_ENV", "commit", "pin_commit"]

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


def pin_commit() -> None:
    """Reads the commit now; `commit()` returns it for the rest of the process (and its
    children). A commit pinned by a parent process is kept."""
    if PINNED_ENV not in os.environ:
        os.environ[PINNED_ENV] = _read_commit() or ""


def commit() -> str | None:
    """The pinned commit, or the checkout's commit now when none is pinned (None outside git)."""
    pinned = os.environ.get(PINNED_ENV)
    if pinned is None:
        return _read_commit()
    return pinned or None
