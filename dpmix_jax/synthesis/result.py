"""What `synthesize` returns: the synthetic texts, what they cost, and what may be published.

`SynthesisResult.public_report` holds what may be published beside the texts (settings fixed
without looking at the data and outputs of the DP mechanism); `owner_report` the exact
properties of the sensitive data (how many units, how many documents the teachers read), which
no guarantee covers, for the data owner only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dpmix_jax.pate.method import Sample
from dpmix_jax.privacy import SEEDED_NOTE
from dpmix_jax.synthesis.ensemble import Ensemble
from dpmix_jax.synthesis.public_models import marked_text

__all__ = ["OWNER_ONLY_NOTE", "SynthesisResult", "sample_fields"]

OWNER_ONLY_NOTE = (
    "for the data owner only, never to be published: exact properties of the sensitive data "
    "that no privacy guarantee covers (the publishable report holds the settings and the "
    "outputs of the DP mechanism)"
)
# Exact functions of the data: in the owner's report only.
_OWNER_ONLY = ("num_units", "documents_in_prompts", "owner_mechanism")
# With one teacher per unit (individual accounting) n is the number of units.
_OWNER_ONLY_PER_UNIT = ("num_teachers", "teacher_forward_passes")
# Released by smooth sensitivity, at a cost that `epsilon` does not include.
_UNACCOUNTED = ("data_dependent_epsilon", "released_epsilons")
_TEXTS = ("texts", "marked_texts", "stop_reasons")


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
            released by smooth sensitivity (`released_epsilons`, release cost included) at the
            common order λ, composed: Σ (released ε_i − ln(1/δ)/(λ−1)) + ln(1/δ)/(λ−1).
            Those releases are not in `epsilon`: publishing them spends more than it, so only
            `owner_report` holds them. None for the other aggregators.
        released_epsilons: the per-sample releases (None for the other aggregators).
        aggregator, method: the aggregator and the sampler ("coordinated" or "independent"),
            or a peer method's name twice, or "individual_gaussian" and "individual" with
            individual accounting (`mechanism` then holds σ, T, η and M), or "dp_sgd" and
            "dp_finetune" for the DP fine-tuned generator (`dp_finetuning`).
        num_teachers, num_units, unit: n (None for the DP fine-tuned generator, which has no
            teachers), the sensitive units behind them, and their kind ("documents" or
            "users").
        documents_in_prompts: documents the teachers read (in their prompts, or fine-tuned on;
            the generator's training documents).
        teachers: the teachers' kind, "in_context" or "fine_tuned" ("none" for the DP
            fine-tuned generator).
        context_width: in-context teachers: the public width of a teacher's context, in tokens
            (documents that do not fit it are not read); None for fine-tuned teachers.
        tokens_generated: tokens in all samples (private plus fallback).
        steps_with_output: steps whose token the aggregator released (tokens from the
            teachers); every token for the DP fine-tuned generator, all from its private model.
        steps_without_output: steps where every try failed (fallback token, or the end).
        num_queries: aggregator calls (steps plus retries), all charged; the DP-SGD steps of
            the DP fine-tuned generator.
        teacher_forward_passes: ensemble queries times n (each teacher ran once per step).
        mechanism: the calibrated parameters (σ1, σ2, T, per-call ε / δ, release λ, β, σ_s).
        owner_mechanism: what depends on the data's size for the DP fine-tuned generator (its
            noise multiplier and sampling rate, from the unit count, the accountant's exact ε,
            the documents cut to the row length); in `owner_report` only. None for the other
            methods.
        allow_large_delta: True when the caller accepted δ >= 1/n.
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
    num_teachers: int | None
    num_units: int
    unit: str
    documents_in_prompts: int
    teachers: str
    context_width: int | None
    tokens_generated: int
    steps_with_output: int
    steps_without_output: int
    num_queries: int
    teacher_forward_passes: int
    mechanism: dict
    allow_large_delta: bool
    seeded: bool
    owner_mechanism: dict | None = None

    @property
    def teacher_token_share(self) -> float | None:
        """The share of the samples' tokens that came from the teachers (the rest came from
        the public model); 0 when no token was generated, None for a generator without
        teachers (DP fine-tuning).

        Privacy:
            An output of the DP mechanism (the marked texts show every token's source).
        """
        if self.num_teachers is None:
            return None
        return self.steps_with_output / self.tokens_generated if self.tokens_generated else 0.0

    def public_report(self) -> dict:
        """What may be published beside the texts, JSON-serialisable: the ε spent, the
        calibrated mechanism, the counts of tokens and queries, the teachers' share of the
        tokens, and the randomness (the seeded note when seeded).

        Privacy:
            Holds settings fixed without looking at the data and outputs of the DP mechanism
            only: no count of units or documents, no n where n is the number of units (one
            teacher per unit), and not the data-dependent ε, whose release `epsilon` does not
            cover (all in `owner_report`).
        """
        fields = self._fields()
        for name in self._owner_only():
            fields.pop(name)
        fields["teacher_token_share"] = self.teacher_token_share
        fields["randomness"] = SEEDED_NOTE if self.seeded else "secret (operating system)"
        return fields

    def owner_report(self) -> dict:
        """The exact properties of the sensitive data `public_report` leaves out, with a note
        saying so, JSON-serialisable: the units, the documents the teachers read, n when each
        unit is a teacher, and confident-GNMax's data-dependent ε.

        Privacy:
            Not covered by any guarantee: for the data owner's eyes only. Publishing it can
            tell two data sets apart with certainty (40 documents from 41).
        """
        fields = self._fields()
        owner = {"note": OWNER_ONLY_NOTE}
        owner.update({name: fields[name] for name in self._owner_only()})
        if self.data_dependent_epsilon is not None:
            owner["data_dependent_epsilon_note"] = (
                "released by smooth sensitivity at a cost not included in epsilon: publishing "
                "it spends more than epsilon"
            )
        return owner

    def _owner_only(self) -> tuple[str, ...]:
        """The fields that only `owner_report` holds."""
        per_unit = _OWNER_ONLY_PER_UNIT if self.method == "individual" else ()
        return (*_OWNER_ONLY, *per_unit, *_UNACCOUNTED)

    def _fields(self) -> dict[str, Any]:
        """Every field but the texts, JSON-serialisable."""
        fields = dataclasses.asdict(self)
        for name in _TEXTS:
            fields.pop(name)
        if self.released_epsilons is not None:
            fields["released_epsilons"] = list(self.released_epsilons)
        return fields


def sample_fields(
    ensemble: Ensemble, tokenizer: Any, prompt: str, samples: Sequence[Sample]
) -> dict[str, Any]:
    """The `SynthesisResult` fields every method fills the same way from its samples and the
    ensemble: the texts (prompt first), the marked texts, the stop reasons, the units, the
    context width, and the counts of tokens.

    Privacy:
        `num_units` and `documents_in_prompts` are exact functions of the data: for the data
        owner's report (`SynthesisResult.owner_report`).
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
        "context_width": ensemble.context_width,
        "tokens_generated": len(sources),
        "steps_with_output": sources.count("private"),
    }
