"""DP fine-tuning as a generator: DP-LoRA of the public model on the sensitive documents, then
sampling as many texts as wanted.

The generator most people reach for: low-rank adapters (`models.lora`) on every attention and MLP
projection of the public model, trained with DP-SGD by the `train.Trainer` (Poisson-sampled units,
per-unit clipped gradient sums, Gaussian noise calibrated by the PLD accountant), then texts
sampled from the fine-tuned model. Its ε is paid once, for any number of texts; Hot PATE and its
peers pay per generated token.

Each training row is the public context the public model reads in `synthesize` (for an instruct
model the chat turn with no documents, `ensemble.prompt_layout`) and the public prompt, then a
document's first tokens and its separator, at most `max_new_tokens` of them: the loss scores those
alone. Sampling decodes from the same context and prompt, so no fine-tuning at all is the public
model's own text. A generator trained once samples any number of texts, after any public prefix:
documents that begin with their label (public, e.g. a topic) give texts conditioned on it.

API:
    GeneratorTuning(*, lora, steps, batch_size, learning_rate, clip_norm, max_documents_per_user)
    finetune_generator(documents, model, *, epsilon, delta, prompt, ...) -> FinetunedGenerator
    FinetunedGenerator.sample(num_samples, *, prefix, key, ...) -> SynthesisResult
    synthesize_finetuned(documents, model, *, epsilon, delta, num_samples, ...) -> SynthesisResult
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dpmix_jax.models import lora
from dpmix_jax.models.gpt2 import generate
from dpmix_jax.pate.partition import document_units
from dpmix_jax.privacy import randomness, validation
from dpmix_jax.synthesis import public_models
from dpmix_jax.synthesis.ensemble import prompt_layout
from dpmix_jax.synthesis.registry import DP_FINETUNE
from dpmix_jax.synthesis.result import SynthesisResult
from dpmix_jax.train import IndexedData, TrainConfig, Trainer, fit
from dpmix_jax.train.losses import sequence_log_prob

__all__ = ["FinetunedGenerator", "GeneratorTuning", "finetune_generator", "synthesize_finetuned"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class GeneratorTuning:
    """How the DP fine-tuned generator trains.

    Attributes:
        lora: the adapters (on every attention and MLP projection; B starts at 0, so the
            untrained generator is the public model).
        steps: DP-SGD steps (Adam on the noisy gradient).
        batch_size: the expected number of units in a step (Poisson sampling at rate
            batch_size / units).
        learning_rate: Adam's step size.
        clip_norm: C, the bound on a unit's gradient (a user's documents averaged first).
        max_documents_per_user: G, the documents of a user a step reads at most (user level).
    """

    lora: lora.LoraConfig = lora.LoraConfig(rank=8, alpha=16.0)
    steps: int = 30
    batch_size: int = 8
    learning_rate: float = 2e-3
    clip_norm: float = 1.0
    max_documents_per_user: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.lora, lora.LoraConfig):
            raise ValueError(f"lora must be a LoraConfig, got {type(self.lora).__name__}")
        for name in ("steps", "batch_size", "max_documents_per_user"):
            validation.check_steps(getattr(self, name), name)
        for name in ("learning_rate", "clip_norm"):
            validation.check_positive(getattr(self, name), name)


@dataclasses.dataclass(frozen=True)
class _Sample:
    tokens: tuple[int, ...]
    sources: tuple[str, ...]
    stop_reason: str


def _training_rows(
    encoded: Sequence[Sequence[int]], context: Sequence[int], end: Sequence[int], width: int
) -> dict[str, np.ndarray]:
    """Rows of `len(context) + width` tokens: the context, then a document and `end`, cut to
    `width` and right-padded; `attention` marks the real tokens, `scored` the ones the loss
    counts (a token counts when it and its predecessor are marked: the document's and `end`'s).

    Privacy: one row per document, a function of that document alone.
    """
    length = len(context) + width
    tokens = np.zeros((len(encoded), length), np.int32)
    attention = np.zeros((len(encoded), length), bool)
    scored = np.zeros((len(encoded), length), bool)
    for row, ids in enumerate(encoded):
        target = [*ids, *end][:width]
        tokens[row, : len(context)] = context
        tokens[row, len(context) : len(context) + len(target)] = target
        attention[row, : len(context) + len(target)] = True
        scored[row, len(context) - 1 : len(context) + len(target)] = True
    return {"tokens": tokens, "attention": attention, "scored": scored}


def _document_nll(model: nnx.Module, batch: Mapping[str, jax.Array]) -> jax.Array:
    """Per row, the mean negative log-likelihood of its document's tokens given the context."""
    logits = model(batch["tokens"], attention_mask=batch["attention"])
    log_prob, count = sequence_log_prob(logits, batch["tokens"], batch["scored"])
    return -log_prob / jnp.maximum(count, 1.0)


