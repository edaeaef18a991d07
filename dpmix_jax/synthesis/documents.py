"""Sensitive documents for private text generation: read from a folder, or the text default's.

`load_documents(folder)` reads `.txt` (one document per file), `.jsonl` (a `text` field,
optional `user`) and `.parquet` files (the same columns; needs pyarrow) into records
`{"text": str, "user": optional id, "source": file and line}`; `text_default_documents()` cuts
the embedded text default's sensitive e-mails into sentences, one document each. The records'
units and their partition among teachers are `pate.partition`'s.

Privacy:
    Every record read here is sensitive.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping
from typing import Any

from dpmix_jax.synthesis.public_models import split_sentences

__all__ = ["DOCUMENT_SUFFIXES", "load_documents", "text_default_documents"]

DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")


def _read_text_file(path: pathlib.Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: byte {err.start} (0x{data[err.start]:02x}) is not UTF-8; save the file as "
            "UTF-8 text"
        ) from None


def _jsonl_records(path: pathlib.Path) -> list[dict]:
    records = []
    for number, line in enumerate(_read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{number}: need a JSON object with a string field 'text'")
        records.append(_record(row, f"{path.name}:{number}"))
    return records


def _parquet_records(path: pathlib.Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: reading .parquet needs pyarrow (pip install 'dpmix_jax[parquet]')"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own error types for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    if "text" not in table.column_names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(table.column_names)})")
    columns = ["text", "user"] if "user" in table.column_names else ["text"]
    rows = table.select(columns).to_pylist()
    records = []
    for number, row in enumerate(rows):
        if not isinstance(row["text"], str):
            raise ValueError(f"{path}: row {number} has no text (a string)")
        records.append(_record(row, f"{path.name}:row {number}"))
    return records


def _record(row: Mapping[str, Any], source: str) -> dict:
    record = {"text": row["text"], "source": source}
    if row.get("user") is not None:
        record["user"] = row["user"]
    return record


def load_documents(folder: str | os.PathLike) -> list[dict]:
    """The documents of every `.txt`, `.jsonl` and `.parquet` file under `folder` (sorted paths).

    A `.txt` file is one document; a `.jsonl` line or a `.parquet` row is one, with a `text`
    field and an optional `user`. Each record also gets `source` (file and line) for messages.

    Raises:
        ValueError: one line naming the folder or file: not a folder, no documents, another file
            type, bytes that are not UTF-8, a line without `text`.

    Privacy:
        The result is sensitive.
    """
    root = pathlib.Path(folder)
    if not root.is_dir():
        raise ValueError(f"documents folder {root} does not exist or is not a folder")
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )  # fmt: skip
    records: list[dict] = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            records.append(_record({"text": _read_text_file(path)}, path.name))
        elif suffix == ".jsonl":
            records.extend(_jsonl_records(path))
        elif suffix == ".parquet":
            records.extend(_parquet_records(path))
        else:
            raise ValueError(
                f"{path}: documents are {', '.join(DOCUMENT_SUFFIXES)} files; move other files "
                "out of the documents folder"
            )
    if not records:
        raise ValueError(
            f"documents folder {root} holds no documents ({', '.join(DOCUMENT_SUFFIXES)} files)"
        )
    return records


def text_default_documents(
    *, min_chars: int = 20, max_chars: int = 120, seed: int = 0
) -> list[dict]:
    """The embedded text default's sensitive e-mails cut into sentences of at least `min_chars`
    characters, each cut to its first `max_chars` characters: one document each (the Hot PATE
    experiment's records, which it cuts to 24 tokens).

    Privacy:
        These play the sensitive data; the unit is one sentence of one e-mail.
    """
    from dpmix_jax.data.builtin import load_text_mixture_task

    task = load_text_mixture_task(seed=seed, num_users=20, max_public_per_domain=300)
    sentences = split_sentences(task.sensitive.texts, min_chars=min_chars)
    return [{"text": s[:max_chars], "source": "text default"} for s in sentences]
