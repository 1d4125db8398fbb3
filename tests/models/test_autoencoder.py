"""FLUX autoencoder (models.autoencoder, loaded by models.autoencoder_weights): numeric parity
with diffusers' AutoencoderKL, FLUX's latent convention, packed latents, loading errors,
parameter counts."""

import functools
import json
import os
import shutil

from diffusers import AutoencoderKL, FluxPipeline
from diffusers.image_processor import VaeImageProcessor
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.torch import load_file, save_file
import torch

from g2rpo_jax import parallel
from g2rpo_jax.models import autoencoder, autoencoder_weights, packing, weights

FLUX_SCALE, FLUX_SHIFT = 0.3611, 0.1159

# Tiny AutoencoderKLs: FLUX's structure (16 latent channels, no quant convs) at widths (8, 16),
# factor 2, 2 layers per block; and one with both quant convs, 4 latent channels, 1 layer per
# block and non-square images.
CASES = {
    "flux_like": dict(block_out_channels=(8, 16), layers_per_block=2, norm_num_groups=4,
                      latent_channels=16, use_quant_conv=False, use_post_quant_conv=False),
    "quant": dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                  latent_channels=4, use_quant_conv=True, use_post_quant_conv=True),
}
IMAGE_SIZE = {"flux_like": (16, 16), "quant": (16, 24)}


def _diffusers_config(case: str) -> dict:
    shape = CASES[case]
    depth = len(shape["block_out_channels"])
    return dict(shape, down_block_types=("DownEncoderBlock2D",) * depth,
                up_block_types=("UpDecoderBlock2D",) * depth, scaling_factor=FLUX_SCALE,
                shift_factor=FLUX_SHIFT)


def _write_vae(directory, case: str, seed: int) -> AutoencoderKL:
    """A random diffusers AutoencoderKL, saved with `save_pretrained` into directory/vae."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(**_diffusers_config(case)).eval()
    # Every parameter random and non-trivial (no zero bias, no unit norm scale), so parity is
    # sensitive to each; weights ~ 1/sqrt(fan_in) keep activations O(1) through the blocks.
    with torch.no_grad():
        for name, param in vae.named_parameters():
            if param.ndim > 1:
                param.copy_(torch.randn_like(param) * param[0].numel() ** -0.5)
            elif "norm" in name and name.endswith("weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.copy_(0.2 * torch.randn_like(param))
        assert all(float(p.abs().min()) > 0 for p in vae.parameters())
    vae.save_pretrained(os.path.join(directory, "vae"))
    return vae


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case → (model folder containing vae/, diffusers model)."""
    out = {}
    for seed, case in enumerate(CASES):
        directory = str(tmp_path_factory.mktemp(case))
        out[case] = (directory, _write_vae(directory, case, seed))
    return out


# XLA:CPU's LLVM optimisation takes half of each compile and buys nothing for tiny convs (the
# outputs are bitwise the same): skip it, so the file stays quick.
_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}


def _program(graphdef, method: str):
    def run(state, *args):
        model = nnx.merge(graphdef, state)
        if method != "probe":
            return getattr(model, method)(*args)
        images, latents, key = args
        mean, logvar = model.encode_moments(images * 2.0 - 1.0)
        # decode_raw sees exactly decode's input, so XLA computes the decoder once for both
        # (and the encoder once for the moments, the mean and the sample): one compile each.
        z = latents / model.cfg.scaling_factor + model.cfg.shift_factor
        return dict(mean=mean, logvar=logvar, raw=model.decode_raw(z),
                    encode=model.encode(images), sample=model.encode(images, key),
                    decode=model.decode(latents))

    return run


@functools.cache
def _executable(graphdef, method: str, signature):
    state, args = jax.tree.unflatten(signature[0], signature[1])
    return jax.jit(_program(graphdef, method)).lower(state, *args).compile(_COMPILER_OPTIONS)


def _call(model: nnx.Module, method: str, *args):
    """model.method(*args) compiled once per model structure and argument shapes (eager NNX
    calls compile op by op; this keeps the file fast). method "probe" runs every entry point
    at once: probe(images, latents, key) → dict of outputs."""
    graphdef, state = nnx.split(model)
    leaves, tree = jax.tree.flatten((state, args))
    signature = (tree, tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves))
    return jax.tree.map(np.asarray, _executable(graphdef, method, signature)(state, *args))


