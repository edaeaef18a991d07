"""Display names for the ids that experiment plots show in legends and tick labels."""

from __future__ import annotations

from dpmix_jax.pipeline.compare import METHOD_NAMES

SOLVER_NAMES = {
    "mirror_descent": "mirror descent",
    "frank_wolfe": "Frank-Wolfe",
    "frank_wolfe_exponential": "Frank-Wolfe, exponential oracle",
}
SHIFT_NAMES = {"none": "no shift", "mean": "mean shift", "weighted": "weighted shift"}


def display_name(name: str) -> str:
    """The readable name of a method or solver id ("dp_mixmin" -> "DP-MixMin", "frank_wolfe" ->
    "Frank-Wolfe"); any other id with its underscores as spaces."""
    return {**METHOD_NAMES, **SOLVER_NAMES}.get(name, name.replace("_", " "))


def counted(number: int, noun: str) -> str:
    """ "1 seed", "3 seeds": a count with its noun in the right number."""
    return f"{number} {noun}" + ("" if number == 1 else "s")
