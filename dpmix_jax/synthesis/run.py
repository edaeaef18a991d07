"""Private synthetic text: `synthesize` from a list of documents and a public language model.

`synthesize(documents, model, epsilon=..., delta=..., num_samples=...)` splits the sensitive
documents among n teachers (`ensemble.build_ensemble`), then runs the named method of
`registry.REGISTRY` (a `pate.method.Method`: Hot PATE's coordinated or independent sampler, or
a peer) on them: calibrated so that the worst case (every sample running all its
`max_new_tokens` steps) costs at most the target ε at δ, it decodes `num_samples` texts and
charges what ran. The result is a `SynthesisResult` whose ε is the method's for the calls that
actually ran.

The privacy unit is a document, or a user when the records carry a `user` field: units go to
teachers by a keyed hash of their id (`pate.partition.teacher_parts`), so one unit's documents
sit in one teacher's prompt and adding or removing a unit changes one teacher's vote per step.

With `accounting="individual"` every unit is its own in-context teacher and each is accounted
for on its own by a Rényi filter (`individual_accounting`). With `method="dp_finetune"` there are
no teachers: DP-LoRA fine-tuning of the public model on the documents, then sampling
(`dp_finetuning`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from dpmix_jax.pate.method import Method, Plan, RunSettings
from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import public_models
from dpmix_jax.synthesis.dp_finetuning import GeneratorTuning, synthesize_finetuned
from dpmix_jax.synthesis.ensemble import Ensemble, build_ensemble, build_unit_ensemble
from dpmix_jax.synthesis.finetuned_teachers import TeacherTuning
from dpmix_jax.synthesis.individual_accounting import (
    check_individual_accounting,
    synthesize_individual,
)
from dpmix_jax.synthesis.registry import DP_FINETUNE, GENERATORS, METHODS, REGISTRY
from dpmix_jax.synthesis.result import SynthesisResult, sample_fields

__all__ = ["MIN_UNANIMOUS_RELEASE", "calibrate_on", "synthesize", "synthesize_with"]

# Hot PATE refuses a calibration whose unanimous token is released less often than this.
MIN_UNANIMOUS_RELEASE = 0.5


def synthesize(
    documents: Sequence[Mapping[str, Any]],
    model: public_models.PublicTextModel | str | os.PathLike,
    *,
    epsilon: float,
    delta: float,
    num_samples: int,
    num_teachers: int | None = None,
    method: str = "coordinated",
    prompt: str = "",
    key: jax.Array | None = None,
    aggregator: str = "confident_gnmax",
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    threshold_fraction: float | None = None,
    max_retries: int = 0,
    stop_at_newline: bool = True,
    separator: str = "\n",
    public_fallback: bool = True,
    public_candidates: int | None = None,
    batch_size: int = 64,
    on_step: Callable[[], None] | None = None,
    teachers: str = "in_context",
    tuning: TeacherTuning | None = None,
    accounting: str = "standard",
    charges_per_teacher: int | None = None,
    context_width: int | None = None,
    allow_large_delta: bool = False,
    finetuning: GeneratorTuning | None = None,
    min_unanimous_release: float = MIN_UNANIMOUS_RELEASE,
) -> SynthesisResult:
    """Generates `num_samples` texts privately from `documents` with Hot PATE, a peer, or DP
    fine-tuning.

    Args:
        documents: records `{"text": str, "user": optional id}`; with `user` the unit is a
            user (all of a user's documents go to one teacher), else a document.
        model: the public model and tokenizer: a `public_models.PublicTextModel`, or its name
            for `public_models.load_public_model` ("smollm2", "text-default", a `.gguf` file,
            a transformers folder of a GPT-2 or Llama-family model, a folder stored by dpmix).
            A model with a chat template reads its prompts as a chat turn (`synthesis.chat`).
        epsilon, delta: the total budget: the method's noise is calibrated so that the worst
            case (num_samples · max_new_tokens · (max_retries + 1) calls) costs at most (ε, δ)
            by its analysis; δ must be below 1/n for the n teachers.
        num_samples: texts to generate.
        num_teachers: n, from 2 to the number of units; fix it without looking at the data
            (not from its size): the partition depends on n, so a data-dependent n would let
            one unit move every other unit's teacher. Required with the standard accounting;
            with `accounting="individual"` every unit is its own teacher, and n must be None
            (default) or the number of units.
        method: a name of `registry.METHODS`: Hot PATE's "coordinated" (hot: shared sampling
            noise) or "independent" (cold) histograms, or a peer from `pate.peers` on the same
            teachers: "invisibleink", "amin" or "pmixed", each calibrated by its own analysis
            so that all `num_samples` texts at full length cost at most (ε, δ); `aggregator`,
            `threshold_fraction`, `max_retries`, `public_fallback` and `public_candidates` are
            Hot PATE's and do not apply to them. Or "invisibleink_disjoint": InvisibleInk in its
            package's setting, text i reading only the i-th of `num_samples` disjoint batches
            of the teachers (`num_teachers` at least `num_samples`), the run costing its
            costliest text (parallel composition). Or "dp_finetune": DP-LoRA fine-tuning of the
            public model on the documents (`finetuning`), then sampling
            (`dp_finetuning.synthesize_finetuned`); ε is paid once for any number of texts, and
            the teachers' settings (`num_teachers`, `teachers`, `tuning`, `accounting`,
            `threshold_fraction`, `max_retries`, `public_candidates`, `context_width`,
            `charges_per_teacher`) are refused.
        prompt: public text every sample starts from, read after each teacher's documents
            (for a chat model: the start of the assistant's reply).
        key: PRNG key of the partition, the samplers and the noise; None (default) draws secret
            randomness. A key makes the run reproducible and not private against anyone who
            knows it (`seeded`).
        aggregator: "confident_gnmax" (default; also releases a data-dependent ε),
            "dpargmax_laplace" or "dpws".
        max_new_tokens: length limit of a sample.
        temperature: the teachers' (and the fallback's) sampling temperature.
        threshold_fraction: the aggregator's threshold as a fraction of n (default per
            aggregator, see `pate.hot_pate_method.calibrated_config`).
        max_retries: retries of a failed step (each charged).
        stop_at_newline: a sample ends at a token holding a newline (else at EOS or the limit).
        separator: what follows each document in a teacher's prompt ("\\n": one per line;
            "\\n\\n" where the public model learned blank lines between paragraphs, so that a
            line, not an empty one, follows).
        public_fallback: on a failed step take the public model's token given only the prompt
            (free); without it the sample ends there.
        public_candidates: c: the aggregator reads only the votes for the public model's c most
            likely next tokens, the others in one bucket (same charge; None: the whole
            vocabulary, where over tens of thousands of tokens the noise makes a released token
            a near-uniform pick). The plan's `unanimous_release_probability` says how likely
            a token all teachers agree on is released.
        batch_size: teachers per forward pass.
        on_step: called once per decoding step (a progress bar in tokens).
        teachers: "in_context" (default: each teacher reads its documents in its prompt, as
            many as fit the context) or "fine_tuned" (each teacher trains its own LoRA adapter
            on all of its documents, `finetuned_teachers.finetune_teachers`, and reads only the
            prompt).
        tuning: the fine-tuned teachers' `finetuned_teachers.TeacherTuning` (None: its
            defaults).
        accounting: "standard" (default: every aggregator call charged to every teacher, the
            data-independent composition above) or "individual": per-unit accounting by a
            Rényi filter (`pate.individual`): one in-context teacher per unit, shared Gumbel
            votes, a teacher agreeing with the public model's vote abstains and is not
            charged, Gaussian noise σ on every count, and each teacher charged at most
            `charges_per_teacher` times (`individual_accounting.synthesize_individual`). It
            applies to `method="coordinated"`, the default aggregator, in-context teachers, the
            public fallback, no retries and no `threshold_fraction`; other settings are refused.
        charges_per_teacher: M, individual accounting only: the charges each teacher may
            have, from 1 to num_samples · max_new_tokens (at that bound the filter never
            binds and every teacher may be charged at every step, the data-independent
            accounting of the same mechanism). Default (None):
            `individual_accounting.default_charges_per_teacher`, the longest run's steps
            divided by `INDIVIDUAL_STEPS_PER_CHARGE`, rounded up.
        context_width: in-context teachers only: the public width, in tokens, of every
            teacher's context (its documents, after the chat turn's head for a chat model),
            left-padded to it; fix it without looking at the data. Default (None):
            `ensemble.DEFAULT_CONTEXT_WIDTH`, or less when the model's context less the prompt
            and `max_new_tokens` is shorter.
            Each teacher's KV cache holds the width, the prompt and `max_new_tokens`; the
            prefill costs n · width tokens of the model.
        allow_large_delta: accept δ >= 1/n (refused by default: at that δ the guarantee
            allows publishing a unit in the clear); the result records it.
        finetuning: `method="dp_finetune"` only: its `dp_finetuning.GeneratorTuning` (None:
            the defaults).
        min_unanimous_release: Hot PATE ("coordinated", "independent", standard accounting)
            only: the run is refused before any teacher is built when a token all n teachers
            vote for would be released with a lower probability
            (`unanimous_release_probability`): its released tokens would be near-uniform picks
            among the candidates, not the teachers' vote. The refusal
            (`pate.hot_pate_method.WeakReleaseError`) names the fewest teachers that reach it.
            0 accepts any calibration.

    Returns:
        A `SynthesisResult`.

    Raises:
        ValueError: one line naming the argument or document: no text, fewer than 2 units,
            a document longer than the model's context leaves room for, ε <= 0, δ >= 1/n
            without `allow_large_delta`, Hot PATE below `min_unanimous_release`, ...

    Privacy:
        Each teacher's prompt or adapter depends on its own units' documents only (keyed hash
        partition), and the teachers are read only through the method's calibrated mechanism,
        every call charged. The prompt, the public model and the fallback read no sensitive
        data. The result's `public_report` is publishable with the texts; its `owner_report`
        (the units, the documents that fit the prompts, confident-GNMax's data-dependent ε,
        whose release `epsilon` does not cover) is for the data owner only.

        With `accounting="individual"` the guarantee is per unit (one unit per teacher):
        (ε, δ) = the RDP of M compositions of the Gaussian mechanism with noise σ, fixed in
        advance; the realised charges are sensitive and are not in the result.
    """
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    validation.check_steps(num_samples, "num_samples")
    validation.check_steps(max_new_tokens, "max_new_tokens")
    if method not in GENERATORS:
        raise ValueError(f"method must be one of {', '.join(GENERATORS)}, got {method!r}")
    if method == DP_FINETUNE:
        _check_no_teacher_settings(
            num_teachers=num_teachers,
            teachers=teachers,
            tuning=tuning,
            accounting=accounting,
            threshold_fraction=threshold_fraction,
            max_retries=max_retries,
            public_candidates=public_candidates,
            context_width=context_width,
            charges_per_teacher=charges_per_teacher,
        )
        return synthesize_finetuned(
            documents,
            public_models.as_public_model(model),
            epsilon=epsilon,
            delta=delta,
            num_samples=num_samples,
            prompt=prompt,
            key=key,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_at_newline=stop_at_newline,
            separator=separator,
            batch_size=batch_size,
            tuning=finetuning,
            allow_large_delta=allow_large_delta,
            on_step=None if on_step is None else lambda done, total: on_step(),
        )
    if finetuning is not None:
        raise ValueError('finetuning applies to method="dp_finetune"')
    charges_per_teacher = check_individual_accounting(
        accounting=accounting,
        charges_per_teacher=charges_per_teacher,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        method=method,
        aggregator=aggregator,
        threshold_fraction=threshold_fraction,
        max_retries=max_retries,
        public_fallback=public_fallback,
        teachers=teachers,
    )
    model = public_models.as_public_model(model)
    seeded = key is not None
    partition_key = None
    if seeded:
        partition_key = jax.random.fold_in(key, 0)
        key = jax.random.fold_in(key, 1)
    if accounting == "individual":
        if public_candidates is not None:
            raise ValueError("public_candidates applies to the standard accounting only")
        ensemble = build_unit_ensemble(
            documents,
            model,
            num_teachers=num_teachers,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            stop_at_newline=stop_at_newline,
            separator=separator,
            on_step=on_step,
            context_width=context_width,
        )
        return synthesize_individual(
            ensemble,
            model,
            epsilon=epsilon,
            delta=delta,
            num_samples=num_samples,
            charges_per_teacher=charges_per_teacher,
            prompt=prompt,
            key=key,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            stop_at_newline=stop_at_newline,
            allow_large_delta=allow_large_delta,
        )
    stops = public_models.newline_tokens(model.tokenizer) if stop_at_newline else ()
    chosen, plan = _calibrate(
        method,
        model,
        num_teachers=num_teachers,
        max_new_tokens=max_new_tokens,
        stop_sequences=tuple((token,) for token in stops),
        epsilon=epsilon,
        delta=delta,
        num_samples=num_samples,
        temperature=temperature,
        stop_at_newline=stop_at_newline,
        aggregator=aggregator,
        threshold_fraction=threshold_fraction,
        max_retries=max_retries,
        public_fallback=public_fallback,
        public_candidates=public_candidates,
        allow_large_delta=allow_large_delta,
        min_unanimous_release=min_unanimous_release,
    )
    ensemble = build_ensemble(
        documents,
        model,
        num_teachers=num_teachers,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        key=partition_key,
        batch_size=batch_size,
        stop_at_newline=stop_at_newline,
        separator=separator,
        on_step=on_step,
        teachers=teachers,
        tuning=tuning,
        context_width=context_width,
    )
    return _generate(chosen, plan, ensemble, model, prompt=prompt, key=key, seeded=seeded)


def _check_no_teacher_settings(**settings: Any) -> None:
    """Refuses, in one line, a teachers' setting given to the DP fine-tuned generator."""
    defaults = {"teachers": "in_context", "accounting": "standard", "max_retries": 0}
    for name, value in settings.items():
        if value != defaults.get(name):
            raise ValueError(
                f'{name} applies to the teacher methods, not to method="{DP_FINETUNE}" (it has '
                "no teachers)"
            )


