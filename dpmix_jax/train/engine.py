"""The training engine: one loop for public and private (DP-SGD) training of NNX models.

The model is split once at the boundary (`split_model`): its `nnx.Param` leaves become two flat
dicts, the *trainable* parameters (differentiated, updated, noised) and the *frozen* ones (never
differentiated, bit-identical after training), plus the remaining non-parameter state. Every step
is a jitted pure function of these pytrees; `nnx.merge` rebuilds the model inside the loss.

Private steps follow the privacy contract: a Poisson batch (example or user level) drawn by the
sampler of the run's `DpSgdPlan`, padded with a mask; the padded batch is cut into chunks of
`chunk_size` units whose clipped gradient *sums* are accumulated (gradient accumulation keeps the
sum semantics); noise is added once and the sum divided once by the public expected batch size
(`privacy.noise.private_optimizer`); the ledger records the plan's event after every executed
step (after every cycle's first step for BandMF's correlated noise, whose batches come from
cyclic Poisson sampling). Public steps use the ordinary mean gradient over a fixed-size batch.

API:
    TrainConfig(...)                                        the run's settings (`train.config`)
    split_model(model, trainable_mask=None) -> (ModelSplit, trainable, frozen, rest)
    check_no_batchnorm(model)
    IndexedData(gather, num_examples, user_ids=None)      data seen through `gather(indices)`
    TrainState(step, params, opt_state)                     the pytree that is checkpointed
    Trainer(config, model, loss_fn, *, trainable_mask=None, num_units=None, noise_key=None,
            mesh=None)                                      jitted steps for one model and loss
    Trainer.jitted_step(state)                              one whole jitted step (benchmarks)
    fit(trainer, data, *, rng=None, state=None, ledger=None, checkpointer=None, evaluate=None,
        logger=None, until=None, on_step=None) -> FitResult
    MetricLogger(path=None)                                 JSON-lines metrics (+ TensorBoard)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm
from flax import nnx

from dpmix_jax import interrupt, parallel
from dpmix_jax.privacy import (
    accounting,
    correlated_noise,
    cyclic_sampling,
    randomness,
    summation,
)
from dpmix_jax.privacy.adaptive_clipping import (
    adaptive_private_optimizer,
    centred_count,
    current_clip_norm,
)
from dpmix_jax.privacy.clipping import (
    ClippedGradSum,
    clipped_grad_sum,
    user_clipped_grad_sum,
)
from dpmix_jax.privacy.ghost import ghost_clipped_grad_sum, ghost_user_clipped_grad_sum
from dpmix_jax.privacy.noise import private_optimizer
from dpmix_jax.privacy.plan import DpSgdPlan, plan_dp_sgd
from dpmix_jax.privacy.sampling import PADDING_INDEX, group_by_user
from dpmix_jax.train import ghost_models
from dpmix_jax.train.config import TrainConfig, make_optimizer
from dpmix_jax.train.losses import Batch, LossFn

PyTree = Any
Gather = Callable[[np.ndarray], Batch]
BatchFn = Callable[[np.random.Generator], Batch]


# --------------------------------------------------------------------------------------------
# The NNX boundary.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class ModelSplit:
    """Static description of how a model's parameters split into trainable and frozen dicts."""

    graphdef: Any
    treedef: Any
    names: tuple[str, ...]
    trainable: tuple[bool, ...]

    def merge(self, params: Mapping[str, Any], frozen: Mapping[str, Any], rest: Any) -> nnx.Module:
        """The model with these parameter values (inside jit: a pure rebuild, no side effects)."""
        leaves = [
            params[n] if t else frozen[n] for n, t in zip(self.names, self.trainable, strict=True)
        ]
        return nnx.merge(self.graphdef, self.treedef.unflatten(leaves), rest)


