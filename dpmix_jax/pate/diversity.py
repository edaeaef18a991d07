"""The (τ, β, γ) diversity-preservation guarantee of sampler + aggregator, measured.

A map from n teacher distributions p^(1..n) over V to one distribution P over V ∪ {⊥} is
(τ, β, γ)-diversity preserving when for every token j
  * transfer: for every q with c_{j,q} = #{i : p^(i)_j >= q} >= τ, P_j >= β·(c_{j,q}/n)·q;
  * relevance: P_j <= γ·(1/n)·Σ_i p^(i)_j.
Hot PATE's main theorem: coordinated histograms + TWS_{τ/2,γ} (γ >= 1) are (τ, 0.17, γ)-diversity
preserving for every τ; DPWS_{(ε,δ)} is with τ = 4ε⁻¹·ln(1/δ), β = Θ(1), γ = 1.

`output_distribution` estimates P of the library's own sampler and aggregator by drawing many
histograms (and, for randomised aggregators, their noise). For TWS the aggregator's law given
the histogram is exact (`aggregators.tws_probabilities`), so only the histogram is sampled; each
estimate comes with its standard error. `attained` turns P into the smallest β and the largest γ
the ensemble attains: for token j the binding q for a count m is the m-th largest teacher
probability p_(m), so β_j = P_j / max_{m >= τ} (m/n)·p_(m), and γ_j = P_j / avg_j.

`adversarial_ensembles` builds the cases where the guarantee is tight or where cold PATE fails:
disjoint groups (the theorem's tightness example), one shared low-probability token, many teachers
exactly at q, a wide uniform, and heterogeneous (Dirichlet) teachers.

Example:
    >>> import jax, numpy as np
    >>> probs = np.full((8, 2), 0.5)
    >>> est = output_distribution(jax.random.key(0), probs, sampler="coordinated",
    ...                           aggregator=tws_aggregator(4, 1.0), num_draws=2000)
    >>> round(float(est.probs[:2].sum() + est.probs[2]), 6)
    1.0
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.pate import aggregators, samplers

__all__ = [
    "THEOREM_BETA_TWS",
    "Attained",
    "Ensemble",
    "OutputEstimate",
    "adversarial_ensembles",
    "attained",
    "dpargmax_aggregator",
    "dpws_aggregator",
    "dpws_tau",
    "output_distribution",
    "secret_set_logits",
    "targmax_aggregator",
    "tws_aggregator",
]

THEOREM_BETA_TWS = 0.17  # ½·(½ ln 2): coordinated sampling + TWS_{τ/2,γ}, any τ, γ >= 1

Aggregate = Callable[[jax.Array, jax.Array], jax.Array]
"""(key, counts (V,)) -> the aggregator's output distribution (V + 1,) or a one-hot draw of it."""


def tws_aggregator(threshold: float, gamma: float) -> Aggregate:
    """TWS_{T,γ} as its exact output distribution given the histogram (no sampling needed)."""
    return lambda key, counts: aggregators.tws_probabilities(counts, threshold, gamma)


def dpws_aggregator(
    epsilon: float, delta: float, gamma: float, *, threshold: float = 0.0
) -> Aggregate:
    """DPWS_{(ε,δ),γ} as a one-hot draw (index V = ⊥) of `aggregators.dpws`, keeping tokens
    whose noisy count reaches max(its stability threshold, `threshold`)."""

    def draw(key, counts):
        token = aggregators.dpws(key, counts, epsilon, delta, gamma, threshold=threshold)
        return _one_hot(token, counts.shape[0])

    return draw


def targmax_aggregator(threshold: float) -> Aggregate:
    """TARGMAX_T as a one-hot draw (index V = ⊥) of `aggregators.targmax`."""

    def draw(key, counts):
        return _one_hot(aggregators.targmax(counts, threshold), counts.shape[0])

    return draw


def dpargmax_aggregator(threshold: float, epsilon: float) -> Aggregate:
    """DPARGMAX_{ε,T} (Laplace) as a one-hot draw (index V = ⊥) of `dpargmax_laplace`."""

    def draw(key, counts):
        token = aggregators.dpargmax_laplace(key, counts, threshold, epsilon)
        return _one_hot(token, counts.shape[0])

    return draw


def _one_hot(token: jax.Array, vocab: int) -> jax.Array:
    return jax.nn.one_hot(jnp.where(token < 0, vocab, token), vocab + 1)


def dpws_tau(epsilon: float, delta: float) -> float:
    """The theorem's τ = 4ε⁻¹·ln(1/δ) for DPWS_{(ε,δ)}."""
    return 4.0 / epsilon * np.log(1.0 / delta)


