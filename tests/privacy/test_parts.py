"""Keyed-hash part assignment and the sources of private randomness."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.privacy import assign_parts, randomness
from dpmix_jax.privacy.parts import secret_key


def test_adding_or_removing_a_unit_leaves_every_other_units_part_unchanged():
    ids = [f"user{i}" for i in range(500)]
    parts = dict(zip(ids, assign_parts(ids, (0.2, 0.5, 0.3), key=b"k"), strict=True))
    for removed in (0, 137, 499):
        rest = ids[:removed] + ids[removed + 1 :]
        again = assign_parts(rest, (0.2, 0.5, 0.3), key=b"k")
        assert all(parts[u] == p for u, p in zip(rest, again, strict=True))
    bigger = ["newcomer", *ids[:250], "another", *ids[250:]]
    again = assign_parts(bigger, (0.2, 0.5, 0.3), key=b"k")
    assert all(parts[u] == p for u, p in zip(bigger, again, strict=True) if u in parts)


def test_part_is_a_keyed_blake2b_of_the_id_cut_at_the_cumulative_fractions():
    # An independent computation of the documented rule for a few ids of each type.
    key = b"secret key"
    ids = [7, "alice", b"\x00\x01", np.int64(-3)]
    encoded = [b"i7", b"salice", b"b\x00\x01", b"i-3"]
    fractions = (0.25, 0.25, 0.5)
    expected = []
    for data in encoded:
        u = int.from_bytes(hashlib.blake2b(data, key=key, digest_size=8).digest(), "big") / 2**64
        expected.append(int(np.searchsorted([0.25, 0.5, 1.0], u, side="right")))
    assert assign_parts(ids, fractions, key=key).tolist() == expected


def test_part_sizes_match_the_fractions_in_expectation():
    n, fractions = 40_000, np.array([0.1, 0.6, 0.3])
    parts = assign_parts(np.arange(n), fractions, key=3)
    counts = np.bincount(parts, minlength=3)
    # Each count is Binomial(n, f): within 5 standard deviations (fails with prob. < 1e-5).
    assert np.all(np.abs(counts - n * fractions) < 5 * np.sqrt(n * fractions * (1 - fractions)))
    chi2 = np.sum((counts - n * fractions) ** 2 / (n * fractions))
    assert chi2 < 23.0  # the 1e-5 quantile of χ²(2)


def test_deterministic_with_a_key_different_with_another_and_secret_without():
    ids = np.arange(2_000)
    first = assign_parts(ids, (0.5, 0.5), key=b"one")
    assert np.array_equal(first, assign_parts(ids, (0.5, 0.5), key=b"one"))
    assert np.array_equal(
        assign_parts(ids, (0.5, 0.5), key=11), assign_parts(ids, (0.5, 0.5), key=11)
    )
    other = assign_parts(ids, (0.5, 0.5), key=b"two")
    assert 0.4 < np.mean(first != other) < 0.6  # independent halves disagree about half the time
    assert 0.4 < np.mean(assign_parts(ids, (0.5, 0.5)) != assign_parts(ids, (0.5, 0.5))) < 0.6
    assert len(secret_key()) == 32 and secret_key() != secret_key()


def test_equal_ids_share_a_part_so_groups_are_never_split():
    users = np.repeat(np.arange(100), 5)
    parts = assign_parts(users, (0.3, 0.7), key=b"k")
    assert all(len(set(parts[users == u])) == 1 for u in range(100))


@pytest.mark.parametrize(
    ("fractions", "message"),
    [
        ((0.5, 0.6), "sum to 1"),
        ((0.5, 0.4), "sum to 1"),
        ((1.2, -0.2), "> 0"),
        ((1.0, 0.0), "> 0"),
        ((float("nan"), 1.0), "> 0"),
        ((), "non-empty"),
    ],
)
def test_bad_fractions_are_rejected(fractions, message):
    with pytest.raises(ValueError, match=message):
        assign_parts([1, 2, 3], fractions, key=b"k")


def test_bad_ids_and_keys_are_rejected():
    with pytest.raises(ValueError, match=r"unit_ids\[1\] is float"):
        assign_parts([1, 2.5], (0.5, 0.5), key=b"k")
    for key in (b"", -1, 1.5):
        with pytest.raises(ValueError, match="key"):
            assign_parts([1, 2], (0.5, 0.5), key=key)


def test_any_iterable_of_ids_is_accepted_and_anything_else_is_one_clear_line():
    ids = [f"user{i}" for i in range(50)]
    expected = assign_parts(ids, (0.3, 0.7), key=b"k").tolist()
    assert assign_parts((u for u in ids), (0.3, 0.7), key=b"k").tolist() == expected
    assert assign_parts(iter(tuple(ids)), (0.3, 0.7), key=b"k").tolist() == expected
    assert assign_parts(range(3), (1.0,), key=b"k").tolist() == [0, 0, 0]
    for bad in ("user0", b"user0", 7, None):
        with pytest.raises(ValueError, match=r"^unit_ids must be an iterable of ids"):
            assign_parts(bad, (0.5, 0.5), key=b"k")


def test_prng_key_depends_on_every_bit_of_a_large_seed():
    data = lambda key: jax.random.key_data(key).tolist()  # noqa: E731
    assert data(randomness.prng_key(5)) == data(jax.random.key(5))
    # jax.random.key keeps the low 32 bits only: 2**32 + 5 and 5 would be the same key.
    assert data(randomness.prng_key(2**32 + 5)) != data(randomness.prng_key(5))
    assert data(randomness.prng_key(2**100 + 5)) != data(randomness.prng_key(2**32 + 5))
    secrets = {randomness.secret_seed() for _ in range(4)}
    assert len(secrets) == 4 and max(secrets) < 2**128
    assert randomness.resolve_seed(3) == (3, True)
    assert randomness.resolve_seed(None)[1] is False
    for bad in (-1, 1.5, "0", True):
        with pytest.raises(ValueError, match="seed"):
            randomness.resolve_seed(bad)


@pytest.mark.parametrize("size", [1, 2, 7, 4096, 100_003])
def test_noise_draws_are_jax_normal_bit_for_bit(size):
    # The unrolled threefry must give exactly JAX's draws: the noise is JAX's Gaussian, faster.
    draw = jax.jit(randomness.normal, static_argnums=1)
    for key in (jax.random.key(0), randomness.prng_key(2**70 + 9), jax.random.PRNGKey(3)):
        expected = jax.random.normal(key, (size,), jnp.float32)
        np.testing.assert_array_equal(np.asarray(draw(key, size)), np.asarray(expected))
    keys = jax.random.split(jax.random.key(1), 2)
    assert not np.array_equal(draw(keys[0], size), draw(keys[1], size))


def test_noise_draws_from_another_key_implementation_are_jax_normal():
    key = jax.random.key(4, impl="rbg")
    np.testing.assert_array_equal(
        np.asarray(randomness.normal(key, 33)), np.asarray(jax.random.normal(key, (33,)))
    )
