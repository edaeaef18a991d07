"""The settings of a training run (`TrainConfig`) and the optimizer they name.

`TrainConfig` holds only public settings: the data set's size, keys and batches live elsewhere.
A private run's DP-SGD settings (`dp_sgd_config`) drive its sampler, noise and accountant
together (`privacy.plan`).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import optax

from dpmix_jax.privacy import accounting, validation
from dpmix_jax.privacy.adaptive_clipping import AdaptiveClipping
from dpmix_jax.privacy.plan import DpSgdConfig, Noise

Optimizer = Literal["sgd", "momentum", "adam", "adamw"]
Level = Literal["example", "user"]
Clipping = Literal["auto", "ghost", "vmap"]


def _check_interval(value: int | None, name: str) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be None or an integer >= 1, got {value!r}.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Public settings of a training run. Data-dependent values (data set size, keys) are not here.

    Attributes:
        steps: number of optimizer steps T.
        batch_size: public runs: rows per step; private runs: the *expected* batch size b of
            Poisson sampling (q = b / n).
        learning_rate: optimizer step size.
        optimizer: "sgd", "momentum", "adam" or "adamw".
        momentum: for "momentum" (and beta1 is left at optax's default for Adam).
        weight_decay: for "adamw".
        private: DP-SGD (True) or ordinary training (False).
        level: "example" or "user" (private runs only).
        clip_norm: C (required for private runs, rejected for public ones).
        epsilon: target ε; or give `noise_multiplier` instead.
        delta: target δ (private runs), below 1/n for n units unless `allow_large_delta`.
        allow_large_delta: accept δ >= 1/n (see `privacy.DpSgdConfig`).
        noise_multiplier: a fixed σ (ε is then computed by the accountant).
        accountant: "pld" (default) or "rdp".
        max_examples_per_user: G, examples per sampled user (user level).
        pad_multiple: Poisson batches are padded to a multiple of this (few jit shapes).
        chunk_size: gradient accumulation: units per jitted call; the padded batch is cut into
            chunks of this size whose clipped sums are added before the single noise draw.
            None: the whole padded batch, clipped sum, noise and update in one jitted call
            (compiled once per padded size).
        microbatch_size: vmap path: units per vmap inside one call (`lax.scan` over
            microbatches; memory only, the result is the same); must divide `chunk_size` (or
            `pad_multiple`). The ghost path keeps no per-example copy of the model's gradient
            and does not use it (`chunk_size` bounds its memory).
        adaptive_clipping: private runs: `privacy.adaptive_clipping.AdaptiveClipping` settings
            to let the clip norm follow a quantile of the units' norms (`clip_norm` is then the
            initial C_0; C_t lives in the optimizer state; independent noise only). The ε is
            that of `noise_multiplier`.
        clipping: how per-unit clipped gradient sums are computed (the same sum either way):
            "ghost" (ghost norms and book-keeping, one backward pass: `privacy.ghost`), "vmap"
            (per-unit gradients with `jax.vmap`), or "auto": ghost when every trainable
            parameter lives in a layer the ghost tape supports (`train.ghost_models`), else vmap.
        noise: private runs: "independent" (DP-SGD, default) or "bandmf" (correlated noise of
            `bands` bands with cyclic Poisson sampling; see `privacy.DpSgdConfig`). BandMF's
            noise state holds bands - 1 float32 copies of the trainable parameters.
        bands: b for noise="bandmf" (1 <= b <= steps; b = 1 is DP-SGD).
        log_every, eval_every, checkpoint_every: intervals in steps (None: never; the last step
            is always checkpointed when a checkpointer is given).
        progress: show a tqdm progress bar.
    """

    steps: int
    batch_size: int
    learning_rate: float
    optimizer: Optimizer = "adam"
    momentum: float = 0.9
    weight_decay: float = 0.0
    private: bool = False
    level: Level = "example"
    clip_norm: float | None = None
    epsilon: float | None = None
    delta: float | None = None
    allow_large_delta: bool = False
    noise_multiplier: float | None = None
    accountant: accounting.Accountant = "pld"
    max_examples_per_user: int | None = None
    pad_multiple: int = 32
    chunk_size: int | None = None
    microbatch_size: int | None = None
    clipping: Clipping = "auto"
    noise: Noise = "independent"
    bands: int | None = None
    adaptive_clipping: AdaptiveClipping | None = None
    log_every: int | None = 100
    eval_every: int | None = None
    checkpoint_every: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        validation.check_steps(self.steps)
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {self.batch_size!r}.")
        validation.check_positive(self.learning_rate, "learning_rate")
        if self.optimizer not in ("sgd", "momentum", "adam", "adamw"):
            raise ValueError(
                f"optimizer must be 'sgd', 'momentum', 'adam' or 'adamw', got {self.optimizer!r}."
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum!r}.")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}.")
        if self.level not in ("example", "user"):
            raise ValueError(f"level must be 'example' or 'user', got {self.level!r}.")
        if self.clipping not in ("auto", "ghost", "vmap"):
            raise ValueError(f"clipping must be 'auto', 'ghost' or 'vmap', got {self.clipping!r}.")
        if self.clipping == "ghost" and self.microbatch_size is not None:
            raise ValueError("microbatch_size applies to the vmap path; remove it or use 'vmap'.")
        for name in ("pad_multiple", "chunk_size", "microbatch_size"):
            _check_interval(getattr(self, name), name)
        for name in ("log_every", "eval_every", "checkpoint_every"):
            _check_interval(getattr(self, name), name)
        unit = self.chunk_size or self.pad_multiple
        if self.microbatch_size is not None and unit % self.microbatch_size:
            raise ValueError(
                f"microbatch_size {self.microbatch_size} must divide the chunk of {unit} units "
                "(chunk_size, or pad_multiple without chunking)."
            )
        if self.adaptive_clipping is not None and not isinstance(
            self.adaptive_clipping, AdaptiveClipping
        ):
            raise ValueError(
                f"adaptive_clipping must be None or an AdaptiveClipping, got "
                f"{self.adaptive_clipping!r}."
            )
        if self.adaptive_clipping is not None and self.noise == "bandmf":
            raise ValueError(
                "adaptive_clipping runs with independent noise; use noise='independent' or no "
                "adaptive_clipping."
            )
        if self.private:
            if self.clip_norm is None or self.delta is None:
                raise ValueError("a private run needs clip_norm and delta.")
            self.dp_sgd_config()  # validates ε/σ, δ, C, G together
        else:
            dp_fields = ("clip_norm", "epsilon", "delta", "noise_multiplier", "adaptive_clipping")
            given = [f for f in dp_fields if getattr(self, f) is not None]
            given += ["bands"] * (self.bands is not None)
            given += ["noise"] * (self.noise != "independent")
            if given or self.level != "example" or self.max_examples_per_user is not None:
                raise ValueError(
                    f"privacy settings {given or ['level/max_examples_per_user']} given for a "
                    "public run; set private=True or remove them."
                )

    def dp_sgd_config(self) -> DpSgdConfig:
        """The privacy core's config: the one object that drives sampler, σ and accountant."""
        if self.level == "user" and self.max_examples_per_user is None:
            raise ValueError("a user-level run needs max_examples_per_user (G).")
        if self.level == "example" and self.max_examples_per_user is not None:
            raise ValueError("max_examples_per_user is for user-level runs (level='user').")
        return DpSgdConfig(
            epsilon=self.epsilon,
            delta=self.delta,
            clip_norm=self.clip_norm,
            batch_size=self.batch_size,
            steps=self.steps,
            noise_multiplier=self.noise_multiplier,
            accountant=self.accountant,
            max_examples_per_user=self.max_examples_per_user,
            pad_multiple=self.pad_multiple,
            allow_large_delta=self.allow_large_delta,
            noise=self.noise,
            bands=self.bands,
        )


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
    """The optax optimizer named by `config` (applied to the mean or noisy-mean gradient)."""
    lr = config.learning_rate
    if config.optimizer == "sgd":
        return optax.sgd(lr)
    if config.optimizer == "momentum":
        return optax.sgd(lr, momentum=config.momentum)
    if config.optimizer == "adam":
        return optax.adam(lr)
    return optax.adamw(lr, weight_decay=config.weight_decay)
