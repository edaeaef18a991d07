"""PMixED peer: projection, sampling, privacy bound, calibration, decoding."""

import dataclasses
import itertools
import math

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import brentq

from dpmix_jax.pate.peers import pmixed
from dpmix_jax.pate.teachers import TableTeachers


def renyi(p, q, order):
    p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
    support = p > 0
    if np.any(q[support] == 0):
        return math.inf
    return math.log(np.sum(p[support] ** order * q[support] ** (1 - order))) / (order - 1)


def softmax(logits):
    z = np.exp(np.asarray(logits, np.float64) - np.max(logits))
    return z / z.sum()


def in_ball(mixture, p0, alpha, beta):
    return (
        renyi(mixture, p0, 2 * alpha) <= 2 * alpha * beta
        and renyi(p0, mixture, 2 * alpha - 1) <= (2 * alpha - 1) * beta
    )


def exact_output(teacher_logits, public_logits, config):
    """Σ over subsets of Pr(subset) · output_distribution(subset), in float64."""
    n = teacher_logits.shape[0]
    q = config.sampling_rate
    subsets = np.array(list(itertools.product([False, True], repeat=n)))
    chances = np.prod(np.where(subsets, q, 1 - q), axis=1)
    outputs = jax.vmap(
        lambda kept: pmixed.output_distribution(
            jnp.asarray(teacher_logits), jnp.asarray(public_logits), kept, config=config
        )
    )(jnp.asarray(subsets))
    return chances @ np.asarray(outputs, np.float64)


def logits_of(distribution):
    return np.log(np.maximum(np.asarray(distribution, np.float64), 1e-30)).astype(np.float32)


def test_projection_stays_in_ball_and_weight_is_maximal():
    config = pmixed.PMixEDConfig(alpha=2.0, beta=0.02, num_teachers=4, bisection_iterations=30)
    rng = np.random.default_rng(0)
    teacher_logits = rng.normal(size=(4, 5)) * 3
    teacher_logits[0] = [9, -9, -9, -9, -9]
    public_logits = rng.normal(size=5)
    weights = np.asarray(
        pmixed.mixing_weights(
            jnp.asarray(teacher_logits), jnp.asarray(public_logits), config=config
        )
    )
    p0 = softmax(public_logits)
    grid = np.linspace(0, 1, 20001)
    for weight, logits in zip(weights, teacher_logits, strict=True):
        p = softmax(logits)
        assert in_ball(weight * p + (1 - weight) * p0, p0, 2.0, 0.02)
        feasible = [g for g in grid if in_ball(g * p + (1 - g) * p0, p0, 2.0, 0.02)]
        assert 0 < weight < 1
        assert weight == pytest.approx(max(feasible), abs=2e-4)


def test_step_samples_the_exact_distribution():
    config = pmixed.PMixEDConfig(alpha=3.0, beta=0.05, sampling_rate=0.6, num_teachers=3)
    rng = np.random.default_rng(1)
    teacher_logits = jnp.asarray(rng.normal(size=(3, 5)) * 2, jnp.float32)
    public_logits = jnp.asarray(rng.normal(size=5), jnp.float32)
    exact = exact_output(np.asarray(teacher_logits), np.asarray(public_logits), config)
    draws = 40000
    keys = jax.random.split(jax.random.key(7), draws)
    tokens = jax.vmap(lambda k: pmixed.step(k, teacher_logits, public_logits, config=config))(keys)
    frequencies = np.bincount(np.asarray(tokens), minlength=5) / draws
    assert 0.5 * np.abs(frequencies - exact).sum() < 0.01
    assert np.any(np.abs(exact - softmax(public_logits)) > 0.02)


def charged_token_divergence_holds(teachers, replacement, public, config):
    """D_α both ways between the exact outputs of two neighbouring ensembles vs the charge."""
    neighbour = teachers.copy()
    neighbour[0] = replacement
    first = exact_output(logits_of(teachers), logits_of(public), config)
    second = exact_output(logits_of(neighbour), logits_of(public), config)
    bound = pmixed.token_rdp(config)
    worst = max(renyi(first, second, config.alpha), renyi(second, first, config.alpha))
    return worst, bound


def near_point_mass(vocab, token):
    distribution = np.full(vocab, 1e-12)
    distribution[token] = 1.0
    return distribution / distribution.sum()


@pytest.mark.parametrize("sampling_rate", [1.0, 0.3])
@pytest.mark.parametrize("public_mass", [1e-2, 1e-6, 1e-10])
def test_extreme_neighbours_respect_the_charge(sampling_rate, public_mass):
    alpha, vocab, n = 2.0, 3, 4
    config = pmixed.PMixEDConfig(
        alpha=alpha, beta=0.05, sampling_rate=sampling_rate, num_teachers=n
    )
    public = np.array([1 - 2 * public_mass, public_mass, public_mass])
    teachers = np.stack([near_point_mass(vocab, 0)] * n)
    worst, bound = charged_token_divergence_holds(
        teachers, near_point_mass(vocab, 1), public, config
    )
    assert worst <= bound * (1 + 1e-3)
    if public_mass == 1e-2:
        assert worst > 0.02 * bound


