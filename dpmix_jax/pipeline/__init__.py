"""DP-MixMin end to end: split, proxies, private mixture, pretraining on λ, DP fine-tuning,
evaluation, budgets; baselines through the same stages; comparisons and reports."""

from dpmix_jax.pipeline import compare, image, presets, text, text_presets
from dpmix_jax.pipeline.budget import end_to_end_budget
from dpmix_jax.pipeline.compare import run_comparison
from dpmix_jax.pipeline.image import ImagePipeline, ImagePipelineConfig, ModelSpec, SharedInputTask
from dpmix_jax.pipeline.mixture_config import MixtureConfig
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline
from dpmix_jax.pipeline.results import METHODS, RunResult
from dpmix_jax.pipeline.text import DomainTextTask, TextPipeline, TextPipelineConfig

__all__ = [
    "METHODS",
    "DomainTextTask",
    "ImagePipeline",
    "ImagePipelineConfig",
    "MixtureConfig",
    "MixturePipeline",
    "ModelSpec",
    "RunResult",
    "SharedInputTask",
    "TextPipeline",
    "TextPipelineConfig",
    "compare",
    "end_to_end_budget",
    "image",
    "presets",
    "run_comparison",
    "text",
    "text_presets",
]
