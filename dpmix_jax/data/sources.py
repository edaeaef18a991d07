"""The common random-access data source and the splits every loader shares.

Every data set in `dpmix_jax.data` is (or adapts to) a `Source`: a fixed-length, random-access
collection of examples, each example a dict of numpy arrays with the same keys and shapes.
The training engine reads sources only through `Source.gather`, which takes a fixed-size vector of
indices in which `-1` marks a padding row (Poisson-sampled batches are padded to a static size so
jit shapes never change) and returns zero-filled rows there.

Sources may carry `user_ids` (one integer per example, for user-level DP) and `group_ids` (e.g.
the patient of a chest X-ray). Splits between privacy stages must follow those boundaries:
`group_disjoint_split` returns index arrays that never put one group in two parts, and `GroupIndex`
turns a vector of sampled users into a padded `(users, G)` matrix of their example indices.

API:
    Source                         abstract base: len, getitem, `gather`, `user_ids`, `group_ids`
    ArraySource(arrays, *, user_ids=None, group_ids=None)   in-memory numpy arrays
    SubsetSource(source, indices)  a view of another source restricted to `indices`
    padding_mask(indices)          True where a padded index vector holds a real example
    random_split(n, fractions, *, seed)                     example-level split -> index arrays
    group_disjoint_split(group_ids, fractions, *, seed)     user/patient-disjoint split
    GroupIndex.from_ids(group_ids) / .sample(groups, max_per_group, rng)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dpmix_jax.privacy.parts import assign_parts

PAD_INDEX = -1


def padding_mask(indices: np.ndarray) -> np.ndarray:
    """Returns a bool array, True where `indices` holds a real example (not the padding `-1`)."""
    return np.asarray(indices) >= 0


def _check_index_vector(indices: np.ndarray, length: int) -> np.ndarray:
    indices = np.asarray(indices)
    if indices.ndim != 1 or not np.issubdtype(indices.dtype, np.integer):
        raise ValueError(
            f"indices must be a 1-D integer array, got {indices.dtype} {indices.shape}"
        )
    bad = (indices < PAD_INDEX) | (indices >= length)
    if bad.any():
        raise ValueError(
            f"indices out of range for a source of length {length} (-1 is padding): "
            f"{indices[bad][:5].tolist()}"
        )
    return indices.astype(np.int64)


def _check_ids(ids: np.ndarray | None, length: int, name: str) -> np.ndarray | None:
    if ids is None:
        return None
    ids = np.asarray(ids)
    if ids.shape != (length,) or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{name} must be an integer array of shape ({length},), got {ids.shape}")
    return ids.astype(np.int64)


class Source(abc.ABC):
    """A fixed-length random-access data set whose examples are dicts of numpy arrays.

    Subclasses implement `__len__` and `_fetch(indices)` for valid (non-negative) indices, including
    an empty index vector (which must still return arrays of the right trailing shape and dtype).
    """

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Returns the examples at `indices` (all valid) stacked along a new leading axis."""

    @property
    def user_ids(self) -> np.ndarray | None:
        """Integer user of each example (user-level DP), or None for example-level data."""
        return None

    @property
    def group_ids(self) -> np.ndarray | None:
        """Integer group of each example (e.g. patient) for disjoint splits, or None."""
        return None

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        index = int(i)
        if not -len(self) <= index < len(self):
            raise IndexError(f"index {i} out of range for a source of length {len(self)}")
        batch = self._fetch(np.array([index % len(self)], dtype=np.int64))
        return {key: value[0] for key, value in batch.items()}

    def gather(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Returns the examples at `indices` stacked; rows where the index is -1 are all zeros.

        Args:
            indices: 1-D integer array; -1 marks a padding row.

        Returns:
            A dict of arrays with leading dimension `len(indices)`.

        Privacy:
            Padding rows are exact zeros, so after masking they contribute nothing to a clipped sum.
        """
        indices = _check_index_vector(indices, len(self))
        mask = padding_mask(indices)
        real = self._fetch(indices[mask])
        out = {}
        for key, values in real.items():
            full = np.zeros((len(indices), *values.shape[1:]), dtype=values.dtype)
            full[mask] = values
            out[key] = full
        return out


class ArraySource(Source):
    """A source over in-memory numpy arrays that share their leading dimension.

    Args:
        arrays: name -> array with leading dimension n.
        user_ids: optional integer user of each example.
        group_ids: optional integer group of each example.
    """

    def __init__(
        self,
        arrays: Mapping[str, np.ndarray],
        *,
        user_ids: np.ndarray | None = None,
        group_ids: np.ndarray | None = None,
    ):
        if not arrays:
            raise ValueError("ArraySource needs at least one array")
        self._arrays = {key: np.asarray(value) for key, value in arrays.items()}
        lengths = {
            key: value.shape[0] if value.ndim else None for key, value in self._arrays.items()
        }
        if len(set(lengths.values())) != 1 or None in lengths.values():
            raise ValueError(f"arrays must share a leading dimension, got {lengths}")
        self._length = next(iter(lengths.values()))
        self._user_ids = _check_ids(user_ids, self._length, "user_ids")
        self._group_ids = _check_ids(group_ids, self._length, "group_ids")

    def __len__(self) -> int:
        return self._length

    @property
    def arrays(self) -> Mapping[str, np.ndarray]:
        """The underlying arrays (read them, do not modify them)."""
        return self._arrays

    @property
    def user_ids(self) -> np.ndarray | None:
        return self._user_ids

    @property
    def group_ids(self) -> np.ndarray | None:
        return self._group_ids

    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return {key: value[indices] for key, value in self._arrays.items()}


class SubsetSource(Source):
    """The examples of `source` at `indices`, in that order (user and group ids follow)."""

    def __init__(self, source: Source, indices: np.ndarray):
        self._source = source
        self._indices = _check_index_vector(indices, len(source))
        if (self._indices < 0).any():
            raise ValueError("SubsetSource indices must be non-negative")

    def __len__(self) -> int:
        return len(self._indices)

    @property
    def user_ids(self) -> np.ndarray | None:
        ids = self._source.user_ids
        return None if ids is None else ids[self._indices]

    @property
    def group_ids(self) -> np.ndarray | None:
        ids = self._source.group_ids
        return None if ids is None else ids[self._indices]

    def _fetch(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        return self._source._fetch(self._indices[indices])


def _check_fractions(fractions: Sequence[float]) -> np.ndarray:
    fractions = np.asarray(fractions, dtype=np.float64)
    if fractions.ndim != 1 or len(fractions) == 0:
        raise ValueError(f"fractions must be a non-empty 1-D sequence, got {fractions}")
    if (fractions < 0).any() or not np.isclose(fractions.sum(), 1.0, atol=1e-6):
        raise ValueError(f"fractions must be non-negative and sum to 1, got {fractions.tolist()}")
    return fractions


def _cut_points(n: int, fractions: np.ndarray) -> np.ndarray:
    return np.round(np.cumsum(fractions)[:-1] * n).astype(np.int64)


def random_split(n: int, fractions: Sequence[float], *, seed: int) -> tuple[np.ndarray, ...]:
    """Splits `range(n)` at random into parts of the given fractions (rounded), seeded.

    Returns:
        One sorted int64 index array per fraction; together they partition `range(n)`.
    """
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}")
    fractions = _check_fractions(fractions)
    order = np.random.default_rng(seed).permutation(n)
    return tuple(np.sort(part) for part in np.split(order, _cut_points(n, fractions)))


def group_disjoint_split(
    group_ids: np.ndarray, fractions: Sequence[float], *, seed: int
) -> tuple[np.ndarray, ...]:
    """Splits examples so that every group (user, patient) falls in exactly one part.

    Each group's part is a keyed hash of its id (`privacy.assign_parts`), so part sizes match
    the fractions in expectation, and adding or removing a group moves no other group.

    Args:
        group_ids: the group (user, patient) id of each example, shape (n,): ints or strings.
        fractions: fraction of groups per part, non-negative, summing to 1.
        seed: the hash key.

    Returns:
        One sorted int64 array of example indices per fraction.

    Privacy:
        Parts are disjoint by group, so mechanisms run on different parts compose in parallel
        under the group-level (user-level) neighbouring relation; a group's part depends on its
        own id and the key only, as add/remove composition needs.
    """
    group_ids = np.asarray(group_ids)
    if group_ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {group_ids.shape}")
    fractions = _check_fractions(fractions)
    groups, inverse = np.unique(group_ids, return_inverse=True)
    used = np.flatnonzero(np.asarray(fractions) > 0)
    part_of_group = used[assign_parts(groups.tolist(), [fractions[i] for i in used], key=seed)]
    part_of_example = part_of_group[inverse]
    return tuple(np.flatnonzero(part_of_example == part) for part in range(len(fractions)))


@dataclasses.dataclass(frozen=True)
class GroupIndex:
    """Examples grouped by user (or any group), for user-level sampling.

    Attributes:
        groups: sorted distinct group ids, shape (u,).
        order: example indices sorted by group, shape (n,).
        starts: start of each group's run in `order`, shape (u,).
        counts: number of examples of each group, shape (u,).
    """

    groups: np.ndarray
    order: np.ndarray
    starts: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_ids(cls, group_ids: np.ndarray) -> GroupIndex:
        """Builds the index from the integer group of each example."""
        group_ids = np.asarray(group_ids)
        if group_ids.ndim != 1 or not np.issubdtype(group_ids.dtype, np.integer):
            raise ValueError(f"group_ids must be a 1-D integer array, got {group_ids.dtype}")
        order = np.argsort(group_ids, kind="stable")
        groups, starts, counts = np.unique(group_ids[order], return_index=True, return_counts=True)
        return cls(groups=groups, order=order, starts=starts, counts=counts)

    def __len__(self) -> int:
        return len(self.groups)

    def sample(
        self, group_rows: np.ndarray, max_per_group: int, rng: np.random.Generator
    ) -> np.ndarray:
        """Returns up to `max_per_group` example indices of each requested group, -1 padded.

        Args:
            group_rows: positions into `groups` (0..u-1) of the sampled groups; -1 rows are padding.
            max_per_group: G, the cap on examples per group.
            rng: numpy Generator choosing which examples a group larger than G contributes.

        Returns:
            int64 array (len(group_rows), max_per_group); row r lists min(G, count) distinct
            examples of group r followed by -1.

        Privacy:
            Each user contributes at most G examples, which bounds a user's influence before the
            per-user average and clipping.
        """
        if max_per_group < 1:
            raise ValueError(f"max_per_group must be >= 1, got {max_per_group}")
        group_rows = _check_index_vector(group_rows, len(self))
        out = np.full((len(group_rows), max_per_group), PAD_INDEX, dtype=np.int64)
        for r, g in enumerate(group_rows):
            if g < 0:
                continue
            members = self.order[self.starts[g] : self.starts[g] + self.counts[g]]
            if len(members) > max_per_group:
                members = rng.choice(members, size=max_per_group, replace=False)
            out[r, : len(members)] = members
        return out
