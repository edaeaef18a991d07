"""Vote-histogram samplers: coordinated ("hot", shared Gumbel noise) and independent ("cold").

Both samplers take the teachers' next-token logits `(n, V)` for one decoding step and draw
`num_histograms` vote histograms `(num_histograms, V)` (int32, every row sums to n).

* Coordinated: per histogram one shared Gumbel vector g (float32, V entries); teacher i votes
  `argmax_j(x_ij + g_j)` with x = logits / t. Each vote is marginally distributed as
  softmax(logits_i / t) (Gumbel-max), while teachers with similar distributions tend to agree: two
  teachers with distributions p, q agree with probability Σ_j 1 / Σ_l max(p_l/p_j, q_l/q_j).
* Independent: every teacher draws its own vote by inverse-CDF sampling (exact two-level
  fixed-point tables: block masses in one pass over the logits, then the chosen block's token
  table), the fair baseline: `jax.random.categorical` would draw n·V noise values per histogram.

`coordinated_sampler` / `independent_sampler` do the per-logits set-up once and return
`draw(key, r)`, so a decoding step's retries share it. A coordinated decoding step (r = 1) is
one pass over the logits (the maxima of 128-token chunks of logits + noise, `_row_votes`) and a
sum of them for the teachers' check; a coordinated draw of fewer than `_LAZY_MIN_HISTOGRAMS`
histograms is the full scan even with `top_k` (the lazy set-up would cost more than it saves).
An independent step is one pass, the block masses of exp(logits), when those masses show them
exact (`_block_tables`).

Lazy coordinated sampler (`top_k=K`). Same law as the full scan, but the shared noise is drawn
only where it can matter. Once per call: each teacher's K best tokens T_i and b_i = the largest
x_ij outside T_i; the head S = ∪_i T_i; the complement V \\ S sorted by max_i x_ij (descending)
and cut into blocks B_1, B_2, ... of sizes 1, 2, 4, ...; c_ib >= max_{j ∈ B_b} x_ij, exact for
the first ten blocks (the 1023 best-ranked outside tokens, the ones that compete) and
min(b_i, max_{j ∈ B_b} max_l x_lj) beyond them (one pass over V instead of n·V).
Per histogram, only g_S (|S| Gumbels) and the block maxima M_b = max_{j ∈ B_b} g_j are drawn:
M_b ~ Gumbel(loc = log |B_b|), since P(max of m iid Gumbel(0, 1) ≤ y) = exp(-m e^{-y}).
Teacher i's best head token w_i = max_{j ∈ T_i} (x_ij + g_j) is its vote when it beats the
certificate
    max( x_ij + g_j for the L largest-noise tokens j of S, other than i's winner,
         b_i + the (L+1)-th largest value of g_S,
         max_b (c_ib + M_b) ),
which bounds every other token's score: tokens of S \\ T_i have x_ij ≤ b_i, tokens of block b
have x_ij ≤ c_ib and g_j ≤ M_b, and rounded float addition is monotone, so the bound holds for the
float32 scores too. A histogram in which some teacher fails gets its noise vector completed
conditionally on what was drawn: within a block of m tokens, the maximum is independent of its
position, which is uniform over the block (exchangeability), and given (M_b, position) the other
m - 1 values are iid Gumbel truncated to (-∞, M_b), drawn by inverse CDF (F(y) = exp(-e^{-y}),
F^{-1}(u·F(M_b)) = -log(E + exp(-M_b)) with E = -log u ~ Exp(1)). The sets S and B_b depend on
the logits only, never on the noise, so drawing lazily biases nothing. The completed vector
therefore has the law of V iid Gumbels, certified votes are its argmaxes, and the failing teachers
are rescanned on it exactly: a failing teacher's vote scores at least its best head score w_i,
and x_ij <= max_l x_lj, so only tokens with max_l x_lj + g_j >= min_i w_i (usually a handful) are
scanned, or the whole vocabulary when there are many. Output histograms thus have the full scan's
law (not its bits for the same key). With n·K ≪ V and peaked (LM-like) teachers most histograms
need no completion (cost O(|S| + n·(K + L + B)) instead of O(n·V)); a single block (one M over
V \\ S) would be valid too but far looser, as it treats every outside token like the largest one.
When |S| is a large part of V (diverse teachers), or the teachers put less than half their mass on
their own K head tokens (flat teachers, even sharing one ranking), the noise-leader certificate
runs instead. Each histogram draws its whole noise vector (the full scan's own bits for the key: V
values, cheap next to the n·V scores) and takes its leaders L, the tokens whose noise exceeds a
fixed θ (about 576 of them, at most 768: `_leader_sizes`). Teacher i's best token among T_i ∪ L
wins when it beats b_i + max_{j ∉ L} g_j, which bounds the score of every other token: a token
outside T_i has x_ij ≤ b_i. The leaders' scores are contiguous rows of the logits transposed once
per call (V, n). Failing teachers (about 2 in 10^5 on N(0, 2²) teachers) are rescanned on the same
noise vector, as above, so the histograms are the full scan's for the same key, bit for bit. The
transposed copy doubles the memory the logits take. No truncation (top-p) is offered: that would be
a different distribution.

Example:
    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))
    >>> h = coordinated_histograms(jax.random.key(0), logits, 4)
    >>> h.shape, bool((h.sum(axis=1) == 2).all()), bool((h[:, 2] == 0).all())
    ((4, 3), True, True)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.privacy import randomness, validation

__all__ = [
    "Draw",
    "coordinated_histograms",
    "coordinated_sampler",
    "first_argmax",
    "independent_histograms",
    "independent_sampler",
]

_LEADERS = 8  # largest head-noise values whose exact scores enter the certificate
_DEFAULT_BATCH = 4  # histograms vmapped together in the lazy sampler's main pass
_EXACT_BLOCKS = 10  # blocks (2^E - 1 best-ranked complement tokens) with exact per-teacher c_ib
_RESCAN_TOKENS = 128  # candidate tokens of a pruned rescan (more: scan the whole vocabulary)
_NOISE_LEADERS = 768  # most noise leaders a histogram gathers (large heads; `_leader_sizes`)
_LEADER_BLOCK = 16  # tokens per block when finding the noise leaders
_LEADER_MIN_VOCAB = 64  # below this a large head means the full scan
# Fewer histograms than this are drawn by the full scan even with `top_k`: the lazy set-up (top-K,
# plan) costs about as much as this many full-scan histograms (each one pass over the logits).
_LAZY_MIN_HISTOGRAMS = 16
_ROW_CHUNK = 128  # tokens per chunk of a pass over the logits (`_row_votes`)
# Below this mean probability on the teachers' own head tokens the noise-leader certificate runs
# even for a small head S: with flat teachers (a shared ranking, little mass on each head) the
# blocks' bound c_ib + M_b exceeds the best head score in most histograms.
_MIN_HEAD_MASS = 0.5


def _check_inputs(logits: jax.Array, num_histograms: int, temperature: float) -> tuple[int, float]:
    """Validates the public arguments; returns (num_histograms, temperature) as Python numbers
    (NumPy scalars are accepted). The teachers' logits themselves are checked on the row maxima
    that the first pass over them computes, and their sum (`_check_teachers`)."""
    if getattr(logits, "ndim", None) != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        shape = getattr(logits, "shape", None)
        raise ValueError(f"logits must have shape (n_teachers, vocab_size), got {shape}.")
    return (
        validation.check_steps(num_histograms, "num_histograms"),
        validation.check_positive(temperature, "temperature"),
    )


def _check_teachers(row_max: jax.Array, may_have_nan: jax.Array, logits: jax.Array) -> None:
    """Raises for a teacher without a finite logit or with a NaN or +inf one.

    Args:
        row_max: per teacher, the maximum of its scaled logits (plus finite noise), which a
            pass over the logits computes anyway: -inf exactly when every logit is -inf, +inf
            when one is +inf.
        may_have_nan: True whenever a logit is NaN, which XLA:CPU's fast maxima skip: whether
            a sum over all the (scaled) logits, or over numbers that propagate their NaN, is
            NaN (`_nan_in`). Only then are the logits looked up per teacher.
        logits: the teachers' logits.
    """
    row_max = np.asarray(row_max)
    has_nan = np.zeros(row_max.shape, bool)
    if may_have_nan:
        has_nan = np.isnan(np.asarray(logits)).any(axis=1)
    for bad, what in (
        (~has_nan & (row_max == -np.inf), "no finite logit (every token -inf)"),
        (has_nan | np.isnan(row_max) | (row_max == np.inf), "a NaN or +inf logit"),
    ):
        if bad.any():
            teachers = np.flatnonzero(bad)
            more = f" (and {len(teachers) - 1} more teachers)" if len(teachers) > 1 else ""
            raise ValueError(
                f"teacher {teachers[0]} has {what}{more}; each teacher's logits need a finite "
                "entry and may use only -inf for probability 0."
            )


@jax.jit
def _nan_in(x: jax.Array) -> jax.Array:
    """True when x holds a NaN (also when +inf meets -inf, or finite entries overflow)."""
    return jnp.isnan(jnp.sum(x))


def _check_batch(batch_size: int | None) -> int | None:
    return None if batch_size is None else validation.check_steps(batch_size, "batch_size")


def _bincount(votes: jax.Array, vocab_size: int) -> jax.Array:
    return jnp.zeros((vocab_size,), jnp.int32).at[votes].add(1)


def _shared_noise(key, vocab):
    """One histogram's shared noise: `jax.random.gumbel(key, (V,))`, rounds unrolled (faster)."""
    return jax.random.gumbel(randomness.unrolled(key), (vocab,))


