"""DP-MixMin's settings as functions of the number of sources k, and how its error scales.

The theory fixes the steps T_k and the mirror-descent step η_k from the privacy budget (ε, δ), the
mixture split's size n and k (`schedule`); the clip norm C_k comes from public data only
(`public_clip_norm`, from the per-example gradient norms of `gradient_norms`). `loglog_slope`
fits the power law of a measured error against k or n.

Example:
    >>> steps, rate = schedule(32, "mirror_descent", clip_norm=20.0, num_examples=50_000,
    ...                        epsilon=1.0, delta=1e-5, max_steps=1000, step_size=1.0)
    >>> steps, round(rate, 5)
    (1000, 0.00416)
    >>> round(loglog_slope(np.array([10, 100, 1000]), np.array([1.0, 0.1, 0.01]), 10), 6)
    -1.0
"""

from __future__ import annotations

import math

import jax
import numpy as np

from dpmix_jax.mixing import objectives, solvers
from dpmix_jax.mixing.solvers import Shift

# Frank-Wolfe with the Gaussian oracle (`solvers.run_frank_wolfe`) and with the exponential
# mechanism's (`exponential_oracle.run_exponential_frank_wolfe`): the same step sizes and T_k.
FRANK_WOLFE_SOLVERS = ("frank_wolfe", "frank_wolfe_exponential")


def mirror_descent_steps(
    k: int, *, num_examples: int, epsilon: float, delta: float, max_steps: int
) -> int:
    """T_k = min(max_steps, ⌈(nε)² / (ln k · ln(1/δ))⌉).

    Entropic mirror descent from uniform weights with step η and noisy gradients G_t has excess
    <= ln k / (ηT) + (η/2) E‖G_t‖²_∞. With ‖clipped mean‖_∞ <= C and Gaussian noise of standard
    deviation σC/b ≈ C√(T ln(1/δ))/(nε) per coordinate (Poisson rate q, σ ≈ q√(T ln(1/δ))/ε),
    E‖G_t‖²_∞ ≈ C²(1 + 2 ln k · T ln(1/δ)/(nε)²). With η = √(2 ln k / T)/C the optimisation term
    C√(2 ln k / T) and the noise term C ln k √(T ln(1/δ)) · √2/(nε) balance at this T_k.
    """
    balanced = (num_examples * epsilon) ** 2 / (math.log(k) * math.log(1.0 / delta))
    return max(1, min(max_steps, math.ceil(balanced)))


def frank_wolfe_steps(
    k: int, *, num_examples: int, epsilon: float, delta: float, max_steps: int
) -> int:
    """T_k = min(max_steps, ⌈(nε / (ln k · √ln(1/δ)))^(2/3)⌉), for either vertex oracle.

    Private Frank-Wolfe over the simplex (Talwar, Thakurta, Zhang 2015): the curvature term of
    the γ_t = 2/(t + 2) schedule falls like 1/T while each noisy vertex selection costs an
    error growing like √T · ln k · √ln(1/δ)/(nε) (the exponential-mechanism oracle of
    `exponential_oracle`, its ε_0 ∝ ε/√(T ln(1/δ))); they balance at
    T ∝ (nε / (ln k √ln(1/δ)))^(2/3).
    """
    ratio = num_examples * epsilon / (math.log(k) * math.sqrt(math.log(1.0 / delta)))
    return max(1, min(max_steps, math.ceil(ratio ** (2.0 / 3.0))))


def mirror_descent_learning_rate(
    k: int, *, steps: int, clip_norm: float, step_size: float
) -> float:
    """η_k = step_size · √(2 ln k / T_k) / C_k (the bound's step with gradient bound C_k)."""
    return step_size * math.sqrt(2.0 * math.log(k) / steps) / clip_norm


def schedule(
    k: int,
    solver: str,
    *,
    clip_norm: float,
    num_examples: int,
    epsilon: float,
    delta: float,
    max_steps: int,
    step_size: float,
) -> tuple[int, float | None]:
    """(T_k, η_k) of `solver` for k sources: "mirror_descent", or Frank-Wolfe with the
    Gaussian oracle ("frank_wolfe") or the exponential-mechanism oracle
    ("frank_wolfe_exponential").

    Args:
        k: the number of sources.
        solver: DP-MixMin's solver.
        clip_norm: C_k (η_k is inversely proportional to it).
        num_examples: n, the mixture split's size.
        epsilon, delta: the privacy target of the run.
        max_steps: the compute cap on T_k.
        step_size: a in η_k = a · √(2 ln k / T_k) / C_k.

    Returns:
        T_k and η_k; η is None for Frank-Wolfe, whose steps are γ_t = 2/(t + 2).
    """
    budget = dict(num_examples=num_examples, epsilon=epsilon, delta=delta, max_steps=max_steps)
    if solver in FRANK_WOLFE_SOLVERS:
        return frank_wolfe_steps(k, **budget), None
    steps = mirror_descent_steps(k, **budget)
    rate = mirror_descent_learning_rate(k, steps=steps, clip_norm=clip_norm, step_size=step_size)
    return steps, rate


def gradient_norms(
    preds: np.ndarray, weights: np.ndarray, *, shift: Shift = solvers.DEFAULT_SHIFT
) -> np.ndarray:
    """Norms `(n,)` of the per-example `nll` gradients at `weights`, shifted as DP-MixMin
    shifts them before clipping (`shift`, its default unless given).

    Privacy: not private; call it on public data, or only to report diagnostics.
    """
    grad = jax.grad(solvers.shifted_example_loss("nll", shift))
    examples = objectives.prepare_examples(preds)
    return np.linalg.norm(np.asarray(jax.vmap(grad, in_axes=(None, 0))(weights, examples)), axis=1)


def public_clip_norm(public_preds: list[np.ndarray], *, quantile: float, scale: float) -> float:
    """C_k = `scale` × the `quantile` quantile of the public problems' gradient norms at uniform
    λ, rounded to the nearest 2^(j/4) (so that runs at nearby k share compiled solvers).

    Privacy: reads only `public_preds`, proxy outputs on public stand-in problems.
    """
    k = public_preds[0].shape[1]
    norms = np.concatenate([gradient_norms(p, np.full(k, 1.0 / k)) for p in public_preds])
    raw = scale * float(np.quantile(norms, quantile))
    return float(2.0 ** (round(4.0 * math.log2(raw)) / 4.0))


def loglog_slope(sizes: np.ndarray, values: np.ndarray, min_size: float) -> float:
    """Least-squares slope of log(values) on log(sizes) over sizes >= `min_size` (values floored
    at 1e-12: a value <= 0 makes the slope meaningless)."""
    keep = sizes >= min_size
    return float(np.polyfit(np.log(sizes[keep]), np.log(np.maximum(values[keep], 1e-12)), 1)[0])
