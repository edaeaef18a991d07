"""Settings of the readable-text study: private generation on SmolLM2-135M-Instruct, on the text
default's e-mail sentences and on the example notes, at ε = 0 (the public model alone), ε = ∞
(the teachers' average, no noise) and ε ∈ {1, 10}.

Command (the stored run, docs/generate.md):
    python -m experiments.readable_text --out runs/readable_text --reproducible

Each document set is split in two by position: the even-numbered documents are the sensitive
ones the teachers read, the odd-numbered ones the real held-out text the samples are measured
against (MAUVE on SmolLM2's last-token states, and the share of words in an English word
list). The teachers' contexts are built once per set and shared by every method and ε.
The `tiny` preset runs the same code on the tiny GPT-2 of the text default in about a minute.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import GENERATORS

REFERENCES = ("public", "nonprivate")
DOCUMENT_SETS = ("text_default", "notes")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generator:
    """One generator of the study.

    Attributes:
        method: a reference ("public": ε = 0, "nonprivate": ε = ∞) or a `synthesis.GENERATORS`
            name (the teacher methods, or "dp_finetune": DP-LoRA of the public model on the
            teachers' documents, then sampling).
        epsilon: the run's target ε (None for the references).
        public_candidates: Hot PATE's c (`synthesize(public_candidates=...)`); None: the whole
            vocabulary.
    """

    method: str
    epsilon: float | None = None
    public_candidates: int | None = None

    def __post_init__(self) -> None:
        if self.method in REFERENCES:
            if self.epsilon is not None or self.public_candidates is not None:
                raise ValueError(f"the {self.method} reference takes no epsilon or candidates")
            return
        if self.method not in GENERATORS:
            raise ValueError(f"method must be one of {', '.join(REFERENCES + GENERATORS)}")
        validation.check_epsilon(self.epsilon)
        if self.public_candidates is not None:
            validation.check_steps(self.public_candidates, "public_candidates")

    @property
    def name(self) -> str:
        """How results name the generator."""
        if self.method in REFERENCES:
            return self.method
        suffix = "" if self.public_candidates is None else f", top {self.public_candidates}"
        return f"{self.method} (ε = {self.epsilon:g}{suffix})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class DocumentSet:
    """A set of documents and the run's settings on it.

    Attributes:
        name: "text_default" (the embedded e-mail sentences) or "notes"
            (`docs/examples/generate/`).
        num_teachers: n.
        context_width: each teacher's public context width in tokens.
        heldout: real held-out documents the samples are measured against (at most).
        finetune_batch_size: DP fine-tuning's expected documents per step (below their number).
    """

    name: str
    num_teachers: int
    context_width: int
    heldout: int
    finetune_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.name not in DOCUMENT_SETS:
            raise ValueError(f"name must be one of {', '.join(DOCUMENT_SETS)}, got {self.name!r}")
        validation.check_steps(self.context_width, "context_width")
        validation.check_steps(self.heldout, "heldout")
        validation.check_steps(self.finetune_batch_size, "finetune_batch_size")


DEFAULT_GENERATORS = (
    Generator(method="public"),
    Generator(method="nonprivate"),
    Generator(method="coordinated", epsilon=1.0, public_candidates=16),
    Generator(method="coordinated", epsilon=10.0, public_candidates=16),
    Generator(method="coordinated", epsilon=10.0),
    Generator(method="dp_finetune", epsilon=1.0),
    Generator(method="dp_finetune", epsilon=10.0),
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadableTextConfig:
    """Public settings of the study.

    Attributes:
        model: the public model (`synthesis.load_public_model`'s name).
        document_sets: the sets, each with its teachers.
        generators: what runs on each set.
        num_samples: texts per run (MAUVE needs 20 with words in them).
        max_new_tokens: length limit of a text (it ends earlier at a newline).
        delta: δ of every private run.
        finetune_steps: DP-SGD steps of the "dp_finetune" generators (LoRA rank 8, α = 16).
        seeds: seeds of the partition, the samplers and the noise.
        mauve_seed: seed of MAUVE's PCA and k-means.
        progress: print a line per run.
    """

    model: str = "smollm2"
    document_sets: tuple[DocumentSet, ...] = (
        DocumentSet(
            name="text_default", num_teachers=32, context_width=256, heldout=64,
            finetune_batch_size=16,
        ),
        DocumentSet(name="notes", num_teachers=8, context_width=128, heldout=20),
    )  # fmt: skip
    generators: tuple[Generator, ...] = DEFAULT_GENERATORS
    num_samples: int = 24
    max_new_tokens: int = 24
    delta: float = 1e-5
    finetune_steps: int = 30
    seeds: tuple[int, ...] = (0,)
    mauve_seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        validation.check_steps(self.num_samples, "num_samples")
        validation.check_steps(self.max_new_tokens, "max_new_tokens")
        validation.check_delta(self.delta)
        validation.check_steps(self.finetune_steps, "finetune_steps")


PRESETS = {
    "smollm2": "SmolLM2-135M-Instruct on both sets (the stored run)",
    "tiny": "the tiny GPT-2 of the text default, 2 generators, 6 short texts (a smoke test)",
}


def get_config(preset: str = "smollm2") -> ReadableTextConfig:
    """The preset's settings."""
    if preset == "tiny":
        return ReadableTextConfig(
            model="text-default",
            document_sets=(
                DocumentSet(name="notes", num_teachers=4, context_width=64, heldout=20),
            ),
            generators=(
                Generator(method="public"),
                Generator(method="coordinated", epsilon=10.0, public_candidates=4),
            ),
            num_samples=6,
            max_new_tokens=6,
        )
    return ReadableTextConfig()
