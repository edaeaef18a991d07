"""Coordinated and independent vote-histogram samplers: distributions, coupling, fast path."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dpmix_jax.pate import samplers

NEG_INF = -np.inf
LAZY = functools.partial(samplers.coordinated_histograms, top_k=3)


def probs_to_logits(p):
    p = np.asarray(p, np.float64)
    with np.errstate(divide="ignore"):
        return jnp.asarray(np.log(p), jnp.float32)


def chi_square_pvalue(observed, probs):
    probs = np.asarray(probs)
    keep = probs > 0
    assert np.all(np.asarray(observed)[~keep] == 0)
    return stats.chisquare(np.asarray(observed)[keep], probs[keep] * np.sum(observed)).pvalue


def p_minhash(p, q):
    """Agreement probability of the shared-Gumbel coupling: Σ_j 1 / Σ_l max(p_l/p_j, q_l/q_j)."""
    total = 0.0
    for j in range(len(p)):
        if p[j] > 0 and q[j] > 0:
            total += 1.0 / sum(max(p[k] / p[j], q[k] / q[j]) for k in range(len(p)))
    return total


@pytest.mark.parametrize(
    "sampler", [samplers.coordinated_histograms, samplers.independent_histograms]
)
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_each_teachers_marginal_is_its_distribution(sampler, temperature):
    p = np.array([0.4, 0.25, 0.2, 0.1, 0.05, 0.0])
    logits = probs_to_logits(p)[None]
    hist = np.asarray(sampler(jax.random.key(0), logits, 20000, temperature=temperature))
    tempered = p ** (1 / temperature) / np.sum(p ** (1 / temperature))
    assert chi_square_pvalue(hist.sum(axis=0), tempered) > 1e-3


@pytest.mark.parametrize(
    "sampler", [samplers.coordinated_histograms, samplers.independent_histograms]
)
def test_expected_counts_are_sums_of_teacher_probabilities(sampler):
    p = np.array([[0.5, 0.3, 0.2, 0.0], [0.2, 0.3, 0.1, 0.4], [0.0, 0.0, 0.5, 0.5]])
    hist = np.asarray(sampler(jax.random.key(1), probs_to_logits(p), 20000))
    assert hist.dtype == np.int32 and hist.shape == (20000, 4)
    assert np.all(hist.sum(axis=1) == 3)
    # Each count is a sum of 3 Bernoullis: standard error of the mean <= sqrt(3 * 0.25 / r).
    np.testing.assert_allclose(hist.mean(axis=0), p.sum(axis=0), atol=4 * np.sqrt(0.75 / 20000))


def test_coordinated_agreement_is_p_minhash_not_weighted_jaccard():
    p = [0.5, 0.3, 0.2, 0.0]
    q = [0.2, 0.3, 0.1, 0.4]
    hist = samplers.coordinated_histograms(jax.random.key(2), probs_to_logits([p, q]), 40000)
    agree = float(np.mean(np.asarray(hist).max(axis=1) == 2))
    exact = p_minhash(p, q)
    jaccard = sum(map(min, p, q)) / sum(map(max, p, q))
    se = np.sqrt(exact * (1 - exact) / 40000)
    assert abs(agree - exact) < 4 * se
    assert abs(agree - jaccard) > 10 * se and exact >= jaccard


def test_independent_agreement_is_product_of_marginals():
    p = [0.5, 0.3, 0.2, 0.0]
    q = [0.2, 0.3, 0.1, 0.4]
    hist = samplers.independent_histograms(jax.random.key(3), probs_to_logits([p, q]), 40000)
    agree = float(np.mean(np.asarray(hist).max(axis=1) == 2))
    exact = float(np.dot(p, q))
    assert abs(agree - exact) < 4 * np.sqrt(exact * (1 - exact) / 40000)


def test_identical_teachers_always_vote_unanimously():
    row = jax.random.normal(jax.random.key(4), (50,)) * 2
    logits = jnp.tile(row, (16, 1))
    hist = np.asarray(samplers.coordinated_histograms(jax.random.key(5), logits, 500))
    assert np.all(hist.max(axis=1) == 16)
    hist = np.asarray(LAZY(jax.random.key(5), jnp.tile(row, (16, 2)), 200))
    assert np.all(hist.max(axis=1) == 16)
    independent = np.asarray(samplers.independent_histograms(jax.random.key(5), logits, 500))
    assert np.mean(independent.max(axis=1) == 16) < 0.1


@pytest.mark.parametrize(
    "sampler", [samplers.coordinated_histograms, LAZY, samplers.independent_histograms]
)
def test_zero_probability_tokens_never_get_votes(sampler):
    logits = jax.random.normal(jax.random.key(6), (8, 64))
    banned = np.zeros((8, 64), bool)
    banned[:, ::3] = True
    banned[:, -1] = True  # the last token too (inverse-CDF edge case)
    banned[0, :] = True
    banned[0, 4] = False  # teacher 0 has a single possible token
    logits = jnp.where(jnp.asarray(banned), NEG_INF, logits)
    hist = np.asarray(sampler(jax.random.key(7), logits, 3000))
    assert np.all(hist[:, banned.all(axis=0)] == 0)
    assert np.all(hist[:, 4] >= 1)
    assert np.all(hist.sum(axis=1) == 8)


def independent_law(logits, temperature=1.0):
    """The exact per-teacher law of the independent sampler, read off its fixed-point tables."""
    n, vocab = logits.shape
    block, blocks, _ = samplers._padded_sizes(vocab)
    block_cdf = samplers._block_tables(logits, temperature)
    local_cdf = samplers._local_tables(logits, temperature)
    block_cdf, local_cdf = (np.asarray(t, np.float64) for t in (block_cdf, local_cdf))
    widths = np.diff(block_cdf[:, :blocks], axis=1, prepend=0.0) / 2**30
    local = np.diff(local_cdf.reshape(n, blocks, block), axis=2, prepend=0.0) / 2**30
    return (widths[:, :, None] * local).reshape(n, -1)[:, :vocab]


def float64_softmax(logits, temperature=1.0):
    x = np.asarray(logits, np.float64) / temperature
    p = np.exp(x - x.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_independent_law_is_exact_to_float32_resolution_on_flat_large_vocabularies(temperature):
    # Flat teachers over V = 50,257: a float32 cumulative sum over V quantises every interval to
    # ulp(cdf) ~ 6e-8 against probabilities ~2e-5 (total variation ~1e-3 off the softmax); the
    # two-level integer tables must be within float32 resolution (TV < 1e-6 per teacher).
    logits = 0.5 * jax.random.normal(jax.random.key(3), (4, 50_257))
    law = independent_law(logits, temperature)
    exact = float64_softmax(logits, temperature)
    assert np.all(np.abs(law.sum(axis=1) - 1) < 1e-12)
    assert np.max(0.5 * np.abs(law - exact).sum(axis=1)) < 1e-6
    # The old float32 cumulative sum, for contrast: off by orders of magnitude more.
    cdf = np.asarray(jnp.cumsum(jax.nn.softmax(logits / temperature, axis=-1), axis=-1))
    widths = np.diff(cdf.astype(np.float64), axis=1, prepend=0.0) / cdf[:, -1:]
    assert np.max(0.5 * np.abs(widths - exact).sum(axis=1)) > 1e-4


@pytest.mark.parametrize(
    ("offset", "unshifted"),
    [(0.0, True), (-30.0, True), (-60.0, False), (-100.0, False), (100.0, False)],
)
def test_independent_law_is_exact_with_and_without_the_shift_by_the_row_maximum(offset, unshifted):
    # Teachers whose block masses show a largest logit in [-40, 80] take exp(x) unshifted;
    # others fall back to exp(x - max x). Both must give the softmax, also for tokens far
    # below float32's normal range of exp (here down to 60 nats under the largest logit).
    logits = jax.random.uniform(jax.random.key(7), (3, 5000), minval=-60.0, maxval=0.0)
    logits = logits.at[:, 17].set(0.0) + offset
    assert bool(samplers._unshifted_block_cdf(logits)[1]) is unshifted
    law = independent_law(logits)
    assert np.max(0.5 * np.abs(law - float64_softmax(logits)).sum(axis=1)) < 1e-6


def test_independent_votes_follow_the_tables_across_blocks_and_zero_tokens():
    # V = 600: three blocks (the last one padded), zero-probability tokens in every block.
    logits = jax.random.normal(jax.random.key(4), (1, 600))
    logits = logits.at[0, ::7].set(NEG_INF).at[0, 256:300].set(NEG_INF)
    law = independent_law(logits)[0]
    assert np.all(law[np.asarray(logits[0]) == NEG_INF] == 0)
    hist = np.asarray(samplers.independent_histograms(jax.random.key(5), logits, 60_000))
    assert chi_square_pvalue(hist.sum(axis=0), law) > 1e-3


@pytest.mark.parametrize(
    ("prepare", "one_shot"),
    [
        (samplers.coordinated_sampler, samplers.coordinated_histograms),
        (functools.partial(samplers.coordinated_sampler, top_k=3), LAZY),
        (samplers.independent_sampler, samplers.independent_histograms),
    ],
)
def test_prepared_sampler_draws_what_the_one_shot_call_draws(prepare, one_shot):
    logits = jax.random.normal(jax.random.key(8), (6, 700))
    draw = prepare(logits, temperature=0.8)
    for seed in (0, 1):
        expected = one_shot(jax.random.key(seed), logits, 5, temperature=0.8)
        np.testing.assert_array_equal(draw(jax.random.key(seed), 5), expected)


def lm_like_logits(key, n, vocab, sharpness=3.0):
    """Zipf-like shared distribution with per-teacher perturbations."""
    base = -1.2 * jnp.log1p(jnp.arange(vocab, dtype=jnp.float32))
    base = base[jax.random.permutation(jax.random.key(11), vocab)]
    return sharpness * base + 0.7 * jax.random.normal(key, (n, vocab))


def lazy_plan(logits, top_k, temperature=1.0):
    scaled = samplers._scale(logits, temperature)
    values, indices = samplers._top_k(scaled, top_k)
    head_tokens, in_head = samplers._head(values, indices, logits.shape[1])
    width = samplers._head_width(int(in_head.sum()), logits.shape[1])
    assert width is not None, "the lazy sampler would fall back to the full scan"
    return scaled, samplers._plan(scaled, values, head_tokens, in_head, width)


def certified_fraction(logits, top_k, num_keys=300):
    _, plan = lazy_plan(logits, top_k)
    keys = jax.random.split(jax.random.key(99), num_keys)
    *_, failing = jax.vmap(lambda k: samplers._certified_votes(k, plan))(keys)
    return float(np.mean(~np.asarray(failing).any(axis=1)))


def test_top_k_matches_jax_lax_top_k():
    x = jnp.round(lm_like_logits(jax.random.key(20), 6, 1000, sharpness=1.0))  # many ties
    x = x.at[:, 500:].set(NEG_INF)
    values, indices = samplers._top_k(x, 40)
    ref_values, _ = jax.lax.top_k(x, 41)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(ref_values))
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(x), indices, 1), values)
    assert all(len(set(row)) == 41 for row in np.asarray(indices).tolist())


@pytest.mark.parametrize("make_logits,top_k", [
    (lambda k: lm_like_logits(k, 24, 500, sharpness=1.5), 8),  # some teachers fail
    (lambda k: 1.5 * jax.random.normal(k, (24, 500)), 4),  # most fail
    (lambda k: jnp.where(jax.random.uniform(k, (24, 500)) < 0.6, NEG_INF,  # -inf, |T_i| < K
                         lm_like_logits(k, 24, 500, sharpness=1.0)).at[:, 0].set(0.0), 8),
])  # fmt: skip
def test_certified_votes_are_argmaxes_of_the_completed_noise(make_logits, top_k):
    scaled, plan = lazy_plan(make_logits(jax.random.key(21)), top_k)
    keys = jax.random.split(jax.random.key(22), 200)
    votes, _, failing = jax.vmap(lambda k: samplers._certified_votes(k, plan))(keys)
    noise = jax.vmap(lambda k: samplers._full_noise(k, plan))(keys)
    exact = np.asarray(jnp.argmax(scaled[None] + noise[:, None, :], axis=-1))
    failing = np.asarray(failing)
    assert 0 < failing.mean() < 1
    np.testing.assert_array_equal(np.asarray(votes)[~failing], exact[~failing])


@pytest.mark.parametrize("make_logits,top_k,pruned", [
    (lambda k: lm_like_logits(k, 64, 2000, sharpness=1.5), 8, True),
    (lambda k: lm_like_logits(k, 16, 600, sharpness=0.6), 4, False),  # flat: whole-row rescans
])  # fmt: skip
def test_lazy_votes_are_the_argmaxes_of_the_completed_noise(make_logits, top_k, pruned):
    # Certified votes and rescanned ones alike: every histogram is exactly the full scan's
    # histogram on the completed noise vector of its key.
    logits = make_logits(jax.random.key(40))
    scaled, plan = lazy_plan(logits, top_k)
    key, r = jax.random.key(41), 64
    hist = samplers._coordinated_lazy(key, scaled, plan, r, 4, 4)
    keys = jax.random.split(key, r)
    _, best, failing = jax.vmap(lambda k: samplers._certified_votes(k, plan))(keys)
    noise = jax.vmap(lambda k: samplers._full_noise(k, plan))(keys)
    votes = jnp.argmax(scaled[None] + noise[:, None, :], axis=-1)
    expected = jax.vmap(lambda v: jnp.bincount(v, length=logits.shape[1]))(votes)
    np.testing.assert_array_equal(np.asarray(hist), np.asarray(expected))
    # Which rescan ran: the pruned one (few candidate tokens) or the whole-row one.
    floor = jnp.min(jnp.where(failing, best, jnp.inf), axis=1, keepdims=True)
    candidates = jnp.sum(plan.column_max + noise >= floor, axis=1)[jnp.any(failing, axis=1)]
    assert candidates.size > 0
    if pruned:
        assert bool(jnp.all(candidates <= samplers._RESCAN_TOKENS))
    else:
        assert bool(jnp.any(candidates > samplers._RESCAN_TOKENS))


def test_completed_noise_is_iid_gumbel_and_consistent_with_the_drawn_part():
    logits = lm_like_logits(jax.random.key(23), 8, 300, sharpness=1.5)
    _, plan = lazy_plan(logits, 4)
    keys = jax.random.split(jax.random.key(24), 2000)
    noise = np.asarray(jax.vmap(lambda k: samplers._full_noise(k, plan))(keys))
    head_noise, block_max = jax.vmap(lambda k: samplers._sparse_noise(k, plan))(keys)
    head = np.asarray(plan.head)
    real = head < 300
    np.testing.assert_array_equal(noise[:, head[real]], np.asarray(head_noise)[:, real])
    block_of = np.asarray(plan.block_of)
    for b in range(plan.log_sizes.shape[0]):
        if np.any(block_of == b):
            np.testing.assert_array_equal(noise[:, block_of == b].max(1), block_max[:, b])
    # Every coordinate is Gumbel(0, 1) (head, small and large blocks), and coordinates are
    # uncorrelated (the completion must not leave the block maxima in fixed positions).
    gumbel = stats.gumbel_r()
    tokens = [head[0], *(np.flatnonzero(block_of == b)[0] for b in (0, 3, 6, 8))]
    for j in tokens:
        assert stats.kstest(noise[:, j], gumbel.cdf).pvalue > 1e-3
    same_block = np.flatnonzero(block_of == 6)[:2]
    assert abs(np.corrcoef(noise[:, same_block].T)[0, 1]) < 4 / np.sqrt(2000)
    assert stats.kstest(noise.max(1) - np.log(300), gumbel.cdf).pvalue > 1e-3


def test_tokens_no_teacher_can_vote_for_rank_before_the_head():
    # Columns that are -inf for every teacher must still rank before S, or a block's maximum
    # could be placed on a head token and overwrite its drawn noise.
    logits = lm_like_logits(jax.random.key(42), 6, 80, sharpness=1.0)
    logits = logits.at[:, 40:].set(NEG_INF)
    _, plan = lazy_plan(logits, 3)
    head = np.asarray(plan.head)
    head = head[head < 80]
    size = int(plan.block_start[-1])
    assert size == 80 - len(head)
    assert not np.isin(np.asarray(plan.ranked)[:size], head).any()
    keys = jax.random.split(jax.random.key(43), 200)
    noise = jax.vmap(lambda k: samplers._full_noise(k, plan))(keys)
    head_noise, _ = jax.vmap(lambda k: samplers._sparse_noise(k, plan))(keys)
    np.testing.assert_array_equal(noise[:, head], head_noise[:, : len(head)])


def grouped_joint(hist_votes, tokens):
    """Joint outcome ids of the teachers' votes, votes outside `tokens` merged into one value."""
    codes = np.searchsorted(tokens, hist_votes)
    codes = np.where(np.isin(hist_votes, tokens), codes, len(tokens))
    return np.ravel_multi_index(codes.T, (len(tokens) + 1,) * hist_votes.shape[1])


