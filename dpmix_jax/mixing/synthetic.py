"""A synthetic MixMin problem whose population optimum is known exactly.

Proxy i predicts f_i(x) = sigmoid(w_i·x + b_i) for x ~ N(0, I_d), and each label is drawn from a
mixture of a few proxies: y ~ Bernoulli(Σ_i λ*_i f_i(x)). Since the log loss is proper, λ*
minimises the population MixMin objective, so the excess loss of a learned λ can be measured
against the truth rather than against another estimate. Imports numpy only.

Example:
    >>> preds, true_weights = mixture_problem(num_examples=100, num_sources=8, seed=0)
    >>> preds.shape, int((true_weights > 0).sum()), round(float(true_weights.sum()), 6)
    ((100, 8), 4, 1.0)
"""

from __future__ import annotations

import numpy as np


def mixture_problem(
    *,
    num_examples: int,
    num_sources: int,
    seed: int,
    num_features: int = 16,
    support: int = 4,
    proxy_scale: float = 3.0,
) -> tuple[np.ndarray, np.ndarray]:
    """An `nll` MixMin problem whose true conditional is an exact mixture of the proxies.

    λ* puts Dirichlet(1) weights on `support` random sources (0 elsewhere); the proxies' weights
    w_i have entries N(0, proxy_scale² / d) and their biases b_i are N(0, 1).

    Args:
        num_examples: n, the examples drawn.
        num_sources: k, the proxies.
        seed: draws the proxies, λ*, the inputs and the labels.
        num_features: d, the input dimension.
        support: the sources with non-zero weight in λ* (at most k are used).
        proxy_scale: the scale of the proxies' logits.

    Returns:
        `preds` `(n, k)` float32 with P[j, i] = p_i(y_j | x_j), and λ* `(k,)`.
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(num_examples, num_features))
    w = rng.normal(size=(num_features, num_sources)) * proxy_scale / np.sqrt(num_features)
    f = 1.0 / (1.0 + np.exp(-(x @ w + rng.normal(size=num_sources))))
    true_weights = np.zeros(num_sources)
    chosen = rng.choice(num_sources, min(support, num_sources), replace=False)
    true_weights[chosen] = rng.dirichlet(np.ones(len(chosen)))
    labels = rng.random(num_examples) < f @ true_weights
    preds = np.where(labels[:, None], f, 1.0 - f).astype(np.float32)
    return preds, true_weights
