"""Private decoding with teacher ensembles; in-context GPT-2 teachers; the record partition."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dpmix_jax.models.gpt2 import GPT2, GPT2Config
from dpmix_jax.pate import accounting, generation, samplers, smooth_sensitivity
from dpmix_jax.pate.teachers import (
    InContextTeachers,
    TableTeachers,
    build_prompts,
    partition_records,
)

V = 12


def chain_table(n, noise=0.0, seed=0):
    """Teachers that all continue t -> t + 1 (mod V) with probability ~1."""
    table = np.full((n, V, V), -30.0, np.float32)
    for t in range(V):
        table[:, t, (t + 1) % V] = 0.0
    table += noise * np.random.default_rng(seed).normal(size=table.shape).astype(np.float32)
    return TableTeachers(table, start_token=0)


def disagreeing_teachers(n):
    """Teacher i always wants token i (mod V): no token ever gets more than ceil(n / V) votes."""
    table = np.full((n, V, V), -30.0, np.float32)
    table[np.arange(n), :, np.arange(n) % V] = 0.0
    return TableTeachers(table)


def public_model(prefix):
    return jnp.zeros((V,)).at[V - 1].set(30.0)  # the public model always says V - 1


DPWS = dict(aggregator="dpws", epsilon=1.0, delta=1e-6, gamma=1.0)


@pytest.mark.parametrize("sampler", ["coordinated", "independent"])
@pytest.mark.parametrize(
    "privacy",
    [
        DPWS,
        dict(aggregator="dpargmax_laplace", epsilon=1.0, threshold=40.0),
        dict(aggregator="confident_gnmax", threshold=40.0, sigma1=5.0, sigma2=3.0),
    ],
)
def test_agreeing_teachers_are_followed_and_every_query_is_charged(sampler, privacy):
    config = generation.GenerationConfig(sampler=sampler, max_new_tokens=6, **privacy)
    result = generation.generate(chain_table(64), [3], config, key=jax.random.key(0))
    assert result.tokens == [4, 5, 6, 7, 8, 9]
    assert result.sources == ["private"] * 6 and result.stop_reason == "max_new_tokens"
    assert result.num_queries == 6 == result.ledger.count
    event, call_delta = config.charge()
    expected = accounting.epsilon_of_steps(event, steps=6, delta=config.report_delta)
    assert result.epsilon == pytest.approx(expected)
    assert result.delta == pytest.approx(config.report_delta + 6 * call_delta)
    if privacy["aggregator"] == "confident_gnmax":
        assert result.gnmax.num_answered == 6
        assert result.gnmax.epsilon_data_dependent < result.gnmax.epsilon_data_independent_rdp


def test_confident_gnmax_run_releases_its_data_dependent_epsilon_privately():
    gnmax = dict(aggregator="confident_gnmax", threshold=40.0, sigma1=5.0, sigma2=3.0)
    config = generation.GenerationConfig(
        max_new_tokens=4, release_order=8.0, release_noise_multiplier=2.0, **gnmax
    )
    result = generation.generate(chain_table(64), [3], config, key=jax.random.key(0))
    released = result.released
    assert released.order == 8.0 and released.noise_multiplier == 2.0
    expected = smooth_sensitivity.release_data_dependent_epsilon(
        np.stack([np.eye(V, dtype=int)[t] * 64 for t in (4, 5, 6, 7)]),
        np.ones(4, bool),
        order=8.0,
        noise_multiplier=2.0,
        delta=config.report_delta,
        seed=0,
        **{k: gnmax[k] for k in ("threshold", "sigma1", "sigma2")},
    )
    # Unanimous histograms: the noise-free value is the closed-form analysis of these 4 queries.
    assert released.epsilon_noise_free == pytest.approx(expected.epsilon_noise_free)
    assert released.smooth_sensitivity == pytest.approx(expected.smooth_sensitivity)
    assert released.epsilon != released.epsilon_noise_free
    assert generation.GenerationConfig(**gnmax).release_order is None
    with pytest.raises(ValueError, match="confident_gnmax"):
        generation.GenerationConfig(release_order=8.0, **DPWS)


def test_the_released_epsilon_is_seeded_only_when_the_run_is():
    config = generation.GenerationConfig(
        aggregator="confident_gnmax",
        threshold=40.0,
        sigma1=5.0,
        sigma2=3.0,
        max_new_tokens=2,
        release_order=8.0,
        release_noise_multiplier=2.0,
    )
    secret = [generation.generate(chain_table(64), [3], config) for _ in range(2)]
    assert not any(run.seeded or run.released.seeded for run in secret)
    assert secret[0].released.epsilon != secret[1].released.epsilon  # fresh release noise
    seeded = [
        generation.generate(chain_table(64), [3], config, key=jax.random.key(5)) for _ in "ab"
    ]
    assert all(run.seeded and run.released.seeded for run in seeded)
    assert seeded[0].released.epsilon == seeded[1].released.epsilon  # reproducible


def test_failed_steps_fall_back_to_public_model_and_retries_are_charged():
    config = generation.GenerationConfig(max_new_tokens=4, max_retries=2, **DPWS)
    result = generation.generate(
        disagreeing_teachers(24), [], config, public_model=public_model, key=jax.random.key(1)
    )
    assert result.tokens == [V - 1] * 4 and result.sources == ["public"] * 4
    assert result.num_queries == 12 == result.num_failed  # 4 steps x (1 + 2 retries)
    assert result.fallback_fraction == 1.0 and result.yield_rate == 0.0
    assert result.epsilon == pytest.approx(
        accounting.epsilon_of_steps(accounting.dpws_event(1.0), steps=12, delta=1e-5)
    )


def test_retries_share_one_sampler_set_up_per_step(monkeypatch):
    prepared = []
    original = samplers.coordinated_sampler

    def counting(logits, **kwargs):
        prepared.append(kwargs)
        return original(logits, **kwargs)

    monkeypatch.setattr(samplers, "coordinated_sampler", counting)
    config = generation.GenerationConfig(max_new_tokens=3, max_retries=2, **DPWS)
    result = generation.generate(
        disagreeing_teachers(24), [], config, public_model=public_model, key=jax.random.key(1)
    )
    assert result.num_queries == 9 and len(prepared) == 3  # 3 steps x 3 calls, 3 set-ups


def test_without_public_model_decoding_stops_on_fail():
    config = generation.GenerationConfig(max_new_tokens=4, **DPWS)
    result = generation.generate(disagreeing_teachers(24), [], config, key=jax.random.key(2))
    assert result.tokens == [] and result.stop_reason == "fail" and result.num_queries == 1


def test_stops_on_eos_and_stop_sequence_and_shares_a_ledger():
    ledger = accounting.PateLedger()
    eos = generation.GenerationConfig(max_new_tokens=20, eos_id=7, **DPWS)
    result = generation.generate(chain_table(64), [3], eos, ledger=ledger, key=jax.random.key(3))
    assert result.tokens == [4, 5, 6, 7] and result.stop_reason == "eos"
    stop = generation.GenerationConfig(max_new_tokens=20, stop_sequences=((9, 10),), **DPWS)
    result = generation.generate(chain_table(64), [6], stop, ledger=ledger, key=jax.random.key(4))
    assert result.tokens == [7, 8, 9, 10] and result.stop_reason == "stop_sequence"
    assert ledger.count == 8 and result.ledger is ledger


def test_config_validation():
    with pytest.raises(ValueError, match="aggregator"):
        generation.GenerationConfig(aggregator="tws")
    with pytest.raises(ValueError, match="top_k"):
        generation.GenerationConfig(sampler="independent", top_k=4)
    with pytest.raises(ValueError, match="epsilon"):
        generation.GenerationConfig(epsilon=0.0)
    with pytest.raises(ValueError, match="protocol"):
        generation.generate(object(), [], generation.GenerationConfig(), key=jax.random.key(0))


def test_partition_is_disjoint_covering_and_keyed_by_record_id():
    ids = [f"record {i}" for i in range(103)]
    parts = partition_records(ids, 10, key=5)
    flat = np.concatenate(parts)
    assert sorted(flat.tolist()) == list(range(103))
    again = partition_records(ids, 10, key=5)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    with pytest.raises(ValueError, match="10 teachers for 5 records"):
        partition_records(ids[:5], 10, key=0)


def test_adding_or_removing_a_record_changes_one_teacher_only():
    ids = [f"record {i}" for i in range(300)]
    teacher_of = lambda ids: {  # noqa: E731
        ids[r]: t for t, part in enumerate(partition_records(ids, 16, key=b"k")) for r in part
    }
    full = teacher_of(ids)
    fewer = teacher_of(ids[:100] + ids[101:])
    assert all(full[r] == t for r, t in fewer.items())
    more = teacher_of(["extra", *ids])
    assert all(full[r] == t for r, t in more.items() if r != "extra")
    # A secret key (the default) gives another partition each time.
    secret = [partition_records(ids, 16)[0] for _ in range(2)]
    assert not np.array_equal(*secret)


def test_prompts_use_only_own_records():
    records = [[100 + i, 200 + i] for i in range(20)]
    parts = partition_records(list(range(20)), 4, key=0)
    prompts = build_prompts(records, parts, separator=[1], records_per_teacher=3)
    for prompt, part in zip(prompts, parts, strict=True):
        expected = [t for i in part[:3] for t in (*records[i], 1)]
        assert prompt == expected


def test_in_context_teachers_match_unbatched_forward_passes():
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_positions=48), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 64, size=rng.integers(2, 12)).tolist() for _ in range(5)]
    teachers = InContextTeachers(model, prompts, width=16, batch_size=2)
    assert isinstance(teachers, generation.Teachers) and teachers.num_teachers == 5
    # Fresh, extended by one token (cache continued), repeated, then restarted from the prompts.
    for prefix in ([5, 9, 11], [5, 9, 11, 2], [5, 9, 11, 2], [7], []):
        logits = np.asarray(teachers(prefix))
        assert logits.shape == (5, 64)
        for i, prompt in enumerate(prompts):
            alone = model(jnp.asarray([prompt + prefix]))[0, -1]
            np.testing.assert_allclose(logits[i], np.asarray(alone), atol=1e-4)
    with pytest.raises(ValueError, match="tokens"):
        teachers(list(range(60)))


_PREFIXES = ([5, 9, 11], [5, 9, 11, 2], [5, 9, 11, 2, 40], [7], [])  # cache extended, restarted


def _teacher_logits(model, prompts, teachers_read):
    """The logits of `teachers_read` after every prefix of `_PREFIXES`, width 16, 2 per batch."""
    teachers = InContextTeachers(model, prompts, width=16, batch_size=2)
    return [np.asarray(teachers(prefix))[teachers_read] for prefix in _PREFIXES]


def test_a_teachers_logits_do_not_change_by_one_bit_when_other_teachers_prompts_change():
    """Teachers 0 (also in the last batch's padding row) and 3 (sharing a batch with 2) read the
    same bits whatever the others' prompts, their lengths included: the width is public."""
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_positions=48), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, size=6).tolist() for _ in range(5)]
    before = _teacher_logits(model, prompts, [0, 3])
    others = list(prompts)
    others[1] = rng.integers(1, 64, size=16).tolist()  # as long as the width allows
    others[2] = [3]
    others[4] = rng.integers(1, 64, size=11).tolist()
    after = _teacher_logits(model, others, [0, 3])
    for logits_before, logits_after in zip(before, after, strict=True):
        np.testing.assert_array_equal(logits_after, logits_before)


