"""Sensitive documents' privacy units, and their keyed-hash partition among teachers.

A document is a record `{"text": str, "user": optional id}`. Its unit is its user when the
records carry `user`, else the document itself (equal texts are one unit). `teacher_parts` gives
unit u to teacher `privacy.assign_parts(unit ids, [1/n] * n, key=key)[u]`, so one unit's
documents sit with one teacher and adding or removing a unit changes one teacher's data.

Example:
    >>> docs = [{"text": f"note {i} says hello", "user": f"u{i % 6}"} for i in range(12)]
    >>> sum(len(p) for p in teacher_parts(docs, 3, key=b"k"))
    12
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dpmix_jax.privacy.parts import assign_parts

__all__ = ["describe_document", "document_units", "teacher_parts"]


def describe_document(record: Mapping[str, Any], index: int) -> str:
    """How messages name document `index`: "document 3", with its `source` when it has one."""
    source = record.get("source") if isinstance(record, Mapping) else None
    return f"document {index}" + (f" ({source})" if source else "")


def document_units(documents: Sequence[Mapping[str, Any]]) -> tuple[list[str], list[str], str]:
    """The documents' texts, each document's unit id and the units' name ("users" or
    "documents"): the unit of a document is its user when the records carry `user`, else its
    text (equal texts are one unit).

    Raises:
        ValueError: one line naming the document: not a list of records, no documents, a
            record without text, a user on some records only, a user that is neither a string
            nor an integer.

    Privacy:
        The result is as sensitive as the documents.
    """
    if isinstance(documents, str | bytes | Mapping) or not isinstance(documents, Sequence):
        raise ValueError(
            f"documents must be a list of records {{'text': ..., 'user': ...}}, got "
            f"{type(documents).__name__}"
        )
    if not documents:
        raise ValueError("documents is empty: need documents from at least 2 units")
    with_user = [isinstance(r, Mapping) and "user" in r for r in documents]
    texts, ids = [], []
    for index, record in enumerate(documents):
        if not isinstance(record, Mapping):
            raise ValueError(
                f"document {index} is a {type(record).__name__}; each document is a record "
                "{'text': str, 'user': optional id}"
            )
        text = record.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{describe_document(record, index)} has no text (a non-empty string)")
        if any(with_user) and not with_user[index]:
            first = with_user.index(True)
            raise ValueError(
                f"{describe_document(record, index)} has no user but "
                f"{describe_document(documents[first], first)} has one; give every document a "
                "user, or none"
            )
        user = record.get("user")
        if any(with_user) and (
            isinstance(user, bool) or not isinstance(user, str | int | np.integer)
        ):
            raise ValueError(
                f"{describe_document(record, index)}: user must be a string or an integer, "
                f"got {user!r}"
            )
        texts.append(text)
        ids.append(str(user) if any(with_user) else text)
    return texts, ids, "users" if any(with_user) else "documents"


def teacher_parts(
    documents: Sequence[Mapping[str, Any]],
    num_teachers: int,
    *,
    key: bytes | int | None = None,
) -> list[np.ndarray]:
    """Each teacher's document positions (ascending): unit u (a user, or a document) goes to
    teacher `assign_parts(unit ids, [1/n] * n, key=key)[u]`.

    Privacy:
        A unit's teacher depends on its own id and the key alone (secret when None), so all its
        documents sit with one teacher and adding or removing it moves no other unit.
    """
    _, ids, _ = document_units(documents)
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, int) or num_teachers < 2:
        raise ValueError(f"num_teachers must be an integer >= 2, got {num_teachers!r}")
    parts = assign_parts(ids, [1.0 / num_teachers] * num_teachers, key=key)
    return [np.flatnonzero(parts == teacher) for teacher in range(num_teachers)]
