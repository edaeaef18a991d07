"""Individual accounting with a Rényi filter (`pate.individual`): the budget against
dp-accounting, the filter, the vectorised step against a per-teacher loop, the noise scale, the
guarantee, and the filter theorem checked by numerical integration on a tiny case."""

from __future__ import annotations

import dataclasses

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import special, stats

from dpmix_jax.pate import individual


def _config(**overrides):
    settings_ = dict(sigma=2.0, threshold=5.0, epsilon=8.0, delta=1e-6)
    return individual.IndividualConfig(**{**settings_, **overrides})


def _rdp(sigma, count, delta):
    """dp-accounting's RDP ε of `count` Gaussian(σ) compositions, built here."""
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), count)
    )
    return accountant.get_epsilon(delta)


# --------------------------------------------------------------------------------------------
# The budget and the guarantee.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sigma, epsilon, delta",
    [(2.0, 8.0, 1e-6), (6.0, 8.0, 1e-6), (2.5, 3.0, 1e-5), (20.0, 1.0, 1e-8)],
)
def test_budget_is_the_last_count_within_the_target(sigma, epsilon, delta):
    budget = individual.budget_per_teacher(sigma, epsilon, delta)
    assert budget >= 1
    assert _rdp(sigma, budget, delta) <= epsilon < _rdp(sigma, budget + 1, delta)


def test_budget_is_zero_when_one_charge_exceeds_the_target():
    assert _rdp(0.3, 1, 1e-6) > 1.0
    assert individual.budget_per_teacher(0.3, 1.0, 1e-6) == 0


def test_the_reported_guarantee_is_dp_accountings_rdp_of_the_budget():
    config = _config(sigma=6.0)
    ledger = individual.IndividualLedger.start(config, 4)
    expected = _rdp(6.0, config.budget, 1e-6)
    assert config.guaranteed_epsilon == pytest.approx(expected, rel=1e-12)
    assert ledger.guarantee() == (pytest.approx(expected, rel=1e-12), 1e-6)
    assert ledger.epsilon <= 8.0
    # From M, not from the realised charges: a run that charged nobody has the same guarantee.
    ledger.record(np.zeros(4, int), steps=10)
    assert ledger.summary()["epsilon"] == pytest.approx(expected, rel=1e-12)
    assert individual.rdp_epsilon(6.0, 0, 1e-6) == 0.0


def test_sigma_for_steps_is_the_noise_that_runs_that_many_steps():
    for steps in (10, 1000):
        sigma = individual.sigma_for_steps(steps, 8.0, 1e-6)
        assert individual.budget_per_teacher(sigma, 8.0, 1e-6) >= steps
        assert individual.budget_per_teacher(sigma / 1.002, 8.0, 1e-6) < steps


def test_threshold_bounds_a_zero_count_token_passing():
    sigma, vocab, eta = 3.0, 1000, 1e-3
    threshold = individual.threshold_for(sigma, vocab, eta)
    assert threshold == pytest.approx(sigma * np.sqrt(2 * np.log(vocab / eta)))
    assert vocab * stats.norm.sf(threshold / sigma) <= eta / 2


@pytest.mark.parametrize(
    "field, value",
    [
        ("sigma", 0.0),
        ("sigma", float("nan")),
        ("threshold", -1.0),
        ("epsilon", 0.0),
        ("delta", 1.0),
        ("temperature", 0.0),
        ("sigma", 0.3),  # so little noise that not one charge fits in (8, 1e-6)
    ],
)
def test_bad_settings_are_refused_with_one_line_naming_the_field(field, value):
    with pytest.raises(ValueError) as error:
        _config(**{field: value})
    message = str(error.value)
    assert field in message and "\n" not in message


def test_the_ledger_refuses_charges_the_filter_would_not_allow():
    config = _config()
    ledger = individual.IndividualLedger.start(config, 3)
    ledger.record([1, 0, 1])
    with pytest.raises(ValueError, match="grow"):
        ledger.record([0, 0, 1])
    with pytest.raises(ValueError, match="grow"):
        ledger.record([3, 0, 1])
    with pytest.raises(ValueError, match="bypassed"):
        ledger.record([config.budget + 1] * 3, steps=config.budget + 1)
    ledger.record([2, 2, 1], steps=2)
    assert (ledger.max_charge, ledger.mean_charge, ledger.steps) == (2, 5 / 3, 3)


