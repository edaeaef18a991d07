"""Aggregators of one vote histogram `(V,)` into a token id or `FAIL` (-1).

Thresholded (T-threshold private: they only ever output a token with at least T votes, a proxy for
privacy, not DP): `targmax`, `tws`. Differentially private, under the vote-move neighbouring
relation (one teacher's vote moves from one token to another; L1 = 2, L∞ = 1, n fixed):
`dpargmax_laplace`, `confident_gnmax`, `dpws`. In every DP mechanism ⊥ is decided after the noise,
so it is an output of the mechanism.

All functions are pure and jittable on one histogram; `jax.vmap` them over many. Their exact
output distributions are checked by enumeration in the tests.

Exact discrete noise: the noisy aggregators take an optional `noise` argument, integer noise of
the same scale drawn host-side by `dpmix_jax.privacy.discrete_noise` (discrete Laplace for
DPARGMAX and DPWS, discrete Gaussian for confident-GNMax), which replaces their floating-point
draw; the noisy counts are then integers, compared exactly (ties go to the smallest id). Their
accounting is in `pate.accounting` (`*_discrete_*`).

Example:
    >>> import jax.numpy as jnp
    >>> int(targmax(jnp.array([1, 5, 2]), 4)), int(targmax(jnp.array([1, 3, 4]), 5))
    (1, -1)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from scipy import special

__all__ = [
    "FAIL",
    "confident_gnmax",
    "dpargmax_laplace",
    "dpws",
    "dpws_epsilon_at",
    "dpws_threshold",
    "targmax",
    "tws",
    "tws_probabilities",
    "unanimous_release_probability",
]

FAIL = -1


def _counts(counts: jax.Array) -> jax.Array:
    if getattr(counts, "ndim", None) != 1:
        raise ValueError(
            f"counts must be one histogram of shape (V,), got {getattr(counts, 'shape', None)}."
        )
    return jnp.asarray(counts)


def targmax(counts: jax.Array, threshold: float) -> jax.Array:
    """TARGMAX_T: the most voted token (smallest id on ties) if it has >= T votes, else FAIL.

    Privacy:
        Not DP: T-threshold private only (outputs only tokens with >= T votes).
    """
    counts = _counts(counts)
    top = jnp.argmax(counts)
    return jnp.where(counts[top] >= threshold, top, FAIL).astype(jnp.int32)


def tws_probabilities(counts: jax.Array, threshold: float, gamma: float) -> jax.Array:
    """The output distribution of TWS_{T,γ}: `(V + 1,)`, last entry = Pr[FAIL].

    P[j] = c_j·1{c_j >= T} / max(M_T, n/γ) with M_T = Σ_{c_j >= T} c_j and n = Σ c; the rest is ⊥.

    Privacy:
        Not DP: T-threshold private only.
    """
    counts = _counts(counts).astype(jnp.float32)
    passing = jnp.where(counts >= threshold, counts, 0.0)
    denom = jnp.maximum(jnp.sum(passing), jnp.sum(counts) / gamma)
    probs = passing / denom
    return jnp.append(probs, 1.0 - jnp.sum(probs))


def tws(key: jax.Array, counts: jax.Array, threshold: float, gamma: float) -> jax.Array:
    """TWS_{T,γ}: thresholded weighted sampling (distribution in `tws_probabilities`).

    With probability min(1, γ·M_T/n) output a token j with c_j >= T drawn ∝ c_j, else FAIL.

    Privacy:
        Not DP: T-threshold private only (a DP version is `dpws`).
    """
    counts = _counts(counts)
    return _weighted_sample(key, jnp.where(counts >= threshold, counts, 0), jnp.sum(counts) / gamma)


def _weighted_sample(key: jax.Array, weights: jax.Array, floor: jax.Array) -> jax.Array:
    """Token j with probability w_j / max(Σw, floor), else FAIL."""
    weights = weights.astype(jnp.float32)
    cdf = jnp.cumsum(weights)
    total = cdf[-1]
    u = jax.random.uniform(key, (), jnp.float32) * jnp.maximum(total, floor)
    token = jnp.minimum(jnp.searchsorted(cdf, u, side="right"), weights.shape[0] - 1)
    return jnp.where(u < total, token, FAIL).astype(jnp.int32)


def dpargmax_laplace(
    key: jax.Array,
    counts: jax.Array,
    threshold: float,
    epsilon: float,
    *,
    noise: jax.Array | None = None,
) -> jax.Array:
    """DPARGMAX (Laplace): ĉ = c + Lap(2/ε)^V; output argmax ĉ if its noisy count >= T, else FAIL.

    Guarantee: ε-DP (pure) per call under the vote-move relation: the noisy vector is the Laplace
    mechanism with L1 sensitivity 2 and scale 2/ε, and the output is a function of it. Choose
    T >= n/2 + (2/ε)·ln(V/η) for zero-vote tokens to pass with probability <= η.

    `noise`: `(V,)` integer discrete Laplace noise of scale 2/ε (`privacy.discrete_noise.
    discrete_laplace`) used instead of the float draw (`key` is then unused); the call is then
    the discrete Laplace mechanism on the two coordinates one vote move changes, also ε-DP
    (`accounting.dpargmax_discrete_laplace_event`).

    Privacy:
        Reads the (sensitive) histogram; its output is ε-DP as stated above. `key` (or `noise`)
        must be secret and fresh per call.
    """
    counts = _counts(counts)
    if noise is None:
        noise = (2.0 / epsilon) * jax.random.laplace(key, counts.shape, jnp.float32)
    noisy = counts + noise
    top = jnp.argmax(noisy)
    return jnp.where(noisy[top] >= threshold, top, FAIL).astype(jnp.int32)


def confident_gnmax(
    key: jax.Array,
    counts: jax.Array,
    threshold: float,
    sigma1: float,
    sigma2: float,
    *,
    noise: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Confident-GNMax (Papernot et al. 2018): noisy threshold check, then Gaussian noisy argmax.

    If max_j c_j + N(0, σ1²) >= T output argmax_j (c_j + N(0, σ2²)), else FAIL.

    Guarantee: under the vote-move relation max_j c_j has sensitivity 1 and c has L2 sensitivity
    √2, so the call is the composition of a Gaussian mechanism with noise multiplier σ1 and one
    with σ2/√2: RDP(λ) = λ/(2σ1²) + λ/σ2² (see `pate.accounting.confident_gnmax_event`).

    `noise`: `(check (), argmax (V,))` integer discrete Gaussian noise of parameters σ1², σ2²
    (`privacy.discrete_noise.discrete_gaussian`) used instead of the float draws (`key` is then
    unused); its ε is `accounting.confident_gnmax_discrete_epsilon` (the same zCDP as above).

    Privacy:
        Reads the (sensitive) histogram; output DP as stated above. `key` (or `noise`) must be
        secret and fresh.
    """
    counts = _counts(counts)
    if noise is None:
        key_check, key_argmax = jax.random.split(key)
        counts = counts.astype(jnp.float32)
        noise = (
            sigma1 * jax.random.normal(key_check, (), jnp.float32),
            sigma2 * jax.random.normal(key_argmax, counts.shape, jnp.float32),
        )
    check_noise, argmax_noise = noise
    passed = jnp.max(counts) + check_noise >= threshold
    top = jnp.argmax(counts + argmax_noise)
    return jnp.where(passed, top, FAIL).astype(jnp.int32)