def votes_of(hist):
    """Per histogram, the sorted multiset of votes (teacher identities are not in histograms)."""
    hist = np.asarray(hist)
    return np.stack([np.repeat(np.arange(hist.shape[1]), row) for row in hist])


@pytest.mark.parametrize("make_logits,top_k,temperature", [
    (lambda k: lm_like_logits(k, 3, 64, sharpness=1.2), 2, 1.0),
    (lambda k: 2.0 * jax.random.normal(k, (3, 64)), 2, 0.7),  # diffuse: most histograms fall back
    (lambda k: jnp.where(jax.random.uniform(k, (3, 64)) < 0.5, NEG_INF,
                         lm_like_logits(k, 3, 64, sharpness=1.0)).at[:, 7].set(1.0), 3, 1.0),
])  # fmt: skip
def test_lazy_sampler_has_the_full_scans_joint_law(make_logits, top_k, temperature):
    logits = make_logits(jax.random.key(25))
    assert 0.02 < certified_fraction(logits / temperature, top_k) < 0.98  # both paths run
    r = 8000
    full = votes_of(
        samplers.coordinated_histograms(jax.random.key(26), logits, r, temperature=temperature)
    )
    lazy = votes_of(
        samplers.coordinated_histograms(
            jax.random.key(27), logits, r, temperature=temperature, top_k=top_k
        )
    )
    tokens = np.argsort(-np.bincount(full.ravel(), minlength=64))[:4]
    tokens = np.sort(tokens)
    table = np.stack([np.bincount(grouped_joint(v, tokens), minlength=125) for v in (full, lazy)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 1e-3


def test_lazy_agreement_is_p_minhash_with_a_long_tail():
    base = np.exp(lm_like_logits(jax.random.key(28), 2, 200, sharpness=1.0))
    p, q = (row / row.sum() for row in np.asarray(base, np.float64))
    logits = probs_to_logits(np.stack([p, q]))
    assert certified_fraction(logits, 4) < 0.9
    hist = samplers.coordinated_histograms(jax.random.key(29), logits, 20000, top_k=4)
    agree = float(np.mean(np.asarray(hist).max(axis=1) == 2))
    exact = p_minhash(p, q)
    assert abs(agree - exact) < 4 * np.sqrt(exact * (1 - exact) / 20000)
    top = np.argsort(-(p + q))[:10]
    counts = np.asarray(hist).sum(axis=0)
    grouped = np.append(counts[top], counts.sum() - counts[top].sum())
    assert chi_square_pvalue(grouped, np.append((p + q)[top], 2 - (p + q)[top].sum()) / 2) > 1e-3


def test_lazy_sampler_on_lm_like_teachers_matches_full_scan_statistics():
    logits = lm_like_logits(jax.random.key(30), 48, 3000, sharpness=1.5)
    r = 800
    full = np.asarray(samplers.coordinated_histograms(jax.random.key(31), logits, r))
    lazy = np.asarray(samplers.coordinated_histograms(jax.random.key(32), logits, r, top_k=16))
    assert np.all(lazy.sum(axis=1) == 48) and lazy.dtype == np.int32
    expected = np.asarray(jax.nn.softmax(logits, axis=-1)).sum(axis=0)
    top = np.argsort(-expected)[:10]
    # Counts of the top tokens: mean matches Σ_i p_ij (each count has variance <= 48²/4).
    se = np.sqrt(lazy[:, top].var(axis=0) / r) + 1e-9
    assert np.all(np.abs(lazy[:, top].mean(axis=0) - expected[top]) < 5 * se)
    # Coordination (largest count per histogram) has the full scan's distribution.
    assert stats.ks_2samp(full.max(axis=1), lazy.max(axis=1)).pvalue > 1e-3


def test_lazy_sampler_uses_the_full_scan_when_the_head_is_most_of_the_vocabulary():
    logits = 2.0 * jax.random.normal(jax.random.key(33), (16, 200))
    key = jax.random.key(34)
    full = samplers.coordinated_histograms(key, logits, 20)
    lazy = samplers.coordinated_histograms(key, logits, 20, top_k=16)
    np.testing.assert_array_equal(np.asarray(full), np.asarray(lazy))


def test_full_scan_matches_argmax_of_shared_gumbel():
    logits = jnp.round(lm_like_logits(jax.random.key(35), 5, 40))  # ties in the logits
    key = jax.random.key(36)
    hist = samplers.coordinated_histograms(key, logits, 8, temperature=0.5)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (40,)))(jax.random.split(key, 8))
    votes = jnp.argmax(logits[None] / 0.5 + noise[:, None, :], axis=-1)
    expected = jax.vmap(lambda v: jnp.bincount(v, length=40))(votes)
    np.testing.assert_array_equal(np.asarray(hist), np.asarray(expected))


