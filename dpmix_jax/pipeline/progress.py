"""What a progress display hears from a pipeline run (`ProgressListener`)."""

from __future__ import annotations

from typing import Protocol


class ProgressListener(Protocol):
    """What a progress display hears from a pipeline (see `MixturePipeline.add_listener`)."""

    def stage(self, name: str) -> None:
        """A stage (split, proxy, mixture, pretrain, finetune, ...) starts computing."""

    def step(self, done: int, total: int) -> None:
        """A training step of the current stage finished."""

    def reused(self, name: str) -> None:
        """A finished run was read back from the stage store instead of computed."""
