"""OpenWebMath with Common Pile domains as public data, example-level DP (paper §5.2, Table 2).

Commands:
    python -m experiments.openwebmath --preset cpu --out runs/openwebmath_cpu
    python -m experiments.openwebmath --preset paper --data-root DATA --weights-root WEIGHTS \
        --out DIR

Paper numbers to compare with (test perplexity, lower is better, δ = 1e-5, 3 seeds, ρ = 0.1):
    ε = 1: DP-MixMin 12.22 ± 0.17, Uniform 14.05 ± 0.17 (about 13% lower);
    Uniform barely moves with ε: 14.04 ± 0.17 (ε = 2), 14.02 ± 0.17 (ε = 5).
    λ cosine to non-private MixMin (ρ = 0.1, 2.8M tokens): 0.92 ± 0.02 at ε = 0.2, 1.00 at ε = 1.
The paper compares DP-MixMin with Uniform only, at ε = 1.

The `paper` preset reads, under DATA: `openwebmath/` (`.parquet` or `.jsonl[.gz]` files with a
`text` field; the first 50,000 documents are used) and `common_pile/<domain>/` (16 domains);
under WEIGHTS: `gpt2` (GPT-2 small, the start of every proxy). Nothing is downloaded: missing
inputs stop the run with a message naming every missing path. Every document is one unit
(example level): the mixture stage samples documents, and fine-tuning uses one row per document
(its first 1024 tokens). Paper settings: mixture 200 steps, η = 5.0, clip 0.2, ρ = 0.1; a 50M-token
fine-tuning budget (here 50 steps of an expected 1,000 documents x 1024 tokens). Not reported and
chosen here: the document split (80/10/10), the mixture's expected batch (1,000 documents), the
optimisers, learning rates and the fine-tuning clip norm (1.0).

`--smoke` (with `--preset paper`) proves the paper path end to end on a small folder in the same
layout (`configs.enron.smoke`): the parquet/jsonl readers, GPT-2's tokenizer, the GPT-2 small
proxies from WEIGHTS/gpt2, GPT-2 medium downstream, 1024-token rows, k = all domain folders,
DP-MixMin and Uniform, but 1-2 steps of one or two documents per stage, ε = 1, one seed, the
first 60 documents and 4 per public domain:
    python -m experiments.openwebmath --preset paper --smoke --data-root DIR --weights-root DIR \
        --out DIR
Its perplexities mean nothing (one step); it checks that every stage runs and writes results.md.

The `cpu` preset runs the same code on the embedded text default with every document its own
unit (`text_task(level="example")`), ρ = 0.3, ε in {1, 2, 5}, 3 seeds: 7 minutes and 1.6 GB
peak memory on 2 loaded CPU cores. Its stored run (docs/results/openwebmath.json): DP-MixMin
67.76 / 67.80 / 68.15, Uniform 73.38 / 73.09 / 72.77, non-private MixMin 63.18 / 62.99 / 62.68
at ε = 1 / 2 / 5.
"""

from __future__ import annotations

import dataclasses
import pathlib

from dpmix_jax.pipeline import MixtureConfig
from dpmix_jax.pipeline.text_presets import text_demo_config
from dpmix_jax.train import TrainConfig
from experiments.configs.enron import TextExperimentConfig, paper_pipeline, smoke

PRESETS = {
    "cpu": "the embedded text default, example level, ρ = 0.3 (offline)",
    "paper": "the paper's data and models",
}


def get_config(
    preset: str = "cpu",
    *,
    data_root: str | pathlib.Path = "data",
    weights_root: str | pathlib.Path = "weights",
    smoke_test: bool = False,
) -> TextExperimentConfig:
    """`preset="paper"`: the paper's experiment on the real data under `data_root` and
    `weights_root` (`smoke_test=True`: its smoke test, `configs.enron.smoke`); `preset="cpu"`:
    the same code on the embedded default, example level."""
    if smoke_test and preset != "paper":
        raise ValueError(f"the smoke test applies to the paper preset, not {preset!r}.")
    if preset == "cpu":
        return TextExperimentConfig(
            data="builtin",
            pipeline=text_demo_config(level="example"),
            methods=("dp_mixmin", "uniform", "nonprivate_mixmin"),
        )
    if preset == "paper":
        data_root = pathlib.Path(data_root)
        enron = paper_pipeline(weights_root)
        pipeline = dataclasses.replace(
            enron,
            level="example",
            mix_fraction=0.1,
            mixture=MixtureConfig(steps=200, batch_size=1000, clip_norm=0.2, learning_rate=5.0),
            finetune=TrainConfig(
                steps=50,
                batch_size=1000,
                learning_rate=1e-4,
                private=True,
                clip_norm=1.0,
                epsilon=1.0,
                delta=1e-5,
                chunk_size=64,
                microbatch_size=8,
                log_every=1,
            ),
        )
        config = TextExperimentConfig(
            data="openwebmath",
            pipeline=pipeline,
            mix_fractions=(0.1,),
            epsilons=(1.0,),
            methods=("dp_mixmin", "uniform"),
            documents_path=str(data_root / "openwebmath"),
            public_root=str(data_root / "common_pile"),
            max_documents=50_000,
        )
        return smoke(config, mix_fraction=0.1) if smoke_test else config
    raise ValueError(f"preset must be 'cpu' or 'paper', got {preset!r}.")