def dpws_threshold(epsilon: float, delta: float, *, discrete: bool = False) -> float:
    """DPWS's keep threshold: a token with one vote passes with probability <= δ/2.

    Continuous Laplace(2/ε): 1 + (2/ε)·ln(1/δ). Discrete Laplace(2/ε) (`discrete=True`), where
    Pr[Z >= k] = e^(-ak)/(1 + e^(-a)) for integers k >= 1 and a = ε/2: the integer 1 + k with
    the smallest k such that e^(-ak)/(1 + e^(-a)) <= δ/2.
    """
    if not epsilon > 0 or not 0 < delta < 1:
        raise ValueError(f"need epsilon > 0 and 0 < delta < 1, got {epsilon!r}, {delta!r}.")
    if not discrete:
        return 1.0 + (2.0 / epsilon) * math.log(1.0 / delta)
    rate = epsilon / 2
    steps = max(1, math.ceil(math.log(2 / (delta * (1 + math.exp(-rate)))) / rate))
    while math.exp(-rate * steps) / (1 + math.exp(-rate)) > delta / 2:  # float rounding
        steps += 1
    return float(1 + steps)


def dpws_epsilon_at(threshold: float, delta: float) -> float:
    """The per-call ε whose (continuous) DPWS keep threshold is `threshold`: the inverse of
    `dpws_threshold`, 2·ln(1/δ) / (T - 1), for T > 1.

    This prices a threshold: an ensemble whose votes reach T can be aggregated by DPWS at this
    ε (and no smaller one) without its keep threshold rising above T.
    """
    if not threshold > 1 or not 0 < delta < 1:
        raise ValueError(f"need threshold > 1 and 0 < delta < 1, got {threshold!r}, {delta!r}.")
    return 2.0 * math.log(1.0 / delta) / (threshold - 1.0)


