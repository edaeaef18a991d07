"""Tests for the common source type, splits, user sampling and λ-mixtures."""

import numpy as np
import pytest
from scipy import stats

from dpmix_jax.data import mixture, sources


def _array_source(n=10, users=None):
    rng = np.random.default_rng(0)
    arrays = {"x": rng.normal(size=(n, 3, 2)).astype(np.float32), "y": np.arange(n)}
    return sources.ArraySource(arrays, user_ids=users)


def test_gather_matches_getitem_and_zero_fills_padding():
    src = _array_source()
    idx = np.array([3, -1, 0, 9, -1])
    batch = src.gather(idx)
    assert batch["x"].shape == (5, 3, 2) and batch["y"].shape == (5,)
    for row, i in enumerate(idx):
        if i < 0:
            assert not batch["x"][row].any() and batch["y"][row] == 0
        else:
            np.testing.assert_array_equal(batch["x"][row], src[int(i)]["x"])
            assert batch["y"][row] == i
    np.testing.assert_array_equal(sources.padding_mask(idx), idx >= 0)
    all_pad = src.gather(np.full(4, -1))
    assert all_pad["x"].shape == (4, 3, 2) and not all_pad["x"].any()


@pytest.mark.parametrize("bad", [np.array([10]), np.array([-2]), np.array([[0]]), np.array([0.5])])
def test_gather_rejects_bad_indices(bad):
    with pytest.raises(ValueError, match="indices"):
        _array_source().gather(bad)


def test_array_source_validation():
    with pytest.raises(ValueError, match="leading dimension"):
        sources.ArraySource({"a": np.zeros(3), "b": np.zeros(4)})
    with pytest.raises(ValueError, match="user_ids"):
        sources.ArraySource({"a": np.zeros(3)}, user_ids=np.zeros(2, dtype=int))


def test_subset_source_follows_indices_and_users():
    users = np.array([0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    src = _array_source(users=users)
    sub = sources.SubsetSource(src, np.array([7, 2, 5]))
    assert len(sub) == 3
    np.testing.assert_array_equal(sub.user_ids, users[[7, 2, 5]])
    np.testing.assert_array_equal(sub.gather(np.array([2, -1, 0]))["y"], [5, 0, 7])


def test_random_split_partitions_and_is_seeded():
    parts = sources.random_split(101, (0.5, 0.3, 0.2), seed=3)
    joined = np.concatenate(parts)
    np.testing.assert_array_equal(np.sort(joined), np.arange(101))
    # Cut points are the rounded cumulative fractions: round(50.5) = 50, round(80.8) = 81.
    assert [len(p) for p in parts] == [50, 31, 20]
    again = sources.random_split(101, (0.5, 0.3, 0.2), seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))
    other = sources.random_split(101, (0.5, 0.3, 0.2), seed=4)
    assert not np.array_equal(parts[0], other[0])
    with pytest.raises(ValueError, match="sum to 1"):
        sources.random_split(10, (0.5, 0.6), seed=0)


def test_group_disjoint_split_never_shares_a_group():
    rng = np.random.default_rng(1)
    groups = rng.integers(0, 40, size=500)
    parts = sources.group_disjoint_split(groups, (0.7, 0.2, 0.1), seed=0)
    np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(500))
    group_sets = [set(groups[p].tolist()) for p in parts]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not group_sets[a] & group_sets[b]
    again = sources.group_disjoint_split(groups, (0.7, 0.2, 0.1), seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_adding_a_group_moves_no_other_group_and_sizes_follow_the_fractions():
    groups = np.repeat(np.arange(1000), 2)

    def part_of_each_group(ids):
        parts = sources.group_disjoint_split(ids, (0.7, 0.2, 0.1), seed=3)
        return {int(g): k for k, part in enumerate(parts) for g in ids[part]}

    before = part_of_each_group(groups)
    after = part_of_each_group(np.concatenate([groups, [1000, 1000, 1000]]))
    assert all(after[g] == k for g, k in before.items())
    counts = np.bincount(list(before.values()), minlength=3)
    assert np.all(np.abs(counts - np.array([700, 200, 100])) < 4 * np.sqrt(1000 * 0.25))
    assert len(sources.group_disjoint_split(groups, (0.5, 0.0, 0.5), seed=0)[1]) == 0


def test_group_index_sample_caps_and_stays_within_group():
    users = np.array([5, 1, 5, 5, 9, 1, 5, 5])
    index = sources.GroupIndex.from_ids(users)
    np.testing.assert_array_equal(index.groups, [1, 5, 9])
    np.testing.assert_array_equal(index.counts, [2, 5, 1])
    out = index.sample(np.array([1, -1, 0, 2]), 3, np.random.default_rng(0))
    assert out.shape == (4, 3)
    assert (out[1] == -1).all()
    for row, group in ((0, 5), (2, 1), (3, 9)):
        members = out[row][out[row] >= 0]
        assert len(members) == min(3, (users == group).sum())
        assert len(set(members.tolist())) == len(members)
        assert (users[members] == group).all()
    # Over many draws every member of the large group is chosen with probability 3/5.
    rng = np.random.default_rng(1)
    counts = np.zeros(len(users))
    for _ in range(2000):
        np.add.at(counts, index.sample(np.array([1]), 3, rng)[0], 1)
    np.testing.assert_allclose(counts[users == 5] / 2000, 0.6, atol=0.05)


def test_check_weights_rejects_bad_mixtures():
    for bad in ([0.5, 0.6], [1.2, -0.2], [np.nan, 1.0], [1.0]):
        with pytest.raises(ValueError, match="weights"):
            mixture.check_weights(bad, 2)
    np.testing.assert_array_equal(mixture.check_weights([[0.2, 0.8], [1, 0]], 2).shape, (2, 2))


def test_soft_targets_equal_naive_sum():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, size=(20, 4)).astype(np.float32)
    lam = np.array([0.1, 0.2, 0.3, 0.4])
    naive = np.array([sum(lam[i] * labels[j, i] for i in range(4)) for j in range(20)])
    np.testing.assert_allclose(mixture.soft_targets(labels, lam), naive, rtol=1e-6)
    lams = np.array([lam, [0, 0, 0, 1.0]])
    out = mixture.soft_targets(labels, lams)
    assert out.shape == (20, 2)
    np.testing.assert_array_equal(out[:, 1], labels[:, 3])
    src = mixture.SoftTargetSource(sources.ArraySource({"labels": labels}), lam)
    np.testing.assert_allclose(src.gather(np.array([4, -1]))["target"], [naive[4], 0.0], rtol=1e-6)