def _gather(rows: dict[str, np.ndarray]) -> Callable[[np.ndarray], dict[str, np.ndarray]]:
    def gather(indices: np.ndarray) -> dict[str, np.ndarray]:
        indices = np.asarray(indices)
        keep = indices >= 0
        picked = {name: array[np.maximum(indices, 0)] for name, array in rows.items()}
        return {name: np.where(keep[:, None], array, 0) for name, array in picked.items()}

    return gather


def _cut(
    tokens: np.ndarray, *, eos_id: int, stops: frozenset[int], stop_at_newline: bool
) -> _Sample:
    """A decoded row up to its first end-of-text token (kept, as the other methods keep it) or,
    with `stop_at_newline`, its first token holding a newline."""
    kept: list[int] = []
    reason = "max_new_tokens"
    for token in tokens.tolist():
        kept.append(token)
        if token == eos_id:
            reason = "eos"
            break
        if stop_at_newline and token in stops:
            reason = "stop_sequence"
            break
    return _Sample(tuple(kept), ("private",) * len(kept), reason)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class FinetunedGenerator:
    """A public model DP-fine-tuned on sensitive documents (`finetune_generator`): sampling from
    it, any number of texts after any public prefix, costs no further privacy.

    Attributes:
        model: the public model with the trained adapters merged into its weights.
        tokenizer: the public model's tokenizer.
        context: the public token context every training row began with (the public model's
            context and the prompt).
        prompt: the public prompt the training rows and every sample start from.
        max_new_tokens: the document tokens a training row held: the longest sample.
        seeded: whether the training's noise and sampling came from a caller's key.
        result_fields: the `SynthesisResult` fields every sample shares: the settings, ε and
            δ, and the exact counts `num_units` and `documents_in_prompts`, which the result's
            `public_report` leaves out (owner only).
        owner_mechanism: what only the data's owner may read: the noise multiplier and
            sampling rate (functions of the exact unit count), the accountant's exact ε and
            how many documents were truncated.

    Privacy:
        The adapted weights are (ε, δ)-DP at the unit level; every sample is post-processing.
        `owner_mechanism` and the exact counts in `result_fields` describe the data and must
        not be published: publish a sample's `public_report()`.
    """

    model: nnx.Module
    tokenizer: Any
    context: tuple[int, ...]
    prompt: str
    max_new_tokens: int
    seeded: bool
    result_fields: Mapping[str, Any]
    owner_mechanism: Mapping[str, Any]

    @property
    def epsilon(self) -> float:
        """The target ε the noise was calibrated to (the accountant's is at most it)."""
        return self.result_fields["epsilon"]

    def sample(
        self,
        num_samples: int,
        *,
        prefix: str = "",
        key: jax.Array | None = None,
        temperature: float = 1.0,
        stop_at_newline: bool = True,
        batch_size: int = 64,
    ) -> SynthesisResult:
        """`num_samples` texts, each the prompt, then the public `prefix`, then what the
        fine-tuned model writes (at most `max_new_tokens` tokens).

        Args:
            num_samples: texts to sample.
            prefix: public text after the prompt that every sample continues (a label the
                training documents began with, for texts conditioned on it). It is tokenized
                on its own: end it where a word ends, as the label does in the documents.
            key: PRNG key of the decoding; None draws a secret one.
            temperature: the sampling temperature.
            stop_at_newline: a sample ends at a token holding a newline (else at EOS or the
                limit).
            batch_size: samples decoded at once.

        Returns:
            A `SynthesisResult` (method "dp_finetune", aggregator "dp_sgd", no teachers).

        Raises:
            ValueError: one line naming the argument.

        Privacy:
            Post-processing of the (ε, δ)-DP weights: no further cost.
        """
        validation.check_steps(num_samples, "num_samples")
        validation.check_steps(batch_size, "batch_size")
        if not isinstance(prefix, str):
            raise ValueError(f"prefix must be a string, got {type(prefix).__name__}")
        _check_temperature(temperature)
        tokenizer = self.tokenizer
        context = [*self.context, *(tokenizer.encode(prefix) if prefix else [])]
        positions = self.model.config.n_positions
        if len(context) + self.max_new_tokens > positions:
            raise ValueError(
                f"the prompt's and prefix's {len(context)} tokens and max_new_tokens = "
                f"{self.max_new_tokens} exceed the model's {positions} positions"
            )
        sample_key = randomness.fresh_secret_key() if key is None else key
        stops = frozenset(public_models.newline_tokens(tokenizer))
        samples = []
        # Every chunk decodes the same number of rows (one compiled program); the last one's
        # extra rows are dropped.
        rows_per_chunk = min(batch_size, num_samples)
        prompts = jnp.repeat(jnp.asarray([context], jnp.int32), rows_per_chunk, axis=0)
        for start in range(0, num_samples, rows_per_chunk):
            count = min(rows_per_chunk, num_samples - start)
            sample_key, chunk_key = jax.random.split(sample_key)
            decoded = generate(
                self.model,
                prompts,
                max_new_tokens=self.max_new_tokens,
                key=chunk_key,
                temperature=float(temperature),
            )
            samples.extend(
                _cut(row, eos_id=tokenizer.eos_id, stops=stops, stop_at_newline=stop_at_newline)
                for row in np.asarray(decoded)[:count]
            )
        # A sample that ended at EOS is counted with it and written without it, as
        # `sample_fields`.
        kept = [len(x.tokens) - (x.stop_reason == "eos") for x in samples]
        texts = tuple(
            self.prompt + prefix + tokenizer.decode(x.tokens[:k])
            for x, k in zip(samples, kept, strict=True)
        )
        generated = sum(len(x.tokens) for x in samples)
        return SynthesisResult(
            texts=texts,
            marked_texts=texts,  # every token is the fine-tuned model's: nothing to mark
            stop_reasons=tuple(x.stop_reason for x in samples),
            tokens_generated=generated,
            steps_with_output=generated,
            steps_without_output=0,
            owner_mechanism=dict(self.owner_mechanism),
            seeded=self.seeded and key is not None,
            **self.result_fields,
        )


