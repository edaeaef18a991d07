"""Orbax checkpoints of a training run, enough to resume it bit for bit.

A checkpoint at step t holds:
- `state`: the `TrainState` pytree (step, trainable parameters, optimizer state; for private runs
  the optimizer state contains the **secret noise key**);
- `meta` (JSON): the step, the numpy Generator state of the batch sampler (so a resumed run draws
  exactly the batches an uninterrupted run would), and the privacy ledger's `state_dict()` (so it
  neither forgets nor re-spends ε).

**A private run's checkpoint is sensitive**: with the noise key and the sampler state, the noise
of every step can be recomputed and subtracted. Store it like the sensitive data itself and never
publish it; publish only the trained parameters.

Saves are atomic (Orbax writes to a temporary directory and renames it on commit), so a run killed
during a save resumes from the previous complete checkpoint. Every checkpoint also holds
`checksums` (JSON): the SHA-256 of every saved array (its dtype, shape and bytes) and of `meta`.
`restore` recomputes them and refuses, naming the file, a checkpoint whose arrays or metadata
changed or whose files are missing, truncated or unreadable: a damaged checkpoint is an error,
never a run that resumes from garbage.

API:
    Checkpointer(directory, *, max_to_keep=2)
        .save(step, state, *, rng, ledger=None)
        .latest_step() -> int | None
        .restore(template, step=None) -> (state, rng, ledger | None)
        .close()
"""

from __future__ import annotations

import hashlib
import json
import pathlib
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
        directory: where checkpoints live (created if needed).
        max_to_keep: how many recent checkpoints to keep (>= 1).

    Privacy: checkpoints of private runs hold the secret noise key and the sampler state; they are
    as sensitive as the training data.
    """

    def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 2):
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be an integer >= 1, got {max_to_keep!r}.")
        self.directory = pathlib.Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep, enable_async_checkpointing=False, create=True
            ),
        )

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        rng: np.random.Generator,
        ledger: PrivacyLedger | None = None,
    ) -> None:
        """Writes the checkpoint of `step` (atomically; replaces nothing already committed)."""
        meta = {
            "step": int(step),
            "sampler": generator_state(rng),
            "ledger": None if ledger is None else ledger.state_dict(),
        }
        checksums = {"state": _array_checksums(state), "meta": _json_checksum(meta)}
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

        Privacy: the restored state contains the secret noise key (private runs).
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
        if _json_checksum(meta) != checksums.get("meta"):
            raise ValueError(
                f"checkpoint file {meta_file} does not match its checksum: it is damaged; "
                "delete the checkpoint to restart from the previous one"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
            )
        except Exception as err:  # Orbax and TensorStore raise many types for damaged files
            raise ValueError(
                f"checkpoint arrays in {folder / 'state'} cannot be read ({type(err).__name__}: "
                f"{err}); delete the checkpoint to restart from the previous one"
            ) from err
        actual = _array_checksums(restored["state"])
        expected = checksums.get("state", {})
        if damaged := sorted(k for k in actual.keys() | expected.keys()
                             if actual.get(k) != expected.get(k)):  # fmt: skip
            raise ValueError(
                f"checkpoint arrays in {folder / 'state'} do not match their checksums "
                f"({', '.join(damaged[:3])}); the files are damaged: delete the checkpoint to "
                "restart from the previous one"
            )
        ledger = None if meta["ledger"] is None else PrivacyLedger.from_state_dict(meta["ledger"])
        return restored["state"], restore_generator(meta["sampler"]), ledger

    def close(self) -> None:
        """Releases Orbax resources."""
        self._manager.close()


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


def _json_checksum(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as err:
        raise ValueError(
            f"checkpoint file {path} is missing (a checkpoint written without checksums, or a "
            "damaged one); delete the checkpoint to restart from the previous one"
        ) from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"checkpoint file {path} cannot be read ({err}); delete the checkpoint to restart "
            "from the previous one"
        ) from err