def split_model(
    model: nnx.Module, trainable_mask: PyTree | None = None
) -> tuple[ModelSplit, dict[str, jax.Array], dict[str, jax.Array], Any]:
    """Splits `model` into `(split, trainable, frozen, rest)`.

    Args:
        model: an NNX module.
        trainable_mask: a bool pytree over the `nnx.Param` state (e.g.
            `models.gpt2.trainable_mask(model, last_n_blocks=2)`); None trains every parameter.

    Returns:
        The static `ModelSplit`, the trainable and frozen parameters as flat dicts keyed by
        parameter path, and the non-parameter state.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    names = tuple(jax.tree_util.keystr(path) for path, _ in flat)
    if trainable_mask is None:
        trainable = (True,) * len(flat)
    else:
        mask_leaves = jax.tree.leaves(trainable_mask)
        if len(mask_leaves) != len(flat):
            raise ValueError(
                f"trainable_mask has {len(mask_leaves)} leaves but the model has {len(flat)} "
                "parameters; build it from the model's nnx.Param state."
            )
        trainable = tuple(bool(m) for m in mask_leaves)
        if not any(trainable):
            raise ValueError("trainable_mask marks no parameter as trainable.")
    split = ModelSplit(graphdef, treedef, names, trainable)
    leaves = dict(zip(names, (leaf for _, leaf in flat), strict=True))
    train = {n: leaves[n] for n, t in zip(names, trainable, strict=True) if t}
    frozen = {n: leaves[n] for n, t in zip(names, trainable, strict=True) if not t}
    return split, train, frozen, rest


def check_no_batchnorm(model: nnx.Module) -> None:
    """Raises ValueError if `model` contains `nnx.BatchNorm` (not allowed in private training)."""
    for path, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            where = "/".join(str(p) for p in path) or "the model itself"
            raise ValueError(
                f"the model contains nnx.BatchNorm at {where}: per-example gradients (vmap) would "
                "silently turn it into per-example normalisation, and batch statistics mix "
                "examples. Use GroupNorm or LayerNorm for private training."
            )


# --------------------------------------------------------------------------------------------
# Data and state.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class IndexedData:
    """A data set seen only through `gather(indices) -> dict of numpy arrays`.

    `gather` takes a 1-D index vector in which -1 marks padding and returns zero-filled rows there
    (`dpmix_jax.data.Source.gather` has this contract). `user_ids` (one per example) is needed
    for user-level runs.
    """

    gather: Gather
    num_examples: int
    user_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_examples, int | np.integer) or self.num_examples < 1:
            raise ValueError(f"num_examples must be an integer >= 1, got {self.num_examples!r}.")
        if self.user_ids is not None and np.shape(self.user_ids) != (self.num_examples,):
            raise ValueError(
                f"user_ids must have shape ({self.num_examples},), got {np.shape(self.user_ids)}."
            )

    @functools.cached_property
    def users(self) -> list[np.ndarray]:
        """Example indices of each user (`privacy.sampling.group_by_user`)."""
        if self.user_ids is None:
            raise ValueError("user-level sampling needs IndexedData.user_ids.")
        return group_by_user(self.user_ids)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """What a step changes: the step count, the trainable parameters and the optimizer state.

    For private runs `opt_state` holds the secret noise key: a checkpoint of it is sensitive.
    """

    step: jax.Array
    params: dict[str, jax.Array]
    opt_state: PyTree


def check_live(state: TrainState) -> None:
    """Refuses a state that an earlier step consumed (its buffers donated to the state it
    returned), with one line saying what to pass instead."""
    if any(isinstance(x, jax.Array) and x.is_deleted() for x in jax.tree.leaves(state)):
        raise ValueError(
            "this TrainState was consumed by an earlier step: its buffers now belong to "
            "the state that step returned. Pass that state (fit returns it as "
            "FitResult.state), or trainer.init_state() to start again from the initial "
            "parameters."
        )


def _pad_rows(rows: np.ndarray, multiple: int) -> np.ndarray:
    extra = -rows.shape[0] % multiple
    if not extra:
        return rows
    pad = np.full((extra, *rows.shape[1:]), PADDING_INDEX, dtype=rows.dtype)
    return np.concatenate([rows, pad])


def _all_finite(tree: PyTree) -> jax.Array:
    """Whether every element of `tree` is finite: one bool scalar (traced inside the steps)."""
    return jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


@dataclasses.dataclass(frozen=True)
class _SumSteps:
    """The jitted pieces of a chunked clipped sum (see `Trainer._jit_sum_steps`)."""

    chunk_sum: Callable
    zeros: Callable
    rounded: Callable


@dataclasses.dataclass(frozen=True)
class _StateSteps:
    """The jitted steps that replace a state (see `Trainer._jit_state_steps`)."""

    apply: Callable
    fused: Callable
    public: Callable


class Trainer:
    """Jitted public or private steps for one model, loss and config.

    Args:
        config: the run's `TrainConfig`.
        model: the NNX model (its current parameters are the starting point).
        loss_fn: `loss_fn(model, batch) -> (B,)` per-row losses (see `train.losses`).
        trainable_mask: bool pytree over the `nnx.Param` state; frozen parameters get no gradient,
            no noise and no update. None trains everything.
        num_units: private runs: the number of sensitive examples (or users), for the sampling
            rate q = b / n.
        noise_key: private runs: the key of the Gaussian noise. None (default): every
            `init_state()` (so every `fit` from step 0) draws a new secret key from the operating
            system, the same on all processes, so two runs of one Trainer have independent
            noise; a resumed run continues with the key in its checkpoint. A given key makes
            every `init_state()` replay the same noise: the caller owns its freshness (one run
            per key), and `fit` refuses a second run from step 0 on this Trainer unless given
            the starting `state` explicitly. A key built from a known seed makes the noise
            reproducible and not private against anyone who knows the seed.
        mesh: a `parallel.make_mesh(...)` mesh: parameters are placed with the FSDP rule,
            batch rows over the "data" axis (each process reads only its rows), and the
            per-example vmap gets `spmd_axis_name="data"`. None: the run's mesh
            (`parallel.active_mesh()`, set from `--mesh` by the command line), or no mesh.
        fsdp_min_size: with an explicit mesh, parameters of at least this many elements are
            sharded over the "model" axis (`MeshConfig.fsdp_min_size`).

    Attributes:
        clipping: private runs: "ghost" or "vmap", the clipped-sum method `config.clipping`
            selected for this model and trainable mask.

    Privacy: a private Trainer's steps read sensitive examples only through clipped, noised sums;
    the noise key must never be logged.
    """

    def __init__(
        self,
        config: TrainConfig,
        model: nnx.Module,
        loss_fn: LossFn,
        *,
        trainable_mask: PyTree | None = None,
        num_units: int | None = None,
        noise_key: jax.Array | None = None,
        mesh: jax.sharding.Mesh | None = None,
        fsdp_min_size: int = parallel.MeshConfig().fsdp_min_size,
    ):
        if mesh is None:
            mesh, fsdp_min_size = parallel.active_mesh()
        self.config = config
        self.loss_fn = loss_fn
        self.mesh = mesh
        self._min_shard = fsdp_min_size
        self.split, params, frozen, rest = split_model(model, trainable_mask)
        self.frozen, self.rest = self._place(frozen), self._place(rest)
        self._initial_params = self._place(params)
        self.plan: DpSgdPlan | None = None
        if config.private:
            check_no_batchnorm(model)
            if num_units is None:
                raise ValueError("a private Trainer needs num_units.")
            self.plan = plan_dp_sgd(config.dp_sgd_config(), num_units=int(num_units))
            self.clipping = self._select_clipping(model)
            if config.adaptive_clipping is None:
                self.optimizer = private_optimizer(
                    make_optimizer(config),
                    noise_multiplier=self.plan.noise_multiplier,
                    sensitivity=self._grad_sum(self.frozen, self.rest).sensitivity(),
                    expected_batch_size=self.plan.expected_batch_size,
                    key=noise_key,
                    strategy=self.plan.strategy(),
                )
            else:  # noise σ_Δ·C_t on the sum, σ_b on the count: one mechanism of multiplier σ
                self.optimizer = adaptive_private_optimizer(
                    make_optimizer(config),
                    config.adaptive_clipping,
                    noise_multiplier=self.plan.noise_multiplier,
                    initial_clip_norm=config.clip_norm,
                    expected_batch_size=self.plan.expected_batch_size,
                    key=noise_key,
                )
            self.sampler = self.plan.sampler()
            rows = config.chunk_size or config.pad_multiple
            if mesh is not None and rows % mesh.shape[parallel.DATA_AXIS]:
                raise ValueError(
                    f"chunks of {rows} units do not split over {mesh.shape[parallel.DATA_AXIS]} "
                    "data-parallel devices; choose chunk_size/pad_multiple as a multiple."
                )
        else:
            self.optimizer = make_optimizer(config)
        self._noise_key_given = noise_key is not None
        self._noise_key_used = False
        self._sum_jitted: _SumSteps | None = None
        self._state_jitted: _StateSteps | None = None

    # ---------------------------------------------------------------- placement and state
    def _place(self, tree: PyTree) -> PyTree:
        if self.mesh is None:
            return tree
        return parallel.shard_tree(tree, self.mesh, min_size=self._min_shard)

    def _place_batch(self, batch: Batch) -> Batch:
        if self.mesh is None:
            return jax.tree.map(jnp.asarray, batch)
        return parallel.shard_batch(batch, self.mesh)

    def _sum_steps(self, params: PyTree) -> _SumSteps:
        """The jitted pieces of a chunked clipped sum, built at the first call."""
        if self._sum_jitted is None:
            self._sum_jitted = self._jit_sum_steps(params)
        return self._sum_jitted

    def _steps(self, state: TrainState) -> _StateSteps:
        """The jitted steps on a state, built at the first call from its structure."""
        if self._state_jitted is None:
            self._state_jitted = self._jit_state_steps(state)
        return self._state_jitted

    def _jit(self, fn: Callable, ins: Any, outs: Any, donate: tuple[int, ...] = ()) -> Callable:
        """`fn` jitted, donating the arguments `donate` (the state or accumulator it replaces).

        On a mesh with declared input and output shardings: the state (step, parameters,
        optimizer and noise state), the frozen parameters and the accumulators keep
        `parallel.tree_sharding`'s FSDP placement, which depends on shapes only, so a step
        returns its state placed as it was given and gathers no parameter in full beyond the
        forward and backward passes' use; batch rows are split over the data axis, scalars
        replicated. Without a mesh the shardings are those of the arguments.
        """
        if self.mesh is None:
            return jax.jit(fn, donate_argnums=donate)
        return jax.jit(fn, in_shardings=ins, out_shardings=outs, donate_argnums=donate)

    def _shardings(self, tree: PyTree) -> PyTree:
        """The FSDP placement of `tree`'s leaves on the mesh (None without a mesh)."""
        if self.mesh is None:
            return None
        return parallel.tree_sharding(tree, self.mesh, min_size=self._min_shard)

    def _rows_and_scalar(self) -> tuple[Any, Any]:
        """Batch rows split over the data axis and replicated scalars (None without a mesh)."""
        if self.mesh is None:
            return None, None
        scalar = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        return parallel.batch_sharding(self.mesh), scalar

    def _jit_sum_steps(self, params: PyTree) -> _SumSteps:
        params_sh, frozen_sh, rest_sh = map(self._shardings, (params, self.frozen, self.rest))
        rows, scalar = self._rows_and_scalar()
        acc_sh = (params_sh, scalar)
        chunk_ins = (params_sh, frozen_sh, rest_sh, acc_sh, rows, rows, scalar, scalar)
        return _SumSteps(
            chunk_sum=self._jit(self._chunk_sum, chunk_ins, acc_sh, donate=(3,)),
            # One dispatch for the accumulator, not one per parameter (it matters for small
            # steps).
            zeros=self._jit(summation.wide_zeros, (params_sh,), params_sh),
            rounded=self._jit(summation.rounded, (params_sh, params_sh), params_sh),
        )

    def _jit_state_steps(self, state: TrainState) -> _StateSteps:
        state_sh, frozen_sh, rest_sh = map(self._shardings, (state, self.frozen, self.rest))
        params_sh = None if state_sh is None else state_sh.params
        rows, scalar = self._rows_and_scalar()
        return _StateSteps(
            apply=self._jit(
                self._apply, (state_sh, params_sh, scalar), (state_sh, scalar), donate=(0,)
            ),
            # Without chunking a private step is this one call: clipped sum, noise and update.
            fused=self._jit(
                self._fused_step,
                (state_sh, frozen_sh, rest_sh, rows, rows),
                (state_sh, scalar),
                donate=(0,),
            ),
            public=self._jit(
                self._public_step,
                (state_sh, frozen_sh, rest_sh, rows),
                (state_sh, scalar, scalar),
                donate=(0,),
            ),
        )

    def jitted_step(self, state: TrainState) -> Callable:
        """The jitted function of one whole step on `state`'s structure, for benchmarks.

        Private: `(state, frozen, rest, batch, mask) -> (state, all_finite)`, the unchunked
        step (clipped sum, noise and update); public: `(state, frozen, rest, batch) -> (state,
        all_finite, loss)`. Both donate `state`. Its `lower(...)` gives the compiled program
        (memory, HLO) and `_cache_size()` the number of compilations.
        """
        steps = self._steps(state)
        return steps.fused if self.config.private else steps.public

    def init_state(self) -> TrainState:
        """The state at step 0 (parameters from the model given at construction).

        A fresh copy each call: steps donate their input state's buffers to the new one, so a
        state must not be used again after it was passed to a step.
        Private runs without a caller's `noise_key` get a new secret noise key each call (a
        collective in a multi-process run).
        """
        params = self._initial_params
        state = TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.init(params))
        return self._place(jax.tree.map(jnp.copy, state))

    def _claim_noise_key(self) -> None:
        """Marks the caller's noise key as used by a run from step 0; refuses a second such run.

        Privacy: two runs on one key would draw the same noise, so their releases would differ
        by their data alone.
        """
        if not self._noise_key_given:
            return
        if self._noise_key_used:
            raise ValueError(
                "this Trainer's noise_key already drove a run from step 0; a second run would "
                "repeat its noise, so two releases would differ by their data alone. Build the "
                "Trainer with noise_key=None (a new secret key per run) or with a fresh key, or "
                "pass state=trainer.init_state() to fit to replay the seeded run on purpose."
            )
        self._noise_key_used = True

    def model(self, state: TrainState) -> nnx.Module:
        """The NNX model with the state's trainable parameters (frozen ones unchanged)."""
        return self.split.merge(state.params, self.frozen, self.rest)

    def _select_clipping(self, model: nnx.Module) -> str:
        """The clipped-sum method for `config.clipping`: auto is ghost where the layers allow."""
        trainable = dict(zip(self.split.names, self.split.trainable, strict=True))
        paths = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
        self._ghost_keys = {
            tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey)): name
            for path, _ in paths
            if trainable[name := jax.tree_util.keystr(path)]
        }
        if self.config.clipping == "vmap":
            return "vmap"
        try:
            ghost_models.check_ghost_support(model, self._ghost_key)
        except ValueError:
            if self.config.clipping == "ghost":
                raise
            return "vmap"
        return "ghost"

    def _ghost_key(self, path: tuple) -> str | None:
        """The params-dict name of the trainable parameter at `path` (None: frozen)."""
        return self._ghost_keys.get(path)

    # ---------------------------------------------------------------- pure jitted pieces
    def _grad_sum(self, frozen: PyTree, rest: PyTree) -> ClippedGradSum:
        config = self.config
        spmd = parallel.DATA_AXIS if self.mesh is not None else None
        if self.clipping == "ghost":

            def taped_loss(params, batch, tape):
                model = self.split.merge(params, frozen, rest)
                return self.loss_fn(ghost_models.tap_model(model, tape, self._ghost_key), batch)

            if config.level == "user":
                return ghost_user_clipped_grad_sum(taped_loss, clip_norm=config.clip_norm)
            return ghost_clipped_grad_sum(taped_loss, clip_norm=config.clip_norm)

        def example_loss(params, example):
            return self.loss_fn(self.split.merge(params, frozen, rest), example)[0]

        if config.level == "user":
            unit_loss = lambda p, ex: example_loss(p, jax.tree.map(lambda x: x[None], ex))
            return user_clipped_grad_sum(
                unit_loss,
                clip_norm=config.clip_norm,
                microbatch_size=config.microbatch_size,
                spmd_axis_name=spmd,
            )
        return clipped_grad_sum(
            example_loss,
            clip_norm=config.clip_norm,
            microbatch_size=config.microbatch_size,
            keep_batch_dim=True,
            spmd_axis_name=spmd,
        )

    def _clip_norm(self, opt_state: PyTree) -> jax.Array | None:
        """C_t of an adaptive run (from the optimizer state); None: the fixed `clip_norm`."""
        if self.config.adaptive_clipping is None:
            return None
        return current_clip_norm(opt_state)

    def _chunk_sum(self, params, frozen, rest, acc, batch, mask, clip_norm, release_units):
        """`acc` = (float64 sum, centred count) plus the chunk's clipped sum and its centred
        count of unclipped units (one of the partial sums of `release_units` units)."""
        acc_sum, acc_count = acc
        grad_sum = self._grad_sum(frozen, rest)
        total, stats = grad_sum(params, batch, mask, clip_norm, release_units=release_units)
        return summation.add(acc_sum, total), acc_count + centred_count(stats["unclipped"], mask)

    def _apply(
        self, state: TrainState, gradient: PyTree, count: jax.Array | None = None
    ) -> tuple[TrainState, jax.Array]:
        """The updated state and whether all its parameters are finite (checked by `fit`).

        `count`: the centred count of unclipped units (adaptive clipping only).
        """
        extra = {} if self.config.adaptive_clipping is None else {"centred_count": count}
        updates, opt_state = self.optimizer.update(gradient, state.opt_state, state.params, **extra)
        params = optax.apply_updates(state.params, updates)
        return TrainState(state.step + 1, params, opt_state), _all_finite(params)

    def _fused_step(self, state, frozen, rest, batch, mask):
        clip_norm = self._clip_norm(state.opt_state)
        total, stats = self._grad_sum(frozen, rest)(state.params, batch, mask, clip_norm)
        return self._apply(state, total, centred_count(stats["unclipped"], mask))

    def _public_step(self, state, frozen, rest, batch):
        def mean_loss(params):
            return jnp.mean(self.loss_fn(self.split.merge(params, frozen, rest), batch))

        loss, grads = jax.value_and_grad(mean_loss)(state.params)
        return *self._apply(state, grads), loss

    # ---------------------------------------------------------------- host-side steps
    def clipped_sum(
        self,
        params: dict[str, jax.Array],
        gather: Gather,
        indices: np.ndarray,
        mask: np.ndarray,
        clip_norm: jax.Array | None = None,
    ) -> dict[str, jax.Array]:
        """Σ of clipped unit gradients over a padded index batch, accumulated chunk by chunk.

        Args:
            params: trainable parameters.
            gather: reads examples (-1 rows come back zero-filled).
            indices: (B,) example indices, or (U, G) per-user example indices, -1 for padding.
            mask: bool, same shape as `indices`.
            clip_norm: the clip norm C_t (adaptive clipping); None: `config.clip_norm`.

        The chunks' sums are accumulated in float64 and the total is rounded once into float32
        or wider (`clipping.sum_dtype`), whatever the parameters' dtype.

        Privacy: the sum has sensitivity `clip_norm` per unit, the rounding of every chunk's sum
        and of the total included (each chunk's units are clipped for a release of the whole
        batch, `ClippedGradSum`'s `release_units`); it is *not* private until noised.
        """
        return self._accumulate(params, gather, indices, mask, clip_norm)[0]

    def _accumulate(self, params, gather, indices, mask, clip_norm):
        """(`clipped_sum`, the centred count of its unclipped units), chunk by chunk."""
        steps = self._sum_steps(params)
        acc = (steps.zeros(params), jnp.zeros((), jnp.float32))
        release_units = np.int32(indices.shape[0])
        for batch, chunk_mask in self._chunks(gather, indices, mask):
            acc = steps.chunk_sum(
                params, self.frozen, self.rest, acc, batch, chunk_mask, clip_norm, release_units
            )
        acc_sum, count = acc
        return steps.rounded(acc_sum, params), count

    def _chunks(self, gather: Gather, indices: np.ndarray, mask: np.ndarray):
        """The placed (batch, mask) chunks of a padded index batch, gathered one at a time."""
        rows = self.config.chunk_size or indices.shape[0]
        if self.mesh is not None:
            rows = math.lcm(rows, self.mesh.shape[parallel.DATA_AXIS])
        indices, mask = _pad_rows(indices, rows), _pad_rows(mask.astype(np.int8), rows) == 1
        for start in range(0, indices.shape[0], rows):
            chunk = indices[start : start + rows]
            chunk_mask = mask[start : start + rows]
            if self.mesh is not None:
                chunk = parallel.process_rows(chunk, self.mesh)
                chunk_mask = parallel.process_rows(chunk_mask, self.mesh)
            batch = gather(chunk.reshape(-1))
            batch = jax.tree.map(lambda x, c=chunk: x.reshape(*c.shape, *x.shape[1:]), batch)
            yield self._place_batch((batch, chunk_mask))

    def private_step(
        self, state: TrainState, data: IndexedData, rng: np.random.Generator
    ) -> TrainState:
        """One DP-SGD step: Poisson batch, clipped sum (in chunks), one noise draw, update.

        For BandMF the batch comes from partition `state.step` mod b (`cycle_parts`).

        Privacy: one execution of the plan's `step_event()` (when `plan.event_due(step)`); the
        caller records it in the ledger (`fit` does).
        """
        return self._checked_private_step(state, data, rng)[0]

    def cycle_parts(self, state: TrainState, data: IndexedData) -> np.ndarray:
        """BandMF: the partition of every unit (example, or user in `data.users` order), from
        the secret partition key in the noise state (so a resumed run keeps its partition).

        Privacy: the partition is secret (its key is); never log it.
        """
        if self.config.level == "user":
            ids = np.unique(data.user_ids)
        else:
            ids = np.arange(data.num_examples)
        key = correlated_noise.partition_key_bytes(state.opt_state[0])
        return cyclic_sampling.cyclic_parts(ids, bands=self.config.bands, key=key)

    def _checked_private_step(
        self,
        state: TrainState,
        data: IndexedData,
        rng: np.random.Generator,
        cycle: tuple[np.ndarray, int] | None = None,
    ) -> tuple[TrainState, jax.Array]:
        """`private_step`, and whether the new parameters are all finite (on device).

        `cycle`: BandMF's (`cycle_parts`, step index), computed from `state` when None.
        """
        check_live(state)
        if self.config.noise == "bandmf":
            parts, step = cycle or (self.cycle_parts(state, data), int(state.step))
            if self.config.level == "user":
                batch = self.sampler.sample(rng, data.users, parts, step)
            else:
                batch = self.sampler.sample(rng, parts, step)
        elif self.config.level == "user":
            batch = self.sampler.sample(rng, data.users)
        else:
            batch = self.sampler.sample(rng, data.num_examples)
        return self._checked_noisy_step(state, data.gather, batch.indices, batch.mask)

    def noisy_step(
        self, state: TrainState, gather: Gather, indices: np.ndarray, mask: np.ndarray
    ) -> TrainState:
        """The update of `private_step` on a given padded index batch: clipped sum, noise, step.

        Without `chunk_size` this is one jitted call (the whole padded batch); with it, the
        chunks' clipped sums are accumulated first. `state` is consumed: its buffers are donated
        to the returned state.

        Privacy: private only as part of `private_step`, on the sampler's Poisson batch.
        """
        return self._checked_noisy_step(state, gather, indices, mask)[0]

    def _checked_noisy_step(
        self, state: TrainState, gather: Gather, indices: np.ndarray, mask: np.ndarray
    ) -> tuple[TrainState, jax.Array]:
        """`noisy_step`, and whether the new parameters are all finite (on device)."""
        check_live(state)
        if self.config.chunk_size is None:
            ((batch, chunk_mask),) = self._chunks(gather, indices, mask)
            return self._steps(state).fused(state, self.frozen, self.rest, batch, chunk_mask)
        clip_norm = self._clip_norm(state.opt_state)
        total, count = self._accumulate(state.params, gather, indices, mask, clip_norm)
        return self._steps(state).apply(state, total, count)

    def public_step(
        self, state: TrainState, data: IndexedData | BatchFn, rng: np.random.Generator
    ) -> tuple[TrainState, jax.Array]:
        """One ordinary step on the mean loss of a public batch; returns the new state and loss.

        `data` is an `IndexedData` (a uniform batch of `batch_size` distinct rows per step) or a
        callable `rng -> batch` (e.g. `pretrain.PackedMixture.batch`).
        """
        state, _, loss = self._checked_public_step(state, data, rng)
        return state, loss

    def _checked_public_step(
        self, state: TrainState, data: IndexedData | BatchFn, rng: np.random.Generator
    ) -> tuple[TrainState, jax.Array, jax.Array]:
        """`public_step` as (state, whether its parameters are all finite (on device), loss)."""
        check_live(state)
        if isinstance(data, IndexedData):
            size = min(self.config.batch_size, data.num_examples)
            indices = rng.choice(data.num_examples, size, replace=False)
            if self.mesh is not None:
                indices = parallel.process_rows(indices, self.mesh)
            batch = data.gather(indices)
        else:
            batch = data(rng)
        batch = self._place_batch(batch)
        return self._steps(state).public(state, self.frozen, self.rest, batch)


