"""How a model runs, as opposed to what it is: the execution fields the ports share.

Every port's config carries some of `dtype` (activations), `param_dtype` (master weights),
`remat_policy` (what the backward pass recomputes) and `scan_layers`; this module turns their
config names into JAX objects and runs stacked layers the way those fields say. The attention
implementation, the remaining execution field, is `models.attention`'s.
"""

from collections.abc import Callable
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def to_dtype(name: str | Any) -> Any:
    """A dtype from its config name ("float32", "bfloat16", "float16"); dtypes pass through."""
    if isinstance(name, str):
        if name not in DTYPES:
            raise ValueError(f"Unknown dtype {name!r}; use one of {sorted(DTYPES)}.")
        return DTYPES[name]
    return name


def check_remat_policy(name: str) -> None:
    """Raises ValueError unless `name` is a key of REMAT_POLICIES."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"Unknown remat_policy {name!r}; use one of {sorted(REMAT_POLICIES)}.")


def stacked(make_block: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs):
    """`count` blocks made by `make_block(rngs)`, parameters stacked on a leading "layers" axis
    (so `run_stacked` compiles one block whatever the depth)."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: None, "logical_axes": "layers"})
    def make(rngs):
        return make_block(rngs)

    return make(rngs)


def run_stacked(stack: nnx.Module, carry: tuple, consts: tuple, count: int, scan: bool,
                remat_policy: str = "none") -> tuple:
    """Applies stacked blocks in order: carry = block_l(*carry, *consts) for l < count.

    A block returns the new carry (a tuple, or one array for a one-element carry). `scan`
    runs the layers with `jax.lax.scan`, else unrolled (for debugging); `remat_policy` names
    the activations the backward pass keeps (REMAT_POLICIES).
    """
    graphdef, state = nnx.split(stack)

    def body(carry, layer_state):
        out = nnx.merge(graphdef, layer_state)(*carry, *consts)
        return (out if isinstance(out, tuple) else (out,)), None

    if remat_policy != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat_policy], prevent_cse=not scan)
    if scan:
        carry, _ = jax.lax.scan(body, carry, state)
    else:
        for layer in range(count):
            carry, _ = body(carry, jax.tree.map(lambda a, layer=layer: a[layer], state))
    return carry
