"""Settings of the teacher-share study: how many of Hot PATE's tokens come from the teachers, on
SmolLM2-135M-Instruct, as the number of teachers n grows from 16 to 512.

Command (the stored run, docs/generate.md):
    python -m experiments.teacher_share --out runs/teacher_share --reproducible

The text default's e-mail sentences go to n in-context teachers (keyed hash, 96-token contexts);
every generator writes the same few short texts on each ensemble, its whole run calibrated to
(ε, δ). Expected: with coordinated sampling the share of released teacher tokens grows with n
(the votes of a larger ensemble stand further above the noise, whose scale the budget fixes
whatever n), and so does the probability that a token all teachers agree on is released;
independent sampling spreads the votes and releases fewer. About 10 minutes on 2 CPU cores; the
`tiny` preset runs the same code on the text default's tiny GPT-2 in seconds.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import validation

SAMPLERS = ("coordinated", "independent")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generator:
    """One Hot PATE generator of the study.

    Attributes:
        method: "coordinated" (shared sampling noise) or "independent" histograms.
        epsilon: the whole run's target ε.
        public_candidates: c: the aggregator reads the votes for the public model's c most
            likely tokens (None: the whole vocabulary).
    """

    method: str
    epsilon: float
    public_candidates: int | None = 16

    def __post_init__(self) -> None:
        if self.method not in SAMPLERS:
            raise ValueError(f"method must be one of {', '.join(SAMPLERS)}, got {self.method!r}")
        validation.check_epsilon(self.epsilon)
        if self.public_candidates is not None:
            validation.check_steps(self.public_candidates, "public_candidates")

    @property
    def name(self) -> str:
        """How results name the generator."""
        suffix = "" if self.public_candidates is None else f", top {self.public_candidates}"
        return f"{self.method} (ε = {self.epsilon:g}{suffix})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TeacherShareConfig:
    """Public settings of the study.

    Attributes:
        model: the public model and the teachers' (`synthesis.load_public_model`'s name).
        teacher_counts: the numbers of teachers n, each its own ensemble.
        generators: what runs on every ensemble.
        num_samples: texts per run.
        max_new_tokens: length limit of a text (it ends earlier at a newline).
        context_width: each teacher's context width in tokens.
        delta: δ of every run.
        seeds: seeds of the partition, the samplers and the noise.
        progress: print a line per run.
    """

    model: str = "smollm2"
    teacher_counts: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    generators: tuple[Generator, ...] = (
        Generator(method="coordinated", epsilon=1.0),
        Generator(method="coordinated", epsilon=10.0),
        Generator(method="independent", epsilon=10.0),
    )
    num_samples: int = 2
    max_new_tokens: int = 12
    context_width: int = 96
    delta: float = 1e-5
    seeds: tuple[int, ...] = (0,)
    progress: bool = True

    def __post_init__(self) -> None:
        if not self.teacher_counts or not self.generators:
            raise ValueError("teacher_counts and generators must not be empty")
        for count in self.teacher_counts:
            validation.check_steps(count, "teacher_counts")
            if count < 2:
                raise ValueError(f"teacher_counts: every n must be at least 2, got {count}")
        validation.check_steps(self.num_samples, "num_samples")
        validation.check_steps(self.max_new_tokens, "max_new_tokens")
        validation.check_steps(self.context_width, "context_width")
        validation.check_delta(self.delta)


PRESETS = {
    "smollm2": "SmolLM2-135M-Instruct, n = 16 to 512 (the stored run)",
    "tiny": "the tiny GPT-2 of the text default, n = 4 and 16, short texts (a smoke test)",
}


def get_config(preset: str = "smollm2") -> TeacherShareConfig:
    """The preset's settings."""
    if preset == "tiny":
        return TeacherShareConfig(
            model="text-default",
            teacher_counts=(4, 16),
            generators=(
                Generator(method="coordinated", epsilon=10.0, public_candidates=4),
                Generator(method="independent", epsilon=10.0, public_candidates=4),
            ),
            num_samples=2,
            max_new_tokens=4,
            context_width=96,
        )
    return TeacherShareConfig()
