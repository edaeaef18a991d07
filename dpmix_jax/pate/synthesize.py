"""Private synthetic text: Hot PATE generation from a folder of documents and a public GPT-2.

`synthesize(documents, model, epsilon=..., delta=..., num_samples=...)` splits the sensitive
documents among n in-context teachers, calibrates the aggregator's noise so that the worst case
(every sample running all its `max_new_tokens` steps) costs at most the target ε at δ, decodes
`num_samples` texts with `generation.generate` (public-model fallback on a failed step), and
returns a `SynthesisResult` whose ε is the accountant's for the calls that actually ran.

The privacy unit is a document, or a user when the records carry a `user` field: units go to
teachers by a keyed hash of their id (`privacy.assign_parts`), so one unit's documents sit in one
teacher's prompt and adding or removing a unit changes one teacher's vote per step.

With `accounting="individual"` every unit is its own in-context teacher and each is accounted
for on its own by a Rényi filter (`pate.individual`): a teacher whose vote agrees with the
public model's is not charged, and none is charged more than `charges_per_teacher` (M) times;
the ε reported is the per-unit guarantee of M Gaussian releases, fixed before the run.

`load_documents(folder)` reads `.txt` (one document per file), `.jsonl` (a `text` field, optional
`user`) and `.parquet` files (the same columns; needs pyarrow).

Example:
    >>> docs = [{"text": f"note {i} says hello", "user": f"u{i % 6}"} for i in range(12)]
    >>> sum(len(p) for p in teacher_parts(docs, 3, key=b"k"))
    12
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import json
import math
import os
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dp_accounting
import jax
import jax.numpy as jnp
import numpy as np

from dpmix_jax.pate import accounting as pate_accounting
from dpmix_jax.pate import (
    finetuned,
    generation,
    individual,
    public,
    smooth_sensitivity,
)
from dpmix_jax.pate.finetuned import TeacherTuning
from dpmix_jax.privacy import SEEDED_NOTE, randomness, validation
from dpmix_jax.privacy import accounting as privacy
from dpmix_jax.privacy.parts import assign_parts

__all__ = [
    "ACCOUNTINGS",
    "AGGREGATORS",
    "DOCUMENT_SUFFIXES",
    "METHODS",
    "PEER_METHODS",
    "TEACHER_KINDS",
    "Ensemble",
    "SynthesisResult",
    "build_ensemble",
    "calibrated_config",
    "check_individual_accounting",
    "default_charges_per_teacher",
    "load_documents",
    "synthesize",
    "teacher_parts",
    "text_default_documents",
]

AGGREGATORS = ("confident_gnmax", "dpargmax_laplace", "dpws")
PEER_METHODS = ("invisibleink", "amin", "pmixed")
METHODS = ("coordinated", "independent", *PEER_METHODS)
DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")
TEACHER_KINDS = ("in_context", "fine_tuned")
ACCOUNTINGS = ("standard", "individual")
# Individual accounting: η of the threshold T = σ·sqrt(2·ln(V/η)) (`individual.threshold_for`):
# at a step, some token no teacher voted for passes T with probability at most η/2.
INDIVIDUAL_ETA = 0.01
# Individual accounting: the default M is the longest run's steps divided by this factor
# (`default_charges_per_teacher`).
INDIVIDUAL_STEPS_PER_CHARGE = 4
# Default thresholds as fractions of the n teachers (the Hot PATE experiment's).
_THRESHOLDS = {"confident_gnmax": 0.5, "dpargmax_laplace": 0.6, "dpws": 0.0}
_GNMAX_SIGMA_RATIO = 2.0  # σ1 = 2·σ2: the threshold check is noisier than the argmax
_RELEASE_AGREEMENT = 0.75


# --------------------------------------------------------------------------------------------
# Documents.
# --------------------------------------------------------------------------------------------


def _where(record: Mapping[str, Any], index: int) -> str:
    source = record.get("source") if isinstance(record, Mapping) else None
    return f"document {index}" + (f" ({source})" if source else "")


def _check_documents(documents: Sequence[Mapping[str, Any]]) -> tuple[list[str], list, str]:
    """(texts, unit ids, unit name): the unit of each document is its user when the records
    carry `user`, else its text (equal texts are one unit)."""
    if isinstance(documents, str | bytes | Mapping) or not isinstance(documents, Sequence):
        raise ValueError(
            f"documents must be a list of records {{'text': ..., 'user': ...}}, got "
            f"{type(documents).__name__}"
        )
    if not documents:
        raise ValueError("documents is empty: need documents from at least 2 units")
    with_user = [isinstance(r, Mapping) and "user" in r for r in documents]
    texts, ids = [], []
    for index, record in enumerate(documents):
        if not isinstance(record, Mapping):
            raise ValueError(
                f"document {index} is a {type(record).__name__}; each document is a record "
                "{'text': str, 'user': optional id}"
            )
        text = record.get("text")
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{_where(record, index)} has no text (a non-empty string)")
        if any(with_user) and not with_user[index]:
            first = with_user.index(True)
            raise ValueError(
                f"{_where(record, index)} has no user but {_where(documents[first], first)} "
                "has one; give every document a user, or none"
            )
        user = record.get("user")
        if any(with_user) and (
            isinstance(user, bool) or not isinstance(user, str | int | np.integer)
        ):
            raise ValueError(
                f"{_where(record, index)}: user must be a string or an integer, got {user!r}"
            )
        texts.append(text)
        ids.append(str(user) if any(with_user) else text)
    return texts, ids, "users" if any(with_user) else "documents"


def teacher_parts(
    documents: Sequence[Mapping[str, Any]],
    num_teachers: int,
    *,
    key: bytes | int | None = None,
) -> list[np.ndarray]:
    """Each teacher's document positions (ascending): unit u (a user, or a document) goes to
    teacher `assign_parts(unit ids, [1/n] * n, key=key)[u]`.

    Privacy:
        A unit's teacher depends on its own id and the key alone (secret when None), so all its
        documents sit with one teacher and adding or removing it moves no other unit.
    """
    _, ids, _ = _check_documents(documents)
    if isinstance(num_teachers, bool) or not isinstance(num_teachers, int) or num_teachers < 2:
        raise ValueError(f"num_teachers must be an integer >= 2, got {num_teachers!r}")
    parts = assign_parts(ids, [1.0 / num_teachers] * num_teachers, key=key)
    return [np.flatnonzero(parts == teacher) for teacher in range(num_teachers)]


def _read_text_file(path: pathlib.Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path}: byte {err.start} (0x{data[err.start]:02x}) is not UTF-8; save the file as "
            "UTF-8 text"
        ) from None


def _jsonl_records(path: pathlib.Path) -> list[dict]:
    records = []
    for number, line in enumerate(_read_text_file(path).splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{number}: not a JSON object ({err.msg})") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise ValueError(f"{path}:{number}: need a JSON object with a string field 'text'")
        records.append(_record(row, f"{path.name}:{number}"))
    return records


def _parquet_records(path: pathlib.Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(
            f"{path}: reading .parquet needs pyarrow (pip install 'dpmix_jax[parquet]')"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as err:  # pyarrow raises its own error types for a corrupt file
        raise ValueError(f"{path}: not a readable parquet file ({err})") from None
    if "text" not in table.column_names:
        raise ValueError(f"{path}: no 'text' column (columns: {', '.join(table.column_names)})")
    columns = ["text", "user"] if "user" in table.column_names else ["text"]
    rows = table.select(columns).to_pylist()
    records = []
    for number, row in enumerate(rows):
        if not isinstance(row["text"], str):
            raise ValueError(f"{path}: row {number} has no text (a string)")
        records.append(_record(row, f"{path.name}:row {number}"))
    return records


def _record(row: Mapping[str, Any], source: str) -> dict:
    record = {"text": row["text"], "source": source}
    if row.get("user") is not None:
        record["user"] = row["user"]
    return record


def load_documents(folder: str | os.PathLike) -> list[dict]:
    """The documents of every `.txt`, `.jsonl` and `.parquet` file under `folder` (sorted paths).

    A `.txt` file is one document; a `.jsonl` line or a `.parquet` row is one, with a `text`
    field and an optional `user`. Each record also gets `source` (file and line) for messages.

    Raises:
        ValueError: one line naming the folder or file: not a folder, no documents, another file
            type, bytes that are not UTF-8, a line without `text`.

    Privacy:
        The result is sensitive.
    """
    root = pathlib.Path(folder)
    if not root.is_dir():
        raise ValueError(f"documents folder {root} does not exist or is not a folder")
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )  # fmt: skip
    records: list[dict] = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix == ".txt":
            records.append(_record({"text": _read_text_file(path)}, path.name))
        elif suffix == ".jsonl":
            records.extend(_jsonl_records(path))
        elif suffix == ".parquet":
            records.extend(_parquet_records(path))
        else:
            raise ValueError(
                f"{path}: documents are {', '.join(DOCUMENT_SUFFIXES)} files; move other files "
                "out of the documents folder"
            )
    if not records:
        raise ValueError(
            f"documents folder {root} holds no documents ({', '.join(DOCUMENT_SUFFIXES)} files)"
        )
    return records


def text_default_documents(
    *, min_chars: int = 20, max_chars: int = 120, seed: int = 0
) -> list[dict]:
    """The embedded text default's sensitive e-mails cut into sentences of at least `min_chars`
    characters, each cut to its first `max_chars` characters: one document each (the Hot PATE
    experiment's records, which it cuts to 24 tokens).

    Privacy:
        These play the sensitive data; the unit is one sentence of one e-mail.
    """
    from dpmix_jax.data.builtin import load_text_mixture_task

    task = load_text_mixture_task(seed=seed, num_users=20, max_public_per_domain=300)
    sentences = public.split_sentences(task.sensitive.texts, min_chars=min_chars)
    return [{"text": s[:max_chars], "source": "text default"} for s in sentences]


# --------------------------------------------------------------------------------------------
# Calibration.
# --------------------------------------------------------------------------------------------


def _repeated(event, count: int):
    return event if count == 1 else dp_accounting.SelfComposedDpEvent(event, count)


def _noise_free_or(make_event: Callable[[float], Any]) -> Callable[[float], Any]:
    """`make_event` for a scale > 0; a noise-free Gaussian (ε = ∞) at 0, where the calibration's
    search starts."""
    return lambda scale: make_event(scale) if scale > 0 else dp_accounting.GaussianDpEvent(0.0)


def calibrated_config(
    aggregator: str,
    *,
    epsilon: float,
    delta: float,
    num_calls: int,
    num_teachers: int,
    threshold_fraction: float | None = None,
    **settings,
) -> generation.GenerationConfig:
    """A `GenerationConfig` whose `num_calls` aggregator calls cost at most (ε, δ).

    The data-independent composition (PLD, dp-accounting) of `num_calls` calls is calibrated to
    `epsilon` at the report δ: confident-GNMax's σ2 (σ1 = 2σ2), or the per-call ε of DPARGMAX
    and DPWS. DPWS spends half of δ on its per-call δ (δ/(2·num_calls) each) and reports at the
    other half. Thresholds are `threshold_fraction` · n (default 0.5 for confident-GNMax, 0.6
    for DPARGMAX, none beyond DPWS's own for DPWS). `settings` go to `GenerationConfig`.

    Privacy:
        Reads no sensitive data: every choice depends on public settings only.
    """
    if aggregator not in AGGREGATORS:
        raise ValueError(f"aggregator must be one of {', '.join(AGGREGATORS)}, got {aggregator!r}")
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    low, high = privacy.CALIBRATION_EPSILON_RANGE
    if not low <= epsilon <= high:
        raise ValueError(f"epsilon must be in [{low:g}, {high:g}], got {epsilon!r}")
    num_calls = validation.check_steps(num_calls, "num_calls")
    fraction = _THRESHOLDS[aggregator] if threshold_fraction is None else threshold_fraction
    if not 0 <= fraction <= 1:
        raise ValueError(f"threshold_fraction must be in [0, 1], got {fraction!r}")
    threshold = fraction * num_teachers
    if aggregator == "confident_gnmax":
        sigma2 = privacy.calibrate(
            _noise_free_or(
                lambda s: _repeated(
                    pate_accounting.confident_gnmax_event(_GNMAX_SIGMA_RATIO * s, s), num_calls
                )
            ),
            target_epsilon=epsilon,
            delta=delta,
        )
        return generation.GenerationConfig(
            aggregator="confident_gnmax",
            threshold=threshold,
            sigma1=_GNMAX_SIGMA_RATIO * sigma2,
            sigma2=sigma2,
            report_delta=delta,
            **settings,
        )
    report_delta = delta / 2 if aggregator == "dpws" else delta
    scale = privacy.calibrate(
        _noise_free_or(
            lambda s: _repeated(pate_accounting.dpargmax_laplace_event(1.0 / s), num_calls)
        ),
        target_epsilon=epsilon,
        delta=report_delta,
    )
    per_call = 1.0 / scale
    # 1/(1/scale) may round below scale; step down until the charged event is within target.
    while (
        pate_accounting.epsilon_of_steps(
            pate_accounting.dpargmax_laplace_event(per_call), steps=num_calls, delta=report_delta
        )
        > epsilon
    ):
        per_call = math.nextafter(per_call, 0.0)
    if aggregator == "dpargmax_laplace":
        return generation.GenerationConfig(
            aggregator="dpargmax_laplace",
            epsilon=per_call,
            threshold=threshold,
            report_delta=delta,
            **settings,
        )
    return generation.GenerationConfig(
        aggregator="dpws",
        epsilon=per_call,
        delta=delta / (2 * num_calls),
        threshold=threshold,
        report_delta=report_delta,
        **settings,
    )


# --------------------------------------------------------------------------------------------
# Generation.
# --------------------------------------------------------------------------------------------


class _CountingTeachers:
    """The teachers, counting their queries and reporting each step to `on_step`."""

    def __init__(self, teachers, on_step: Callable[[], None] | None):
        self._teachers = teachers
        self._on_step = on_step
        self.vocab_size = teachers.vocab_size
        self.calls = 0

    @property
    def num_teachers(self) -> int:
        return self._teachers.num_teachers

    def __call__(self, prefix):
        self.calls += 1
        if self._on_step is not None:
            self._on_step()
        return self._teachers(prefix)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Ensemble:
    """Teachers over a public GPT-2 (in context or fine-tuned), built from sensitive documents.

    Attributes:
        teachers: the n teachers (`generation.Teachers`), counting their queries in `calls`.
        public_model: the same GPT-2 given only the public prompt (reads nothing sensitive).
        prompt_ids: the public prompt's tokens, the shared prefix of every sample.
        stop_sequences: token sequences that end a sample (any token holding a newline).
        num_units, unit: the sensitive units behind the teachers and their kind ("documents"
            or "users").
        documents_in_prompts: documents the teachers read: those that fit their prompts (the
            others are unread), or every document for fine-tuned teachers.
        kind: "in_context" or "fine_tuned".
    """

    teachers: _CountingTeachers
    public_model: generation.PublicModel
    prompt_ids: list[int]
    stop_sequences: tuple[tuple[int, ...], ...]
    num_units: int
    unit: str
    documents_in_prompts: int
    kind: str


def build_ensemble(
    documents: Sequence[Mapping[str, Any]],
    model: public.PublicTextModel,
    *,
    num_teachers: int,
    prompt: str = "",
    max_new_tokens: int,
    key: jax.Array | None = None,
    batch_size: int = 64,
    stop_at_newline: bool = True,
    separator: str = "\n",
    on_step: Callable[[], None] | None = None,
    teachers: str = "in_context",
    tuning: TeacherTuning | None = None,
) -> Ensemble:
    """Splits `documents` among `num_teachers` teachers over `model`.

    Units (users, or documents) go to teachers by a keyed hash (`teacher_parts`). An in-context
    teacher's context is its own documents, each followed by `separator`, as many as fit a
    public width (the model's context less the public `prompt` and `max_new_tokens`), left-padded
    to that width. A fine-tuned teacher trains its own adapter on all of its documents (each
    after EOS and followed by `separator`, `finetuned.finetune_teachers`) and reads only EOS.
    Every sample then decodes from the prompt after that context, and the public model reads EOS
    and the prompt.

    Args:
        documents: as in `synthesize`.
        model: as in `synthesize`.
        num_teachers: as in `synthesize`.
        prompt: as in `synthesize`.
        max_new_tokens: as in `synthesize`.
        key: the partition's PRNG key; None draws a secret one.
        batch_size: as in `synthesize`.
        stop_at_newline: as in `synthesize`.
        separator: as in `synthesize`.
        on_step: as in `synthesize`.
        teachers: as in `synthesize`.
        tuning: as in `synthesize`.

    Raises:
        ValueError: one line naming the argument or document (no text, fewer than 2 units,
            n outside [2, units], a document longer than the context leaves room for, ...).

    Privacy:
        Each teacher's prompt (or adapter) depends on its own units' documents only, so adding
        or removing a unit changes one teacher; padded to a public width, it changes no other
        teacher's logits, not even by rounding. The teachers are sensitive: read them only
        through a DP mechanism.
    """
    prepared = _prepare_documents(
        documents,
        model,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        separator=separator,
        teachers=teachers,
        tuning=tuning,
    )
    n = num_teachers
    if isinstance(n, bool) or not isinstance(n, int) or not 2 <= n <= prepared.num_units:
        raise ValueError(
            f"num_teachers must be an integer from 2 to the {prepared.num_units} "
            f"{prepared.unit}, got {n!r}"
        )
    partition_key = None if key is None else np.asarray(jax.random.key_data(key)).tobytes()
    parts = teacher_parts(documents, n, key=partition_key)
    return _assemble_ensemble(
        prepared,
        model,
        parts,
        batch_size=batch_size,
        stop_at_newline=stop_at_newline,
        on_step=on_step,
        teachers=teachers,
        tuning=tuning,
    )


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """Checked documents and the public prompt layout (`_prepare_documents`)."""

    ids: list
    unit: str
    num_units: int
    encoded: list[list[int]]
    prompt_ids: list[int]
    separator: list[int]
    budget: int


def _prepare_documents(
    documents: Sequence[Mapping[str, Any]],
    model: public.PublicTextModel,
    *,
    prompt: str,
    max_new_tokens: int,
    separator: str,
    teachers: str,
    tuning: TeacherTuning | None,
) -> _Prepared:
    """Checks the arguments and documents shared by every ensemble and tokenizes them: the
    public width (`budget`) a teacher's documents must fit next to the prompt and
    `max_new_tokens`, and every document within it (one line naming the first that is not)."""
    validation.check_steps(max_new_tokens, "max_new_tokens")
    if teachers not in TEACHER_KINDS:
        raise ValueError(f"teachers must be one of {', '.join(TEACHER_KINDS)}, got {teachers!r}")
    if tuning is not None and teachers != "fine_tuned":
        raise ValueError("tuning applies to teachers='fine_tuned'")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    texts, ids, unit = _check_documents(documents)
    num_units = len(set(ids))
    if num_units < 2:
        raise ValueError(
            f"the documents hold only one unit (one {unit[:-1]}); PATE needs at least 2 {unit} "
            "to form teachers"
        )
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"separator must be a non-empty string, got {separator!r}")
    tokenizer = model.tokenizer
    prompt_ids = tokenizer.encode(prompt) if prompt else []
    separator_ids = tokenizer.encode(separator)
    # Every sample decodes from the public prompt (`generation.generate(teachers, prompt_ids,
    # ...)`) after a teacher's documents, so a teacher call reads at most
    # budget + len(prompt_ids) + max_new_tokens - 1 tokens: one less than the context.
    budget = model.context_length - max_new_tokens - len(prompt_ids)
    if budget < 1 + len(separator_ids):
        raise ValueError(
            f"the prompt ({len(prompt_ids)} tokens) and max_new_tokens = {max_new_tokens} leave no "
            f"room for documents in the model's context of {model.context_length} tokens"
        )
    encoded = tokenizer.encode_batch(texts)
    for index, ids_of_doc in enumerate(encoded):
        if len(ids_of_doc) + len(separator_ids) > budget:
            raise ValueError(
                f"{_where(documents[index], index)} has {len(ids_of_doc)} tokens; the model's "
                f"context of {model.context_length} tokens holds documents of at most "
                f"{budget - len(separator_ids)} next to the prompt and max_new_tokens = "
                f"{max_new_tokens}; split it into shorter documents"
            )
    return _Prepared(ids, unit, num_units, encoded, prompt_ids, separator_ids, budget)


def _assemble_ensemble(
    prepared: _Prepared,
    model: public.PublicTextModel,
    parts: Sequence[np.ndarray],
    *,
    batch_size: int,
    stop_at_newline: bool,
    on_step: Callable[[], None] | None,
    teachers: str,
    tuning: TeacherTuning | None,
) -> Ensemble:
    """The `Ensemble` whose teacher i reads the documents at positions `parts[i]` (ascending):
    in its prompt, as many as fit the public width, or through its own fine-tuned adapter."""
    from dpmix_jax.pate.teachers import InContextTeachers

    tokenizer = model.tokenizer
    encoded, separator, budget = prepared.encoded, prepared.separator, prepared.budget
    n = len(parts)
    if teachers == "fine_tuned":
        tuned = finetuned.finetune_teachers(
            model.model,
            encoded,
            parts,
            context=[tokenizer.eos_id],
            end=separator,
            tuning=tuning or finetuned.TeacherTuning(),
        )
        ensemble_teachers, used = tuned, len(encoded)
    else:
        prompts, used = [], 0
        for part in parts:
            context = []
            for index in part:
                piece = [*encoded[int(index)], *separator]
                if len(context) + len(piece) > budget:
                    break
                context.extend(piece)
                used += 1
            prompts.append(context or [tokenizer.eos_id])
        ensemble_teachers = InContextTeachers(
            model.model,
            prompts,
            width=budget,
            batch_size=min(batch_size, n),
            pad_id=tokenizer.eos_id,
        )
    teachers_counted = _CountingTeachers(ensemble_teachers, on_step)
    stops = tuple((t,) for t in public.newline_tokens(tokenizer)) if stop_at_newline else ()
    return Ensemble(
        teachers=teachers_counted,
        public_model=public.make_public_model(model.model, [tokenizer.eos_id]),
        prompt_ids=prepared.prompt_ids,
        stop_sequences=stops,
        num_units=prepared.num_units,
        unit=prepared.unit,
        documents_in_prompts=used,
        kind=teachers,
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class SynthesisResult:
    """Synthetic texts and what they cost.

    Attributes:
        texts: per sample, the prompt followed by the generated text.
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


def synthesize(
    documents: Sequence[Mapping[str, Any]],
    model: public.PublicTextModel,
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
    batch_size: int = 64,
    on_step: Callable[[], None] | None = None,
    teachers: str = "in_context",
    tuning: TeacherTuning | None = None,
    accounting: str = "standard",
    charges_per_teacher: int | None = None,
) -> SynthesisResult:
    """Generates `num_samples` texts privately from `documents` with Hot PATE.

    Args:
        documents: records `{"text": str, "user": optional id}`; with `user` the unit is a
            user (all of a user's documents go to one teacher), else a document.
        model: the public GPT-2 and tokenizer (`public.load_public_model`, `text_default_model`).
        epsilon, delta: the total budget: the aggregator's noise is calibrated so that the
            worst case (num_samples · max_new_tokens · (max_retries + 1) calls) costs at most
            (ε, δ) by the accountant; δ must be below 1/n for the n teachers.
        num_samples: texts to generate.
        num_teachers: n, from 2 to the number of units; fix it without looking at the data
            (not from its size): the partition depends on n, so a data-dependent n would let
            one unit move every other unit's teacher. Required with the standard accounting;
            with `accounting="individual"` every unit is its own teacher, and n must be None
            (default) or the number of units.
        method: Hot PATE's "coordinated" (hot: shared sampling noise) or "independent" (cold)
            histograms, or a peer from `pate.peers` on the same teachers: "invisibleink",
            "amin" or "pmixed", each calibrated by its own analysis so that all `num_samples`
            texts at full length cost at most (ε, δ); `aggregator`, `threshold_fraction`,
            `max_retries` and `public_fallback` are Hot PATE's and do not apply to them.
        prompt: public text every sample starts from, read after each teacher's documents.
        key: PRNG key of the partition, the samplers and the noise; None (default) draws secret
            randomness. A key makes the run reproducible and not private against anyone who
            knows it (`seeded`).
        aggregator: "confident_gnmax" (default; also releases a data-dependent ε),
            "dpargmax_laplace" or "dpws".
        max_new_tokens: length limit of a sample.
        temperature: the teachers' (and the fallback's) sampling temperature.
        threshold_fraction: the aggregator's threshold as a fraction of n (default per
            aggregator, see `calibrated_config`).
        max_retries: retries of a failed step (each charged).
        stop_at_newline: a sample ends at a token holding a newline (else at EOS or the limit).
        separator: what follows each document in a teacher's prompt ("\n": one per line; "\n\n"
            where the public model learned blank lines between paragraphs, so that a line,
            not an empty one, follows).
        public_fallback: on a failed step take the public model's token given only the prompt
            (free); without it the sample ends there.
        batch_size: teachers per forward pass.
        on_step: called once per decoding step (a progress bar in tokens).
        teachers: "in_context" (default: each teacher reads its documents in its prompt, as
            many as fit the context) or "fine_tuned" (each teacher trains its own LoRA adapter
            on all of its documents, `finetuned.finetune_teachers`, and reads only the prompt).
        tuning: the fine-tuned teachers' `finetuned.TeacherTuning` (None: its defaults).
        accounting: "standard" (default: every aggregator call charged to every teacher, the
            data-independent composition above) or "individual": per-unit accounting by a
            Rényi filter (`pate.individual`): one in-context teacher per unit, shared Gumbel
            votes, a teacher agreeing with the public model's vote abstains and is not
            charged, Gaussian noise σ on every count, and each teacher charged at most
            `charges_per_teacher` times (see `_synthesize_individual`). It applies to
            `method="coordinated"`, the default aggregator, in-context teachers, the public
            fallback, no retries and no `threshold_fraction`; other settings are refused.
        charges_per_teacher: M, individual accounting only: the charges each teacher may
            have, from 1 to num_samples · max_new_tokens (at that bound the filter never
            binds and every teacher may be charged at every step, the data-independent
            accounting of the same mechanism). Default (None): `default_charges_per_teacher`,
            the longest run's steps divided by `INDIVIDUAL_STEPS_PER_CHARGE`, rounded up.

    Returns:
        A `SynthesisResult`.

    Raises:
        ValueError: one line naming the argument or document: no text, fewer than 2 units,
            a document longer than the model's context leaves room for, ε <= 0, δ >= 1/n, ...

    Privacy:
        Each teacher's prompt or adapter depends on its own units' documents only (keyed hash
        partition), and the teachers are read only through the calibrated DP aggregator, every
        call charged in the ledger. The prompt, the public model and the fallback read no
        sensitive data. The result's texts and ε values are publishable;
        `documents_in_prompts` depends on the documents' lengths and is for the data owner's
        report only.

        With `accounting="individual"` the guarantee is per unit (one unit per teacher):
        (ε, δ) = the RDP of M compositions of the Gaussian mechanism with noise σ, fixed in
        advance; the realised charges are sensitive and are not in the result.
    """
    epsilon = validation.check_epsilon(epsilon)
    delta = validation.check_delta(delta)
    validation.check_steps(num_samples, "num_samples")
    validation.check_steps(max_new_tokens, "max_new_tokens")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
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
    seeded = key is not None
    partition_key = None
    if seeded:
        partition_key = jax.random.fold_in(key, 0)
        key = jax.random.fold_in(key, 1)
    if accounting == "individual":
        ensemble = _unit_ensemble(
            documents,
            model,
            num_teachers=num_teachers,
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            stop_at_newline=stop_at_newline,
            separator=separator,
            on_step=on_step,
        )
        return _synthesize_individual(
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
    )
    validation.check_delta_for_units(delta, num_teachers, unit="teachers")
    if method in PEER_METHODS:
        return _synthesize_with_peer(
            ensemble,
            model,
            method=method,
            epsilon=epsilon,
            delta=delta,
            num_samples=num_samples,
            num_teachers=num_teachers,
            prompt=prompt,
            key=key,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
        )
    tokenizer = model.tokenizer
    prompt_ids = ensemble.prompt_ids
    n = num_teachers
    num_calls = num_samples * max_new_tokens * (max_retries + 1)
    config = calibrated_config(
        aggregator,
        epsilon=epsilon,
        delta=delta,
        num_calls=num_calls,
        num_teachers=n,
        threshold_fraction=threshold_fraction,
        sampler=method,
        temperature=temperature,
        max_retries=max_retries,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        stop_sequences=ensemble.stop_sequences,
    )
    vocab = int(model.model.config.vocab_size)
    if config.aggregator == "confident_gnmax":
        release = smooth_sensitivity.choose_release(
            num_queries=max_new_tokens,
            num_teachers=n,
            num_classes=vocab,
            threshold=config.threshold,
            sigma1=config.sigma1,
            sigma2=config.sigma2,
            delta=config.report_delta,
            agreement=_RELEASE_AGREEMENT,
        )
        config = dataclasses.replace(
            config,
            release_order=release.order,
            release_noise_multiplier=release.noise_multiplier,
            release_beta=release.beta,
        )
    event, call_delta = config.charge()
    planned = pate_accounting.epsilon_of_steps(event, steps=num_calls, delta=config.report_delta)

    teachers = ensemble.teachers
    fallback = ensemble.public_model if public_fallback else None
    ledger = pate_accounting.PateLedger()
    results = []
    for _ in range(num_samples):
        sub = None
        if seeded:
            key, sub = jax.random.split(key)
        results.append(
            generation.generate(
                teachers, prompt_ids, config, key=sub, public_model=fallback, ledger=ledger
            )
        )
    last = results[-1]
    released = None
    data_dependent = None
    if config.release_order is not None:
        released = tuple(float(r.released.epsilon) for r in results)
        conversion = math.log(1 / config.report_delta) / (config.release_order - 1)
        data_dependent = sum(released) - (len(released) - 1) * conversion
    failed_steps = sum(r.sources.count("public") + (r.stop_reason == "fail") for r in results)
    mechanism = {
        "threshold": config.threshold,
        "per_call_epsilon": config.epsilon if aggregator != "confident_gnmax" else None,
        "per_call_delta": call_delta,
        "sigma1": config.sigma1 if aggregator == "confident_gnmax" else None,
        "sigma2": config.sigma2 if aggregator == "confident_gnmax" else None,
        "report_delta": config.report_delta,
        "max_calls": num_calls,
        "release_order": config.release_order,
        "release_beta": config.release_beta,
        "release_noise_multiplier": (
            config.release_noise_multiplier if config.release_order is not None else None
        ),
        "max_new_tokens": max_new_tokens,
        "max_retries": max_retries,
        "temperature": temperature,
        "stop_at_newline": stop_at_newline,
        "public_fallback": public_fallback,
    }
    return SynthesisResult(
        **_sample_fields(ensemble, tokenizer, prompt, results),
        epsilon=last.epsilon,
        delta=last.delta,
        target_epsilon=epsilon,
        target_delta=delta,
        planned_epsilon=planned,
        data_dependent_epsilon=data_dependent,
        released_epsilons=released,
        aggregator=aggregator,
        method=method,
        num_teachers=n,
        steps_without_output=failed_steps,
        num_queries=sum(r.num_queries for r in results),
        teacher_forward_passes=teachers.calls * n,
        mechanism=mechanism,
        seeded=seeded,
    )


def _sample_fields(
    ensemble: Ensemble, tokenizer: Any, prompt: str, samples: Sequence[Any]
) -> dict[str, Any]:
    """The `SynthesisResult` fields every method fills the same way from its samples (each with
    `tokens`, `sources` and `stop_reason`) and the ensemble."""
    sources = [source for sample in samples for source in sample.sources]
    return {
        "texts": tuple(prompt + tokenizer.decode(x.tokens) for x in samples),
        "marked_texts": tuple(
            prompt + public.marked_text(tokenizer, x.tokens, x.sources) for x in samples
        ),
        "stop_reasons": tuple(x.stop_reason for x in samples),
        "num_units": ensemble.num_units,
        "unit": ensemble.unit,
        "documents_in_prompts": ensemble.documents_in_prompts,
        "teachers": ensemble.kind,
        "tokens_generated": len(sources),
        "steps_with_output": sources.count("private"),
    }


def _synthesize_with_peer(
    ensemble: Ensemble,
    model: public.PublicTextModel,
    *,
    method: str,
    epsilon: float,
    delta: float,
    num_samples: int,
    num_teachers: int,
    prompt: str,
    key: jax.Array | None,
    max_new_tokens: int,
    temperature: float,
) -> SynthesisResult:
    """`synthesize` with a peer method of `pate.peers` on the ensemble's teachers.

    The peer is calibrated for the worst case of all samples, num_samples · max_new_tokens
    tokens from the same teachers (each peer's cost per token composes over tokens and texts
    alike), then decodes each text with max_new_tokens; the ε reported is the peer's own
    analysis of the texts' charges added up (`PeerResult.charges`).

    Privacy: the teachers are read only through the peer's mechanism; see its module.
    """
    peer = importlib.import_module(f"dpmix_jax.pate.peers.{method}")
    worst_case = num_samples * max_new_tokens
    settings = {}
    if method == "amin":
        # The sparse-vector test gets half of the budget and the clip bound the rest.
        settings["svt_noise"] = peer.svt_noise_for(
            epsilon=epsilon / 2, delta=delta, runs=worst_case, num_teachers=num_teachers
        )
    config = peer.calibrate(
        epsilon=epsilon,
        delta=delta,
        max_new_tokens=worst_case,
        num_teachers=num_teachers,
        temperature=temperature,
        **settings,
    )
    planned = peer.epsilon(config, delta=delta, **peer.worst_case_charges(config))
    per_text = {"max_new_tokens": max_new_tokens}
    if method == "amin":
        per_text["max_private_tokens"] = max_new_tokens
    text_config = dataclasses.replace(config, **per_text)
    tokenizer = model.tokenizer
    seeded = key is not None
    results = []
    for _ in range(num_samples):
        sub = None
        if seeded:
            key, sub = jax.random.split(key)
        results.append(
            peer.generate(
                ensemble.teachers,
                ensemble.public_model,
                prompt=ensemble.prompt_ids,
                config=text_config,
                key=sub,
                eos_id=tokenizer.eos_id,
                stop_sequences=ensemble.stop_sequences,
            )
        )
    charges = collections.Counter()
    for result in results:
        charges.update(result.charges)
    spent = peer.epsilon(config, delta=delta, **charges)
    sources = [s for r in results for s in r.sources]
    return SynthesisResult(
        **_sample_fields(ensemble, tokenizer, prompt, results),
        steps_without_output=sources.count("public"),
        epsilon=spent,
        delta=delta,
        target_epsilon=epsilon,
        target_delta=delta,
        planned_epsilon=planned,
        data_dependent_epsilon=None,
        released_epsilons=None,
        aggregator=method,
        method=method,
        num_teachers=num_teachers,
        num_queries=len(sources),
        teacher_forward_passes=sum(r.teacher_forward_passes for r in results),
        mechanism={**dataclasses.asdict(config), "max_calls": worst_case},
        seeded=seeded,
    )


# --------------------------------------------------------------------------------------------
# Individual (per-unit) accounting.
# --------------------------------------------------------------------------------------------

# One compile per run shape: the config is static, the budget M a traced scalar.
_individual_step = jax.jit(individual.individual_step, static_argnames="config")


def default_charges_per_teacher(num_samples: int, max_new_tokens: int) -> int:
    """The default M of individual accounting: ceil(num_samples · max_new_tokens /
    `INDIVIDUAL_STEPS_PER_CHARGE`), a teacher charged at most at a quarter of the longest run's
    steps.

    Privacy:
        Public: a function of public settings only.
    """
    steps = validation.check_steps(num_samples, "num_samples") * validation.check_steps(
        max_new_tokens, "max_new_tokens"
    )
    return max(1, -(-steps // INDIVIDUAL_STEPS_PER_CHARGE))


def check_individual_accounting(
    *,
    accounting: str,
    charges_per_teacher: int | None,
    num_samples: int,
    max_new_tokens: int,
    method: str = "coordinated",
    aggregator: str = "confident_gnmax",
    threshold_fraction: float | None = None,
    max_retries: int = 0,
    public_fallback: bool = True,
    teachers: str = "in_context",
) -> int | None:
    """The M of a run (`charges_per_teacher`, or `default_charges_per_teacher` when None) with
    `accounting="individual"`, None otherwise; refuses in one line `charges_per_teacher`
    without individual accounting, an M outside 1 to num_samples · max_new_tokens, and the
    settings individual accounting does not apply to. `synthesize` and `dpmix generate` (before
    any model is loaded) call it.

    Privacy:
        Public: reads public settings only.
    """
    if accounting not in ACCOUNTINGS:
        raise ValueError(f"accounting must be one of {', '.join(ACCOUNTINGS)}, got {accounting!r}")
    if accounting != "individual":
        if charges_per_teacher is not None:
            raise ValueError("charges_per_teacher applies to accounting='individual'")
        return None
    refused = [
        (method != "coordinated", f"method={method!r} (it uses coordinated votes)"),
        (aggregator != "confident_gnmax", f"aggregator={aggregator!r} (it has its own)"),
        (threshold_fraction is not None, "threshold_fraction (T is set from σ and η)"),
        (max_retries != 0, "max_retries (a step never fails: it falls back to the public vote)"),
        (not public_fallback, "public_fallback=False (a token below T is the public vote)"),
        (teachers != "in_context", f"teachers={teachers!r} (one in-context teacher per unit)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"accounting='individual' does not apply to {what}")
    if charges_per_teacher is None:
        return default_charges_per_teacher(num_samples, max_new_tokens)
    if isinstance(charges_per_teacher, bool) or not isinstance(
        charges_per_teacher, int | np.integer
    ):
        raise ValueError(
            f"charges_per_teacher must be an integer >= 1, got {charges_per_teacher!r}"
        )
    steps = num_samples * max_new_tokens
    if not 1 <= charges_per_teacher <= steps:
        raise ValueError(
            f"charges_per_teacher must be from 1 to the {steps} steps of the longest run "
            f"(num_samples · max_new_tokens; more only adds noise), got {charges_per_teacher!r}"
        )
    return int(charges_per_teacher)


def _unit_ensemble(
    documents: Sequence[Mapping[str, Any]],
    model: public.PublicTextModel,
    *,
    num_teachers: int | None,
    prompt: str,
    max_new_tokens: int,
    batch_size: int,
    stop_at_newline: bool,
    separator: str,
    on_step: Callable[[], None] | None,
) -> Ensemble:
    """An in-context ensemble of one teacher per unit (`build_ensemble`'s prompts and width):
    teacher i reads unit i's documents (in their order, as many as fit the public width);
    units in the order of their first document.

    Privacy:
        Adding or removing a unit adds or removes its teacher and changes no other teacher
        (each row's logits are its own prompt's, `InContextTeachers`). n is the number of
        units, a function of the data: not a public setting (the report's `num_teachers` and
        `num_units` carry it, as `num_units` does in the standard accounting).
    """
    prepared = _prepare_documents(
        documents,
        model,
        prompt=prompt,
        max_new_tokens=max_new_tokens,
        separator=separator,
        teachers="in_context",
        tuning=None,
    )
    if num_teachers is not None and (
        isinstance(num_teachers, bool)
        or not isinstance(num_teachers, int | np.integer)
        or num_teachers != prepared.num_units
    ):
        raise ValueError(
            f"num_teachers must be None or the {prepared.num_units} {prepared.unit} with "
            f"accounting='individual' (one teacher per unit), got {num_teachers!r}"
        )
    positions: dict[Any, list[int]] = {}
    for position, unit_id in enumerate(prepared.ids):
        positions.setdefault(unit_id, []).append(position)
    parts = [np.asarray(p, np.int64) for p in positions.values()]
    return _assemble_ensemble(
        prepared,
        model,
        parts,
        batch_size=batch_size,
        stop_at_newline=stop_at_newline,
        on_step=on_step,
        teachers="in_context",
        tuning=None,
    )


def _individual_config(
    *, epsilon: float, delta: float, charges_per_teacher: int, vocab_size: int, temperature: float
) -> individual.IndividualConfig:
    """σ = `sigma_for_steps(M, ε, δ)` (the smallest σ, to 0.1%, whose M Gaussian compositions
    are within (ε, δ) by RDP), T = `threshold_for(σ, V, INDIVIDUAL_ETA)`.

    Privacy:
        Public: a function of public settings only.
    """
    sigma = individual.sigma_for_steps(charges_per_teacher, epsilon, delta)
    return individual.IndividualConfig(
        sigma=sigma,
        threshold=individual.threshold_for(sigma, vocab_size, INDIVIDUAL_ETA),
        epsilon=epsilon,
        delta=delta,
        temperature=temperature,
    )


@dataclasses.dataclass(frozen=True)
class _Decoded:
    tokens: list[int]
    sources: list[str]
    stop_reason: str


def _decode_individual(
    ensemble: Ensemble,
    config: individual.IndividualConfig,
    ledger: individual.IndividualLedger,
    *,
    num_samples: int,
    max_new_tokens: int,
    eos_id: int | None,
    key: jax.Array,
) -> list[_Decoded]:
    """Decodes `num_samples` texts with `individual.individual_step`, one step at a time.

    Each step splits `key` (`key, step_key = jax.random.split(key)`), queries the teachers and
    the public model on the prompt and the sample so far, and takes the step's token ("public"
    when no noisy count passed T). The charges start at the ledger's and are carried across
    steps and samples, never reset; every sample is recorded in `ledger`, whose `budget` is the
    M passed to the step. A sample ends at EOS, a stop sequence or `max_new_tokens`
    (`generation.generate`'s rules).

    Privacy:
        Reads the teachers only through `individual_step`; the ledger's charges are sensitive.
    """
    teachers = ensemble.teachers
    charges = jnp.asarray(ledger.charges, jnp.int32)
    budget = ledger.budget
    decoded = []
    for _ in range(num_samples):
        tokens: list[int] = []
        sources: list[str] = []
        stop_reason = "max_new_tokens"
        while len(tokens) < max_new_tokens:
            prefix = [*ensemble.prompt_ids, *tokens]
            key, step_key = jax.random.split(key)
            teacher_logits = jnp.asarray(teachers(prefix), jnp.float32)
            public_logits = jnp.asarray(ensemble.public_model(prefix), jnp.float32)
            token, charges, info = _individual_step(
                step_key, teacher_logits, public_logits, charges, config, budget
            )
            token = int(token)
            tokens.append(token)
            sources.append("public" if bool(info.from_public) else "private")
            if eos_id is not None and token == eos_id:
                stop_reason = "eos"
                break
            if any(tuple(tokens[-len(s) :]) == tuple(s) for s in ensemble.stop_sequences):
                stop_reason = "stop_sequence"
                break
        ledger.record(np.asarray(charges), steps=len(tokens))
        decoded.append(_Decoded(tokens, sources, stop_reason))
    return decoded


def _synthesize_individual(
    ensemble: Ensemble,
    model: public.PublicTextModel,
    *,
    epsilon: float,
    delta: float,
    num_samples: int,
    charges_per_teacher: int,
    prompt: str,
    key: jax.Array | None,
    max_new_tokens: int,
    temperature: float,
    stop_at_newline: bool,
) -> SynthesisResult:
    """`synthesize` with individual (per-unit) accounting on a one-teacher-per-unit ensemble.

    σ is the smallest whose M = `charges_per_teacher` Gaussian compositions are within
    (ε, δ) by dp-accounting's RDP (`individual.sigma_for_steps`), T =
    `individual.threshold_for(σ, V, INDIVIDUAL_ETA)`; every step is `individual.individual_step`
    with the budget M, the charges carried across all steps and samples. The result's ε is
    `individual.rdp_epsilon(σ, M, δ)` <= ε whatever the run did (`epsilon` =
    `planned_epsilon`); tokens from the public vote are marked like the public fallback's.

    Privacy:
        Per unit (each unit is one teacher): (ε, δ)-DP under adding or removing one unit, by
        the Rényi filter (`pate.individual`'s module docstring); δ < 1/units is required, as
        for n teachers. With M = num_samples · max_new_tokens the filter never binds and the
        guarantee is that of charging every teacher at every step. The realised charges are
        sensitive: the result holds none of them (nor their max or mean); the counts of
        private and public tokens are those of the released marked texts.
    """
    low, high = privacy.CALIBRATION_EPSILON_RANGE
    if not low <= epsilon <= high:
        raise ValueError(f"epsilon must be in [{low:g}, {high:g}], got {epsilon!r}")
    n = ensemble.teachers.num_teachers
    validation.check_delta_for_units(delta, n, unit=f"teachers (one per {ensemble.unit[:-1]})")
    tokenizer = model.tokenizer
    vocab = int(model.model.config.vocab_size)
    config = _individual_config(
        epsilon=epsilon,
        delta=delta,
        charges_per_teacher=charges_per_teacher,
        vocab_size=vocab,
        temperature=temperature,
    )
    ledger = individual.IndividualLedger.start(config, n, max_charges=charges_per_teacher)
    seeded = key is not None
    key = key if seeded else randomness.prng_key(randomness.secret_seed())
    decoded = _decode_individual(
        ensemble,
        config,
        ledger,
        num_samples=num_samples,
        max_new_tokens=max_new_tokens,
        eos_id=tokenizer.eos_id,
        key=key,
    )
    guarantee = ledger.epsilon  # from M alone: rdp_epsilon(σ, M, δ)
    sources = [s for d in decoded for s in d.sources]
    mechanism = {
        "accounting": "individual",
        "sigma": config.sigma,
        "threshold": config.threshold,
        "eta": INDIVIDUAL_ETA,
        "charges_per_teacher": charges_per_teacher,
        "max_calls": num_samples * max_new_tokens,
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "stop_at_newline": stop_at_newline,
        "public_fallback": True,
    }
    return SynthesisResult(
        **_sample_fields(ensemble, tokenizer, prompt, decoded),
        steps_without_output=sources.count("public"),
        epsilon=guarantee,
        delta=delta,
        target_epsilon=epsilon,
        target_delta=delta,
        planned_epsilon=guarantee,
        data_dependent_epsilon=None,
        released_epsilons=None,
        aggregator="individual_gaussian",
        method="individual",
        num_teachers=n,
        num_queries=len(sources),
        teacher_forward_passes=ensemble.teachers.calls * n,
        mechanism=mechanism,
        seeded=seeded,
    )