def test_paper_bound_fails_with_near_zero_public_mass():
    """The order-α ball and the 4αβ charge: released divergence far above the charge."""
    alpha, beta, n, public_mass = 2.0, 0.05, 4, 1e-8
    public = np.array([1 - public_mass, public_mass])

    def paper_mixture(p):
        def excess(weight):
            mixture = weight * p + (1 - weight) * public
            return max(renyi(mixture, public, alpha), renyi(public, mixture, alpha)) - alpha * beta

        weight = 1.0 if excess(1.0) <= 0 else brentq(excess, 0, 1, xtol=1e-15)
        return weight * p + (1 - weight) * public

    towards_rare = paper_mixture(np.array([0.0, 1.0]))
    towards_common = paper_mixture(np.array([1.0, 0.0]))
    first = (towards_rare + (n - 1) * towards_common) / n
    released = renyi(first, towards_common, alpha)
    charged = math.log((n - 1) / n + math.exp((alpha - 1) * 4 * alpha * beta) / n) / (alpha - 1)
    assert released > 10
    assert charged < 0.12
    ours = pmixed.PMixEDConfig(alpha=alpha, beta=beta, num_teachers=n)
    ours_worst, ours_bound = charged_token_divergence_holds(
        np.stack([near_point_mass(2, 0)] * n),
        near_point_mass(2, 1),
        np.array([1 - public_mass, public_mass]),
        ours,
    )
    assert ours_worst <= ours_bound * (1 + 1e-3)


distributions = st.lists(
    st.floats(min_value=-12, max_value=12, allow_nan=False), min_size=4, max_size=4
)


@settings(max_examples=25, deadline=None)
@given(
    teachers=st.lists(distributions, min_size=3, max_size=3),
    replacement=distributions,
    public=distributions,
    alpha=st.sampled_from([1.5, 2.0, 4.0]),
    beta=st.sampled_from([0.01, 0.1, 0.5]),
    sampling_rate=st.sampled_from([1.0, 0.5, 0.1]),
)
def test_neighbours_respect_the_charge(teachers, replacement, public, alpha, beta, sampling_rate):
    config = pmixed.PMixEDConfig(
        alpha=alpha, beta=beta, sampling_rate=sampling_rate, num_teachers=3
    )
    worst, bound = charged_token_divergence_holds(
        np.stack([softmax(t) for t in teachers]), softmax(replacement), softmax(public), config
    )
    assert worst <= bound * (1 + 1e-3) + 1e-7


def test_pairwise_bound_from_the_weak_triangle_inequality():
    """Two ball members at the ball's edge, opposite sides: within D, and not far below it."""
    alpha, beta = 3.0, 0.01
    config = pmixed.PMixEDConfig(alpha=alpha, beta=beta, num_teachers=2)
    public_logits = jnp.zeros(2)
    teacher_logits = jnp.array([[4.0, -4.0], [-4.0, 4.0]])
    weights = np.asarray(pmixed.mixing_weights(teacher_logits, public_logits, config=config))
    p = np.asarray(jax.nn.softmax(teacher_logits), np.float64)
    mixtures = weights[:, None] * p + (1 - weights[:, None]) * 0.5
    divergence = renyi(mixtures[0], mixtures[1], alpha)
    assert divergence <= pmixed.pairwise_divergence_bound(alpha, beta)
    assert divergence > 0.5 * pmixed.pairwise_divergence_bound(alpha, beta)


def test_epsilon_uses_dp_accountings_rdp_conversion():
    orders = [3.0]
    accountant = dp_accounting.rdp.RdpAccountant(orders)
    accountant.compose(dp_accounting.GaussianDpEvent(4.0), 50)
    gaussian_rdp = 50 * orders[0] / (2 * 4.0**2)
    converted, _ = dp_accounting.rdp.rdp_privacy_accountant.compute_epsilon(
        orders, [gaussian_rdp], 1e-6
    )
    assert converted == pytest.approx(accountant.get_epsilon(1e-6), rel=1e-9)
    config = pmixed.PMixEDConfig(alpha=3.0, beta=0.001, sampling_rate=0.5, num_teachers=10)
    steps = 40
    rdp = steps * pmixed.token_rdp(config)
    expected = rdp + math.log1p(-1 / 3.0) - math.log(1e-6 * 3.0) / 2.0
    assert pmixed.epsilon(config, steps=steps, delta=1e-6) == pytest.approx(expected, rel=1e-12)
    weight = (1 - 0.5**10) / 10
    divergence = 25 * 0.001 / 2
    assert pmixed.token_rdp(config) == pytest.approx(
        math.log(1 + weight * (math.exp(2 * divergence) - 1)) / 2, rel=1e-12
    )
    assert pmixed.epsilon(config, steps=0, delta=1e-6) == 0.0


