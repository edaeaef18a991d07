"""The float64 accumulation of clipped sums and its rounding bound (`privacy.summation`)."""

import fractions

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpmix_jax.privacy import clipping, summation
from dpmix_jax.privacy.ghost import ghost_clipped_grad_sum
from tests.privacy.test_adversarial_clipping import cancelling, dense_taped


def test_unit_roundoffs():
    assert summation.unit_roundoff(jnp.float32) == 2.0**-24
    assert summation.unit_roundoff(jnp.float64) == 2.0**-53
    assert summation.unit_roundoff(jnp.bfloat16) == 2.0**-8
    assert summation.output_roundoff({"a": jnp.zeros(2, jnp.bfloat16)}) == 2.0**-24


def test_float64_gamma_is_highams_and_refuses_useless_lengths():
    assert summation.float64_gamma(1000) == pytest.approx(1000 * 2.0**-53 / (1 - 1000 * 2.0**-53))
    with pytest.raises(ValueError, match="no useful rounding bound"):
        summation.float64_gamma(2**52)


def test_effective_clip_norm_is_c_over_one_plus_two_eta():
    u = 2.0**-24
    for units, release, roundings in [(1, None, 2), (1040, None, 2), (8192, 262_144, 3)]:
        eta = roundings * u * (release or units) * (1 + u)
        expected = 1.0 / (1.0 + 2.0 * eta)
        value = float(summation.effective_clip_norm(1.0, units, u, release))
        # A traced release size computes C' in float32: within the clip factor's 2⁻²⁰ slack.
        assert value == pytest.approx(expected, rel=1e-15 if release is None else 2.0**-22)
    # 2.5e-4 for 1,040 units, 6% for 262,144 (the figures of the module docstring).
    assert 1 - summation.effective_clip_norm(1.0, 1040, u) == pytest.approx(2.48e-4, rel=1e-2)
    assert 1 - summation.effective_clip_norm(1.0, 262_144, u) == pytest.approx(0.0588, rel=1e-2)
    with pytest.raises(ValueError, match="roundings >= 1"):
        summation.rounding_slack(4, u, roundings=0)


def _exact_sum(column) -> fractions.Fraction:
    return sum((fractions.Fraction(float(x)) for x in column), fractions.Fraction(0))


@settings(max_examples=20, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**16),
    units=st.integers(1, 300),
    spread=st.floats(0.0, 30.0),
)
def test_sum_units_is_within_its_float64_bound_and_rounds_once(seed, units, spread):
    # Magnitudes over 10^±spread: a float32 running sum would lose the small terms entirely.
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((units, 3)) * 10.0 ** rng.uniform(-spread, spread, (units, 3))
    x = x.astype(np.float32)
    wide = summation.sum_units({"x": jnp.asarray(x)})
    assert wide["x"].dtype == jnp.float64
    out = summation.rounded(wide, {"x": jnp.zeros(3, jnp.bfloat16)})["x"]
    assert out.dtype == jnp.float32
    gamma = summation.float64_gamma(units)
    for k in range(3):
        exact = _exact_sum(x[:, k])
        bound = gamma * float(np.sum(np.abs(x[:, k].astype(np.float64))))
        assert abs(fractions.Fraction(float(wide["x"][k])) - exact) <= fractions.Fraction(bound)
        # One rounding into float32: within half an ulp of the float64 sum.
        assert float(out[k]) == float(np.float32(float(wide["x"][k])))


def test_accumulation_scope_does_not_reach_the_loss():
    # The loss is traced outside the float64 scope: its defaults stay 32-bit.
    seen = []

    def loss(w, example):
        seen.append(jnp.asarray(1.0).dtype)
        return jnp.sum(example["x"] @ w)

    grad_sum = clipping.clipped_grad_sum(loss, clip_norm=1.0, microbatch_size=2)
    total, _ = jax.jit(grad_sum.function)(jnp.ones((3, 2)), {"x": jnp.ones((4, 3))}, np.ones(4))
    assert total.dtype == jnp.float32 and seen and set(seen) == {np.dtype(np.float32)}
    assert jnp.asarray(1.0).dtype == jnp.float32  # and nothing leaks after the call


def test_a_cancelling_unit_is_clipped_by_its_share_of_the_accumulation():
    # Rows of magnitude ~1e12 that cancel to ~1e8: the unit's clip bound must cover
    # γ⁶⁴_K · Σ_t |x_t||v_t| / u (computed here independently) as well as its norm.
    # With 4,096 units the share (2⁻²⁹·K·mass) exceeds the Gram form's rounding bound.
    x, v = cancelling(np.random.default_rng(3), 4096, 2, 8, 8, scale=1e12, close=1e-7)
    fn = jax.jit(ghost_clipped_grad_sum(dense_taped, clip_norm=1.0).function)
    _, stats = fn({"w": jnp.zeros((8, 8))}, {"x": x, "v": v}, np.ones(4096, bool))
    x64, v64 = x.astype(np.float64), v.astype(np.float64)
    mass = np.sum(np.linalg.norm(x64, axis=2) * np.linalg.norm(v64, axis=2), axis=1)
    terms = 4096 * 2 + 1
    share = mass * (terms * 2.0**-53) / (1 - terms * 2.0**-53) / 2.0**-24
    norms = np.sqrt(np.sum(np.einsum("bti,btj->bij", x64, v64) ** 2, axis=(1, 2)))
    assert np.all(stats["grad_norm"] >= share * (1 - 1e-6))
    assert np.all(stats["grad_norm"] >= norms)
