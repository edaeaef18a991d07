"""Hot PATE's calibration refuses a run whose unanimous token is rarely released
(`hot_pate_method.WeakReleaseError`), and names the fewest teachers that would reach the floor."""

import pytest

from dpmix_jax.pate import hot_pate_method
from dpmix_jax.pate.method import RunSettings

SMOLLM2_VOCAB = 49_152


def _run(**overrides) -> RunSettings:
    settings = dict(
        epsilon=1.0,
        delta=1e-5,
        num_samples=4,
        max_new_tokens=16,
        num_teachers=32,
        vocab_size=SMOLLM2_VOCAB,
        public_candidates=16,
        min_unanimous_release=0.5,
    )
    return RunSettings(**{**settings, **overrides})


@pytest.mark.parametrize("aggregator", ["confident_gnmax", "dpargmax_laplace"])
def test_the_named_number_of_teachers_is_the_fewest_that_reach_the_floor(aggregator):
    with pytest.raises(hot_pate_method.WeakReleaseError) as refused:
        hot_pate_method.COORDINATED.calibrate(_run(aggregator=aggregator))
    needed = refused.value.needed
    assert needed is not None and needed > 32
    assert refused.value.probability < 0.5
    assert f"at least {needed} teachers" in str(refused.value)
    assert "\n" not in str(refused.value)

    plan = hot_pate_method.COORDINATED.calibrate(_run(aggregator=aggregator, num_teachers=needed))
    assert plan.mechanism["unanimous_release_probability"] >= 0.5
    with pytest.raises(hot_pate_method.WeakReleaseError):
        hot_pate_method.COORDINATED.calibrate(_run(aggregator=aggregator, num_teachers=needed - 1))


def test_the_noise_does_not_depend_on_the_number_of_teachers():
    """The search for the fewest teachers keeps the noise fixed: one teacher moves one vote
    whatever n is, so the calibration must give the same noise at every n."""
    small = hot_pate_method.COORDINATED.calibrate(_run(num_teachers=8, min_unanimous_release=0))
    large = hot_pate_method.COORDINATED.calibrate(_run(num_teachers=512))
    assert (small.config.sigma1, small.config.sigma2) == (large.config.sigma1, large.config.sigma2)


def test_a_floor_of_zero_accepts_any_calibration_and_dpws_is_never_refused():
    plan = hot_pate_method.INDEPENDENT.calibrate(_run(num_teachers=2, min_unanimous_release=0))
    assert plan.mechanism["unanimous_release_probability"] < 0.05
    # DPWS releases only tokens some teacher voted for: no near-uniform picks to refuse.
    dpws = hot_pate_method.COORDINATED.calibrate(
        _run(aggregator="dpws", num_teachers=2, min_unanimous_release=1.0)
    )
    assert dpws.mechanism["unanimous_release_probability"] is None


def test_a_floor_beyond_the_search_says_so(monkeypatch):
    monkeypatch.setattr(hot_pate_method, "_MOST_TEACHERS_SEARCHED", 64)
    with pytest.raises(hot_pate_method.WeakReleaseError, match="far more teachers") as refused:
        hot_pate_method.COORDINATED.calibrate(_run(num_teachers=16))
    assert refused.value.needed is None


def test_the_command_line_message_names_its_options():
    with pytest.raises(hot_pate_method.WeakReleaseError) as refused:
        hot_pate_method.COORDINATED.calibrate(_run())
    flags = refused.value.message(flags=True)
    for option in ("--num-teachers", "--epsilon", "--num-samples", "--min-unanimous-release"):
        assert option in flags
    assert "min_unanimous_release" in str(refused.value)


@pytest.mark.parametrize("floor", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_a_floor_outside_the_unit_interval_is_refused(floor):
    with pytest.raises(ValueError, match="min_unanimous_release must be in"):
        _run(min_unanimous_release=floor)