@pytest.mark.parametrize(
    ("target", "tokens", "n", "q"), [(8.0, 64, 20, 0.3), (2.0, 16, 8, 1.0), (1.0, 100, 50, 0.05)]
)
def test_calibrate_meets_the_target_tightly(target, tokens, n, q):
    config = pmixed.calibrate(
        epsilon=target, delta=1e-6, max_new_tokens=tokens, num_teachers=n, sampling_rate=q
    )
    spent = pmixed.epsilon(config, steps=tokens, delta=1e-6)
    assert spent <= target * (1 + 1e-9)
    assert spent >= 0.99 * target
    assert config.alpha in pmixed.ORDERS
    for order in pmixed.ORDERS:
        try:
            other = pmixed.calibrate(
                epsilon=target,
                delta=1e-6,
                max_new_tokens=tokens,
                num_teachers=n,
                sampling_rate=q,
                alpha=order,
            )
        except ValueError:
            continue
        assert other.beta <= config.beta
    louder = dataclasses.replace(config, beta=config.beta * 1.05)
    assert pmixed.epsilon(louder, steps=tokens, delta=1e-6) > target


def test_calibrate_rejects_unreachable_target():
    with pytest.raises(ValueError, match="cannot be met"):
        pmixed.calibrate(epsilon=1e-3, delta=1e-9, max_new_tokens=10, num_teachers=5, alpha=2.0)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"alpha": 1.0}, "alpha"),
        ({"beta": -1.0}, "beta"),
        ({"sampling_rate": 0.0}, "sampling_rate"),
        ({"num_teachers": 0}, "num_teachers"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"bisection_iterations": 0}, "bisection_iterations"),
    ],
)
def test_bad_config_is_one_clear_error(changes, field):
    settings_ = {"alpha": 2.0, "beta": 0.1, "num_teachers": 3, **changes}
    with pytest.raises(ValueError, match=field):
        pmixed.PMixEDConfig(**settings_)


def make_ensemble():
    rng = np.random.default_rng(3)
    table = rng.normal(size=(3, 5, 5)).astype(np.float32)
    table[:, :, 4] += 1.5
    public = rng.normal(size=(5, 5)).astype(np.float32)
    return TableTeachers(jnp.asarray(table)), lambda prefix: jnp.asarray(public[prefix[-1]])


def test_generate_stops_counts_and_reproduces():
    teachers, public_model = make_ensemble()
    config = pmixed.PMixEDConfig(alpha=2.0, beta=0.5, num_teachers=3, max_new_tokens=12)
    first = pmixed.generate(
        teachers, public_model, prompt=[0], config=config, key=jax.random.key(5)
    )
    again = pmixed.generate(
        teachers, public_model, prompt=[0], config=config, key=jax.random.key(5)
    )
    assert first.tokens == again.tokens
    assert first.seeded
    assert first.stop_reason == "max_new_tokens" and len(first.tokens) == 12
    assert first.teacher_forward_passes == 36 and first.public_forward_passes == 12
    assert first.epsilon == pytest.approx(pmixed.epsilon(config, steps=12, delta=1e-5))
    stopped = [
        pmixed.generate(
            teachers, public_model, prompt=[0], config=config, key=jax.random.key(s), eos_id=4
        )
        for s in range(6)
    ]
    ended = [r for r in stopped if r.stop_reason == "eos"]
    assert ended
    for result in ended:
        assert result.tokens[-1] == 4 and 4 not in result.tokens[:-1]
        assert result.teacher_forward_passes == 3 * len(result.tokens)
        assert result.private_steps == len(result.tokens)
        assert result.epsilon < first.epsilon or len(result.tokens) == 12
    secret = pmixed.generate(teachers, public_model, prompt=[0], config=config)
    assert not secret.seeded


def test_generate_stop_sequence_and_wrong_ensemble():
    teachers, public_model = make_ensemble()
    config = pmixed.PMixEDConfig(alpha=2.0, beta=0.5, num_teachers=3, max_new_tokens=30)
    result = pmixed.generate(
        teachers,
        public_model,
        prompt=[0],
        config=config,
        key=jax.random.key(1),
        stop_sequences=[(4,)],
    )
    assert result.stop_reason == "stop_sequence" and result.tokens[-1] == 4
    wrong = pmixed.PMixEDConfig(alpha=2.0, beta=0.5, num_teachers=4)
    with pytest.raises(ValueError, match="num_teachers"):
        pmixed.generate(teachers, public_model, prompt=[0], config=wrong, key=jax.random.key(1))
