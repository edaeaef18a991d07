"""The public settings of the DP-MixMin stage that every pipeline's config holds
(`MixtureConfig`)."""

from __future__ import annotations

import dataclasses

from dpmix_jax.mixing import DEFAULT_SHIFT
from dpmix_jax.privacy import accounting, plan, validation
from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureConfig:
    """Public settings of the DP-MixMin stage (see `mixing.dp_mixmin`).

    Attributes:
        steps: T, mirror-descent (or Frank-Wolfe) steps.
        batch_size: expected examples (or users, at user level) per step.
        clip_norm: C of the per-unit λ-gradient.
        learning_rate: η (None for Frank-Wolfe).
        solver: "mirror_descent" or "frank_wolfe".
        shift: per-example gradient shift before clipping.
        max_examples_per_user: G for user-level runs.
        accountant: "pld" or "rdp".
        nonprivate_steps: steps of the exact (non-private) MixMin baseline.
        noise: "independent" (default) or "bandmf" (correlated noise, cyclic Poisson sampling;
            see `mixing.dp_mixmin`).
        bands: b for noise="bandmf" (1 <= b <= steps).
        adaptive_clipping: None, or adaptive clipping of the λ-gradients (`clip_norm` is then
            the initial C; same σ and ε, see `privacy.adaptive_clipping`).
    """

    steps: int
    batch_size: float
    clip_norm: float
    learning_rate: float | None
    solver: str = "mirror_descent"
    shift: str = DEFAULT_SHIFT
    max_examples_per_user: int | None = None
    accountant: accounting.Accountant = "pld"
    nonprivate_steps: int = 300
    noise: plan.Noise = "independent"
    bands: int | None = None
    adaptive_clipping: AdaptiveClipping | None = None

    def __post_init__(self) -> None:
        validation.check_steps(self.steps)
        plan.check_noise_settings(self.noise, self.bands, self.steps)
        validation.check_steps(self.nonprivate_steps, "nonprivate_steps")
        validation.check_positive(self.batch_size, "batch_size")
        validation.check_positive(self.clip_norm, "clip_norm")
        if self.solver not in ("mirror_descent", "frank_wolfe"):
            raise ValueError(
                f"solver must be 'mirror_descent' or 'frank_wolfe', got {self.solver!r}."
            )
        if (self.learning_rate is None) != (self.solver == "frank_wolfe"):
            raise ValueError(
                "learning_rate is required for mirror descent and unused by Frank-Wolfe."
            )
        if self.adaptive_clipping is not None and not isinstance(
            self.adaptive_clipping, AdaptiveClipping
        ):
            raise ValueError(
                f"adaptive_clipping must be None or an AdaptiveClipping, got "
                f"{self.adaptive_clipping!r}."
            )
