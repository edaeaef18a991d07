"""NIH ChestX-ray14 with CheXpert or MIMIC-CXR as public data (paper §5.1, Tables 7 and 8).

Commands:
    python -m experiments.nih_chexpert --preset cpu --out runs/nih_chexpert_cpu
    python -m experiments.nih_mimic    --preset cpu --out runs/nih_mimic_cpu
    python -m experiments.nih_chexpert --preset paper --nih-root DIR --public-root DIR --out DIR
    python -m experiments.nih_mimic    --preset paper --nih-root DIR --public-root DIR --out DIR

Paper numbers to compare with (macro AUC over the 14 NIH tasks, δ = 1e-5, ρ = 0.1):
    CheXpert -> NIH   ε = 1: DP-MixMin 0.707, Uniform 0.670, Random Search 0.667, Random Init 0.636
                      ε = 5: 0.729, 0.701, 0.698, 0.675   (ε = 2: 0.719, 0.687, 0.684)
    MIMIC-CXR -> NIH  ε = 1: 0.712, 0.679, 0.670, 0.636;  ε = 5: 0.730, 0.706, 0.703, 0.675
    Non-private MixMin (upper bound) at ε = 1: 0.712 (CheXpert), 0.723 (MIMIC-CXR).
    λ cosine to non-private MixMin at ε = 1: 0.97 ± 0.01 (CheXpert), 0.93 ± 0.04 (MIMIC-CXR).

The `paper` preset needs the real data sets in their published layouts (NIH: Data_Entry_2017.csv,
images*/, train_val_list.txt, test_list.txt; CheXpert-v1.0: train.csv, with --public-root the
folder holding it, under any name; MIMIC-CXR-JPG: mimic-cxr-2.0.0-chexpert.csv.gz,
-metadata.csv.gz, -split.csv.gz (or unpacked .csv), files/) and an accelerator (ResNet-50 proxy,
ResNet-18 downstream at 224x224, 36,000 fine-tuning steps). It stops with a message naming the
missing file when the data is absent.

`--smoke` (with `--preset paper`) proves the paper path end to end in minutes on a CPU: the
paper's data layouts and loaders, models (ResNet-50 proxy, ResNet-18 downstream), 224x224
images, k = 14 public label sources, ρ, δ, clip norms, learning rates and all five methods, but
1-2 steps of batch 2 per stage (the mixture's expected batch: 1), one seed, ε = 1, one finding
(Effusion) and two random-search candidates; it reads every image it is given, so point it at a
small folder:
    python -m experiments.nih_chexpert --preset paper --smoke --nih-root DIR --public-root DIR \
        --out DIR
Its AUCs measure nothing (one step); it checks that every stage runs and writes results.md.

Privacy unit: by default each (ε, δ) protects one image, the paper's unit; a NIH patient has 3.6
images on average, so it does not protect a patient. `--privacy-unit patient` (paper preset only:
it needs NIH's patient ids) makes both private stages user level over patients: DP-MixMin and
DP-SGD Poisson-sample patients and clip the mean gradient of up to `--max-images-per-patient` G
of a sampled patient's images (default 4), δ is checked against the number of patients, and every
output says which unit its ε is for ("per image", "per patient (user-level, up to G images)"):
    python -m experiments.nih_chexpert --preset paper --privacy-unit patient \
        --max-images-per-patient 4 --nih-root DIR --public-root DIR --out DIR
The expected batch sizes then count patients, not images. `experiments/patient_level.py`
measures the utility cost of the patient unit on the digits stand-in (`docs/patient-level.md`).

The `cpu` preset runs the same code on the embedded digits default (3 sensitive tasks, MLP, 2
seeds; 6 minutes and 1.4 GB peak memory on 2 loaded CPU cores), the same for both public data
sets. Its stored run (docs/results/nih_cpu.json): macro AUC DP-MixMin 0.829 / 0.834 / 0.833,
Uniform 0.757 / 0.771 / 0.779, Random Search 0.747 / 0.757 / 0.772, Random Init 0.623 / 0.650 /
0.674 at ε = 1 / 2 / 5.
"""

from __future__ import annotations

import dataclasses

from dpmix_jax.models.resnet import ResNetConfig
from dpmix_jax.pipeline import ImagePipelineConfig, MixtureConfig, ModelSpec, presets
from dpmix_jax.train import TrainConfig

