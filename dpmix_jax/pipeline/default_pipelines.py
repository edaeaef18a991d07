"""The pipeline of an embedded default, image or text, on any draw of its data.

The image default is `presets.digit_task` (MNIST-5k, 12 label sources) and the text default is
`text_presets.text_task` (public domains, synthetic e-mail users); `seed` draws another split,
mixture and labels (or users) from the same generator, so that settings can be chosen on draws
other than the reported one.
"""

from __future__ import annotations

import os

from dpmix_jax.pipeline import presets, text_presets
from dpmix_jax.pipeline.image import ImagePipeline, ImagePipelineConfig
from dpmix_jax.pipeline.mixture_pipeline import MixturePipeline
from dpmix_jax.pipeline.text import TextPipeline, TextPipelineConfig


def default_pipeline(
    config: ImagePipelineConfig | TextPipelineConfig,
    root: str | os.PathLike,
    *,
    seed: int = 0,
    reproducible: bool = False,
) -> MixturePipeline:
    """The image default's pipeline for an `ImagePipelineConfig`, the text default's (at the
    config's privacy level) for a `TextPipelineConfig`.

    Args:
        config: the pipeline settings; their type chooses the default.
        root: the folder of the pipeline's stored stages.
        seed: the data seed of the default's generator (0: the reported draw).
        reproducible: seed the private randomness with the run seeds.
    """
    if isinstance(config, ImagePipelineConfig):
        task = presets.digit_task(seed=seed)
        return ImagePipeline(task, config, root, reproducible=reproducible)
    if isinstance(config, TextPipelineConfig):
        task = text_presets.text_task(seed=seed, level=config.level)
        return TextPipeline(task, config, root, reproducible=reproducible)
    raise TypeError(
        f"config must be an ImagePipelineConfig or a TextPipelineConfig, got {type(config)}."
    )
