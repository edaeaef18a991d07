"""Pretraining on a mixture λ of public sources.

Two recipes (SPEC §4):
- shared inputs, different label functions (chest X-rays): train on public images with the soft
  target Σ_i λ_i y_i and BCE, i.e. `engine.Trainer(config, model, losses.mixture_bce(λ))` over the
  public `IndexedData` whose batches hold `labels` (n, k);
- different inputs per source (text domains): each document comes from source i with probability
  λ_i, uniformly within it, and documents are packed into fixed-length rows (`PackedMixture`),
  trained with `losses.next_token_nll(mask_key=None)` through `engine.fit(trainer, packed.batch)`.

A packed batch depends only on the generator it is drawn with (no carry-over between batches),
so checkpointing the generator state resumes the exact stream.

API:
    PackedMixture(sources, weights, *, seq_len, batch_size, eos_id)
        .batch(rng) -> {"tokens": (batch_size, seq_len) int32, "source": same shape, int32}
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpmix_jax.data.mixture import check_weights, draw_mixture

# A document source: anything with len() whose items are 1-D token-id arrays (a list of arrays,
# or a thin adapter over a data-layer source).
DocumentSource = Sequence[np.ndarray]


class PackedMixture:
    """Fixed-shape token batches: documents drawn by λ, joined with EOS, cut into rows.

    Args:
        sources: k document sources (see `DocumentSource`).
        weights: λ, shape (k,), on the simplex.
        seq_len: tokens per row.
        batch_size: rows per batch.
        eos_id: token appended after every document.
    """

    def __init__(
        self,
        sources: Sequence[DocumentSource],
        weights: Sequence[float] | np.ndarray,
        *,
        seq_len: int,
        batch_size: int,
        eos_id: int,
    ):
        if not sources:
            raise ValueError("PackedMixture needs at least one source.")
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if not isinstance(eos_id, int) or eos_id < 0:
            raise ValueError(f"eos_id must be a non-negative integer, got {eos_id!r}.")
        self.weights = check_weights(weights, len(sources))
        if self.weights.ndim != 1:
            raise ValueError("PackedMixture takes a single mixture of shape (k,).")
        self.sources = tuple(sources)
        self.sizes = [len(s) for s in self.sources]
        self.seq_len, self.batch_size, self.eos_id = seq_len, batch_size, eos_id

    def batch(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """One packed batch; the last document is cut where the batch is full.

        `source` marks the source of every token (EOS tokens belong to the document before them).
        """
        need = self.seq_len * self.batch_size
        tokens, owners, filled = [], [], 0
        while filled < need:
            (source,), (within,) = draw_mixture(self.sizes, self.weights, 1, rng=rng)
            doc = np.asarray(self.sources[source][within], dtype=np.int64).ravel()
            doc = np.append(doc, self.eos_id)
            tokens.append(doc)
            owners.append(np.full(len(doc), source))
            filled += len(doc)
        shape = (self.batch_size, self.seq_len)
        return {
            "tokens": np.concatenate(tokens)[:need].reshape(shape).astype(np.int32),
            "source": np.concatenate(owners)[:need].reshape(shape).astype(np.int32),
        }
