"""Hot PATE experiments (SPEC §5): diversity transfer, natural task, private generation.

Command:
    python -m experiments.hot_pate --preset cpu --out DIR      # about 5 minutes on 2 CPU cores

Writes DIR/hot_pate.json, DIR/hot_pate.md (tables) and DIR/diversity_*.png, DIR/natural.png.
`--preset tiny` is the seconds-long version the tests run. Measured with the cpu preset (2 shared,
heavily loaded cores: diversity 67 s, tokenizer + public training 84 s, natural task 19 s,
generation 150 s; 319 s in all):

(a) tunable diversity (secret set of k tokens, V = 2000, 20% private mass, r = 200):

    | n   | k  | cov@n/2 hot | cov@n/2 cold | T@20% hot | T@20% cold | gain  |
    |-----|----|-------------|--------------|-----------|------------|-------|
    | 512 | 1  | 0.77        | 0.80         | 464       | 380        | 1.2x  |
    | 512 | 5  | 0.64        | 0.00         | 464       | 86         | 5.4x  |
    | 512 | 10 | 0.66        | 0.00         | 464       | 43         | 10.8x |
    | 512 | 50 | 0.59        | 0.00         | 464       | 11         | 42.2x |

    (n = 128 is the same picture: gain 1.2x, 4.6x, 9.2x, 29.8x.)

The cpu preset's public GPT-2 is now 128 wide with 4 layers, trained 1000 public steps (every
20th public document held out for its perplexity) and stored in DIR/stages/ for later runs;
`--parts natural,generation` runs (b) and (c) only. The numbers of (b) and (c) below are from the
previous preset (64 wide, 2 layers, 300 steps, release at λ = 8, σ_s = 2); the README has the
current preset's.

(b) natural task on the text default: BPE (V = 512) and tiny GPT-2 trained on the public domains
    (300 public steps; loss 5.28 nats at step 60, 4.13 at step 300); 2203 sensitive records
    (e-mail sentences), n = 512 teachers with 4 records each, instruction "The", r = 1000
    histograms per step for both samplers on the same 8 prefixes (mean over steps):

    | T     | coverage hot | coverage cold | support hot | support cold |
    |-------|--------------|---------------|-------------|--------------|
    | 32    | 0.994        | 0.221         | 160.4       | 5.1          |
    | 76.8  | 0.981        | 0.004         | 155.5       | 0.5          |
    | 184.4 | 0.949        | 0.000         | 149.4       | 0.0          |
    | 256   | 0.918        | 0.000         | 144.4       | 0.0          |

    Max passing threshold (mean / worst step), 1, 5, 10 tries: coordinated 473/463, 512/512,
    512/512; independent 52/31, 59/35, 61/37. The tiny model's teachers are nearly homogeneous
    and high-entropy: coordinated histograms are near-unanimous votes for a sample of the shared
    distribution (large support at T = n/2), independent votes spread and never reach n/8.

(c) private generation (2 sequences of at most 12 tokens, a line ends at a newline token; public
    fallback = the same GPT-2 given only the instruction; δ = 1e-5 plus 1e-6 per DPWS call):

    | aggregator          | sampler     | ε     | queries | yield | public fallback |
    |---------------------|-------------|-------|---------|-------|-----------------|
    | DPWS (ε = 1/call)   | coordinated | 22.2  | 24      | 0.96  | 0.04            |
    | DPWS                | independent | 12.9  | 13      | 0.15  | 0.85            |
    | DPARGMAX Laplace    | coordinated | 22.2  | 24      | 0.88  | 0.12            |
    | DPARGMAX Laplace    | independent | 22.2  | 24      | 0.00  | 1.00            |
    | confident-GNMax     | coordinated | 1.08  | 24      | 0.92  | 0.08            |
    | confident-GNMax     | independent | 1.05  | 23      | 0.00  | 1.00            |

    (confident-GNMax: T = n/2, σ1 = 0.1n, σ2 = 0.05n; data-dependent ε per sequence 0.28-0.30
    coordinated.) The ε column is the data-independent composition over every query.

The privacy unit of (b) and (c) is one record (one sentence of one e-mail).

(d) the (τ, β, γ) diversity-preservation guarantee measured on 7 adversarial ensembles (n = 64,
    τ = 4, 16, 32, 40,000 histograms each; DPWS: n = 128, ε = 1, δ = 1e-6, τ = 55.3, 20,000
    draws); smallest β and largest γ attained (a later run, secret randomness, 2 loaded cores):

    | aggregator       | min β coordinated        | min β independent | max γ coord. | theorem     |
    |------------------|--------------------------|-------------------|--------------|-------------|
    | TWS_{τ/2}, γ = 1 | 0.554 (minority_low_q)   | 0.000             | 1.055        | β 0.17, γ 1 |
    | TWS_{τ/2}, γ = 4 | 0.965 (wide_uniform)     | 0.000             | 2.998        | β 0.17, γ 4 |
    | DPWS, γ = 1      | 0.519 (minority_low_q)   | 0.000             | 1.041        | Θ(1), γ 1   |

    (γ above 1 is within 4 standard errors of the estimate.)

The paper preset uses n = 512 and 10,000 teachers and V = 50,257 in (a); in (b) and (c) a BPE of
8192 tokens, GPT-2 small trained 5000 public steps, n = 512 teachers, r = 1000 histograms per step
(with the exact top-K fast path), 32 steps; it is sized for an accelerator.
"""

from __future__ import annotations

import dataclasses

__all__ = [
    "DiversityConfig",
    "GenerationRunConfig",
    "GuaranteeConfig",
    "HotPateConfig",
    "NaturalConfig",
    "get_config",
]


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
