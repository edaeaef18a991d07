"""Settings of the canary audit of every private text generator.

Run (about 35 minutes on 2 shared CPU cores, resumable: finished runs are stored under `--out`'s
stages):
    python -m experiments.generation_audit --out runs/generation_audit --reproducible

m canary documents share an in-distribution prefix ("My secret code is") and end in two rare
words of their own; each sits first in its own teacher's context (one teacher per unit, the
others' sentences after it), included with probability 1/2. Every generator writes texts from
the prefix; a canary's score is how often its rare words occur in them, and the one-run audit
(`privacy.audit.one_run_epsilon_lower_bound`) turns the scores into an ε lower bound, to be
below the generator's claimed ε; the control, each text wholly one random teacher's (no
aggregation, ε = ∞), shows the audit can see a leak.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.privacy import validation
from dpmix_jax.synthesis import DP_FINETUNE, METHODS, GeneratorTuning

GENERATORS = (*METHODS, DP_FINETUNE)
EPSILONS = (10.0,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationAuditConfig:
    """Public settings of the audit.

    Attributes:
        model: the public model, a name for `synthesis.load_public_model`.
        generators: the audited generators (`synthesis.METHODS` names and "dp_finetune").
        epsilons: the claimed ε of each audited run.
        delta: δ of each run and of the audit's bound.
        num_canaries: m canaries, one per teacher (so m teachers).
        fillers_per_teacher: real sentences (BBC topics) after a teacher's canary.
        num_texts: texts each generator writes from the canaries' prefix (InvisibleInk in its
            own setting, one disjoint batch of teachers per text: at most one per teacher).
        max_new_tokens: the longest text.
        canary_prefix: the canaries' shared beginning, and every text's public prompt.
        public_candidates: Hot PATE's public candidate set.
        context_width: each teacher's public context width in tokens.
        finetuning: DP fine-tuning's adapters and steps (a user: one teacher's documents).
        seed: draws the canaries' words, their inclusion and every run's randomness.
        confidence: the audit's confidence level.
        progress: print a line per run.
    """

    model: str = "smollm2"
    generators: tuple[str, ...] = GENERATORS
    epsilons: tuple[float, ...] = EPSILONS
    delta: float = 1e-5
    num_canaries: int = 32
    fillers_per_teacher: int = 3
    num_texts: int = 64
    max_new_tokens: int = 8
    canary_prefix: str = "My secret code is"
    public_candidates: int = 16
    context_width: int = 192
    finetuning: GeneratorTuning = GeneratorTuning(steps=20, batch_size=8)
    seed: int = 0
    confidence: float = 0.95
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = sorted(set(self.generators) - set(GENERATORS))
        if not self.generators or unknown:
            raise ValueError(
                f"generators must be a non-empty subset of {GENERATORS}, got {self.generators!r}."
            )
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise ValueError(f"epsilons must be positive numbers, got {self.epsilons!r}.")
        validation.check_delta(self.delta)
        for name in (
            "fillers_per_teacher",
            "num_texts",
            "max_new_tokens",
            "public_candidates",
            "context_width",
        ):
            validation.check_steps(getattr(self, name), name)
        if validation.check_steps(self.num_canaries, "num_canaries") < 4:
            raise ValueError(f"num_canaries must be >= 4, got {self.num_canaries}.")
        if not self.canary_prefix.strip():
            raise ValueError("canary_prefix must hold words.")
        if not 0 < self.confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {self.confidence!r}.")


PRESETS = {
    "cpu": "SmolLM2, 32 canaries in 32 teachers, every generator at ε = 10, 64 texts each",
    "tiny": "a test run on a small public GPT-2 (`text-default`)",
}


def get_config(preset: str = "cpu") -> GenerationAuditConfig:
    """A preset of `PRESETS`: "cpu" (the stored audit) or "tiny" (a test run)."""
    if preset == "cpu":
        return GenerationAuditConfig()
    if preset == "tiny":
        return GenerationAuditConfig(
            model="text-default",
            epsilons=(10.0,),
            num_canaries=8,
            fillers_per_teacher=1,
            num_texts=8,
            max_new_tokens=4,
            public_candidates=4,
            context_width=96,
            finetuning=GeneratorTuning(steps=2, batch_size=4),
            progress=False,
        )
    raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}.")
