"""Quality of synthetic text: vocabulary share, distinct-n, MAUVE and downstream accuracy.

* `vocabulary_share`: the share of generated words found in a reference vocabulary
  (`corpus_vocabulary` builds one from texts, `english_vocabulary` is an English word list);
* `distinct_n`: distinct word n-grams over all word n-grams (Li et al., 2016, "A
  Diversity-Promoting Objective Function for Neural Conversation Models");
* `mauve_score`: MAUVE (Pillutla et al., 2021, "MAUVE: Measuring the Gap Between Neural Text and
  Human Text using Divergence Frontiers") through the `mauve-text` package, on features from a
  caller's featuriser, e.g. `last_token_features` of our own GPT-2 or Llama-family model;
* `downstream_accuracy`: a logistic-regression classifier trained on synthetic labelled texts and
  tested on real held-out ones, on TF-IDF or on a model's features (`mean_token_features`).

Words are the matches of `WORD_PATTERN` in the lower-cased text: maximal runs of Unicode letters
and digits, joined across inner apostrophes ("Don't stop" -> ["don't", "stop"]).

Privacy:
    These are evaluation measures. Whatever they read from real (sensitive) texts, a reference
    vocabulary, MAUVE's reference sample, the held-out test set, reaches the returned numbers
    without any differential-privacy protection; the guarantee of the generator covers the
    synthetic texts only.

Example:
    >>> distinct_n(["the cat sat", "the cat ran"], 1)
    0.6666666666666666
    >>> vocabulary_share(["The cat barked"], corpus_vocabulary(["the cat sat"]))
    0.6666666666666666
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.models.gpt2 import GPT2

if TYPE_CHECKING:
    from dpmix_jax.data.tokenizer import TextTokenizer
    from dpmix_jax.models.llama import Llama

__all__ = [
    "MIN_MAUVE_TEXTS",
    "WORD_PATTERN",
    "DownstreamResult",
    "MauveResult",
    "corpus_vocabulary",
    "distinct_n",
    "downstream_accuracy",
    "english_vocabulary",
    "last_token_features",
    "mauve_score",
    "mean_token_features",
    "vocabulary_share",
    "words",
]

WORD_PATTERN = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
MIN_MAUVE_TEXTS = 20
_SHORTEST_BUCKET = 16


def words(text: str) -> list[str]:
    """The words of `text`: matches of `WORD_PATTERN` in `text.lower()`, in order.

    Privacy:
        The result is as sensitive as `text`.
    """
    return WORD_PATTERN.findall(text.lower())


def corpus_vocabulary(texts: Sequence[str]) -> frozenset[str]:
    """Every word that occurs in `texts` (lower-cased, see `words`).

    Privacy:
        The vocabulary of real texts is as sensitive as the texts: a rare word can single out
        one record.
    """
    return frozenset(word for text in texts for word in words(text))


@functools.cache
def english_vocabulary() -> frozenset[str]:
    """An English word list: the lower-cased union of the `english-words` package's web2
    (Webster's Second International) and GCIDE lists, 264,494 words. Inflections are partly
    missing ("tomatoes" is not in it), so a share of 1 is out of reach even for English text.
    """
    from english_words import get_english_words_set

    return frozenset(get_english_words_set(["web2", "gcide"], lower=True))


def vocabulary_share(texts: Sequence[str], vocabulary: Collection[str]) -> float:
    """The share of word occurrences in `texts` that belong to `vocabulary`.

    Every occurrence counts (a word repeated five times counts five times); the vocabulary is
    compared after lower-casing, as `words` yields lower-cased words.

    Args:
        texts: the generated texts.
        vocabulary: the reference words, e.g. `corpus_vocabulary(real_texts)`.

    Returns:
        (#word occurrences in the vocabulary) / (#word occurrences), in [0, 1].

    Raises:
        ValueError: the texts hold no words.

    Privacy:
        Reads `vocabulary`, which is sensitive when built from real texts; the share is not
        differentially private with respect to them.
    """
    reference = {word.lower() for word in vocabulary}
    generated = [word for text in texts for word in words(text)]
    if not generated:
        raise ValueError("vocabulary_share: the texts hold no words (nothing to measure).")
    return sum(word in reference for word in generated) / len(generated)


def _ngrams(tokens: Sequence[str], n: int) -> Iterator[tuple[str, ...]]:
    return zip(*(tokens[i:] for i in range(n)), strict=False)


def distinct_n(texts: Sequence[str], n: int) -> float:
    """Distinct-n: the number of distinct word n-grams over the number of word n-grams.

    Counted over the whole set of texts: an n-gram repeated in two texts is one distinct n-gram
    and two n-grams. N-grams do not cross text boundaries, so a text of w >= n words holds
    w - n + 1 of them. Li et al. (2016) divide by the number of generated words, which is the same
    for n = 1; dividing by the number of n-grams keeps the value in [0, 1] for every n.

    Args:
        texts: the generated texts.
        n: the n-gram order (1 for distinct-1, 2 for distinct-2, ...).

    Returns:
        The ratio in (0, 1]; 1 means no n-gram repeats.

    Raises:
        ValueError: `n` < 1, or no text holds n words (no n-grams to count).
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"distinct_n: n must be a positive int, got {n!r}.")
    grams = [gram for text in texts for gram in _ngrams(words(text), n)]
    if not grams:
        raise ValueError(f"distinct_n: no text holds {n} words, so there are no {n}-grams.")
    return len(set(grams)) / len(grams)


# --------------------------------------------------------------------------------------------
# MAUVE.
# --------------------------------------------------------------------------------------------


def _buckets(max_tokens: int) -> tuple[int, ...]:
    """Padded lengths: powers of two from `_SHORTEST_BUCKET` below `max_tokens`, then it."""
    lengths = []
    length = _SHORTEST_BUCKET
    while length < max_tokens:
        lengths.append(length)
        length *= 2
    return (*lengths, max_tokens)


def last_token_features(
    model: GPT2 | Llama, tokenizer: TextTokenizer, *, max_tokens: int, batch_size: int = 32
) -> Callable[[Sequence[str]], np.ndarray]:
    """A featuriser for `mauve_score`: each text's final hidden state at its last token.

    The feature of a text is the output of the final layer norm (GPT-2) or RMSNorm (the Llama
    family) at the text's last token, the state the model's head reads to predict the next
    token. This is the feature of MAUVE's own featuriser (the last hidden state of
    `transformers`' GPT-2 at the last token); under causal attention it is also the only token
    state that has read the whole text, whereas a mean over tokens mixes in states that saw only
    a prefix.

    Texts are tokenized without special tokens and cut to their first `max_tokens` tokens (as
    MAUVE truncates). Each is right-padded to the shortest length of the buckets 16, 32, 64, ...,
    `max_tokens` that holds it, and batches always have `batch_size` rows, so the jitted forward
    pass compiles at most once per bucket whatever the texts' lengths. Causal attention keeps
    padding after a text's last token out of its feature.

    Args:
        model: the Flax GPT-2 or Llama-family model (`PublicTextModel.model`).
        tokenizer: its tokenizer (`PublicTextModel.tokenizer`).
        max_tokens: tokens kept per text, 1 to the model's `n_positions`.
        batch_size: rows per forward pass.

    Returns:
        `featurize(texts)` -> float32 array of shape (len(texts), width).

    Raises:
        ValueError: `max_tokens` or `batch_size` out of range; `featurize` raises it for a text
            with no tokens.

    Privacy:
        The features of real texts are as sensitive as the texts.
    """
    return _pooled_features(
        model, tokenizer, max_tokens=max_tokens, batch_size=batch_size, pooling="last"
    )


def mean_token_features(
    model: GPT2 | Llama, tokenizer: TextTokenizer, *, max_tokens: int, batch_size: int = 32
) -> Callable[[Sequence[str]], np.ndarray]:
    """A featuriser for `downstream_accuracy`: each text's final hidden states averaged over its
    tokens.

    The mean of the final layer norm's (GPT-2) or RMSNorm's (the Llama family) output over a
    text's tokens: the usual sentence embedding of a decoder for classification. Every word of
    the text weighs in it, where the last token's state (`last_token_features`) is shaped by
    the prediction of the next token; on SmolLM2 and the BBC topics, a logistic regression on
    these features tells topics apart from a few sentences each. Tokenization, truncation,
    padding buckets and batching are those of `last_token_features`; padding after a text's
    last token is left out of its mean. Arguments, return value and errors are those of
    `last_token_features`.

    Privacy:
        The features of real texts are as sensitive as the texts.
    """
    return _pooled_features(
        model, tokenizer, max_tokens=max_tokens, batch_size=batch_size, pooling="mean"
    )


def _pooled_features(
    model: GPT2 | Llama,
    tokenizer: TextTokenizer,
    *,
    max_tokens: int,
    batch_size: int,
    pooling: str,
) -> Callable[[Sequence[str]], np.ndarray]:
    """The featuriser of `last_token_features` (`pooling="last"`) and `mean_token_features`
    (`pooling="mean"`)."""
    caller = f"{pooling}_token_features"
    n_positions = int(model.config.n_positions)
    if not isinstance(max_tokens, int) or not 1 <= max_tokens <= n_positions:
        raise ValueError(
            f"{caller}: max_tokens must be an int in [1, n_positions = "
            f"{n_positions}], got {max_tokens!r}."
        )
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{caller}: batch_size must be a positive int, got {batch_size!r}.")
    buckets = _buckets(max_tokens)
    graphdef, state = nnx.split(model)
    pad_id = tokenizer.eos_id
    width = int(model.config.n_embd if isinstance(model, GPT2) else model.config.hidden_size)

    def final_states(module, ids):
        if not isinstance(module, GPT2):
            return module.final_states(ids)  # causal: padding after a text never reaches it
        rows, length = ids.shape
        positions = jnp.broadcast_to(jnp.arange(length), (rows, length))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (rows, length, length))
        hidden = module.wte(ids) + module.wpe(positions)
        for block in module.h:
            hidden, _ = block(hidden, mask)
        return module.ln_f(hidden)

    @jax.jit
    def pooled_states(state, ids, lengths):
        states = final_states(nnx.merge(graphdef, state), ids).astype(jnp.float32)
        if pooling == "last":
            return jnp.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0]
        inside = (jnp.arange(ids.shape[1])[None, :] < lengths[:, None]).astype(jnp.float32)
        return jnp.einsum("rt,rtw->rw", inside, states) / lengths[:, None]

    def featurize(texts: Sequence[str]) -> np.ndarray:
        encoded = [ids[:max_tokens] for ids in tokenizer.encode_batch(list(texts))]
        empty = [i for i, ids in enumerate(encoded) if not ids]
        if empty:
            raise ValueError(
                f"{caller}: text {empty[0]} has no tokens ({len(empty)} empty in "
                "all); drop empty texts before measuring."
            )
        features = np.zeros((len(encoded), width), np.float32)
        bucket_of = np.searchsorted(buckets, [len(ids) for ids in encoded])
        for bucket, length in enumerate(buckets):
            members = np.flatnonzero(bucket_of == bucket)
            for start in range(0, len(members), batch_size):
                chunk = members[start : start + batch_size]
                ids = np.full((batch_size, length), pad_id, np.int32)
                lengths = np.ones(batch_size, np.int32)
                for row, index in enumerate(chunk):
                    ids[row, : len(encoded[index])] = encoded[index]
                    lengths[row] = len(encoded[index])
                states = pooled_states(state, ids, lengths)
                features[chunk] = np.asarray(states)[: len(chunk)]
        return features

    return featurize


