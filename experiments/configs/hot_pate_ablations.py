"""Settings of the Hot PATE paper's ablations (`experiments.hot_pate_ablations`).

Command:
    python -m experiments.hot_pate_ablations --out DIR --reproducible [--preset cpu|tiny]

Six parts, all on synthetic teachers with a known ground truth (`pate.diversity`):

(e) temperature: the secret-set ensembles of `experiments.hot_pate` (a) at n = 512, V = 2000,
    k = 2 and 10, every teacher sampled at temperature t in {0.5, 0.75, 1, 1.5, 2}: coverage at
    T = n/2, the largest T with coverage >= 0.2, and the share of the transferred votes that
    fall on the secret tokens (the utility: votes on private or background tokens are noise),
    coordinated against independent sampling, r = 1000 histograms each.
(f) aggregators: TARGMAX, TWS, DPARGMAX (Laplace, ε = 1) and DPWS ((ε, δ) = (1, 1e-6)) on a
    homogeneous ensemble (one secret set of k = 5 tokens shared by all 512 teachers) and on a
    heterogeneous one (8 groups of sizes 128, 96, 80, 64, 48, 40, 32, 24, each group identical
    teachers over its own 2 tokens): yield, the total variation distance between the output
    given a yield and the teachers' average distribution, and the groups whose tokens come
    out. Thresholds T = n/2 (homogeneous) and T = 12 (half the smallest group); 20,000 draws.
(g) privacy cost: for the ensembles of (e) at t = 1 and k in {1, 2, 5, 10, 20, 50}, the largest
    T at which coverage stays >= 0.2 for each sampler, priced by DPWS: the per-call ε whose keep
    threshold is that T (δ = 1e-8 per call), the ε of 100 such calls and the calls that fit in
    ε = 10 (dp-accounting's PLD composition at δ = 1e-6, plus the calls' δ), and DPWS's measured
    yield at that ε.
(h) API teachers: each teacher known only through m sampled answers (`teachers.sampled_logits`),
    m in {1, 4, 16, 64, 256}, beside the exact distributions; coverage at T = n/2 and the
    largest T with coverage >= 0.2 of coordinated sampling on the estimates.

(i) steps with no output: streams of 100, 1000 and 10,000 steps of which 20 can be answered
    (the k = 1 ensemble: one token shared by all) and the rest cannot (every teacher on a
    private token of its own, 0.99 of its mass), in a random order, at a total (ε, δ) =
    (8, 1e-6), T = n/2: DPARGMAX charged on every step (the per-call ε whose composition over
    the stream is 8) against the sparse vector gate of `pate.sparse` (c = 30 answers, gate
    ε = 5 of which 1 on the threshold, each selection's ε3 the largest that keeps the run's ε at
    8): answered and correct steps among the answerable, answers among the others.
(j) individual accounting (`pate.individual`): streams of 100, 1000 and 10,000 steps of a
    heterogeneous ensemble of n = 512 teachers (one user each) and a public model (logits
    3·N(0, 1) over V = 2000, fresh each step). At 5% of the steps a group of 48 random teachers
    knows a token the public model gives its least mass (0.9 of the group's mass on it); at
    every step each teacher's logits are the public model's plus a fixed jitter h·N(0, 1) of its
    own, h in {0, 0.01}. Same mechanism (votes under shared Gumbel noise, a teacher that agrees
    with the public vote abstains, Gaussian noise σ = 6 on every count, threshold
    T = σ·sqrt(2·ln(V/0.01)), else the public vote), at a per-teacher (ε, δ) = (8, 1e-6):
    individual accounting (a Rényi filter: each teacher charged only when it votes, at most
    M = 75 times) against the standard accounting (every teacher charged every step: the run
    stops after M steps) and against the standard accounting with the σ that runs the whole
    stream: group tokens released, tokens from the histogram and from the public fallback,
    the mean and max charge per teacher, and the (ε, δ) each guarantees.

`tiny` runs every part at toy sizes (n = 64, V = 200, r = 200; (j): groups of 12, 10% of the
steps, σ = 2); the tests run it.
The cpu preset (about 3 minutes on 2 CPU cores) and its results are in docs/experiments.md
("Hot PATE ablations"), rebuilt from the stored run.
"""