def dpws(
    key: jax.Array,
    counts: jax.Array,
    epsilon: float,
    delta: float,
    gamma: float,
    *,
    threshold: float = 0.0,
    noise: jax.Array | None = None,
) -> jax.Array:
    """DPWS: noisy counts on the support, stability threshold, then TWS on the noisy counts.

    ĉ_j = c_j + Lap(2/ε) for c_j > 0 (zero-vote tokens are never considered); keep
    K = {j : ĉ_j >= max(1 + (2/ε)·ln(1/δ), threshold)}; output j ∈ K with probability
    ĉ_j / max(Σ_K ĉ, n/γ), else FAIL.

    Guarantee: (ε, δ)-DP per call under the vote-move relation. Tokens in both supports: Laplace
    with scale 2/ε on two coordinates changing by 1 each (ε). A token entering (0 -> 1) or
    leaving the support is kept with probability <= δ/2 each, giving δ in total. The TWS step
    only post-processes the released (K, ĉ_K).

    `noise`: `(V,)` integer discrete Laplace noise of scale 2/ε (`privacy.discrete_noise.
    discrete_laplace`) used instead of the float draw, with the keep threshold
    `dpws_threshold(ε, δ, discrete=True)`; the same argument gives (ε, δ)-DP per call
    (`accounting.dpws_discrete_event`). `key` still draws the final weighted sample.

    Privacy:
        Reads the (sensitive) histogram; output DP as stated above. `key` (and `noise`) must be
        secret and fresh.
    """
    counts = _counts(counts)
    discrete = noise is not None
    keep_at = max(dpws_threshold(epsilon, delta, discrete=discrete), float(threshold))
    key_noise, key_sample = jax.random.split(key)
    if noise is None:
        noise = (2.0 / epsilon) * jax.random.laplace(key_noise, counts.shape, jnp.float32)
    noisy = counts + noise
    kept = jnp.where((counts > 0) & (noisy >= keep_at), noisy, 0.0)
    return _weighted_sample(key_sample, kept, jnp.sum(counts) / gamma)


def unanimous_release_probability(
    aggregator: str,
    *,
    num_teachers: int,
    num_buckets: int,
    threshold: float,
    sigma1: float = 1.0,
    sigma2: float = 1.0,
    epsilon: float = 1.0,
) -> float | None:
    """The probability that a token on which all n teachers agree is released, against the
    other `num_buckets` - 1 counts at zero: the check passes and the token wins the noisy
    argmax. Near 1/`num_buckets` the released tokens carry hardly any of the teachers' vote.

    Confident-GNMax: Φ((n − T)/σ1) · ∫ φ(z) Φ(n/σ2 + z)^(B−1) dz. DPARGMAX (Laplace of scale
    b = 2/ε): ∫ f(x) F(n + x)^(B−1) 1[n + x >= T] dx. Both integrals by quadrature on a grid of
    20,001 points over ±12 scales (error below 1e-6). None for DPWS, whose release does not
    compete with zero-vote tokens (they are never considered).

    Privacy:
        A function of public settings only.
    """
    competitors = num_buckets - 1
    if aggregator == "confident_gnmax":
        z = np.linspace(-12.0, 12.0, 20_001)
        density = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
        wins = np.trapezoid(density * special.ndtr(num_teachers / sigma2 + z) ** competitors, z)
        return float(special.ndtr((num_teachers - threshold) / sigma1) * wins)
    if aggregator == "dpargmax_laplace":
        scale = 2.0 / epsilon
        x = np.linspace(-12.0 * scale, 12.0 * scale, 20_001)
        density = np.exp(-np.abs(x) / scale) / (2 * scale)
        y = num_teachers + x
        cdf = np.where(y < 0, 0.5 * np.exp(y / scale), 1 - 0.5 * np.exp(-y / scale))
        return float(np.trapezoid(density * cdf**competitors * (y >= threshold), x))
    return None
