"""One writer per output folder: an advisory lock on `DIR/.lock` that names its holder.

Two runs writing the same stage files and checkpoints would overwrite each other's work (one
of them dies on a rename, or worse, reads a half-written stage). `folder_lock(DIR)` takes an
exclusive `fcntl.flock` on `DIR/.lock` and writes the process id into it; a second run on the
same folder stops at once with "DIR is in use by process N". The operating system releases the
lock when its process ends, so a crashed run leaves no stale lock behind. Within one process the
lock is re-entrant (a comparison locks its output folder and its stage store, which may be the
same folder).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import threading
from collections.abc import Iterator

LOCK_NAME = ".lock"

_held: dict[pathlib.Path, tuple[int, int]] = {}  # folder -> (file descriptor, depth)
_guard = threading.Lock()


class FolderInUseError(ValueError):
    """Another process holds the folder's lock (a ValueError, so the CLI reports one line)."""


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike) -> Iterator[pathlib.Path]:
    """Holds the exclusive lock of `folder` (created if needed) for the `with` block.

    Raises:
        FolderInUseError: another process holds it; the message names the folder and the pid.
    """
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    with _guard:
        if key in _held:
            fd, depth = _held[key]
            _held[key] = (fd, depth + 1)
        else:
            _held[key] = (_acquire(folder), 1)
    try:
        yield folder
    finally:
        with _guard:
            fd, depth = _held[key]
            if depth > 1:
                _held[key] = (fd, depth - 1)
            else:
                del _held[key]
                os.close(fd)  # closing the descriptor releases the flock


def _acquire(folder: pathlib.Path) -> int:
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise FolderInUseError(
            f"{folder} is in use by process {holder}; wait for that run to finish, or give "
            "another output folder"
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd
