"""The data side of the text pipeline: `DomainTextTask` and adapters from the embedded default,
Enron sent mail, and document files (OpenWebMath) against public domain folders.

API:
    DomainTextTask(*, name, public_domains, train, val, test, true_weights=None)
    from_builtin(task, *, split_fractions=(0.6, 0.2, 0.2), seed=0) -> DomainTextTask
    from_user_documents(documents, public_domains, *, name, split_fractions, seed, ...)
    from_enron(enron_root, public_root, *, domains=None, max_public_documents=None, ...)
    from_document_files(path, public_root, *, max_documents=50_000, ...)   (OpenWebMath)
    documents_as_units(texts) -> UserDocuments          every document its own unit
    require_paths({what: path}) -> None                 ValueError naming every missing path
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence

import numpy as np

from dpmix_jax.data import builtin
from dpmix_jax.data.text import UserDocuments, iter_documents, load_domains, load_enron


@dataclasses.dataclass(frozen=True, kw_only=True)
class DomainTextTask:
    """k public text domains and a sensitive corpus split by user into train, val and test.

    Attributes:
        name: for reports.
        public_domains: domain name -> public documents (k >= 2 domains, none empty).
        train, val, test: sensitive documents with their users; no user is in two splits.
        true_weights: the population mixture over the domains that generated the sensitive
            documents, when known (the embedded default), for scoring λ.

    Privacy: `train`, `val` and `test` are sensitive; only the pipeline's accounted stages read
    `train`, and `val`/`test` serve evaluation (and random search's non-private selection).
    """

    name: str
    public_domains: Mapping[str, Sequence[str]]
    train: UserDocuments
    val: UserDocuments
    test: UserDocuments
    true_weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        if len(self.public_domains) < 2:
            raise ValueError(f"need at least 2 public domains, got {len(self.public_domains)}.")
        empty = [name for name, docs in self.public_domains.items() if not docs]
        if empty:
            raise ValueError(f"public domains {empty} have no documents.")
        for split in ("train", "val", "test"):
            if len(getattr(self, split)) == 0:
                raise ValueError(f"the sensitive {split} split has no documents.")
        names = {s: _present_users(getattr(self, s)) for s in ("train", "val", "test")}
        for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
            if shared := names[a] & names[b]:
                raise ValueError(
                    f"{len(shared)} users are in both the {a} and {b} splits (e.g. "
                    f"{sorted(shared)[0]!r}); the splits must be user-disjoint."
                )
        if self.true_weights is not None and np.shape(self.true_weights) != (self.k,):
            raise ValueError(
                f"true_weights must have shape ({self.k},), got {np.shape(self.true_weights)}."
            )

    @property
    def source_names(self) -> tuple[str, ...]:
        """The public domains, in the order of λ's coordinates."""
        return tuple(self.public_domains)

    @property
    def k(self) -> int:
        return len(self.public_domains)


def _present_users(documents: UserDocuments) -> set[str]:
    return {documents.users[u] for u in np.unique(documents.user_ids)}


def documents_as_units(texts: Sequence[str]) -> UserDocuments:
    """Documents without authors, each its own unit (example-level tasks such as OpenWebMath).

    Privacy: with one document per unit, user-disjoint splits are document-disjoint and the
    unit of privacy is a document.
    """
    return UserDocuments(
        texts=tuple(texts),
        user_ids=np.arange(len(texts), dtype=np.int64),
        users=tuple(f"doc{i}" for i in range(len(texts))),
    )


def from_user_documents(
    documents: UserDocuments,
    public_domains: Mapping[str, Sequence[str]],
    *,
    name: str,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
    true_weights: np.ndarray | None = None,
) -> DomainTextTask:
    """A task from a sensitive corpus: its users are split into train, val and test by `seed`.

    Privacy: each user's split is a keyed hash of their name alone (`UserDocuments.split_by_user`),
    so adding or removing a user moves no other user between splits, and the test users'
    documents never reach a training stage.
    """
    if len(split_fractions) != 3:
        raise ValueError(f"split_fractions must be (train, val, test), got {split_fractions!r}.")
    train, val, test = documents.split_by_user(split_fractions, seed=seed)
    return DomainTextTask(
        name=name,
        public_domains={k: tuple(v) for k, v in public_domains.items()},
        train=train,
        val=val,
        test=test,
        true_weights=None if true_weights is None else np.asarray(true_weights, np.float64),
    )


def from_builtin(
    task: builtin.TextMixtureTask,
    *,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
) -> DomainTextTask:
    """The embedded text default (`data.builtin.load_text_mixture_task`) as a pipeline task;
    `true_weights` is its population mixture.

    Privacy: its users play the sensitive data; they are split as in `from_user_documents`.
    """
    return from_user_documents(
        task.sensitive,
        task.public_domains,
        name=f"e-mail users over {len(task.domain_names)} text domains (embedded)",
        split_fractions=split_fractions,
        seed=seed,
        true_weights=task.population_weights,
    )


def from_enron(
    enron_root: str | os.PathLike,
    public_root: str | os.PathLike,
    *,
    domains: Sequence[str] | None = None,
    max_public_documents: int | None = None,
    split_fractions: tuple[float, float, float] = (0.6, 0.2, 0.2),
    seed: int = 0,
) -> DomainTextTask:
    """Enron sent mail (user level) against public domain folders (Common Pile layout).

    Args:
        enron_root: the CMU `maildir` (or its parent); see `data.text.load_enron`.
        public_root: one sub-folder of `.jsonl[.gz]`/`.parquet` files per domain.
        domains: which domain folders (default: all).
        max_public_documents: cap per domain.
        split_fractions, seed: the user split into train, val and test.

    Privacy: the mail is sensitive; it is split by user before any stage reads it.
    """
    require_paths({"Enron maildir": enron_root, "public domain folder": public_root})
    return from_user_documents(
        load_enron(enron_root),
        load_domains(public_root, domains=domains, max_documents_per_domain=max_public_documents),
        name="Enron sent mail",
        split_fractions=split_fractions,
        seed=seed,
    )


def from_document_files(
    path: str | os.PathLike,
    public_root: str | os.PathLike,
    *,
    name: str = "OpenWebMath",
    max_documents: int | None = 50_000,
    domains: Sequence[str] | None = None,
    max_public_documents: int | None = None,
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    seed: int = 0,
) -> DomainTextTask:
    """Sensitive documents without authors (OpenWebMath `.parquet`/`.jsonl` files), each its own
    unit (example level), against public domain folders.

    Privacy: the documents are split by document (`documents_as_units`) before any stage.
    """
    require_paths({f"{name} documents": path, "public domain folder": public_root})
    texts = list(iter_documents(path, max_documents=max_documents))
    return from_user_documents(
        documents_as_units(texts),
        load_domains(public_root, domains=domains, max_documents_per_domain=max_public_documents),
        name=name,
        split_fractions=split_fractions,
        seed=seed,
    )


def require_paths(paths: Mapping[str, str | os.PathLike | None]) -> None:
    """ValueError naming every missing path (None entries are not required)."""
    missing = [
        f"{what}: {path}"
        for what, path in paths.items()
        if path is not None and not os.path.exists(path)
    ]
    if missing:
        raise ValueError("missing input paths (nothing is downloaded): " + "; ".join(missing))
