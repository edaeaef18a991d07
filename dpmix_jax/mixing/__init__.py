"""DP-MixMin: learn mixture weights over public sources from cached proxy outputs.

Imports `dpmix_jax.privacy` only (plus jax, numpy, optax); knows no model and no data set.
"""

from dpmix_jax.mixing import metrics, objectives, solvers
from dpmix_jax.mixing.metrics import cosine_similarity, excess_loss, l1_distance
from dpmix_jax.mixing.objectives import (
    example_loss,
    mixmin_loss,
    per_example_grads,
    per_example_losses,
    prepare_examples,
)
from dpmix_jax.mixing.solvers import (
    DEFAULT_SHIFT,
    DpMixMinResult,
    SolverTrace,
    dp_mixmin,
    mixmin,
    run_frank_wolfe,
    run_mirror_descent,
    shifted_example_loss,
)

__all__ = [
    "DEFAULT_SHIFT",
    "DpMixMinResult",
    "SolverTrace",
    "cosine_similarity",
    "dp_mixmin",
    "example_loss",
    "excess_loss",
    "l1_distance",
    "metrics",
    "mixmin",
    "mixmin_loss",
    "objectives",
    "per_example_grads",
    "per_example_losses",
    "prepare_examples",
    "run_frank_wolfe",
    "run_mirror_descent",
    "shifted_example_loss",
    "solvers",
]