@dataclasses.dataclass(frozen=True, kw_only=True)
class MauveResult:
    """MAUVE of two samples of texts.

    Attributes:
        mauve: the MAUVE score in (0, 1]; 1 when the quantized distributions coincide.
        mauve_star: MAUVE* (Pillutla et al., JMLR 2023): the same on histograms with
            Krichevsky-Trofimov smoothing (+1/2 per bucket), less biased on small samples.
        frontier_integral: the frontier integral in [0, 1]; 0 when the distributions coincide.
        num_buckets: k-means clusters the features were quantized into.
        num_p: texts in the first sample.
        num_q: texts in the second sample.
        seed: the seed of the PCA and k-means.
        p_histogram: the first sample's share of texts in each cluster.
        q_histogram: the second sample's share of texts in each cluster.
    """

    mauve: float
    mauve_star: float
    frontier_integral: float
    num_buckets: int
    num_p: int
    num_q: int
    seed: int
    p_histogram: tuple[float, ...]
    q_histogram: tuple[float, ...]


def _features(
    featurize: Callable[[Sequence[str]], np.ndarray], texts: Sequence[str], name: str, caller: str
) -> np.ndarray:
    """`featurize(texts)`, checked to be one finite row per text."""
    features = np.asarray(featurize(texts))
    if features.ndim != 2 or features.shape[0] != len(texts):
        raise ValueError(
            f"{caller}: featurize returned shape {features.shape} for {len(texts)} {name} "
            "texts; it must return one row per text, shape (len(texts), d)."
        )
    if not np.all(np.isfinite(features)):
        raise ValueError(f"{caller}: featurize returned non-finite features for {name}.")
    return features