def test_the_too_long_prefix_error_depends_on_the_public_width_only():
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_positions=48), rngs=nnx.Rngs(0))
    messages = set()
    for prompts in ([[1, 2]] * 3, [[1] * 20, [2], [3, 4]]):
        teachers = InContextTeachers(model, prompts, width=20, batch_size=2)
        teachers(list(range(28)))  # 20 + 28 = 48 positions: allowed for every prompt length
        with pytest.raises(ValueError, match="more than the model's 48 positions") as error:
            teachers(list(range(29)))
        messages.add(str(error.value))
    assert len(messages) == 1


def test_a_bad_width_or_a_prompt_longer_than_the_width_is_refused_in_one_line():
    model = GPT2(GPT2Config.tiny(vocab_size=64, n_positions=48), rngs=nnx.Rngs(0))
    for width in (0, 49, 4.0, True, None):
        with pytest.raises(ValueError, match=r"^width must be an integer in \[1, 48\]") as error:
            InContextTeachers(model, [[1, 2]], width=width)
        assert "\n" not in str(error.value)
    assert InContextTeachers(model, [[1, 2]], width=np.int64(48)).num_teachers == 1
    with pytest.raises(ValueError, match=r"^prompts\[1\] has 5 tokens, more than width = 4\.$"):
        InContextTeachers(model, [[1, 2], [1, 2, 3, 4, 5]], width=4)


def test_a_total_delta_of_one_over_the_teachers_or_more_is_refused_before_any_teacher_is_read():
    calls, table = [], chain_table(10)

    class Counting:
        vocab_size, num_teachers = V, 10

        def __call__(self, prefix):
            calls.append(prefix)
            return table(prefix)

    # DPWS charges δ = 0.01 per call: 6 tokens x 2 tries is 0.12 + 1e-5 >= 1/10.
    config = generation.GenerationConfig(max_new_tokens=6, max_retries=1, epsilon=1.0, delta=0.01)
    with pytest.raises(ValueError, match=r"total δ .* >= 1/n = 0\.1 for n = 10 teachers"):
        generation.generate(Counting(), [3], config)
    assert calls == []
    allowed = dataclasses.replace(config, allow_large_delta=True)
    assert generation.generate(Counting(), [3], allowed).num_queries > 0 and calls
