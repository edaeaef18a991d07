"""Proxy training and the cached proxy-output matrices."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx

from dpmix_jax.models import gpt2
from dpmix_jax.train import TrainConfig, engine, losses, proxies


class Heads(nnx.Module):
    """A linear multi-head proxy with k sigmoid heads."""

    def __init__(self, din, k, rngs):
        self.linear = nnx.Linear(din, k, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def test_nll_matrix_against_naive_loop():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(9, 4)) * 3
    targets = rng.integers(0, 2, size=9)
    matrix = proxies.nll_matrix(logits, targets)
    for j in range(9):
        for i in range(4):
            f = 1 / (1 + np.exp(-logits[j, i]))
            assert matrix[j, i] == pytest.approx(f if targets[j] == 1 else 1 - f, rel=1e-12)
    # -log Σ_i λ_i P[j, i] is the BCE of the mixture prediction Σ_i λ_i f_i(x).
    lam = np.array([0.1, 0.2, 0.3, 0.4])
    mix = scipy.special.expit(logits) @ lam
    bce = -(targets * np.log(mix) + (1 - targets) * np.log(1 - mix))
    np.testing.assert_allclose(-np.log(matrix @ lam), bce, rtol=1e-10)
    with pytest.raises(ValueError):
        proxies.nll_matrix(logits, np.full(9, 2))


def test_train_image_proxy_and_outputs_on_sensitive_split(tmp_path):
    rng = np.random.default_rng(1)
    true_w = rng.normal(size=(5, 3)).astype(np.float32)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    labels = (x @ true_w > 0).astype(np.float32)

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {
            "inputs": x[rows] * keep[:, None],
            "labels": labels[rows] * keep[:, None],
            "target": labels[rows, 0] * keep,  # the sensitive task's binary target
        }

    config = TrainConfig(steps=80, batch_size=32, learning_rate=0.1, progress=False, log_every=None)
    model = Heads(5, 3, nnx.Rngs(0))
    full = jax.tree.map(jnp.asarray, gather(np.arange(200)))
    bce = losses.sigmoid_bce(target_key="labels")
    before = float(jnp.mean(bce(model, full)))
    result = proxies.train_image_proxy(
        model,
        engine.IndexedData(gather=gather, num_examples=200),
        config,
        rng=np.random.default_rng(0),
    )
    assert float(jnp.mean(bce(result.model, full))) < 0.6 * before

    matrix = proxies.image_proxy_outputs(result.model, gather, 37, batch_size=16)
    logits = np.asarray(result.model(jnp.asarray(x[:37])), np.float64)
    np.testing.assert_allclose(matrix, proxies.nll_matrix(logits, labels[:37, 0]), rtol=1e-5)

    cached = proxies.ProxyOutputs(kind="nll", matrix=matrix, metadata={"split": "mix", "k": 3})
    proxies.save_proxy_outputs(tmp_path / "p.npz", cached)
    loaded = proxies.load_proxy_outputs(tmp_path / "p.npz")
    assert loaded.kind == "nll" and loaded.metadata == {"split": "mix", "k": 3}
    np.testing.assert_array_equal(loaded.matrix, matrix)
    assert loaded.token_counts is None
    with pytest.raises(ValueError):
        proxies.train_image_proxy(
            model,
            None,
            TrainConfig(
                steps=1,
                batch_size=2,
                learning_rate=0.1,
                private=True,
                clip_norm=1.0,
                delta=1e-5,
                noise_multiplier=1.0,
            ),
            rng=np.random.default_rng(0),
        )


def test_sequence_outputs_against_direct_sum(tmp_path):
    config = gpt2.GPT2Config.tiny(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=16)
    models = [gpt2.GPT2(config, rngs=nnx.Rngs(s)) for s in (0, 1)]
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 40, size=(5, 6)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[2, 3:] = 0

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {"tokens": tokens[rows] * keep[:, None], "mask": mask[rows] * keep[:, None]}

    matrix, counts = proxies.sequence_proxy_outputs(models, gather, 5, batch_size=2)
    np.testing.assert_array_equal(counts, mask.sum(axis=1) - 1)
    for j in range(5):
        length = int(mask[j].sum())
        for i, model in enumerate(models):
            logits = np.asarray(model(jnp.asarray(tokens[j : j + 1, :length]))[0], np.float64)
            log_probs = scipy.special.log_softmax(logits, axis=-1)
            direct = sum(log_probs[t - 1, tokens[j, t]] for t in range(1, length))
            assert matrix[j, i] == pytest.approx(direct, rel=1e-4)
    cached = proxies.ProxyOutputs(kind="sequence", matrix=matrix, token_counts=counts)
    proxies.save_proxy_outputs(tmp_path / "s.npz", cached)
    loaded = proxies.load_proxy_outputs(tmp_path / "s.npz")
    np.testing.assert_array_equal(loaded.token_counts, counts)
    with pytest.raises(ValueError):
        proxies.ProxyOutputs(kind="sequence", matrix=matrix)
    with pytest.raises(ValueError):
        proxies.ProxyOutputs(kind="nll", matrix=matrix)  # log-probabilities are not in [0, 1]
