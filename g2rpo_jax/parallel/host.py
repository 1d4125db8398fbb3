"""Moving batch-major arrays between one process's host memory and global (multi-host) arrays.

A batch split over the mesh's batch axes is held, across processes, as one global jax.Array;
each process owns the rows on its devices. Host-side work (decoding to images, reward models
that are not jitted with the rollout) reads a process's own rows and hands back its results as
rows of a new global array. With one process these are plain device transfers.
"""

from collections.abc import Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from g2rpo_jax.parallel.sharding import DEFAULT_RULES, batch_sharding, logical_to_spec


def to_host(x) -> np.ndarray:
    """The whole array on this host (gathered from every process when it spans several)."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def local_rows(x: jax.Array, mesh, axis: int = 0, rules=DEFAULT_RULES) -> np.ndarray:
    """This process's rows (along `axis`, split over the batch axes) of a global array."""
    if x.is_fully_addressable:
        return np.asarray(x)
    names = [None] * x.ndim
    names[axis] = "batch"
    spec = logical_to_spec(names, rules, x.shape, mesh)
    return np.asarray(multihost_utils.global_array_to_host_local_array(x, mesh, spec))


def from_local_rows(local, mesh, global_rows: int, axis: int = 0,
                    rules=DEFAULT_RULES) -> jax.Array:
    """A global array from every process's rows (`local` [..., rows of this process, ...]):
    the inverse of `local_rows`, and how per-host prompt batches enter the mesh."""
    local = np.asarray(local)
    shape = list(local.shape)
    shape[axis] = global_rows
    names: Sequence[str | None] = [None] * local.ndim
    names[axis] = "batch"
    sharding = batch_sharding(mesh, shape, rules, names)
    return jax.make_array_from_process_local_data(sharding, local, tuple(shape))
