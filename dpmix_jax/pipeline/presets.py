"""Ready-made tasks and settings: the embedded CPU demos (the paper-scale presets live in
`experiments/configs/`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dpmix_jax.data import builtin
from dpmix_jax.pipeline.image import ImagePipelineConfig, ModelSpec, SharedInputTask
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.train import TrainConfig


def digit_tasks(
    *,
    seed: int = 0,
    image_size: int = 16,
    num_tasks: int = 1,
    prevalence_scales: Sequence[float] | None = None,
    num_active_sources: int = 3,
) -> list[SharedInputTask]:
    """The embedded image default (MNIST-5k, 12 overlapping label rules) as pipeline tasks.

    Sensitive task t is labelled Bernoulli(s_t Σ_i λ*_ti y_i(x)) for a recorded sparse λ*_t (data
    seed `seed`, `num_active_sources` non-zero weights) and prevalence scale s_t
    (`prevalence_scales`, default 1); each task's `true_weights` is its λ*_t.
    """
    task = builtin.load_digit_mixture_task(
        seed=seed,
        image_size=image_size,
        num_tasks=num_tasks,
        prevalence_scales=prevalence_scales,
        num_active_sources=num_active_sources,
    )
    return [
        SharedInputTask(
            name=f"digits (MNIST-5k, 12 label sources), task {t}",
            public=task.public_source(),
            source_names=tuple(task.source_names),
            train=task.sensitive["train"].source(),
            val=task.sensitive["val"].source(),
            test=task.sensitive["test"].source(),
            task_index=t,
            true_weights=task.true_weights[t],
        )
        for t in range(num_tasks)
    ]


def digit_task(*, seed: int = 0, image_size: int = 16) -> SharedInputTask:
    """The single-task image default of `dpmix demo` (see `digit_tasks`)."""
    (task,) = digit_tasks(seed=seed, image_size=image_size)
    return dataclasses.replace(task, name="digits (MNIST-5k, 12 label sources)")


def image_demo_config(**overrides) -> ImagePipelineConfig:
    """Settings of `dpmix demo` on the digits default (2 CPU cores, minutes)."""
    quiet = {"progress": False, "log_every": None}
    settings = dict(
        delta=1e-5,
        mix_fraction=0.3,
        model=ModelSpec(kind="mlp", mlp_hidden=(64,)),
        proxy=TrainConfig(steps=300, batch_size=128, learning_rate=3e-3, **quiet),
        mixture=MixtureConfig(steps=100, batch_size=120, clip_norm=5.0, learning_rate=0.4),
        pretrain=TrainConfig(steps=300, batch_size=128, learning_rate=3e-3, **quiet),
        finetune=TrainConfig(
            steps=60,
            batch_size=128,
            learning_rate=1e-3,
            private=True,
            clip_norm=1.0,
            epsilon=1.0,
            delta=1e-5,
            **quiet,
        ),
        random_search_candidates=4,
    )
    settings.update(overrides)
    return ImagePipelineConfig(**settings)


def wiring_check_config(steps: int = 3) -> ImagePipelineConfig:
    """`image_demo_config` with `steps` steps in every stage (proxies, mixture, pretraining,
    fine-tuning): the experiments' "tiny" presets, which check the wiring in about a minute."""
    demo = image_demo_config()
    short = {
        name: dataclasses.replace(getattr(demo, name), steps=steps)
        for name in ("proxy", "pretrain", "finetune")
    }
    mixture = dataclasses.replace(demo.mixture, steps=steps, nonprivate_steps=steps)
    return dataclasses.replace(demo, mixture=mixture, **short)
