"""Vote-histogram samplers: coordinated ("hot", shared Gumbel noise) and independent ("cold").

Both samplers take the teachers' next-token logits `(n, V)` for one decoding step and draw
`num_histograms` vote histograms `(num_histograms, V)` (int32, every row sums to n).

* Coordinated: per histogram one shared Gumbel vector g (float32, V entries); teacher i votes
  `argmax_j(x_ij + g_j)` with x = logits / t. Each vote is marginally distributed as
  softmax(logits_i / t) (Gumbel-max), while teachers with similar distributions tend to agree: two
  teachers with distributions p, q agree with probability Σ_j 1 / Σ_l max(p_l/p_j, q_l/q_j).
* Independent: every teacher draws its own vote by inverse-CDF sampling (one cumulative sum per
  call, one binary search per vote), the fair baseline: `jax.random.categorical` would draw n·V
  noise values per histogram.

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
When |S| is a large part of V the full scan is used directly. No truncation (top-p) is offered:
that would be a different distribution.

Example:
    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))
    >>> h = coordinated_histograms(jax.random.key(0), logits, 4)
    >>> h.shape, bool((h.sum(axis=1) == 2).all()), bool((h[:, 2] == 0).all())
    ((4, 3), True, True)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["coordinated_histograms", "independent_histograms"]

_LEADERS = 8  # largest head-noise values whose exact scores enter the certificate
_DEFAULT_BATCH = 4  # histograms vmapped together in the lazy sampler's main pass
_EXACT_BLOCKS = 10  # blocks (2^E - 1 best-ranked complement tokens) with exact per-teacher c_ib
_RESCAN_TOKENS = 128  # candidate tokens of a pruned rescan (more: scan the whole vocabulary)


def _check_inputs(logits: jax.Array, num_histograms: int, temperature: float) -> None:
    if getattr(logits, "ndim", None) != 2 or logits.shape[0] < 1 or logits.shape[1] < 1:
        shape = getattr(logits, "shape", None)
        raise ValueError(f"logits must have shape (n_teachers, vocab_size), got {shape}.")
    if (
        isinstance(num_histograms, bool)
        or not isinstance(num_histograms, int)
        or num_histograms < 1
    ):
        raise ValueError(f"num_histograms must be an integer >= 1, got {num_histograms!r}.")
    if not isinstance(temperature, int | float) or not temperature > 0:
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}.")


def _check_batch(batch_size: int | None) -> None:
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise ValueError(f"batch_size must be None or an integer >= 1, got {batch_size!r}.")


def _bincount(votes: jax.Array, vocab_size: int) -> jax.Array:
    return jnp.zeros((vocab_size,), jnp.int32).at[votes].add(1)


def _first_argmax(scores: jax.Array) -> jax.Array:
    """`jnp.argmax(scores, -1)` (first maximal index) as two plain reductions (faster on CPU)."""
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
            docstring): same law as the full scan, not the same bits for the same key. It looks
            once at the head size on the host, so call it outside `jax.jit`.
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
    _check_inputs(logits, num_histograms, temperature)
    _check_batch(batch_size)
    vocab = logits.shape[1]
    temperature = float(temperature)
    if top_k is None:
        return _coordinated_full(key, logits, num_histograms, temperature, batch_size)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < vocab:
        raise ValueError(f"top_k must be an integer in [1, vocab_size), got {top_k!r}.")
    if isinstance(fallback_rows, bool) or not isinstance(fallback_rows, int) or fallback_rows < 1:
        raise ValueError(f"fallback_rows must be an integer >= 1, got {fallback_rows!r}.")
    scaled = _scale(logits, temperature)
    values, indices = _top_k(scaled, top_k)
    head_tokens, in_head = _head(values, indices, vocab)
    width = _head_width(int(in_head.sum()), vocab)  # the one host look per call
    if width is None:
        return _coordinated_full(key, logits, num_histograms, temperature, batch_size)
    plan = _plan(scaled, values, head_tokens, in_head, width)
    return _coordinated_lazy(
        key,
        scaled,
        plan,
        num_histograms,
        min(fallback_rows, logits.shape[0]),
        _DEFAULT_BATCH if batch_size is None else batch_size,
    )


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


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _coordinated_full(key, logits, num_histograms, temperature, batch_size):
    scaled = _scale(logits, temperature)
    vocab = scaled.shape[1]

    def one(k):
        return _bincount(_first_argmax(scaled + jax.random.gumbel(k, (vocab,))), vocab)

    return jax.lax.map(one, jax.random.split(key, num_histograms), batch_size=batch_size)


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
    chunk_max = jax.lax.reduce_window(
        scaled,
        -jnp.inf,
        jax.lax.max,
        (1, width),
        (1, width),
        [(0, 0), (0, num_chunks * width - vocab)],
    )
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
        index = _first_argmax(x)
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
    n, vocab = scaled.shape
    keys = jax.random.split(key, num_histograms)
    votes, best, failing = jax.lax.map(
        functools.partial(_certified_votes, plan=plan), keys, batch_size=batch_size
    )
    flagged = jnp.any(failing, axis=1)
    order = jnp.nonzero(flagged, size=num_histograms, fill_value=0)[0]

    def rescan(i, votes):
        h = order[i]
        noise = _full_noise(keys[h], plan)
        # A failing teacher's vote scores at least its best head score, and x_ij <= max_i x_ij:
        # tokens whose column maximum plus noise stays below the smallest such score are no
        # teacher's vote. Usually only a few tokens are left to scan.
        floor = jnp.min(jnp.where(failing[h], best[h], jnp.inf))
        candidates = plan.column_max + noise >= floor
        tokens = jnp.nonzero(candidates, size=_RESCAN_TOKENS, fill_value=vocab)[0]

        def pruned_scan(row_votes):
            x = jnp.take(scaled, tokens, axis=1, mode="fill", fill_value=-jnp.inf)
            scores = x + jnp.take(noise, tokens, mode="fill", fill_value=-jnp.inf)
            return jnp.where(failing[h], tokens[_first_argmax(scores)], row_votes)

        def full_scan(row_votes):
            rows = jnp.nonzero(failing[h], size=n + fallback_rows, fill_value=n)[0]

            def some_rows(j, row_votes):
                some = jax.lax.dynamic_slice(rows, (j * fallback_rows,), (fallback_rows,))
                rescanned = _first_argmax(scaled[jnp.minimum(some, n - 1)] + noise)
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

    The per-teacher cumulative distribution is computed once per call (float32); each vote is
    one binary search. Tokens of probability 0 have an empty CDF interval and never get votes.

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
    _check_inputs(logits, num_histograms, temperature)
    _check_batch(batch_size)
    return _independent(key, logits, num_histograms, float(temperature), batch_size)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _independent(key, logits, num_histograms, temperature, batch_size):
    probs = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    n, vocab = probs.shape
    cdf = jnp.cumsum(probs, axis=-1)
    total = cdf[:, -1]
    # A uniform rounded up to the total must still land on a token of positive probability.
    last_positive = vocab - 1 - jnp.argmax(probs[:, ::-1] > 0, axis=-1)
    search = jax.vmap(functools.partial(jnp.searchsorted, side="right"))

    def one(k):
        u = jax.random.uniform(k, (n,), jnp.float32) * total
        votes = jnp.minimum(search(cdf, u), last_positive)
        return _bincount(votes, vocab)

    return jax.lax.map(one, jax.random.split(key, num_histograms), batch_size=batch_size)