def synthesize_with(
    ensemble: Ensemble,
    model: public_models.PublicTextModel,
    *,
    epsilon: float,
    delta: float,
    num_samples: int,
    method: str = "coordinated",
    prompt: str = "",
    key: jax.Array | None = None,
    aggregator: str = "confident_gnmax",
    temperature: float = 1.0,
    threshold_fraction: float | None = None,
    max_retries: int = 0,
    stop_at_newline: bool = True,
    public_fallback: bool = True,
    public_candidates: int | None = None,
    allow_large_delta: bool = False,
    min_unanimous_release: float = MIN_UNANIMOUS_RELEASE,
    seeded: bool | None = None,
) -> SynthesisResult:
    """`synthesize`'s generation on teachers already built by `ensemble.build_ensemble` (with
    the same `prompt`), so that several methods and budgets share one prefill of the teachers'
    contexts. The arguments are `synthesize`'s; `seeded` (default: whether `key` is given) is
    what the result reports, for a caller that derived `key` from a seed of its own.

    Privacy:
        As `synthesize`: the teachers are read only through the method's calibrated mechanism,
        every call charged. Every call on the same ensemble is a release about the same units:
        their ε compose, which the caller accounts for.
    """
    chosen, plan = calibrate_on(
        ensemble,
        model,
        epsilon=epsilon,
        delta=delta,
        num_samples=num_samples,
        method=method,
        aggregator=aggregator,
        temperature=temperature,
        threshold_fraction=threshold_fraction,
        max_retries=max_retries,
        stop_at_newline=stop_at_newline,
        public_fallback=public_fallback,
        public_candidates=public_candidates,
        allow_large_delta=allow_large_delta,
        min_unanimous_release=min_unanimous_release,
    )
    seeded = key is not None if seeded is None else seeded
    return _generate(chosen, plan, ensemble, model, prompt=prompt, key=key, seeded=seeded)


