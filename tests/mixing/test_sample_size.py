"""The mixture-size guide: monotone bound, regime switch at the hand-computed crossover, the
paper's operating points, and clear errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpmix_jax import mixing
from dpmix_jax.mixing import sample_size

DELTA = 1e-5


def test_bound_terms_match_a_hand_computation():
    terms = mixing.excess_loss_bound(10_000, k=8, epsilon=0.5, delta=DELTA)
    assert terms.statistical == pytest.approx(math.sqrt(math.log(8) / 10_000))
    assert terms.privacy == pytest.approx(math.sqrt(math.log(8) * math.log(1e5)) / 5_000)
    scaled = mixing.excess_loss_bound(
        10_000, k=8, epsilon=0.5, delta=DELTA, loss_scale=3.0, clip_norm=2.0
    )
    assert scaled.statistical == pytest.approx(3 * terms.statistical)
    assert scaled.privacy == pytest.approx(2 * terms.privacy)


def test_bound_decreases_in_n_and_epsilon_and_grows_with_k():
    ns = np.geomspace(10, 1e7, 30)
    totals = [mixing.excess_loss_bound(n, k=14, epsilon=1.0, delta=DELTA).total for n in ns]
    assert np.all(np.diff(totals) < 0)
    by_eps = [
        mixing.excess_loss_bound(5_000, k=14, epsilon=e, delta=DELTA).total
        for e in (0.1, 0.2, 1.0, 5.0)
    ]
    assert np.all(np.diff(by_eps) < 0)
    by_k = [mixing.excess_loss_bound(5_000, k=k, epsilon=1.0, delta=DELTA).total for k in (2, 16)]
    assert by_k[0] < by_k[1]


def test_sufficient_size_is_the_smallest_n_reaching_alpha_and_monotone():
    for alpha, epsilon in ((1e-2, 1.0), (1e-3, 0.2), (0.05, 0.01)):
        guide = mixing.sufficient_mixture_size(k=14, alpha=alpha, epsilon=epsilon, delta=DELTA)
        n = guide.num_units
        bound = lambda m, e=epsilon: mixing.excess_loss_bound(m, k=14, epsilon=e, delta=DELTA)
        assert bound(n).total <= alpha * (1 + 1e-9) < bound(n - 1).total
        assert guide.terms.total == pytest.approx(bound(n).total)
    sizes = [
        mixing.sufficient_mixture_size(k=14, alpha=1e-2, epsilon=e, delta=DELTA).num_units
        for e in (0.05, 0.2, 1.0, 5.0)
    ]
    assert np.all(np.diff(sizes) < 0)
    by_alpha = [
        mixing.sufficient_mixture_size(k=14, alpha=a, epsilon=1.0, delta=DELTA).num_units
        for a in (1e-3, 1e-2, 1e-1)
    ]
    assert np.all(np.diff(by_alpha) < 0)


def test_regime_switches_where_the_terms_cross():
    # Terms equal at sqrt(n) = sqrt(log(1/δ))/ε: n× = log(1e5)/0.01² = 115,129.25 at ε = 0.01.
    crossover = mixing.crossover_units(epsilon=0.01, delta=DELTA)
    assert crossover == pytest.approx(math.log(1e5) / 1e-4)
    assert crossover == pytest.approx(115_129.25, abs=0.01)
    terms = mixing.excess_loss_bound(crossover, k=5, epsilon=0.01, delta=DELTA)
    assert terms.statistical == pytest.approx(terms.privacy)
    below = mixing.excess_loss_bound(115_000, k=5, epsilon=0.01, delta=DELTA)
    above = mixing.excess_loss_bound(115_300, k=5, epsilon=0.01, delta=DELTA)
    assert (below.limited_by, above.limited_by) == ("privacy", "statistics")
    # α at the crossover is 2·sqrt(log 5 / n×) = 0.00747: a slightly larger α needs fewer units
    # than n× (privacy-limited), a slightly smaller one more (statistics-limited).
    alpha_cross = 2 * math.sqrt(math.log(5) / crossover)
    loose = mixing.sufficient_mixture_size(k=5, alpha=alpha_cross * 1.01, epsilon=0.01, delta=DELTA)
    tight = mixing.sufficient_mixture_size(k=5, alpha=alpha_cross * 0.99, epsilon=0.01, delta=DELTA)
    assert loose.num_units < crossover < tight.num_units
    assert (loose.limited_by, tight.limited_by) == ("privacy", "statistics")
    assert loose.crossover_units == pytest.approx(crossover)
    # With clip norm C and loss scale B the crossover moves to (C/B)²·log(1/δ)/ε²: C = 10,
    # B = 2, ε = 1 gives 25·log(1e5) = 287.82.
    moved = mixing.crossover_units(epsilon=1.0, delta=DELTA, loss_scale=2.0, clip_norm=10.0)
    assert moved == pytest.approx(25 * math.log(1e5))
    for n, regime in ((280, "privacy"), (295, "statistics")):
        terms = mixing.excess_loss_bound(
            n, k=3, epsilon=1.0, delta=DELTA, loss_scale=2.0, clip_norm=10.0
        )
        assert terms.limited_by == regime


def test_the_papers_operating_points():
    # Language (OpenWebMath, k = 16 domains, ε = 1, ρ = 0.1): about 2.8M tokens for α ≈ 0.001.
    language = mixing.sufficient_mixture_size(k=16, alpha=1e-3, epsilon=1.0, delta=DELTA)
    assert language.num_units == pytest.approx(2.8e6, rel=0.01)
    assert language.limited_by == "statistics"
    owm = mixing.sufficient_mixture_size(k=16, alpha=1e-3, epsilon=1.0, delta=DELTA, clip_norm=0.2)
    assert owm.num_units == pytest.approx(2.8e6, rel=0.01)
    # Vision (NIH, k = 14, ε = 1, ρ = 0.1 of 89,696 training images): 8,970 examples for
    # α ≈ 0.01. With B = C = 1 the bound there is 0.018 (same order); B = C = 0.563 gives 0.01.
    at_vision = mixing.excess_loss_bound(8_970, k=14, epsilon=1.0, delta=DELTA)
    assert 0.01 < at_vision.total < 0.02
    vision = mixing.sufficient_mixture_size(
        k=14, alpha=1e-2, epsilon=1.0, delta=DELTA, loss_scale=0.563, clip_norm=0.563
    )
    assert vision.num_units == pytest.approx(8_970, rel=0.002)
    assert vision.limited_by == "statistics"
    assert vision.mix_fraction(89_696) == pytest.approx(0.1, rel=0.002)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(k=1, alpha=0.01, epsilon=1.0, delta=DELTA), "k"),
        (dict(k=2.5, alpha=0.01, epsilon=1.0, delta=DELTA), "k"),
        (dict(k=4, alpha=0.0, epsilon=1.0, delta=DELTA), "alpha"),
        (dict(k=4, alpha=0.01, epsilon=-1.0, delta=DELTA), "epsilon"),
        (dict(k=4, alpha=0.01, epsilon=1.0, delta=1.0), "delta"),
        (dict(k=4, alpha=0.01, epsilon=1.0, delta=DELTA, loss_scale=math.inf), "loss_scale"),
        (dict(k=4, alpha=0.01, epsilon=1.0, delta=DELTA, clip_norm=0), "clip_norm"),
    ],
)
def test_bad_arguments_name_themselves(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} "):
        mixing.sufficient_mixture_size(**kwargs)


def test_mix_fraction_and_bound_errors():
    guide = sample_size.sufficient_mixture_size(k=4, alpha=0.01, epsilon=1.0, delta=DELTA)
    assert guide.mix_fraction(10 * guide.num_units) == pytest.approx(0.1)
    with pytest.raises(ValueError, match="total_units"):
        guide.mix_fraction(guide.num_units - 1)
    with pytest.raises(ValueError, match="total_units"):
        guide.mix_fraction(0)
    with pytest.raises(ValueError, match="num_units"):
        mixing.excess_loss_bound(0, k=4, epsilon=1.0, delta=DELTA)
