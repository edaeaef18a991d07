"""Settings of the generation-step benchmark: every teacher method's seconds per token against
the teachers' forward passes it needs, on SmolLM2.

Run (about 10 minutes on 2 CPU cores; nothing to resume: a timing benchmark keeps no texts):
    python -m experiments.bench_generation --out runs/bench_generation

Expected: every method's median ratio to the ε = ∞ reference in results.md (docs/generate.md
quotes the stored run).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.data.builtin import BBC_TOPICS
from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import METHODS


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchGenerationConfig:
    """Public settings of the benchmark.

    Attributes:
        model: the public model, a name for `synthesis.load_public_model`.
        methods: the teacher methods timed (`synthesis.METHODS` names).
        topic: the BBC topic whose sensitive sentences the teachers read (as in
            `experiments.topic_generation`).
        num_teachers: n in-context teachers.
        context_width: each teacher's context width in tokens.
        max_new_tokens: the longest text (it ends earlier at a newline).
        prompt: the public start of every text.
        epsilon: each method's target ε for one text (the step's cost does not depend on it).
        delta: its δ.
        public_candidates: Hot PATE's public candidate set.
        rounds: timed rounds; each writes one text with every method and the reference, in a
            fresh order, after one untimed round that compiles.
        seed: the fixed seed of the partition, the order and every key.
        min_chars, max_chars: sentences shorter than `min_chars` are dropped, longer ones cut
            to `max_chars` (as in the topic study).
        progress: print a line per round.
    """

    model: str = "smollm2"
    methods: tuple[str, ...] = METHODS
    topic: str = "business"
    num_teachers: int = 16
    context_width: int = 320
    max_new_tokens: int = 16
    prompt: str = "The"
    epsilon: float = 3.0
    delta: float = 1e-5
    public_candidates: int = 16
    rounds: int = 5
    seed: int = 0
    min_chars: int = 40
    max_chars: int = 160
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHODS))
        if not self.methods or unknown:
            raise ValueError(
                f"methods must be a non-empty subset of {METHODS}, got {self.methods!r}."
            )
        if self.topic not in BBC_TOPICS:
            raise ValueError(f"topic must be one of {BBC_TOPICS}, got {self.topic!r}.")
        for name in (
            "num_teachers",
            "context_width",
            "max_new_tokens",
            "public_candidates",
            "rounds",
            "min_chars",
            "max_chars",
        ):
            validation.check_steps(getattr(self, name), name)
        if self.num_teachers < 2:
            raise ValueError(f"num_teachers must be >= 2, got {self.num_teachers}.")
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)


PRESETS = {
    "cpu": "SmolLM2, 16 teachers on one BBC topic, every teacher method, 5 timed rounds",
    "tiny": "a test run on a small public GPT-2 (`text-default`)",
}


def get_config(preset: str = "cpu") -> BenchGenerationConfig:
    """A preset of `PRESETS`: "cpu" (the stored benchmark) or "tiny" (a test run)."""
    if preset == "cpu":
        return BenchGenerationConfig()
    if preset == "tiny":
        return BenchGenerationConfig(
            model="text-default",
            num_teachers=4,
            context_width=96,
            max_new_tokens=4,
            public_candidates=4,
            rounds=2,
            max_chars=60,
            progress=False,
        )
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}.")