@pytest.mark.parametrize("vocab", [2048, 5000])  # whole 128-token chunks; and a tail of 8
def test_long_row_votes_are_first_argmaxes(vocab):
    # Ties planted within a chunk, across chunks, between a chunk and the tail, the maximum in
    # the tail alone, and a row that is -inf but for one token.
    noise = jnp.zeros(vocab)
    rows = np.array(jax.random.normal(jax.random.key(0), (7, vocab)))
    rows[0, [300, 301]] = 9.0
    rows[1, [5, 4000 % vocab]] = 9.0
    rows[2, [130, vocab - 3]] = 9.0
    rows[3, vocab - 2] = 9.0
    rows[4] = -np.inf
    rows[4, 1000] = 0.0
    rows[5, [vocab - 1, vocab - 4]] = 9.0
    votes, best = jax.jit(samplers._row_votes)(jnp.asarray(rows), noise)
    scores = rows + np.asarray(noise)
    np.testing.assert_array_equal(np.asarray(votes), np.argmax(scores, axis=1))
    np.testing.assert_array_equal(np.asarray(best), scores.max(axis=1))
    gumbel = jax.random.gumbel(jax.random.key(1), (vocab,))
    votes, best = jax.jit(samplers._row_votes)(jnp.asarray(rows), gumbel)
    np.testing.assert_array_equal(np.asarray(votes), np.argmax(rows + np.asarray(gumbel), 1))


