"""Text corpora (Enron sent mail, Common Pile domains, OpenWebMath) and token packing.

Enron: `load_enron(root)` reads the CMU maildir (`maildir/<user>/<folder>/<n>.`, RFC 822), keeps
each message's own body (quoted `>` lines, everything from "-----Original Message-----" or
"---- Forwarded by" on, are removed) and returns `UserDocuments`: texts with the user who wrote
each. Messages whose body is empty after stripping are skipped and counted in
`.skipped["empty_body"]`; users with no message in the chosen folders are counted in
`.skipped["users_without_messages"]` (the real maildir has such users, so they are not errors).
A root with no messages at all is a ValueError.

Public text: `iter_documents(path)` streams documents one at a time from `.jsonl`, `.jsonl.gz`
or `.parquet` files (a file or a folder of them, in sorted order) with a `text` field, up to
`max_documents`; a bad JSON line, a line that is not UTF-8, a record without the text field, a
truncated or corrupt `.gz` or `.parquet` file is a ValueError naming the file (and line or row).
`load_domains(root)` reads one folder per domain (Common Pile layout).

Packing: `pack_sequences` concatenates tokenised documents with end-of-text separators into
fixed-length rows for LM training (never mixing two users in one row when users are given);
`document_tokens` lays out one document per row for the `sequence` proxy outputs: the total
log-probability of document j is Σ_t mask·log p(targets | inputs), and `token_counts` is T_j.

API:
    UserDocument(user, text)                  one example (`UserDocuments[i]`)
    UserDocuments(texts, user_ids, users, skipped)   `.subset(idx)`, `.split_by_user(fr, *, seed)`
                                              (a keyed hash of each user's name)
    load_enron(root, folders=("sent", "sent_items", "_sent_mail"))
    clean_email_body(body) -> str
    iter_documents(path, *, max_documents=None, text_field="text") -> Iterator[str]
    load_domains(root, *, domains=None, max_documents_per_domain=None) -> dict[str, list[str]]
    PackedSequences(tokens, mask, group_ids)
    pack_sequences(token_lists, *, seq_len, eos_id, group_ids=None) -> PackedSequences
    DocumentTokens(inputs, targets, mask, token_counts, truncated)
    document_tokens(token_lists, *, max_len, eos_id) -> DocumentTokens
"""

from __future__ import annotations

import dataclasses
import email
import email.policy
import gzip
import json
import re
import zlib
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from dpmix_jax.privacy.parts import assign_parts

ENRON_SENT_FOLDERS = ("sent", "sent_items", "_sent_mail")
_REPLY_MARKER = re.compile(r"^\s*-{2,}\s*Original Message\s*-{2,}", re.IGNORECASE | re.MULTILINE)
_FORWARD_MARKER = re.compile(r"^\s*-{2,}\s*Forwarded by", re.IGNORECASE | re.MULTILINE)


@dataclasses.dataclass(frozen=True)
class UserDocument:
    """One document and the user who wrote it."""

    user: str
    text: str