def mauve_score(
    p_texts: Sequence[str],
    q_texts: Sequence[str],
    *,
    featurize: Callable[[Sequence[str]], np.ndarray],
    seed: int,
    num_buckets: int | None = None,
    scaling_factor: float = 5.0,
    explained_variance: float = 0.9,
    kmeans_restarts: int = 5,
    kmeans_max_iter: int = 500,
) -> MauveResult:
    """MAUVE between two samples of texts, on features from `featurize`.

    Following the MAUVE paper, P is the reference (real) text and Q the generated text; the
    score is symmetric in them. `mauve.compute_mauve` receives the features only, so it never
    loads or downloads a model of its own. It quantizes the L2-normalised features of both
    samples together (PCA keeping `explained_variance` of the variance, then k-means with
    `kmeans_restarts` restarts) and integrates the divergence frontier of the two cluster
    histograms, with exp(-`scaling_factor` · KL).

    Args:
        p_texts: the reference texts.
        q_texts: the generated texts.
        featurize: texts -> (len(texts), d) features, e.g. `last_token_features(...)`.
        seed: seeds the PCA and k-means, so equal inputs give equal scores.
        num_buckets: k-means clusters; by default MAUVE's rule, max(2, round(m / 10)) for the
            smaller sample size m.
        scaling_factor: MAUVE's constant c (5 in the paper).
        explained_variance: variance kept by the PCA before clustering, in (0, 1).
        kmeans_restarts: k-means runs; the best objective is kept.
        kmeans_max_iter: iterations per k-means run.

    Returns:
        The `MauveResult`.

    Raises:
        ValueError: a sample has fewer than `MIN_MAUVE_TEXTS` texts, `num_buckets` is below 2 or
            above the smaller sample size, another setting is out of range, or `featurize`
            returns the wrong shape or non-finite values.

    Privacy:
        Reads the real texts (usually `p_texts`); the score is not differentially private with
        respect to them.
    """
    num_p, num_q = len(p_texts), len(q_texts)
    if min(num_p, num_q) < MIN_MAUVE_TEXTS:
        raise ValueError(
            f"mauve_score: need at least {MIN_MAUVE_TEXTS} texts on each side, got {num_p} and "
            f"{num_q}; MAUVE quantizes the features into clusters (about one per 10 texts) and "
            "is meaningless on fewer texts."
        )
    if num_buckets is None:
        num_buckets = max(2, round(min(num_p, num_q) / 10))
    if not isinstance(num_buckets, int) or not 2 <= num_buckets <= min(num_p, num_q):
        raise ValueError(
            f"mauve_score: num_buckets must be an int in [2, {min(num_p, num_q)}] (the smaller "
            f"sample size), got {num_buckets!r}."
        )
    if not scaling_factor > 0:
        raise ValueError(f"mauve_score: scaling_factor must be > 0, got {scaling_factor}.")
    if not 0 < explained_variance < 1:
        raise ValueError(
            f"mauve_score: explained_variance must be in (0, 1), got {explained_variance}."
        )
    if kmeans_restarts < 1 or kmeans_max_iter < 1:
        raise ValueError(
            f"mauve_score: kmeans_restarts and kmeans_max_iter must be >= 1, got "
            f"{kmeans_restarts} and {kmeans_max_iter}."
        )
    from mauve import compute_mauve

    out = compute_mauve(
        p_features=_features(featurize, p_texts, "p_texts", "mauve_score"),
        q_features=_features(featurize, q_texts, "q_texts", "mauve_score"),
        num_buckets=num_buckets,
        kmeans_explained_var=explained_variance,
        kmeans_num_redo=kmeans_restarts,
        kmeans_max_iter=kmeans_max_iter,
        mauve_scaling_factor=scaling_factor,
        seed=seed,
        verbose=False,
    )
    return MauveResult(
        mauve=float(out.mauve),
        mauve_star=float(out.mauve_star),
        frontier_integral=float(out.frontier_integral),
        num_buckets=int(out.num_buckets),
        num_p=num_p,
        num_q=num_q,
        seed=seed,
        p_histogram=tuple(float(x) for x in out.p_hist),
        q_histogram=tuple(float(x) for x in out.q_hist),
    )


