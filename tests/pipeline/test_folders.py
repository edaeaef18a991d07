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


def test_private_folders_and_files_are_owner_only_even_over_a_readable_file(tmp_path):
    previous = os.umask(0o022)
    try:
        path = tmp_path / "store" / "seed0" / "split.json"
        path.parent.mkdir(parents=True)
        path.write_text("old")  # 0644 under this umask
        folders.write_private(path, '{"mix": [1]}')
    finally:
        os.umask(previous)
    assert path.read_text() == '{"mix": [1]}'
    assert path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert sorted(p.name for p in path.parent.iterdir()) == ["split.json"]  # no temporary left
    fresh = folders.private_folder(tmp_path / "a" / "b")
    assert [oct(p.stat().st_mode & 0o777) for p in (fresh, fresh.parent)] == ["0o700"] * 2


def test_a_file_that_cannot_be_written_is_one_line_naming_it(tmp_path):
    (tmp_path / "split.json.tmp").mkdir()  # in the way of the temporary file
    (tmp_path / "split.json.tmp" / "x").write_text("")
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'split.json'}"):
        folders.write_private(tmp_path / "split.json", "{}")


def test_the_compilation_cache_is_an_owner_only_folder(tmp_path, monkeypatch):
    # JAX's cache setting is process-wide: a stand-in config records what would be set.
    import types

    from dpmix_jax.pipeline import compilation_cache

    updates = {}
    config = types.SimpleNamespace(
        jax_compilation_cache_dir=None, update=lambda name, value: updates.update({name: value})
    )
    monkeypatch.setattr(compilation_cache, "jax", types.SimpleNamespace(config=config))
    compilation_cache.use_compilation_cache(tmp_path / "out" / "xla_cache")
    folder = tmp_path / "out" / "xla_cache"
    assert updates == {"jax_compilation_cache_dir": str(folder)}
    assert folder.stat().st_mode & 0o777 == 0o700
