"""FLUX's patch packing of spatial latents into transformer tokens, and the lossless "pixel
autoencoder" of the embedded world built on it.

FLUX packs a [H, W, C] latent into (H/p)·(W/p) tokens of C·p² channels (p = 2 for the real
16-channel VAE latents → 64 channels), channel order (c, dy, dx) as diffusers'
`FluxPipeline._pack_latents`; token (i, j) gets position id (0, i, j).
"""

import jax
import jax.numpy as jnp


def pack(latents: jax.Array, patch: int = 2) -> jax.Array:
    """[B, H, W, C] → [B, (H/p)·(W/p), C·p²], tokens row-major, channels (c, dy, dx)."""
    b, h, w, c = latents.shape
    if h % patch or w % patch:
        raise ValueError(f"Latent size {h}x{w} is not divisible by the patch size {patch}.")
    x = latents.reshape(b, h // patch, patch, w // patch, patch, c)
    x = x.transpose(0, 1, 3, 5, 2, 4)                   # [B, H/p, W/p, C, dy, dx]
    return x.reshape(b, (h // patch) * (w // patch), c * patch * patch)


def unpack(tokens: jax.Array, height: int, width: int, patch: int = 2) -> jax.Array:
    """The inverse of `pack`: [B, (H/p)·(W/p), C·p²] → [B, H, W, C]."""
    b, n, cp = tokens.shape
    hp, wp = height // patch, width // patch
    if n != hp * wp or cp % (patch * patch):
        raise ValueError(f"{n} tokens of {cp} channels do not unpack to {height}x{width} with "
                         f"patch {patch}.")
    c = cp // (patch * patch)
    x = tokens.reshape(b, hp, wp, c, patch, patch).transpose(0, 1, 4, 2, 5, 3)
    return x.reshape(b, height, width, c)


def image_ids(height: int, width: int, patch: int = 2) -> jax.Array:
    """[(H/p)·(W/p), 3] position ids (0, row, col) of the packed tokens, float32."""
    rows, cols = jnp.meshgrid(jnp.arange(height // patch), jnp.arange(width // patch),
                              indexing="ij")
    return jnp.stack([jnp.zeros_like(rows), rows, cols], -1).reshape(-1, 3).astype(jnp.float32)


class PixelAutoencoder:
    """Lossless stand-in for the FLUX autoencoder: pixels in [0, 1] ↔ packed tokens in [-1, 1].

    Same interface as the real autoencoder (`encode(images [B,H,W,3]) -> latents`,
    `decode(latents) -> images`), so a config can swap one for the other. decode(encode(x)) == x
    up to float rounding; decode clips to [0, 1].
    """

    def __init__(self, height: int, width: int, patch: int = 2, channels: int = 3):
        self.height, self.width, self.patch, self.channels = height, width, patch, channels

    @property
    def latent_shape(self) -> tuple[int, int]:
        """(N, C) of one image's packed latents."""
        n = (self.height // self.patch) * (self.width // self.patch)
        return n, self.channels * self.patch * self.patch

    def encode(self, images: jax.Array) -> jax.Array:
        return pack(jnp.asarray(images, jnp.float32) * 2.0 - 1.0, self.patch)

    def decode(self, latents: jax.Array) -> jax.Array:
        pixels = unpack(latents, self.height, self.width, self.patch)
        return jnp.clip((pixels + 1.0) / 2.0, 0.0, 1.0)

    def image_ids(self) -> jax.Array:
        return image_ids(self.height, self.width, self.patch)
