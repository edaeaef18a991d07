"""One run per output folder: a second run stops and names the process holding the folder."""

import os
import subprocess
import sys

import pytest

from dpmix_jax.pipeline import folders

# Loads folders.py by path: the holder needs no JAX, so it starts fast.
HOLD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("folders", sys.argv[2])
folders = importlib.util.module_from_spec(spec)
spec.loader.exec_module(folders)
with folders.folder_lock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def test_a_second_process_is_refused_with_the_holders_pid(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path), folders.__file__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(folders.FolderInUseError) as error, folders.folder_lock(tmp_path):
            pass
        assert str(error.value).startswith(f"{tmp_path} is in use by process {holder.pid}")
    finally:
        holder.kill()  # a killed run leaves its lock file, but the OS released its lock
        holder.wait()
    assert (tmp_path / folders.LOCK_NAME).exists()
    with folders.folder_lock(tmp_path):
        assert (tmp_path / folders.LOCK_NAME).read_text().strip() == str(os.getpid())


def test_the_lock_is_reentrant_within_a_process_and_released_after(tmp_path):
    with folders.folder_lock(tmp_path), folders.folder_lock(tmp_path / "."):
        pass
    probe = subprocess.run(
        [sys.executable, "-c", HOLD, str(tmp_path), folders.__file__],
        input="\n",
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0 and probe.stdout.strip() == "locked"
