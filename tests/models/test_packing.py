"""Latent packing against diffusers' FluxPipeline, and the lossless pixel autoencoder."""

from diffusers import FluxPipeline
import numpy as np
import pytest
import torch

from g2rpo_jax.models import packing


def test_pack_matches_diffusers_and_inverts():
    rng = np.random.default_rng(0)
    latents = rng.normal(size=(2, 6, 8, 16)).astype(np.float32)       # NHWC
    reference = FluxPipeline._pack_latents(torch.from_numpy(latents).permute(0, 3, 1, 2),
                                           2, 16, 6, 8).numpy()
    packed = np.asarray(packing.pack(latents))
    np.testing.assert_array_equal(packed, reference)
    # diffusers' unpack (vae_scale_factor 8 → pixel size ×8) gives NCHW back.
    back = FluxPipeline._unpack_latents(torch.from_numpy(packed), 6 * 8, 8 * 8, 8).numpy()
    np.testing.assert_array_equal(np.transpose(back, (0, 2, 3, 1)), latents)
    np.testing.assert_array_equal(np.asarray(packing.unpack(packed, 6, 8)), latents)


def test_image_ids_match_diffusers():
    reference = FluxPipeline._prepare_latent_image_ids(1, 3, 4, "cpu", torch.float32).numpy()
    np.testing.assert_array_equal(np.asarray(packing.image_ids(6, 8)), reference)


def test_pixel_autoencoder_is_lossless():
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(3, 32, 32, 3)).astype(np.float32) / 255.0
    ae = packing.PixelAutoencoder(32, 32)
    latents = ae.encode(images)
    assert latents.shape == (3, *ae.latent_shape) == (3, 256, 12)
    assert float(latents.min()) >= -1.0 and float(latents.max()) <= 1.0
    np.testing.assert_allclose(np.asarray(ae.decode(latents)), images, atol=1e-6)
    # Out-of-range latents decode to valid pixels.
    assert float(ae.decode(latents * 3).max()) <= 1.0


def test_bad_sizes():
    with pytest.raises(ValueError, match="not divisible by the patch size 2"):
        packing.pack(np.zeros((1, 5, 4, 3)))
    with pytest.raises(ValueError, match="do not unpack to 8x8"):
        packing.unpack(np.zeros((1, 15, 12)), 8, 8)
