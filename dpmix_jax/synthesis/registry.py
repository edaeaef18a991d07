"""The private text generators `synthesize` runs, by name.

Every entry of `REGISTRY` satisfies `pate.method.Method` (a mechanism over a teacher ensemble). A
new peer adds its `METHOD` to `PEERS` (run in its own paper's setting: to `OWN_SETTINGS`);
`synthesize`, the experiments and `dpmix generate` read the names from here.
`GENERATORS` adds DP fine-tuning (`dp_finetuning`), which has no teachers.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from dpmix_jax.pate import hot_pate_method
from dpmix_jax.pate.method import Method
from dpmix_jax.pate.peers import amin, invisibleink, pmixed

__all__ = [
    "DP_FINETUNE",
    "GENERATORS",
    "HOT_PATE",
    "METHODS",
    "OWN_SETTINGS",
    "PEERS",
    "PEER_METHODS",
    "REGISTRY",
]

HOT_PATE: Mapping[str, Method] = types.MappingProxyType(
    {m.name: m for m in (hot_pate_method.COORDINATED, hot_pate_method.INDEPENDENT)}
)
"""Hot PATE's samplers: "coordinated" (hot) and "independent" (cold)."""

PEERS: Mapping[str, Method] = types.MappingProxyType(
    {m.name: m for m in (invisibleink.METHOD, amin.METHOD, pmixed.METHOD)}
)
"""The peers Hot PATE is compared with, on the same teachers."""

OWN_SETTINGS: Mapping[str, Method] = types.MappingProxyType(
    {m.name: m for m in (invisibleink.DISJOINT_METHOD,)}
)
"""Peers in their own papers' setting rather than on the shared teachers: InvisibleInk with a
disjoint batch of teachers per text."""

REGISTRY: Mapping[str, Method] = types.MappingProxyType({**HOT_PATE, **PEERS, **OWN_SETTINGS})
"""Every method, Hot PATE's first."""

METHODS = tuple(REGISTRY)
PEER_METHODS = tuple(PEERS)

DP_FINETUNE = "dp_finetune"
"""DP-LoRA fine-tuning of the public model, then sampling (`dp_finetuning`)."""

GENERATORS = (*METHODS, DP_FINETUNE)
"""Every method `synthesize` runs: the teacher-ensemble methods and DP fine-tuning."""
