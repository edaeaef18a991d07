"""Device meshes, parameter and batch placement, and multi-host start-up.

The mesh has a `data` axis (examples of a batch are split over it; the per-example `vmap` gets
`spmd_axis_name="data"`) and a `model` axis for FSDP-style sharding of large parameters (GPT-2
medium): a parameter with at least `fsdp_min_size` elements is split along its largest dimension
that the `model` axis divides; everything else is replicated. Both axes are `AxisType.Auto`, so
`jax.jit` propagates shardings from the placed inputs.

Noise is drawn once: the noise key is replicated and `jax.random` draws the *global* array inside
the jitted step, so every device holds its slice of one and the same noise draw, whatever the mesh.

Multi-host: `initialize(config)` calls `jax.distributed.initialize()`; every host runs the same
sampler with the same seed (so all hosts agree on the global index batch), keeps only its rows
(`process_rows`), reads those examples, and `shard_batch` assembles the global array with
`jax.make_array_from_process_local_data`.

The mesh of a run is set once (`set_active_mesh`, done by `dpmix demo`, `dpmix run` and every
experiment from `--mesh data=D,model=M`); a `Trainer` built without an explicit mesh uses it.

API:
    MeshConfig(*, data=-1, model=1, fsdp_min_size=2**18, distributed=False,
               coordinator_address=None, num_processes=None, process_id=None)
    parse_mesh(text) -> MeshConfig             "data=8", "data=4,model=2"
    initialize(config)                         jax.distributed.initialize() when configured
    make_mesh(config, devices=None) -> Mesh     axes ("data", "model")
    set_active_mesh(mesh, fsdp_min_size) / active_mesh() -> (Mesh | None, fsdp_min_size)
    is_main_process() -> bool                  process 0 (the one that writes shared outputs)
    on_main_process(write)                     write() on process 0 only; every process waits
    broadcast_from_main(value) -> value        process 0's numpy value on every process
    agree(flag) -> bool                        process 0's answer (e.g. "is it stored?") on all
    tree_sharding(tree, mesh, *, min_size) -> pytree of NamedSharding (FSDP rule, by shape)
    shard_tree(tree, mesh, *, min_size)         device_put with `tree_sharding`
    batch_sharding(mesh) -> NamedSharding       leading axis over "data"
    process_rows(rows, mesh)                    this host's slice of a global (padded) batch
    shard_batch(local_batch, mesh)              global arrays from each host's rows
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

PyTree = Any
DATA_AXIS = "data"
MODEL_AXIS = "model"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """Shape of the device mesh and multi-host settings.

    Attributes:
        data: devices along the data axis; -1 takes all devices left after `model`.
        model: devices along the FSDP/model axis (1: parameters replicated).
        fsdp_min_size: parameters with at least this many elements are sharded over `model`.
        distributed: call `jax.distributed.initialize()` in `initialize` (multi-host pods).
        coordinator_address, num_processes, process_id: passed to `jax.distributed.initialize`;
            None lets JAX detect them (TPU pods, SLURM).
    """

    data: int = -1
    model: int = 1
    fsdp_min_size: int = 2**18
    distributed: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.data, int) or (self.data < 1 and self.data != -1):
            raise ValueError(f"data must be -1 or an integer >= 1, got {self.data!r}.")
        if not isinstance(self.model, int) or self.model < 1:
            raise ValueError(f"model must be an integer >= 1, got {self.model!r}.")
        if not isinstance(self.fsdp_min_size, int) or self.fsdp_min_size < 1:
            raise ValueError(f"fsdp_min_size must be an integer >= 1, got {self.fsdp_min_size!r}.")


def parse_mesh(text: str) -> MeshConfig:
    """The `MeshConfig` of a `--mesh` value such as "data=8" or "data=4,model=2"."""
    sizes = {}
    for item in text.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or name not in (DATA_AXIS, MODEL_AXIS) or name in sizes:
            raise ValueError(
                f"--mesh {text!r}: give data=D and/or model=M once each, e.g. data=4,model=2."
            )
        try:
            sizes[name] = int(value)
        except ValueError:
            message = f"--mesh {text!r}: {name} must be an integer, got {value!r}."
            raise ValueError(message) from None
    return MeshConfig(**sizes)


def initialize(config: MeshConfig) -> None:
    """Starts the multi-host runtime when `config.distributed` (call before any other JAX use).

    A second call in the same process does nothing.
    """
    if config.distributed and not jax.distributed.is_initialized():
        jax.distributed.initialize(
            coordinator_address=config.coordinator_address,
            num_processes=config.num_processes,
            process_id=config.process_id,
        )


def make_mesh(config: MeshConfig, devices: list[Any] | None = None) -> Mesh:
    """A `("data", "model")` mesh over `devices` (default: all devices of all hosts)."""
    devices = list(jax.devices() if devices is None else devices)
    data = len(devices) // config.model if config.data == -1 else config.data
    if data < 1 or data * config.model != len(devices):
        raise ValueError(
            f"a mesh of data={config.data} x model={config.model} does not fit {len(devices)} "
            "devices; the product must equal the device count."
        )
    return jax.make_mesh(
        (data, config.model),
        (DATA_AXIS, MODEL_AXIS),
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices,
    )


_ACTIVE: dict[str, Any] = {"mesh": None, "fsdp_min_size": MeshConfig().fsdp_min_size}


def set_active_mesh(mesh: Mesh | None, fsdp_min_size: int = MeshConfig().fsdp_min_size) -> None:
    """Makes `mesh` the run's mesh: `Trainer`s built without a mesh argument use it."""
    _ACTIVE.update(mesh=mesh, fsdp_min_size=fsdp_min_size)


