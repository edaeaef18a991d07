"""Teacher ensembles over our own models, and synthetic ensembles for tests.

* `partition_records`: a partition of sensitive records into n disjoint parts in which each
  record's part is a keyed hash of its own id (`privacy.assign_parts`).
* `build_prompts`: one in-context prompt per teacher from its own part only.
* `InContextTeachers`: n prompts over one Flax decoder (GPT-2 or Llama family); the prompts are
  left-padded to a public width, run once into KV caches of a public capacity, and each call
  runs only the shared generated prefix's new tokens after it.
* `TableTeachers`: synthetic teachers whose logits depend on the last token (a per-teacher Markov
  table), for tests and experiments that need a known ground truth.
* `sampled_logits`: API-only teachers, whose distributions are known only through m samples each.

All of them implement `dpmix_jax.pate.generation.Teachers`: `teachers(prefix) -> (n, V)` logits.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.privacy import validation
from dpmix_jax.privacy.parts import UnitId, assign_parts

if TYPE_CHECKING:
    from dpmix_jax.models.gpt2 import GPT2
    from dpmix_jax.models.llama import Llama

__all__ = [
    "InContextTeachers",
    "TableTeachers",
    "build_prompts",
    "partition_records",
    "sampled_logits",
]


def partition_records(
    record_ids: Sequence[UnitId] | np.ndarray,
    num_teachers: int,
    *,
    key: bytes | int | None = None,
) -> list[np.ndarray]:
    """The positions (into `record_ids`) of each teacher's records: `num_teachers` disjoint parts.

    Record r goes to teacher `assign_parts(record_ids, [1/n] * n, key=key)[r]`: part sizes are
    equal in expectation (Binomial, not exactly equal). Positions within a part are ascending.

    Args:
        record_ids: a stable identifier per record (its id in the source data, or its content);
            equal ids share a teacher.
        num_teachers: n >= 1.
        key: the assignment key; None draws a secret one (`privacy.assign_parts`).

    Privacy:
        A record's teacher depends on its own id and the key alone, so adding or removing one
        record changes one teacher's data and no other's. With a secret key nobody can tell in
        advance which teacher a record lands with.
    """
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, int) or num_teachers < 1:
        raise ValueError(f"num_teachers must be an integer >= 1, got {num_teachers!r}.")
    if len(record_ids) < num_teachers:
        raise ValueError(
            f"need at least as many records as teachers, got {num_teachers} teachers "
            f"for {len(record_ids)} records."
        )
    parts = assign_parts(record_ids, [1.0 / num_teachers] * num_teachers, key=key)
    return [np.flatnonzero(parts == teacher) for teacher in range(num_teachers)]


def build_prompts(
    records: Sequence[Sequence[int]],
    parts: Sequence[np.ndarray],
    *,
    separator: Sequence[int],
    records_per_teacher: int,
) -> list[list[int]]:
    """Teacher i's prompt: its first `records_per_teacher` records (all of them when its part is
    smaller) joined and ended by `separator`.

    Privacy:
        Teacher i's prompt reads only the records in `parts[i]`; with a disjoint, data-independent
        `parts`, one record influences one teacher.
    """
    if records_per_teacher < 1:
        raise ValueError(f"records_per_teacher must be >= 1, got {records_per_teacher}.")
    prompts = []
    for part in parts:
        prompt: list[int] = []
        for index in part[:records_per_teacher]:
            prompt.extend(int(t) for t in records[int(index)])
            prompt.extend(int(t) for t in separator)
        prompts.append(prompt)
    return prompts


@functools.partial(jax.jit, static_argnums=0)
def _extend(graphdef, state, input_ids, cache, attention_mask):
    """The last position's logits after `input_ids` and the extended KV cache."""
    model = nnx.merge(graphdef, state)
    logits, cache = model.extend(input_ids, cache, attention_mask=attention_mask)
    return logits[:, -1], cache


