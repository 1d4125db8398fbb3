"""Everything that touches devices: meshes, logical axis rules, shardings, multi-host start-up."""

from g2rpo_jax.parallel.agreement import ConfigMismatchError, check_same_config
from g2rpo_jax.parallel.conditioning import PER_PROMPT_COND, place_cond
from g2rpo_jax.parallel.host import (
    from_local_rows,
    gather_rows,
    host_row_indices,
    local_rows,
    process_row_indices,
    put_global,
    replicated,
    rows_by_process,
    to_host,
)
from g2rpo_jax.parallel.mesh import (
    MESH_AXES,
    MeshError,
    initialize_distributed,
    make_mesh,
    mesh_from_config,
    resolve_mesh_shape,
)
from g2rpo_jax.parallel.sharding import (
    DEFAULT_RULES,
    batch_sharding,
    logical_to_spec,
    optimizer_state_shardings,
    replicate_unplaced,
    rules_from_config,
    sharding_table,
    state_shardings,
    with_logical_constraint,
)

__all__ = [
    "ConfigMismatchError",
    "check_same_config",
    "DEFAULT_RULES",
    "MESH_AXES",
    "MeshError",
    "PER_PROMPT_COND",
    "batch_sharding",
    "sharding_table",
    "initialize_distributed",
    "logical_to_spec",
    "optimizer_state_shardings",
    "place_cond",
    "replicate_unplaced",
    "from_local_rows",
    "gather_rows",
    "host_row_indices",
    "process_row_indices",
    "rows_by_process",
    "put_global",
    "replicated",
    "local_rows",
    "to_host",
    "make_mesh",
    "mesh_from_config",
    "resolve_mesh_shape",
    "rules_from_config",
    "state_shardings",
    "with_logical_constraint",
]
