"""The ε = 0 and ε = ∞ references of the generators' head-to-head (`pate.peers.reference`)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.pate.peers import reference
from dpmix_jax.pate.teachers import TableTeachers

V = 4


def _table(seed: int = 0, n: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, V, V)).astype(np.float32) * 2


def test_nonprivate_samples_from_the_teachers_average_distribution():
    table = _table()
    teachers = TableTeachers(table)
    draws = [
        reference.generate_nonprivate(
            teachers, prompt=[1], max_new_tokens=1, key=jax.random.key(i)
        ).tokens[0]
        for i in range(2500)
    ]
    exact = jax.nn.softmax(jnp.asarray(table[:, 1]), axis=-1).mean(axis=0)
    counts = np.bincount(draws, minlength=V)
    assert np.abs(counts / len(draws) - np.asarray(exact)).max() < 0.03
    # The average of the teachers' probabilities, not the softmax of their average logit.
    pooled = np.asarray(jax.nn.softmax(jnp.asarray(table[:, 1]).mean(axis=0)))
    assert np.abs(pooled - np.asarray(exact)).max() > 0.05


def test_public_reads_only_the_public_model_and_costs_nothing():
    public_logits = jnp.log(jnp.asarray([0.7, 0.1, 0.1, 0.1]))
    calls = []

    def public_model(prefix):
        calls.append(list(prefix))
        return public_logits

    result = reference.generate_public(
        public_model, prompt=[2], max_new_tokens=5, key=jax.random.key(0)
    )
    assert result.epsilon == 0 and result.sources == ["public"] * 5
    assert result.teacher_forward_passes == 0 and result.public_forward_passes == len(calls) == 5
    assert calls[0] == [2] and calls[-1] == [2, *result.tokens[:-1]]
    draws = [
        reference.generate_public(
            public_model, prompt=[], max_new_tokens=1, key=jax.random.key(i)
        ).tokens[0]
        for i in range(1200)
    ]
    assert abs(np.mean(np.asarray(draws) == 0) - 0.7) < 0.05


def test_nonprivate_is_charged_infinity_and_counts_passes():
    teachers = TableTeachers(_table(n=5))
    result = reference.generate_nonprivate(
        teachers, prompt=[0], max_new_tokens=6, key=jax.random.key(1)
    )
    assert math.isinf(result.epsilon) and result.private_steps == len(result.tokens) == 6
    assert result.teacher_forward_passes == 5 * 6 and result.seeded


def test_stops_and_reproducibility():
    table = np.full((2, V, V), -30.0, np.float32)
    table[:, :, 3] = 0.0  # every teacher always says 3
    teachers = TableTeachers(table)
    at_eos = reference.generate_nonprivate(
        teachers, prompt=[0], max_new_tokens=9, eos_id=3, key=jax.random.key(0)
    )
    assert at_eos.tokens == [3] and at_eos.stop_reason == "eos"
    at_stop = reference.generate_nonprivate(
        teachers, prompt=[0], max_new_tokens=9, stop_sequences=[(3, 3)], key=jax.random.key(0)
    )
    assert at_stop.tokens == [3, 3] and at_stop.stop_reason == "stop_sequence"
    teachers = TableTeachers(_table())
    first, again = (
        reference.generate_nonprivate(teachers, prompt=[0], max_new_tokens=8, key=jax.random.key(7))
        for _ in range(2)
    )
    assert first.tokens == again.tokens and first.stop_reason == "max_new_tokens"
    secret = reference.generate_nonprivate(teachers, prompt=[0], max_new_tokens=2)
    assert not secret.seeded


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"max_new_tokens": 2, "temperature": 0.0}, "temperature"),
    ],
)
def test_bad_settings_are_one_clear_line(settings, match):
    teachers = TableTeachers(_table())
    with pytest.raises(ValueError, match=match):
        reference.generate_nonprivate(teachers, prompt=[0], **settings)
    with pytest.raises(ValueError, match=match):
        reference.generate_public(lambda prefix: jnp.zeros(V), prompt=[0], **settings)
