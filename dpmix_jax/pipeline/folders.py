"""One writer per output folder, and owner-only folders and files for what is private.

`folder_lock(DIR)`: an advisory lock on `DIR/.lock` (owner-only) that names its holder; a folder
that the lock created and that holds nothing else when it is released is removed again.

Two runs writing the same stage files and checkpoints would overwrite each other's work (one
of them dies on a rename, or worse, reads a half-written stage). `folder_lock(DIR)` takes an
exclusive `fcntl.flock` on `DIR/.lock` and writes the process id into it; a second run on the
same folder stops at once with "DIR is in use by process N". The operating system releases the
lock when its process ends, so a crashed run leaves no stale lock behind. Within one process the
lock is re-entrant (a comparison locks its output folder and its stage store, which may be the
same folder).

`private_folder(DIR)` and `write_private(PATH, text)` create folders 0700 and files 0600 (never
readable by other local users, not even for a moment), for the stage store's splits, secrets,
checkpoints and results.
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
    created = [f for f in (folder, *folder.absolute().parents) if not f.exists()]
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
                if created:
                    _remove_if_only_the_lock(created)
                os.close(fd)  # closing the descriptor releases the flock


def _remove_if_only_the_lock(created: list[pathlib.Path]) -> None:
    """Removes the locked folder (`created[0]`) and the parents created with it when the lock
    is all they hold: a run that failed before writing anything leaves no empty output folder
    behind (called with the lock held)."""
    folder = created[0]
    with contextlib.suppress(OSError):
        if [p.name for p in folder.iterdir()] != [LOCK_NAME]:
            return
        (folder / LOCK_NAME).unlink()
        for empty in created:
            empty.rmdir()


def _acquire(folder: pathlib.Path) -> int:
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
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


def private_folder(folder: str | os.PathLike) -> pathlib.Path:
    """`folder` created if needed and made owner-only (0700); missing parents are created
    owner-only too, existing ones are left as they are."""
    folder = pathlib.Path(folder)
    previous = os.umask(0o077)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    finally:
        os.umask(previous)
    folder.chmod(0o700)
    return folder


def write_private(path: str | os.PathLike, text: str) -> None:
    """Writes `text` to `path` atomically (a temporary file renamed over it), owner-only (0600)
    in an owner-only folder.

    Raises:
        OSError: the file cannot be written (a full disk, a read-only folder): one line naming it.
    """
    path = pathlib.Path(path)
    private_folder(path.parent)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        tmp.replace(path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise OSError(
            f"cannot write {path} ({err.strerror or err}); free disk space or give a writable "
            "folder, then rerun"
        ) from err
