"""The privacy core: accounting, sampling, clipping, noise. Imports only jax, numpy, optax and
dp_accounting; knows no model and no data set."""

from dpmix_jax.privacy import (
    accounting,
    adaptive_clipping,
    clipping,
    correlated_noise,
    cyclic_sampling,
    noise,
    parts,
    plan,
    randomness,
    sampling,
)
from dpmix_jax.privacy.accounting import (
    PrivacyBudget,
    PrivacyLedger,
    calibrate_noise_multiplier,
    compose_ledgers,
    compose_parallel,
    compose_sequential,
    dpsgd_event,
    epsilon,
)
from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping
from dpmix_jax.privacy.clipping import ClippedGradSum, clipped_grad_sum, user_clipped_grad_sum
from dpmix_jax.privacy.correlated_noise import (
    BandedToeplitzStrategy,
    add_correlated_noise,
    amplified_bandmf_event,
    sqrt_prefix_sum,
)
from dpmix_jax.privacy.gaussian_noise import add_gaussian_noise
from dpmix_jax.privacy.noise import make_dp_sgd_step, private_optimizer
from dpmix_jax.privacy.parts import assign_parts
from dpmix_jax.privacy.plan import DpSgdConfig, DpSgdPlan, plan_dp_sgd
from dpmix_jax.privacy.randomness import SEEDED_NOTE
from dpmix_jax.privacy.sampling import PoissonSampler, UserPoissonSampler, group_by_user

__all__ = [
    "BandedToeplitzStrategy",
    "AdaptiveClipping",
    "ClippedGradSum",
    "DpSgdConfig",
    "DpSgdPlan",
    "PoissonSampler",
    "PrivacyBudget",
    "PrivacyLedger",
    "SEEDED_NOTE",
    "UserPoissonSampler",
    "accounting",
    "add_correlated_noise",
    "adaptive_clipping",
    "add_gaussian_noise",
    "amplified_bandmf_event",
    "assign_parts",
    "calibrate_noise_multiplier",
    "clipped_grad_sum",
    "clipping",
    "compose_ledgers",
    "compose_parallel",
    "compose_sequential",
    "correlated_noise",
    "cyclic_sampling",
    "dpsgd_event",
    "epsilon",
    "group_by_user",
    "make_dp_sgd_step",
    "noise",
    "parts",
    "plan",
    "plan_dp_sgd",
    "private_optimizer",
    "randomness",
    "sampling",
    "sqrt_prefix_sum",
    "user_clipped_grad_sum",
]