# --------------------------------------------------------------------------------------------
# The filter.
# --------------------------------------------------------------------------------------------


def test_a_dissenting_teacher_is_charged_exactly_m_times_and_then_contributes_nothing():
    config = _config()  # M = 8
    budget, steps, vocab = config.budget, 40, 6
    public = 2.0 * jax.random.normal(jax.random.key(0), (steps, vocab))
    public = public.at[:, -1].set(-100.0)  # the public model never votes for the last token
    dissent = jnp.full((steps, vocab), -100.0).at[:, -1].set(100.0)  # always the last token
    teachers = jnp.stack([dissent, public], axis=1)  # teacher 1 is the public model itself
    tokens, charges, info = individual.run_stream(jax.random.key(1), teachers, public, config)
    charged = np.asarray(info.charged)
    assert np.asarray(charges).tolist() == [budget, 0]
    assert charged[:budget, 0].all() and not charged[budget:, 0].any()
    assert not charged[:, 1].any()
    counts = np.asarray(info.counts)
    assert (counts[:budget, -1] == 1).all() and (counts[budget:] == 0).all()
    assert (counts.sum(axis=1) == charged.sum(axis=1)).all()
    # After the budget, every token passes only by noise: the public vote comes out.
    from_public = np.asarray(info.from_public)
    assert (np.asarray(tokens)[from_public] == np.asarray(info.public_vote)[from_public]).all()


def test_a_teacher_equal_to_the_public_model_is_never_charged():
    config = _config(temperature=1.7)
    keys = jax.random.split(jax.random.key(3), 50)
    for key in keys[:10]:
        logits = 3.0 * jax.random.normal(key, (300,))
        teachers = jnp.broadcast_to(logits, (5, 300))
        _, charges, info = individual.individual_step(
            jax.random.fold_in(key, 1), teachers, logits, jnp.zeros(5, jnp.int32), config
        )
        assert int(charges.sum()) == 0 and int(info.counts.sum()) == 0


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 6),
    vocab=st.integers(2, 5),
    budget=st.integers(1, 4),
    steps=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_no_teacher_is_ever_charged_more_than_m(n, vocab, budget, steps, seed):
    config = _config(sigma=1.0, threshold=2.0)
    rng = np.random.default_rng(seed)
    charges = jnp.zeros(n, jnp.int32)
    key = jax.random.key(seed)
    for _ in range(steps):
        key, key_step = jax.random.split(key)
        teachers = rng.normal(0.0, 2.0, (n, vocab)).astype(np.float32)
        public = rng.normal(0.0, 2.0, vocab).astype(np.float32)
        if rng.random() < 0.3:  # some teachers agree with the public model
            teachers[rng.random(n) < 0.5] = public
        _, new, info = individual.individual_step(
            key_step, teachers, public, charges, config, budget
        )
        old, new, charged = np.asarray(charges), np.asarray(new), np.asarray(info.charged)
        assert new.max() <= budget
        assert (new == old + charged).all()
        assert not charged[old >= budget].any()
        votes = np.asarray(info.votes)
        assert not charged[votes == int(info.public_vote)].any()
        assert int(np.asarray(info.counts).sum()) == int(charged.sum())
        charges = jnp.asarray(new)


# --------------------------------------------------------------------------------------------
# The vectorised step against a per-teacher loop.
# --------------------------------------------------------------------------------------------


def _loop_step(key, teachers, public, charges, config, budget):
    """The step written teacher by teacher (numpy float32), from the same three keys."""
    key_vote, key_noise, _ = jax.random.split(key, 3)
    vocab = public.shape[0]
    gumbel = np.asarray(jax.random.gumbel(key_vote, (vocab,), jnp.float32))
    scale = np.float32(1.0 / config.temperature)
    public_vote = int(np.argmax(public.astype(np.float32) * scale + gumbel))
    votes, charged, counts = [], [], np.zeros(vocab, np.int64)
    for i in range(teachers.shape[0]):
        vote = int(np.argmax(teachers[i].astype(np.float32) * scale + gumbel))
        votes.append(vote)
        voted = vote != public_vote and charges[i] < budget
        charged.append(voted)
        if voted:
            counts[vote] += 1
    noise = config.sigma * np.asarray(jax.random.normal(key_noise, (vocab,), jnp.float32))
    return np.array(votes), public_vote, np.array(charged), counts, counts + noise


