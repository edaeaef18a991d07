"""Teacher ensembles over our own models, and synthetic ensembles for tests.

* `partition_records`: a data-independent partition of sensitive records into n disjoint parts.
* `build_prompts`: one in-context prompt per teacher from its own part only.
* `InContextTeachers`: n prompts over one Flax GPT-2; the prompts (plus the shared generated
  prefix) are batched, right-padded to a common bucketed length, and each teacher's logits are read
  at its own last real position (causal attention makes right padding exact without a mask).
* `TableTeachers`: synthetic teachers whose logits depend on the last token (a per-teacher Markov
  table), for tests and experiments that need a known ground truth.

All of them implement `dpmix_jax.pate.generation.Teachers`: `teachers(prefix) -> (n, V)` logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.models.gpt2 import GPT2

__all__ = ["InContextTeachers", "TableTeachers", "build_prompts", "partition_records"]


def partition_records(num_records: int, num_teachers: int, *, seed: int) -> list[np.ndarray]:
    """A random partition of record indices `0..num_records-1` into `num_teachers` disjoint parts.

    The partition depends only on (num_records, num_teachers, seed), never on record contents,
    so one record always affects exactly one teacher. Parts differ in size by at most one.

    Privacy:
        Data-independent by construction; the seed need not be secret.
    """
    if num_teachers < 1 or num_records < num_teachers:
        raise ValueError(
            f"need 1 <= num_teachers <= num_records, got {num_teachers} teachers "
            f"for {num_records} records."
        )
    order = np.random.default_rng(seed).permutation(num_records)
    return np.array_split(order, num_teachers)


def build_prompts(
    records: Sequence[Sequence[int]],
    parts: Sequence[np.ndarray],
    *,
    separator: Sequence[int],
    records_per_teacher: int,
) -> list[list[int]]:
    """Teacher i's prompt: its first `records_per_teacher` records joined and ended by `separator`.

    Privacy:
        Teacher i's prompt reads only the records in `parts[i]`; with a disjoint, data-independent
        `parts`, one record influences one teacher.
    """
    if records_per_teacher < 1:
        raise ValueError(f"records_per_teacher must be >= 1, got {records_per_teacher}.")
    prompts = []
    for part in parts:
        if len(part) < records_per_teacher:
            raise ValueError(
                f"a part has {len(part)} records, fewer than records_per_teacher = "
                f"{records_per_teacher}."
            )
        prompt: list[int] = []
        for index in part[:records_per_teacher]:
            prompt.extend(int(t) for t in records[int(index)])
            prompt.extend(int(t) for t in separator)
        prompts.append(prompt)
    return prompts


@functools.partial(jax.jit, static_argnums=0)
def _last_logits(graphdef, state, input_ids, last):
    model = nnx.merge(graphdef, state)
    logits = model(input_ids)
    return jnp.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


class InContextTeachers:
    """In-context teachers: one GPT-2, one private prompt per teacher.

    Args:
        model: a `dpmix_jax.models.gpt2.GPT2`.
        prompts: one token list per teacher (see `build_prompts`).
        batch_size: teachers per forward pass (the ensemble is padded to a multiple of it).
        length_bucket: sequences are right-padded to a multiple of this, so a decoding loop
            compiles once per bucket rather than once per step.
        pad_id: the padding token (never attended to by real tokens: padding is on the right).

    Privacy:
        Teacher i's logits depend on its own prompt only (and on the shared public prefix).
    """

    def __init__(
        self,
        model: GPT2,
        prompts: Sequence[Sequence[int]],
        *,
        batch_size: int = 64,
        length_bucket: int = 16,
        pad_id: int = 0,
    ):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("need at least one teacher, and every prompt must be non-empty.")
        if batch_size < 1 or length_bucket < 1:
            raise ValueError(
                f"batch_size and length_bucket must be >= 1, got {batch_size}, {length_bucket}."
            )
        self._graphdef, self._state = nnx.split(model)
        self._prompts = [list(map(int, p)) for p in prompts]
        self._max_len = int(model.config.n_positions)
        self._batch_size = min(batch_size, len(prompts))
        self._bucket = length_bucket
        self._pad_id = pad_id
        self.vocab_size = int(model.config.vocab_size)

    @property
    def num_teachers(self) -> int:
        return len(self._prompts)

    def __call__(self, prefix: Sequence[int]) -> jax.Array:
        """`(n, V)` float32 next-token logits of every teacher after its prompt + `prefix`.

        Privacy:
            Reads every teacher's private prompt; the result is sensitive.
        """
        rows = [p + [int(t) for t in prefix] for p in self._prompts]
        longest = max(map(len, rows))
        width = min(-(-longest // self._bucket) * self._bucket, self._max_len)
        if longest > width:
            raise ValueError(
                f"prompt + prefix has {longest} tokens, more than the model's {self._max_len}."
            )
        num_rows = -(-len(rows) // self._batch_size) * self._batch_size
        ids = np.full((num_rows, width), self._pad_id, np.int32)
        last = np.zeros((num_rows,), np.int32)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = row
            last[i] = len(row) - 1
        outputs = [
            _last_logits(
                self._graphdef,
                self._state,
                jnp.asarray(ids[s : s + self._batch_size]),
                jnp.asarray(last[s : s + self._batch_size]),
            )
            for s in range(0, num_rows, self._batch_size)
        ]
        return jnp.concatenate(outputs)[: self.num_teachers]


class TableTeachers:
    """Synthetic teachers: teacher i's next-token logits are `table[i, prefix[-1]]`.

    With an empty prefix, row `start_token` is used. `table` has shape `(n, V, V)`.
    """

    def __init__(self, table: jax.Array, *, start_token: int = 0):
        table = jnp.asarray(table, jnp.float32)
        if table.ndim != 3 or table.shape[1] != table.shape[2]:
            raise ValueError(f"table must have shape (n, V, V), got {table.shape}.")
        if not 0 <= start_token < table.shape[1]:
            raise ValueError(f"start_token must be in [0, {table.shape[1]}), got {start_token}.")
        self._table = table
        self._start = start_token
        self.vocab_size = int(table.shape[1])

    @property
    def num_teachers(self) -> int:
        return int(self._table.shape[0])

    def __call__(self, prefix: Sequence[int]) -> jax.Array:
        """`(n, V)` logits given the last token of `prefix`."""
        last = int(prefix[-1]) if len(prefix) else self._start
        return self._table[:, last]
