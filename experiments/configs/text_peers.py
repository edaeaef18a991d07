"""Settings of the private text generators' head-to-head: Hot PATE against its peers.

Run:
    python -m experiments.text_peers --out DIR --reproducible

Topic-conditioned generation on the text default's BBC domains: for each of the five topics,
the sentences of half of its held-out articles (never seen by the public model) are split among
n in-context teachers over the public GPT-2; every method writes the same number of lines per
topic at the same (ε, δ), and a TF-IDF + logistic-regression classifier trained on the synthetic
lines (labelled by the topic they were generated from) is tested on real sentences of the other
held-out articles. Measured beside it: MAUVE against those real sentences (features from the
public model), the share of words in the public corpus's vocabulary, distinct-2, tokens per
second and teacher forward passes per token. References: the public model alone (ε = 0) and
sampling from the teachers' average distribution (ε = ∞).

The cpu preset's duration and results are in docs/generate.md, rebuilt from the stored run.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.data.builtin import BBC_TOPICS
from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import PEER_METHODS, TEACHER_KINDS
from dpmix_jax.synthesis.finetuned_teachers import TeacherTuning
from dpmix_jax.synthesis.public_models import TextDefaultModel

# The experiment's names of Hot PATE's samplers (`synthesis.METHODS` names), then every peer.
HOT_PATE_METHODS = {"hot_pate": "coordinated", "independent_pate": "independent"}
PRIVATE_METHODS = (*HOT_PATE_METHODS, *PEER_METHODS)
REFERENCES = ("public", "nonprivate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TextPeersConfig:
    """Public settings of the head-to-head.

    Attributes:
        methods: the private generators compared (a subset of `PRIVATE_METHODS`).
        references: the references run beside them (a subset of `REFERENCES`).
        teachers: "in_context" (each teacher reads its sentences in its prompt) or
            "fine_tuned" (each trains its own LoRA adapter on them, `tuning`).
        tuning: the fine-tuned teachers' adapters and training.
        epsilons: total ε of each topic's run (topics hold disjoint sentences, so the whole
            output is (max ε, δ)-DP by parallel composition).
        delta: total δ of each topic's run.
        seeds: seeds of the partition and of every sampler and noise draw (3 by default).
        topics: the BBC topics (labels of the downstream task).
        num_teachers: n teachers per topic (each sentence is one unit).
        lines_per_topic: synthetic lines each method writes per topic and run.
        max_new_tokens: length limit of a line (it ends earlier at a newline).
        test_per_topic: real held-out sentences per topic for the classifier and MAUVE.
        min_chars, max_chars: sentences shorter than `min_chars` are dropped, longer ones cut.
        temperature: the teachers' and the public model's sampling temperature.
        model: the public GPT-2 (trained on the public domains on first use, then read back
            from the run's stages folder).
        mauve_seed: seed of MAUVE's PCA and k-means.
        progress: print a line per run.
    """

    methods: tuple[str, ...] = PRIVATE_METHODS
    references: tuple[str, ...] = REFERENCES
    teachers: str = "in_context"
    tuning: TeacherTuning = TeacherTuning(steps=20)
    epsilons: tuple[float, ...] = (1.0, 3.0, 10.0)
    delta: float = 1e-5
    seeds: tuple[int, ...] = (0, 1, 2)
    topics: tuple[str, ...] = BBC_TOPICS
    num_teachers: int = 64
    lines_per_topic: int = 12
    max_new_tokens: int = 24
    test_per_topic: int = 100
    min_chars: int = 40
    max_chars: int = 160
    temperature: float = 1.0
    model: TextDefaultModel = TextDefaultModel(
        vocab_size=2048, width=256, depth=4, heads=4, train_steps=2000, learning_rate=2e-3
    )
    mauve_seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(PRIVATE_METHODS))
        if not self.methods or unknown:
            raise ValueError(
                f"methods must be a non-empty subset of {PRIVATE_METHODS}, got {self.methods!r}."
            )
        if not set(self.references) <= set(REFERENCES):
            raise ValueError(
                f"references must be a subset of {REFERENCES}, got {self.references!r}."
            )
        if self.teachers not in TEACHER_KINDS:
            raise ValueError(f"teachers must be one of {TEACHER_KINDS}, got {self.teachers!r}.")
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise ValueError(f"epsilons must be positive numbers, got {self.epsilons!r}.")
        validation.check_delta(self.delta)
        if not self.seeds:
            raise ValueError("seeds must name at least one seed.")
        unknown = sorted(set(self.topics) - set(BBC_TOPICS))
        if len(self.topics) < 2 or unknown:
            raise ValueError(f"topics must be at least two of {BBC_TOPICS}, got {self.topics!r}.")
        for name in ("num_teachers", "lines_per_topic", "max_new_tokens", "test_per_topic"):
            validation.check_steps(getattr(self, name), name)
        if self.num_teachers < 2:
            raise ValueError(f"num_teachers must be >= 2, got {self.num_teachers}.")
        if not 0 < self.min_chars <= self.max_chars:
            raise ValueError(
                f"need 0 < min_chars <= max_chars, got {self.min_chars}, {self.max_chars}."
            )
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}.")


PRESETS = {
    "cpu": "5 methods, ε in {1, 3, 10}, 3 seeds, 64 in-context teachers per topic",
    "fine_tuned": "Hot PATE at ε = 10 and the ε = ∞ reference with 64 fine-tuned teachers per "
    "topic, 3 seeds (against the cpu preset's in-context teachers)",
    "tiny": "a test run on a small public model",
}


def get_config(preset: str = "cpu") -> TextPeersConfig:
    """A preset of `PRESETS`: "cpu" (the stored head-to-head), "fine_tuned" (fine-tuned
    teachers on the same public model, topics and seeds) or "tiny" (a test run)."""
    if preset == "cpu":
        return TextPeersConfig()
    if preset == "fine_tuned":
        return TextPeersConfig(
            methods=("hot_pate",),
            references=("nonprivate",),
            epsilons=(10.0,),
            teachers="fine_tuned",
        )
    if preset == "tiny":
        return TextPeersConfig(
            epsilons=(3.0,),
            seeds=(0,),
            topics=BBC_TOPICS[:2],
            num_teachers=8,
            lines_per_topic=12,
            max_new_tokens=6,
            test_per_topic=20,
            model=TextDefaultModel(train_steps=20, width=32, depth=1, heads=2),
        )
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}.")
