"""Settings of the Hot PATE experiments (`experiments.hot_pate`): four parts, three presets.

Command:
    python -m experiments.hot_pate --preset cpu --out DIR [--parts LIST] [--reproducible]

`--parts` is a comma-separated subset of diversity, guarantees, natural, generation (default:
all four). The run writes DIR/hot_pate.json (with each part's run time in seconds),
DIR/hot_pate.md (the tables of the parts that ran), DIR/diversity_n<N>.png for (a) and
DIR/natural.png for (b); the public tokenizer and GPT-2 of (b) and (c) are stored under
DIR/stages/ and read back by later runs with the same settings. The measured results of the cpu
preset, with their run times, are in README.md ("Experiments", Hot PATE).

What the `cpu` preset runs (`get_config("cpu")`):

(a) diversity: synthetic teachers sharing a secret set of k tokens (20% of each teacher's mass
    on a private token of its own, logit jitter 0.3, 1e-3 background mass), V = 2000,
    n = 128 and 512, k = 1, 2, 5, 10, 20, 50; r = 200 histograms per (n, k) for the coordinated
    (exact top-64 fast path) and the independent sampler: coverage and transferred support
    against the threshold T, and the largest T with coverage >= 0.2.
(d) guarantees: the (τ, β, γ) diversity-preservation guarantee measured on the adversarial
    ensembles of `pate.diversity`: TWS_{τ/2, γ} with n = 64, τ = 4, 16, 32, γ = 1 and 4,
    40,000 histograms per case; DPWS with n = 128, ε = 1, δ = 1e-6 (τ = 4ε⁻¹ln(1/δ)), 20,000
    draws per case.
(b) natural: a byte-level BPE (V = 512) and a GPT-2 128 wide with 4 layers trained 1000 public
    steps of 32 x 128 tokens (learning rate 3e-3) on the public text domains (at most 300
    documents per domain, every 20th held out for the perplexity); the sensitive records are
    the sentences (at least 20 characters, cut to 24 tokens) of the e-mails of 20 users of the
    text default's sensitive corpus, dealt by a keyed hash to n = 512 teachers with 4 records
    each, prompt = records + the public instruction "The"; 8 decoding steps with r = 1000
    histograms per step and sampler.
(c) generation: 2 sequences of at most 12 tokens for each aggregator and sampler, with the
    public fallback model (the same GPT-2 given only the instruction): DPWS at (ε, δ) =
    (1, 1e-6) per call, DPARGMAX (Laplace, ε = 1 per call, threshold 0.6n) and confident-GNMax
    (T = n/2, σ1 = 0.1n, σ2 = 0.05n). ε is reported at δ = 1e-5 (plus DPWS's per-call δ) by
    dp-accounting's composition of every call; confident-GNMax's data-dependent ε is released
    by smooth sensitivity with (λ, β, σ_s) chosen from public inputs only (a hypothetical 12
    answered queries with 75% of the votes on one token).

The privacy unit of (b) and (c) is one record (one sentence of one e-mail).

`paper`: (a) n = 512 and 10,000, V = 50,257, k up to 100, r = 1000 (top-128 path); (b) BPE of
8192 tokens, GPT-2 small trained 5000 public steps of 256 tokens, records cut to 48 tokens,
n = 512 teachers with 4 records, 32 steps, r = 1000 (top-128 path); (c) 16 sequences of at most
32 tokens; (d) as cpu. It is sized for an accelerator.

`tiny`: every part at toy sizes (n = 32 teachers in (a)-(c), V = 200 in (a), 20 public steps in
(b), one sequence of 4 tokens in (c), n = 16 and 2,000 draws in (d), DPWS n = 48 and 1,000
draws); the tests run it. All four
parts took 32 s on 2 shared CPU cores (`--preset tiny --reproducible`, 2026-12-03).
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "DiversityConfig",
    "GenerationRunConfig",
    "GuaranteeConfig",
    "HotPateConfig",
    "NaturalConfig",
    "PRESETS",
    "get_config",
]

PRESETS = {
    "cpu": "n = 512 teachers on the embedded text (10 minutes and 4.2 GB on 2 CPU cores when it "
    "trains its public model)",
    "paper": "the paper's sizes",
    "tiny": "seconds, for tests",
}


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
class GuaranteeConfig:
    """(d) The (τ, β, γ) diversity-preservation guarantee measured on adversarial ensembles.

    Attributes:
        num_teachers: n of the TWS ensembles (V = 16 shared tokens + one private per teacher).
        taus: the τ values; TWS runs at T = τ/2.
        gammas: TWS's relevance factors γ.
        num_draws: histograms per (ensemble, τ, γ, sampler).
        dpws_teachers: n of the DPWS ensembles (τ = 4ε⁻¹ln(1/δ) must be <= n).
        dpws_epsilon, dpws_delta: DPWS's per-call (ε, δ).
        dpws_draws: draws per DPWS (ensemble, sampler) (the aggregator is sampled too).
    """

    num_teachers: int = 64
    taus: tuple[int, ...] = (4, 16, 32)
    gammas: tuple[float, ...] = (1.0, 4.0)
    num_draws: int = 40_000
    dpws_teachers: int = 128
    dpws_epsilon: float = 1.0
    dpws_delta: float = 1e-6
    dpws_draws: int = 20_000

    def __post_init__(self):
        if not self.taus or not all(1 <= t <= self.num_teachers for t in self.taus):
            raise ValueError(f"taus must be in [1, num_teachers], got {self.taus}.")
        if not self.gammas or min(self.gammas) < 1:
            raise ValueError(f"gammas must be >= 1 (the theorem's range), got {self.gammas}.")
        for name in ("num_draws", "dpws_draws", "dpws_epsilon"):
            _positive(name, getattr(self, name))
        if not 0 < self.dpws_delta < 1:
            raise ValueError(f"dpws_delta must be in (0, 1), got {self.dpws_delta}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NaturalConfig:
    """(b) In-context teachers over a GPT-2 trained here on the public text domains.

    The text default (`dpmix_jax.data.builtin.load_text_mixture_task`) supplies public documents
    (BBC topics, Python code, Python docs) and a sensitive e-mail corpus. A byte-level BPE is
    trained on the public documents only, and the GPT-2 on the same documents (uniform domain
    mixture, public steps of the training engine). The sensitive records are the sentences of the
    e-mails; they are partitioned (data-independently, disjointly) among the teachers, and
    teacher i's prompt is its own records, one per line, then the shared public `instruction`.

    Attributes:
        model: "tiny" or "small" (`GPT2Config` preset; n_positions = seq_len).
        width, depth: override the preset's n_embd and n_layer (None: the preset's).
        vocab_size: BPE vocabulary size.
        train_steps, batch_size, seq_len, learning_rate: public pre-training.
        max_public_per_domain: public documents per domain (tokenizer and model training).
        heldout_every: every this-many-th public document of each domain is held out of the
            model's training and scores its held-out perplexity.
        num_users: users of the sensitive e-mail corpus.
        min_record_chars: sentences shorter than this are not records.
        max_record_tokens: records are cut to this many tokens.
        num_teachers: n.
        records_per_teacher: records in each teacher's prompt.
        instruction: the public text every prompt ends with (and the public model's prompt).
        num_steps: decoding steps evaluated (the prefix advances by the non-private average).
        num_histograms: r per step, for each sampler.
        temperature: teacher temperature.
        top_k: exact top-K fast path of the coordinated sampler (None = full scan).
    """

    model: str
    width: int | None = None
    depth: int | None = None
    vocab_size: int
    train_steps: int
    batch_size: int = 32
    seq_len: int = 128
    learning_rate: float = 3e-3
    max_public_per_domain: int = 300
    heldout_every: int = 20
    num_users: int = 20
    min_record_chars: int = 20
    max_record_tokens: int = 24
    num_teachers: int
    records_per_teacher: int
    instruction: str = "The"
    num_steps: int
    num_histograms: int
    temperature: float = 1.0
    top_k: int | None = None

    def __post_init__(self):
        if self.model not in ("tiny", "small"):
            raise ValueError(f"model must be 'tiny' or 'small', got {self.model!r}.")
        if self.vocab_size < 257:
            raise ValueError(f"vocab_size must be >= 257 (byte-level BPE), got {self.vocab_size}.")
        for name in (
            "train_steps", "batch_size", "seq_len", "learning_rate", "max_public_per_domain",
            "heldout_every", "num_users", "min_record_chars", "max_record_tokens", "num_teachers",
            "records_per_teacher", "num_steps", "num_histograms", "temperature",
        ):  # fmt: skip
            _positive(name, getattr(self, name))
        if not self.instruction:
            raise ValueError("instruction must be a non-empty string.")
        for name in ("width", "depth"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be None or >= 1, got {value!r}.")
        if self.heldout_every < 2:
            raise ValueError(f"heldout_every must be >= 2, got {self.heldout_every}.")
        prompt = self.records_per_teacher * (self.max_record_tokens + 1) + self.num_steps
        if prompt >= self.seq_len:
            raise ValueError(
                f"records_per_teacher * (max_record_tokens + 1) + num_steps = {prompt} must be "
                f"< seq_len = {self.seq_len} (teacher prompts must fit the trained positions)."
            )
        if self.top_k is not None and not 1 <= self.top_k < self.vocab_size:
            raise ValueError(f"top_k must be None or in [1, vocab_size), got {self.top_k}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerationRunConfig:
    """(c) Private generation with the natural task's teachers.

    Thresholds are fractions of n. Per-call privacy: DPWS (epsilon, delta), DPARGMAX (epsilon),
    confident-GNMax (sigma fractions of n). Confident-GNMax's data-dependent ε is released
    privately at Rényi order `release_order` with smooth-sensitivity noise multiplier
    `release_noise_multiplier`; None (the default) chooses both, and β, from public inputs
    only (`pate.smooth_sensitivity.choose_release`: a hypothetical sequence of max_new_tokens
    answered queries with `release_agreement` of the votes on one token).
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
    release_order: float | None = None
    release_noise_multiplier: float | None = None
    release_agreement: float = 0.75

    def __post_init__(self):
        for name in ("num_sequences", "max_new_tokens", "epsilon", "gamma", "gnmax_sigma1"):
            _positive(name, getattr(self, name))
        if not 0 < self.delta < 1 or not 0 < self.report_delta < 1:
            raise ValueError("delta and report_delta must be in (0, 1).")
        if (self.release_order is None) != (self.release_noise_multiplier is None):
            raise ValueError(
                "give release_order and release_noise_multiplier together, or neither."
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class HotPateConfig:
    """All three Hot PATE experiments."""

    preset: str
    seed: int = 0
    diversity: DiversityConfig
    natural: NaturalConfig
    generation: GenerationRunConfig
    guarantees: GuaranteeConfig = dataclasses.field(default_factory=GuaranteeConfig)

    def __post_init__(self):
        natural = self.natural
        prompt = natural.records_per_teacher * (natural.max_record_tokens + 1)
        if prompt + self.generation.max_new_tokens >= natural.seq_len:
            raise ValueError(
                f"teacher prompts ({prompt} tokens) plus max_new_tokens = "
                f"{self.generation.max_new_tokens} must be < seq_len = {natural.seq_len}."
            )


def get_config(preset: str = "cpu") -> HotPateConfig:
    """The `cpu` preset (minutes on 2 cores), `paper` (accelerator) or `tiny` (tests, seconds)."""
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
                width=128,
                depth=4,
                vocab_size=512,
                train_steps=1000,
                num_teachers=512,
                records_per_teacher=4,
                num_steps=8,
                num_histograms=1000,
            ),
            generation=GenerationRunConfig(num_sequences=2, max_new_tokens=12),
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
                vocab_size=8192,
                train_steps=5000,
                seq_len=256,
                learning_rate=3e-4,
                max_public_per_domain=100_000,
                max_record_tokens=48,
                num_teachers=512,
                records_per_teacher=4,
                num_steps=32,
                num_histograms=1000,
                top_k=128,
            ),
            generation=GenerationRunConfig(num_sequences=16, max_new_tokens=32),
        )
    if preset == "tiny":
        return HotPateConfig(
            preset="tiny",
            diversity=DiversityConfig(
                num_teachers=(32,), vocab_size=200, set_sizes=(1, 5), num_histograms=50
            ),
            natural=NaturalConfig(
                model="tiny",
                vocab_size=300,
                train_steps=20,
                batch_size=8,
                seq_len=64,
                max_public_per_domain=40,
                max_record_tokens=16,
                num_teachers=32,
                records_per_teacher=2,
                num_steps=3,
                num_histograms=100,
            ),
            generation=GenerationRunConfig(num_sequences=1, max_new_tokens=4),
            guarantees=GuaranteeConfig(
                num_teachers=16,
                taus=(8,),
                gammas=(1.0,),
                num_draws=2000,
                dpws_teachers=48,
                dpws_epsilon=2.0,
                dpws_delta=1e-3,
                dpws_draws=1000,
            ),  # fmt: skip
        )
    raise ValueError(f"preset must be 'cpu', 'paper' or 'tiny', got {preset!r}.")
