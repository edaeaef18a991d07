"""Cyclic Poisson sampling: b partitions taking turns, Poisson sampling inside the active one.

BandMF with b bands (`correlated_noise`) needs every unit to take part at most once every b
steps. Units are split into b partitions by a keyed hash of their id (`parts.assign_parts`, so
adding or removing a unit moves no other unit); at step t partition t mod b is active and each
of its units joins the batch independently with probability q. With n units and an expected
batch of B units, q = B / (n / b). One band is plain Poisson sampling: the samplers then draw
exactly the batches of `sampling.PoissonSampler` / `UserPoissonSampler` from the same rng.

Example:
    >>> import numpy as np
    >>> parts = cyclic_parts(np.arange(100), bands=4, key=b"k")
    >>> sampler = CyclicPoissonSampler(sampling_rate=0.2, bands=4, pad_multiple=8)
    >>> batch = sampler.sample(np.random.default_rng(0), parts, step=5)
    >>> bool(np.all(parts[batch.indices[batch.mask]] == 1))
    True
"""

from __future__ import annotations

import dataclasses

import numpy as np

from dpmix_jax.privacy.correlated_noise import check_bands
from dpmix_jax.privacy.parts import UnitId, assign_parts
from dpmix_jax.privacy.sampling import (
    IndexBatch,
    PoissonSampler,
    UserBatch,
    UserPoissonSampler,
    pad_indices,
    padded_size,
)


def cyclic_parts(unit_ids: np.ndarray | list[UnitId], *, bands: int, key: bytes) -> np.ndarray:
    """The partition (0 .. bands - 1) of every unit: `assign_parts` with b equal fractions.

    Args:
        unit_ids: one stable identifier per unit (example index or user id).
        bands: b, the number of partitions.
        key: the secret hash key (`correlated_noise.partition_key_bytes` of the run).

    Privacy: a unit's partition depends on its id and the key only; keep the key secret.
    """
    bands = check_bands(bands)
    if bands == 1:
        return np.zeros(len(unit_ids), np.int64)
    return assign_parts(unit_ids, (1.0 / bands,) * bands, key=key)


def _active_units(parts: np.ndarray, bands: int, step: int) -> np.ndarray:
    if not isinstance(step, int | np.integer) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}.")
    parts = np.asarray(parts)
    if parts.ndim != 1 or len(parts) == 0:
        raise ValueError("parts must be a non-empty 1-D array with one partition per unit.")
    if bands == 1:
        return np.arange(len(parts))
    return np.flatnonzero(parts == step % bands)


@dataclasses.dataclass(frozen=True, kw_only=True)
class CyclicPoissonSampler:
    """Example-level cyclic Poisson sampling.

    Attributes:
        sampling_rate: q in (0, 1], the inclusion probability inside the active partition.
        bands: b >= 1, the number of partitions (and the strategy's bands).
        pad_multiple: batches are padded with -1 to a multiple of this (default 32).
    """

    sampling_rate: float
    bands: int
    pad_multiple: int = 32

    def __post_init__(self) -> None:
        check_bands(self.bands)
        self._poisson()  # validates the rate and padding

    def _poisson(self) -> PoissonSampler:
        return PoissonSampler(sampling_rate=self.sampling_rate, pad_multiple=self.pad_multiple)

    def sample(self, rng: np.random.Generator, parts: np.ndarray, step: int) -> IndexBatch:
        """The padded batch of step `step`: Poisson over the examples of partition step mod b.

        Args:
            rng: the sampler's generator.
            parts: `(n,)` the partition of every example (`cyclic_parts`).
            step: the step index t (0-based); partition t mod b is active.

        Privacy: the batch depends on the sensitive data; use it only inside an accounted step.
        """
        return pad_indices(self._sample_indices(rng, parts, step), self.pad_multiple)

    def _sample_indices(self, rng: np.random.Generator, parts: np.ndarray, step: int):
        active = _active_units(parts, self.bands, step)
        chosen = self._poisson().sample_indices(rng, len(active)) if len(active) else []
        return active[chosen]

    def sample_steps(self, rng: np.random.Generator, parts: np.ndarray, steps: int) -> IndexBatch:
        """The batches of steps 0 .. steps - 1 stacked to one static shape `(steps, B)` (B: the
        largest batch rounded up to `pad_multiple`), as `PoissonSampler.sample_steps`."""
        batches = [self._sample_indices(rng, parts, step) for step in range(steps)]
        size = padded_size(max(len(b) for b in batches), self.pad_multiple)
        padded = [pad_indices(b, self.pad_multiple, size) for b in batches]
        return IndexBatch(np.stack([p.indices for p in padded]), np.stack([p.mask for p in padded]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class CyclicUserPoissonSampler:
    """User-level cyclic Poisson sampling: users take turns by partition; a sampled user brings
    at most G examples (a fresh random subset when it has more, as `UserPoissonSampler`).

    Attributes:
        sampling_rate: q in (0, 1], the per-user inclusion probability in the active partition.
        bands: b >= 1, the number of partitions.
        max_examples_per_user: G >= 1.
        pad_multiple: the user axis is padded with -1 to a multiple of this.
    """

    sampling_rate: float
    bands: int
    max_examples_per_user: int
    pad_multiple: int = 32

    def __post_init__(self) -> None:
        check_bands(self.bands)
        self._poisson()  # validates the rate, G and padding

    def _poisson(self) -> UserPoissonSampler:
        return UserPoissonSampler(
            sampling_rate=self.sampling_rate,
            max_examples_per_user=self.max_examples_per_user,
            pad_multiple=self.pad_multiple,
        )

    def sample(
        self, rng: np.random.Generator, users: list[np.ndarray], parts: np.ndarray, step: int
    ) -> UserBatch:
        """The padded user batch of step `step` (see `sampling.group_by_user` for `users`).

        Args:
            rng: the sampler's generator.
            users: the example indices of every user.
            parts: `(len(users),)` the partition of every user (`cyclic_parts`).
            step: the step index t (0-based); partition t mod b is active.

        Privacy: the batch depends on the sensitive data; use it only inside an accounted step.
        """
        chosen, rows = self._sample_users(rng, users, parts, step)
        return self._poisson()._pad(chosen, rows, padded_size(len(chosen), self.pad_multiple))

    def _sample_users(self, rng, users, parts, step) -> tuple[np.ndarray, np.ndarray]:
        if len(parts) != len(users):
            raise ValueError(f"parts has {len(parts)} entries for {len(users)} users.")
        active = _active_units(parts, self.bands, step)
        if not len(active):
            return active, np.zeros((0, self.max_examples_per_user), np.int64)
        chosen, rows = self._poisson()._sample_users(rng, [users[u] for u in active])
        return active[chosen], rows

    def sample_steps(
        self, rng: np.random.Generator, users: list[np.ndarray], parts: np.ndarray, steps: int
    ) -> UserBatch:
        """The user batches of steps 0 .. steps - 1 stacked to `(steps, U, G)`, as
        `UserPoissonSampler.sample_steps`."""
        draws = [self._sample_users(rng, users, parts, step) for step in range(steps)]
        size = padded_size(max(len(c) for c, _ in draws), self.pad_multiple)
        padded = [self._poisson()._pad(c, r, size) for c, r in draws]
        return UserBatch(*(np.stack(parts) for parts in zip(*padded, strict=True)))