def test_batch_size_does_not_change_histograms():
    logits = lm_like_logits(jax.random.key(10), 8, 200, sharpness=1.5)
    key = jax.random.key(12)
    coordinated_top_k = functools.partial(samplers.coordinated_histograms, top_k=8)
    for sampler in (
        samplers.coordinated_histograms,
        coordinated_top_k,
        samplers.independent_histograms,
    ):
        a = sampler(key, logits, 12, batch_size=1)
        b = sampler(key, logits, 12, batch_size=5)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_fresh_noise_per_histogram():
    logits = jnp.zeros((4, 1000))
    hist = np.asarray(samplers.coordinated_histograms(jax.random.key(13), logits, 50))
    winners = hist.argmax(axis=1)
    assert len(set(winners.tolist())) > 40
    assert all(a != b for a, b in itertools.pairwise(winners.tolist()))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"logits": jnp.zeros((3,)), "num_histograms": 2}, "shape"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 0}, "num_histograms"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 2, "temperature": 0.0}, "temperature"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 2, "top_k": 4}, "top_k"),
        ({"logits": jnp.zeros((3, 4)), "num_histograms": 2, "batch_size": 0}, "batch_size"),
    ],
)
def test_bad_inputs_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        samplers.coordinated_histograms(jax.random.key(0), **kwargs)


