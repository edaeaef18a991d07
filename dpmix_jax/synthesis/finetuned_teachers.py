"""Fine-tuned teachers: one LoRA adapter per teacher, trained on that teacher's documents only.

In-context teachers (`pate.teachers.InContextTeachers`) read their documents from the prompt; a
small public model uses such a prompt poorly. Fine-tuned teachers instead train their own
low-rank adapters (`models.lora`) on the last blocks of the shared public GPT-2, each on its own
part of the sensitive documents, and then predict from the public context alone:

* `TeacherTuning`: the adapters' shape, where they sit and how long each teacher trains;
* `finetune_teachers(model, documents, parts, ...)`: trains every teacher's adapter (full-batch
  Adam on next-token loss over its documents; teachers trained side by side with `vmap`, chunked
  with `lax.map`) and returns `FineTunedTeachers`;
* `FineTunedTeachers`: `teachers(prefix) -> (n, V)` logits, every teacher's adapter over the
  same public context, one KV cache per teacher so a decoding loop runs one token per step.

Example:
    >>> from flax import nnx
    >>> from dpmix_jax.models.gpt2 import GPT2, GPT2Config
    >>> model = GPT2(GPT2Config.tiny(vocab_size=32, n_positions=16), rngs=nnx.Rngs(0))
    >>> documents = [[5, 6, 7], [8, 9], [5, 5, 5], [10, 11, 12]]
    >>> teachers = finetune_teachers(
    ...     model, documents, [[0, 1], [2, 3]], context=[0], end=[1],
    ...     tuning=TeacherTuning(steps=2))
    >>> teachers([]).shape
    (2, 32)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dpmix_jax.models import lora
from dpmix_jax.models.gpt2 import GPT2
from dpmix_jax.privacy import validation

__all__ = ["FineTunedTeachers", "TeacherTuning", "check_model", "finetune_teachers"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherTuning:
    """How every fine-tuned teacher trains its own adapter.

    Attributes:
        lora: the adapters' rank, scale and targets (every teacher has its own copy; all start
            from the same data-independent initialisation, B = 0).
        last_blocks: adapters train in the last `last_blocks` transformer blocks only (earlier
            blocks stay exactly the public model).
        steps: full-batch Adam steps over the teacher's documents.
        learning_rate: Adam's step size.
        chunk: teachers trained at once (memory: a chunk holds chunk x documents x tokens
            logits).
    """

    lora: lora.LoraConfig = lora.LoraConfig(rank=8, alpha=16.0)
    last_blocks: int = 1
    steps: int = 30
    learning_rate: float = 1e-2
    chunk: int = 16

    def __post_init__(self) -> None:
        if not isinstance(self.lora, lora.LoraConfig):
            raise ValueError(f"lora must be a LoraConfig, got {type(self.lora).__name__}.")
        for name in ("last_blocks", "steps", "chunk"):
            validation.check_steps(getattr(self, name), name)
        if not self.learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {self.learning_rate!r}.")


def check_model(model, source: str = "the public model") -> None:
    """Refuses a public model fine-tuned teachers do not support: anything but a GPT-2 (their
    adapters, training rows and caches follow GPT-2's layout and length).

    Raises:
        ValueError: one line naming `source` and the in-context alternative.
    """
    if not isinstance(model, GPT2):
        raise ValueError(
            f"fine-tuned teachers need a GPT-2 public model, and {source} is a "
            f"{type(model).__name__}; use in-context teachers with it"
        )


def _adapter_filter(n_layer: int, last_blocks: int):
    """The adapter parameters of the last `last_blocks` blocks (what a teacher trains)."""

    def trainable(path, value) -> bool:
        in_last = len(path) > 1 and path[0] == "h" and int(path[1]) >= n_layer - last_blocks
        named = any(name in path for name in ("lora_a", "lora_b"))
        return isinstance(value, nnx.Param) and in_last and named

    return trainable


def _rows(
    documents: Sequence[Sequence[int]],
    parts: Sequence[Sequence[int]],
    *,
    context: Sequence[int],
    end: Sequence[int],
    length: int,
) -> tuple[np.ndarray, ...]:
    """(inputs, input mask, targets, loss weights), each (n, R, length - 1): teacher i's row r
    is `context + document + end` of its r-th document, right-padded (mask 0); the loss covers
    the document and `end` (what the teacher learns to write after the context). R: the
    largest part (a teacher's missing rows are all zero)."""
    width = max(1, max(len(part) for part in parts))
    tokens = np.zeros((len(parts), width, length), np.int32)
    present = np.zeros((len(parts), width, length), np.int32)
    weights = np.zeros((len(parts), width, length), np.float32)
    for i, part in enumerate(parts):
        for r, index in enumerate(part):
            row = [*context, *documents[int(index)], *end]
            tokens[i, r, : len(row)] = row
            present[i, r, : len(row)] = 1
            weights[i, r, len(context) : len(row)] = 1.0
    return tokens[..., :-1], present[..., :-1], tokens[..., 1:], weights[..., 1:]


@functools.partial(jax.jit, static_argnames=("graphdef", "steps", "learning_rate", "chunk"))
def _train(graphdef, start, frozen, rows, *, steps, learning_rate, chunk):
    """Every teacher's adapter after `steps` full-batch Adam steps on its own `rows`.

    A teacher's gradient is summed document by document in a scan, each document one row of
    the model's full (public) length, and padding documents add exact zeros: the adapter is the
    same to the last bit whatever the other teachers hold (how many documents, how long).
    """
    optimizer = optax.adam(learning_rate)

    def teacher(rows):
        def document_loss(adapter, row):
            inputs, mask, targets, weights = row
            model = nnx.merge(graphdef, adapter, frozen)
            logits = model(inputs[None], attention_mask=mask[None])[0]
            return (
                optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights
            ).sum()

        def gradient(adapter):
            def add(total, row):
                grads, weight = total
                present = row[3].sum() > 0
                step = jax.grad(document_loss)(adapter, row)
                grads = jax.tree.map(lambda g, d: g + jnp.where(present, d, 0.0), grads, step)
                return (grads, weight + row[3].sum()), None

            zeros = jax.tree.map(jnp.zeros_like, adapter)
            (grads, weight), _ = jax.lax.scan(add, (zeros, jnp.float32(0)), rows)
            return jax.tree.map(lambda g: g / jnp.maximum(weight, 1.0), grads)

        def step(carry, _):
            adapter, state = carry
            updates, state = optimizer.update(gradient(adapter), state, adapter)
            return (optax.apply_updates(adapter, updates), state), None

        (adapter, _), _ = jax.lax.scan(step, (start, optimizer.init(start)), length=steps)
        return adapter

    return jax.lax.map(teacher, rows, batch_size=chunk)


@functools.partial(jax.jit, static_argnums=0)
def _extend_all(graphdef, adapters, frozen, input_ids, caches):
    """Every teacher's last-position logits after `input_ids` (T,) and its extended cache."""

    def teacher(adapter, cache):
        model = nnx.merge(graphdef, adapter, frozen)
        logits, cache = model.extend(input_ids[None], cache)
        return logits[0, -1], cache

    return jax.vmap(teacher)(adapters, caches)


def finetune_teachers(
    model: GPT2,
    documents: Sequence[Sequence[int]],
    parts: Sequence[Sequence[int]],
    *,
    context: Sequence[int],
    end: Sequence[int],
    tuning: TeacherTuning = TeacherTuning(),  # noqa: B008 (frozen, immutable)
    seed: int = 0,
) -> FineTunedTeachers:
    """Fine-tunes one adapter per part of `documents`: teacher i learns `parts[i]` only.

    Args:
        model: the public GPT-2 (left unchanged; the teachers add adapters to a copy).
        documents: token ids of every sensitive document.
        parts: the positions (into `documents`) of each teacher's documents, disjoint
            (`pate.teachers.partition_records`); an empty part leaves its teacher the public model.
        context: the public tokens every row starts with and every query continues (for
            instance EOS and a public prompt); they are not trained on.
        end: the tokens after each document (a separator or EOS), trained on.
        tuning: the adapters and their training.
        seed: seed of the adapters' shared, data-independent initialisation.

    Returns:
        The n teachers.

    Raises:
        ValueError: a model other than GPT-2, fewer than 2 parts, an empty context, a document
            whose row is longer than the model's context, or more blocks than the model has.

    Privacy:
        Teacher i's adapter is trained on the documents in `parts[i]` alone (the start point
        and the context are public), so with a disjoint, data-independent partition one unit
        changes one teacher. The adapters are as sensitive as those documents: read them only
        through a DP aggregator.
    """
    check_model(model)
    if len(parts) < 2:
        raise ValueError(f"need at least 2 teachers, got {len(parts)} parts.")
    if not context:
        raise ValueError("context must hold at least one token (for instance EOS).")
    n_layer, positions = int(model.config.n_layer), int(model.config.n_positions)
    if tuning.last_blocks > n_layer:
        raise ValueError(
            f"tuning.last_blocks = {tuning.last_blocks} but the model has {n_layer} blocks."
        )
    longest = len(context) + max(
        (len(documents[int(i)]) for part in parts for i in part), default=0
    )
    if longest + len(end) > positions:
        raise ValueError(
            f"a document needs {longest + len(end)} positions with the context and end, more "
            f"than the model's {positions}; split it into shorter documents."
        )
    adapted = lora.add_lora(nnx.clone(model), tuning.lora, rngs=nnx.Rngs(seed))
    graphdef, start, frozen = nnx.split(adapted, _adapter_filter(n_layer, tuning.last_blocks), ...)
    # Rows span the model's positions, a public length: no teacher's shapes depend on the data.
    rows = _rows(documents, parts, context=context, end=end, length=positions + 1)
    adapters = _train(
        graphdef,
        start,
        frozen,
        tuple(jnp.asarray(r) for r in rows),
        steps=tuning.steps,
        learning_rate=tuning.learning_rate,
        chunk=min(tuning.chunk, len(parts)),
    )
    return FineTunedTeachers(graphdef, adapters, frozen, context=context, capacity=positions)


class FineTunedTeachers:
    """n fine-tuned teachers over one public GPT-2: its frozen weights and one adapter each.

    Every teacher reads the same public context; a call runs only the prefix's new tokens after
    the previous call's prefix (one KV cache per teacher), so the logits equal each adapted
    model's full forward pass over context + prefix. Build them with `finetune_teachers`.

    Privacy:
        The adapters (and the caches computed from them) are sensitive: teacher i's depend on
        its own documents only.
    """

    def __init__(self, graphdef, adapters, frozen, *, context: Sequence[int], capacity: int):
        self._graphdef, self._adapters, self._frozen = graphdef, adapters, frozen
        self._context = [int(t) for t in context]
        self._capacity = capacity
        self.num_teachers = int(jax.tree.leaves(adapters)[0].shape[0])
        model = nnx.merge(graphdef, jax.tree.map(lambda x: x[0], adapters), frozen)
        self.vocab_size = int(model.config.vocab_size)
        empty = model.init_cache(1, capacity)
        self._empty = jax.tree.map(
            lambda x: jnp.broadcast_to(x, (self.num_teachers, *x.shape)), empty
        )
        self._last: tuple[tuple[int, ...], object, jax.Array] | None = None

    def __call__(self, prefix: Sequence[int]) -> jax.Array:
        """`(n, V)` float32 next-token logits of every teacher after the context + `prefix`.

        Privacy:
            Reads every teacher's adapter; the result is sensitive.
        """
        prefix = tuple(int(t) for t in prefix)
        if len(self._context) + len(prefix) > self._capacity:
            raise ValueError(
                f"context + prefix has {len(self._context) + len(prefix)} tokens, more than the "
                f"model's {self._capacity}."
            )
        if self._last is not None and prefix[: len(self._last[0])] == self._last[0]:
            done, caches, logits = self._last
            new = prefix[len(done) :]
        else:
            caches, logits = self._empty, None
            new = (*self._context, *prefix)
        if new:
            logits, caches = _extend_all(
                self._graphdef, self._adapters, self._frozen, jnp.asarray(new, jnp.int32), caches
            )
        self._last = (prefix, caches, logits)
        return logits
