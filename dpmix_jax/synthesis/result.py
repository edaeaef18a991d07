"""What `synthesize` returns: the synthetic texts and what they cost."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dpmix_jax.pate.method import Sample
from dpmix_jax.privacy import SEEDED_NOTE
from dpmix_jax.synthesis.ensemble import Ensemble
from dpmix_jax.synthesis.public_models import marked_text

__all__ = ["SynthesisResult", "sample_fields"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthesisResult:
    """Synthetic texts and what they cost.

    Attributes:
        texts: per sample, the prompt followed by the generated text (without the EOS token
            that ended it, if one did).
        marked_texts: the same with the public fallback's tokens in [ ].
        stop_reasons: per sample, `GenerationResult.stop_reason`.
        epsilon: the accountant's data-independent ε of every aggregator call that ran (with
            individual accounting: the per-unit guarantee from M, whatever the run charged).
        delta: its δ (the report δ plus DPWS's per-call δ of the calls that ran).
        target_epsilon, target_delta: the budget the noise was calibrated to.
        planned_epsilon: the data-independent ε had every sample run all its steps (<= target).
        data_dependent_epsilon: confident-GNMax only: the samples' data-dependent ε, each
            released privately by smooth sensitivity (`released_epsilons`, release cost
            included) at the common order λ, composed: Σ (released ε_i − ln(1/δ)/(λ−1)) +
            ln(1/δ)/(λ−1). None for the other aggregators.
        released_epsilons: the per-sample releases (None for the other aggregators).
        aggregator, method: the aggregator and the sampler ("coordinated" or "independent"),
            or a peer method's name twice, or "individual_gaussian" and "individual" with
            individual accounting (`mechanism` then holds σ, T, η and M).
        num_teachers, num_units, unit: n, the sensitive units behind them, and their kind
            ("documents" or "users").
        documents_in_prompts: documents the teachers read (in their prompts, or fine-tuned on).
        teachers: the teachers' kind, "in_context" or "fine_tuned".
        tokens_generated: tokens in all samples (private plus fallback).
        steps_with_output: steps whose token the aggregator released.
        steps_without_output: steps where every try failed (fallback token, or the end).
        num_queries: aggregator calls (steps plus retries), all charged.
        teacher_forward_passes: ensemble queries times n (each teacher ran once per step).
        mechanism: the calibrated parameters (σ1, σ2, T, per-call ε / δ, release λ, β, σ_s).
        seeded: True when the caller gave the key (`privacy.SEEDED_NOTE`).
    """

    texts: tuple[str, ...]
    marked_texts: tuple[str, ...]
    stop_reasons: tuple[str, ...]
    epsilon: float
    delta: float
    target_epsilon: float
    target_delta: float
    planned_epsilon: float
    data_dependent_epsilon: float | None
    released_epsilons: tuple[float, ...] | None
    aggregator: str
    method: str
    num_teachers: int
    num_units: int
    unit: str
    documents_in_prompts: int
    teachers: str
    tokens_generated: int
    steps_with_output: int
    steps_without_output: int
    num_queries: int
    teacher_forward_passes: int
    mechanism: dict
    seeded: bool

    def report(self) -> dict:
        """Everything but the texts, JSON-serialisable, with the seeded note when seeded."""
        fields = dataclasses.asdict(self)
        for name in ("texts", "marked_texts", "stop_reasons"):
            fields.pop(name)
        if self.released_epsilons is not None:
            fields["released_epsilons"] = list(self.released_epsilons)
        fields["randomness"] = SEEDED_NOTE if self.seeded else "secret (operating system)"
        return fields


def sample_fields(
    ensemble: Ensemble, tokenizer: Any, prompt: str, samples: Sequence[Sample]
) -> dict[str, Any]:
    """The `SynthesisResult` fields every method fills the same way from its samples and the
    ensemble: the texts (prompt first), the marked texts, the stop reasons, the units, and the
    counts of tokens.

    Privacy:
        `documents_in_prompts` depends on the documents' lengths: for the data owner's report.
    """
    sources = [source for sample in samples for source in sample.sources]
    # A sample that ended at EOS (an instruct model's end of turn) ends there: the token is
    # counted, not written.
    kept = [len(x.tokens) - (x.stop_reason == "eos") for x in samples]
    return {
        "texts": tuple(
            prompt + tokenizer.decode(x.tokens[:k]) for x, k in zip(samples, kept, strict=True)
        ),
        "marked_texts": tuple(
            prompt + marked_text(tokenizer, x.tokens[:k], x.sources[:k])
            for x, k in zip(samples, kept, strict=True)
        ),
        "stop_reasons": tuple(x.stop_reason for x in samples),
        "num_units": ensemble.num_units,
        "unit": ensemble.unit,
        "documents_in_prompts": ensemble.documents_in_prompts,
        "teachers": ensemble.kind,
        "tokens_generated": len(sources),
        "steps_with_output": sources.count("private"),
    }