def test_vectorised_step_equals_a_per_teacher_loop():
    rng = np.random.default_rng(7)
    config = _config(sigma=0.7, threshold=1.5, epsilon=30.0, temperature=0.8)
    for trial in range(20):
        n, vocab, budget = rng.integers(1, 9), rng.integers(2, 7), rng.integers(1, 4)
        teachers = rng.normal(0.0, 1.5, (n, vocab)).astype(np.float32)
        public = rng.normal(0.0, 1.5, vocab).astype(np.float32)
        teachers[rng.random(n) < 0.3] = public
        charges = rng.integers(0, budget + 1, n).astype(np.int32)
        key = jax.random.key(trial)
        token, new, info = individual.individual_step(
            key, teachers, public, charges, config, int(budget)
        )
        votes, public_vote, charged, counts, noisy = _loop_step(
            key, teachers, public, charges, config, budget
        )
        assert np.asarray(info.votes).tolist() == votes.tolist()
        assert int(info.public_vote) == public_vote
        assert np.asarray(info.charged).tolist() == charged.tolist()
        assert np.asarray(new).tolist() == (charges + charged).tolist()
        assert np.asarray(info.counts).tolist() == counts.tolist()
        np.testing.assert_allclose(np.asarray(info.noisy_counts), noisy, rtol=1e-6, atol=1e-6)
        passing = np.flatnonzero(noisy >= config.threshold)
        if passing.size:
            assert int(token) in passing.tolist() and not bool(info.from_public)
        else:
            assert int(token) == public_vote and bool(info.from_public)


def test_the_token_is_drawn_in_proportion_to_the_passing_noisy_counts():
    """100 teachers vote token 1, 300 token 2, the public model votes token 0: tokens 1 and 2
    come out about 1 : 3, never token 0 (it has no votes) or the others."""
    vocab = 5
    config = _config(sigma=1.0, threshold=4.0, epsilon=30.0)
    teachers = np.full((400, vocab), -100.0, np.float32)
    teachers[:100, 1] = teachers[100:, 2] = 100.0
    public = np.full(vocab, -100.0, np.float32)
    public[0] = 100.0
    charges = jnp.zeros(400, jnp.int32)
    keys = jax.random.split(jax.random.key(11), 4000)
    step = jax.vmap(
        lambda key: individual.individual_step(key, teachers, public, charges, config, 10)[0]
    )
    tokens = np.asarray(step(keys))
    assert set(np.unique(tokens).tolist()) == {1, 2}
    share = (tokens == 1).mean()
    assert abs(share - 0.25) < 4 * np.sqrt(0.25 * 0.75 / tokens.size)


def test_the_noise_has_standard_deviation_sigma_and_mean_zero():
    sigma, vocab, draws = 2.5, 8, 5000
    config = _config(sigma=sigma, threshold=10.0)
    rng = np.random.default_rng(0)
    teachers = rng.normal(0.0, 1.0, (6, vocab)).astype(np.float32)
    public = rng.normal(0.0, 1.0, vocab).astype(np.float32)
    charges = jnp.zeros(6, jnp.int32)

    def noise(key):
        info = individual.individual_step(key, teachers, public, charges, config)[2]
        return info.noisy_counts - info.counts

    z = np.asarray(jax.vmap(noise)(jax.random.split(jax.random.key(5), draws)), np.float64)
    size = z.size
    assert abs(z.mean()) < 4 * sigma / np.sqrt(size)
    chi2 = (z**2).sum() / sigma**2  # ~ chi-square with `size` degrees of freedom
    assert abs(chi2 - size) < 5 * np.sqrt(2 * size)
    # Independent coordinates: no correlation between tokens.
    correlation = np.corrcoef(z, rowvar=False)
    assert np.abs(correlation - np.eye(vocab)).max() < 5 / np.sqrt(draws)


# --------------------------------------------------------------------------------------------
# The filter theorem on a tiny case, by numerical integration.
# --------------------------------------------------------------------------------------------


