"""Training: the public/private engine, losses, pretraining on λ, proxies, evaluation,
checkpoints. Composes `privacy` with models (NNX) and data (through `gather` callables)."""

from dpmix_jax.train import checkpoint, config, engine, evaluate, losses, pretrain, proxies
from dpmix_jax.train.checkpoint import Checkpointer
from dpmix_jax.train.config import TrainConfig
from dpmix_jax.train.engine import FitResult, IndexedData, MetricLogger, Trainer, TrainState, fit

__all__ = [
    "Checkpointer",
    "FitResult",
    "IndexedData",
    "MetricLogger",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "checkpoint",
    "config",
    "engine",
    "evaluate",
    "fit",
    "losses",
    "pretrain",
    "proxies",
]
