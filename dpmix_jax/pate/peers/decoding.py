"""The token loop the peers share: draw, append, stop on EOS, a stop sequence or the limit."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax

from dpmix_jax.pate.generation import Teachers
from dpmix_jax.privacy import randomness, validation

__all__ = ["Decoded", "check_teachers", "decode"]


def check_teachers(teachers: Teachers, num_teachers: int) -> None:
    """Raises ValueError unless `teachers` is a `Teachers` ensemble of the n the config was
    calibrated for (every peer's analysis divides by n).

    Privacy: reads only the ensemble's size, which is public (fixed before the data is seen).
    """
    if not isinstance(teachers, Teachers):
        raise ValueError("teachers must implement the Teachers protocol.")
    if teachers.num_teachers != num_teachers:
        raise ValueError(
            f"config.num_teachers is {num_teachers} but the ensemble has "
            f"{teachers.num_teachers} teachers; calibrate for this ensemble (the accounting "
            "depends on n)."
        )


@dataclasses.dataclass(frozen=True)
class Decoded:
    """The generated tokens, why decoding stopped, and whether the caller gave the key."""

    tokens: list[int]
    stop_reason: str
    seeded: bool


def decode(
    next_token: Callable[[jax.Array, list[int]], int],
    *,
    prompt: Sequence[int],
    key: jax.Array | None,
    max_new_tokens: int,
    eos_id: int | None = None,
    stop_sequences: Sequence[Sequence[int]] = (),
) -> Decoded:
    """Calls `next_token(key, prompt + tokens)` with a fresh subkey until it returns `eos_id`,
    the tokens end with a stop sequence, or `max_new_tokens` tokens are out.

    Args:
        next_token: draws one token after a prefix.
        prompt: the public prefix.
        key: PRNG key of the draws; None draws a secret one from the operating system (a known
            key makes the text reproducible by whoever knows it).
        max_new_tokens: length limit.
        eos_id: the end token (None: none).
        stop_sequences: token sequences that end the text once it ends with one.

    Raises:
        ValueError: `max_new_tokens` is not a positive integer or a stop sequence is empty.

    Privacy: as private as `next_token`; the loop reads nothing else.
    """
    max_new_tokens = validation.check_steps(max_new_tokens, "max_new_tokens")
    stops = [tuple(int(t) for t in s) for s in stop_sequences]
    if any(len(s) == 0 for s in stops):
        raise ValueError("stop_sequences must not contain an empty sequence.")
    seeded = key is not None
    key = key if seeded else randomness.prng_key(randomness.secret_seed())
    prefix = [int(t) for t in prompt]
    tokens: list[int] = []
    while len(tokens) < max_new_tokens:
        key, sub = jax.random.split(key)
        tokens.append(int(next_token(sub, prefix + tokens)))
        if eos_id is not None and tokens[-1] == eos_id:
            return Decoded(tokens, "eos", seeded)
        if any(tuple(tokens[-len(s) :]) == s for s in stops):
            return Decoded(tokens, "stop_sequence", seeded)
    return Decoded(tokens, "max_new_tokens", seeded)
