"""Device mesh construction and multi-host start-up.

The mesh has three named axes, always in this order:
    data:   independent replicas of the model; each holds its own batch slice (groups of prompts).
    fsdp:   parameters and optimizer state are sharded over it (ZeRO-3 style); the batch is too.
    tensor: attention heads and MLP hidden units are split over it (Megatron style).
"""

from collections.abc import Mapping, Sequence
import logging

import jax
from jax.sharding import AxisType, Mesh
import numpy as np

logger = logging.getLogger(__name__)

MESH_AXES = ("data", "fsdp", "tensor")

_AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


class MeshError(ValueError):
    """A mesh configuration that cannot be laid out on the available devices."""


def resolve_mesh_shape(sizes: Mapping[str, int] | Sequence[int], num_devices: int) -> tuple[int, ...]:
    """Resolves a mesh shape with at most one -1 ("the rest") against a device count.

    Args:
        sizes: sizes per axis, as a mapping with keys `MESH_AXES` (missing axes are 1) or a
            sequence in `MESH_AXES` order. At most one size may be -1.
        num_devices: the number of devices the mesh must cover exactly.

    Returns:
        The mesh shape as a tuple in `MESH_AXES` order, whose product is `num_devices`.

    Raises:
        MeshError: unknown axis names, several -1 sizes, non-positive sizes, or a product that
            does not match the device count; the message names the sizes, the devices and a fix.
    """
    if isinstance(sizes, Mapping):
        unknown = set(sizes) - set(MESH_AXES)
        if unknown:
            raise MeshError(f"Unknown mesh axes {sorted(unknown)}; the mesh axes are {MESH_AXES}.")
        shape = [int(sizes.get(name, 1)) for name in MESH_AXES]
    else:
        shape = [int(s) for s in sizes]
        if len(shape) != len(MESH_AXES):
            raise MeshError(f"A mesh shape needs {len(MESH_AXES)} sizes {MESH_AXES}, got {tuple(shape)}.")
    described = ", ".join(f"{n}={s}" for n, s in zip(MESH_AXES, shape))
    if shape.count(-1) > 1:
        raise MeshError(f"Mesh ({described}): at most one axis may be -1 (the rest of the devices).")
    if any(s == 0 or s < -1 for s in shape):
        raise MeshError(f"Mesh ({described}): sizes must be positive or -1.")
    known = int(np.prod([s for s in shape if s != -1]))
    if -1 in shape:
        if num_devices % known:
            raise MeshError(
            f"Mesh ({described}) cannot cover {num_devices} devices: the fixed axes multiply to "
            f"{known}, which does not divide {num_devices}. Choose sizes whose product divides "
            f"the device count.")
        shape[shape.index(-1)] = num_devices // known
    elif known != num_devices:
        raise MeshError(
            f"Mesh ({described}) has {known} positions but there are {num_devices} devices. Make "
            f"the sizes multiply to {num_devices}, or set one axis to -1 to take the rest.")
    return tuple(shape)


def make_mesh(sizes: Mapping[str, int] | Sequence[int], axis_types: str = "auto",
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the (data, fsdp, tensor) mesh over all (or the given) devices.

    Args:
        sizes: per-axis sizes; see `resolve_mesh_shape`.
        axis_types: "auto" (the compiler propagates shardings; our default) or "explicit"
            (sharding in types), applied to all three axes.
        devices: devices to use; defaults to `jax.devices()` (all processes' devices).
    """
    if axis_types not in _AXIS_TYPES:
        raise MeshError(f"Unknown mesh axis_types {axis_types!r}; use one of {sorted(_AXIS_TYPES)}.")
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape(sizes, len(devices))
    types = (_AXIS_TYPES[axis_types],) * len(MESH_AXES)
    try:
        return jax.make_mesh(shape, MESH_AXES, axis_types=types, devices=devices)
    except NotImplementedError as e:
        # A TPU torus whose axes cannot be grouped into these sizes (fsdp=8 on a v5p-128's
        # 4x4x4: each mesh axis must be a product of whole physical axes). Split physical axes,
        # as jax itself does on v5e, rather than refuse a mesh that works.
        from jax.experimental import mesh_utils

        logger.info("Mesh %s: %s; splitting physical axes.", shape, str(e).split(".")[0])
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, MESH_AXES, axis_types=types)


def mesh_from_config(mesh_config, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Builds the mesh from a config section with fields data, fsdp, tensor, axis_types."""
    sizes = {name: mesh_config.get(name, 1) for name in MESH_AXES}
    return make_mesh(sizes, mesh_config.get("axis_types", "auto"), devices)


def initialize_distributed(distributed_config) -> None:
    """Joins a multi-process JAX job when the config asks for it.

    With `enabled` false this does nothing (a single process). On TPU pods all other fields may
    be left empty: `jax.distributed.initialize()` discovers the coordinator from the environment.
    Elsewhere (e.g. several processes on one machine) give coordinator_address, num_processes
    and process_id.

    With `single_process_fallback` (a pod config run on a workstation, e.g. `mode=describe`), an
    environment where jax detects no cluster and no coordinator is configured runs as one
    process with a warning instead of failing.
    """
    if not distributed_config.get("enabled", False):
        return
    kwargs = {}
    for name in ("coordinator_address", "num_processes", "process_id"):
        value = distributed_config.get(name, None)
        if value not in (None, "", -1):
            kwargs[name] = value
    try:
        jax.distributed.initialize(**kwargs)
    except ValueError as e:
        # jax raises ValueError ("coordinator_address should be defined") when it detects no
        # cluster (TPU pod, SLURM, MPI, Kubernetes) and none was given.
        if kwargs or not distributed_config.get("single_process_fallback", False):
            raise ValueError(
                f"jax.distributed.initialize() failed ({e}). On a TPU pod run the job on every "
                "TPU VM; elsewhere set distributed.coordinator_address, num_processes and "
                "process_id, or distributed.enabled=False for a single process.") from e
        logger.warning("distributed.enabled but no cluster environment was detected (%s): "
                       "running as a single process.", e)
        return
    logger.info("JAX distributed: process %d of %d, %d local / %d global devices.",
                jax.process_index(), jax.process_count(), jax.local_device_count(),
                jax.device_count())