# ------------------------------------------------------------------------------------------
# Large heads: the noise-leader certificate.
# ------------------------------------------------------------------------------------------


def leader_plan(logits, top_k):
    values, indices = samplers._top_k(logits, top_k)
    head_tokens, _ = samplers._head(values, indices, logits.shape[1])
    return samplers._leader_plan(logits, values, head_tokens)


@pytest.mark.parametrize("vocab", [640, 1000])  # whole blocks, and a last block of 8 tokens
def test_noise_leaders_are_the_tokens_above_the_threshold(vocab):
    capacity, threshold = samplers._leader_sizes(vocab)
    keys = jax.random.split(jax.random.key(41), 200)
    noise = np.asarray(jax.vmap(lambda k: samplers._shared_noise(k, vocab))(keys))
    # A threshold that keeps the count below the capacity, and one that overflows it.
    for theta in (threshold, float(np.quantile(noise, 0.6))):
        tokens, rest, overflow = jax.vmap(
            lambda g, t=theta: samplers._noise_leaders(g, t, capacity)
        )(jnp.asarray(noise))
        rows = zip(noise, np.asarray(tokens), np.asarray(rest), np.asarray(overflow), strict=True)
        for g, got, got_rest, got_overflow in rows:
            above = np.flatnonzero(g > theta)
            assert bool(got_overflow) == (above.size > capacity)
            if above.size <= capacity:
                expected = np.full(capacity, vocab)
                expected[: above.size] = above
                np.testing.assert_array_equal(got, expected)
                assert float(got_rest) == g[g <= theta].max()


