"""Logical axis names → mesh shardings.

Parameters and activations are annotated with *logical* axis names ("embed", "heads", "batch",
...). A rule table maps each logical name to zero, one or several mesh axes. Keeping the two
apart lets one model definition run pure data parallel, FSDP, or FSDP + tensor parallel by
changing only the config's mesh sizes and rules.
"""

from collections.abc import Sequence
import math
from typing import Any

from flax import nnx
import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Each rule: (logical name, mesh axis | tuple of mesh axes | None). Earlier dims of an array
# claim mesh axes first; a mesh axis is never used twice in one array.
LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

DEFAULT_RULES: tuple[tuple[str, Any], ...] = (
    # Activations.
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_mlp", "tensor"),
    # Parameters: FSDP over the model dimension, tensor parallel over heads / MLP units.
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    # adaLN modulation outputs stay whole: they are small, are split into 6 chunks right away,
    # and with the chunked dim over `tensor` and the batch over (data, fsdp) XLA (CPU, jax
    # 0.10.2) produced wrong values (0.15 abs error on a (2, 2, 2) mesh; see the tests).
    ("modulation", None),
    ("layers", None),
    ("head_dim", None),
    ("input", None),
)


def rules_from_config(rules) -> tuple[tuple[str, Any], ...]:
    """Normalises rules from a config (lists become tuples, so rules are hashable/static)."""
    if rules is None:
        return DEFAULT_RULES
    normalised = []
    for rule in rules:
        if len(rule) != 2:
            raise ValueError(f"A logical axis rule is (logical_name, mesh_axes); got {rule!r}.")
        name, axes = rule
        if isinstance(axes, list | tuple):
            axes = tuple(axes)
        normalised.append((str(name), axes))
    return tuple(normalised)


def _mesh_axes_for(name: str | None, rules: LogicalRules) -> tuple[str, ...]:
    if name is None:
        return ()
    for logical, axes in rules:
        if logical == name:
            if axes is None:
                return ()
            return (axes,) if isinstance(axes, str) else tuple(axes)
    raise ValueError(
        f"Logical axis {name!r} has no rule. Add ({name!r}, <mesh axes or None>) to the "
        f"sharding rules (known names: {[r[0] for r in rules]}).")


def logical_to_spec(names: Sequence[str | None], rules: LogicalRules = DEFAULT_RULES,
                    shape: Sequence[int] | None = None, mesh: Mesh | None = None) -> PartitionSpec:
    """Maps logical axis names to a PartitionSpec.

    With `shape` and `mesh`, a dim whose size is not divisible by its mesh axes' total size
    keeps only the leading mesh axes that divide it (replication is always correct; uneven
    shards are not placeable). Mesh axes of size 1 are dropped so specs stay readable.

    Args:
      names: one logical name (or None) per array dim.
      rules: the logical → mesh table.
      shape: the array's shape, for the divisibility fallback.
      mesh: the mesh, for axis sizes.
    """
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        axes = [a for a in _mesh_axes_for(name, rules) if a not in used]
        if mesh is not None:
            axes = [a for a in axes if mesh.shape[a] > 1]
            if shape is not None:
                while axes and shape[dim] % math.prod(mesh.shape[a] for a in axes):
                    axes.pop()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _variable_names(variable: nnx.Variable) -> tuple[str | None, ...]:
    names = variable.get_metadata().get("logical_axes")
    if not names:
        return (None,) * len(variable.shape)
    if len(names) != len(variable.shape):
        raise ValueError(
            f"Sharding names {names} do not match the parameter's shape {variable.shape}.")
    return tuple(names)


