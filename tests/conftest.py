"""Test settings shared by the whole suite: offline hubs, deterministic float32 CPU runs."""

import gc
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# Scripts run in their own processes with simulated devices; importing them (doctest collection)
# would set XLA_FLAGS for the whole test session.
collect_ignore = ["parallel_check.py", "multiprocess_check.py"]


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_state_per_module():
    """Each test module starts without the compiled programs of the ones before it and without a
    persistent compilation cache that one of them (or a command it ran) switched on: the suite's
    memory stays that of its largest module, not of all of them together."""
    yield
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir is not None:
        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()
    jax.clear_caches()
    gc.collect()
