"""Validation of the compute and parameter dtypes of the models' configs."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def float_dtype(value: Any, name: str) -> jnp.dtype:
    """`value` as a floating `jnp.dtype`, or ValueError naming the field."""
    try:
        dtype = jnp.dtype(value)
    except TypeError as err:
        raise ValueError(f"{name} must be a floating dtype, got {value!r}") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {dtype}")
    return dtype