def calibrate_on(
    ensemble: Ensemble,
    model: public_models.PublicTextModel,
    *,
    epsilon: float,
    delta: float,
    num_samples: int,
    method: str = "coordinated",
    aggregator: str = "confident_gnmax",
    temperature: float = 1.0,
    threshold_fraction: float | None = None,
    max_retries: int = 0,
    stop_at_newline: bool = True,
    public_fallback: bool = True,
    public_candidates: int | None = None,
    allow_large_delta: bool = False,
    min_unanimous_release: float = MIN_UNANIMOUS_RELEASE,
) -> tuple[Method, Plan]:
    """The named method and its plan for `num_samples` texts on `ensemble`'s teachers, as
    `synthesize_with` calibrates them (its arguments), without generating: the plan's
    `chosen.generate(plan, ensemble.teachers, ensemble.public_model, prompt=...)` is the run.

    Privacy:
        Reads no sensitive data: the plan depends on public settings only (n, the
        vocabulary, the stop tokens, the budget).
    """
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    validation.check_steps(num_samples, "num_samples")
    return _calibrate(
        method,
        model,
        num_teachers=ensemble.teachers.num_teachers,
        max_new_tokens=ensemble.max_new_tokens,
        stop_sequences=ensemble.stop_sequences,
        epsilon=epsilon,
        delta=delta,
        num_samples=num_samples,
        temperature=temperature,
        stop_at_newline=stop_at_newline,
        aggregator=aggregator,
        threshold_fraction=threshold_fraction,
        max_retries=max_retries,
        public_fallback=public_fallback,
        public_candidates=public_candidates,
        allow_large_delta=allow_large_delta,
        min_unanimous_release=min_unanimous_release,
    )


