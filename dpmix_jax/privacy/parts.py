"""Data-independent partitions: each unit's part is a keyed hash of its identifier alone.

Parallel composition over disjoint parts ("total ε = max over parts"), and PATE's "one record
changes one teacher", need a partition in which adding or removing one unit moves no other unit.
A shuffle of positions cut at fractions does not have this property (one more unit shifts the
cut); here unit u goes to part j when `blake2b_key(id_u)`, read as a number in [0, 1), falls in
[F_{j-1}, F_j), F being the cumulative fractions. Part sizes match the fractions in expectation.

Example:
    >>> parts = assign_parts(["alice", "bob", "carol"], (0.5, 0.5), key=b"k")
    >>> parts.shape, set(parts.tolist()) <= {0, 1}
    ((3,), True)
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Iterable, Sequence

import numpy as np

UnitId = int | str | bytes | np.integer


def secret_key() -> bytes:
    """A fresh 32-byte key from the operating system's entropy.

    Privacy: keep it secret (store it with the run's other secret state to resume the run).
    """
    return secrets.token_bytes(32)


def _key_bytes(key: bytes | int) -> bytes:
    if isinstance(key, bytes):
        if not key:
            raise ValueError("key must be non-empty bytes or an integer >= 0.")
        return key if len(key) <= 64 else hashlib.sha256(key).digest()
    if isinstance(key, bool) or not isinstance(key, int | np.integer) or key < 0:
        raise ValueError(f"key must be None, bytes or an integer >= 0, got {key!r}.")
    return hashlib.sha256(f"assign_parts/{int(key)}".encode()).digest()


def _id_bytes(unit_id: UnitId, index: int) -> bytes:
    if isinstance(unit_id, int | np.integer) and not isinstance(unit_id, bool):
        return b"i" + str(int(unit_id)).encode()
    if isinstance(unit_id, str):
        return b"s" + unit_id.encode("utf-8", "surrogatepass")
    if isinstance(unit_id, bytes):
        return b"b" + unit_id
    raise ValueError(
        f"unit_ids[{index}] is {type(unit_id).__name__} {unit_id!r}; unit ids must be integers, "
        "strings or bytes (stable identifiers such as row ids or user ids)."
    )


def _id_list(unit_ids: Iterable[UnitId] | np.ndarray) -> Sequence[UnitId]:
    if isinstance(unit_ids, str | bytes) or not isinstance(unit_ids, Iterable):
        raise ValueError(
            f"unit_ids must be an iterable of ids (a list, an array, a generator), got "
            f"{type(unit_ids).__name__} {unit_ids!r:.80}."
        )
    return unit_ids if isinstance(unit_ids, Sequence | np.ndarray) else list(unit_ids)


def check_fractions(fractions: Sequence[float]) -> np.ndarray:
    """The fractions as an array: at least one, each in (0, 1], summing to 1."""
    values = np.asarray(fractions, dtype=np.float64) if len(fractions) else np.zeros(0)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"fractions must be a non-empty list of numbers, got {fractions!r}.")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"every fraction must be a finite number > 0, got {list(fractions)}.")
    if not math.isclose(float(values.sum()), 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"fractions must sum to 1, got {list(fractions)} (sum {values.sum()}).")
    return values


def assign_parts(
    unit_ids: Iterable[UnitId] | np.ndarray,
    fractions: Sequence[float],
    *,
    key: bytes | int | None = None,
) -> np.ndarray:
    """The part index (0 .. len(fractions) - 1) of every unit, by a keyed hash of its id.

    Args:
        unit_ids: one stable identifier per unit (row id, user id, record index in the source
            data set; not a position after filtering or shuffling), as any iterable (a list,
            an array, a generator); the parts come in its order. Equal ids get equal parts,
            so passing each example's user id gives a user-disjoint partition of examples.
        fractions: the expected share of each part; positive, summing to 1.
        key: the hash key (bytes, or an integer seed for a reproducible partition). None draws
            a secret key from the operating system (the partition then cannot be recomputed:
            pass `secret_key()` and keep it if the run must resume).

    Returns:
        `(len(unit_ids),)` int64 part indices.

    Raises:
        ValueError: on bad fractions, a bad key, `unit_ids` that is not an iterable of ids (a
            single str or bytes included), or an id that is not an int, str or bytes.

    Privacy: a unit's part depends on its own id and the key only, never on the other units:
    adding or removing a unit leaves every other unit's part unchanged, so stages run on
    different parts compose in parallel under add/remove. With a secret key nobody can tell in
    advance which part a unit will land in.
    """
    cumulative = np.cumsum(check_fractions(fractions))
    hash_key = _key_bytes(secret_key() if key is None else key)
    ids = _id_list(unit_ids)
    draws = np.fromiter(
        (
            int.from_bytes(
                hashlib.blake2b(_id_bytes(u, i), key=hash_key, digest_size=8).digest(), "big"
            )
            / 2.0**64
            for i, u in enumerate(ids)
        ),
        dtype=np.float64,
        count=len(ids),
    )
    parts = np.searchsorted(cumulative, draws, side="right")
    return np.minimum(parts, len(cumulative) - 1).astype(np.int64)