def finetune_generator(
    documents: Sequence[Mapping[str, Any]],
    model: public_models.PublicTextModel,
    *,
    epsilon: float,
    delta: float,
    prompt: str = "",
    key: jax.Array | None = None,
    max_new_tokens: int = 16,
    separator: str = "\n",
    tuning: GeneratorTuning | None = None,
    allow_large_delta: bool = False,
    on_step: Callable[[int, int], None] | None = None,
) -> FinetunedGenerator:
    """Fine-tunes LoRA adapters of `model` on `documents` with DP-SGD at (ε, δ).

    Args:
        documents: as in `synthesize` (with `user` the unit is a user: a step reads up to G of
            a sampled user's documents, averaged, then clipped).
        model: the public model and tokenizer.
        epsilon, delta: the budget the DP-SGD noise is calibrated to (PLD accountant); δ must
            be below 1/n for the n units unless `allow_large_delta`.
        prompt: public text every training row and sample starts from (after the chat turn,
            for a chat model).
        key: PRNG key of the noise and the Poisson sampler (`synthesize_finetuned` samples
            with the third of its three splits); None (default) draws secret randomness.
        max_new_tokens: the document tokens (separator included) a training row holds, and
            the longest sample: longer documents train on their beginning (their number is
            `owner_mechanism["documents_truncated"]`, an exact count for the owner only).
        separator: what ends a document in its training row ("\\n" teaches a line per text).
        tuning: the fine-tuning's settings (default `GeneratorTuning()`).
        allow_large_delta: accept δ >= 1/n; the generator's records say so.
        on_step: called with (steps done, steps) after every training step.

    Returns:
        The `FinetunedGenerator`; the accountant's ε for the steps that ran is checked not to
        exceed the target.

    Raises:
        ValueError: one line naming the argument or document.

    Privacy:
        DP-SGD at the unit level (document, or user with up to G documents), accounted by the
        PLD accountant for the steps that ran, at most the target ε. The sampling rate is
        batch_size / n with the exact unit count n, as DP-SGD implementations use it (n treated
        as public); the noise multiplier, the rate and the accountant's exact ε, functions of
        n, are in the owner's record only.
    """
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    validation.check_steps(max_new_tokens, "max_new_tokens")
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"separator must be a non-empty string, got {separator!r}")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    tuning = GeneratorTuning() if tuning is None else tuning
    if not isinstance(tuning, GeneratorTuning):
        raise ValueError(f"tuning must be a GeneratorTuning, got {type(tuning).__name__}")
    texts, ids, unit = document_units(documents)
    user_level = unit == "users"
    unit_index = {unit_id: i for i, unit_id in enumerate(dict.fromkeys(ids))}
    num_units = len(unit_index)
    validation.check_delta_for_units(
        delta, num_units, unit=unit, allow_large_delta=allow_large_delta
    )
    if tuning.batch_size >= num_units:
        raise ValueError(
            f"tuning.batch_size {tuning.batch_size} must be below the {num_units} {unit} "
            "(it is the expected number of units in a step)"
        )

    tokenizer = model.tokenizer
    _, prompt_ids, public_context = prompt_layout(model, prompt)
    context = [*public_context, *prompt_ids]
    positions = model.model.config.n_positions
    if len(context) + max_new_tokens > positions:
        raise ValueError(
            f"the prompt's {len(context)} tokens and max_new_tokens = {max_new_tokens} exceed "
            f"the model's {positions} positions"
        )
    encoded, end = tokenizer.encode_batch(texts), tokenizer.encode(separator)
    rows = _training_rows(encoded, context, end, max_new_tokens)
    truncated = sum(len(ids) + len(end) > max_new_tokens for ids in encoded)
    data = IndexedData(
        gather=_gather(rows),
        num_examples=len(texts),
        user_ids=np.asarray([unit_index[i] for i in ids]) if user_level else None,
    )

    noise_key = sampler_rng = None
    if key is not None:  # three independent streams: noise, Poisson sampling, decoding
        noise_key, sampler_key, _ = jax.random.split(key, 3)
        sampler_rng = np.random.default_rng(np.asarray(jax.random.key_data(sampler_key)))
    config = TrainConfig(
        steps=tuning.steps,
        batch_size=tuning.batch_size,
        learning_rate=tuning.learning_rate,
        private=True,
        level="user" if user_level else "example",
        max_examples_per_user=tuning.max_documents_per_user if user_level else None,
        clip_norm=tuning.clip_norm,
        epsilon=epsilon,
        delta=delta,
        allow_large_delta=allow_large_delta,
        pad_multiple=8,
        progress=False,
        log_every=None,
    )
    adapted = lora.add_lora(nnx.clone(model.model), tuning.lora, rngs=nnx.Rngs(0))
    trainer = Trainer(
        config,
        adapted,
        _document_nll,
        trainable_mask=lora.trainable_mask(adapted),
        num_units=num_units,
        noise_key=noise_key,
    )
    result = fit(trainer, data, rng=sampler_rng, on_step=on_step)
    spent = result.ledger.budget(delta, config.accountant)
    if spent.epsilon > epsilon * (1 + 1e-9):
        raise RuntimeError(
            f"the accountant's ε {spent.epsilon} for the {tuning.steps} steps exceeds the target "
            f"{epsilon}: the noise calibration failed"
        )
    plan = trainer.plan
    result_fields = dict(
        # The accountant's ε, a function of the sampling rate batch_size / n, is at most the
        # target; the target is the data-independent guarantee a reader may see.
        epsilon=epsilon,
        delta=spent.delta,
        target_epsilon=epsilon,
        target_delta=delta,
        planned_epsilon=epsilon,
        data_dependent_epsilon=None,
        released_epsilons=None,
        aggregator="dp_sgd",
        method=DP_FINETUNE,
        num_teachers=None,
        num_units=num_units,
        unit=unit,
        documents_in_prompts=len(texts),
        teachers="none",
        context_width=None,
        num_queries=tuning.steps,
        teacher_forward_passes=0,
        mechanism={
            "steps": tuning.steps,
            "expected_batch_size": tuning.batch_size,
            "clip_norm": tuning.clip_norm,
            "learning_rate": tuning.learning_rate,
            "lora_rank": tuning.lora.rank,
            "lora_alpha": tuning.lora.alpha,
            "max_documents_per_user": tuning.max_documents_per_user if user_level else None,
            "accountant": config.accountant,
        },
        allow_large_delta=allow_large_delta,
    )
    return FinetunedGenerator(
        model=lora.merge_lora(result.model),
        tokenizer=tokenizer,
        context=tuple(context),
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        seeded=key is not None,
        result_fields=result_fields,
        owner_mechanism={
            "noise_multiplier": plan.noise_multiplier,
            "sampling_rate": plan.sampling_rate,
            "accountant_epsilon": spent.epsilon,
            "documents_truncated": truncated,
        },
    )