# --------------------------------------------------------------------------------------------
# Downstream classification.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class DownstreamResult:
    """A classifier trained on synthetic texts, scored on real ones.

    Attributes:
        accuracy: the share of test texts classified correctly.
        macro_f1: the F1 score averaged over the classes of the training and test labels (a
            class never predicted scores 0).
        num_train: synthetic training texts.
        num_test: real test texts.
        num_classes: distinct training labels.
    """

    accuracy: float
    macro_f1: float
    num_train: int
    num_test: int
    num_classes: int


def downstream_accuracy(
    train_texts: Sequence[str],
    train_labels: Sequence,
    test_texts: Sequence[str],
    test_labels: Sequence,
    *,
    seed: int,
    featurize: Callable[[Sequence[str]], np.ndarray] | None = None,
) -> DownstreamResult:
    """Accuracy on real texts of a logistic-regression classifier fit on synthetic ones.

    The classifier is scikit-learn's multinomial `LogisticRegression` (L2, C = 1, up to 1000
    L-BFGS iterations) on either of two features:

    * by default, TF-IDF of the words (`TfidfVectorizer` fit on the training texts,
      lower-cased, words of `WORD_PATTERN`): it needs the training texts to share words with
      the test texts, so a few short texts per class leave it near chance;
    * with `featurize`, a model's features of each text (e.g. `mean_token_features`),
      standardized by the training texts' means and deviations: a pretrained model's
      embedding carries the topic of a sentence in words the training texts never used.

    Test labels absent from training count as errors.

    Args:
        train_texts: the synthetic texts.
        train_labels: their labels (any hashable values).
        test_texts: the real held-out texts.
        test_labels: their labels.
        seed: the classifier's `random_state` (L-BFGS itself is deterministic).
        featurize: texts -> (len(texts), d) features; None for TF-IDF.

    Returns:
        The `DownstreamResult`.

    Raises:
        ValueError: an empty set, texts and labels of different lengths, a single training
            class, training texts without a single word (TF-IDF), or features that are not
            one finite row per text.

    Privacy:
        Reads the real test texts and labels; the scores are not differentially private with
        respect to them.
    """
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.metrics import accuracy_score, f1_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    for name, texts, labels in (
        ("train", train_texts, train_labels),
        ("test", test_texts, test_labels),
    ):
        if not len(texts):
            raise ValueError(f"downstream_accuracy: the {name} set is empty.")
        if len(texts) != len(labels):
            raise ValueError(
                f"downstream_accuracy: {len(texts)} {name} texts but {len(labels)} {name} labels."
            )
    classes = set(train_labels)
    if len(classes) < 2:
        raise ValueError(
            f"downstream_accuracy: the training labels hold {len(classes)} class; a classifier "
            "needs at least 2."
        )
    classifier = LogisticRegression(max_iter=1000, random_state=seed)
    if featurize is None:
        vectorizer = TfidfVectorizer(lowercase=True, token_pattern=WORD_PATTERN.pattern)
        try:
            train_features = vectorizer.fit_transform(list(train_texts))
        except ValueError:
            raise ValueError("downstream_accuracy: the training texts hold no words.") from None
        test_features = vectorizer.transform(list(test_texts))
    else:
        classifier = make_pipeline(StandardScaler(), classifier)
        train_features = _features(featurize, train_texts, "train", "downstream_accuracy")
        test_features = _features(featurize, test_texts, "test", "downstream_accuracy")
    classifier.fit(train_features, list(train_labels))
    predicted = classifier.predict(test_features)
    labels = sorted(classes | set(test_labels), key=repr)
    return DownstreamResult(
        accuracy=float(accuracy_score(list(test_labels), predicted)),
        macro_f1=float(
            f1_score(list(test_labels), predicted, labels=labels, average="macro", zero_division=0)
        ),
        num_train=len(train_texts),
        num_test=len(test_texts),
        num_classes=len(classes),
    )
