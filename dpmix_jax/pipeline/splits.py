"""How a run divides its data and draws its public choices: the keyed (D_mix, D_ft) split of the
privacy units (`split_mixture`), random search's candidate mixtures, and the seeds of named
streams of a run seed (`derived_seed`)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from dpmix_jax.privacy import assign_parts


def split_mixture(
    unit_ids: Sequence[Any] | np.ndarray, mix_fraction: float, *, key: bytes | int
) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint (D_mix, D_ft) row positions: each unit's rows go to D_mix with probability ρ.

    Args:
        unit_ids: per row, the stable id of its privacy unit (the example's own id, or its
            user's or patient's id: rows of one unit always land in the same part).
        mix_fraction: ρ.
        key: the part-assignment key (`privacy.assign_parts`).

    Privacy: a unit's part is a keyed hash of its id alone (`privacy.assign_parts`), never a
    function of the other units, so adding or removing a unit moves no other unit and the two
    parts' budgets compose in parallel under add/remove.
    """
    if not 0 < mix_fraction < 1:
        raise ValueError(f"mix_fraction (ρ) must be in (0, 1), got {mix_fraction!r}.")
    parts = assign_parts(unit_ids, (mix_fraction, 1 - mix_fraction), key=key)
    mix, ft = np.flatnonzero(parts == 0), np.flatnonzero(parts == 1)
    if len(mix) == 0 or len(ft) == 0:
        raise ValueError(
            f"ρ = {mix_fraction} left a part of the {len(parts)} rows empty; change ρ."
        )
    return mix, ft


def dirichlet_candidates(k: int, count: int, *, seed: int) -> np.ndarray:
    """`count` mixture candidates λ ~ Dirichlet(1, ..., 1) over k sources (random search)."""
    return np.random.default_rng(seed).dirichlet(np.ones(k), size=count)


def derived_seed(seed: int, *names: object) -> int:
    """A 32-bit seed for one named use of the run seed (a different stream per full name).

    Every noisy stage derives its noise key and sampler seed from its own name, including the
    target ε, so runs at different ε or from different initialisations never share noise.
    """
    text = "/".join(str(n) for n in (seed, *names))
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")
