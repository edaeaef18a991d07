"""Vote-histogram samplers: coordinated ("hot", shared Gumbel noise) and independent ("cold").

Both samplers take the teachers' next-token logits `(n, V)` for one decoding step and draw
`num_histograms` vote histograms `(num_histograms, V)` (int32, every row sums to n).

* Coordinated: per histogram one shared Gumbel vector g (float32, V entries); teacher i votes
  `argmax_j(logits_ij / t + g_j)`. Each vote is marginally distributed as softmax(logits_i / t)
  (Gumbel-max), while teachers with similar distributions tend to agree: two teachers with
  distributions p, q agree with probability Σ_j 1 / Σ_l max(p_l/p_j, q_l/q_j).
* Independent: every teacher draws its own vote by inverse-CDF sampling (one cumulative sum per
  call, one binary search per vote), the fair baseline: `jax.random.categorical` would draw n·V
  noise values per histogram.

The coordinated sampler has an exact top-K fast path (`top_k=K`): each teacher's K best tokens are
found once per call; per histogram the winner among them is exact, and it is the overall winner
when its score beats a bound on every outside token's score: the exact scores of the M tokens with
the largest shared noise (outside the teacher's top K), and `logits_(K+1) / t` plus the (M+1)-th
largest noise value for the rest (the exponential-clock bound). Teachers failing the certificate
are re-scanned in full, so the result is bit-for-bit the full scan's for the same key. No
truncation (top-p) is offered: that would be a different distribution.

Memory stays at O(batch_size·n·V) whatever `num_histograms` is (`lax.map` over histograms).

Example:
    >>> import jax, jax.numpy as jnp
    >>> logits = jnp.log(jnp.array([[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]))
    >>> h = coordinated_histograms(jax.random.key(0), logits, 4)
    >>> h.shape, bool((h.sum(axis=1) == 2).all()), bool((h[:, 2] == 0).all())
    ((4, 3), True, True)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["coordinated_histograms", "independent_histograms"]


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
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"batch_size must be None or an integer >= 1, got {batch_size!r}.")


def _bincount(votes: jax.Array, vocab_size: int) -> jax.Array:
    return jnp.zeros((vocab_size,), jnp.int32).at[votes].add(1)


def coordinated_histograms(
    key: jax.Array,
    logits: jax.Array,
    num_histograms: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    fallback_rows: int = 8,
    batch_size: int | None = None,
) -> jax.Array:
    """Coordinated (shared-randomness) vote histograms.

    Args:
        key: PRNG key; histogram h uses the shared Gumbel vector drawn from `split(key, r)[h]`.
        logits: `(n, V)` teacher logits (`-inf` = probability 0; each row needs a finite entry).
        num_histograms: r, the number of histograms (fresh shared noise for each).
        temperature: t > 0; votes are drawn from softmax(logits / t).
        top_k: if set, the exact top-K fast path (same output as the full scan, K < V). It runs
            as a few jitted passes with a host-side look at how many teachers failed the
            certificate, so call it outside `jax.jit`.
        fallback_rows: with `top_k`, a histogram with at most this many uncertified teachers
            re-scans just those rows; one with more is re-scanned in full (speed only).
        batch_size: histograms processed together inside `lax.map` (memory vs speed).

    Returns:
        `(r, V)` int32 vote counts; each row sums to n.

    Privacy:
        Reads the teachers' logits, which depend on sensitive data. Conditioned on the (public,
        data-independent) shared noise, one teacher's data changes one vote, so the histogram
        has L1 sensitivity 2; release it only through a DP aggregator.
    """
    _check_inputs(logits, num_histograms, temperature)
    _check_batch(batch_size)
    vocab = logits.shape[1]
    temperature = float(temperature)
    if top_k is None:
        return _coordinated_full(key, logits, num_histograms, temperature, batch_size)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k < vocab:
        raise ValueError(f"top_k must be an integer in [1, vocab_size), got {top_k!r}.")
    if not isinstance(fallback_rows, int) or fallback_rows < 1:
        raise ValueError(f"fallback_rows must be an integer >= 1, got {fallback_rows!r}.")
    fallback_rows = min(fallback_rows, logits.shape[0])
    keys = jax.random.split(key, num_histograms)
    scaled = _scale(logits, temperature)
    candidates = _top_k_candidates(scaled, top_k)
    votes, failing = _top_k_votes(keys, scaled, *candidates, batch_size)
    num_failing = np.asarray(failing.sum(axis=1))
    partial = np.flatnonzero((num_failing > 0) & (num_failing <= fallback_rows))
    full = np.flatnonzero(num_failing > fallback_rows)
    for chunk in _chunks(partial):
        votes = _rescan_rows(votes, failing, keys, scaled, chunk, fallback_rows)
    for chunk in _chunks(full):
        votes = _rescan_full(votes, keys, scaled, chunk)
    return _histograms(votes, vocab)


_CHUNK = 16  # histograms re-scanned per jitted call (one compilation per shape)


def _chunks(indices: np.ndarray):
    """Fixed-size index chunks, the last padded by repeating an index (re-scans are idempotent)."""
    for start in range(0, len(indices), _CHUNK):
        chunk = indices[start : start + _CHUNK]
        yield jnp.asarray(np.pad(chunk, (0, _CHUNK - len(chunk)), mode="edge"))


@functools.partial(jax.jit, static_argnums=1)
def _scale(logits, temperature):
    return logits.astype(jnp.float32) / temperature


def _gumbel(key, vocab):
    return jax.random.gumbel(key, (vocab,), jnp.float32)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _coordinated_full(key, logits, num_histograms, temperature, batch_size):
    scaled = _scale(logits, temperature)
    vocab = scaled.shape[1]

    def one(k):
        return _bincount(jnp.argmax(scaled + _gumbel(k, vocab), axis=-1), vocab)

    return jax.lax.map(one, jax.random.split(key, num_histograms), batch_size=batch_size)


_NOISE_LEADERS = 8  # the largest shared-noise values checked token by token in the certificate


@functools.partial(jax.jit, static_argnums=1)
def _top_k_candidates(scaled, top_k):
    """Each teacher's K best tokens, and the largest scaled logit outside them (once per call)."""
    values, indices = jax.lax.top_k(scaled, top_k + 1)
    return values[:, :top_k], indices[:, :top_k], values[:, top_k]


