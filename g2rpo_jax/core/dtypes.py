"""The float promotion shared by the sampling and RL math."""

import jax
import jax.numpy as jnp
import numpy as np


def at_least_float32(x: jax.Array | np.ndarray | float) -> jax.Array:
    """`x` as a JAX array promoted to at least float32 (a wider float keeps its width).

    bf16 (or integer) inputs would lose what this code measures: the small differences
    between group members that advantages standardise, the ratio exp(Δ log π) that a clip
    of ε = 1e-4 acts on, the spacing of a sigma schedule near 0.
    """
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))
