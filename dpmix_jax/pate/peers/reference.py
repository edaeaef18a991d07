"""The two references every private generator sits between.

`generate_public` is ε = 0: the public model alone, given only the public prompt (it never reads
a teacher). `generate_nonprivate` is ε = ∞: each token is sampled from the teachers' average
next-token distribution, with no clipping and no noise, which is what the private methods
approximate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import dp_accounting
import jax
import jax.numpy as jnp

from dpmix_jax.pate.generation import PublicModel, Teachers
from dpmix_jax.pate.peers import decoding
from dpmix_jax.pate.peers.result import PeerResult

__all__ = ["generate_nonprivate", "generate_public"]


@functools.partial(jax.jit, static_argnames="temperature")
def _average_teacher_token(key: jax.Array, logits: jax.Array, temperature: float) -> jax.Array:
    probabilities = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jax.random.categorical(key, jnp.log(probabilities.mean(axis=0)))


@functools.partial(jax.jit, static_argnames="temperature")
def _public_token(key: jax.Array, logits: jax.Array, temperature: float) -> jax.Array:
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature)


def generate_public(
    public_model: PublicModel,
    *,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> PeerResult:
    """One text from the public model alone (the ε = 0 reference).

    Privacy:
        Reads no sensitive data: ε = 0.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")

    def next_token(key, prefix):
        return int(_public_token(key, jnp.asarray(public_model(prefix)), temperature))

    decoded = decoding.decode(
        next_token,
        prompt=prompt,
        key=key,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
    )
    tokens = decoded.tokens
    return PeerResult(
        tokens=tokens,
        sources=["public"] * len(tokens),
        stop_reason=decoded.stop_reason,
        event=dp_accounting.NoOpDpEvent(),
        charges={},
        epsilon=0.0,
        delta=0.0,
        teacher_forward_passes=0,
        public_forward_passes=len(tokens),
        seeded=decoded.seeded,
    )


def generate_nonprivate(
    teachers: Teachers,
    *,
    prompt: Sequence[int],
    max_new_tokens: int,
    temperature: float = 1.0,
    key: jax.Array | None = None,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> PeerResult:
    """One text sampled from the teachers' average distribution (the ε = ∞ reference).

    Privacy:
        Not private: every token reads every teacher without noise (ε = ∞). For comparison
        only; never publish its output as private text.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")

    def next_token(key, prefix):
        return int(_average_teacher_token(key, jnp.asarray(teachers(prefix)), temperature))

    decoded = decoding.decode(
        next_token,
        prompt=prompt,
        key=key,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
    )
    tokens = decoded.tokens
    return PeerResult(
        tokens=tokens,
        sources=["private"] * len(tokens),
        stop_reason=decoded.stop_reason,
        event=dp_accounting.NonPrivateDpEvent(),
        charges={"steps": len(tokens)},
        epsilon=math.inf,
        delta=0.0,
        teacher_forward_passes=teachers.num_teachers * len(tokens),
        public_forward_passes=0,
        seeded=decoded.seeded,
    )
