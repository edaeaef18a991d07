"""Hot PATE experiments (SPEC §5): diversity transfer, natural task, private generation.

Command:
    python -m experiments.hot_pate --preset cpu --out DIR      # 1-2 minutes on 2 CPU cores

Writes DIR/hot_pate.json, DIR/hot_pate.md (tables) and DIR/diversity_*.png, DIR/natural.png.
Expected with the cpu preset:
* (a) tunable diversity (secret set of k tokens, n = 128 and 512, V = 2000, 20% private mass):
  coordinated coverage at T = n/2 stays about 0.6-0.8 for every k, independent coverage at
  T = n/2 is about 0 for every k >= 2; the largest T with coverage >= 0.2 ("T@20%") is about 0.9n
  for coordinated and about 0.8n/k for independent, so the gain grows about linearly in k
  (about 1.2x at k = 1, 5x at k = 5, 10-20x at k = 10-20, 30-40x at k = 50).
* (b) natural task (64 in-context teachers over a tiny GPT-2 briefly trained on public synthetic
  Markov text; randomly initialised weights would give near-uniform teachers): mean coverage at
  T = n/2 about 0.9 coordinated vs about 0.1 independent, support about 25 vs 1, and a max
  passing threshold (1 try) of about 60 vs 22 of 64.
* (c) private generation (2 sequences, at most 8 tokens, per-call ε = 1): coordinated yields
  about 0.9-1.0 with almost no public fallback, independent about 0.1-0.2 with 80-90% fallback;
  the ledger's ε over the 12-16 queries is about 8-16 (δ = 1e-5, plus 1e-6 per DPWS call).
The paper preset uses n = 512 and 10,000 teachers, V = 50,257, r = 1000 histograms (with the exact
top-K fast path) and GPT-2 small; it is sized for an accelerator.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DiversityConfig", "GenerationRunConfig", "HotPateConfig", "NaturalConfig", "get_config"]


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiversityConfig:
    """(a) Tunable diversity: teachers share a secret set of k equally likely tokens.

    Attributes:
        num_teachers: the ensemble sizes n to run.
        vocab_size: V.
        set_sizes: the k values (diversity).
        private_mass: probability each teacher puts on its own private token.
        heterogeneity: std of per-teacher Gaussian jitter of the logits of the secret tokens.
        background_mass: probability spread over all other tokens (a realistic tail).
        num_histograms: r per setting.
        top_k: exact fast path of the coordinated sampler (None = full scan).
    """

    num_teachers: tuple[int, ...]
    vocab_size: int
    set_sizes: tuple[int, ...]
    private_mass: float = 0.2
    heterogeneity: float = 0.3
    background_mass: float = 1e-3
    num_histograms: int
    top_k: int | None = None

    def __post_init__(self):
        if not self.num_teachers or min(self.num_teachers) < 16:
            raise ValueError(f"num_teachers must be non-empty, each >= 16: {self.num_teachers}.")
        if not self.set_sizes or max(self.set_sizes) + 2 >= self.vocab_size:
            raise ValueError(f"set_sizes must be non-empty and < vocab_size - 2: {self.set_sizes}.")
        if not 0 <= self.private_mass < 1 or not 0 < self.background_mass < 1:
            raise ValueError("private_mass must be in [0, 1) and background_mass in (0, 1).")
        _positive("num_histograms", self.num_histograms)


@dataclasses.dataclass(frozen=True, kw_only=True)
class NaturalConfig:
    """(b) In-context teachers over a GPT-2 trained on public synthetic Markov text.

    Attributes:
        model: "tiny" or "small" (`GPT2Config` preset).
        vocab_size: vocabulary of the synthetic language (<= the model's).
        train_steps, batch_size, seq_len, learning_rate: brief public pre-training.
        num_records: sensitive records (synthetic sentences), partitioned among teachers.
        num_teachers: n.
        records_per_teacher: records in each teacher's prompt.
        num_steps: decoding steps evaluated (the prefix advances by the non-private average).
        num_histograms: r per step, for each sampler.
        temperature: teacher temperature.
    """

    model: str
    vocab_size: int
    train_steps: int
    batch_size: int = 32
    seq_len: int = 48
    learning_rate: float = 3e-3
    num_records: int
    num_teachers: int
    records_per_teacher: int
    num_steps: int
    num_histograms: int
    temperature: float = 1.0

    def __post_init__(self):
        if self.model not in ("tiny", "small"):
            raise ValueError(f"model must be 'tiny' or 'small', got {self.model!r}.")
        if self.num_records < self.num_teachers * self.records_per_teacher:
            raise ValueError("num_records must cover num_teachers * records_per_teacher.")
        for name in ("train_steps", "num_steps", "num_histograms", "temperature"):
            _positive(name, getattr(self, name))


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRunConfig:
    """(c) Private generation with the natural task's teachers.

    Thresholds are fractions of n. Per-call privacy: DPWS (epsilon, delta), DPARGMAX (epsilon),
    confident-GNMax (sigma fractions of n).
    """

    num_sequences: int
    max_new_tokens: int
    epsilon: float = 1.0
    delta: float = 1e-6
    gamma: float = 1.0
    argmax_threshold: float = 0.6
    gnmax_threshold: float = 0.5
    gnmax_sigma1: float = 0.1
    gnmax_sigma2: float = 0.05
    report_delta: float = 1e-5

    def __post_init__(self):
        for name in ("num_sequences", "max_new_tokens", "epsilon", "gamma", "gnmax_sigma1"):
            _positive(name, getattr(self, name))
        if not 0 < self.delta < 1 or not 0 < self.report_delta < 1:
            raise ValueError("delta and report_delta must be in (0, 1).")


@dataclasses.dataclass(frozen=True, kw_only=True)
class HotPateConfig:
    """All three Hot PATE experiments."""

    preset: str
    seed: int = 0
    diversity: DiversityConfig
    natural: NaturalConfig
    generation: GenerationRunConfig


def get_config(preset: str = "cpu") -> HotPateConfig:
    """The `cpu` preset (minutes on 2 cores) or the `paper` preset (accelerator)."""
    if preset == "cpu":
        return HotPateConfig(
            preset="cpu",
            diversity=DiversityConfig(
                num_teachers=(128, 512),
                vocab_size=2000,
                set_sizes=(1, 2, 5, 10, 20, 50),
                num_histograms=200,
                top_k=64,
            ),
            natural=NaturalConfig(
                model="tiny",
                vocab_size=64,
                train_steps=150,
                num_records=256,
                num_teachers=64,
                records_per_teacher=4,
                num_steps=6,
                num_histograms=200,
            ),
            generation=GenerationRunConfig(num_sequences=2, max_new_tokens=8),
        )
    if preset == "paper":
        return HotPateConfig(
            preset="paper",
            diversity=DiversityConfig(
                num_teachers=(512, 10_000),
                vocab_size=50_257,
                set_sizes=(1, 2, 5, 10, 20, 50, 100),
                num_histograms=1000,
                top_k=128,
            ),
            natural=NaturalConfig(
                model="small",
                vocab_size=512,
                train_steps=2000,
                num_records=5120,
                num_teachers=512,
                records_per_teacher=10,
                num_steps=32,
                num_histograms=1000,
            ),
            generation=GenerationRunConfig(num_sequences=16, max_new_tokens=32),
        )
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
