"""How many mixture units DP-MixMin needs: the error bound behind choosing ρ.

For k sources, n units (examples, or users at user level) in the mixture split and an
(ε, δ)-DP run, the excess MixMin loss of the learned λ over the best mixture is bounded by a
statistical and a privacy term:

    excess(n) <= B · sqrt(log k / n)  +  C · sqrt(log k · log(1/δ)) / (n ε),

with B the scale of the per-unit loss and C the Lipschitz constant of the privatised per-unit
loss, i.e. the mixture stage's clip norm (the Gaussian noise is σC per coordinate). The first
term is the price of estimating the objective from n samples over the simplex (it grows only
with log k: the simplex has ℓ1 geometry); the second is the price of the noise of DP mirror
descent. The two are equal at n× = (C/B)² · log(1/δ) / ε², whatever k: with fewer units the
run is privacy-limited (more units help as 1/n), with more it is statistics-limited (as 1/√n).
The sufficient size for a target accuracy α solves excess(n) = α (a quadratic in 1/√n); ρ is
then that size over the sensitive split's size.

This is guidance, not a guarantee for a particular run: it assumes the solver has converged
(no term for T) and a clip norm that leaves the gradients near the optimum unclipped, and B is
a scale, not a known constant. The paper's operating points (ε = 1, δ = 1e-5, ρ = 0.1):

- language, k = 16: with B = C = 1 the sufficient size for α = 0.001 is 2.78M units (2.77M
  with OpenWebMath's C = 0.2; the bound at 2.8M is 0.000997): the paper's "about 2.8M tokens".
- vision, k = 14: 8,970 examples (ρ = 0.1 of NIH's training split) give α = 0.018 with
  B = C = 1 (27,500 units reach α = 0.01), and α = 0.01 exactly with B = C = 0.563; with the
  paper's C = 13 and B = 1 they give 0.025 (0.017 + 0.008). "α ≈ 0.01" holds to its order.

Example:
    >>> guide = sufficient_mixture_size(k=16, alpha=1e-3, epsilon=1.0, delta=1e-5)
    >>> guide.num_units, guide.limited_by
    (2783877, 'statistics')
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from dpmix_jax.privacy import validation

Regime = Literal["statistics", "privacy"]


def _check_sources(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int) or k < 2:
        raise ValueError(f"k (the number of sources) must be an integer >= 2, got {k!r}.")
    return k


@dataclasses.dataclass(frozen=True, kw_only=True)
class BoundTerms:
    """The two terms of the excess-loss bound at one mixture-split size.

    Attributes:
        num_units: n.
        statistical: B·sqrt(log k / n).
        privacy: C·sqrt(log k · log(1/δ)) / (n ε).
    """

    num_units: float
    statistical: float
    privacy: float

    @property
    def total(self) -> float:
        """The bound: statistical + privacy."""
        return self.statistical + self.privacy

    @property
    def limited_by(self) -> Regime:
        """ "privacy" when the privacy term is the larger one, else "statistics"."""
        return "privacy" if self.privacy > self.statistical else "statistics"


def excess_loss_bound(
    num_units: float,
    *,
    k: int,
    epsilon: float,
    delta: float,
    loss_scale: float = 1.0,
    clip_norm: float = 1.0,
) -> BoundTerms:
    """The bound's two terms for n = `num_units` units (see the module docstring).

    Args:
        num_units: n > 0, units in the mixture split.
        k: number of sources (>= 2).
        epsilon, delta: the mixture stage's (ε, δ).
        loss_scale: B > 0, the scale of the per-unit loss.
        clip_norm: C > 0, the mixture stage's clip norm (in the units of B).

    Raises:
        ValueError: naming the first invalid argument.
    """
    num_units = validation.check_positive(num_units, "num_units")
    k = _check_sources(k)
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    loss_scale = validation.check_positive(loss_scale, "loss_scale")
    clip_norm = validation.check_positive(clip_norm, "clip_norm")
    log_k = math.log(k)
    return BoundTerms(
        num_units=num_units,
        statistical=loss_scale * math.sqrt(log_k / num_units),
        privacy=clip_norm * math.sqrt(log_k * math.log(1 / delta)) / (num_units * epsilon),
    )


def crossover_units(
    *, epsilon: float, delta: float, loss_scale: float = 1.0, clip_norm: float = 1.0
) -> float:
    """n× = (C/B)² · log(1/δ) / ε², where the two terms are equal (independent of k)."""
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    ratio = validation.check_positive(clip_norm, "clip_norm") / validation.check_positive(
        loss_scale, "loss_scale"
    )
    return ratio**2 * math.log(1 / delta) / epsilon**2


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureSizeGuide:
    """The sufficient mixture-split size for a target accuracy, and what limits it.

    Attributes:
        num_units: the smallest integer n with bound(n) <= α.
        alpha: the target excess loss α.
        k, epsilon, delta, loss_scale, clip_norm: the inputs.
        terms: the bound's terms at `num_units`.
        crossover_units: n× = (C/B)²·log(1/δ)/ε²; below it the privacy term dominates.
    """

    num_units: int
    alpha: float
    k: int
    epsilon: float
    delta: float
    loss_scale: float
    clip_norm: float
    terms: BoundTerms
    crossover_units: float

    @property
    def limited_by(self) -> Regime:
        """ "statistics" (n >= n×: more data helps as 1/√n) or "privacy" (n < n×: as 1/n)."""
        return self.terms.limited_by

    def mix_fraction(self, total_units: int) -> float:
        """ρ = num_units / total_units for a sensitive split of `total_units` units.

        Raises:
            ValueError: if `total_units` is not positive or is smaller than `num_units` (then
                no ρ < 1 reaches α: a larger α, ε or data set is needed).
        """
        total_units = validation.check_steps(total_units, "total_units")
        if total_units < self.num_units:
            raise ValueError(
                f"total_units = {total_units} is below the {self.num_units} units needed for "
                f"α = {self.alpha:g}; no ρ <= 1 reaches it."
            )
        return self.num_units / total_units


def sufficient_mixture_size(
    *,
    k: int,
    alpha: float,
    epsilon: float,
    delta: float,
    loss_scale: float = 1.0,
    clip_norm: float = 1.0,
) -> MixtureSizeGuide:
    """The number of mixture units at which the bound reaches α, and the limiting term.

    With a = B·sqrt(log k), b = C·sqrt(log k · log(1/δ))/ε and u = 1/√n, bound(n) = a·u + b·u²;
    bound = α at u = (-a + sqrt(a² + 4bα)) / (2b) = 2α / (a + sqrt(a² + 4bα)), so n = 1/u²
    (rounded up).

    Args:
        k: number of sources (>= 2).
        alpha: target excess MixMin loss α > 0.
        epsilon, delta: the mixture stage's (ε, δ).
        loss_scale: B > 0, the scale of the per-unit loss (see the module docstring).
        clip_norm: C > 0, the mixture stage's clip norm (in the units of B).

    Raises:
        ValueError: naming the first invalid argument.
    """
    k = _check_sources(k)
    alpha = validation.check_positive(alpha, "alpha")
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    loss_scale = validation.check_positive(loss_scale, "loss_scale")
    clip_norm = validation.check_positive(clip_norm, "clip_norm")
    a = loss_scale * math.sqrt(math.log(k))
    b = clip_norm * math.sqrt(math.log(k) * math.log(1 / delta)) / epsilon
    u = 2 * alpha / (a + math.sqrt(a * a + 4 * b * alpha))
    num_units = math.ceil(1 / u**2 * (1 - 1e-12))
    return MixtureSizeGuide(
        num_units=num_units,
        alpha=alpha,
        k=k,
        epsilon=epsilon,
        delta=delta,
        loss_scale=loss_scale,
        clip_norm=clip_norm,
        terms=excess_loss_bound(
            num_units,
            k=k,
            epsilon=epsilon,
            delta=delta,
            loss_scale=loss_scale,
            clip_norm=clip_norm,
        ),
        crossover_units=crossover_units(
            epsilon=epsilon, delta=delta, loss_scale=loss_scale, clip_norm=clip_norm
        ),
    )
