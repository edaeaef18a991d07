"""Teacher ensembles over a public language model, built from sensitive documents.

`build_ensemble` splits the documents' units among n teachers by a keyed hash
(`pate.partition.teacher_parts`); `build_unit_ensemble` gives every unit its own teacher (for
individual accounting). A teacher reads its documents in its prompt (`pate.teachers.
InContextTeachers`, as many as fit a public width; in a chat turn for a model with a chat
template, `synthesis.chat`) or trains its own LoRA adapter on all of them
(`finetuned_teachers`, GPT-2 only); the public model reads only the public prompt.

Every in-context teacher's KV cache holds the public width plus the public prompt plus
`max_new_tokens`, and so does the public fallback's, so a run costs the prompts' prefill once
plus one token per teacher per step, whatever the model's positions.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from dpmix_jax.pate import generation
from dpmix_jax.pate.partition import describe_document, document_units, teacher_parts
from dpmix_jax.pate.teachers import InContextTeachers
from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import finetuned_teachers, public_models
from dpmix_jax.synthesis.finetuned_teachers import TeacherTuning

__all__ = [
    "DEFAULT_CONTEXT_WIDTH",
    "TEACHER_KINDS",
    "Ensemble",
    "build_ensemble",
    "build_unit_ensemble",
    "prompt_layout",
]

TEACHER_KINDS = ("in_context", "fine_tuned")
# A teacher's context is at most this many tokens unless `context_width` says otherwise.
DEFAULT_CONTEXT_WIDTH = 256


class _CountingTeachers:
    """The teachers, counting their queries and reporting each step to `on_step`."""

    def __init__(self, teachers, on_step: Callable[[], None] | None):
        self._teachers = teachers
        self._on_step = on_step
        self.vocab_size = teachers.vocab_size
        self.calls = 0

    @property
    def num_teachers(self) -> int:
        return self._teachers.num_teachers

    def __call__(self, prefix):
        self.calls += 1
        if self._on_step is not None:
            self._on_step()
        return self._teachers(prefix)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ensemble:
    """Teachers over a public model (in context or fine-tuned), built from sensitive documents.

    Attributes:
        teachers: the n teachers (`generation.Teachers`), counting their queries in `calls`.
        public_model: the same model given only the public context (reads nothing sensitive).
        prompt_ids: the public tokens every sample decodes from after a teacher's context (the
            chat turn's tail, then the prompt), the shared prefix of every sample.
        stop_sequences: token sequences that end a sample (any token holding a newline).
        num_units, unit: the sensitive units behind the teachers and their kind ("documents"
            or "users").
        documents_in_prompts: documents the teachers read: those that fit their prompts (the
            others are unread), or every document for fine-tuned teachers.
        kind: "in_context" or "fine_tuned".
        context_width: in-context teachers: the public width of a teacher's context, in
            tokens; None for fine-tuned teachers.
        max_new_tokens: the longest sample the teachers' and the public model's caches hold.
    """

    teachers: _CountingTeachers
    public_model: generation.PublicModel
    prompt_ids: list[int]
    stop_sequences: tuple[tuple[int, ...], ...]
    num_units: int
    unit: str
    documents_in_prompts: int
    kind: str
    context_width: int | None
    max_new_tokens: int


def build_ensemble(
    documents: Sequence[Mapping[str, Any]],
    model: public_models.PublicTextModel | str | os.PathLike,
    *,
    num_teachers: int,
    prompt: str = "",
    max_new_tokens: int,
    key: jax.Array | None = None,
    batch_size: int = 64,
    stop_at_newline: bool = True,
    separator: str = "\n",
    on_step: Callable[[], None] | None = None,
    teachers: str = "in_context",
    tuning: TeacherTuning | None = None,
    context_width: int | None = None,
) -> Ensemble:
    """Splits `documents` among `num_teachers` teachers over `model`.

    Units (users, or documents) go to teachers by a keyed hash (`teacher_parts`). An in-context
    teacher's context is its own documents, each followed by `separator`, as many as fit the
    public `context_width`, left-padded to it; for a model with a chat template they sit in a
    user turn (`synthesis.chat`: the turn's head, the documents, then its tail and the prompt),
    else they are the whole context. A fine-tuned teacher trains its own adapter on all of its
    documents (each after EOS and followed by `separator`, `finetuned_teachers.
    finetune_teachers`) and reads only EOS. Every sample then decodes from the public
    `prompt_ids` (the turn's tail, if any, and the prompt) after that context, and the public
    model reads the same with no documents: the turn's head, or EOS without a chat template.

    Args:
        documents: as in `synthesize`.
        model: as in `synthesize` (a `PublicTextModel` or a name for `load_public_model`).
        num_teachers: as in `synthesize`.
        prompt: as in `synthesize`.
        max_new_tokens: as in `synthesize`.
        key: the partition's PRNG key; None draws a secret one.
        batch_size: as in `synthesize`.
        stop_at_newline: as in `synthesize`.
        separator: as in `synthesize`.
        on_step: as in `synthesize`.
        teachers: as in `synthesize`.
        tuning: as in `synthesize`.
        context_width: as in `synthesize`.

    Raises:
        ValueError: one line naming the argument or document (no text, fewer than 2 units,
            n outside [2, units], a document longer than the context leaves room for, ...).

    Privacy:
        Each teacher's prompt (or adapter) depends on its own units' documents only, so adding
        or removing a unit changes one teacher; padded to a public width, it changes no other
        teacher's logits, not even by rounding. The teachers are sensitive: read them only
        through a DP mechanism.
    """
    model = public_models.as_public_model(model)
    prepared = _prepare_documents(
        documents,
        model,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        separator=separator,
        teachers=teachers,
        tuning=tuning,
        context_width=context_width,
    )
    n = num_teachers
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= prepared.num_units:
        raise ValueError(
            f"num_teachers must be an integer from 2 to the {prepared.num_units} "
            f"{prepared.unit}, got {n!r}"
        )
    partition_key = None if key is None else np.asarray(jax.random.key_data(key)).tobytes()
    parts = teacher_parts(documents, n, key=partition_key)
    return _assemble_ensemble(
        prepared,
        model,
        parts,
        batch_size=batch_size,
        stop_at_newline=stop_at_newline,
        max_new_tokens=max_new_tokens,
        on_step=on_step,
        teachers=teachers,
        tuning=tuning,
    )


def build_unit_ensemble(
    documents: Sequence[Mapping[str, Any]],
    model: public_models.PublicTextModel | str | os.PathLike,
    *,
    num_teachers: int | None,
    prompt: str,
    max_new_tokens: int,
    batch_size: int,
    stop_at_newline: bool,
    separator: str,
    on_step: Callable[[], None] | None,
    context_width: int | None = None,
) -> Ensemble:
    """An in-context ensemble of one teacher per unit (`build_ensemble`'s prompts and width):
    teacher i reads unit i's documents (in their order, as many as fit the public width);
    units in the order of their first document.

    Raises:
        ValueError: as `build_ensemble`'s, and `num_teachers` neither None nor the number of
            units.

    Privacy:
        Adding or removing a unit adds or removes its teacher and changes no other teacher
        (each row's logits are its own prompt's, `InContextTeachers`). n is the number of
        units, a function of the data: not a public setting (the report's `num_teachers` and
        `num_units` carry it, as `num_units` does in the standard accounting).
    """
    model = public_models.as_public_model(model)
    prepared = _prepare_documents(
        documents,
        model,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        separator=separator,
        teachers="in_context",
        tuning=None,
        context_width=context_width,
    )
    if num_teachers is not None and (
        isinstance(num_teachers, bool)
        or not isinstance(num_teachers, int | np.integer)
        or num_teachers != prepared.num_units
    ):
        raise ValueError(
            f"num_teachers must be None or the {prepared.num_units} {prepared.unit} with "
            f"accounting='individual' (one teacher per unit), got {num_teachers!r}"
        )
    positions: dict[Any, list[int]] = {}
    for position, unit_id in enumerate(prepared.ids):
        positions.setdefault(unit_id, []).append(position)
    parts = [np.asarray(p, np.int64) for p in positions.values()]
    return _assemble_ensemble(
        prepared,
        model,
        parts,
        batch_size=batch_size,
        stop_at_newline=stop_at_newline,
        max_new_tokens=max_new_tokens,
        on_step=on_step,
        teachers="in_context",
        tuning=None,
    )


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """Checked documents and the public prompt layout (`_prepare_documents`).

    A teacher's context is `head` + its documents (each + `separator`, at most `budget` tokens
    of them), left-padded to `width`; samples decode from `prompt_ids`; the public model reads
    `public_context` first.
    """

    ids: list
    unit: str
    num_units: int
    encoded: list[list[int]]
    head: list[int]
    prompt_ids: list[int]
    public_context: list[int]
    separator: list[int]
    width: int
    budget: int


def _prepare_documents(
    documents: Sequence[Mapping[str, Any]],
    model: public_models.PublicTextModel,
    *,
    prompt: str,
    max_new_tokens: int,
    separator: str,
    teachers: str,
    tuning: TeacherTuning | None,
    context_width: int | None,
) -> _Prepared:
    """Checks the arguments and documents shared by every ensemble and tokenizes them: the
    public layout (the chat turn's head and tail for a model with a chat template and
    in-context teachers), the public width of a teacher's context, the documents' `budget`
    within it, and every document within that budget (one line naming the first that is not).

    Privacy:
        The layout, the width and the budget depend on public settings only; the documents are
        read to tokenize and check them.
    """
    validation.check_steps(max_new_tokens, "max_new_tokens")
    if teachers not in TEACHER_KINDS:
        raise ValueError(f"teachers must be one of {', '.join(TEACHER_KINDS)}, got {teachers!r}")
    if tuning is not None and teachers != "fine_tuned":
        raise ValueError("tuning applies to teachers='fine_tuned'")
    if teachers == "fine_tuned":
        finetuned_teachers.check_model(model.model, model.source)
        if context_width is not None:
            raise ValueError("context_width applies to teachers='in_context'")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    texts, ids, unit = document_units(documents)
    num_units = len(set(ids))
    if num_units < 2:
        raise ValueError(
            f"the documents hold only one unit (one {unit[:-1]}); PATE needs at least 2 {unit} "
            "to form teachers"
        )
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"separator must be a non-empty string, got {separator!r}")
    tokenizer = model.tokenizer
    head, prompt_ids, public_context = prompt_layout(model, prompt, chat=teachers == "in_context")
    separator_ids = tokenizer.encode(separator)
    # Every sample decodes from `prompt_ids` after a teacher's context, so a teacher's cache
    # holds width + len(prompt_ids) + max_new_tokens tokens, at most the model's context.
    room = model.context_length - max_new_tokens - len(prompt_ids)
    if context_width is None:  # a fine-tuned teacher's documents need only fit the model
        width = room if teachers == "fine_tuned" else min(DEFAULT_CONTEXT_WIDTH, room)
    elif isinstance(context_width, bool) or not isinstance(context_width, int | np.integer):
        raise ValueError(f"context_width must be an integer, got {context_width!r}")
    elif not 1 <= context_width <= room:
        raise ValueError(
            f"context_width must be from 1 to {room} (the model's context of "
            f"{model.context_length} tokens less the prompt's {len(prompt_ids)} and "
            f"max_new_tokens = {max_new_tokens}), got {context_width}"
        )
    else:
        width = int(context_width)
    budget = width - len(head)
    if budget < 1 + len(separator_ids):
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens), max_new_tokens = {max_new_tokens} and a "
            f"context width of {width} tokens leave no room for documents in the model's "
            f"context of {model.context_length} tokens"
        )
    encoded = tokenizer.encode_batch(texts)
    for index, ids_of_doc in enumerate(encoded):
        if len(ids_of_doc) + len(separator_ids) > budget:
            raise ValueError(
                f"{describe_document(documents[index], index)} has {len(ids_of_doc)} tokens; a "
                f"teacher's context of {width} tokens holds documents of at most "
                f"{budget - len(separator_ids)}; split it into shorter documents or raise "
                "context_width"
            )
    return _Prepared(
        ids, unit, num_units, encoded, head, prompt_ids, public_context, separator_ids, width,
        budget,
    )  # fmt: skip


def prompt_layout(
    model: public_models.PublicTextModel, prompt: str, *, chat: bool = True
) -> tuple[list[int], list[int], list[int]]:
    """The public token layout around a teacher's documents: `(head, prompt_ids,
    public_context)`. With a chat template (and `chat`), the user turn's head before the
    documents, its tail and `prompt` after them, and the public model reads the head alone;
    otherwise no head, `prompt` alone, and the public model reads the end-of-text token.

    Privacy:
        Public: a function of the model and the public prompt.
    """
    tokenizer = model.tokenizer
    prompt_tokens = tokenizer.encode(prompt) if prompt else []
    if model.chat is None or not chat:
        return [], prompt_tokens, [tokenizer.eos_id]
    layout = model.chat.layout()
    head = tokenizer.encode(layout.head)
    return head, tokenizer.encode(layout.tail) + prompt_tokens, head


def _assemble_ensemble(
    prepared: _Prepared,
    model: public_models.PublicTextModel,
    parts: Sequence[np.ndarray],
    *,
    batch_size: int,
    stop_at_newline: bool,
    max_new_tokens: int,
    on_step: Callable[[], None] | None,
    teachers: str,
    tuning: TeacherTuning | None,
) -> Ensemble:
    """The `Ensemble` whose teacher i reads the documents at positions `parts[i]` (ascending):
    in its prompt, as many as fit the public width, or through its own fine-tuned adapter.

    Privacy:
        Teacher i's prompt or adapter reads `parts[i]`'s documents only; every shape (width,
        cache capacity) is public.
    """
    tokenizer = model.tokenizer
    encoded, separator, budget = prepared.encoded, prepared.separator, prepared.budget
    # What a teacher's cache (and the fallback's, after its context) must hold: its context,
    # the public prompt and every generated token.
    steps = len(prepared.prompt_ids) + max_new_tokens
    n = len(parts)
    if teachers == "fine_tuned":
        tuned = finetuned_teachers.finetune_teachers(
            model.model,
            encoded,
            parts,
            context=[tokenizer.eos_id],
            end=separator,
            tuning=tuning or TeacherTuning(),
        )
        ensemble_teachers, used = tuned, len(encoded)
    else:
        prompts, used = [], 0
        for part in parts:
            context = []
            for index in part:
                piece = [*encoded[int(index)], *separator]
                if len(context) + len(piece) > budget:
                    break
                context.extend(piece)
                used += 1
            prompts.append([*prepared.head, *context] or [tokenizer.eos_id])
        ensemble_teachers = InContextTeachers(
            model.model,
            prompts,
            width=prepared.width,
            batch_size=min(batch_size, n),
            pad_id=tokenizer.eos_id,
            capacity=prepared.width + steps,
        )
    teachers_counted = _CountingTeachers(ensemble_teachers, on_step)
    stops = ()
    if stop_at_newline:
        stops = tuple((t,) for t in public_models.newline_tokens(tokenizer))
    public_context = prepared.public_context
    return Ensemble(
        teachers=teachers_counted,
        public_model=public_models.make_public_model(
            model.model, public_context, capacity=len(public_context) + steps
        ),
        prompt_ids=prepared.prompt_ids,
        stop_sequences=stops,
        num_units=prepared.num_units,
        unit=prepared.unit,
        documents_in_prompts=used,
        kind=teachers,
        context_width=prepared.width if teachers == "in_context" else None,
        max_new_tokens=steps - len(prepared.prompt_ids),
    )
