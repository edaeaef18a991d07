"""Host-side Poisson sampling of examples and users, padded to few static shapes.

Batches are index arrays built with a numpy `Generator` (the sampler state is therefore a plain,
checkpointable dict). Each unit (an example, or a user) joins a batch independently with
probability q, which is exactly what `accounting.dpsgd_event` assumes. The realised batch is padded
with -1 to a multiple of `pad_multiple` so that jitted steps see few distinct shapes; the mask marks
the real rows, and padded rows must contribute exactly zero downstream (see `clipping`).

Example:
    >>> import numpy as np
    >>> sampler = PoissonSampler(sampling_rate=0.1, pad_multiple=8)
    >>> batch = sampler.sample(np.random.default_rng(0), num_units=100)
    >>> batch.indices.shape[0] % 8, int(batch.mask.sum()) == int((batch.indices >= 0).sum())
    (0, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import numpy as np

from dpmix_jax.privacy.validation import check_sampling_rate

PADDING_INDEX = -1


class IndexBatch(NamedTuple):
    """A padded batch of example indices: `indices` (B,) with -1 for padding, `mask` (B,) bool."""

    indices: np.ndarray
    mask: np.ndarray


class UserBatch(NamedTuple):
    """A padded batch of users, each with up to G example indices.

    Attributes:
        indices: `(U, G)` example indices, -1 where there is no example (padding).
        mask: `(U, G)` bool, True for real examples.
        users: `(U,)` the sampled user ids (positions into the user list), -1 for padded users.
    """

    indices: np.ndarray
    mask: np.ndarray
    users: np.ndarray


def padded_size(size: int, multiple: int) -> int:
    """The smallest positive multiple of `multiple` that holds `size` rows."""
    return max(multiple, multiple * math.ceil(size / multiple))


def pad_indices(indices: np.ndarray, multiple: int, size: int | None = None) -> IndexBatch:
    """Pads a 1-D index array with -1 to `size` (default: the next multiple of `multiple`)."""
    indices = np.asarray(indices, dtype=np.int64)
    target = padded_size(len(indices), multiple) if size is None else size
    if target < len(indices):
        raise ValueError(f"cannot pad {len(indices)} indices to a smaller size {target}.")
    padded = np.full(target, PADDING_INDEX, dtype=np.int64)
    padded[: len(indices)] = indices
    return IndexBatch(padded, padded != PADDING_INDEX)


def _check_pad_multiple(pad_multiple: int) -> None:
    if not isinstance(pad_multiple, int | np.integer) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be an integer >= 1, got {pad_multiple!r}.")


def _check_num_units(num_units: int, what: str) -> None:
    if not isinstance(num_units, int | np.integer) or num_units < 1:
        raise ValueError(f"{what} must be an integer >= 1, got {num_units!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoissonSampler:
    """Poisson sampling of example indices: each of n examples joins with probability q.

    Attributes:
        sampling_rate: q in (0, 1].
        pad_multiple: batches are padded with -1 to a multiple of this (default 32).
    """

    sampling_rate: float
    pad_multiple: int = 32

    def __post_init__(self) -> None:
        check_sampling_rate(self.sampling_rate)
        _check_pad_multiple(self.pad_multiple)

    def sample_indices(self, rng: np.random.Generator, num_units: int) -> np.ndarray:
        """The unpadded indices of one Poisson batch over `range(num_units)`.

        Privacy: the batch is sensitive (it depends on the data set size); only its use inside an
        accounted mechanism is private.
        """
        _check_num_units(num_units, "num_units")
        return np.flatnonzero(rng.random(num_units) < self.sampling_rate)

    def sample(self, rng: np.random.Generator, num_units: int) -> IndexBatch:
        """One Poisson batch over `range(num_units)`, padded to a multiple of `pad_multiple`."""
        return pad_indices(self.sample_indices(rng, num_units), self.pad_multiple)

    def sample_steps(self, rng: np.random.Generator, num_units: int, steps: int) -> IndexBatch:
        """`steps` Poisson batches stacked to one static shape `(steps, B)` for `lax.scan`.

        B is the largest realised batch of the run rounded up to `pad_multiple`; every batch is
        still an independent Poisson sample, only the padding differs.
        """
        batches = [self.sample_indices(rng, num_units) for _ in range(steps)]
        size = padded_size(max(len(b) for b in batches), self.pad_multiple)
        padded = [pad_indices(b, self.pad_multiple, size) for b in batches]
        return IndexBatch(np.stack([p.indices for p in padded]), np.stack([p.mask for p in padded]))


def group_by_user(user_ids: np.ndarray) -> list[np.ndarray]:
    """Example indices of each user, in order of the sorted distinct user ids."""
    user_ids = np.asarray(user_ids)
    if user_ids.ndim != 1 or len(user_ids) == 0:
        raise ValueError("user_ids must be a non-empty 1-D array with one id per example.")
    order = np.argsort(user_ids, kind="stable")
    _, starts = np.unique(user_ids[order], return_index=True)
    return np.split(order, starts[1:])


@dataclasses.dataclass(frozen=True, kw_only=True)
class UserPoissonSampler:
    """User-level Poisson sampling: each user joins with probability q, bringing <= G examples.

    A sampled user with more than G examples contributes a uniformly random subset of G of them,
    drawn afresh each step. Users with no examples are rejected up front: they would change the
    sampling rate the accountant sees.

    Attributes:
        sampling_rate: q_u in (0, 1], the per-user inclusion probability.
        max_examples_per_user: G >= 1.
        pad_multiple: the user axis is padded with -1 to a multiple of this.
    """

    sampling_rate: float
    max_examples_per_user: int
    pad_multiple: int = 32

    def __post_init__(self) -> None:
        check_sampling_rate(self.sampling_rate)
        _check_pad_multiple(self.pad_multiple)
        if (
            not isinstance(self.max_examples_per_user, int | np.integer)
            or self.max_examples_per_user < 1
        ):
            raise ValueError(
                "max_examples_per_user must be an integer >= 1, "
                f"got {self.max_examples_per_user!r}."
            )

    def _sample_users(
        self, rng: np.random.Generator, users: list[np.ndarray]
    ) -> tuple[np.ndarray, np.ndarray]:
        if not users or any(len(u) == 0 for u in users):
            raise ValueError("every user must have at least one example.")
        chosen = np.flatnonzero(rng.random(len(users)) < self.sampling_rate)
        rows = np.full((len(chosen), self.max_examples_per_user), PADDING_INDEX, dtype=np.int64)
        for row, user in enumerate(chosen):
            examples = users[user]
            if len(examples) > self.max_examples_per_user:
                examples = rng.choice(examples, self.max_examples_per_user, replace=False)
            rows[row, : len(examples)] = examples
        return chosen, rows

    def sample(self, rng: np.random.Generator, users: list[np.ndarray]) -> UserBatch:
        """One batch of users (see `group_by_user` for `users`), padded on the user axis.

        Privacy: the batch depends on the sensitive data; use it only inside an accounted step.
        """
        chosen, rows = self._sample_users(rng, users)
        return self._pad(chosen, rows, padded_size(len(chosen), self.pad_multiple))

    def sample_steps(
        self, rng: np.random.Generator, users: list[np.ndarray], steps: int
    ) -> UserBatch:
        """`steps` user batches stacked to one static shape `(steps, U, G)` for `lax.scan`."""
        draws = [self._sample_users(rng, users) for _ in range(steps)]
        size = padded_size(max(len(c) for c, _ in draws), self.pad_multiple)
        padded = [self._pad(c, r, size) for c, r in draws]
        return UserBatch(*(np.stack(parts) for parts in zip(*padded, strict=True)))

    def _pad(self, chosen: np.ndarray, rows: np.ndarray, size: int) -> UserBatch:
        indices = np.full((size, self.max_examples_per_user), PADDING_INDEX, dtype=np.int64)
        indices[: len(rows)] = rows
        users = np.full(size, PADDING_INDEX, dtype=np.int64)
        users[: len(chosen)] = chosen
        return UserBatch(indices, indices != PADDING_INDEX, users)


def generator_state(rng: np.random.Generator) -> dict[str, Any]:
    """The state of a numpy Generator as a JSON-friendly dict (for checkpoints)."""
    return rng.bit_generator.state


def restore_generator(state: dict[str, Any]) -> np.random.Generator:
    """A numpy Generator continuing exactly from `generator_state(...)`."""
    bit_generator = getattr(np.random, state["bit_generator"])()
    bit_generator.state = state
    return np.random.Generator(bit_generator)
