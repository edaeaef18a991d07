"""Validation of the privacy parameters every module takes: one clear line naming the argument.

Each `check_*` returns the value in its canonical Python type, or raises `ValueError` with the
argument's name, what it must be and what it got, so that bad input never reaches a mechanism or
an accountant as a quiet default.

Example:
    >>> check_delta_for_units(1e-6, 1000)
    1e-06
    >>> check_steps(3.0)
    3
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def check_epsilon(epsilon: float, name: str = "epsilon") -> float:
    """Returns `epsilon` as a float, or raises ValueError if it is not a finite positive number."""
    if not is_real(epsilon) or not math.isfinite(epsilon) or epsilon <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {epsilon!r}.")
    return float(epsilon)


def check_delta(delta: float, name: str = "delta") -> float:
    """Returns `delta` as a float, or raises ValueError unless 0 < delta < 1."""
    if not is_real(delta) or not 0 < delta < 1:
        raise ValueError(f"{name} must be in the open interval (0, 1), got {delta!r}.")
    return float(delta)


class LargeDeltaError(ValueError):
    """δ >= 1/n for the n units a guarantee covers (see `check_delta_for_units`).

    `str(error)` names the library's override (`allow_large_delta=True`); a command line shows
    `message(flag)` with its own flag, or none where it has no override.
    """

    def __init__(self, delta: float, num_units: int, unit: str, name: str):
        self.delta, self.num_units, self.unit, self.name = delta, num_units, unit, name
        super().__init__(self.message("allow_large_delta=True"))

    def message(self, override: str | None) -> str:
        """The refusal, ending with how to override it (`override`), or without one."""
        n, unit = self.num_units, self.unit
        text = (
            f"{self.name} = {self.delta:g} >= 1/n = {1 / n:.3g} for n = {n} {unit}: publishing "
            f"one of the {unit}, drawn at random, in the clear meets that δ, so the guarantee "
            f"means nothing; use {self.name} < 1/n (e.g. {_suggested_delta(n):.0e})"
        )
        if override is None:
            return text + "."
        return text + f", or {override} to run anyway (the result records it)."


def check_delta_for_units(
    delta: float,
    num_units: int,
    *,
    unit: str = "units",
    name: str = "delta",
    allow_large_delta: bool = False,
) -> float:
    """Returns `delta` as a float, or raises ValueError when it is at least 1/`num_units`.

    Args:
        delta: the δ a mechanism on `num_units` units is calibrated or reported at.
        num_units: n, the units (examples, or users at user level) whose add/remove the
            guarantee covers.
        unit: what a unit is, for the message ("examples", "users", "records").
        name: the argument's name, for the message.
        allow_large_delta: accept δ >= 1/n (validity is still checked: 0 < δ < 1).

    Raises:
        ValueError: δ is not in (0, 1); `LargeDeltaError` (a ValueError): δ >= 1/n without
            `allow_large_delta`.

    Privacy: a mechanism that publishes one of the n units, chosen at random, in the clear is
    (0, 1/n)-DP; at δ >= 1/n an (ε, δ) guarantee allows that, so it protects nobody.
    """
    delta = check_delta(delta, name)
    if not isinstance(num_units, numbers.Integral) or num_units < 1:
        raise ValueError(f"num_units must be an integer >= 1, got {num_units!r}.")
    if not allow_large_delta and delta * num_units >= 1:
        raise LargeDeltaError(delta, int(num_units), unit, name)
    return delta


def _suggested_delta(num_units: int) -> float:
    """A power of ten at most 1/n^1.1: the usual δ << 1/n."""
    return 10.0 ** math.floor(-1.1 * math.log10(num_units) - 1e-9)


def check_sampling_rate(rate: float, name: str = "sampling_rate") -> float:
    """Returns `rate` as a float, or raises ValueError unless 0 < rate <= 1."""
    if not is_real(rate) or not 0 < rate <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {rate!r}.")
    return float(rate)


def check_steps(steps: int, name: str = "steps") -> int:
    """Returns `steps` as an int, or raises ValueError unless it is an integer >= 1 (a Python or
    NumPy integer, or an integral float)."""
    if not is_real(steps) or not math.isfinite(steps) or steps != int(steps) or steps < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {steps!r}.")
    return int(steps)


def check_positive(value: float, name: str) -> float:
    """Returns `value` as a float, or raises ValueError unless it is finite and > 0."""
    if not is_real(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}.")
    return float(value)


def check_noise_multiplier(noise_multiplier: float) -> float:
    """Returns σ as a float, or raises ValueError unless finite and >= 0 (0 means no noise)."""
    if not is_real(noise_multiplier) or not math.isfinite(noise_multiplier):
        raise ValueError(
            f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}."
        )
    if noise_multiplier < 0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}.")
    return float(noise_multiplier)


def is_real(value: Any) -> bool:
    """True for Python and NumPy ints and floats (np.float32(1.0), np.int64(5)), not for bools."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
