"""The embedded text demo: a `DomainTextTask` on the built-in domains and CPU-sized settings (the
paper-scale Enron and OpenWebMath presets live in `experiments/configs/`)."""

from __future__ import annotations

from dpmix_jax.data import builtin
from dpmix_jax.models.gpt2 import GPT2Config
from dpmix_jax.pipeline import common
from dpmix_jax.pipeline.text import (
    DomainTextTask,
    LanguageModelSpec,
    TextPipelineConfig,
    from_builtin,
)
from dpmix_jax.train import TrainConfig


def text_task(
    *,
    seed: int = 0,
    num_users: int = 60,
    documents_per_user: tuple[int, int] = (3, 8),
    max_chars: int = 800,
) -> DomainTextTask:
    """The embedded text default (7 public domains: five BBC topics, Python code, Python docs;
    e-mail users whose documents follow a recorded sparse population mixture) as a pipeline task.

    Users are split 60/20/20 into train, val and test (by `seed`); `true_weights` is the
    population mixture the users' mixtures were drawn around.
    """
    task = builtin.load_text_mixture_task(
        seed=seed,
        num_users=num_users,
        documents_per_user=documents_per_user,
        holdout_fraction=0.4,
        max_chars=max_chars,
    )
    return from_builtin(task, seed=seed)


def text_demo_config(**overrides) -> TextPipelineConfig:
    """Settings of the text demo on `text_task()` (2 CPU cores, minutes): GPT-2 with 2 layers,
    64 wide, a 512-token BPE trained on the public domains, 64-token rows, user-level DP."""
    quiet = {"progress": False, "log_every": None}
    tiny = LanguageModelSpec(config=GPT2Config.tiny(n_positions=64))
    settings = dict(
        delta=1e-5,
        level="user",
        mix_fraction=0.3,
        tokenizer="bpe",
        vocab_size=512,
        proxy_model=tiny,
        model=tiny,
        proxy=TrainConfig(steps=150, batch_size=16, learning_rate=3e-3, **quiet),
        mixture=common.MixtureConfig(
            steps=200,
            batch_size=4,
            clip_norm=0.05,
            learning_rate=5.0,
            max_examples_per_user=8,
        ),
        pretrain=TrainConfig(steps=200, batch_size=16, learning_rate=3e-3, **quiet),
        finetune=TrainConfig(
            steps=20,
            batch_size=8,
            learning_rate=1e-3,
            private=True,
            level="user",
            max_examples_per_user=8,
            clip_norm=1.0,
            epsilon=1.0,
            delta=1e-5,
            pad_multiple=16,
            **quiet,
        ),
        finetune_last_blocks=1,
        random_search_candidates=2,
        eval_batch_size=64,
    )
    settings.update(overrides)
    return TextPipelineConfig(**settings)