def synthesize_finetuned(
    documents: Sequence[Mapping[str, Any]],
    model: public_models.PublicTextModel,
    *,
    epsilon: float,
    delta: float,
    num_samples: int,
    prompt: str = "",
    key: jax.Array | None = None,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    stop_at_newline: bool = True,
    separator: str = "\n",
    batch_size: int = 64,
    tuning: GeneratorTuning | None = None,
    allow_large_delta: bool = False,
    on_step: Callable[[int, int], None] | None = None,
) -> SynthesisResult:
    """Fine-tunes LoRA adapters of `model` on `documents` with DP-SGD at (ε, δ)
    (`finetune_generator`), then samples `num_samples` texts from the adapted model
    (`FinetunedGenerator.sample`).

    Args:
        documents: as in `finetune_generator`.
        model: as in `finetune_generator`.
        epsilon: as in `finetune_generator`.
        delta: as in `finetune_generator`.
        num_samples: texts to sample (any number: sampling costs no privacy).
        prompt: as in `finetune_generator`.
        key: PRNG key of the noise, the Poisson sampler and the sampling (its three splits);
            None (default) draws secret randomness.
        max_new_tokens: as in `finetune_generator`.
        temperature: as in `FinetunedGenerator.sample`.
        stop_at_newline: as in `FinetunedGenerator.sample`.
        separator: as in `finetune_generator`.
        batch_size: as in `FinetunedGenerator.sample`.
        tuning: as in `finetune_generator`.
        allow_large_delta: as in `finetune_generator`.
        on_step: as in `finetune_generator`.

    Returns:
        A `SynthesisResult` (method "dp_finetune", aggregator "dp_sgd", no teachers: every
        token is the fine-tuned model's, `num_queries` the DP-SGD steps that ran). Its
        `epsilon` is the target, which the accountant's ε for the steps that ran
        (`owner_mechanism["accountant_epsilon"]`) is checked not to exceed.

    Raises:
        ValueError: one line naming the argument or document.

    Privacy:
        As `finetune_generator`; sampling reads only the adapted weights (post-processing).
    """
    validation.check_steps(num_samples, "num_samples")
    validation.check_steps(batch_size, "batch_size")
    _check_temperature(temperature)
    generator = finetune_generator(
        documents,
        model,
        epsilon=epsilon,
        delta=delta,
        prompt=prompt,
        key=key,
        max_new_tokens=max_new_tokens,
        separator=separator,
        tuning=tuning,
        allow_large_delta=allow_large_delta,
        on_step=on_step,
    )
    return generator.sample(
        num_samples,
        key=None if key is None else jax.random.split(key, 3)[2],
        temperature=temperature,
        stop_at_newline=stop_at_newline,
        batch_size=batch_size,
    )


def _check_temperature(temperature: Any) -> None:
    if (
        isinstance(temperature, bool)
        or not isinstance(temperature, int | float)
        or not (temperature > 0 and math.isfinite(temperature))
    ):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
