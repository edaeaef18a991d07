"""Evaluation: AUC with ties against sklearn, macro AUC, batched outputs, perplexity."""

import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
from flax import nnx
from sklearn.metrics import roc_auc_score

from dpmix_jax.models import gpt2
from dpmix_jax.train import evaluate


def test_roc_auc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    for _ in range(20):
        n = int(rng.integers(5, 60))
        labels = rng.integers(0, 2, size=n)
        labels[:2] = [0, 1]
        scores = rng.integers(0, 4, size=n).astype(float)  # many ties
        assert evaluate.roc_auc(scores, labels) == pytest.approx(roc_auc_score(labels, scores))
    assert evaluate.roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert evaluate.roc_auc([1.0, 1.0], [0, 1]) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        evaluate.roc_auc([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError):
        evaluate.roc_auc([0.1, 0.2], [0, 2])


def test_per_task_and_macro_auc():
    rng = np.random.default_rng(1)
    labels = rng.integers(0, 2, size=(50, 4))
    labels[:, 3] = 1  # a task with one class is skipped
    scores = rng.normal(size=(50, 4)) + labels
    aucs = evaluate.per_task_auc(scores, labels)
    for t in range(3):
        assert aucs[t] == pytest.approx(roc_auc_score(labels[:, t], scores[:, t]))
    assert np.isnan(aucs[3])
    assert evaluate.macro_auc(scores, labels) == pytest.approx(np.mean(aucs[:3]))


def test_model_outputs_pads_the_last_batch_and_auc_report():
    weights = np.array([[1.0, -1.0], [0.5, 2.0]], np.float32)
    inputs = np.random.default_rng(2).normal(size=(11, 2)).astype(np.float32)
    labels = (inputs @ weights > 0).astype(np.int32)
    labels[0] = 1 - labels[0]

    class Linear(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.asarray(weights))

        def __call__(self, x):
            return x @ self.w

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {"inputs": inputs[rows] * keep[:, None], "labels": labels[rows] * keep[:, None]}

    out = evaluate.model_outputs(Linear(), lambda m, b: m(b["inputs"]), gather, 11, batch_size=4)
    np.testing.assert_allclose(out, inputs @ weights, rtol=1e-6)
    report = evaluate.auc_report(Linear(), gather, 11, batch_size=4)
    for t in range(2):
        expected = roc_auc_score(labels[:, t], inputs @ weights[:, t])
        assert report[f"auc/{t}"] == pytest.approx(expected)
    assert report["macro_auc"] == pytest.approx((report["auc/0"] + report["auc/1"]) / 2)


def test_perplexity_matches_a_direct_computation():
    config = gpt2.GPT2Config.tiny(n_layer=1, n_embd=32, n_head=2, vocab_size=50, n_positions=16)
    model = gpt2.GPT2(config, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50, size=(5, 7)).astype(np.int32)
    mask = np.ones_like(tokens)
    mask[1, 4:] = 0  # right padding

    def gather(idx):
        keep = idx >= 0
        rows = np.where(keep, idx, 0)
        return {"tokens": tokens[rows] * keep[:, None], "mask": mask[rows] * keep[:, None]}

    ppl = evaluate.perplexity(model, gather, 5, batch_size=2)
    nll, count = 0.0, 0
    for j in range(5):
        length = int(mask[j].sum())
        logits = model(jnp.asarray(tokens[j : j + 1, :length]))[0]
        log_probs = scipy.special.log_softmax(np.asarray(logits, np.float64), axis=-1)
        for t in range(1, length):
            nll -= log_probs[t - 1, tokens[j, t]]
            count += 1
    assert ppl == pytest.approx(np.exp(nll / count), rel=1e-4)