@pytest.mark.parametrize("vocab", [640, 1000])
def test_leader_certified_votes_are_argmaxes_of_the_full_scans_noise(vocab):
    # Spread-out teachers and K = 2, so that some votes are not certified; teacher 0 has one
    # finite logit (its head holds a -inf candidate).
    logits = 3.0 * jax.random.normal(jax.random.key(42), (12, vocab))
    logits = logits.at[0].set(NEG_INF).at[0, 5].set(0.0)
    plan = leader_plan(logits, 2)
    capacity, threshold = samplers._leader_sizes(vocab)
    keys = jax.random.split(jax.random.key(43), 2000)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, (vocab,)))(keys)
    np.testing.assert_array_equal(
        np.asarray(jax.vmap(lambda k: samplers._shared_noise(k, vocab))(keys)), np.asarray(noise)
    )
    votes, _, failing = jax.vmap(
        lambda k: samplers._leader_certified_votes(k, plan, threshold, capacity)
    )(keys)
    argmax = np.argmax(np.asarray(logits)[None] + np.asarray(noise)[:, None, :], axis=-1)
    certified = ~np.asarray(failing)
    assert 0.5 < certified.mean() < 0.99  # votes certified and votes left to the rescan
    np.testing.assert_array_equal(np.asarray(votes)[certified], argmax[certified])
    assert certified[:, 0].all()  # a teacher with one finite logit is always certified