class InContextTeachers:
    """In-context teachers: one decoder, one private prompt per teacher.

    The prompts are left-padded to the public `width` and run once through the model into KV
    caches of the public `capacity` (`GPT2.extend`, `Llama.extend`); a call then runs only the
    shared prefix's tokens after them, and continues from the previous call's caches when its
    prefix extends the previous prefix (a decoding loop runs one token per step), else from
    the caches of the latest call that started from the prompts when it extends that one (the
    next sample after the same public prompt). The logits equal the full forward pass over
    prompt + prefix (padding takes no position and is never attended to).

    Memory: n · capacity keys and values per layer. Give `capacity` = `width` + the longest
    prefix a run can reach (e.g. width + prompt + max_new_tokens) rather than the model's
    positions: for SmolLM2 (8,192 positions, 30 layers of 3 · 64-wide key and value heads) a
    full-length cache takes 377 MB per teacher.

    Args:
        model: a `dpmix_jax.models.gpt2.GPT2` or `dpmix_jax.models.llama.Llama`.
        prompts: one token list per teacher (see `build_prompts`), each at most `width` tokens.
        width: the public prompt width every prompt is left-padded to, in [1, capacity]: a
            bound chosen without reading the prompts (e.g. the prompt budget they were built
            to fit), never their longest length.
        batch_size: teachers per forward pass (the ensemble is padded to a multiple of it with
            copies of prompt 0, whose rows are discarded).
        pad_id: the padding token id (masked out).
        capacity: tokens each cache row holds: the width plus the longest prefix a call may
            bring, in [width, n_positions]; None (default): the model's n_positions.

    Raises:
        ValueError: one line naming the argument: no prompts or an empty one, a width outside
            [1, n_positions], a capacity outside [width, n_positions], a prompt longer than
            `width`, a batch_size below 1.

    Privacy:
        The shapes of every computation depend on public numbers only (`width`, `capacity`, n,
        batch_size, the prefix), and every row is computed on its own (no reduction across
        rows), so teacher i's logits are a function of its own prompt and the public prefix
        only, bit for bit: changing another teacher's prompt, even its length, changes none of
        teacher i's bits, and whether a prefix is too long depends on `width` and `capacity`
        alone. Teacher i's cache rows hold its own prompt's keys and values, as sensitive as
        the prompt.
    """

    def __init__(
        self,
        model: GPT2 | Llama,
        prompts: Sequence[Sequence[int]],
        *,
        width: int,
        batch_size: int = 64,
        pad_id: int = 0,
        capacity: int | None = None,
    ):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("need at least one teacher, and every prompt must be non-empty.")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}.")
        self._max_len = int(model.config.n_positions)
        if not _is_count(width) or not 1 <= width <= self._max_len:
            raise ValueError(
                f"width must be an integer in [1, {self._max_len}] (the model's positions), "
                f"got {width!r}."
            )
        self._width = int(width)
        if capacity is None:
            capacity = self._max_len
        if not _is_count(capacity) or not self._width <= capacity <= self._max_len:
            raise ValueError(
                f"capacity must be an integer in [width = {self._width}, {self._max_len}] (the "
                f"model's positions), got {capacity!r}."
            )
        self._capacity = int(capacity)
        self._prompts = [list(map(int, p)) for p in prompts]
        for index, prompt in enumerate(self._prompts):
            if len(prompt) > self._width:
                raise ValueError(
                    f"prompts[{index}] has {len(prompt)} tokens, more than width = {self._width}."
                )
        self._model = model
        self._graphdef, self._state = nnx.split(model)
        self._batch_size = min(batch_size, len(prompts))
        self._pad_id = pad_id
        self.vocab_size = int(model.config.vocab_size)
        self._prompt_state = None  # (caches, logits) after the prompts alone, built on first use
        self._last = None  # (prefix, caches, logits) of the latest call
        # (prefix, caches, logits) of the latest call that started from the prompts: every
        # sample of a run starts from the same public prompt, which then runs once per run.
        self._anchor = None

    @property
    def num_teachers(self) -> int:
        return len(self._prompts)

    def _run(self, caches, ids, mask=None):
        """Runs `ids` (rows, T) after `caches` batch by batch; (logits (n, V), new caches)."""
        outputs, new_caches = [], []
        for b, cache in enumerate(caches):
            rows = slice(b * self._batch_size, (b + 1) * self._batch_size)
            batch_mask = None if mask is None else jnp.asarray(mask[rows])
            logits, cache = _extend(
                self._graphdef, self._state, jnp.asarray(ids[rows]), cache, batch_mask
            )
            outputs.append(logits)
            new_caches.append(cache)
        return jnp.concatenate(outputs)[: self.num_teachers], new_caches

    def _prompts_state(self):
        if self._prompt_state is None:
            num_rows = -(-self.num_teachers // self._batch_size) * self._batch_size
            ids = np.full((num_rows, self._width), self._pad_id, np.int32)
            mask = np.zeros((num_rows, self._width), np.int32)
            for i in range(num_rows):  # padding rows repeat the first prompt (discarded)
                prompt = self._prompts[i] if i < self.num_teachers else self._prompts[0]
                ids[i, self._width - len(prompt) :] = prompt
                mask[i, self._width - len(prompt) :] = 1
            empty = [
                self._model.init_cache(self._batch_size, self._capacity)
                for _ in range(num_rows // self._batch_size)
            ]
            logits, caches = self._run(empty, ids, mask)
            self._prompt_state = (caches, logits)
        return self._prompt_state

    def __call__(self, prefix: Sequence[int]) -> jax.Array:
        """`(n, V)` float32 next-token logits of every teacher after its prompt + `prefix`.

        Privacy:
            Reads every teacher's private prompt; the result is sensitive.
        """
        prefix = tuple(int(t) for t in prefix)
        if self._width + len(prefix) > self._capacity:
            limit = (
                f"the model's {self._max_len} positions"
                if self._capacity == self._max_len
                else f"the caches' capacity of {self._capacity} tokens"
            )
            raise ValueError(
                f"prefix has {len(prefix)} tokens; with the prompt width {self._width} that is "
                f"{self._width + len(prefix)}, more than {limit}."
            )
        restart = False
        if self._last is not None and prefix[: len(self._last[0])] == self._last[0]:
            done, caches, logits = self._last
        elif self._anchor is not None and prefix[: len(self._anchor[0])] == self._anchor[0]:
            done, caches, logits = self._anchor
        else:
            caches, logits = self._prompts_state()
            done, restart = (), True
        if len(prefix) > len(done):
            new = np.asarray(prefix[len(done) :], np.int32)
            ids = np.broadcast_to(new, (len(caches) * self._batch_size, len(new)))
            logits, caches = self._run(caches, ids)
        self._last = (prefix, caches, logits)
        if restart:
            self._anchor = self._last
        return logits


def _is_count(value) -> bool:
    """An integer (Python or NumPy), not a bool."""
    return not isinstance(value, bool) and isinstance(value, int | np.integer)


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


def sampled_logits(
    key: jax.Array, logits: jax.Array, num_samples: int, *, temperature: float = 1.0
) -> jax.Array:
    """API-only teachers: each distribution replaced by the empirical one of `num_samples` draws.

    A teacher behind an API that returns sampled tokens, not its distribution, is known through
    m answers to the same prompt; the samplers then run on the log-frequencies (-inf for tokens
    never drawn). With m = 1 every teacher is a point mass at its one draw, so coordinated
    sampling votes exactly that draw: the histogram of independent sampling. As m grows the
    estimate approaches the teacher's distribution and coordination returns.

    Args:
        key: PRNG key of the m draws of every teacher.
        logits: `(n, V)` the teachers' logits (what the API samples from).
        num_samples: m >= 1 draws per teacher.
        temperature: the API's sampling temperature.

    Returns:
        `(n, V)` float32 log empirical frequencies.

    Privacy:
        Each teacher's estimate depends on its own distribution only, so one teacher's data still
        moves one vote of a histogram drawn from the estimates; the draws are internal (never
        released) and their key need not be secret beyond the samplers' own.
    """
    if getattr(logits, "ndim", None) != 2:
        raise ValueError(f"logits must have shape (n, V), got {getattr(logits, 'shape', None)}.")
    num_samples = validation.check_steps(num_samples, "num_samples")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}.")
    n, vocab = logits.shape
    draws = jax.random.categorical(key, logits / temperature, axis=-1, shape=(num_samples, n))
    teachers = jnp.broadcast_to(jnp.arange(n), draws.shape)
    counts = jnp.zeros((n, vocab), jnp.float32).at[teachers, draws].add(1.0)
    return jnp.log(counts / num_samples)