@functools.partial(jax.jit, static_argnums=5)
def _top_k_votes(keys, scaled, cand_values, cand_indices, outside_bound, batch_size):
    """Per histogram: each teacher's winner among its top K, and whether it is certified.

    Certificate: every token outside teacher i's top K scores at most
    max(scaled_i(j) + g_j over the M largest-noise tokens j not in its top K,
        outside_bound_i + the (M+1)-th largest noise value).
    The (n, V) logits are not used inside the map (on XLA:CPU a large loop operand, or control
    flow, made each histogram cost as much as a full scan); leader scores are gathered after it.
    """
    vocab = scaled.shape[1]

    def one(k):
        g = _gumbel(k, vocab)
        scores = cand_values + jnp.take(g, cand_indices, mode="clip")  # indices are in range
        best = jnp.max(scores, axis=-1)
        # Ties go to the smallest token id, as jnp.argmax does in the full scan.
        winner = jnp.min(jnp.where(scores == best[:, None], cand_indices, vocab), axis=-1)
        noise, leaders = jax.lax.top_k(g, _NOISE_LEADERS + 1)
        return winner, best, noise, leaders

    winner, best, noise, leaders = jax.lax.map(one, keys, batch_size=batch_size)

    def certify(best, noise, leaders):
        leader_scores = jnp.take(scaled, leaders[:-1], axis=1) + noise[:-1]  # (n, M)
        inside = jnp.any(leaders[None, :-1, None] == cand_indices[:, None, :], axis=-1)
        leader_bound = jnp.max(jnp.where(inside, -jnp.inf, leader_scores), axis=-1)
        # Rounded addition is monotone, so no other token's rounded score can reach the bound.
        return ~(best > jnp.maximum(leader_bound, outside_bound + noise[-1]))

    return winner, jax.vmap(certify)(best, noise, leaders)


@functools.partial(jax.jit, static_argnums=5, donate_argnums=0)
def _rescan_rows(votes, failing, keys, scaled, chunk, fallback_rows):
    n, vocab = scaled.shape

    def one(h):
        rows = jnp.nonzero(failing[h], size=fallback_rows, fill_value=n)[0]
        g = _gumbel(keys[h], vocab)
        return rows, jnp.argmax(scaled[jnp.minimum(rows, n - 1)] + g, axis=-1)

    rows, rescanned = jax.lax.map(one, chunk)
    return votes.at[chunk[:, None], rows].set(rescanned, mode="drop")


@functools.partial(jax.jit, donate_argnums=0)
def _rescan_full(votes, keys, scaled, chunk):
    vocab = scaled.shape[1]
    rescanned = jax.lax.map(lambda h: jnp.argmax(scaled + _gumbel(keys[h], vocab), -1), chunk)
    return votes.at[chunk].set(rescanned)


@functools.partial(jax.jit, static_argnums=1)
def _histograms(votes, vocab):
    return jax.vmap(lambda v: _bincount(v, vocab))(votes)


def independent_histograms(
    key: jax.Array,
    logits: jax.Array,
    num_histograms: int,
    *,
    temperature: float = 1.0,
    batch_size: int | None = 64,
) -> jax.Array:
    """Independent vote histograms by inverse-CDF sampling (the cold-PATE baseline).

    The per-teacher cumulative distribution is computed once per call (float32); each vote is
    one binary search. Tokens of probability 0 have an empty CDF interval and never get votes.

    Args:
        key: PRNG key.
        logits: `(n, V)` teacher logits (`-inf` = probability 0; each row needs a finite entry).
        num_histograms: r, the number of histograms.
        temperature: t > 0; votes are drawn from softmax(logits / t).
        batch_size: histograms processed together inside `lax.map`.

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