def secret_set_logits(
    key: jax.Array,
    *,
    num_teachers: int,
    vocab_size: int,
    set_size: int,
    private_mass: float,
    heterogeneity: float,
    background_mass: float,
) -> tuple[jax.Array, jax.Array]:
    """Tunable diversity with a known ground truth: a secret set of k tokens shared by all.

    Every teacher puts `1 - private_mass - background_mass` on the k secret tokens (equal logits
    plus a per-teacher N(0, heterogeneity²) jitter), `private_mass` on a private token of its own
    and `background_mass` spread over the vocabulary.

    Returns:
        `(n, V)` float32 logits and the `(k,)` secret tokens.

    Privacy:
        Synthetic teachers; nothing sensitive.
    """
    key_set, key_private, key_jitter = jax.random.split(key, 3)
    order = jax.random.permutation(key_set, vocab_size)
    secret, others = order[:set_size], order[set_size:]
    private = others[jax.random.randint(key_private, (num_teachers,), 0, others.shape[0])]
    shared_mass = 1.0 - private_mass - background_mass
    logits = jnp.full(
        (num_teachers, vocab_size), jnp.log(background_mass / vocab_size), jnp.float32
    )
    jitter = heterogeneity * jax.random.normal(key_jitter, (num_teachers, set_size))
    logits = logits.at[:, secret].set(jnp.log(shared_mass / set_size) + jitter)
    if private_mass > 0:
        logits = logits.at[jnp.arange(num_teachers), private].set(jnp.log(private_mass))
    return logits, secret


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputEstimate:
    """P over V ∪ {⊥} (last entry ⊥) and the standard error of each entry."""

    probs: np.ndarray
    stderr: np.ndarray
    num_draws: int


def output_distribution(
    key: jax.Array,
    probs: np.ndarray,
    *,
    sampler: str,
    aggregator: Aggregate,
    num_draws: int,
    chunk: int = 20_000,
) -> OutputEstimate:
    """The output distribution of `sampler` histograms aggregated by `aggregator`.

    Args:
        key: PRNG key.
        probs: `(n, V)` teacher distributions (zeros allowed).
        sampler: "coordinated" or "independent" (the library's samplers, full scan).
        aggregator: `tws_aggregator(...)` or `dpws_aggregator(...)`.
        num_draws: histograms drawn (in chunks of `chunk`).

    Returns:
        The mean of the aggregator's per-histogram distribution and its standard error.

    Privacy:
        Analysis of a mechanism on given distributions; meant for public or synthetic teachers.
    """
    if sampler not in ("coordinated", "independent"):
        raise ValueError(f"sampler must be 'coordinated' or 'independent', got {sampler!r}.")
    probs = np.asarray(probs, np.float64)
    if probs.ndim != 2 or np.any(probs < 0) or not np.allclose(probs.sum(1), 1, atol=1e-6):
        raise ValueError(f"probs must be (n, V) rows of distributions, got shape {probs.shape}.")
    if num_draws < 2:
        raise ValueError(f"num_draws must be >= 2, got {num_draws}.")
    with np.errstate(divide="ignore"):
        logits = jnp.asarray(np.log(probs), jnp.float32)
    draw = (
        samplers.coordinated_histograms
        if sampler == "coordinated"
        else samplers.independent_histograms
    )
    total = np.zeros(probs.shape[1] + 1)
    total_sq = np.zeros_like(total)
    done = 0
    while done < num_draws:
        size = min(chunk, num_draws - done)
        key, key_hist, key_agg = jax.random.split(key, 3)
        histograms = draw(key_hist, logits, size, batch_size=1024)
        outputs = np.asarray(_aggregate_all(aggregator, key_agg, histograms), np.float64)
        total += outputs.sum(0)
        total_sq += (outputs**2).sum(0)
        done += size
    mean = total / num_draws
    variance = np.maximum(total_sq / num_draws - mean**2, 0.0) * num_draws / (num_draws - 1)
    return OutputEstimate(probs=mean, stderr=np.sqrt(variance / num_draws), num_draws=num_draws)