def _row_votes(scaled: jax.Array, noise: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row of `scaled` (n, V): the first argmax of row + noise and its maximum.

    The maxima of the rows' 128-token chunks come from one reduce-window over row + noise, which
    XLA:CPU runs at about the speed of one read of the logits (a row-wise reduction or argmax over
    (n, V) runs at 2-15 reads); the first chunk holding a row's maximum is then searched for its
    first maximal token (one gather of 128 entries per row). The sums row + noise are never
    stored.
    """
    chunk_best = _block_reduce(scaled + noise, _ROW_CHUNK)
    best = jnp.max(chunk_best, axis=-1)
    columns = first_argmax(chunk_best)[..., None] * _ROW_CHUNK + jnp.arange(_ROW_CHUNK)
    in_chunk = jnp.take_along_axis(
        scaled, columns, axis=-1, mode="fill", fill_value=-jnp.inf
    ) + jnp.take(noise, columns, mode="fill", fill_value=-jnp.inf)
    votes = jnp.take_along_axis(columns, first_argmax(in_chunk)[..., None], axis=-1)[..., 0]
    return votes.astype(jnp.int32), best


_chunk_max = jax.jit(lambda x: _block_reduce(x, _ROW_CHUNK))


def _row_max(x: jax.Array) -> jax.Array:
    """`jnp.max(x, axis=1)` from the maxima of 128-token chunks (one fast pass, `_row_votes`).
    Two calls on purpose: in one, XLA rewrites the pair back into the slow row reduction."""
    return jnp.max(_chunk_max(x), axis=1)


def first_argmax(scores: jax.Array) -> jax.Array:
    """`jnp.argmax(scores, -1)` (first maximal index) as two plain reductions (faster on CPU).
    Scores must hold no NaN (a row with one has no maximum: its index is the row's length)."""
    best = jnp.max(scores, axis=-1, keepdims=True)
    ids = jnp.arange(scores.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(scores == best, ids, scores.shape[-1]), axis=-1)


def coordinated_histograms(
    key: jax.Array,
    logits: jax.Array,
    num_histograms: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    fallback_rows: int = 16,
    batch_size: int | None = None,
) -> jax.Array:
    """Coordinated (shared-randomness) vote histograms.

    Args:
        key: PRNG key; histogram h uses the noise drawn from `split(key, r)[h]`.
        logits: `(n, V)` teacher logits (`-inf` = probability 0; each row needs a finite entry).
        num_histograms: r, the number of histograms (fresh shared noise for each).
        temperature: t > 0; votes are drawn from softmax(logits / t).
        top_k: if set, the lazy sampler with K head tokens per teacher (K < V; module
            docstring) for draws of at least `_LAZY_MIN_HISTOGRAMS` = 16 histograms: same law
            as the full scan (the same bits for the same key when the heads cover most of
            V). It looks once at the head size on the host, so call it outside `jax.jit`.
        fallback_rows: with `top_k`, the failing teachers of a histogram are rescanned over V
            this many rows at a time (speed only).
        batch_size: histograms vmapped together inside `lax.map` (memory vs speed); None means
            1 for the full scan and 4 for the lazy sampler (fastest on CPU).

    Returns:
        `(r, V)` int32 vote counts; each row sums to n.

    Privacy:
        Reads the teachers' logits, which depend on sensitive data. Conditioned on the (public,
        data-independent) shared noise, one teacher's data changes one vote, so the histogram
        has L1 sensitivity 2; release it only through a DP aggregator. The lazy sampler decides
        from the logits which noise values to draw, but their joint law, and hence the
        histogram's law, is exactly that of the full scan.
    """
    num_histograms, _ = _check_inputs(logits, num_histograms, temperature)
    draw = coordinated_sampler(
        logits,
        temperature=temperature,
        top_k=top_k,
        fallback_rows=fallback_rows,
        batch_size=batch_size,
    )
    return draw(key, num_histograms)


Draw = Callable[[jax.Array, int], jax.Array]
"""`draw(key, r) -> (r, V)` histograms from logits prepared once (`coordinated_sampler`,
`independent_sampler`)."""


def coordinated_sampler(
    logits: jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    fallback_rows: int = 16,
    batch_size: int | None = None,
) -> Draw:
    """`coordinated_histograms` with its per-logits set-up (checks, the lazy path's top-K and
    plan) done once: the returned `draw(key, r)` only draws, e.g. for a decoding step's retries.

    Args and privacy: as `coordinated_histograms`; `draw(key, r)` gives the same histograms as
    `coordinated_histograms(key, logits, r, ...)`.
    """
    _, temperature = _check_inputs(logits, 1, temperature)
    batch_size = _check_batch(batch_size)
    vocab = logits.shape[1]

    def full(key, num_histograms):
        return _coordinated_full(key, logits, num_histograms, temperature, batch_size)

    if top_k is None:
        return _counted(full)
    top_k = validation.check_steps(top_k, "top_k")
    if top_k >= vocab:
        raise ValueError(f"top_k must be an integer in [1, vocab_size = {vocab}), got {top_k}.")
    fallback_rows = min(validation.check_steps(fallback_rows, "fallback_rows"), logits.shape[0])
    prepared: list[Draw] = []

    def lazy_draw() -> Draw:
        """The lazy path's set-up, done on the first draw that needs it."""
        if prepared:
            return prepared[0]
        scaled = _scale(logits, temperature)
        _check_teachers(_row_max(scaled), _nan_in(scaled), logits)
        values, indices = _top_k(scaled, top_k)
        head_tokens, in_head = _head(values, indices, vocab)
        width = _head_width(int(in_head.sum()), vocab)  # the host looks of the set-up
        if width is not None and float(_head_mass(scaled, values)) < _MIN_HEAD_MASS:
            width = None  # flat teachers: the blocks' bound is loose, the leaders' is not
        chosen_batch = _DEFAULT_BATCH if batch_size is None else batch_size
        if width is None and vocab < _LEADER_MIN_VOCAB:
            prepared.append(full)
        elif width is None:
            plan = _leader_plan(scaled, values, head_tokens)
            prepared.append(
                lambda key, r: _coordinated_leaders(
                    key, scaled, plan, r, fallback_rows, chosen_batch
                )
            )
        else:
            plan = _plan(scaled, values, head_tokens, in_head, width)
            prepared.append(
                lambda key, r: _coordinated_lazy(key, scaled, plan, r, fallback_rows, chosen_batch)
            )
        return prepared[0]

    def draw(key, num_histograms):
        if num_histograms < _LAZY_MIN_HISTOGRAMS:  # the set-up would cost more than it saves
            return full(key, num_histograms)
        return lazy_draw()(key, num_histograms)

    return _counted(draw)


def _counted(draw: Draw) -> Draw:
    """`draw` with its `num_histograms` validated."""

    def checked(key, num_histograms):
        return draw(key, validation.check_steps(num_histograms, "num_histograms"))

    return checked


@jax.jit
def _head_mass(scaled, values):
    """The teachers' mean probability on their own K head tokens (one pass of exponentials)."""
    top_k = values.shape[1] - 1
    head = jax.nn.logsumexp(values[:, :top_k], axis=1)
    return jnp.mean(jnp.exp(head - jax.nn.logsumexp(scaled, axis=1)))


def _head_width(size: int, vocab: int) -> int | None:
    """Static padded head size (a power of two > |S|, so few compilations), None: full scan."""
    width = max(2 ** int(np.ceil(np.log2(size + 1))), 2 * _LEADERS)
    return None if 2 * width > vocab else width


def _scale(logits, temperature):
    """float32 logits / t (the input itself when there is nothing to do: no 4·n·V-byte copy)."""
    if temperature == 1.0 and logits.dtype == jnp.float32:
        return logits
    return _divide(logits, temperature)


@functools.partial(jax.jit, static_argnums=1)
def _divide(logits, temperature):
    return logits.astype(jnp.float32) / temperature


def _coordinated_full(key, logits, num_histograms, temperature, batch_size):
    """The full scan: every teacher's vote is the first argmax of x_i + g; the teachers are
    checked on the first histogram's row maxima and the logits' sum (same call)."""
    histograms, row_max, may_have_nan = _coordinated_full_pass(
        key, logits, num_histograms, temperature, batch_size
    )
    _check_teachers(row_max, may_have_nan, logits)
    return histograms


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _coordinated_full_pass(key, logits, num_histograms, temperature, batch_size):
    scaled = _scale(logits, temperature)
    vocab = scaled.shape[1]

    def one(k):
        votes, best = _row_votes(scaled, _shared_noise(k, vocab))
        return _bincount(votes, vocab), best

    histograms, best = jax.lax.map(
        one, jax.random.split(key, num_histograms), batch_size=batch_size
    )
    return histograms, best[0], _nan_in(scaled)


_CHUNK = 128  # tokens per chunk in the two-stage top-K


@functools.partial(jax.jit, static_argnums=1)
def _top_k(scaled, top_k):
    """Per teacher the K + 1 largest scaled logits and their tokens.

    Two stages (`lax.top_k` over whole rows is slow on CPU): the K + 1 chunks with the largest
    maxima hold the K + 1 largest entries, since an entry outside them is exceeded by K + 1 chunk
    maxima.
    """
    n, vocab = scaled.shape
    width = min(_CHUNK, vocab)
    num_chunks = -(-vocab // width)
    chunk_max = _block_reduce(scaled, width)
    _, chunks = jax.lax.top_k(chunk_max, min(top_k + 1, num_chunks))
    # The last chunk is read from vocab - width on; entries of the previous chunk are masked.
    tokens = jnp.minimum(chunks * width, vocab - width)[:, :, None] + jnp.arange(width)
    candidates = jnp.take_along_axis(scaled, tokens.reshape(n, -1), axis=1)
    candidates = jnp.where(
        tokens >= chunks[:, :, None] * width, candidates.reshape(tokens.shape), -jnp.inf
    )
    # Materialised on purpose: fused into the next top_k it is several times slower on CPU.
    candidates = jax.lax.optimization_barrier(candidates.reshape(n, -1))
    values, flat = jax.lax.top_k(candidates, top_k + 1)
    return values, jnp.take_along_axis(tokens.reshape(n, -1), flat, axis=1)


@functools.partial(jax.jit, static_argnums=2)
def _head(values, indices, vocab):
    """T_i without its -inf entries (id V), and the mask of S (a separate jit: fused with the
    top-K above, XLA:CPU made the whole pass an order of magnitude slower)."""
    top_k = values.shape[1] - 1
    head_tokens = jnp.where(values[:, :top_k] > -jnp.inf, indices[:, :top_k], vocab)
    return head_tokens, jnp.zeros(vocab, bool).at[head_tokens].set(True, mode="drop")


def _column_max(x):
    """`jnp.max(x, axis=0)` as a tree of elementwise maxima (a column reduction is slow on CPU)."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        top = jnp.maximum(x[:half], x[half : 2 * half])
        x = jnp.concatenate([top, x[2 * half :]]) if x.shape[0] % 2 else top
    return x[0]


class _Plan(NamedTuple):
    """What the lazy sampler computes once per call (module docstring for the symbols)."""

    head: jax.Array  # (P,) token ids of S, padded with V
    head_x: jax.Array  # (n, P) x_ij on S, -inf on padding
    cand_values: jax.Array  # (n, K) x_ij on T_i
    cand_pos: jax.Array  # (n, K) positions of T_i in `head`
    cand_tokens: jax.Array  # (n, K) token ids of T_i (V for left-out -inf candidates)
    outside: jax.Array  # (n,) b_i
    block_x: jax.Array  # (n, B) c_ib
    log_sizes: jax.Array  # (B,) log |B_b| (-inf for empty blocks)
    block_start: jax.Array  # (B + 1,) block b = complement ranks [start_b, start_{b+1})
    ranked: jax.Array  # (V,) complement token ids by decreasing max_i x_ij, then S
    block_of: jax.Array  # (V,) block of each token, B for tokens of S
    column_max: jax.Array  # (V,) max_i x_ij


@functools.partial(jax.jit, static_argnums=4)
def _plan(scaled, values, head_tokens, in_head, width):
    n, vocab = scaled.shape
    top_k = head_tokens.shape[1]
    head = jnp.nonzero(in_head, size=width, fill_value=vocab)[0]
    position = jnp.cumsum(in_head) - 1
    # Left-out (-inf) candidates point at a padding slot of the head (width > |S|).
    cand_pos = jnp.where(head_tokens < vocab, position[jnp.minimum(head_tokens, vocab - 1)], -1)
    head_x = jnp.where(head < vocab, jnp.take(scaled, head, axis=1, mode="clip"), -jnp.inf)
    # Blocks of sizes 1, 2, 4, ... over the complement ranked by its largest logit.
    num_blocks = int(np.ceil(np.log2(vocab + 1)))
    size = vocab - jnp.sum(in_head)
    block_start = jnp.minimum(2 ** jnp.arange(num_blocks + 1) - 1, size).at[-1].set(size)
    column_max = _column_max(scaled)
    # Tokens of S last, after every complement token (also those with column max -inf).
    finite_last = jnp.minimum(-column_max, jnp.finfo(jnp.float32).max)
    ranked = jnp.argsort(jnp.where(in_head, jnp.inf, finite_last), stable=True)
    rank = jnp.zeros(vocab, jnp.int32).at[ranked].set(jnp.arange(vocab, dtype=jnp.int32))
    block_of = jnp.searchsorted(block_start, rank, side="right") - 1
    block_of = jnp.where(in_head, num_blocks, block_of)
    # c_ib exactly for the first blocks, the complement's best-ranked tokens (one (n, 2^E - 1)
    # gather); beyond them the bound min(b_i, max_{j ∈ B_b} max_i x_ij), from (V,) values only.
    exact_blocks = min(num_blocks, _EXACT_BLOCKS)
    span = min(2**exact_blocks - 1, vocab)
    leading = jnp.take(scaled, ranked[:span], axis=1)
    leading = jnp.where(jnp.arange(span) < size, leading, -jnp.inf)
    exact = [
        jnp.max(leading[:, 2**b - 1 : min(2 ** (b + 1) - 1, span)], axis=1)
        for b in range(exact_blocks)
    ]
    loose = jax.ops.segment_max(column_max, block_of, num_blocks + 1)[:num_blocks]
    block_x = jnp.minimum(values[:, top_k, None], loose)
    block_x = block_x.at[:, :exact_blocks].set(jnp.stack(exact, axis=1))
    return _Plan(
        head=head,
        head_x=head_x,
        cand_values=values[:, :top_k],
        cand_pos=cand_pos % width,
        cand_tokens=head_tokens,
        outside=values[:, top_k],
        block_x=block_x,
        log_sizes=jnp.log(jnp.diff(block_start).astype(jnp.float32)),
        block_start=block_start,
        ranked=ranked,
        block_of=block_of,
        column_max=column_max,
    )


def _sparse_noise(key, plan: _Plan):
    """The drawn part of one histogram's noise: g on S (padding -inf) and the block maxima."""
    key_head, key_blocks, _ = jax.random.split(key, 3)
    head_noise = jax.random.gumbel(key_head, plan.head.shape)
    head_noise = jnp.where(plan.head < plan.ranked.shape[0], head_noise, -jnp.inf)
    return head_noise, jax.random.gumbel(key_blocks, plan.log_sizes.shape) + plan.log_sizes


def _largest(x, count):
    """`jax.lax.top_k(x, count)` for a small count, by repeated argmax (XLA:CPU sorts instead)."""
    values, indices = [], []
    for _ in range(count):
        index = first_argmax(x)
        values.append(x[index])
        indices.append(index)
        x = x.at[index].set(-jnp.inf)
    return jnp.stack(values), jnp.stack(indices)


def _certified_votes(key, plan: _Plan):
    """Each teacher's best head token, its score, and whether the certificate proves it wins."""
    vocab = plan.ranked.shape[0]
    head_noise, block_max = _sparse_noise(key, plan)
    scores = plan.cand_values + head_noise[plan.cand_pos]
    best = jnp.max(scores, axis=-1)
    # Ties go to the smallest token id, as in the full scan.
    winner = jnp.min(jnp.where(scores == best[:, None], plan.cand_tokens, vocab), axis=-1)
    leader_noise, leaders = _largest(head_noise, _LEADERS + 1)
    leader_scores = plan.head_x[:, leaders[:-1]] + leader_noise[:-1]
    leader_scores = jnp.where(plan.head[leaders[:-1]] == winner[:, None], -jnp.inf, leader_scores)
    bound = jnp.maximum(
        jnp.maximum(jnp.max(leader_scores, axis=-1), plan.outside + leader_noise[-1]),
        jnp.max(plan.block_x + block_max, axis=-1),
    )
    return winner, best, ~(best > bound)


def _full_noise(key, plan: _Plan):
    """The whole noise vector, drawn conditionally on `_sparse_noise(key, plan)`."""
    vocab = plan.ranked.shape[0]
    head_noise, block_max = _sparse_noise(key, plan)
    key_position, key_rest = jax.random.split(jax.random.split(key, 3)[2])
    start, stop = plan.block_start[:-1], plan.block_start[1:]
    rank = jax.random.randint(key_position, start.shape, start, jnp.maximum(stop, start + 1))
    argmax_token = jnp.where(stop > start, plan.ranked[jnp.minimum(rank, vocab - 1)], vocab)
    cap = jnp.append(block_max, 0.0)[plan.block_of]  # tokens of S are overwritten below
    rest = -jnp.log(jax.random.exponential(key_rest, (vocab,)) + jnp.exp(-cap))
    rest = jnp.minimum(rest, jnp.nextafter(cap, -jnp.inf))  # strictly below the block maximum
    noise = rest.at[plan.head].set(head_noise, mode="drop")
    return noise.at[argmax_token].set(block_max, mode="drop")


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _coordinated_lazy(key, scaled, plan, num_histograms, fallback_rows, batch_size):
    return _certify_then_rescan(
        jax.random.split(key, num_histograms),
        scaled,
        plan.column_max,
        functools.partial(_certified_votes, plan=plan),
        functools.partial(_full_noise, plan=plan),
        fallback_rows,
        batch_size,
    )


def _block_reduce(x, width, *, reduce=jax.lax.max, init=-jnp.inf):
    """(..., V) -> (..., ceil(V / width)): maxima (or `reduce` with identity `init`) over
    consecutive blocks of `width` tokens, a reduce-window (fast on XLA:CPU, `_row_votes`)."""
    vocab = x.shape[-1]
    window = (1,) * (x.ndim - 1) + (width,)
    padding = [(0, 0)] * (x.ndim - 1) + [(0, -vocab % width)]
    return jax.lax.reduce_window(x, init, reduce, window, window, padding)


class _LeaderPlan(NamedTuple):
    """What the noise-leader certificate computes once per call."""

    cand_values: jax.Array  # (n, K) x_ij on T_i (-inf for left-out candidates)
    cand_tokens: jax.Array  # (n, K) token ids of T_i (V for left-out candidates)
    outside: jax.Array  # (n,) b_i, the largest x_ij outside T_i
    tokens_major: jax.Array  # (V, n) x transposed: a leader's scores are one contiguous row
    column_max: jax.Array  # (V,) max_i x_ij


@jax.jit
def _leader_plan(scaled, values, head_tokens):
    top_k = head_tokens.shape[1]
    return _LeaderPlan(
        cand_values=values[:, :top_k],
        cand_tokens=head_tokens,
        outside=values[:, top_k],
        tokens_major=scaled.T,
        column_max=_column_max(scaled),
    )


def _leader_sizes(vocab: int) -> tuple[int, float]:
    """(the most leaders a histogram gathers, the noise threshold that makes a leader).

    The threshold θ has P(g > θ) = m / V for m = 3/4 of the capacity, so a histogram has
    Binomial(V, m / V) leaders, more than the capacity with probability below 1e-9 at the full
    capacity (then all its teachers are rescanned: exact, only slower)."""
    capacity = min(_NOISE_LEADERS, max(vocab // 4, 1))
    mean = 0.75 * capacity
    return capacity, float(-np.log(-np.log1p(-mean / vocab)))


def _noise_leaders(noise, threshold, capacity):
    """The tokens whose noise exceeds `threshold` (ascending, padded with V to `capacity`), the
    largest noise value of all other tokens, and whether a token above `threshold` was left
    out (more than `capacity` of them).

    Two levels (one `nonzero` over V is several times slower on CPU): the blocks of
    `_LEADER_BLOCK` tokens holding a leader, then the leaders within those blocks."""
    vocab = noise.shape[0]
    width = _LEADER_BLOCK
    padded = jnp.pad(noise, (0, -vocab % width), constant_values=-jnp.inf)
    blocks = padded.reshape(-1, width)
    above = blocks > threshold
    count = jnp.sum(above)
    hit = jnp.nonzero(jnp.any(above, axis=1), size=capacity, fill_value=blocks.shape[0])[0]
    within = jnp.take(above, hit, axis=0, mode="fill", fill_value=False).reshape(-1)
    slot = jnp.nonzero(within, size=capacity, fill_value=within.shape[0])[0]
    tokens = jnp.take(hit, slot // width, mode="fill", fill_value=vocab) * width + slot % width
    tokens = jnp.where(slot < within.shape[0], tokens, vocab)
    rest = jnp.max(jnp.where(above, -jnp.inf, blocks))
    return tokens, rest, count > capacity


def _leader_certified_votes(key, plan: _LeaderPlan, threshold, capacity):
    """Each teacher's best token among T_i and the noise leaders L, its score, and whether it
    provably wins: a token outside T_i ∪ L scores at most b_i + (the largest noise outside L)."""
    vocab = plan.tokens_major.shape[0]
    noise = _shared_noise(key, vocab)
    leaders, rest, overflow = _noise_leaders(noise, threshold, capacity)
    head_scores = plan.cand_values + noise[jnp.minimum(plan.cand_tokens, vocab - 1)]
    leader_scores = (
        jnp.take(plan.tokens_major, leaders, axis=0, mode="fill", fill_value=-jnp.inf)
        + jnp.take(noise, leaders, mode="fill", fill_value=-jnp.inf)[:, None]
    )
    best = jnp.maximum(jnp.max(head_scores, axis=1), _column_max(leader_scores))
    # Ties go to the smallest token id, as in the full scan.
    head_winner = jnp.min(jnp.where(head_scores == best[:, None], plan.cand_tokens, vocab), axis=1)
    leader_winner = -_column_max(jnp.where(leader_scores == best, -leaders[:, None], -vocab))
    winner = jnp.minimum(head_winner, leader_winner)
    return winner, best, ~(best > plan.outside + rest) | overflow


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _coordinated_leaders(key, scaled, plan, num_histograms, fallback_rows, batch_size):
    capacity, threshold = _leader_sizes(scaled.shape[1])
    return _certify_then_rescan(
        jax.random.split(key, num_histograms),
        scaled,
        plan.column_max,
        functools.partial(
            _leader_certified_votes, plan=plan, threshold=threshold, capacity=capacity
        ),
        lambda key: _shared_noise(key, scaled.shape[1]),
        fallback_rows,
        batch_size,
    )


def _certify_then_rescan(keys, scaled, column_max, certify, complete, fallback_rows, batch_size):
    """Votes certified per histogram by `certify(key) -> (votes, best, failing)`; the failing
    teachers of a histogram are rescanned on `complete(key)`, its whole noise vector."""
    n, vocab = scaled.shape
    num_histograms = keys.shape[0]
    votes, best, failing = jax.lax.map(certify, keys, batch_size=batch_size)
    flagged = jnp.any(failing, axis=1)
    order = jnp.nonzero(flagged, size=num_histograms, fill_value=0)[0]

    def rescan(i, votes):
        h = order[i]
        noise = complete(keys[h])
        # A failing teacher's vote scores at least its best head score, and x_ij <= max_i x_ij:
        # tokens whose column maximum plus noise stays below the smallest such score are no
        # teacher's vote. Usually only a few tokens are left to scan.
        floor = jnp.min(jnp.where(failing[h], best[h], jnp.inf))
        candidates = column_max + noise >= floor
        tokens = jnp.nonzero(candidates, size=_RESCAN_TOKENS, fill_value=vocab)[0]

        def pruned_scan(row_votes):
            x = jnp.take(scaled, tokens, axis=1, mode="fill", fill_value=-jnp.inf)
            scores = x + jnp.take(noise, tokens, mode="fill", fill_value=-jnp.inf)
            return jnp.where(failing[h], tokens[first_argmax(scores)], row_votes)

        def full_scan(row_votes):
            rows = jnp.nonzero(failing[h], size=n + fallback_rows, fill_value=n)[0]

            def some_rows(j, row_votes):
                some = jax.lax.dynamic_slice(rows, (j * fallback_rows,), (fallback_rows,))
                rescanned, _ = _row_votes(scaled[jnp.minimum(some, n - 1)], noise)
                return row_votes.at[some].set(rescanned, mode="drop")

            count = -(-jnp.sum(failing[h]) // fallback_rows)
            return jax.lax.fori_loop(0, count, some_rows, row_votes)

        few = jnp.sum(candidates) <= _RESCAN_TOKENS
        return votes.at[h].set(jax.lax.cond(few, pruned_scan, full_scan, votes[h]))

    votes = jax.lax.fori_loop(0, jnp.sum(flagged), rescan, votes)
    return jax.vmap(lambda v: _bincount(v, vocab))(votes)


def independent_histograms(
    key: jax.Array,
    logits: jax.Array,
    num_histograms: int,
    *,
    temperature: float = 1.0,
    batch_size: int | None = 1024,
) -> jax.Array:
    """Independent vote histograms by inverse-CDF sampling (the cold-PATE baseline).

    Once per call, per teacher (one pass over the logits): the block table, the masses of blocks
    of 256 tokens as integers in units of 2^-30 of their total (cumulative sums exact); per
    vote a block by binary search, then a token within it by the block's own fixed-point table
    (built per vote for fewer than 64 histograms, for every block once for more), with two
    30-bit uniforms. Every token's
    probability is its float32 softmax probability up to float32 rounding and 2^-30 of its block
    (total variation ~1e-7 at V = 50,257, against ~1e-3 for a float32 cumulative sum over V).
    Tokens of probability 0 have empty intervals and never get votes.

    Args:
        key: PRNG key.
        logits: `(n, V)` teacher logits (`-inf` = probability 0; each row needs a finite entry).
        num_histograms: r, the number of histograms.
        temperature: t > 0; votes are drawn from softmax(logits / t).
        batch_size: histograms vmapped together inside `lax.map` (None: one at a time); the
            default, large batches, is the fastest on CPU, which keeps the baseline fair.

    Returns:
        `(r, V)` int32 vote counts; each row sums to n.

    Privacy:
        Reads the teachers' logits (sensitive). Every teacher votes independently, so one
        teacher's data changes one vote (L1 sensitivity 2); release only through a DP aggregator.
    """
    num_histograms, _ = _check_inputs(logits, num_histograms, temperature)
    return independent_sampler(logits, temperature=temperature, batch_size=batch_size)(
        key, num_histograms
    )


def independent_sampler(
    logits: jax.Array, *, temperature: float = 1.0, batch_size: int | None = 1024
) -> Draw:
    """`independent_histograms` with its set-up (checks, block tables: one pass over the logits)
    done once: the returned `draw(key, r)` gives the same histograms as
    `independent_histograms(key, logits, r, ...)` and only draws.

    Privacy: as `independent_histograms`.
    """
    _, temperature = _check_inputs(logits, 1, temperature)
    batch_size = _check_batch(batch_size)
    block_cdf = _block_tables(logits, temperature)
    vocab = logits.shape[1]
    local: list[jax.Array] = []

    def draw(key, num_histograms):
        num_histograms = validation.check_steps(num_histograms, "num_histograms")
        if num_histograms < _TABLE_MIN_HISTOGRAMS:  # each vote's block table, built on the fly
            return _independent_lazy(
                key, logits, block_cdf, temperature, num_histograms, batch_size
            )
        if not local:
            local.append(_local_tables(logits, temperature))
        return _independent(key, (block_cdf, local[0]), vocab, num_histograms, batch_size)

    return draw


_FIXED_ONE = 2**30  # fixed-point unit of the independent sampler's tables (u < 2^30)
_BLOCK = 256  # tokens per block of the independent sampler's two-level tables
# Fewer histograms than this build the chosen blocks' token tables per vote (n·B work per
# histogram) instead of every block's once (about three passes over the logits).
_TABLE_MIN_HISTOGRAMS = 64


def _fixed_point(weights):
    """Non-negative float32 weights (..., m) -> int32 weights summing to exactly 2^30 per row,
    each round(w / Σw · 2^30) (relative float32 rounding) and the rounding residual (a few
    hundred units at most) on the largest one."""
    total = jnp.sum(weights, axis=-1, keepdims=True)
    scale = _FIXED_ONE / jnp.where(total > 0, total, 1.0)
    fixed = jnp.round(weights * scale).astype(jnp.int32)
    residual = _FIXED_ONE - jnp.sum(fixed, axis=-1, keepdims=True)
    largest = first_argmax(weights)[..., None]
    return fixed + jnp.where(jnp.arange(weights.shape[-1]) == largest, residual, 0)


def _block_cumsum(x):
    """Inclusive cumulative sum over the last axis (a power-of-two size), as cumulative sums of
    its square-root-sized pieces plus their offsets: XLA:CPU lowers `jnp.cumsum` over m entries
    to a reduce-window of width m (m operations per entry), this to about 2·√m."""
    size = x.shape[-1]
    piece = 2 ** (int(np.log2(size)) // 2)
    pieces = jnp.cumsum(x.reshape(*x.shape[:-1], size // piece, piece), axis=-1)
    totals = pieces[..., -1]
    offsets = jnp.cumsum(totals, axis=-1) - totals
    return (pieces + offsets[..., None]).reshape(x.shape)


def _padded_sizes(vocab: int) -> tuple[int, int, int]:
    """(block size B, number of blocks, blocks padded to a power of two)."""
    block = min(_BLOCK, 2 ** int(np.ceil(np.log2(max(vocab, 2)))))
    blocks = -(-vocab // block)
    return block, blocks, 2 ** int(np.ceil(np.log2(max(blocks, 2))))


def _blocks_of(row, temperature):
    """One teacher's scaled logits x = row / t as (blocks, B), padded with -inf."""
    block, blocks, _ = _padded_sizes(row.shape[0])
    x = row.astype(jnp.float32) / temperature
    return jnp.pad(x, (0, blocks * block - row.shape[0]), constant_values=-jnp.inf).reshape(
        blocks, block
    )


def _token_cdf(x_blocks):
    """Inclusive fixed-point cumulative weights of tokens within their blocks: exp(x - the
    block's max) in units of 2^-30 of the block total (`_fixed_point`, exact integer sums). A
    block without a finite logit gets weights 0 (and a table it is never drawn to use)."""
    peak = jnp.max(x_blocks, axis=-1, keepdims=True)
    peak = jnp.where(peak > -jnp.inf, peak, 0.0)
    return _block_cumsum(_fixed_point(jnp.exp(x_blocks - peak)))


# exp(x) of scaled logits x is exact to float32 resolution without a shift when every teacher's
# largest x lies in [-40, 80]: no exponential or block sum overflows, and a token below float32's
# normal range (x < -87.3) has at most e^-47 of its teacher's largest probability.
_UNSHIFTED_RANGE = (-40.0, 80.0)


def _block_tables(logits, temperature):
    """Checks the teachers (`_check_teachers`); returns the block table: per teacher the
    inclusive cumulative sums (n, NB) int32 of the block masses m_b = Σ_{j ∈ b} exp(x_ij)
    (x = logits / t), in units of 2^-30 of their total.

    One pass over the logits (a reduce-window, `_row_votes` says why) when the masses show
    every teacher's largest x in `_UNSHIFTED_RANGE` (max x <= log max_b m_b <= max x + log B:
    max_b m_b in [B·e^-40, e^80] proves it, which a NaN, +inf or all -inf teacher fails);
    otherwise two: the row maxima, then the masses of exp(x - max x), which also check the
    teachers.

    A vote draws a block with probability W_b / 2^30, then a token within it with probability
    w_j / 2^30 (`_token_cdf`), so P(j) = m_b/M · p_j/m_b · (1 + float32 rounding) = p_j / M up
    to float32 resolution and 2^-30 units; the float32 error of the block sums m_b cancels.
    Integer sums are exact, unlike a float32 cumulative sum over V (whose interval widths are
    quantised to ulp(cdf), a total variation of ~1e-3 on flat teachers at V = 50,257).
    """
    scaled = _scale(logits, temperature)  # its own pass: a division stops XLA's fast reduction
    block_cdf, in_range = _unshifted_block_cdf(scaled)
    if not in_range:
        top = _row_max(scaled)
        block_cdf, may_have_nan = _shifted_block_cdf(scaled, top)
        # A NaN logit makes its block's mass NaN (so do +inf and a teacher without a finite one).
        _check_teachers(top, may_have_nan, logits)
    return block_cdf


def _block_masses(x):
    return _block_reduce(jnp.exp(x), _padded_sizes(x.shape[1])[0], reduce=jax.lax.add, init=0.0)


def _cumulative_table(masses, vocab):
    """(n, NB) block masses -> the inclusive fixed-point block table, padded to a power of two
    with blocks ending at 2^30 > every u (never drawn)."""
    _, blocks, padded = _padded_sizes(vocab)
    block_cdf = jnp.cumsum(_fixed_point(masses), axis=-1)
    return jnp.pad(block_cdf, ((0, 0), (0, padded - blocks)), constant_values=_FIXED_ONE)


@jax.jit
def _unshifted_block_cdf(scaled):
    masses = _block_masses(scaled)
    low, high = _UNSHIFTED_RANGE
    largest = jnp.max(masses, axis=1)  # (XLA:CPU's maximum skips NaN: `_nan_in` sees it)
    block = _padded_sizes(scaled.shape[1])[0]
    in_range = jnp.all((largest <= np.exp(high)) & (largest >= block * np.exp(low)))
    return _cumulative_table(masses, scaled.shape[1]), in_range & ~_nan_in(masses)


@jax.jit
def _shifted_block_cdf(scaled, top):
    masses = _block_masses(scaled - top[:, None])
    return _cumulative_table(masses, scaled.shape[1]), _nan_in(masses)


@functools.partial(jax.jit, static_argnums=1)
def _local_tables(logits, temperature):
    """Every block's token table (`_token_cdf`), (n, blocks·B) int32, one teacher at a time."""
    return jax.lax.map(lambda row: _token_cdf(_blocks_of(row, temperature)).reshape(-1), logits)


def _count_at_most(cdf, start, u, width):
    """Per row, #{k < width : cdf[row, start + k] <= u} for sorted rows whose last entry of the
    range exceeds u (binary lifting over a power-of-two width: log2(width) gathers)."""
    rows = jnp.arange(cdf.shape[0])
    count = jnp.zeros_like(u)
    step = width // 2
    while step >= 1:
        count = count + jnp.where(cdf[rows, start + count + step - 1] <= u, step, 0)
        step //= 2
    return count


def _uniforms(key, n):
    """Two uniforms on [0, 2^30) per teacher (block, then token within it)."""
    return (jax.random.bits(key, (2, n), jnp.uint32) >> 2).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _independent(key, tables, vocab, num_histograms, batch_size):
    block_cdf, local_cdf = tables
    n = block_cdf.shape[0]
    block, _, padded = _padded_sizes(vocab)

    def one(k):
        u = _uniforms(k, n)
        chosen = _count_at_most(block_cdf, jnp.zeros(n, jnp.int32), u[0], padded)
        votes = chosen * block + _count_at_most(local_cdf, chosen * block, u[1], block)
        return _bincount(votes, vocab)

    return jax.lax.map(one, jax.random.split(key, num_histograms), batch_size=batch_size)


@functools.partial(jax.jit, static_argnums=(3, 4, 5))
def _independent_lazy(key, logits, block_cdf, temperature, num_histograms, batch_size):
    """`_independent` with each vote's block table built from its block's B logits (the same
    table `_local_tables` holds), for a few histograms."""
    n, vocab = logits.shape
    block, _, padded = _padded_sizes(vocab)
    offsets = jnp.arange(block, dtype=jnp.int32)

    def one(k):
        u = _uniforms(k, n)
        chosen = _count_at_most(block_cdf, jnp.zeros(n, jnp.int32), u[0], padded)
        columns = chosen[:, None] * block + offsets
        x = jnp.take_along_axis(logits, columns, axis=1, mode="fill", fill_value=-jnp.inf)
        cdf = _token_cdf(x.astype(jnp.float32)[:, None] / temperature)[:, 0]
        votes = chosen * block + jnp.sum(cdf <= u[1][:, None], axis=1, dtype=jnp.int32)
        return _bincount(votes, vocab)

    return jax.lax.map(one, jax.random.split(key, num_histograms), batch_size=batch_size)
