"""Tests for the embedded offline defaults (MNIST-5k label mixtures, text domains with users)."""

import numpy as np
import pytest
from scipy import stats

from dpmix_jax.data import builtin


@pytest.fixture(scope="module")
def digit_task():
    return builtin.load_digit_mixture_task(seed=0, image_size=16, num_tasks=2)


def test_digit_task_shapes_and_determinism(digit_task):
    t = digit_task
    k = len(builtin.DIGIT_LABEL_SOURCES)
    assert (
        k >= 10
        and t.public_images.shape == (3000, 16, 16, 1)
        and t.public_labels.shape == (3000, k)
    )
    assert sum(len(s) for s in t.sensitive.values()) == 2000
    assert t.true_weights.shape == (2, k)
    np.testing.assert_allclose(t.true_weights.sum(axis=1), 1.0)
    assert ((t.true_weights > 0).sum(axis=1) == 3).all()
    again = builtin.load_digit_mixture_task(seed=0, image_size=16, num_tasks=2)
    np.testing.assert_array_equal(again.sensitive["val"].labels, t.sensitive["val"].labels)
    np.testing.assert_array_equal(again.public_images, t.public_images)
    other = builtin.load_digit_mixture_task(seed=1, image_size=16, num_tasks=2)
    assert not np.array_equal(other.true_weights, t.true_weights)
    batch = t.public_source().gather(np.array([5, -1]))
    np.testing.assert_array_equal(batch["labels"][0], t.public_labels[5])


def test_digit_label_functions_follow_their_definitions(digit_task):
    t = digit_task
    for i, members in enumerate(builtin.DIGIT_SETS.values()):
        np.testing.assert_array_equal(t.public_labels[:, i], np.isin(t.public_digits, members))
    # Image-statistic rules are thresholded at the public medians: about half the pool each.
    stat_cols = t.public_labels[:, len(builtin.DIGIT_SETS) :]
    np.testing.assert_allclose(stat_cols.mean(axis=0), 0.5, atol=0.01)
    # Labels overlap: the uniform mixture target is not constant, and the sources are identifiable.
    uniform = t.public_labels.mean(axis=1)
    assert uniform.std() > 0.1
    assert np.linalg.matrix_rank(t.public_labels) == t.public_labels.shape[1]


def test_sensitive_labels_follow_the_true_mixture(digit_task):
    t = digit_task
    for split in t.sensitive.values():
        np.testing.assert_allclose(
            split.label_probs, split.source_labels @ t.true_weights.T, rtol=1e-6
        )
        assert split.images.shape[1:] == (16, 16, 1) and set(np.unique(split.labels)) <= {0, 1}
    labels = np.concatenate([s.labels for s in t.sensitive.values()])
    probs = np.concatenate([s.label_probs for s in t.sensitive.values()])
    # Bernoulli(p) labels: the total count is within 4 standard deviations of Σ p, per task.
    z = (labels.sum(0) - probs.sum(0)) / np.sqrt((probs * (1 - probs)).sum(0))
    assert (np.abs(z) < 4).all()
    # Calibration by bins of p: the empirical rate tracks the drawn mean.
    for lo in (0.0, 0.3, 0.6):
        sel = (probs >= lo) & (probs < lo + 0.3)
        if sel.sum() > 100:
            assert abs(labels[sel].mean() - probs[sel].mean()) < 0.06


def test_public_and_sensitive_pools_are_disjoint(digit_task):
    t = digit_task
    public = {img.tobytes() for img in t.public_images}
    for split in t.sensitive.values():
        assert not public & {img.tobytes() for img in split.images}
    keys = [{img.tobytes() for img in s.images} for s in t.sensitive.values()]
    assert not keys[0] & keys[1] and not keys[0] & keys[2] and not keys[1] & keys[2]


def test_given_true_weights_are_used_and_checked():
    k = len(builtin.DIGIT_LABEL_SOURCES)
    lam = np.zeros(k)
    lam[builtin.DIGIT_LABEL_SOURCES.index("even")] = 1.0
    t = builtin.load_digit_mixture_task(seed=3, true_weights=lam)
    train = t.sensitive["train"]
    np.testing.assert_array_equal(train.labels[:, 0], train.digits % 2 == 0)
    with pytest.raises(ValueError, match="weights"):
        builtin.load_digit_mixture_task(true_weights=np.ones(k))