@dataclasses.dataclass(frozen=True)
class UserDocuments:
    """Documents with an author each, for user-level DP.

    Attributes:
        texts: the documents.
        user_ids: int64 (n,), index into `users` of each document's author.
        users: user names.
        skipped: reason -> count of items the loader left out.
    """

    texts: tuple[str, ...]
    user_ids: np.ndarray
    users: tuple[str, ...]
    skipped: Mapping[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        ids = np.asarray(self.user_ids)
        if ids.shape != (len(self.texts),) or not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"user_ids must be integers of shape ({len(self.texts)},)")
        if len(ids) and (ids.min() < 0 or ids.max() >= len(self.users)):
            raise ValueError("user_ids must index into users")

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, i: int) -> UserDocument:
        return UserDocument(user=self.users[self.user_ids[i]], text=self.texts[i])

    def subset(self, indices: np.ndarray) -> UserDocuments:
        """The documents at `indices` (the user list is kept, so ids stay comparable)."""
        indices = np.asarray(indices, dtype=np.int64)
        return UserDocuments(
            texts=tuple(self.texts[i] for i in indices),
            user_ids=np.asarray(self.user_ids)[indices],
            users=self.users,
            skipped=self.skipped,
        )

    def split_by_user(
        self, fractions: Sequence[float], *, seed: int | bytes
    ) -> tuple[UserDocuments, ...]:
        """User-disjoint parts holding the given fractions of users in expectation.

        User u goes to part `privacy.assign_parts([name of u], fractions, key=seed)`: a keyed
        hash of the user's name, so the parts' sizes vary around the fractions.

        Args:
            fractions: the expected share of users in each part; positive, summing to 1.
            seed: the hash key (an integer, or secret bytes).

        Privacy:
            No user appears in two parts, so stages run on different parts compose in parallel
            under user-level DP. A user's part depends only on their name and `seed`: adding or
            removing a user moves no other user between parts.
        """
        names = [self.users[u] for u in np.asarray(self.user_ids)]
        parts = assign_parts(names, fractions, key=seed)
        return tuple(self.subset(np.flatnonzero(parts == j)) for j in range(len(fractions)))


def clean_email_body(body: str) -> str:
    """The sender's own text: quoted lines, replied-to and forwarded parts removed, trimmed."""
    for marker in (_REPLY_MARKER, _FORWARD_MARKER):
        match = marker.search(body)
        if match:
            body = body[: match.start()]
    lines = [line.rstrip() for line in body.splitlines() if not line.lstrip().startswith(">")]
    return "\n".join(lines).strip()


def _message_body(raw: bytes) -> str:
    message = email.message_from_bytes(raw, policy=email.policy.compat32)
    parts = message.walk() if message.is_multipart() else [message]
    texts = []
    for part in parts:
        if part.get_content_maintype() != "text" or part.get_content_subtype() != "plain":
            continue
        payload = part.get_payload(decode=True) or b""
        charset = part.get_content_charset() or "latin-1"
        try:
            texts.append(payload.decode(charset, errors="replace"))
        except LookupError:  # unknown charset name in the header
            texts.append(payload.decode("latin-1"))
    return "\n".join(texts)


def load_enron(root: str | Path, folders: Sequence[str] = ENRON_SENT_FOLDERS) -> UserDocuments:
    """Reads the sent mail of every user in the CMU Enron maildir.

    Args:
        root: the `maildir` folder, or a folder containing it.
        folders: mail folder names read for each user.

    Returns:
        UserDocuments with users in sorted order and messages in file-name order.

    Privacy:
        Returns sensitive text with its authors; split by user before any private stage.
    """
    root = Path(root)
    maildir = root / "maildir" if (root / "maildir").is_dir() else root
    if not maildir.is_dir():
        raise ValueError(f"Enron maildir {maildir} does not exist")
    texts, user_ids, users = [], [], []
    skipped: Counter = Counter()
    for user_dir in sorted(p for p in maildir.iterdir() if p.is_dir()):
        files = sorted(
            (
                f
                for folder in folders
                if (user_dir / folder).is_dir()
                for f in (user_dir / folder).iterdir()
            ),
            key=lambda f: (f.parent.name, _natural_key(f.name)),
        )
        bodies = [clean_email_body(_message_body(f.read_bytes())) for f in files if f.is_file()]
        kept = [b for b in bodies if b]
        skipped["empty_body"] += len(bodies) - len(kept)
        if not kept:
            skipped["users_without_messages"] += 1
            continue
        user_ids.extend([len(users)] * len(kept))
        users.append(user_dir.name)
        texts.extend(kept)
    if not texts:
        raise ValueError(f"no messages found in folders {list(folders)} under {maildir}")
    return UserDocuments(
        texts=tuple(texts),
        user_ids=np.array(user_ids, dtype=np.int64),
        users=tuple(users),
        skipped={k: v for k, v in skipped.items() if v},
    )


