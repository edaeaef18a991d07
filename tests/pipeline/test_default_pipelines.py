"""The embedded defaults' pipelines: the config's type picks the default, the seed its draw."""

import numpy as np
import pytest

from dpmix_jax.pipeline import ImagePipeline, TextPipeline, presets, text_presets
from dpmix_jax.pipeline.default_pipelines import default_pipeline


def test_an_image_config_gives_the_digits_default(tmp_path):
    config = presets.image_demo_config()
    pipeline = default_pipeline(config, tmp_path, reproducible=True)
    assert isinstance(pipeline, ImagePipeline) and pipeline.config == config
    assert pipeline.task.name == presets.digit_task().name
    np.testing.assert_array_equal(pipeline.task.true_weights, presets.digit_task().true_weights)
    other = default_pipeline(config, tmp_path / "other", seed=100)
    expected = presets.digit_task(seed=100).true_weights
    np.testing.assert_array_equal(other.task.true_weights, expected)
    assert not np.array_equal(other.task.true_weights, pipeline.task.true_weights)


def test_a_text_config_gives_the_text_default_at_its_level(tmp_path):
    config = text_presets.text_demo_config()
    pipeline = default_pipeline(config, tmp_path, seed=3)
    assert isinstance(pipeline, TextPipeline)
    expected = text_presets.text_task(seed=3, level=config.level)
    assert pipeline.task.name == expected.name
    np.testing.assert_array_equal(pipeline.task.true_weights, expected.true_weights)
    reported = default_pipeline(config, tmp_path / "reported").task.true_weights
    assert not np.array_equal(pipeline.task.true_weights, reported)


def test_another_config_is_refused(tmp_path):
    with pytest.raises(TypeError, match="ImagePipelineConfig or a TextPipelineConfig"):
        default_pipeline(object(), tmp_path)
