"""What every peer shares as a `pate.method.Method`.

A peer is calibrated for the longest run, all of its texts at full length (num_samples ·
max_new_tokens tokens from the same teachers: each peer's cost per token composes over tokens
and texts alike), decodes each text with the run's `max_new_tokens`, and is charged its own
analysis of the texts' charges added up (`PeerResult.charges`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from dpmix_jax.pate.generation import PublicModel, Teachers
from dpmix_jax.pate.method import Plan, RunSettings, Spent, sample_keys
from dpmix_jax.pate.peers.result import PeerResult

__all__ = ["charge", "decode_texts", "plan"]

EpsilonOf = Callable[..., float]
"""A peer's analysis: `epsilon(config, delta=..., **charges)`."""


def plan(
    name: str,
    run: RunSettings,
    config: Any,
    epsilon_of: EpsilonOf,
    worst_case_charges: Mapping[str, int],
) -> Plan:
    """The `Plan` of a peer calibrated for `run.worst_case_tokens`: its planned ε is
    `epsilon_of` the worst-case charges at `run.delta`, its mechanism the config's fields.

    Privacy:
        Public: a function of public settings only.
    """
    return Plan(
        run=run,
        config=config,
        planned_epsilon=epsilon_of(config, delta=run.delta, **worst_case_charges),
        mechanism={**dataclasses.asdict(config), "max_calls": run.worst_case_tokens},
        aggregator=name,
    )


def decode_texts(
    generate_text: Callable[..., PeerResult],
    text_config: Any,
    run: RunSettings,
    teachers: Teachers,
    public_model: PublicModel,
    *,
    prompt: Sequence[int],
    key: jax.Array | None,
    **settings,
) -> list[PeerResult]:
    """The run's texts, each `generate_text(teachers, public_model, prompt=..., config=
    text_config, key=..., eos_id=..., stop_sequences=..., **settings)` with its own key
    (`pate.method.sample_keys`).

    Privacy:
        As private as `generate_text`: the teachers are read only through the peer.
    """
    return [
        generate_text(
            teachers,
            public_model,
            prompt=prompt,
            config=text_config,
            key=text_key,
            eos_id=run.eos_id,
            stop_sequences=run.stop_sequences,
            **settings,
        )
        for text_key in sample_keys(key, run.num_samples)
    ]


def charge(plan: Plan, samples: Sequence[PeerResult], epsilon_of: EpsilonOf) -> Spent:
    """`epsilon_of` the texts' charges added up, at the run's δ, and the run's counts: a query
    per token, the public model's tokens without output.

    Privacy:
        Reads the texts' charges and sources only (counts of what ran), never the teachers.
    """
    charges: collections.Counter = collections.Counter()
    for sample in samples:
        charges.update(sample.charges)
    sources = [source for sample in samples for source in sample.sources]
    return Spent(
        epsilon=epsilon_of(plan.config, delta=plan.run.delta, **charges),
        delta=plan.run.delta,
        num_queries=len(sources),
        steps_without_output=sources.count("public"),
        teacher_forward_passes=sum(sample.teacher_forward_passes for sample in samples),
    )
