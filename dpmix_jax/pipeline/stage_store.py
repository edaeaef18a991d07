"""The content-addressed store of pipeline stages: how stages are keyed (`canonical_json`,
`fingerprint`, `code_fingerprint`), named (`weights_key`, `epsilon_name`), written and read back
(`StageStore`).

Stored stages are keyed by everything that determines them: they live under
`root/<fingerprint of the data's content, full config, seed mode and code>/seed<N>/` and are named
by stage, composition, method and exact ε, so other settings, other data (one changed label) or
other code (one changed line of the package) never read them back. The folder name is keyed by
`root/store_key` (owner-only), so it says nothing about the data to whoever can list `root`.

Everything under a settings folder is owner-only (folders 0700, files 0600): the split, the run's
secret, the proxy outputs and the running checkpoints reveal sensitive data, sampling or noise.
Every stage JSON holds the SHA-256 of its result; a file that does not match (edited, truncated)
is refused with one line naming it, never reused.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

import dpmix_jax
from dpmix_jax import parallel
from dpmix_jax.pipeline import folders
from dpmix_jax.train.checkpoint import json_checksum


def weights_key(weights: np.ndarray | None) -> str:
    """A short stable name for a λ (stage directories are shared between runs with equal λ)."""
    if weights is None:
        return "none"
    rounded = np.round(np.asarray(weights, dtype=np.float64), 10)
    return hashlib.sha256(rounded.tobytes()).hexdigest()[:12]


def epsilon_name(epsilon: float) -> str:
    """ε exactly as it is (`repr`), for stage names: 1.0000004 and 1 are different runs."""
    return repr(float(epsilon))


def canonical_json(value: Any, **kwargs: Any) -> str:
    """`value` as JSON with sorted keys: dataclasses as their fields plus their type's name,
    floats exact (repr), NumPy values and dtypes as lists and strings."""
    return json.dumps(canonical_form(value), sort_keys=True, **kwargs)


def fingerprint(value: Any) -> str:
    """SHA-256 (hex) of `canonical_json(value)`."""
    return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def canonical_form(value: Any) -> Any:
    """`value` as plain JSON values (what `canonical_json` writes): dataclasses as dicts of their
    fields with their type's name under `"__type__"`, mappings with string keys, sequences as
    lists, NumPy values as lists or numbers, dtypes, types and paths as strings.

    Raises:
        TypeError: `value` holds something else (it cannot be part of a fingerprint).
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: canonical_form(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {"__type__": type(value).__qualname__, **fields}
    if isinstance(value, Mapping):
        return {str(k): canonical_form(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [canonical_form(v) for v in value]
    if isinstance(value, np.ndarray | np.generic):
        return canonical_form(value.tolist())
    if isinstance(value, np.dtype | type):
        return str(value)
    if isinstance(value, pathlib.PurePath):
        return str(value)
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"cannot fingerprint a {type(value).__name__} setting: {value!r}")


@functools.cache
def code_fingerprint() -> str:
    """SHA-256 (hex) of the package's source: every `.py` file under `dpmix_jax/`, by relative
    path and bytes. Computed once per process; part of `MixturePipeline.settings`, so a stage
    stored by other code is never read back (the version number does not change with a fix)."""
    package = pathlib.Path(dpmix_jax.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        content = path.read_bytes()
        digest.update(f"{path.relative_to(package).as_posix()}/{len(content)}/".encode())
        digest.update(content)
    return digest.hexdigest()


class StageStore:
    """JSON results of pipeline stages under one owner-only directory; computed once, then read
    back after checking them.

    Each `NAME.json` is the result with one more key, `"sha256"`: the checksum of the rest as
    JSON with sorted keys (`train.checkpoint.json_checksum`).

    Privacy: the results include the split and proxy outputs on sensitive rows; every folder is
    0700 and every file 0600.
    """

    def __init__(self, root: str | os.PathLike):
        self.root = folders.private_folder(root)

    def path(self, *parts: str) -> pathlib.Path:
        """An owner-only sub-directory for a stage's own files (checkpoints), created if needed."""
        return folders.private_folder(self.root.joinpath(*parts))

    def json(
        self,
        name: str,
        compute: Callable[[], Mapping[str, Any]],
        check: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """The stored result `name`, or `compute()` written atomically and returned.

        Args:
            name: the stage's file name, without `.json`.
            compute: what computes the result when none is stored.
            check: raises a ValueError (without the path) for a result that is not valid.

        Raises:
            ValueError: the stored file cannot be read, does not match its checksum, or fails
                `check`: one line naming it and saying to delete it to recompute.
            OSError: the result cannot be written (`folders.write_private`).
        """
        target = self.root / f"{name}.json"
        if parallel.agree(target.exists()):  # one decision for all processes of a run
            return self._read(target, check)
        result = json.loads(json.dumps(dict(compute()), default=_json_default))
        content = {**result, "sha256": json_checksum(result)}
        parallel.on_main_process(  # a multi-process run: process 0 writes, all wait
            lambda: folders.write_private(target, json.dumps(content, indent=1))
        )
        return self._read(target, check)

    @staticmethod
    def _read(
        target: pathlib.Path, check: Callable[[Mapping[str, Any]], None] | None
    ) -> dict[str, Any]:
        def refuse(problem: str) -> ValueError:
            return ValueError(f"stage file {target} {problem}; delete it to recompute the stage")

        try:
            content = json.loads(target.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise refuse(f"cannot be read ({err})") from err
        if not isinstance(content, dict):
            raise refuse("is not a stage result")
        expected = content.pop("sha256", None)
        if json_checksum(content) != expected:
            raise refuse("does not match its checksum (edited or damaged)")
        if check is not None:
            try:
                check(content)
            except (KeyError, TypeError, ValueError) as err:
                raise refuse(f"is not valid ({err})") from err
        return content


def _json_default(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot store {type(value).__name__} as JSON")