from __future__ import annotations

import dataclasses

__all__ = ["PRESETS", "AblationsConfig", "get_config"]

PRESETS = {"cpu": "n = 512 teachers, V = 2000, r = 1000", "tiny": "a test run"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class AblationsConfig:
    """Public settings of the ablations.

    Attributes:
        num_teachers: n of every ensemble.
        vocab_size: V of the secret-set ensembles.
        private_mass, heterogeneity, background_mass: the secret-set ensembles' shape
            (`pate.diversity.secret_set_logits`).
        num_histograms: r per setting of (e), (g) and (h).
        coverage_level: the coverage the largest passing threshold must keep.
        temperatures: the teachers' sampling temperatures of (e).
        temperature_set_sizes: k of (e) and (h).
        homogeneous_set_size: k of the homogeneous ensemble of (f).
        group_sizes: teachers per group of the heterogeneous ensemble of (f) (sum = n).
        aggregator_epsilon, aggregator_delta: DPARGMAX's ε and DPWS's (ε, δ) in (f).
        aggregator_draws: draws per (ensemble, aggregator, sampler) in (f).
        cost_set_sizes: k of (g).
        call_delta: DPWS's δ per call in (g).
        composition_delta: the composition's δ in (g) (each call's δ comes on top).
        calls: how many calls (g) prices.
        budget_epsilon: the ε within which (g) counts calls.
        yield_draws: draws of DPWS's measured yield in (g).
        api_samples: the m values of (h).
        stream_steps: the stream lengths of (i).
        answerable_steps: the steps of each stream that can be answered, in (i).
        stream_epsilon, stream_delta: the total (ε, δ) of every method in (i), and each
            teacher's (ε, δ) in (j).
        max_answers: the sparse gate's c in (i).
        gate_epsilon: the sparse gate's ε1 + ε2 in (i).
        gate_threshold_share: ε1 / (ε1 + ε2) in (i).
        individual_sigma: σ of the Gaussian noise on every count in (j).
        individual_eta: η of (j)'s threshold T = σ·sqrt(2·ln(V/η)) (a token with no vote passes
            with probability <= η/(2V)).
        individual_group_size: teachers that know the group token at a group step of (j).
        individual_group_share: the share of (j)'s steps that are group steps.
        individual_group_mass: the group's mass on its token in (j).
        individual_heterogeneity: the jitters h of the teachers' logits in (j).
        individual_logit_scale: the scale of the public model's logits in (j).
        seed: seed of the ensembles and of every draw.
        progress: print a line per setting.
    """

    num_teachers: int = 512
    vocab_size: int = 2000
    private_mass: float = 0.2
    heterogeneity: float = 0.3
    background_mass: float = 1e-3
    num_histograms: int = 1000
    coverage_level: float = 0.2
    temperatures: tuple[float, ...] = (0.5, 0.75, 1.0, 1.5, 2.0)
    temperature_set_sizes: tuple[int, ...] = (2, 10)
    homogeneous_set_size: int = 5
    group_sizes: tuple[int, ...] = (128, 96, 80, 64, 48, 40, 32, 24)
    aggregator_epsilon: float = 1.0
    aggregator_delta: float = 1e-6
    aggregator_draws: int = 20_000
    cost_set_sizes: tuple[int, ...] = (1, 2, 5, 10, 20, 50)
    call_delta: float = 1e-8
    composition_delta: float = 1e-6
    calls: int = 100
    budget_epsilon: float = 10.0
    yield_draws: int = 2000
    api_samples: tuple[int, ...] = (1, 4, 16, 64, 256)
    stream_steps: tuple[int, ...] = (100, 1000, 10_000)
    answerable_steps: int = 20
    stream_epsilon: float = 8.0
    stream_delta: float = 1e-6
    max_answers: int = 30
    gate_epsilon: float = 5.0
    gate_threshold_share: float = 0.2
    individual_sigma: float = 6.0
    individual_eta: float = 0.01
    individual_group_size: int = 48
    individual_group_share: float = 0.05
    individual_group_mass: float = 0.9
    individual_heterogeneity: tuple[float, ...] = (0.0, 0.01)
    individual_logit_scale: float = 3.0
    seed: int = 0
    progress: bool = True

    def __post_init__(self):
        if self.num_teachers < 16 or sum(self.group_sizes) != self.num_teachers:
            raise ValueError(
                f"num_teachers must be >= 16 and equal sum(group_sizes), got {self.num_teachers}"
                f" and {sum(self.group_sizes)}."
            )
        if max((*self.temperature_set_sizes, *self.cost_set_sizes)) + 2 >= self.vocab_size:
            raise ValueError("every set size must be < vocab_size - 2.")
        if 2 * len(self.group_sizes) + self.homogeneous_set_size > self.vocab_size:
            raise ValueError("the heterogeneous groups' tokens must fit in vocab_size.")
        if not all(t > 0 for t in self.temperatures) or not self.temperatures:
            raise ValueError(f"temperatures must be > 0, got {self.temperatures}.")
        if not all(m >= 1 for m in self.api_samples) or not self.api_samples:
            raise ValueError(f"api_samples must be >= 1, got {self.api_samples}.")
        for name in ("num_histograms", "aggregator_draws", "calls", "yield_draws"):
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2, got {getattr(self, name)}.")
        for name in ("aggregator_delta", "call_delta", "composition_delta", "coverage_level"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}.")
        if not self.aggregator_epsilon > 0 or not self.budget_epsilon > 0:
            raise ValueError("aggregator_epsilon and budget_epsilon must be > 0.")
        if not 0 < self.gate_epsilon < self.stream_epsilon:
            raise ValueError("gate_epsilon must be in (0, stream_epsilon).")
        if not self.stream_steps or min(self.stream_steps) <= self.answerable_steps:
            raise ValueError("every stream must be longer than answerable_steps.")
        if self.answerable_steps < 1 or self.max_answers < 1:
            raise ValueError("answerable_steps and max_answers must be >= 1.")
        if not 0 < self.stream_delta < 1 or not 0 < self.gate_threshold_share < 1:
            raise ValueError("stream_delta and gate_threshold_share must be in (0, 1).")
        if not 1 <= self.individual_group_size <= self.num_teachers:
            raise ValueError(
                f"individual_group_size must be in [1, num_teachers], got"
                f" {self.individual_group_size}."
            )
        for name in ("individual_eta", "individual_group_share", "individual_group_mass"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}.")
        if not self.individual_heterogeneity or min(self.individual_heterogeneity) < 0:
            raise ValueError(
                f"individual_heterogeneity must be >= 0, got {self.individual_heterogeneity}."
            )
        if not self.individual_sigma > 0 or not self.individual_logit_scale > 0:
            raise ValueError("individual_sigma and individual_logit_scale must be > 0.")


def get_config(preset: str = "cpu") -> AblationsConfig:
    """ "cpu" (the stored run) or "tiny" (every part at toy sizes, for the tests)."""
    if preset == "cpu":
        return AblationsConfig()
    if preset == "tiny":
        return AblationsConfig(
            num_teachers=64,
            vocab_size=200,
            num_histograms=200,
            temperatures=(0.5, 1.0, 2.0),
            group_sizes=(24, 16, 12, 8, 4),
            aggregator_draws=2000,
            cost_set_sizes=(1, 10),
            yield_draws=200,
            api_samples=(1, 16),
            stream_steps=(50, 200),
            answerable_steps=5,
            max_answers=8,
            individual_sigma=2.0,
            individual_group_size=12,
            individual_group_share=0.1,
        )
    raise ValueError(f"preset must be 'cpu' or 'tiny', got {preset!r}.")
