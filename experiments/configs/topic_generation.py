"""Settings of private topic-conditioned generation on a pretrained model: every generator
against the public model alone and the teachers' average, on the BBC topics.

Run (about 85 minutes a seed on 2 shared CPU cores, resumable: finished runs are stored
under `--out`'s stages):
    python -m experiments.topic_generation --out runs/topic_generation --reproducible

For each of the five BBC topics of the text default, the sentences of half of its held-out
articles are the sensitive documents (one sentence is one unit) and the sentences of the other
half the real test set. Each teacher-ensemble method writes `lines_per_topic` lines per topic
from n in-context SmolLM2 teachers (built once per topic and seed, shared by every method and
ε); DP fine-tuning trains one DP-LoRA generator on every topic's sentences, each after its
topic's neutral label ("Topic 3: "), and samples the same number of lines after each label.
Measured: a logistic-regression classifier on SmolLM2's mean token states trained on the
synthetic lines and tested on the real ones (downstream accuracy, chance 1 / topics), topic
fidelity, TF-IDF downstream accuracy, MAUVE, the share of each run's tokens released by the
teachers, ε, and seconds per token against the teachers' average.

The stored run's duration and results are in docs/generate.md, rebuilt from it.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.data.builtin import BBC_TOPICS
from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import DP_FINETUNE, METHODS, GeneratorTuning

GENERATORS = (*METHODS, DP_FINETUNE)
REFERENCES = ("public", "nonprivate", "real")
EPSILONS = (1.0, 3.0, 10.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopicGenerationConfig:
    """Public settings of the study.

    Attributes:
        model: the public model, a name for `synthesis.load_public_model`.
        generators: the private generators (`synthesis.METHODS` names and "dp_finetune").
        references: the references run beside them (a subset of `REFERENCES`): the public
            model alone (ε = 0), the teachers' average (ε = ∞), and the real sentences cut to a
            line's length (what the measures give real lines of that number and length).
        epsilons: total ε of each run (the topics' teachers hold disjoint sentences and DP
            fine-tuning trains once on all of them, so every run is (ε, δ)-DP).
        delta: total δ of each run.
        seeds: seeds of the partition and of every sampler and noise draw.
        topics: the BBC topics (labels of the downstream task).
        num_teachers: n in-context teachers per topic.
        context_width: each teacher's public context width in tokens (as many sentences as fit).
        lines_per_topic: lines each generator writes per topic and run.
        max_new_tokens: the longest line (it ends earlier at a newline or the end of the turn).
        prompt: the public start of every line (after the chat turn): it keeps the instruct
            model writing a sentence rather than talking about the request.
        public_candidates: Hot PATE's public candidate set (the public model's likeliest tokens).
        finetuning: DP fine-tuning's adapters and DP-SGD steps.
        test_per_topic: real held-out sentences per topic for the classifiers and MAUVE.
        min_chars, max_chars: sentences shorter than `min_chars` are dropped, longer ones cut.
        mauve_seed: seed of MAUVE's PCA and k-means and of the classifiers.
        progress: print a line per run.
    """

    model: str = "smollm2"
    generators: tuple[str, ...] = GENERATORS
    references: tuple[str, ...] = REFERENCES
    epsilons: tuple[float, ...] = EPSILONS
    delta: float = 1e-5
    seeds: tuple[int, ...] = (0, 1, 2)
    topics: tuple[str, ...] = BBC_TOPICS
    num_teachers: int = 16
    context_width: int = 320
    lines_per_topic: int = 8
    max_new_tokens: int = 16
    prompt: str = "The"
    public_candidates: int = 16
    finetuning: GeneratorTuning = GeneratorTuning(steps=20, batch_size=8)
    test_per_topic: int = 100
    min_chars: int = 40
    max_chars: int = 160
    mauve_seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.generators) - set(GENERATORS))
        if not self.generators or unknown:
            raise ValueError(
                f"generators must be a non-empty subset of {GENERATORS}, got {self.generators!r}."
            )
        if not set(self.references) <= set(REFERENCES):
            raise ValueError(
                f"references must be a subset of {REFERENCES}, got {self.references!r}."
            )
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise ValueError(f"epsilons must be positive numbers, got {self.epsilons!r}.")
        validation.check_delta(self.delta)
        if not self.seeds:
            raise ValueError("seeds must name at least one seed.")
        unknown = sorted(set(self.topics) - set(BBC_TOPICS))
        if len(self.topics) < 2 or unknown:
            raise ValueError(f"topics must be at least two of {BBC_TOPICS}, got {self.topics!r}.")
        for name in (
            "num_teachers",
            "context_width",
            "lines_per_topic",
            "max_new_tokens",
            "public_candidates",
            "test_per_topic",
        ):
            validation.check_steps(getattr(self, name), name)
        if self.num_teachers < 2:
            raise ValueError(f"num_teachers must be >= 2, got {self.num_teachers}.")
        if not 0 < self.min_chars <= self.max_chars:
            raise ValueError(
                f"need 0 < min_chars <= max_chars, got {self.min_chars}, {self.max_chars}."
            )


PRESETS = {
    "cpu": "SmolLM2, 5 topics, 16 teachers per topic, every generator at ε in {1, 3, 10}, 3 seeds",
    "teachers64": "Hot PATE coordinated at ε = 10 with 64 teachers per topic, beside the"
    " public model and the real sentences, seed 0",
    "tiny": "a test run on a small public GPT-2 (`text-default`)",
}


def get_config(preset: str = "cpu") -> TopicGenerationConfig:
    """A preset of `PRESETS`: "cpu" (the stored study), "teachers64" or "tiny" (a test run).

    "teachers64" asks whether Hot PATE's release carries the teachers' vote with four times
    the teachers: at 16 a unanimous token is released with probability 0.37 at ε = 10. It
    reads more of each topic's sentences too, a few per teacher. The teachers' average (ε = ∞)
    is left out: with every topic's 64 teachers keeping their cached states for the whole
    study, it nears 24 GiB even alone. About 15 minutes on 2 CPU cores:
        python -m experiments.topic_generation --preset teachers64 \\
            --out runs/topic_generation_teachers64 --reproducible
    """
    if preset == "cpu":
        return TopicGenerationConfig()
    if preset == "teachers64":
        return TopicGenerationConfig(
            generators=("coordinated",),
            references=("public", "real"),
            epsilons=(10.0,),
            seeds=(0,),
            num_teachers=64,
        )
    if preset == "tiny":
        return TopicGenerationConfig(
            model="text-default",
            epsilons=(3.0,),
            seeds=(0,),
            topics=BBC_TOPICS[:2],
            num_teachers=4,
            context_width=96,
            max_chars=60,
            lines_per_topic=4,
            max_new_tokens=4,
            public_candidates=4,
            finetuning=GeneratorTuning(steps=2, batch_size=4),
            test_per_topic=20,
            progress=False,
        )
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}.")