# --------------------------------------------------------------------------------------------
# The loop.
# --------------------------------------------------------------------------------------------


class MetricLogger:
    """Writes metric dicts as JSON lines to `path` (and to TensorBoard when `tensorboardX` is
    installed and `tensorboard_dir` is given); keeps them in `history`.

    Never log the noise key or per-example values of sensitive data.
    """

    def __init__(
        self, path: str | pathlib.Path | None = None, *, tensorboard_dir: str | None = None
    ):
        self.path = None if path is None else pathlib.Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self.history: list[dict[str, Any]] = []
        self._writer = None
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                SummaryWriter = None  # noqa: N806
            self._writer = SummaryWriter and SummaryWriter(tensorboard_dir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        record = {"step": int(step), **{k: float(v) for k, v in metrics.items()}}
        self.history.append(record)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        if self._writer is not None:
            for key, value in metrics.items():
                self._writer.add_scalar(key, float(value), int(step))


@dataclasses.dataclass(frozen=True)
class FitResult:
    """The outcome of `fit`: final state, the merged model, the ledger (private runs) and the rng
    (continue sampling from it)."""

    state: TrainState
    model: nnx.Module
    ledger: accounting.PrivacyLedger | None
    rng: np.random.Generator


# Steps dispatched ahead of the devices before `fit` waits for them. XLA:CPU launches every local
# device's share of a step on one thread pool (as many threads as devices) and each launch waits
# for a per-device slot (32 in flight): with more steps queued, blocked launches can hold every
# thread while a device's pending all-reduce waits for one (a deadlock seen with 8 simulated
# devices). Waiting every few steps costs one pipeline drain per 8 steps on an accelerator.
_MAX_STEPS_AHEAD = 8


def _check_finite(flags: list[tuple[int, jax.Array]], last_checked: int) -> int:
    """The last step of `flags` if all its steps left finite parameters, else a ValueError naming
    the first step that did not.

    `flags` holds (step, the step's on-device finite flag) for the steps since `last_checked`;
    fetching them is one transfer of a few scalars the steps already computed.
    """
    steps = [step for step, _ in flags]
    for step, finite in zip(steps, jax.device_get([f for _, f in flags]), strict=True):
        if not finite:
            raise ValueError(
                f"training produced non-finite parameters at step {step} (finite at step "
                f"{last_checked}); lower the learning rate or check the data and loss."
            )
        last_checked = step
    return last_checked


def fit(
    trainer: Trainer,
    data: IndexedData | BatchFn,
    *,
    rng: np.random.Generator | None = None,
    state: TrainState | None = None,
    ledger: accounting.PrivacyLedger | None = None,
    checkpointer: Any | None = None,
    evaluate: Callable[[nnx.Module], Mapping[str, float]] | None = None,
    logger: MetricLogger | None = None,
    until: int | None = None,
    on_step: Callable[[int, int], None] | None = None,
) -> FitResult:
    """Runs `trainer` from `state` (or step 0, or the checkpointer's latest step) to `until`.

    Args:
        trainer: the `Trainer`.
        data: `IndexedData` (private runs need it), or for public runs a callable `rng -> batch`.
        rng: numpy Generator of the batch sampler (its state is checkpointed). None (default):
            a generator seeded from the operating system's entropy, so a private run's Poisson
            batches are secret; pass `np.random.default_rng(seed)` to reproduce them.
        state: the starting state (default: `trainer.init_state()`).
        ledger: the privacy ledger to record private steps in (default: a fresh one).
        checkpointer: a `checkpoint.Checkpointer`; when it holds a checkpoint the run resumes from
            its latest step (state, sampler state and ledger), and it saves every
            `checkpoint_every` steps and at the end.
        evaluate: `model -> metrics`, run every `eval_every` steps and logged.
        logger: where metrics go (default: an in-memory `MetricLogger`).
        until: stop after this step (default: `config.steps`), e.g. to split a run over
            time-limited jobs; resuming continues exactly as an uninterrupted run.
        on_step: called with (steps done, `until`) after every step, for progress reports.

    Returns:
        A `FitResult`. For private runs `ledger.epsilon(delta)` is the ε of the steps executed.

    Raises:
        ValueError: the parameters became non-finite: every step computes a finite flag on the
            device, and `fit` reads the flags every few steps (where it waits for the devices
            anyway), before logging, evaluating or saving (a non-finite state is never saved)
            and at the end; the message names the first non-finite step. Also a second run
            from step 0 of a private Trainer built with a caller's `noise_key` without an
            explicit `state`: it would replay the first run's noise on whatever data it is given.

    Privacy: private runs read `data` only through accounted DP-SGD steps; each executed step is
    recorded once (a resumed run restores the ledger, never re-records). BandMF records a cycle of
    b steps at its first step: a run continued mid-cycle from an explicit `state` must be given
    the ledger that recorded the cycle's start (a checkpointer restores it). Logged values are the
    step, ε and, for public runs, the training loss; `evaluate` must use non-sensitive data or be
    accounted by the caller.
    """
    config = trainer.config
    if config.private:
        if not isinstance(data, IndexedData):
            raise ValueError("private training reads data through IndexedData (Poisson sampling).")
        ledger = accounting.PrivacyLedger() if ledger is None else ledger
    logger = MetricLogger() if logger is None else logger
    if rng is None:  # one secret sampler seed for all processes of a multi-process run
        rng = np.random.default_rng(randomness.agree_secret(randomness.secret_seed()))
    fresh = state is None
    state = trainer.init_state() if fresh else state
    check_live(state)
    if checkpointer is not None and checkpointer.latest_step() is not None:
        state, rng, restored = checkpointer.restore(state)
        ledger = restored if config.private else ledger
        fresh = False
    until = config.steps if until is None else min(until, config.steps)
    start = int(state.step)
    if config.private and fresh and start < until:
        trainer._claim_noise_key()
    bandmf = config.private and config.noise == "bandmf"
    parts = trainer.cycle_parts(state, data) if bandmf and start < until else None
    checked = start  # the last step whose parameters were checked finite (or the resumed one)
    flags: list[tuple[int, jax.Array]] = []  # steps not yet checked, with their finite flags
    bar = tqdm.trange(start, until, initial=start, total=until, disable=not config.progress)
    for step in bar:
        interrupt.raise_if_interrupted()
        if config.private:
            cycle = (parts, step) if bandmf else None
            state, finite = trainer._checked_private_step(state, data, rng, cycle)
            if trainer.plan.event_due(step):
                ledger.record(trainer.plan.step_event())
            metrics = {}
        else:
            state, finite, loss = trainer._checked_public_step(state, data, rng)
            metrics = {"train_loss": loss}
        done = step + 1
        flags.append((done, finite))
        saving = checkpointer is not None and (
            done == until or (config.checkpoint_every and done % config.checkpoint_every == 0)
        )
        log_now = config.log_every and (done % config.log_every == 0 or done == until)
        evaluating = evaluate is not None and config.eval_every and done % config.eval_every == 0
        waiting = done % _MAX_STEPS_AHEAD == 0
        if waiting:
            jax.block_until_ready(state.params)
        if saving or log_now or evaluating or waiting or done == until:
            checked = _check_finite(flags, checked)
            flags.clear()
        if log_now:
            if config.private:
                metrics["epsilon"] = ledger.epsilon(config.delta, config.accountant)
            logger.log(done, metrics)
            bar.set_postfix({k: f"{float(v):.4g}" for k, v in metrics.items()})
        if evaluating:
            logger.log(done, {f"eval/{k}": v for k, v in evaluate(trainer.model(state)).items()})
        if saving:
            checkpointer.save(done, state, rng=rng, ledger=ledger)
        if on_step is not None:
            on_step(done, until)
    return FitResult(state, trainer.model(state), ledger, rng)
