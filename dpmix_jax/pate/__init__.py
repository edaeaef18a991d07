"""Hot PATE: private aggregation of teacher distributions with coordinated sampling.

Modules: `samplers` (coordinated / independent vote histograms), `aggregators` (TARGMAX, TWS and
their DP versions), `accounting` (dp-accounting events, PATE 2018 data-dependent RDP),
`smooth_sensitivity` (private release of the data-dependent ε), `individual` (per-teacher
accounting of heterogeneous ensembles with a Rényi filter), `diversity` (the (τ, β, γ)
diversity-preservation guarantee measured), `metrics` (coverage, support, yield, margins),
`generation` (private decoding), `partition` (documents' units and their keyed-hash partition
among teachers), `method` (the protocol every private text generator implements: calibrate for
a run, generate, charge), `hot_pate_method` (Hot PATE's samplers as such methods, and the
aggregator's noise calibrated for a run), `teachers` (in-context GPT-2 teachers) and `peers`
(the private generators Hot PATE is compared with: InvisibleInk, Amin et al. 2024, PMixED, and
the ε = 0 / ε = ∞ references); the last five are imported on demand. Documents, public models
and `synthesize` compose these in `dpmix_jax.synthesis`.
"""

from dpmix_jax.pate import (
    accounting,
    aggregators,
    diversity,
    generation,
    individual,
    metrics,
    samplers,
    smooth_sensitivity,
)
from dpmix_jax.pate.aggregators import (
    FAIL,
    confident_gnmax,
    dpargmax_laplace,
    dpws,
    targmax,
    tws,
    tws_probabilities,
)
from dpmix_jax.pate.generation import GenerationConfig, GenerationResult, Teachers, generate
from dpmix_jax.pate.individual import IndividualConfig, IndividualLedger, individual_step
from dpmix_jax.pate.samplers import coordinated_histograms, independent_histograms

__all__ = [
    "FAIL",
    "GenerationConfig",
    "GenerationResult",
    "IndividualConfig",
    "IndividualLedger",
    "Teachers",
    "accounting",
    "aggregators",
    "confident_gnmax",
    "coordinated_histograms",
    "diversity",
    "dpargmax_laplace",
    "dpws",
    "generate",
    "generation",
    "independent_histograms",
    "individual",
    "individual_step",
    "metrics",
    "samplers",
    "smooth_sensitivity",
    "targmax",
    "tws",
    "tws_probabilities",
]
