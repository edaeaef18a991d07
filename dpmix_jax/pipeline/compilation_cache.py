"""JAX's persistent compilation cache for pipeline runs (`use_compilation_cache`)."""

from __future__ import annotations

import os
import pathlib

import jax

from dpmix_jax.pipeline.folders import private_folder


def use_compilation_cache(directory: str | os.PathLike) -> None:
    """Points JAX's persistent compilation cache (a process-wide setting) at `directory`, unless
    one is configured already: pipeline runs whose training steps share shapes and σ then compile
    once across runs and across reruns.

    Privacy: a compiled program may hold constants of the computation it was compiled for, so
    the folder is owner-only (0700), like the stage store.
    """
    if jax.config.jax_compilation_cache_dir is None:
        folder = private_folder(pathlib.Path(directory).absolute())
        jax.config.update("jax_compilation_cache_dir", str(folder))
