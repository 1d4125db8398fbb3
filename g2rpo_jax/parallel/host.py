"""Moving batch-major arrays between one process's host memory and global (multi-host) arrays.

A batch split over the mesh's batch axes is held, across processes, as one global jax.Array;
each process owns the rows on its devices (`host_row_indices`: not necessarily contiguous, and
the same rows on several processes where a batch shard spans hosts, e.g. a `tensor` axis
across hosts). Host-side work (reading prompts, decoding to images, reward models that are not
jitted with the rollout) handles a process's own rows: `local_rows` reads them out of a global
array, `from_local_rows` builds a global array from every process's rows, and `gather_rows`
gives every process the whole batch from its rows (small results, such as rewards). With one
process all rows are the process's and these are plain device transfers.
"""

from collections.abc import Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from g2rpo_jax.parallel.sharding import DEFAULT_RULES, batch_sharding


def to_host(x) -> np.ndarray:
    """The whole array on this host (gathered from every process when it spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _row_sharding(mesh, shape: Sequence[int], axis: int, rules) -> jax.sharding.NamedSharding:
    names = [None] * len(shape)
    names[axis] = "batch"
    return batch_sharding(mesh, tuple(shape), rules, names)


def process_row_indices(mesh, rows: int, rules=DEFAULT_RULES) -> list[np.ndarray]:
    """For every process p, the sorted rows [R_p] of a [rows, ...] batch split over the batch
    axes that lie on p's devices. Every process computes the same list (no communication).

    Raises:
      ValueError: processes would hold different numbers of rows (see `rows_by_process`).
    """
    sharding = _row_sharding(mesh, (rows,), 0, rules)
    placement = [(device.process_index, index[0])
                 for device, index in sharding.devices_indices_map((rows,)).items()]
    return rows_by_process(placement, rows, jax.process_count(), dict(mesh.shape))


def rows_by_process(placement, rows: int, process_count: int, mesh_shape=None
                    ) -> list[np.ndarray]:
    """placement: (process index, slice of the batch on one of its devices) for every device →
    the sorted rows [R_p] of each process.

    Raises:
      ValueError: the processes would hold different numbers of rows, or a process none:
        names the batch size, the mesh and the fix.
    """
    owned: list[set[int]] = [set() for _ in range(process_count)]
    for process, where in placement:
        owned[process].update(range(rows)[where])
    counts = sorted({len(s) for s in owned})
    if len(counts) > 1 or counts[0] == 0:
        raise ValueError(
            f"A batch of {rows} rows over the mesh {mesh_shape} would give the "
            f"{process_count} processes {counts} rows each: make the batch "
            "(train.prompts_per_iteration, evaluation.num_prompts) a multiple of the number of "
            "batch shards (mesh data × fsdp), with every host holding whole shards.")
    return [np.asarray(sorted(s), np.int64) for s in owned]


def host_row_indices(mesh, rows: int, rules=DEFAULT_RULES) -> np.ndarray:
    """The rows [R_host] of a [rows, ...] batch on this process's devices (see the module
    docstring); all of range(rows) with one process."""
    return process_row_indices(mesh, rows, rules)[jax.process_index()]


def local_rows(x: jax.Array, mesh, axis: int = 0, rules=DEFAULT_RULES) -> np.ndarray:
    """This process's rows (along `axis`, in `host_row_indices` order) of a global array."""
    if x.is_fully_addressable:
        return np.asarray(x)
    rows = host_row_indices(mesh, x.shape[axis], rules)
    sharding = _row_sharding(mesh, x.shape, axis, rules)
    if not x.sharding.is_equivalent_to(sharding, x.ndim):
        x = jax.jit(lambda a: a, out_shardings=sharding)(x)   # split over the batch axes only
    out = np.empty(x.shape[:axis] + (len(rows),) + x.shape[axis + 1:], x.dtype)
    for shard in x.addressable_shards:
        start = np.searchsorted(rows, range(x.shape[axis])[shard.index[axis]].start)
        where = [slice(None)] * x.ndim
        where[axis] = slice(start, start + shard.data.shape[axis])
        out[tuple(where)] = np.asarray(shard.data)
    return out


def from_local_rows(local, mesh, global_rows: int, axis: int = 0,
                    rules=DEFAULT_RULES) -> jax.Array:
    """A global array from every process's rows (`local` [..., R_host, ...] in
    `host_row_indices` order): the inverse of `local_rows`, and how per-host prompt batches
    enter the mesh."""
    local = np.asarray(local)
    rows = host_row_indices(mesh, global_rows, rules)
    if local.shape[axis] != len(rows):
        raise ValueError(f"This process holds {len(rows)} of the {global_rows} rows, but "
                         f"{local.shape[axis]} were given.")
    shape = list(local.shape)
    shape[axis] = global_rows
    sharding = _row_sharding(mesh, shape, axis, rules)

    def rows_of(index):
        span = range(global_rows)[index[axis]]
        start = np.searchsorted(rows, span.start)
        where = list(index)
        where[axis] = slice(start, start + len(span))
        return local[tuple(where)]

    return jax.make_array_from_callback(tuple(shape), sharding, rows_of)


def gather_rows(local, mesh, global_rows: int, axis: int = 0,
                rules=DEFAULT_RULES) -> np.ndarray:
    """The whole batch [..., global_rows, ...] on every process, from each process's rows
    (`local` [..., R_host, ...] in `host_row_indices` order)."""
    local = np.asarray(local)
    if jax.process_count() == 1:
        return local
    gathered = np.asarray(multihost_utils.process_allgather(local))   # [H, ..., R_host, ...]
    shape = list(local.shape)
    shape[axis] = global_rows
    out = np.empty(shape, local.dtype)
    for process, rows in enumerate(process_row_indices(mesh, global_rows, rules)):
        where = [slice(None)] * local.ndim
        where[axis] = rows
        out[tuple(where)] = gathered[process]
    return out


def put_global(value, sharding: jax.sharding.NamedSharding) -> jax.Array:
    """A host value that every process holds whole (numpy, a Python scalar, or a jax.random
    key) as a global array with `sharding`: each process fills its own devices' slices, so no
    collective runs (jax.device_put would check across hosts that the values agree)."""
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = put_global(np.asarray(jax.random.key_data(value)), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    value = np.asarray(value)
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def replicated(tree, mesh):
    """`put_global` of every leaf, replicated over the mesh."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return jax.tree.map(lambda value: put_global(value, sharding), tree)
