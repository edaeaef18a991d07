"""DP-MixMin: learn mixture weights over public sources from cached proxy outputs.

Imports `dpmix_jax.privacy` only (plus jax, numpy, optax); knows no model and no data set.
"""

from dpmix_jax.mixing import (
    exponential_oracle,
    metrics,
    objectives,
    sample_size,
    scaling,
    solvers,
    subspace,
    synthetic,
)
from dpmix_jax.mixing.exponential_oracle import (
    ExponentialFrankWolfeResult,
    dp_exponential_frank_wolfe,
    run_exponential_frank_wolfe,
)
from dpmix_jax.mixing.metrics import (
    cosine_similarity,
    excess_loss,
    l1_distance,
    uniform_cosine,
)
from dpmix_jax.mixing.objectives import (
    example_loss,
    mixmin_loss,
    per_example_grads,
    per_example_losses,
    prepare_examples,
)
from dpmix_jax.mixing.sample_size import (
    BoundTerms,
    MixtureSizeGuide,
    crossover_units,
    excess_loss_bound,
    sufficient_mixture_size,
)
from dpmix_jax.mixing.solvers import (
    DEFAULT_SHIFT,
    DpMixMinResult,
    MixtureRelease,
    SolverTrace,
    dp_mixmin,
    mixmin,
    run_frank_wolfe,
    run_mirror_descent,
    shifted_example_loss,
)
from dpmix_jax.mixing.subspace import (
    gradient_subspace_distance,
    projection_distance,
    top_subspace,
)

__all__ = [
    "DEFAULT_SHIFT",
    "BoundTerms",
    "DpMixMinResult",
    "ExponentialFrankWolfeResult",
    "MixtureRelease",
    "MixtureSizeGuide",
    "SolverTrace",
    "cosine_similarity",
    "crossover_units",
    "dp_exponential_frank_wolfe",
    "dp_mixmin",
    "example_loss",
    "excess_loss",
    "excess_loss_bound",
    "exponential_oracle",
    "gradient_subspace_distance",
    "l1_distance",
    "metrics",
    "mixmin",
    "mixmin_loss",
    "objectives",
    "per_example_grads",
    "per_example_losses",
    "prepare_examples",
    "projection_distance",
    "run_exponential_frank_wolfe",
    "run_frank_wolfe",
    "run_mirror_descent",
    "sample_size",
    "scaling",
    "shifted_example_loss",
    "solvers",
    "subspace",
    "sufficient_mixture_size",
    "synthetic",
    "top_subspace",
    "uniform_cosine",
]
