"""The private text generators `synthesize` runs, by name.

Every entry satisfies `pate.method.Method`. A new peer adds its `METHOD` to `PEERS`;
`synthesize`, the experiments and `dpmix generate` read the names from here.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from dpmix_jax.pate import hot_pate_method
from dpmix_jax.pate.method import Method
from dpmix_jax.pate.peers import amin, invisibleink, pmixed

__all__ = ["HOT_PATE", "METHODS", "PEERS", "PEER_METHODS", "REGISTRY"]

HOT_PATE: Mapping[str, Method] = types.MappingProxyType(
    {m.name: m for m in (hot_pate_method.COORDINATED, hot_pate_method.INDEPENDENT)}
)
"""Hot PATE's samplers: "coordinated" (hot) and "independent" (cold)."""

PEERS: Mapping[str, Method] = types.MappingProxyType(
    {m.name: m for m in (invisibleink.METHOD, amin.METHOD, pmixed.METHOD)}
)
"""The peers Hot PATE is compared with, on the same teachers."""

REGISTRY: Mapping[str, Method] = types.MappingProxyType({**HOT_PATE, **PEERS})
"""Every method, Hot PATE's first."""

METHODS = tuple(REGISTRY)
PEER_METHODS = tuple(PEERS)