def test_leader_votes_break_ties_towards_the_smallest_token():
    # Teachers 0 and 1 tie between a head token and a leader; teacher 2 between two leaders.
    vocab = 256
    noise = np.asarray(samplers._shared_noise(jax.random.key(46), vocab))
    capacity, threshold = samplers._leader_sizes(vocab)
    leaders = np.flatnonzero(noise > threshold)
    low, high = int(leaders[0]), int(leaders[1])
    logits = np.full((3, vocab), -50.0, np.float32)
    logits[:, 7 if low != 7 else 8] = 0.0  # the head's only finite-scoring token (K = 1)
    for i, (a, b) in enumerate([(low, high), (high, low), (low, high)]):
        logits[i, a] = 40.0
        logits[i, b] = np.float32(40.0 + noise[a]) - noise[b]
    plan = leader_plan(jnp.asarray(logits), 1)
    votes, best, failing = samplers._leader_certified_votes(
        jax.random.key(46), plan, threshold, capacity
    )
    scores = logits + noise
    np.testing.assert_array_equal(np.asarray(votes), np.argmax(scores, axis=1))
    assert not np.asarray(failing).any()


@pytest.mark.parametrize("scale", [2.0, 3.0, 6.0])
def test_leader_sampler_gives_the_full_scans_histograms(scale):
    # 64 diverse teachers over V = 700 with K = 6: their heads cover most of the vocabulary, so
    # the noise-leader certificate runs; its histograms are the full scan's for the same key,
    # rescans (of pruned candidates or whole rows) included.
    logits = scale * jax.random.normal(jax.random.key(44), (64, 700))
    key, r = jax.random.key(45), 300
    full = samplers.coordinated_histograms(key, logits, r)
    leaders = samplers.coordinated_sampler(logits, top_k=6, fallback_rows=3)(key, r)
    np.testing.assert_array_equal(np.asarray(leaders), np.asarray(full))
    capacity, threshold = samplers._leader_sizes(700)
    _, _, failing = jax.vmap(
        lambda k: samplers._leader_certified_votes(k, leader_plan(logits, 6), threshold, capacity)
    )(jax.random.split(key, r))
    assert 0 < float(np.mean(np.asarray(failing))) < 0.01


