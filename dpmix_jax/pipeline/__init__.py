"""DP-MixMin end to end: split, proxies, private mixture, pretraining on λ, DP fine-tuning,
evaluation, budgets; baselines through the same stages; comparisons and reports."""

from dpmix_jax.pipeline import common, compare, image, presets
from dpmix_jax.pipeline.common import METHODS, MixtureConfig, RunResult, end_to_end_budget
from dpmix_jax.pipeline.compare import run_comparison
from dpmix_jax.pipeline.image import ImagePipeline, ImagePipelineConfig, ModelSpec, SharedInputTask

__all__ = [
    "METHODS",
    "ImagePipeline",
    "ImagePipelineConfig",
    "MixtureConfig",
    "ModelSpec",
    "RunResult",
    "SharedInputTask",
    "common",
    "compare",
    "end_to_end_budget",
    "image",
    "presets",
    "run_comparison",
]