def _natural_key(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


# ------------------------------------------------------------------------------------------
# Streaming public documents
# ------------------------------------------------------------------------------------------

_DOCUMENT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")


def _document_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"{path} does not exist")
    files = sorted(
        p for p in path.rglob("*") if p.is_file() and p.name.endswith(_DOCUMENT_SUFFIXES)
    )
    if not files:
        raise ValueError(f"no {'/'.join(_DOCUMENT_SUFFIXES)} files under {path}")
    return files


def _raw_lines(path: Path) -> Iterator[bytes]:
    """The lines of a plain or gzip file; a truncated or corrupt gzip stream is a ValueError."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rb") as f:
        line_number = 0
        while True:
            try:
                line = f.readline()
            except (EOFError, OSError, zlib.error) as err:
                raise ValueError(
                    f"{path}: cannot read past line {line_number} ({err}); "
                    "the file is truncated or corrupt: download it again"
                ) from err
            if not line:
                return
            line_number += 1
            yield line


def _iter_jsonl(path: Path, text_field: str) -> Iterator[str]:
    for line_number, raw in enumerate(_raw_lines(path), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"{path} line {line_number}: not UTF-8 text (byte {raw[err.start]:#04x}); "
                "JSON Lines files must be UTF-8"
            ) from err
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} line {line_number}: invalid JSON ({err.msg})") from err
        except RecursionError:
            raise ValueError(f"{path} line {line_number}: JSON nested too deeply to read") from None
        if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
            raise ValueError(f"{path} line {line_number}: no string field {text_field!r}")
        text = record[text_field]
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(
                f"{path} line {line_number}: the {text_field!r} text holds the lone surrogate "
                f"U+{ord(text[err.start]):04X} (an unpaired \\u escape), which is not Unicode text"
            ) from None
        yield text


def _iter_parquet(path: Path, text_field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = 0
    try:
        parquet = pq.ParquetFile(path)
        if text_field not in parquet.schema_arrow.names:
            names = parquet.schema_arrow.names
            raise ValueError(f"{path} has no column {text_field!r}; found {names}")
        batches = parquet.iter_batches(columns=[text_field], batch_size=256)
        for batch in batches:
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise ValueError(f"{path} row {row}: the {text_field!r} value is {text!r}")
                yield text
                row += 1
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        reason = ascii(str(err).splitlines()[0][:120]) if str(err) else type(err).__name__
        raise ValueError(
            f"{path}: not a readable Parquet file after row {row}; the file is truncated or "
            f"corrupt: download it again (reader said {reason})"
        ) from None


def iter_documents(
    path: str | Path, *, max_documents: int | None = None, text_field: str = "text"
) -> Iterator[str]:
    """Streams document texts from a `.jsonl` / `.jsonl.gz` / `.parquet` file or a folder of them.

    Args:
        path: a file, or a folder searched recursively (files in sorted order).
        max_documents: stop after this many documents (None: all).
        text_field: the field (column) holding the text.
    """
    if max_documents is not None and max_documents < 0:
        raise ValueError(f"max_documents must be non-negative, got {max_documents}")
    if max_documents == 0:
        return
    count = 0
    for file in _document_files(Path(path)):
        reader = _iter_parquet if file.name.endswith(".parquet") else _iter_jsonl
        for text in reader(file, text_field):
            yield text
            count += 1
            if count == max_documents:
                return


def load_domains(
    root: str | Path,
    *,
    domains: Sequence[str] | None = None,
    max_documents_per_domain: int | None = None,
    text_field: str = "text",
) -> dict[str, list[str]]:
    """Reads one folder per domain (e.g. Common Pile sources) into name -> documents.

    Args:
        root: folder holding one sub-folder of document files per domain.
        domains: which sub-folders (default: all, sorted).
        max_documents_per_domain: cap per domain.
        text_field: the text field of each record.
    """
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder")
    names = (
        list(domains)
        if domains is not None
        else sorted(p.name for p in root.iterdir() if p.is_dir())
    )
    if not names:
        raise ValueError(f"no domain folders under {root}")
    return {
        name: list(
            iter_documents(
                root / name, max_documents=max_documents_per_domain, text_field=text_field
            )
        )
        for name in names
    }


# ------------------------------------------------------------------------------------------
# Token layout for training and for sequence-level proxy outputs
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PackedSequences:
    """Fixed-length LM training rows.

    Attributes:
        tokens: int32 (m, seq_len); documents joined by end-of-text, the last row of each group
            padded with end-of-text.
        mask: bool (m, seq_len), False on padding.
        group_ids: int64 (m,), the group (user) of each row, or all zeros without groups.
    """

    tokens: np.ndarray
    mask: np.ndarray
    group_ids: np.ndarray


def pack_sequences(
    token_lists: Sequence[Sequence[int]],
    *,
    seq_len: int,
    eos_id: int,
    group_ids: Sequence[int] | None = None,
) -> PackedSequences:
    """Packs tokenised documents into rows of `seq_len`, each document followed by `eos_id`.

    With `group_ids`, documents are packed group by group (in order of first appearance), so a
    row never holds two users' text.

    Privacy:
        Keeping rows within one user preserves the user boundary that user-level DP relies on.
    """
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    groups = (
        np.zeros(len(token_lists), dtype=np.int64) if group_ids is None else np.asarray(group_ids)
    )
    if groups.shape != (len(token_lists),):
        raise ValueError("group_ids needs one entry per document")
    rows, masks, row_groups = [], [], []
    for group in dict.fromkeys(groups.tolist()):
        stream = [tok for i in np.flatnonzero(groups == group) for tok in (*token_lists[i], eos_id)]
        n_rows = -(-len(stream) // seq_len)
        padded = np.full(n_rows * seq_len, eos_id, dtype=np.int32)
        padded[: len(stream)] = stream
        mask = np.zeros(n_rows * seq_len, dtype=bool)
        mask[: len(stream)] = True
        rows.append(padded.reshape(n_rows, seq_len))
        masks.append(mask.reshape(n_rows, seq_len))
        row_groups.append(np.full(n_rows, group, dtype=np.int64))
    if not rows:
        raise ValueError("no documents to pack")
    return PackedSequences(
        tokens=np.concatenate(rows),
        mask=np.concatenate(masks),
        group_ids=np.concatenate(row_groups),
    )


@dataclasses.dataclass(frozen=True)
class DocumentTokens:
    """One document per row, laid out for total log-probabilities under a causal LM.

    Attributes:
        inputs: int32 (n, max_len): end-of-text, then the document's first max_len - 1 tokens.
        targets: int32 (n, max_len): the document's first max_len tokens (padding: end-of-text).
        mask: bool (n, max_len): True on the document's tokens.
        token_counts: int32 (n,), T_j = mask.sum(1), the number of scored tokens.
        truncated: bool (n,), True where the document had more than max_len tokens.
    """

    inputs: np.ndarray
    targets: np.ndarray
    mask: np.ndarray
    token_counts: np.ndarray
    truncated: np.ndarray


def document_tokens(
    token_lists: Sequence[Sequence[int]], *, max_len: int, eos_id: int
) -> DocumentTokens:
    """Lays out documents one per row; the first token is predicted from end-of-text.

    Empty documents are a ValueError (their log-probability per token is undefined).

    Privacy:
        On sensitive documents the result feeds the cached proxy outputs of the mixture stage;
        it is a deterministic per-document map, so it adds no privacy cost of its own.
    """
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    n = len(token_lists)
    targets = np.full((n, max_len), eos_id, dtype=np.int32)
    mask = np.zeros((n, max_len), dtype=bool)
    truncated = np.zeros(n, dtype=bool)
    for j, tokens in enumerate(token_lists):
        if len(tokens) == 0:
            raise ValueError(f"document {j} has no tokens")
        kept = tokens[:max_len]
        targets[j, : len(kept)] = kept
        mask[j, : len(kept)] = True
        truncated[j] = len(tokens) > max_len
    inputs = np.concatenate([np.full((n, 1), eos_id, dtype=np.int32), targets[:, :-1]], axis=1)
    return DocumentTokens(
        inputs=inputs,
        targets=targets,
        mask=mask,
        token_counts=mask.sum(axis=1).astype(np.int32),
        truncated=truncated,
    )
