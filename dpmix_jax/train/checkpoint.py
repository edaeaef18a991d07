"""Orbax checkpoints of a training run, enough to resume it bit for bit.

A checkpoint at step t holds:
- `state`: the `TrainState` pytree (step, trainable parameters, optimizer state; for private runs
  the optimizer state contains the **secret noise key**);
- `meta` (JSON): the step, the numpy Generator state of the batch sampler (so a resumed run draws
  exactly the batches an uninterrupted run would), and the privacy ledger's `state_dict()` (so it
  neither forgets nor re-spends ε).

**A private run's checkpoint is sensitive**: with the noise key and the sampler state, the noise
of every step can be recomputed and subtracted. Store it like the sensitive data itself and never
publish it; publish only the trained parameters. Every folder a `Checkpointer` writes is
owner-only (0700, its files 0600), and by default it keeps only the newest checkpoint: two
checkpoints of consecutive steps give that step's noise exactly. A finished private run can keep
its parameters and ledger without the sampler (`save(..., rng=None)` of the parameters alone) and
delete its running checkpoints.

Saves are atomic (Orbax writes to a temporary directory and renames it on commit), so a run killed
during a save resumes from the previous complete checkpoint; a save that cannot write (a full
disk) raises one OSError naming the folder. Every checkpoint also holds
`checksums` (JSON): the SHA-256 of every saved array (its dtype, shape and bytes) and of `meta`.
`restore` recomputes them and refuses, naming the file, a checkpoint whose arrays or metadata
changed or whose files are missing, truncated or unreadable: a damaged checkpoint is an error,
never a run that resumes from garbage.

API:
    Checkpointer(directory, *, max_to_keep=1)
        .save(step, state, *, rng, ledger=None)
        .latest_step() -> int | None
        .restore(template, step=None) -> (state, rng | None, ledger | None)
        .close()
    json_checksum(value) -> str                       SHA-256 of a JSON value (sorted keys)
    owner_only(path)                                  chmod a tree to 0700 folders, 0600 files
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from dpmix_jax.privacy.accounting import PrivacyLedger
from dpmix_jax.privacy.sampling import generator_state, restore_generator

PyTree = Any


class Checkpointer:
    """Saves and restores `(state, sampler rng, ledger)` under `directory`, one folder per step.

    Args:
        directory: where checkpoints live (created owner-only if needed).
        max_to_keep: how many recent checkpoints to keep (>= 1).

    Privacy: checkpoints of private runs hold the secret noise key and the sampler state; they are
    as sensitive as the training data. Everything under `directory` is owner-only, and with the
    default `max_to_keep=1` no two steps' checkpoints stay side by side.
    """

    def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 1):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an integer >= 1, got {max_to_keep!r}.")
        self.directory = pathlib.Path(directory).absolute()
        with _owner_only_umask():
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
                ),
            )
        owner_only(self.directory)

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        rng: np.random.Generator | None,
        ledger: PrivacyLedger | None = None,
    ) -> None:
        """Writes the checkpoint of `step` (atomically; replaces nothing already committed).

        Args:
            step: the step it is the state of.
            state: the pytree to save.
            rng: the batch sampler to resume, or None for a finished run's result (nothing left
                to sample).
            ledger: the privacy ledger of the steps taken (private runs).

        Raises:
            OSError: the checkpoint cannot be written (a full disk, a read-only folder): one
                line naming the folder.

        Privacy: a private run's state holds the secret noise key; the files are owner-only.
        """
        meta = {
            "step": int(step),
            "sampler": None if rng is None else generator_state(rng),
            "ledger": None if ledger is None else ledger.state_dict(),
        }
        checksums = {"state": _array_checksums(state), "meta": json_checksum(meta)}
        try:
            with _owner_only_umask(), _quiet_orbax_tracebacks():
                self._manager.save(
                    int(step),
                    args=ocp.args.Composite(
                        state=ocp.args.StandardSave(state),
                        meta=ocp.args.JsonSave(meta),
                        checksums=ocp.args.JsonSave(checksums),
                    ),
                    force=True,
                )
                self._manager.wait_until_finished()
        except Exception as err:  # Orbax and TensorStore wrap OS errors in many types
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise OSError(
                f"cannot write the checkpoint of step {step} to {self.directory} ({reason}); "
                "free disk space or give a writable folder, then rerun to resume"
            ) from err
        finally:
            owner_only(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None for an empty directory."""
        return self._manager.latest_step()

    def restore(
        self, template: PyTree, step: int | None = None
    ) -> tuple[PyTree, np.random.Generator, PrivacyLedger | None]:
        """Restores `(state, rng, ledger)` of `step` (default: the latest).

        Args:
            template: a state with the structure, dtypes and shardings to restore into (e.g. the
                run's initial state).
            step: which checkpoint; None for the latest.

        Raises:
            ValueError: no such checkpoint, or one that fails its checksums or cannot be read
                (the message names the file).

        Privacy: the restored state contains the secret noise key (private runs). The rng is
        None for a checkpoint saved without one.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise ValueError(f"no checkpoint in {self.directory}.")
        if step not in self._manager.all_steps():
            raise ValueError(f"no checkpoint of step {step} in {self.directory}.")
        folder = self.directory / str(step)
        checksums = _read_json(folder / "checksums" / "metadata")
        meta_file = folder / "meta" / "metadata"
        meta = _read_json(meta_file)
        if json_checksum(meta) != checksums.get("meta"):
            raise ValueError(
                f"checkpoint file {meta_file} does not match its checksum: it is damaged; "
                "delete the checkpoint to restart without it"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
        except Exception as err:  # Orbax and TensorStore raise many types for damaged files
            raise ValueError(
                f"checkpoint arrays in {folder / 'state'} cannot be read ({type(err).__name__}: "
                f"{err}); delete the checkpoint to restart without it"
            ) from err
        actual = _array_checksums(restored["state"])
        expected = checksums.get("state", {})
        if damaged := sorted(k for k in actual.keys() | expected.keys()
                             if actual.get(k) != expected.get(k)):  # fmt: skip
            raise ValueError(
                f"checkpoint arrays in {folder / 'state'} do not match their checksums "
                f"({', '.join(damaged[:3])}); the files are damaged: delete the checkpoint to "
                "restart without it"
            )
        ledger = None if meta["ledger"] is None else PrivacyLedger.from_state_dict(meta["ledger"])
        rng = None if meta["sampler"] is None else restore_generator(meta["sampler"])
        return restored["state"], rng, ledger

    def close(self) -> None:
        """Releases Orbax resources."""
        self._manager.close()


def owner_only(path: str | pathlib.Path) -> None:
    """Makes `path` and everything under it owner-only: folders 0700, files 0600.

    Entries that vanish meanwhile are skipped (another process of a multi-process save may be
    renaming its temporary files).
    """
    path = pathlib.Path(path)
    entries = [(path, path.is_dir())]
    for folder, names, files in os.walk(path):
        entries += [(os.path.join(folder, name), True) for name in names]
        entries += [(os.path.join(folder, name), False) for name in files]
    for entry, is_folder in entries:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(entry, 0o700 if is_folder else 0o600)


def _without_traceback(record: logging.LogRecord) -> bool:
    return record.exc_info is None


@contextlib.contextmanager
def _quiet_orbax_tracebacks() -> Iterator[None]:
    """Drops the tracebacks Orbax's writer threads log for a failed write (dozens of lines per
    thread): `save` raises the error itself, as one line."""
    logger = logging.getLogger("absl")
    logger.addFilter(_without_traceback)
    try:
        yield
    finally:
        logger.removeFilter(_without_traceback)


@contextlib.contextmanager
def _owner_only_umask() -> Iterator[None]:
    """Umask 077 for the block, so files are owner-only from the moment they exist (the
    `owner_only` pass after a save also covers files written with explicit modes)."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def _array_checksums(state: PyTree) -> dict[str, str]:
    """SHA-256 of every leaf's dtype, shape and bytes, keyed by its path in the tree."""
    checksums = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
            leaf = multihost_utils.process_allgather(leaf, tiled=True)
        value = np.ascontiguousarray(np.asarray(leaf))
        digest = hashlib.sha256(f"{value.dtype.str}/{value.shape}/".encode())
        digest.update(value.tobytes())
        checksums[jax.tree_util.keystr(path)] = digest.hexdigest()
    return checksums


def json_checksum(value: Any) -> str:
    """SHA-256 (hex) of `value` as JSON with sorted keys."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ValueError(
            f"checkpoint file {path} is missing (a checkpoint written without checksums, or a "
            "damaged one); delete the checkpoint to restart without it"
        ) from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"checkpoint file {path} cannot be read ({err}); delete the checkpoint to restart "
            "without it"
        ) from err
