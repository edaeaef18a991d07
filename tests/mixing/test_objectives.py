"""MixMin objectives: values and gradients against naive implementations, stability, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dpmix_jax.mixing import objectives

RNG = np.random.default_rng(0)
N, K = 12, 4
PROBS = RNG.uniform(0.01, 0.99, size=(N, K))
LOGPROBS = -RNG.uniform(1.0, 30.0, size=(N, K))
LENGTHS = RNG.integers(1, 20, size=N).astype(float)
REALS = RNG.normal(size=(N, K))
TARGETS = RNG.normal(size=N)
WEIGHTS = np.array([0.1, 0.2, 0.3, 0.4])


def naive_losses(weights, kind):
    """Per-example losses written directly from the definitions (no logsumexp, no floor)."""
    if kind == "nll":
        return -jnp.log(jnp.asarray(PROBS) @ weights)
    if kind == "sequence":
        return -jnp.log(jnp.exp(jnp.asarray(LOGPROBS)) @ weights) / LENGTHS
    return (jnp.asarray(REALS) @ weights - TARGETS) ** 2


def packed(kind):
    if kind == "nll":
        return objectives.prepare_examples(PROBS, kind="nll")
    if kind == "sequence":
        return objectives.prepare_examples(LOGPROBS, kind="sequence", lengths=LENGTHS)
    return objectives.prepare_examples(REALS, kind="mse", targets=TARGETS)


@pytest.mark.parametrize("kind", objectives.KINDS)
def test_losses_and_gradients_match_naive_implementation(kind):
    weights = jnp.asarray(WEIGHTS, jnp.float32)
    losses = objectives.per_example_losses(weights, packed(kind), kind=kind)
    np.testing.assert_allclose(losses, naive_losses(weights, kind), rtol=2e-5, atol=1e-6)
    grads = objectives.per_example_grads(weights, packed(kind), kind=kind)
    expected = jax.jacrev(lambda w: naive_losses(w, kind))(weights)
    np.testing.assert_allclose(grads, expected, rtol=1e-4, atol=1e-6)


def test_nll_gradient_closed_form():
    grads = objectives.per_example_grads(jnp.asarray(WEIGHTS), packed("nll"), kind="nll")
    expected = -PROBS / (PROBS @ WEIGHTS)[:, None]
    np.testing.assert_allclose(grads, expected, rtol=1e-5)
    # <λ, g_j> = -1 for every example.
    np.testing.assert_allclose(np.asarray(grads) @ WEIGHTS, -1.0, rtol=1e-5)


def test_sequence_equals_product_of_token_probabilities():
    # Two sequences of 3 and 2 tokens under k = 3 proxies (per-token probabilities).
    token_probs = [
        np.array([[0.5, 0.2, 0.9], [0.1, 0.3, 0.4], [0.7, 0.7, 0.2]]),
        np.array([[0.6, 0.05], [0.3, 0.5], [0.25, 0.9]]),
    ]
    weights = np.array([0.2, 0.5, 0.3])
    logprobs = np.array([np.log(p).sum(axis=1) for p in token_probs])
    lengths = np.array([p.shape[1] for p in token_probs], float)
    direct = np.mean([-np.log(weights @ np.prod(p, axis=1)) / p.shape[1] for p in token_probs])
    got = objectives.mixmin_loss(weights, logprobs, kind="sequence", lengths=lengths)
    np.testing.assert_allclose(float(got), direct, rtol=1e-5)


def test_sequence_is_stable_for_very_negative_log_probs_and_zero_weights():
    logprobs = np.array([[-5000.0, -5001.0], [-8000.0, -7990.0]])
    weights = np.array([1.0, 0.0])
    examples = objectives.prepare_examples(
        logprobs, kind="sequence", lengths=np.array([100.0, 100.0])
    )
    loss = objectives.per_example_losses(jnp.asarray(weights), examples, kind="sequence")
    np.testing.assert_allclose(loss, [50.0, 80.0], rtol=1e-5)
    grads = objectives.per_example_grads(jnp.asarray(weights), examples, kind="sequence")
    assert np.all(np.isfinite(np.asarray(grads)))


def test_nll_floor_applies_only_when_every_source_gives_zero():
    preds = np.array([[0.0, 0.0], [0.0, 0.5]])
    with (
        pytest.warns(UserWarning, match="probability 0 under every source"),
        pytest.warns(UserWarning, match=r"column\(s\) \[0\]"),
    ):
        examples = objectives.prepare_examples(preds)
    losses = objectives.per_example_losses(jnp.array([0.5, 0.5]), examples, kind="nll")
    np.testing.assert_allclose(losses, [-np.log(objectives.NLL_FLOOR), -np.log(0.25)], rtol=1e-5)


def test_mixmin_loss_is_the_mean():
    got = objectives.mixmin_loss(WEIGHTS, REALS, kind="mse", targets=TARGETS)
    np.testing.assert_allclose(float(got), np.mean((REALS @ WEIGHTS - TARGETS) ** 2), rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(preds=np.array([[0.5, np.nan]])), "non-finite"),
        (dict(preds=np.array([[0.5, np.inf]]), kind="mse", targets=np.zeros(1)), "non-finite"),
        (dict(preds=np.array([[0.5, -0.1]])), r"\[0, 1\]"),
        (dict(preds=np.array([[0.5, 1.2]])), r"\[0, 1\]"),
        (dict(preds=np.array([[0.5], [0.2]])), "at least 2 sources"),
        (dict(preds=np.zeros((0, 3))), "no examples"),
        (dict(preds=np.array([0.5, 0.5])), "2-D"),
        (dict(preds=np.array([[-1.0, -2.0]]), kind="sequence"), "needs lengths"),
        (dict(preds=np.array([[1.0, -2.0]]), kind="sequence", lengths=np.ones(1)), "<= 0"),
        (dict(preds=np.array([[-1.0, -2.0]]), kind="sequence", lengths=np.zeros(1)), "> 0"),
        (dict(preds=np.array([[0.1, 0.2]]), kind="mse"), "needs targets"),
        (dict(preds=np.array([[0.1, 0.2]]), kind="mse", targets=np.zeros(2)), "shape"),
        (dict(preds=np.array([[0.1, 0.2]]), targets=np.zeros(1)), "does not use targets"),
        (dict(preds=np.array([[0.1, 0.2]]), kind="ce"), "kind must be"),
    ],
)
def test_invalid_proxy_outputs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        objectives.prepare_examples(**kwargs)


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        (np.array([0.5, 0.5]), "shape"),
        (np.array([0.5, 0.5, 0.5, -0.5]), ">= 0"),
        (np.array([0.1, 0.1, 0.1, 0.1]), "sum to 1"),
        (np.array([np.nan, 0.5, 0.25, 0.25]), "finite"),
    ],
)
def test_invalid_weights_raise(weights, message):
    with pytest.raises(ValueError, match=message):
        objectives.mixmin_loss(weights, PROBS)