def test_draw_mixture_frequencies_match_weights():
    lam = np.array([0.5, 0.0, 0.2, 0.3])
    sizes = [3, 5, 7, 2]
    src_ids, within = mixture.draw_mixture(sizes, lam, 20000, rng=np.random.default_rng(0))
    counts = np.bincount(src_ids, minlength=4)
    assert counts[1] == 0
    assert stats.chisquare(counts[[0, 2, 3]], 20000 * lam[[0, 2, 3]]).pvalue > 1e-3
    assert (within < np.array(sizes)[src_ids]).all() and (within >= 0).all()
    within_2 = within[src_ids == 2]
    assert stats.chisquare(np.bincount(within_2, minlength=7)).pvalue > 1e-3
    with pytest.raises(ValueError, match="no examples"):
        mixture.draw_mixture([3, 0], [0.5, 0.5], 10, rng=np.random.default_rng(0))


def test_mixture_source_returns_the_drawn_examples():
    a = sources.ArraySource({"v": np.arange(5) * 10.0})
    b = sources.ArraySource({"v": np.arange(3) * -1.0 - 1})
    mix = mixture.MixtureSource([a, b], [0.4, 0.6], num_examples=50, seed=0)
    batch = mix.gather(np.arange(50))
    for v, s in zip(batch["v"], batch["source"], strict=True):
        assert (v >= 0) if s == 0 else (v < 0)
        assert v in (a.arrays["v"] if s == 0 else b.arrays["v"])
    again = mixture.MixtureSource([a, b], [0.4, 0.6], num_examples=50, seed=0)
    np.testing.assert_array_equal(again.gather(np.arange(50))["v"], batch["v"])
    np.testing.assert_array_equal(mix.gather(np.array([7, -1]))["v"], [batch["v"][7], 0.0])


def test_allot_token_budget_sums_exactly_and_is_proportional():
    rng = np.random.default_rng(0)
    for _ in range(50):
        lam = rng.dirichlet(np.ones(6))
        total = int(rng.integers(0, 10_000))
        out = mixture.allot_token_budget(total, lam)
        assert out.sum() == total
        assert (np.abs(out - lam * total) < 1).all()
    np.testing.assert_array_equal(mixture.allot_token_budget(10, [1 / 3, 1 / 3, 1 / 3]), [4, 3, 3])


def test_tfds_sources_under_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    from dpmix_jax.data import tfds_sources

    with tfds.testing.mock_data(num_examples=6, policy=tfds.testing.MockPolicy.USE_CODE):
        raw = tfds.data_source("cifar100", split="train")
        src = tfds_sources.cifar100_source("train", label="coarse_label")
        batch = src.gather(np.array([4, -1, 0]))
        assert batch["image"].shape == (3, 32, 32, 3) and batch["image"].dtype == np.float32
        np.testing.assert_allclose(batch["image"][0], raw[4]["image"] / 255.0)
        assert batch["label"][2] == raw[0]["coarse_label"] and not batch["image"][1].any()
        imagenet = tfds_sources.imagenet_source("validation", image_size=16)
        assert len(imagenet) == 6
        image = imagenet[2]["image"]
        assert image.shape == (16, 16, 3) and 0.0 <= image.min() <= image.max() <= 1.0
    with pytest.raises(ValueError, match="label"):
        tfds_sources.cifar100_source(label="fine")


def test_resize_center_crop_keeps_the_centre():
    from dpmix_jax.data.tfds_sources import _resize_center_crop

    image = np.zeros((40, 20, 3), dtype=np.uint8)
    image[10:30] = 255  # the centre 20x20 square is white, top and bottom bands black
    out = _resize_center_crop(image, 10)
    assert out.shape == (10, 10, 3)
    # Bilinear filtering blends only the crop's edge rows with the black bands outside it.
    np.testing.assert_array_equal(out[1:-1], 255)
    assert out[[0, -1]].min() > 127
