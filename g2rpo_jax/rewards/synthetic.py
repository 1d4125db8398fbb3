"""Synthetic rewards for tests and benchmarks: cheap, differentiable-free functions of latents."""

import jax
import jax.numpy as jnp


def brightness(latents: jax.Array, cond: dict) -> jax.Array:
    """Mean value of the packed latents ("mean brightness of the decoded image" when the decoder
    is the identity packing): [P, M, N, C] → [1, P, M]."""
    del cond
    return jnp.mean(latents, axis=(-2, -1))[None]


def brightness_and_contrast(latents: jax.Array, cond: dict) -> jax.Array:
    """Two reward models: mean brightness and its spread over pixels: [P, M, N, C] → [2, P, M]."""
    del cond
    return jnp.stack([jnp.mean(latents, axis=(-2, -1)), jnp.std(latents, axis=(-2, -1))])
