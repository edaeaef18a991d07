"""Settings of the k-scaling study (excess MixMin loss of DP-MixMin vs the number of sources k).

Run:
    python -m experiments.k_scaling --preset cpu --out DIR
    python -m experiments.k_scaling --preset cpu --proxies synthetic --out DIR

Trained proxies (the default; the analogue of the paper's Appendix A.6): the public label
functions are distinct subsets of the 10 digit classes of MNIST-5k ("is the digit in S?"; there
are 1022 non-trivial subsets), one trained multi-head proxy (shared MLP trunk, one sigmoid head per
subset) per seed, ten sensitive tasks per seed, each labelled y ~ Bernoulli(Σ_i λ*_i y_i(x)) for a
sparse λ* over the 1000 label functions (three active, like the image default). Smaller k take the
first k heads of the same proxy (nested subsets). The cpu preset (k in {2, 8, 32, 100, 316,
1000}, 5 seeds × 10 tasks, n = 3,000 sensitive images, b = 300, ε = 1; the three solvers, each
DP run repeated without noise) took 6.5 minutes of wall time and 1.4 GB on 2 CPU cores shared
with other jobs; its stored run, docs/results/k_scaling.json, gives the excess per k and the
fitted slopes (docs/experiments.md; a test checks the mirror-descent slope against the paper's).
The paper (ResNet-50 proxies on k ImageNet classes, the first ten binarised CIFAR-100 classes as
tasks, N = 50,000): slope 0.49 for k >= 32 (theory 0.5); Table 4: 3.8e-3 at k = 32, 17.7e-3 at
k = 1000.

The paper preset reads ImageNet-2012 (public sources: its 1000 classes, one-vs-rest) and
CIFAR-100 (tasks: classes 0-9 one-vs-rest on the 50,000 training images) through tfds from
`tfds_data_dir` (both must already be prepared there; the run stops with one line otherwise) and
trains a ResNet-50 proxy with 1000 heads (an accelerator job).

`--smoke` (with `--preset paper`; `smoke` below) proves that path end to end in a minute on a
CPU: the same tfds data sets and loaders, the ResNet-50 proxy with 1000 heads at 224x224, its
learning rate, ε, δ, the T_k/η_k/C_k rules and the three solvers, but k in {2, 4, 8} (a
doubling grid like the paper's, slope over k >= 4), one seed, two tasks, n = 8 sensitive images,
4 public holdout images, b = 4 and one proxy step of batch 2:
    python -m experiments.k_scaling --preset paper --smoke --out DIR
Its excess losses measure nothing; it checks that every stage runs and writes k_scaling.md
(`tests/experiments/test_k_scaling_smoke.py` runs it on `tfds.testing.mock_data`).

Synthetic proxies (`--proxies synthetic`): k sigmoid proxies on Gaussian inputs and labels drawn
from an exact mixture of four of them (`mixing.synthetic.mixture_problem`), n = 20,000: the
only setting where the population optimum λ* is known exactly. Its cpu preset (k in {2, 8, 32,
128, 256}, 3 seeds, b = 1000) is not among the stored runs.

The solvers (`SOLVERS`): DP mirror descent (the paper's), DP Frank-Wolfe with the Gaussian
oracle (noisy argmin of a Poisson-sampled clipped sum; `mixing.solvers`) and DP Frank-Wolfe with
the exponential-mechanism oracle (a vertex drawn by the exponential mechanism from the clipped sum
over the whole mixture split; `mixing.exponential_oracle`; `batch_size` does not apply). T and η
follow the theory in both settings (`mixing.scaling.schedule`): mirror descent
T_k = min(max_steps, ⌈(nε)² / (ln k · ln(1/δ))⌉) and η_k = step_size · √(2 ln k / T_k) / C_k;
Frank-Wolfe (both oracles) T_k = min(max_steps, ⌈(nε / (ln k · √ln(1/δ)))^(2/3)⌉).
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.mixing import scaling
from dpmix_jax.models.resnet import ResNetConfig
from dpmix_jax.pipeline.image import ModelSpec
from dpmix_jax.privacy import validation
from dpmix_jax.train import TrainConfig

DATA = ("digits", "imagenet_cifar100")
EXPONENTIAL_FRANK_WOLFE = "frank_wolfe_exponential"
SOLVERS = ("mirror_descent", "frank_wolfe", EXPONENTIAL_FRANK_WOLFE)
NUM_DIGIT_SUBSETS = 2**10 - 2
PRESETS = {
    "cpu": "k up to 1000 trained heads on MNIST-5k (or 256 synthetic sources)",
    "paper": "ImageNet classes as sources for CIFAR-100 tasks through tfds, k up to 1000",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainedProxyConfig:
    """Public settings of the trained multi-head proxy and of the sensitive tasks.

    Attributes:
        data: "digits" (MNIST-5k; sources: digit subsets; tasks: sparse mixtures of them) or
            "imagenet_cifar100" (tfds; sources: ImageNet-2012 classes one-vs-rest; tasks:
            CIFAR-100 classes 0 .. num_tasks-1 one-vs-rest).
        num_label_functions: K, heads of the proxy (the largest k); digits: at most 1022.
        num_tasks: sensitive tasks per seed.
        num_active_sources: digits: label functions with non-zero weight in each task's λ*.
        public_holdout: public examples kept out of proxy training; C_k is set from the proxy's
            outputs on them (stand-in tasks drawn with `KScalingConfig.public_seed`).
        stand_in_tasks: number of such public stand-in tasks.
        image_size: side of the square images.
        model: the proxy network (its output layer has K heads).
        train: public training of the proxy (BCE over the K heads).
        eval_batch_size: rows per batch when computing the proxy's outputs.
        tfds_data_dir: where tfds finds ImageNet and CIFAR-100 (None: tfds' default folder).
    """

    data: str = "digits"
    num_label_functions: int = 1000
    num_tasks: int = 10
    num_active_sources: int = 3
    public_holdout: int = 500
    stand_in_tasks: int = 10
    image_size: int = 16
    model: ModelSpec = ModelSpec(kind="mlp", mlp_hidden=(128,))
    train: TrainConfig = TrainConfig(
        steps=400, batch_size=128, learning_rate=3e-3, progress=False, log_every=None
    )
    eval_batch_size: int = 500
    tfds_data_dir: str | None = None

    def __post_init__(self) -> None:
        if self.data not in DATA:
            raise ValueError(f"data must be one of {DATA}, got {self.data!r}.")
        for name in (
            "num_label_functions",
            "num_tasks",
            "num_active_sources",
            "public_holdout",
            "stand_in_tasks",
            "eval_batch_size",
        ):
            validation.check_steps(getattr(self, name), name)
        if self.data == "digits" and self.num_label_functions > NUM_DIGIT_SUBSETS:
            raise ValueError(
                f"num_label_functions must be <= {NUM_DIGIT_SUBSETS} (the non-trivial subsets of"
                f" 10 digits), got {self.num_label_functions}."
            )
        if self.num_active_sources > self.num_label_functions:
            raise ValueError("num_active_sources must be <= num_label_functions.")
        if self.image_size < 4:
            raise ValueError(f"image_size must be >= 4, got {self.image_size}.")
        if self.train.private:
            raise ValueError("the proxy trains on public data: train.private must be False.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KScalingConfig:
    """Public settings of the k-scaling study.

    Attributes:
        ks: numbers of sources to run.
        seeds: data seeds (each gives a fresh problem: synthetic proxies, or a public/sensitive
            split, label functions, tasks and a trained proxy).
        num_examples: n, the size of the sensitive mixture split.
        trained: the trained-proxy setting; None runs the synthetic proxies below.
        num_features: synthetic: input dimension of the proxies.
        support: synthetic: number of sources in the true mixture λ*.
        proxy_scale: synthetic: scale of the proxies' logits.
        epsilon, delta: the privacy target of every DP-MixMin run.
        batch_size: the Gaussian solvers' expected batch size b (q = b / n), fixed across k
            (the exponential oracle reads all n examples at every step).
        max_steps: the compute cap on T_k (see `mixing.scaling.schedule`).
        step_size: a in the mirror-descent step η_k = a · √(2 ln k / T_k) / C_k.
        clip_quantile, clip_scale: C_k = clip_scale × the `clip_quantile` quantile of the
            (mean-shifted) per-example gradient norms at uniform weights on *public* stand-in
            data (synthetic: a fresh problem with `public_seed`; trained: the proxy's public
            holdout), rounded to a quarter-octave grid so runs share compiled solvers.
        public_examples: synthetic: size of the public stand-in problem.
        public_seed: seed of the public stand-in problem or tasks (must differ from the seeds).
        solvers: some of `SOLVERS`: "mirror_descent", "frank_wolfe" (Gaussian oracle),
            "frank_wolfe_exponential" (exponential-mechanism oracle).
        reference_steps, reference_learning_rate: non-private MixMin for the reference optimum.
        slope_min_k: the log-log slope is fitted over k >= this.
    """

    ks: tuple[int, ...]
    seeds: tuple[int, ...]
    num_examples: int
    trained: TrainedProxyConfig | None = None
    num_features: int = 16
    support: int = 4
    proxy_scale: float = 3.0
    epsilon: float = 1.0
    delta: float = 1e-5
    batch_size: int = 1000
    max_steps: int = 1000
    step_size: float = 20.0
    clip_quantile: float = 0.9
    clip_scale: float = 4.0
    public_examples: int = 5000
    public_seed: int = 10_000
    solvers: tuple[str, ...] = SOLVERS
    reference_steps: int = 2000
    reference_learning_rate: float = 2.0
    slope_min_k: int = 32

    def __post_init__(self) -> None:
        if not self.ks or any(not isinstance(k, int) or k < 2 for k in self.ks):
            raise ValueError(f"ks must be integers >= 2, got {self.ks!r}.")
        if not self.seeds:
            raise ValueError("seeds must not be empty.")
        if sum(k >= self.slope_min_k for k in self.ks) < 2:
            raise ValueError(f"need at least two ks >= slope_min_k = {self.slope_min_k}.")
        if self.trained is not None and max(self.ks) > self.trained.num_label_functions:
            raise ValueError(
                f"the largest k ({max(self.ks)}) exceeds the proxy's"
                f" {self.trained.num_label_functions} heads."
            )
        for name in ("num_examples", "num_features", "support", "batch_size", "public_examples"):
            validation.check_steps(getattr(self, name), name)
        validation.check_epsilon(self.epsilon)
        validation.check_delta(self.delta)
        validation.check_steps(self.max_steps, "max_steps")
        validation.check_steps(self.reference_steps, "reference_steps")
        for name in ("proxy_scale", "clip_scale", "step_size", "reference_learning_rate"):
            validation.check_positive(getattr(self, name), name)
        if not 0.0 < self.clip_quantile <= 1.0:
            raise ValueError(f"clip_quantile must be in (0, 1], got {self.clip_quantile!r}.")
        if self.public_seed in self.seeds:
            raise ValueError(f"public_seed {self.public_seed} must differ from the study seeds.")
        if not self.solvers or not set(self.solvers) <= set(SOLVERS):
            raise ValueError(f"solvers must be some of {SOLVERS}, got {self.solvers!r}.")

    def schedule(self, k: int, solver: str, clip_norm: float) -> tuple[int, float | None]:
        """(T_k, η_k) of `solver` for k sources at clip norm C_k (`mixing.scaling.schedule`; η
        is None for Frank-Wolfe's 2/(t + 2) steps, with either oracle)."""
        return scaling.schedule(
            k,
            solver,
            clip_norm=clip_norm,
            num_examples=self.num_examples,
            epsilon=self.epsilon,
            delta=self.delta,
            max_steps=self.max_steps,
            step_size=self.step_size,
        )


PROXIES = ("trained", "synthetic")


def smoke(config: KScalingConfig) -> KScalingConfig:
    """The trained paper config's smoke test: the same data, model, image size, heads, learning
    rate, privacy target, schedule rules and solvers; k in {2, 4, 8}, one seed, two tasks, n = 8,
    b = 4 and one proxy step of batch 2 (a test that the paper's path runs, not a result)."""
    trained = config.trained
    return dataclasses.replace(
        config,
        ks=(2, 4, 8),
        seeds=(0,),
        num_examples=8,
        batch_size=4,
        slope_min_k=4,
        trained=dataclasses.replace(
            trained,
            num_tasks=2,
            public_holdout=4,
            stand_in_tasks=2,
            train=dataclasses.replace(
                trained.train,
                steps=1,
                batch_size=2,
                log_every=1,
                progress=False,
                checkpoint_every=None,
            ),
            eval_batch_size=4,
        ),
    )


def get_config(
    preset: str = "cpu", proxies: str = "trained", *, smoke_test: bool = False
) -> KScalingConfig:
    """The "cpu" preset (minutes on 2 cores) or the "paper" preset (the paper's grid), with
    trained (default) or synthetic proxies; `smoke_test=True`: the trained paper preset's smoke
    test (`smoke`)."""
    if proxies not in PROXIES:
        raise ValueError(f"proxies must be one of {PROXIES}, got {proxies!r}.")
    if preset not in PRESETS:
        raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
    if smoke_test and (preset, proxies) != ("paper", "trained"):
        raise ValueError(
            f"the smoke test applies to the paper preset's trained proxies, not {preset!r}"
            f" with {proxies!r} proxies."
        )
    paper_ks = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1000)
    seeds = (0, 1, 2, 3, 4)
    if proxies == "synthetic":
        if preset == "cpu":
            return KScalingConfig(ks=(2, 8, 32, 128, 256), seeds=(0, 1, 2), num_examples=20_000)
        return KScalingConfig(ks=paper_ks, seeds=seeds, num_examples=50_000)
    if preset == "cpu":
        return KScalingConfig(
            ks=(2, 8, 32, 100, 316, 1000),
            seeds=seeds,
            num_examples=3000,
            batch_size=300,
            reference_steps=1000,
            trained=TrainedProxyConfig(),
        )
    paper = KScalingConfig(
        ks=paper_ks,
        seeds=seeds,
        num_examples=50_000,
        max_steps=2000,
        trained=TrainedProxyConfig(
            data="imagenet_cifar100",
            public_holdout=10_000,
            image_size=224,
            model=ModelSpec(kind="resnet", resnet=ResNetConfig.resnet50()),
            train=TrainConfig(
                steps=20_000,
                batch_size=256,
                learning_rate=1e-3,
                log_every=500,
                checkpoint_every=2000,
            ),
            eval_batch_size=512,
        ),
    )
    return smoke(paper) if smoke_test else paper