def test_flat_teachers_sharing_a_ranking_take_the_noise_leaders():
    # Flat teachers over one shared ranking have a small head S (their top tokens coincide) but
    # little mass on it, where the blocks' certificate fails in most histograms; the sampler
    # takes the noise-leader certificate instead, whose histograms are the full scan's.
    vocab, n = 4096, 48
    rank = 1 + jax.random.permutation(jax.random.key(50), vocab).astype(jnp.float32)
    logits = 0.35 * (-1.1 * jnp.log(rank) + 0.5 * jax.random.normal(jax.random.key(51), (n, vocab)))
    values, indices = samplers._top_k(logits, 8)
    _, in_head = samplers._head(values, indices, vocab)
    assert samplers._head_width(int(in_head.sum()), vocab) is not None  # a small head
    assert float(samplers._head_mass(logits, values)) < samplers._MIN_HEAD_MASS
    key, r = jax.random.key(52), 64
    full = samplers.coordinated_histograms(key, logits, r)
    lazy = samplers.coordinated_sampler(logits, top_k=8)(key, r)
    np.testing.assert_array_equal(np.asarray(lazy), np.asarray(full))  # bit for bit: leaders
    peaked = lm_like_logits(jax.random.key(53), n, vocab)
    values, _ = samplers._top_k(peaked, 8)
    assert float(samplers._head_mass(peaked, values)) > samplers._MIN_HEAD_MASS
