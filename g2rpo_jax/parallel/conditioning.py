"""Placing a model's conditioning dict on the mesh.

The conditioning of a batch of prompts (`sampling.rollout.make_velocity_fn`) holds per-prompt
entries with a leading prompt axis [P, ...], split over the mesh's batch axes like every batch,
and entries that all prompts share (position ids), replicated.
"""

import jax
import numpy as np

from g2rpo_jax.parallel.host import from_local_rows, put_global
from g2rpo_jax.parallel.sharding import batch_sharding, rules_from_config

# Conditioning entries with a leading prompt axis [P, ...]; the others (position ids) are shared.
PER_PROMPT_COND = ("txt", "y")


def place_cond(cond: dict, mesh: jax.sharding.Mesh, rules=None,
               prompts: int | None = None) -> dict:
    """Host (or local) conditioning on the mesh: per-prompt entries split over the batch
    axes, shared entries replicated. Every process passes the same shared entries; its
    per-prompt entries are all `P` prompts, or with `prompts=P` only its own rows
    (`host_row_indices`)."""
    rules = rules_from_config(rules)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    placed = {}
    for k, v in cond.items():
        v = np.asarray(v)
        if k not in PER_PROMPT_COND:
            placed[k] = put_global(v, replicated)
        elif prompts is not None:
            placed[k] = from_local_rows(v, mesh, prompts, rules=rules)
        else:
            placed[k] = put_global(v, batch_sharding(mesh, v.shape, rules))
    return placed