def state_shardings(state, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES):
    """NamedShardings for every Variable of an nnx state (abstract or concrete), same tree."""

    def to_sharding(variable):
        spec = logical_to_spec(_variable_names(variable), rules, variable.shape, mesh)
        return variable.replace(NamedSharding(mesh, spec))

    return jax.tree.map(to_sharding, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def optimizer_state_shardings(optimizer, opt_state, param_shardings, mesh: Mesh):
    """Shardings for an optax state: every copy of the parameter tree in it (AdamW's moments)
    laid out like the parameters, everything else (step counts) replicated.

    `jax.jit(optimizer.init)(params)` does not do this by itself: the moments are zeros that
    depend on no input's values, so their layout is unconstrained and they come back on one
    device (then replicated: 2 × 44 GiB per chip for FLUX.1-dev in fp32). Use
    `jax.jit(optimizer.init, out_shardings=optimizer_state_shardings(...))(params)`.

    Args:
      optimizer: the optax GradientTransformation.
      opt_state: its state, concrete or abstract (`jax.eval_shape(optimizer.init, params)`).
      param_shardings: the parameters' shardings, same tree as the parameters
        (e.g. `jax.tree.map(lambda a: a.sharding, params)` or `state_shardings(...)`).
      mesh: the mesh for the replicated rest.
    """
    import optax

    replicated = NamedSharding(mesh, PartitionSpec())
    return optax.tree_map_params(optimizer, lambda _, sharding: sharding, opt_state,
                                 param_shardings, transform_non_params=lambda _: replicated)


def in_host_memory(tree):
    """ShapeDtypeStructs (with shardings) laid out the same way in pinned host memory: the
    layout of state that waits outside device memory between uses (host offload)."""
    def move(a):
        return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                    sharding=a.sharding.with_memory_kind("pinned_host"))
    return jax.tree.map(move, tree)


def move_to_memory(tree, kind: str):
    """Arrays moved to device memory ("device") or pinned host memory ("pinned_host"), each
    keeping its sharding; inside a jitted function too (the copy is part of the program)."""
    spaces = {"device": jax.memory.Space.Device, "pinned_host": jax.memory.Space.Host}
    if kind not in spaces:
        raise ValueError(f"Unknown memory kind {kind!r}; use one of {sorted(spaces)}.")
    return jax.device_put(tree, spaces[kind])


def placed_copy(tree, shardings):
    """A copy of every array, placed with `shardings` (a tree of the same structure); never
    an alias of the input, so either may be donated."""
    return jax.tree.map(lambda a, s: jax.device_put(a, s, may_alias=False), tree, shardings)


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules: LogicalRules = DEFAULT_RULES,
                   names: Sequence[str | None] | None = None) -> NamedSharding:
    """Sharding for a batch-major input array: dim 0 is "batch", the rest replicated."""
    if names is None:
        names = ("batch",) + (None,) * (len(shape) - 1) if len(shape) else ()
    return NamedSharding(mesh, logical_to_spec(names, rules, shape, mesh))


def replicate_unplaced(tree, mesh: Mesh):
    """Puts every array not yet laid out on the mesh (e.g. a fresh scalar) replicated on it."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def place(a):
        if isinstance(getattr(a, "sharding", None), NamedSharding) and a.sharding.mesh == mesh:
            return a
        return jax.device_put(a, replicated)

    return jax.tree.map(place, tree)


def with_logical_constraint(x: jax.Array, names: Sequence[str | None],
                            rules: LogicalRules = DEFAULT_RULES) -> jax.Array:
    """Constrains an activation's sharding by logical names, under the mesh set by `jax.set_mesh`.

    Outside a mesh context (plain single-device calls) this is the identity, so models stay
    callable without any parallel set-up.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    spec = logical_to_spec(names, rules, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def sharding_table(state, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES) -> list[dict]:
    """One row per parameter: path, shape, PartitionSpec and bytes held by each device."""
    rows = []
    for path, variable in nnx.to_flat_state(state):
        spec = logical_to_spec(_variable_names(variable), rules, variable.shape, mesh)
        shards = math.prod(
            math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
            for axes in spec if axes is not None)
        nbytes = math.prod(variable.shape) * variable.dtype.itemsize
        rows.append({"path": ".".join(map(str, path)), "shape": tuple(variable.shape),
                     "spec": spec, "bytes_per_device": nbytes // shards})
    return rows