@functools.partial(jax.jit, static_argnums=0)
def _aggregate_all(aggregator, key, histograms):
    return jax.vmap(aggregator)(jax.random.split(key, histograms.shape[0]), histograms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Attained:
    """The smallest β and the largest γ an ensemble attains, with confidence bounds.

    Attributes:
        beta: min over tokens j (with some q having c_{j,q} >= τ) of P_j / max_{m>=τ}(m/n)·p_(m);
            None when no token reaches τ teachers.
        beta_lower: the same with P_j lowered by `z` standard errors.
        beta_token: the token attaining it.
        gamma: max over tokens of P_j / avg_j (tokens with avg_j = 0 count as ∞ if P_j > 0).
        gamma_lower, gamma_upper: the same with P_j lowered / raised by `z` standard errors.
    """

    beta: float | None
    beta_lower: float | None
    beta_token: int | None
    gamma: float
    gamma_lower: float
    gamma_upper: float


def attained(
    probs: np.ndarray, estimate: OutputEstimate, tau: float, *, z: float = 4.0
) -> Attained:
    """β and γ attained by `estimate` on the ensemble `probs` at τ (module docstring)."""
    probs = np.asarray(probs, np.float64)
    n = probs.shape[0]
    p_out, err = estimate.probs[:-1], estimate.stderr[:-1]
    ranked = -np.sort(-probs, axis=0)  # (n, V): column j is p_(1) >= p_(2) >= ...
    m = np.arange(1, n + 1)[:, None]
    demand = np.where(m >= tau, m / n * ranked, 0.0).max(axis=0)  # max_{m>=τ} (m/n) p_(m)
    applies = demand > 0
    beta = beta_lower = token = None
    if np.any(applies):
        safe = np.where(applies, demand, 1.0)
        ratios = np.where(applies, p_out / safe, np.inf)
        token = int(np.argmin(ratios))
        beta = float(ratios[token])
        beta_lower = float(np.min(np.where(applies, (p_out - z * err) / safe, np.inf)))
    average = probs.mean(axis=0)

    def relevance(p):
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where(average > 0, p / average, np.where(p > 0, np.inf, 0.0))
        return float(ratio.max())

    return Attained(
        beta=beta,
        beta_lower=beta_lower,
        beta_token=token,
        gamma=relevance(p_out),
        gamma_lower=relevance(p_out - z * err),
        gamma_upper=relevance(p_out + z * err),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ensemble:
    """A named teacher ensemble `probs` (n, V) and the τ at which it is evaluated."""

    name: str
    probs: np.ndarray
    tau: float


def adversarial_ensembles(n: int, tau: float, *, shared: int = 16, seed: int = 0) -> list[Ensemble]:
    """Ensembles of n teachers that stress the guarantee at τ.

    The vocabulary has `shared` tokens any teacher may use, then one private token per teacher
    (V = shared + n), so that mass "elsewhere" is on tokens no other teacher votes for, the
    case where coordination helps least.

    * disjoint_groups: groups of ⌈τ⌉ identical teachers, each group on its own shared token (the
      theorem's tightness example).
    * disjoint_pairs: the same with two equally likely tokens per group.
    * minority_low_q: ⌈τ⌉ teachers give token 0 probability q = 0.05 and the rest to their private
      token; every other teacher votes for its private token.
    * shared_low_q: every teacher gives token 0 q = 0.05 and the rest to its private token.
    * exactly_q: ⌈τ⌉ teachers give token 0 exactly q = 0.2, the others just below q (so
      c_{0,q} = τ exactly), the rest on private tokens.
    * wide_uniform: identical uniform teachers over the shared tokens (cold PATE fails here).
    * heterogeneous: 0.7·Dirichlet(0.3) over the shared tokens plus 0.3 on the private token.
    """
    if shared < 4 or n < 2 or not 1 <= tau <= n:
        raise ValueError(f"need shared >= 4, n >= 2 and 1 <= tau <= n, got {shared}, {n}, {tau}.")
    rng = np.random.default_rng(seed)
    rows, size = np.arange(n), int(np.ceil(tau))
    private = shared + rows

    def empty():
        return np.zeros((n, shared + n))

    group = np.minimum(rows // size, shared // 2 - 1)
    groups, pairs = empty(), empty()
    groups[rows, group] = 1.0
    pairs[rows, 2 * group] = pairs[rows, 2 * group + 1] = 0.5
    minority, low, exact = empty(), empty(), empty()
    minority[:size, 0] = 0.05
    low[:, 0] = 0.05
    exact[:, 0] = np.where(rows < size, 0.2, 0.2 * (1 - 1e-3))
    for table in (minority, low, exact):
        table[rows, private] = 1.0 - table[:, 0]
    uniform = empty()
    uniform[:, :shared] = 1.0 / shared
    hetero = empty()
    hetero[:, :shared] = 0.7 * rng.dirichlet(np.full(shared, 0.3), size=n)
    hetero[rows, private] = 0.3
    named = {
        "disjoint_groups": groups,
        "disjoint_pairs": pairs,
        "minority_low_q": minority,
        "shared_low_q": low,
        "exactly_q": exact,
        "wide_uniform": uniform,
        "heterogeneous": hetero,
    }
    return [Ensemble(name=name, probs=probs, tau=tau) for name, probs in named.items()]