def _calibrate(
    method: str,
    model: public_models.PublicTextModel,
    *,
    num_teachers: int,
    max_new_tokens: int,
    stop_sequences: tuple[tuple[int, ...], ...],
    **settings: Any,
) -> tuple[Method, Plan]:
    """The named method and its plan for a run of n teachers on `model` (`settings`: the rest
    of `pate.method.RunSettings`), from public settings only: no teacher is needed.

    Raises:
        ValueError: an unknown method, δ >= 1/n without `allow_large_delta`, or the method's
            own refusal (`min_unanimous_release` for Hot PATE).

    Privacy:
        Reads no sensitive data.
    """
    if method not in REGISTRY:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    run = RunSettings(
        num_teachers=num_teachers,
        max_new_tokens=max_new_tokens,
        stop_sequences=stop_sequences,
        vocab_size=int(model.model.config.vocab_size),
        eos_id=model.tokenizer.eos_id,
        **settings,
    )
    validation.check_delta_for_units(
        run.delta, run.num_teachers, unit="teachers", allow_large_delta=run.allow_large_delta
    )
    chosen = REGISTRY[method]
    return chosen, chosen.calibrate(run)


def _generate(
    chosen: Method,
    plan: Plan,
    ensemble: Ensemble,
    model: public_models.PublicTextModel,
    *,
    prompt: str,
    key: jax.Array | None,
    seeded: bool,
) -> SynthesisResult:
    """Runs `plan` on the ensemble's teachers and charges what ran.

    Privacy:
        Reads the teachers through the method's calibrated mechanism only, every call charged.
    """
    samples = chosen.generate(
        plan, ensemble.teachers, ensemble.public_model, prompt=ensemble.prompt_ids, key=key
    )
    spent = chosen.charge(plan, samples)
    return SynthesisResult(
        **sample_fields(ensemble, model.tokenizer, prompt, samples),
        epsilon=spent.epsilon,
        delta=spent.delta,
        target_epsilon=plan.run.epsilon,
        target_delta=plan.run.delta,
        planned_epsilon=plan.planned_epsilon,
        data_dependent_epsilon=spent.data_dependent_epsilon,
        released_epsilons=spent.released_epsilons,
        aggregator=plan.aggregator,
        method=chosen.name,
        num_teachers=plan.run.num_teachers,
        steps_without_output=spent.steps_without_output,
        num_queries=spent.num_queries,
        teacher_forward_passes=spent.teacher_forward_passes,
        mechanism=dict(plan.mechanism),
        allow_large_delta=plan.run.allow_large_delta,
        seeded=seeded,
    )