PAPER_IMAGE_SIZE = 224  # the side of the paper's square X-ray images
PRESETS = {
    "cpu": "digit tasks standing in for the X-ray findings (offline)",
    "paper": "the real data under --nih-root and --public-root",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CxrExperimentConfig:
    """One NIH experiment: the data, the pipeline settings and the grid.

    Attributes:
        public: "chexpert" or "mimic" (the public label sources), or "digits" for the cpu preset.
        pipeline: the per-task pipeline settings.
        epsilons, seeds, methods: the grid.
        tasks: NIH findings to run (None: all 14); for digits, the number of tasks.
        image_size: images are resized to this square size.
    """

    public: str
    pipeline: ImagePipelineConfig
    epsilons: tuple[float, ...] = (1.0, 2.0, 5.0)
    seeds: tuple[int, ...] = (0, 1, 2)
    methods: tuple[str, ...] = (
        "dp_mixmin",
        "uniform",
        "random_init",
        "random_search",
        "nonprivate_mixmin",
    )
    tasks: tuple[str, ...] | int | None = None
    image_size: int = PAPER_IMAGE_SIZE

    def __post_init__(self) -> None:
        if self.public not in ("chexpert", "mimic", "digits"):
            raise ValueError(
                f"public must be 'chexpert', 'mimic' or 'digits', got {self.public!r}."
            )


def paper_pipeline() -> ImagePipelineConfig:
    """The paper's settings: ResNet-50 proxy, ResNet-18 downstream, mixture batch 1000 and clip
    13.0, fine-tuning 36,000 steps at lr 1e-4 and clip 2.0, ρ = 0.1, δ = 1e-5."""
    resnet = lambda config: ModelSpec(kind="resnet", resnet=config)
    return ImagePipelineConfig(
        delta=1e-5,
        mix_fraction=0.1,
        model=resnet(ResNetConfig.resnet18()),
        proxy_model=resnet(ResNetConfig.resnet50()),
        proxy=TrainConfig(steps=20_000, batch_size=256, learning_rate=1e-3, log_every=200),
        mixture=MixtureConfig(steps=200, batch_size=1000, clip_norm=13.0, learning_rate=1.0),
        pretrain=TrainConfig(steps=20_000, batch_size=256, learning_rate=1e-3, log_every=200),
        finetune=TrainConfig(
            steps=36_000,
            batch_size=1000,
            learning_rate=1e-4,
            private=True,
            clip_norm=2.0,
            epsilon=1.0,
            delta=1e-5,
            chunk_size=256,
            microbatch_size=64,
            log_every=500,
            checkpoint_every=1000,
        ),
        random_search_candidates=5,
    )


def smoke_pipeline() -> ImagePipelineConfig:
    """`paper_pipeline()` with 1-2 steps of batch 2 in every stage (models, clip norms, learning
    rates, ρ and δ unchanged): a test that the paper's path runs, not a result."""
    paper = paper_pipeline()
    short = dict(steps=1, batch_size=2, log_every=1, progress=False)
    return dataclasses.replace(
        paper,
        proxy=dataclasses.replace(paper.proxy, **short),
        mixture=dataclasses.replace(paper.mixture, steps=2, batch_size=1),
        pretrain=dataclasses.replace(paper.pretrain, **short),
        finetune=dataclasses.replace(
            paper.finetune,
            **short,
            pad_multiple=2,
            chunk_size=None,
            microbatch_size=None,
            checkpoint_every=None,
        ),
        random_search_candidates=2,
        eval_batch_size=8,
    )


def get_config(
    public: str = "chexpert", preset: str = "cpu", *, smoke: bool = False
) -> CxrExperimentConfig:
    """`preset="paper"`: the paper's experiment (`smoke=True`: its smoke test, see above);
    `preset="cpu"`: the same code on digits."""
    if public not in ("chexpert", "mimic"):
        raise ValueError(f"public must be 'chexpert' or 'mimic', got {public!r}.")
    if smoke and preset != "paper":
        raise ValueError(f"smoke applies to the paper preset, not {preset!r}.")
    if preset == "paper" and smoke:
        return CxrExperimentConfig(
            public=public,
            pipeline=smoke_pipeline(),
            epsilons=(1.0,),
            seeds=(0,),
            tasks=("Effusion",),
        )
    if preset == "paper":
        return CxrExperimentConfig(public=public, pipeline=paper_pipeline())
    if preset == "cpu":
        return CxrExperimentConfig(
            public="digits",
            pipeline=presets.image_demo_config(),
            seeds=(0, 1),
            tasks=3,
            image_size=16,
        )
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
