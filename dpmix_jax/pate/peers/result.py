"""What one peer decoding run produced and what it cost."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import dp_accounting

__all__ = ["PeerResult"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class PeerResult:
    """One decoded text of a peer method.

    Attributes:
        tokens: the generated tokens (prompt excluded).
        sources: per token, "private" (its distribution read the teachers) or "public" (it came
            from the public model alone, e.g. after a sparse-vector test).
        stop_reason: "eos", "stop_sequence", "max_new_tokens" or, for a method with a budget
            of private tokens per text, "private_token_budget".
        event: the dp-accounting event of everything this run executed (steps that ran, not
            the worst case); `UnsupportedDpEvent` parts where dp-accounting cannot express the
            method's analysis.
        charges: the counts the method's analysis charges for this run, the keyword arguments
            of the method's `epsilon(config, delta=..., **charges)` (counts of several runs of
            one config add up: their composition is `epsilon` of the sums).
        epsilon: the method's own analysis of `event` at `delta`.
        delta: the δ of that guarantee.
        teacher_forward_passes: teacher forward passes made (n per private step).
        public_forward_passes: public-model forward passes made.
        seeded: True when the caller gave the key (reproducible by whoever knows it).
    """

    tokens: list[int]
    sources: list[str]
    stop_reason: str
    event: dp_accounting.DpEvent
    charges: Mapping[str, int]
    epsilon: float
    delta: float
    teacher_forward_passes: int
    public_forward_passes: int
    seeded: bool

    @property
    def private_steps(self) -> int:
        """Tokens whose distribution read the teachers."""
        return self.sources.count("private")