def _renyi_both_ways(sigma, alphas, *, filtered):
    """D_α(with ‖ without) and D_α(without ‖ with) of the released (ĉ_1, ĉ_2), one teacher,
    V = 2, M = 1, 2 steps (scenario in the test's docstring)."""
    step = 0.01
    x = np.arange(-16 * sigma, 16 * sigma + 8, step)
    log_weights = -(x**2) / (2 * sigma**2) - 0.5 * np.log(2 * np.pi * sigma**2) + np.log(step)
    log_ratio = (2 * x - 1) / (2 * sigma**2)  # log N(1, σ²) / N(0, σ²)
    x1, l1, l2 = x[:, None], log_ratio[:, None], log_ratio[None, :]
    half = np.log(0.5)
    # Step 2 given ĉ_1 when the teacher was not charged at step 1.
    second = np.where(x1 > 0.5, np.logaddexp(half + l2, half), 0.0)
    # Filtered: charged at step 1 (probability 1/2), the teacher abstains at step 2. Without
    # the filter, step 2 goes as if it had never been charged.
    log_density = (
        np.logaddexp(half + l1, half + second)
        if filtered
        else np.logaddexp(half + l1, half) + second
    )
    log_joint = log_weights[:, None] + log_weights[None, :]
    assert special.logsumexp(log_joint) == pytest.approx(0.0, abs=1e-6)
    assert special.logsumexp(log_joint + log_density) == pytest.approx(0.0, abs=1e-6)
    return [
        (
            special.logsumexp(log_joint + alpha * log_density) / (alpha - 1),
            special.logsumexp(log_joint + (1 - alpha) * log_density) / (alpha - 1),
        )
        for alpha in alphas
    ]


def test_the_filter_theorem_on_two_adaptive_steps():
    """One teacher, V = 2, M = 1, two steps; the teacher always votes token 0 when it votes.

    Step 1: the public model's vote is 0 or 1 with probability 1/2 each (its logits are equal,
    the shared noise decides), so the teacher is charged with probability 1/2. Step 2 (adaptive):
    the teacher's logits equal the public model's unless ĉ_1[0] > 1/2, in which case it votes 0
    again and is charged, with probability 1/2, if the filter lets it. Only ĉ[0] differs between
    the neighbours; the Rényi divergence of the joint law of (ĉ_1[0], ĉ_2[0]) with and without
    the teacher is within the filter's bound α/(2σ²) in both directions, and without the filter
    (the same rules, M = 2) it is not. The rules are first read off `individual_step`."""
    sigma = 0.5
    config = _config(sigma=sigma, threshold=3.0, epsilon=100.0)
    votes_zero = jnp.asarray([[0.0, -100.0]])
    even = jnp.zeros(2)
    keys = jax.random.split(jax.random.key(0), 400)
    charged = []
    for key in keys:
        _, _, info = individual.individual_step(key, votes_zero, even, jnp.zeros(1, int), config, 1)
        assert bool(info.charged[0]) == (int(info.public_vote) == 1)
        assert int(info.counts[1]) == 0
        charged.append(bool(info.charged[0]))
        _, _, spent = individual.individual_step(key, votes_zero, even, jnp.ones(1, int), config, 1)
        assert not bool(spent.charged[0])
        _, _, same = individual.individual_step(key, even[None], even, jnp.zeros(1, int), config, 1)
        assert not bool(same.charged[0])
    assert abs(np.mean(charged) - 0.5) < 4 * np.sqrt(0.25 / len(keys))

    alphas = (2.0, 4.0, 8.0)
    for alpha, (forward, backward) in zip(
        alphas, _renyi_both_ways(sigma, alphas, filtered=True), strict=True
    ):
        bound = alpha / (2 * sigma**2)
        assert forward <= bound and backward <= bound, (alpha, forward, backward, bound)
    for alpha, (forward, _) in zip(
        alphas, _renyi_both_ways(sigma, alphas, filtered=False), strict=True
    ):
        assert forward > alpha / (2 * sigma**2)


def test_configs_are_hashable_for_jit():
    config = _config()
    assert hash(config) == hash(dataclasses.replace(config))


def test_votes_take_the_first_maximum_like_argmax():
    scores = jnp.asarray(
        [[1.0, 3.0, 3.0], [-jnp.inf, -jnp.inf, -jnp.inf], [0.0, jnp.nan, 5.0], [2.0, 2.0, 2.0]]
    )
    assert individual._votes(scores).tolist() == jnp.argmax(scores, axis=-1).tolist()
    assert int(individual._votes(scores[0])) == 1
