"""The aggregator restricted to the public model's candidates (`public_candidates`), and the
probability that a unanimous vote is released (`aggregators.unanimous_release_probability`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmix_jax.pate import aggregators, generation, hot_pate_method
from dpmix_jax.pate.method import RunSettings
from dpmix_jax.pate.teachers import TableTeachers

V = 12
GNMAX = dict(aggregator="confident_gnmax", threshold=20.0, sigma1=2.0, sigma2=1.0)


def chain_teachers(n, step=1):
    """Teachers that all continue t -> t + step (mod V)."""
    table = np.full((n, V, V), -30.0, np.float32)
    for t in range(V):
        table[:, t, (t + step) % V] = 0.0
    return TableTeachers(table, start_token=0)


def ranked_public_model(prefix):
    """A public model whose ranking is V-1 > V-2 > ... > 0 after every prefix."""
    return jnp.arange(V, dtype=jnp.float32)


@settings(max_examples=200, deadline=None)
@given(
    votes=st.lists(st.integers(0, 5), min_size=V, max_size=V),
    move=st.tuples(st.integers(0, V - 1), st.integers(0, V - 1)),
    candidates=st.lists(st.integers(0, V - 1), min_size=1, max_size=V - 1, unique=True),
)
def test_a_moved_vote_changes_two_restricted_counts_by_one_at_most(votes, move, candidates):
    source, target = move
    votes = np.array(votes)
    if votes[source] == 0:
        votes[source] = 1
    neighbour = votes.copy()
    neighbour[source] -= 1
    neighbour[target] += 1
    ids = jnp.asarray(candidates, jnp.int32)
    first = np.asarray(generation.restrict_votes(jnp.asarray(votes), ids))
    second = np.asarray(generation.restrict_votes(jnp.asarray(neighbour), ids))
    assert first.shape == (len(candidates) + 1,)
    assert first.sum() == votes.sum() == second.sum()  # n is kept: the others' bucket
    difference = np.abs(first - second)
    assert difference.max() <= 1 and difference.sum() <= 2
    np.testing.assert_array_equal(first[:-1], votes[candidates])


def test_released_tokens_are_always_among_the_public_candidates():
    # The teachers agree on t + 1, which the public model ranks last but one after t = 10
    # only; elsewhere their token is outside the 3 candidates {V-1, V-2, V-3}.
    config = generation.GenerationConfig(max_new_tokens=12, public_candidates=3, **GNMAX)
    result = generation.generate(
        chain_teachers(32), [8], config, key=jax.random.key(0), public_model=ranked_public_model
    )
    private = [t for t, s in zip(result.tokens, result.sources, strict=True) if s == "private"]
    assert private[:3] == [9, 10, 11]  # 8 -> 9 -> 10 -> 11 from the teachers
    # A token outside the candidates is never released: its votes fell into the others' bucket.
    assert set(private) <= {V - 1, V - 2, V - 3}
    assert "public" in result.sources  # after 11 the teachers' 0 is no candidate


def test_a_release_of_the_others_bucket_is_a_fail_and_takes_the_fallback():
    config = generation.GenerationConfig(max_new_tokens=1, public_candidates=2, **GNMAX)
    # After 0 the teachers say 1, outside the public candidates {11, 10}: every vote is in the
    # others' bucket, which passes the check and wins the argmax, and is refused.
    result = generation.generate(
        chain_teachers(32), [0], config, key=jax.random.key(1), public_model=ranked_public_model
    )
    assert result.sources == ["public"] and result.num_failed == 1 == result.ledger.count
    without_fallback = generation.generate(
        chain_teachers(32),
        [0],
        generation.GenerationConfig(
            max_new_tokens=1, public_candidates=2, public_fallback=False, **GNMAX
        ),
        key=jax.random.key(1),
        public_model=ranked_public_model,
    )
    assert without_fallback.tokens == [] and without_fallback.stop_reason == "fail"


def test_the_candidates_are_charged_like_the_whole_vocabulary():
    full = generation.GenerationConfig(max_new_tokens=4, **GNMAX)
    restricted = generation.GenerationConfig(max_new_tokens=4, public_candidates=4, **GNMAX)
    assert full.charge() == restricted.charge()
    run = generation.generate(
        chain_teachers(32), [8], restricted, key=jax.random.key(2), public_model=ranked_public_model
    )
    assert run.ledger.count == run.num_queries == 4
    assert run.gnmax is not None  # the data-dependent analysis reads the restricted counts


def test_candidates_need_a_public_model_and_fewer_ids_than_the_vocabulary():
    config = generation.GenerationConfig(max_new_tokens=2, public_candidates=3, **GNMAX)
    with pytest.raises(ValueError, match="public_candidates needs a public_model"):
        generation.generate(chain_teachers(4), [0], config, key=jax.random.key(0))
    too_many = generation.GenerationConfig(max_new_tokens=2, public_candidates=V, **GNMAX)
    with pytest.raises(ValueError, match="public_candidates must be below the vocabulary's 12"):
        generation.generate(
            chain_teachers(4),
            [0],
            too_many,
            key=jax.random.key(0),
            public_model=ranked_public_model,
        )
    with pytest.raises(ValueError, match="public_candidates"):
        generation.GenerationConfig(public_candidates=0)


@pytest.mark.parametrize(
    ("aggregator", "settings_"),
    [
        ("confident_gnmax", dict(threshold=5.0, sigma1=4.0, sigma2=3.0)),
        ("confident_gnmax", dict(threshold=12.0, sigma1=6.0, sigma2=8.0)),
        ("dpargmax_laplace", dict(threshold=5.0, epsilon=0.5)),
    ],
)
def test_the_unanimous_release_probability_matches_simulation(aggregator, settings_):
    n, buckets, draws = 10, 6, 400_000
    rng = np.random.default_rng(0)
    if aggregator == "confident_gnmax":
        passed = n + settings_["sigma1"] * rng.standard_normal(draws) >= settings_["threshold"]
        noisy = settings_["sigma2"] * rng.standard_normal((draws, buckets))
        noisy[:, 0] += n
    else:
        noisy = rng.laplace(0.0, 2.0 / settings_["epsilon"], (draws, buckets))
        noisy[:, 0] += n
        passed = noisy[:, 0] >= settings_["threshold"]
    simulated = np.mean(passed & (noisy.argmax(axis=1) == 0))
    exact = aggregators.unanimous_release_probability(
        aggregator, num_teachers=n, num_buckets=buckets, **settings_
    )
    standard_error = np.sqrt(exact * (1 - exact) / draws)
    assert abs(simulated - exact) < 5 * standard_error
    assert (
        aggregators.unanimous_release_probability(
            "dpws", num_teachers=n, num_buckets=buckets, threshold=0.0
        )
        is None
    )


def test_a_calibrated_run_states_how_likely_a_unanimous_vote_is_released():
    def plan(candidates):
        run = RunSettings(
            epsilon=1.0, delta=1e-5, num_samples=8, max_new_tokens=32, num_teachers=32,
            vocab_size=49_152, public_candidates=candidates,
        )  # fmt: skip
        return hot_pate_method.COORDINATED.calibrate(run).mechanism

    full, restricted = plan(None), plan(16)
    assert full["public_candidates"] is None and restricted["public_candidates"] == 16
    # Over 49,152 tokens the noise drowns a unanimous vote; over 17 buckets it does less so.
    assert full["unanimous_release_probability"] < 1e-3
    assert restricted["unanimous_release_probability"] > 20 * full["unanimous_release_probability"]
    with pytest.raises(ValueError, match="public_candidates must be below"):
        RunSettings(
            epsilon=1.0, delta=1e-5, num_samples=1, max_new_tokens=1, num_teachers=2,
            vocab_size=8, public_candidates=8,
        )  # fmt: skip