@pytest.fixture(scope="module")
def text_task():
    return builtin.load_text_mixture_task(
        seed=0, num_canaries=2, canary_repeats=3, email_style=False
    )


def test_text_task_domains_and_disjointness(text_task):
    t = text_task
    assert len(t.domain_names) >= 6 and set(t.public_domains) == set(t.domain_names)
    assert all(len(docs) >= 100 for docs in t.public_domains.values())
    public = {doc for docs in t.public_domains.values() for doc in docs}
    drawn = t.document_domains >= 0
    sensitive = [doc for doc, keep in zip(t.sensitive.texts, drawn, strict=True) if keep]
    assert not public & set(sensitive) and len(set(sensitive)) == len(sensitive)
    # Each drawn document comes from the held-out part of the domain it is labelled with.
    code = t.domain_names.index("python_code")
    for doc, d in zip(t.sensitive.texts, t.document_domains, strict=True):
        if d == code:
            assert (
                "def " in doc or "import " in doc or "class " in doc or '"""' in doc or "#" in doc
            )
    again = builtin.load_text_mixture_task(
        seed=0, num_canaries=2, canary_repeats=3, email_style=False
    )
    assert again.sensitive.texts == t.sensitive.texts
    np.testing.assert_array_equal(again.user_weights, t.user_weights)


def test_held_out_domains_are_the_pool_the_sensitive_corpus_is_drawn_from(text_task):
    held_out = builtin.held_out_domains(seed=0)
    assert list(held_out) == list(text_task.domain_names)
    for name, docs in held_out.items():
        assert docs and not set(docs) & set(text_task.public_domains[name])
    for doc, d in zip(text_task.sensitive.texts, text_task.document_domains, strict=True):
        if d >= 0:
            assert doc in held_out[text_task.domain_names[d]]
    assert builtin.held_out_domains(seed=1) != held_out
    with pytest.raises(ValueError, match="holdout_fraction"):
        builtin.held_out_domains(holdout_fraction=1.0)


def test_user_mixtures_match_the_drawn_domains():
    t = builtin.load_text_mixture_task(
        seed=2, num_users=40, documents_per_user=(6, 6), holdout_fraction=0.6
    )
    np.testing.assert_allclose(t.user_weights.sum(axis=1), 1.0)
    np.testing.assert_allclose(t.population_weights.sum(), 1.0)
    assert (t.user_weights[:, t.population_weights == 0] == 0).all()
    user_ids = np.asarray(t.sensitive.user_ids)
    expected = np.zeros(len(t.domain_names))
    observed = np.bincount(t.document_domains, minlength=len(t.domain_names))
    for u in range(40):
        domains = t.document_domains[user_ids == u]
        assert len(domains) == 6 and (t.user_weights[u, domains] > 0).all()
        expected += 6 * t.user_weights[u]
    support = expected > 0
    assert stats.chisquare(observed[support], expected[support]).pvalue > 1e-3
    # User mixtures are Dirichlet draws around the population mixture (mean = population).
    assert np.abs(t.user_weights.mean(axis=0) - t.population_weights).max() < 0.1


def test_canaries_are_planted_only_where_recorded(text_task):
    t = text_task
    assert len(t.canaries) == 2 and len(t.reference_canaries) == 2
    user_ids = np.asarray(t.sensitive.user_ids)
    for canary in t.canaries:
        assert len(canary.document_indices) == 3
        holders = [i for i, doc in enumerate(t.sensitive.texts) if canary.text in doc]
        assert holders == list(canary.document_indices)
        assert (user_ids[holders] == canary.user_id).all()
        assert (t.document_domains[holders] == -1).all()
    for reference in t.reference_canaries:
        assert not any(reference in doc for doc in t.sensitive.texts)


def test_email_wrapping_and_description():
    t = builtin.load_text_mixture_task(seed=0, num_users=3)
    first = t.sensitive[0]
    assert first.text.startswith("Subject: ") and first.text.endswith(first.user)
    table = builtin.describe_builtin_data()
    for source in builtin.BUILTIN_DATA_SOURCES:
        assert source.name in table and source.licence in table