def _probe(model, images, latents, key=0):
    return _call(model, "probe", images, latents, jax.random.key(key))


def _nchw(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(x)).permute(0, 3, 1, 2)


def _nhwc(x: torch.Tensor) -> np.ndarray:
    return x.detach().permute(0, 2, 3, 1).numpy()


def _inputs(case: str, seed: int = 0):
    """Images [2, H, W, 3] in [0, 1] and FLUX latents [2, H/f, W/f, C]."""
    rng = np.random.default_rng(seed)
    (h, w), f = IMAGE_SIZE[case], 2 ** (len(CASES[case]["block_out_channels"]) - 1)
    images = rng.uniform(size=(2, h, w, 3)).astype(np.float32)
    latent_shape = (2, h // f, w // f, CASES[case]["latent_channels"])
    return images, rng.normal(size=latent_shape).astype(np.float32)


def _flux_decode_reference(vae: AutoencoderKL, latents: np.ndarray):
    """FluxPipeline's arithmetic: vae.decode(latents / scale + shift), then postprocess.
    Returns (raw decoder output, image in [0, 1])."""
    with torch.no_grad():
        z = _nchw(latents) / vae.config.scaling_factor + vae.config.shift_factor
        pixels = vae.decode(z, return_dict=False)[0]
    return _nhwc(pixels), _nhwc(VaeImageProcessor().postprocess(pixels, output_type="pt"))


def _flux_encode_reference(vae: AutoencoderKL, images: np.ndarray):
    """FLUX's image latents (posterior mean − shift) · scale of the [-1, 1] image, and the
    posterior (mean, logvar) itself."""
    with torch.no_grad():
        dist = vae.encode(_nchw(images) * 2.0 - 1.0).latent_dist
    latents = (dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    return _nhwc(latents), _nhwc(dist.mean), _nhwc(dist.logvar)


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_diffusers(checkpoints, case):
    directory, vae = checkpoints[case]
    model = autoencoder_weights.from_pretrained(directory)
    assert model.cfg.block_out_channels == CASES[case]["block_out_channels"]
    assert (model.cfg.scaling_factor, model.cfg.shift_factor) == (FLUX_SCALE, FLUX_SHIFT)
    images, latents = _inputs(case)
    got = _probe(model, images, latents)
    encoded, mean, logvar = _flux_encode_reference(vae, images)
    raw, decoded = _flux_decode_reference(vae, latents)
    errors = {
        # The raw networks (no clip can hide an error): posterior moments, decoder output.
        "posterior mean": np.abs(got["mean"] - mean).max(),
        "posterior logvar": np.abs(got["logvar"] - logvar).max(),
        "decoder output": np.abs(got["raw"] - raw).max(),
        # FLUX's convention end to end: encode(images) and decode(latents).
        "encode": np.abs(got["encode"] - encoded).max(),
        "decode": np.abs(got["decode"] - decoded).max(),
    }
    print(f"\nparity {case}: " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items())
          + f" (|decoder out| max {np.abs(raw).max():.2f})")
    assert got["raw"].shape == got["decode"].shape == (2, *IMAGE_SIZE[case], 3)
    assert got["encode"].shape == latents.shape
    assert max(errors.values()) <= 1e-4


def test_encode_decode_round_trip_follows_flux_pipeline(checkpoints):
    """decode(encode(x)) is FluxPipeline's image → latents → image arithmetic."""
    directory, vae = checkpoints["flux_like"]
    model = autoencoder_weights.from_pretrained(directory)
    images, latents = _inputs("flux_like", seed=1)
    encoded = _probe(model, images, latents)["encode"]
    round_trip = _probe(model, images, encoded)["decode"]
    expected = _flux_decode_reference(vae, _flux_encode_reference(vae, images)[0])[1]
    err = np.abs(round_trip - expected).max()
    print(f"\nround trip vs FluxPipeline arithmetic: {err:.2e}")
    assert err <= 1e-4
    assert round_trip.shape == images.shape and round_trip.min() >= 0 and round_trip.max() <= 1


def test_posterior_sample(checkpoints):
    directory, _ = checkpoints["flux_like"]
    model = autoencoder_weights.from_pretrained(directory)
    images, latents = _inputs("flux_like")
    got = _probe(model, images, latents, key=0)
    # Undo FLUX's scale/shift: the noise (z − mean) / std must be standard normal.
    noise = (got["sample"] / FLUX_SCALE + FLUX_SHIFT - got["mean"]) / np.exp(0.5 * got["logvar"])
    assert abs(noise.mean()) < 0.1 and abs(noise.std() - 1.0) < 0.1
    np.testing.assert_array_equal(_probe(model, images, latents, key=0)["sample"], got["sample"])
    assert not np.allclose(_probe(model, images, latents, key=1)["sample"], got["sample"])


def test_packed_interface_matches_pixel_autoencoder(checkpoints):
    """`at(H, W)` speaks PixelAutoencoder's interface, and decoding packed tokens is
    FluxPipeline's unpack + decode."""
    directory, vae = checkpoints["quant"]
    model = autoencoder_weights.from_pretrained(directory)
    images, latents = _inputs("quant")
    h, w = IMAGE_SIZE["quant"]                      # factor 2 → latents 8 x 12 → 4 x 6 tokens
    packed, pixel = model.at(h, w), packing.PixelAutoencoder(h, w)
    for name in ("latent_shape", "encode", "decode", "image_ids"):
        assert hasattr(packed, name) and hasattr(pixel, name)
    assert packed.latent_shape == model.latent_shape(h, w) == (24, 16)
    np.testing.assert_array_equal(packed.image_ids(), packing.image_ids(8, 12))
    assert model.at(h, w)._decode is packed._decode             # one compile per structure

    tokens = packed.encode(images)
    assert tokens.shape == (2, *packed.latent_shape)
    np.testing.assert_allclose(tokens, packing.pack(_probe(model, images, latents)["encode"]),
                               atol=1e-6)
    tokens = packing.pack(latents)
    factor = 2 ** (len(CASES["quant"]["block_out_channels"]) - 1)
    spatial = FluxPipeline._unpack_latents(torch.from_numpy(np.array(tokens)), h, w, factor)
    decoded = np.asarray(packed.decode(tokens))
    err = np.abs(decoded - _flux_decode_reference(vae, _nhwc(spatial))[1]).max()
    print(f"\ndecode_packed vs FluxPipeline unpack + decode: {err:.2e}")
    assert decoded.shape == images.shape and err <= 1e-4
    # Its methods also trace inside an outer jit (as in a jitted training or reward step).
    assert jax.jit(packed.decode).eval_shape(tokens).shape == images.shape
    with pytest.raises(ValueError, match="multiple of 4"):
        model.at(10, 16)


def test_legacy_names_single_file_and_mesh(checkpoints, tmp_path):
    """diffusers' pre-0.15 attention names (query/key/value/proj_attn) load the same, so does
    a bare safetensors file; a mesh places every parameter replicated."""
    directory, _ = checkpoints["flux_like"]
    images, latents = _inputs("flux_like")
    expected = _probe(autoencoder_weights.from_pretrained(directory), images, latents)

    legacy = tmp_path / "vae"
    legacy.mkdir()
    shutil.copy(os.path.join(directory, "vae", "config.json"), legacy)
    renames = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}
    tensors = {}
    for key, value in load_file(os.path.join(directory, "vae",
                                             "diffusion_pytorch_model.safetensors")).items():
        for new, old in renames.items():
            key = key.replace(f".attentions.0.{new}.", f".attentions.0.{old}.")
        tensors[key] = value
    assert "decoder.mid_block.attentions.0.proj_attn.weight" in tensors
    save_file(tensors, str(legacy / "diffusion_pytorch_model.safetensors"))
    got = _probe(autoencoder_weights.from_pretrained(tmp_path), images, latents)   # parent folder
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name])

    # A bare safetensors file with diffusers' keys: the architecture comes from the overrides.
    single = autoencoder_weights.from_pretrained(
        os.path.join(directory, "vae", "diffusion_pytorch_model.safetensors"),
        **{k: v for k, v in _diffusers_config("flux_like").items() if "block_types" not in k})
    reference = nnx.state(autoencoder_weights.from_pretrained(directory), nnx.Param)
    for leaf, ref_leaf in zip(jax.tree.leaves(nnx.state(single, nnx.Param)),
                              jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(leaf, ref_leaf)

    mesh = parallel.make_mesh((8, 1, 1))
    state = nnx.state(autoencoder_weights.from_pretrained(directory, mesh=mesh), nnx.Param)
    for leaf, ref_leaf in zip(jax.tree.leaves(state), jax.tree.leaves(reference), strict=True):
        assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8
        np.testing.assert_array_equal(leaf, ref_leaf)


def test_bfloat16(checkpoints):
    """bfloat16 activations and parameters trace through every entry point (shapes only: a
    bfloat16 compile costs seconds here), and the outputs stay float32."""
    directory, _ = checkpoints["flux_like"]
    images, latents = _inputs("flux_like")
    model = autoencoder_weights.from_pretrained(directory, dtype="bfloat16", param_dtype="bfloat16")
    kernel = model.decoder.conv_in.kernel[...]
    assert kernel.dtype == jnp.bfloat16
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(_program(graphdef, "probe"), state, images, latents, jax.random.key(0))
    assert {k: (v.shape, v.dtype) for k, v in out.items()} == {
        "mean": (latents.shape, jnp.float32), "logvar": (latents.shape, jnp.float32),
        "encode": (latents.shape, jnp.float32), "sample": (latents.shape, jnp.float32),
        "raw": (images.shape, jnp.float32), "decode": (images.shape, jnp.float32)}


def _copy_with(directory, target, edit):
    """A copy of directory/vae whose state dict went through edit(dict) → dict."""
    target.mkdir()
    shutil.copy(os.path.join(directory, "vae", "config.json"), target)
    tensors = load_file(os.path.join(directory, "vae", "diffusion_pytorch_model.safetensors"))
    save_file(edit(tensors), str(target / "diffusion_pytorch_model.safetensors"))
    return target


def test_loading_errors_name_keys_and_shapes(checkpoints, tmp_path):
    directory, _ = checkpoints["flux_like"]

    def drop(tensors):
        del tensors["decoder.conv_in.weight"]
        return tensors

    with pytest.raises(weights.CheckpointMismatchError) as info:
        autoencoder_weights.from_pretrained(_copy_with(directory, tmp_path / "missing", drop))
    message = str(info.value)
    print(f"\n{message}")
    assert "missing tensor 'decoder.conv_in.weight'" in message
    assert "decoder.conv_in.kernel, expected shape (3, 3, 16, 16)" in message

    def reshape(tensors):
        tensors["encoder.mid_block.attentions.0.to_q.weight"] = torch.zeros(16, 8)
        tensors["decoder.conv_out.weight"] = torch.zeros(5, 8, 3, 3)
        return tensors

    with pytest.raises(weights.CheckpointMismatchError) as info:
        autoencoder_weights.from_pretrained(_copy_with(directory, tmp_path / "shapes", reshape))
    message = str(info.value)
    print(message)
    assert ("tensor 'encoder.mid_block.attentions.0.to_q.weight' has shape (16, 8), but "
            "encoder.mid_block.attentions.0.to_q.kernel needs (16, 16)") in message
    # Conv kernels are compared in our [kH, kW, C_in, C_out] layout, and the message says so.
    assert ("tensor 'decoder.conv_out.weight' has shape (3, 3, 8, 5), but decoder.conv_out.kernel "
            "needs (3, 3, 8, 3)") in message
    assert "PyTorch stores [C_out, C_in, kH, kW]" in message

    # A config that disagrees with the weights: the unused tensors are listed.
    wrong = tmp_path / "config"
    shutil.copytree(os.path.join(directory, "vae"), wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps(dict(config, mid_block_add_attention=False)))
    with pytest.raises(weights.CheckpointMismatchError, match="not used by the model"):
        autoencoder_weights.from_pretrained(wrong)

    no_config = _copy_with(directory, tmp_path / "noconfig", dict)
    (no_config / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        autoencoder_weights.from_pretrained(no_config)
    ldm = tmp_path / "ae.safetensors"
    save_file({"encoder.down.0.block.0.norm1.weight": torch.ones(8)}, str(ldm))
    with pytest.raises(weights.CheckpointMismatchError, match="original .LDM / BFL"):
        autoencoder_weights.from_pretrained(ldm)


def test_config_from_diffusers_json():
    flux_vae = {"_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0", "act_fn": "silu",
                "block_out_channels": [128, 256, 512, 512],
                "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True,
                "in_channels": 3, "latent_channels": 16, "latents_mean": None,
                "latents_std": None, "layers_per_block": 2, "mid_block_add_attention": True,
                "norm_num_groups": 32, "out_channels": 3, "sample_size": 1024,
                "scaling_factor": 0.3611, "shift_factor": 0.1159,
                "up_block_types": ["UpDecoderBlock2D"] * 4, "use_post_quant_conv": False,
                "use_quant_conv": False}
    cfg = autoencoder.AutoencoderConfig.from_dict(flux_vae)
    assert cfg == autoencoder.AutoencoderConfig() and cfg.downsample_factor == 8
    sd_style = autoencoder.AutoencoderConfig.from_dict(dict(flux_vae, shift_factor=None))
    assert sd_style.shift_factor == 0.0
    with pytest.raises(ValueError, match="divisible by norm_num_groups 32"):
        autoencoder.AutoencoderConfig(block_out_channels=(128, 200))
    with pytest.raises(ValueError, match="up_block_types"):
        autoencoder.AutoencoderConfig.from_dict(dict(flux_vae, up_block_types=["UpDecoderBlock2D"]))


def _hand_count(cfg: autoencoder.AutoencoderConfig) -> tuple[int, int]:
    """(encoder, decoder) parameters of diffusers' AutoencoderKL, counted by hand."""
    def conv(i, o, k=3):
        return k * k * i * o + o

    def resnet(i, o):
        return 2 * i + conv(i, o) + 2 * o + conv(o, o) + (conv(i, o, 1) if i != o else 0)

    def mid(c):
        return 2 * resnet(c, c) + 2 * c + 4 * (c * c + c)     # attention: norm + q, k, v, out

    widths, n = cfg.block_out_channels, cfg.layers_per_block
    encoder = conv(cfg.in_channels, widths[0]) + mid(widths[-1]) + 2 * widths[-1] + conv(
        widths[-1], 2 * cfg.latent_channels)
    decoder = conv(cfg.latent_channels, widths[-1]) + mid(widths[-1]) + 2 * widths[0] + conv(
        widths[0], cfg.out_channels)
    previous = widths[0]
    for i, width in enumerate(widths):                    # down blocks, then their mirrors
        last = i == len(widths) - 1
        encoder += resnet(previous, width) + (n - 1) * resnet(width, width)
        encoder += 0 if last else conv(width, width)
        previous = width
    up = tuple(reversed(widths))
    previous = up[0]
    for i, width in enumerate(up):
        decoder += resnet(previous, width) + n * resnet(width, width)
        decoder += 0 if i == len(up) - 1 else conv(width, width)
        previous = width
    return encoder, decoder


def test_flux_vae_parameter_count():
    cfg = autoencoder.AutoencoderConfig()                  # FLUX.1-dev's VAE
    total, decoder = autoencoder.count_params(cfg), autoencoder.count_params(cfg, "decoder")
    print(f"\nFLUX.1 VAE parameters: total {total:,} (encoder {total - decoder:,}, "
          f"decoder {decoder:,})")
    assert (total - decoder, decoder) == _hand_count(cfg)
    with torch.device("meta"):                             # shapes only, no memory
        reference = AutoencoderKL(
            block_out_channels=cfg.block_out_channels, layers_per_block=2, latent_channels=16,
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            use_quant_conv=False, use_post_quant_conv=False)
    assert total == sum(p.numel() for p in reference.parameters())
    assert decoder == sum(p.numel() for p in reference.decoder.parameters())
    assert round(total / 1e6, 1) == 83.8 and round(decoder / 1e6, 1) == 49.5
    # The tiny cases too, against the hand count.
    for case, shape in CASES.items():
        tiny = autoencoder.AutoencoderConfig(**shape)
        quant = 2 * shape["latent_channels"] * (2 * shape["latent_channels"] + 1)
        post = shape["latent_channels"] * (shape["latent_channels"] + 1)
        extra = (quant + post) if shape["use_quant_conv"] else 0
        assert autoencoder.count_params(tiny) == sum(_hand_count(tiny)) + extra, case
