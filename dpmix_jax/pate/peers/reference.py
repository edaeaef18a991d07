"""The two references every private generator sits between.

`generate_public` is ε = 0: the public model alone, given only the public prompt (it never reads
a teacher). `generate_nonprivate` is ε = ∞: each token is sampled from the teachers' average
next-token distribution, with no clipping and no noise, which is what the private methods
approximate.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import dp_accounting
import jax
import jax.numpy as jnp

from dpmix_jax.pate.generation import PublicModel, Teachers
from dpmix_jax.pate.peers.result import PeerResult
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy import randomness

__all__ = ["generate_nonprivate", "generate_public"]


@functools.partial(jax.jit, static_argnames="temperature")
def _average_teacher_token(key: jax.Array, logits: jax.Array, temperature: float) -> jax.Array:
    probabilities = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jax.random.categorical(key, jnp.log(probabilities.mean(axis=0)))


@functools.partial(jax.jit, static_argnames="temperature")
def _public_token(key: jax.Array, logits: jax.Array, temperature: float) -> jax.Array:
    return jax.random.categorical(key, logits.astype(jnp.float32) / temperature)


def _decode(
    next_token: Callable[[jax.Array, list[int]], int],
    *,
    prompt: Sequence[int],
    key: jax.Array | None,
    max_new_tokens: int,
    eos_id: int | None,
    stop_sequences: Sequence[Sequence[int]],
) -> tuple[list[int], str, bool]:
    max_new_tokens = privacy.check_steps(max_new_tokens, "max_new_tokens")
    seeded = key is not None
    key = key if seeded else randomness.prng_key(randomness.secret_seed())
    prefix = [int(t) for t in prompt]
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        key, sub = jax.random.split(key)
        token = next_token(sub, prefix + tokens)
        tokens.append(token)
        if eos_id is not None and token == eos_id:
            return tokens, "eos", seeded
        if any(tuple(tokens[-len(s) :]) == tuple(s) for s in stop_sequences):
            return tokens, "stop_sequence", seeded
    return tokens, "max_new_tokens", seeded


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

    tokens, stop_reason, seeded = _decode(
        next_token,
        prompt=prompt,
        key=key,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
    )
    return PeerResult(
        tokens=tokens,
        sources=["public"] * len(tokens),
        stop_reason=stop_reason,
        event=dp_accounting.NoOpDpEvent(),
        charges={},
        epsilon=0.0,
        delta=0.0,
        teacher_forward_passes=0,
        public_forward_passes=len(tokens),
        seeded=seeded,
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

    tokens, stop_reason, seeded = _decode(
        next_token,
        prompt=prompt,
        key=key,
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        stop_sequences=stop_sequences,
    )
    return PeerResult(
        tokens=tokens,
        sources=["private"] * len(tokens),
        stop_reason=stop_reason,
        event=dp_accounting.NonPrivateDpEvent(),
        charges={"steps": len(tokens)},
        epsilon=math.inf,
        delta=0.0,
        teacher_forward_passes=teachers.num_teachers * len(tokens),
        public_forward_passes=0,
        seeded=seeded,
    )