def active_mesh() -> tuple[Mesh | None, int]:
    """The run's mesh (None: none set) and its FSDP size threshold."""
    return _ACTIVE["mesh"], _ACTIVE["fsdp_min_size"]


def is_main_process() -> bool:
    """Whether this is process 0, the one that writes outputs shared by all processes."""
    return jax.process_index() == 0


def on_main_process(write: Any) -> None:
    """Calls `write()` on process 0 only, then waits until every process gets here.

    Every process must call it at the same point of the program (a collective barrier), so that
    no process reads a shared file before process 0 has written it.
    """
    if jax.process_count() == 1:
        write()
        return
    if is_main_process():
        write()
    multihost_utils.sync_global_devices("dpmix_jax.parallel.on_main_process")


def broadcast_from_main(value: np.ndarray) -> np.ndarray:
    """Process 0's `value` on every process (the others' values are ignored); a collective."""
    if jax.process_count() == 1:
        return np.asarray(value)
    return np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(value)))


def agree(flag: bool) -> bool:
    """Process 0's `flag` on every process: one decision (compute or read a stored stage) for
    all, even when a file appears between the processes' checks. A collective."""
    return bool(broadcast_from_main(np.asarray(bool(flag))))


def _leaf_spec(shape: tuple[int, ...], model_size: int, min_size: int) -> PartitionSpec:
    if model_size == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return PartitionSpec()
    for dim in sorted(range(len(shape)), key=lambda d: -shape[d]):
        if shape[dim] % model_size == 0:
            return PartitionSpec(*([None] * dim), MODEL_AXIS)
    return PartitionSpec()


def tree_sharding(tree: PyTree, mesh: Mesh, *, min_size: int = 2**18) -> PyTree:
    """FSDP shardings for the leaves of `tree` (params, or optimizer state shaped like them).

    The rule depends on shapes only, so Adam moments get their parameter's sharding.
    """
    model_size = mesh.shape[MODEL_AXIS]
    return jax.tree.map(
        lambda x: NamedSharding(mesh, _leaf_spec(np.shape(x), model_size, min_size)), tree
    )


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    if jax.process_count() == 1 or (isinstance(x, jax.Array) and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _place(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard_tree(tree: PyTree, mesh: Mesh, *, min_size: int = 2**18) -> PyTree:
    """Places `tree` on `mesh` with `tree_sharding`.

    Leaves are host values or arrays of this process (every process holds the same values) or
    global arrays already on the mesh (resharded).
    """
    return jax.tree.map(_place, tree, tree_sharding(tree, mesh, min_size=min_size))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of a batch split over the data axis, replicated over the model axis."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def _check_rows(num_rows: int, mesh: Mesh) -> None:
    if num_rows % mesh.shape[DATA_AXIS]:
        raise ValueError(
            f"a batch of {num_rows} rows cannot be split over {mesh.shape[DATA_AXIS]} "
            "data-parallel devices; pad batches to a multiple of the data axis size."
        )


def process_rows(rows: np.ndarray, mesh: Mesh) -> np.ndarray:
    """This host's contiguous share of a global batch of rows (all rows on a single host).

    Every host holds the same global index batch (same sampler, same seed); each reads only the
    examples of its share.
    """
    rows = np.asarray(rows)
    _check_rows(rows.shape[0], mesh)
    count = jax.process_count()
    if count == 1:
        return rows
    per_host = rows.shape[0] // count
    if per_host * count != rows.shape[0]:
        raise ValueError(f"a batch of {rows.shape[0]} rows does not split over {count} hosts.")
    start = jax.process_index() * per_host
    return rows[start : start + per_host]


def shard_batch(local_batch: PyTree, mesh: Mesh) -> PyTree:
    """Global arrays, rows over the data axis, from this host's rows (`process_rows`).

    Privacy: the batch holds sensitive examples; placing it changes nothing about what is released.
    """
    sharding = batch_sharding(mesh)

    def place(x):
        x = np.asarray(x)
        global_rows = x.shape[0] * jax.process_count()
        _check_rows(global_rows, mesh)
        return jax.make_array_from_process_local_data(sharding, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(place, local_batch)
