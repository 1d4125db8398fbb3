"""The FLUX.1 autoencoder (diffusers' `AutoencoderKL`), in Flax NNX, channels-last.

FLUX.1-dev's `vae/`: a KL autoencoder with 16 latent channels and spatial factor 8. The encoder
is conv_in → 4 down blocks (2 ResNet blocks each; a stride-2 conv after all but the last) → a
mid block (ResNet, single-head self-attention, ResNet) → GroupNorm, SiLU, conv_out to the
posterior's (mean, log-variance); the decoder mirrors it with 3 ResNet blocks per up block and
nearest ×2 upsampling. FLUX has no quant_conv / post_quant_conv (both optional here).

Layout: images and feature maps are [B, H, W, C] (NHWC, JAX's convention) and conv kernels
[kH, kW, C_in, C_out]; PyTorch's [C_out, C_in, kH, kW] kernels are transposed while loading.
Module and attribute names mirror diffusers' (`down_blocks.0.resnets.1.conv1`, ...), so our
parameter paths are the checkpoint keys with `kernel`/`scale` → `weight`.

FLUX's latent convention (diffusers' FluxPipeline): the transformer sees
(z − shift_factor) · scaling_factor, where z is the VAE's latent, and decoding undoes it:
vae.decode(latents / scaling_factor + shift_factor). Pixels are [0, 1] outside and [-1, 1]
inside the VAE.

  ae = autoencoder_weights.from_pretrained("FLUX.1-dev/vae")  # or the FLUX.1-dev folder itself
  latents = ae.encode(images)                                 # [B, H, W, 3] → [B, H/8, W/8, 16]
  images = ae.decode(latents)                                 # → [B, H, W, 3] in [0, 1]
  packed = ae.at(1024, 1024)                                  # PixelAutoencoder's interface
"""

from collections.abc import Mapping
import dataclasses
import functools
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from g2rpo_jax.models import execution, packing
from g2rpo_jax.models.attention import IMPLEMENTATIONS, dot_product_attention

__all__ = ["AutoencoderConfig", "Autoencoder", "PackedAutoencoder", "Encoder", "Decoder",
           "count_params", "abstract_model"]

# diffusers builds every VAE GroupNorm (ResNets, attention, output) with eps 1e-6.
_NORM_EPS = 1e-6
# diffusers' DiagonalGaussianDistribution clamps the log-variance to this range.
_LOGVAR_RANGE = (-30.0, 20.0)



@dataclasses.dataclass(frozen=True)
class AutoencoderConfig:
    """Architecture and execution settings; field names follow diffusers' vae/config.json.
    The defaults are FLUX.1-dev's VAE."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 16
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512)
    layers_per_block: int = 2
    norm_num_groups: int = 32
    act_fn: str = "silu"
    mid_block_add_attention: bool = True
    use_quant_conv: bool = False
    use_post_quant_conv: bool = False
    scaling_factor: float = 0.3611
    shift_factor: float = 0.1159
    # Execution (not architecture): activations' dtype, parameters' dtype, attention kernel.
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "xla"

    def __post_init__(self):
        widths = tuple(int(c) for c in self.block_out_channels)
        object.__setattr__(self, "block_out_channels", widths)
        if not widths:
            raise ValueError("block_out_channels is empty: the autoencoder needs at least one "
                             "block.")
        bad = [c for c in widths if c % self.norm_num_groups]
        if bad:
            raise ValueError(f"block_out_channels {widths} must all be divisible by "
                             f"norm_num_groups {self.norm_num_groups} (GroupNorm); {bad} are not.")
        if self.layers_per_block < 1:
            raise ValueError(f"layers_per_block must be ≥ 1, got {self.layers_per_block}.")
        if self.act_fn not in ("silu", "swish"):
            raise ValueError(f"act_fn {self.act_fn!r} is not supported; FLUX's and SD's VAEs use "
                             "'silu'.")
        if self.attention not in IMPLEMENTATIONS:
            raise ValueError(f"Unknown attention {self.attention!r}; use one of "
                             f"{IMPLEMENTATIONS}.")
        execution.to_dtype(self.dtype), execution.to_dtype(self.param_dtype)

    @property
    def downsample_factor(self) -> int:
        """Pixels per latent along each side (8 for FLUX): one ×2 per block but the last."""
        return 2 ** (len(self.block_out_channels) - 1)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "AutoencoderConfig":
        """Builds a config from a mapping (a diffusers vae/config.json or a config section),
        ignoring keys that are not fields (`_class_name`, `sample_size`, `force_upcast`, ...)."""
        values = dict(values)
        depth = len(values.get("block_out_channels", cls.block_out_channels))
        for key, kind in (("down_block_types", "DownEncoderBlock2D"),
                          ("up_block_types", "UpDecoderBlock2D")):
            types = values.get(key)
            if types is not None and (len(types) != depth or any(t != kind for t in types)):
                raise ValueError(f"{key} {list(types)} is not supported: this port builds "
                                 f"{depth} x {kind!r} (one per block_out_channels entry), as the "
                                 "FLUX and SD VAEs do.")
        for key in ("latents_mean", "latents_std"):
            if values.get(key) is not None:
                raise ValueError(f"This VAE normalises latents per channel ({key} is set); "
                                 "only the scalar scaling_factor / shift_factor convention is "
                                 "supported.")
        if values.get("shift_factor", 0.0) is None:   # SD-style VAEs store null: no shift.
            values["shift_factor"] = 0.0
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


# ---------------------------------------------------------------------------------------------
# Layers. Every module takes and returns [B, H, W, C].


def _conv(in_ch: int, out_ch: int, kernel: int, cfg: AutoencoderConfig, rngs: nnx.Rngs,
          stride: int = 1, padding: Any = "SAME") -> nnx.Conv:
    return nnx.Conv(in_ch, out_ch, (kernel, kernel), strides=(stride, stride), padding=padding,
                    dtype=execution.to_dtype(cfg.dtype), param_dtype=execution.to_dtype(cfg.param_dtype), rngs=rngs)


def _linear(features: int, cfg: AutoencoderConfig, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(features, features, dtype=execution.to_dtype(cfg.dtype),
                      param_dtype=execution.to_dtype(cfg.param_dtype), rngs=rngs)


class GroupNorm(nnx.Module):
    """torch.nn.GroupNorm on channels-last input: statistics per (sample, group of consecutive
    channels) over all positions, computed in float32 with a two-pass variance (the one-pass
    E[x²] − E[x]² loses digits on the large activations deep in the decoder)."""

    def __init__(self, channels: int, cfg: AutoencoderConfig):
        self.groups = cfg.norm_num_groups
        self.scale = nnx.Param(jnp.ones((channels,), execution.to_dtype(cfg.param_dtype)))
        self.bias = nnx.Param(jnp.zeros((channels,), execution.to_dtype(cfg.param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, ..., C] → same shape and dtype."""
        b, c = x.shape[0], x.shape[-1]
        grouped = x.astype(jnp.float32).reshape(b, -1, self.groups, c // self.groups)
        mean = jnp.mean(grouped, axis=(1, 3), keepdims=True)
        var = jnp.mean(jnp.square(grouped - mean), axis=(1, 3), keepdims=True)
        normed = ((grouped - mean) * jax.lax.rsqrt(var + _NORM_EPS)).reshape(x.shape)
        out = normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
        return out.astype(x.dtype)


class ResnetBlock2D(nnx.Module):
    """GroupNorm → SiLU → conv3×3, twice, plus the input (through a 1×1 conv if the width
    changes). diffusers' ResnetBlock2D without a time embedding."""

    def __init__(self, in_ch: int, out_ch: int, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.norm1 = GroupNorm(in_ch, cfg)
        self.conv1 = _conv(in_ch, out_ch, 3, cfg, rngs)
        self.norm2 = GroupNorm(out_ch, cfg)
        self.conv2 = _conv(out_ch, out_ch, 3, cfg, rngs)
        self.conv_shortcut = _conv(in_ch, out_ch, 1, cfg, rngs) if in_ch != out_ch else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.conv1(jax.nn.silu(self.norm1(x)))
        h = self.conv2(jax.nn.silu(self.norm2(h)))
        shortcut = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return shortcut + h


class Downsample2D(nnx.Module):
    """Stride-2 conv3×3 that halves H and W. diffusers pads only bottom and right by one pixel
    (F.pad (0, 1, 0, 1), then no conv padding): windows start at pixels 0, 2, 4, ... A
    symmetric padding of 1 (PyTorch's usual) would move every window by one pixel. For even
    sizes XLA's "SAME" happens to pad (0, 1) too; spelled out, it holds for every size."""

    def __init__(self, channels: int, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.conv = _conv(channels, channels, 3, cfg, rngs, stride=2, padding=((0, 1), (0, 1)))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv(x)


class Upsample2D(nnx.Module):
    """Nearest-neighbour ×2 (each pixel repeated 2×2), then conv3×3."""

    def __init__(self, channels: int, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.conv = _conv(channels, channels, 3, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)
        return self.conv(x)


class AttentionBlock(nnx.Module):
    """Single-head self-attention over all H·W positions with a GroupNorm in front and a
    residual connection (the VAE mid-block's diffusers `Attention`, head dim = channels).
    The logits and softmax are float32 (diffusers' upcast_softmax). With "xla" the [S, S]
    logits are materialised: at 1024² pixels S = 128² and that is 1 GiB per image; "cudnn"
    (bfloat16, NVIDIA) streams them."""

    def __init__(self, channels: int, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.group_norm = GroupNorm(channels, cfg)
        self.to_q = _linear(channels, cfg, rngs)
        self.to_k = _linear(channels, cfg, rngs)
        self.to_v = _linear(channels, cfg, rngs)
        self.to_out = _linear(channels, cfg, rngs)
        self.attention = cfg.attention

    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, c = x.shape
        tokens = self.group_norm(x).reshape(b, h * w, 1, c)       # [B, S, heads=1, C]
        q, k, v = self.to_q(tokens), self.to_k(tokens), self.to_v(tokens)
        out = dot_product_attention(q, k, v, self.attention)
        return x + self.to_out(out.reshape(b, h, w, c))


class MidBlock2D(nnx.Module):
    """ResNet → attention → ResNet at the lowest resolution (diffusers' UNetMidBlock2D)."""

    def __init__(self, channels: int, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(channels, channels, cfg, rngs) for _ in range(2)])
        self.attentions = nnx.List([AttentionBlock(channels, cfg, rngs)]
                                   if cfg.mid_block_add_attention else [])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.resnets[0](x)
        for attention in self.attentions:
            x = attention(x)
        return self.resnets[1](x)


class DownEncoderBlock2D(nnx.Module):
    """`num_layers` ResNet blocks, then (optionally) a stride-2 downsample."""

    def __init__(self, in_ch: int, out_ch: int, num_layers: int, downsample: bool,
                 cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, cfg, rngs)
                                 for i in range(num_layers)])
        self.downsamplers = nnx.List([Downsample2D(out_ch, cfg, rngs)] if downsample else [])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in (*self.resnets, *self.downsamplers):
            x = layer(x)
        return x


class UpDecoderBlock2D(nnx.Module):
    """`num_layers` ResNet blocks, then (optionally) a nearest ×2 upsample."""

    def __init__(self, in_ch: int, out_ch: int, num_layers: int, upsample: bool,
                 cfg: AutoencoderConfig, rngs: nnx.Rngs):
        self.resnets = nnx.List([ResnetBlock2D(in_ch if i == 0 else out_ch, out_ch, cfg, rngs)
                                 for i in range(num_layers)])
        self.upsamplers = nnx.List([Upsample2D(out_ch, cfg, rngs)] if upsample else [])

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in (*self.resnets, *self.upsamplers):
            x = layer(x)
        return x


class Encoder(nnx.Module):
    """Pixels [B, H, W, in_channels] in [-1, 1] → posterior moments [B, H/f, W/f, 2·latent]
    (mean channels first, then log-variance), f = cfg.downsample_factor."""

    def __init__(self, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        widths = cfg.block_out_channels
        self.conv_in = _conv(cfg.in_channels, widths[0], 3, cfg, rngs)
        self.down_blocks = nnx.List([
            DownEncoderBlock2D(widths[max(i - 1, 0)], width, cfg.layers_per_block,
                               i < len(widths) - 1, cfg, rngs)
            for i, width in enumerate(widths)])
        self.mid_block = MidBlock2D(widths[-1], cfg, rngs)
        self.conv_norm_out = GroupNorm(widths[-1], cfg)
        self.conv_out = _conv(widths[-1], 2 * cfg.latent_channels, 3, cfg, rngs)
        self.dtype = execution.to_dtype(cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.conv_in(x.astype(self.dtype))
        for block in self.down_blocks:
            x = block(x)
        x = self.mid_block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


class Decoder(nnx.Module):
    """Latents z [B, h, w, latent] (the VAE's own scale) → pixels [B, h·f, w·f, out_channels]
    in about [-1, 1] (not clipped)."""

    def __init__(self, cfg: AutoencoderConfig, rngs: nnx.Rngs):
        widths = tuple(reversed(cfg.block_out_channels))
        self.conv_in = _conv(cfg.latent_channels, widths[0], 3, cfg, rngs)
        self.mid_block = MidBlock2D(widths[0], cfg, rngs)
        # Each up block has one ResNet more than a down block (diffusers' layers_per_block + 1).
        self.up_blocks = nnx.List([
            UpDecoderBlock2D(widths[max(i - 1, 0)], width, cfg.layers_per_block + 1,
                             i < len(widths) - 1, cfg, rngs)
            for i, width in enumerate(widths)])
        self.conv_norm_out = GroupNorm(widths[-1], cfg)
        self.conv_out = _conv(widths[-1], cfg.out_channels, 3, cfg, rngs)
        self.dtype = execution.to_dtype(cfg.dtype)

    def __call__(self, z: jax.Array) -> jax.Array:
        x = self.mid_block(self.conv_in(z.astype(self.dtype)))
        for block in self.up_blocks:
            x = block(x)
        return self.conv_out(jax.nn.silu(self.conv_norm_out(x)))


# ---------------------------------------------------------------------------------------------
# The autoencoder and its FLUX-facing interface.


class Autoencoder(nnx.Module):
    """Encoder + decoder + FLUX's latent scale/shift. Pixels are [B, H, W, C] in [0, 1];
    FLUX latents are [B, H/f, W/f, latent_channels] (f = 8 for FLUX), already shifted and
    scaled for the transformer. No method jits itself: call them inside your own jit, or use
    `at(height, width)`, whose methods are jitted."""

    def __init__(self, cfg: AutoencoderConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.encoder = Encoder(cfg, rngs)
        self.decoder = Decoder(cfg, rngs)
        c = cfg.latent_channels
        self.quant_conv = _conv(2 * c, 2 * c, 1, cfg, rngs) if cfg.use_quant_conv else None
        self.post_quant_conv = _conv(c, c, 1, cfg, rngs) if cfg.use_post_quant_conv else None

    # --- diffusers' own scale: pixels in [-1, 1], latents z unshifted, unscaled. -----------

    def encode_moments(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        """pixels [B, H, W, C] in [-1, 1] → the posterior's (mean, logvar), each
        [B, H/f, W/f, latent_channels], float32 (diffusers' `vae.encode(x).latent_dist`)."""
        f = self.cfg.downsample_factor
        if pixels.shape[1] % f or pixels.shape[2] % f:
            raise ValueError(f"Image size {pixels.shape[1]}x{pixels.shape[2]} is not a multiple of "
                             f"the autoencoder's downsampling factor {f}; resize or crop first.")
        moments = self.encoder(pixels)
        if self.quant_conv is not None:
            moments = self.quant_conv(moments)
        mean, logvar = jnp.split(moments.astype(jnp.float32), 2, axis=-1)
        return mean, jnp.clip(logvar, *_LOGVAR_RANGE)

    def decode_raw(self, z: jax.Array) -> jax.Array:
        """z [B, h, w, latent_channels] (VAE scale) → pixels [B, h·f, w·f, C] in about [-1, 1],
        float32, unclipped (diffusers' `vae.decode(z).sample`)."""
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z.astype(self.decoder.dtype))
        return self.decoder(z).astype(jnp.float32)

    # --- FLUX's convention: images in [0, 1], latents (z − shift) · scale. ------------------

    def encode(self, images: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """images [B, H, W, C] in [0, 1] → FLUX latents [B, H/f, W/f, latent_channels].

        z is the posterior mean, or with a PRNG `key` a posterior sample (mean + std·ε);
        the result is (z − shift_factor) · scaling_factor, as FLUX pipelines prepare latents.
        """
        z, logvar = self.encode_moments(jnp.asarray(images, jnp.float32) * 2.0 - 1.0)
        if key is not None:
            z = z + jnp.exp(0.5 * logvar) * jax.random.normal(key, z.shape)
        return (z - self.cfg.shift_factor) * self.cfg.scaling_factor

    def decode(self, latents: jax.Array) -> jax.Array:
        """FLUX latents [B, h, w, latent_channels] → images [B, h·f, w·f, C] in [0, 1], float32."""
        z = jnp.asarray(latents, jnp.float32) / self.cfg.scaling_factor + self.cfg.shift_factor
        return jnp.clip((self.decode_raw(z) + 1.0) / 2.0, 0.0, 1.0)

    # --- packed tokens, as the FLUX transformer sees latents (patch 2). --------------------

    def _latent_size(self, height: int, width: int, patch: int) -> tuple[int, int]:
        step = self.cfg.downsample_factor * patch
        if height % step or width % step:
            raise ValueError(f"Image size {height}x{width} must be a multiple of {step} (the "
                             f"autoencoder's factor {self.cfg.downsample_factor} × patch {patch}).")
        return height // self.cfg.downsample_factor, width // self.cfg.downsample_factor

    def latent_shape(self, height: int, width: int, patch: int = 2) -> tuple[int, int]:
        """(N, C) of one height×width image's packed latents: (h/p · w/p, latent_channels · p²)."""
        h, w = self._latent_size(height, width, patch)
        return (h // patch) * (w // patch), self.cfg.latent_channels * patch * patch

    def image_ids(self, height: int, width: int, patch: int = 2) -> jax.Array:
        """[N, 3] position ids (0, row, col) of a height×width image's packed latents."""
        return packing.image_ids(*self._latent_size(height, width, patch), patch)

    def encode_packed(self, images: jax.Array, key: jax.Array | None = None,
                      patch: int = 2) -> jax.Array:
        """images [B, H, W, C] in [0, 1] → packed FLUX latents [B, N, latent_channels · p²]."""
        self._latent_size(images.shape[1], images.shape[2], patch)
        return packing.pack(self.encode(images, key), patch)

    def decode_packed(self, tokens: jax.Array, height: int, width: int,
                      patch: int = 2) -> jax.Array:
        """Packed FLUX latents [B, N, latent_channels · p²] of height×width images (pixels)
        → images [B, height, width, C] in [0, 1]."""
        return self.decode(packing.unpack(tokens, *self._latent_size(height, width, patch), patch))

    def at(self, height: int, width: int, patch: int = 2) -> "PackedAutoencoder":
        """This autoencoder bound to one image size, with PixelAutoencoder's interface."""
        return PackedAutoencoder(self, height, width, patch)


@functools.lru_cache(maxsize=16)
def _packed_programs(graphdef, height: int, width: int, patch: int):
    """Jitted packed encode/decode for one model structure and image size, shared by every
    PackedAutoencoder of that structure (so `ae.at(h, w)` in a loop compiles once)."""

    def encode(state, images, key):
        return nnx.merge(graphdef, state).encode_packed(images, key, patch)

    def decode(state, tokens):
        return nnx.merge(graphdef, state).decode_packed(tokens, height, width, patch)

    return jax.jit(encode), jax.jit(decode)


class PackedAutoencoder:
    """An Autoencoder fixed to height×width images, speaking packed tokens: the same interface
    as `packing.PixelAutoencoder` (`latent_shape`, `encode`, `decode`, `image_ids`), so the
    generator and the RL code can take either.

    encode/decode are jitted over the autoencoder's state (passed as an argument, not baked
    into the program as constants) and may also be called inside another jit.
    """

    def __init__(self, autoencoder: Autoencoder, height: int, width: int, patch: int = 2):
        self.height, self.width, self.patch = height, width, patch
        self.channels = autoencoder.cfg.out_channels
        self.autoencoder = autoencoder
        self._latent_shape = autoencoder.latent_shape(height, width, patch)   # validates the size
        graphdef, self._state = nnx.split(autoencoder)
        self._encode, self._decode = _packed_programs(graphdef, height, width, patch)

    @property
    def latent_shape(self) -> tuple[int, int]:
        """(N, C) of one image's packed latents."""
        return self._latent_shape

    def encode(self, images: jax.Array, key: jax.Array | None = None) -> jax.Array:
        """images [B, H, W, C] in [0, 1] → packed FLUX latents [B, N, C_latent · p²]."""
        return self._encode(self._state, images, key)

    def decode(self, latents: jax.Array) -> jax.Array:
        """Packed FLUX latents [B, N, C_latent · p²] → images [B, H, W, C] in [0, 1]."""
        return self._decode(self._state, latents)

    def image_ids(self) -> jax.Array:
        return self.autoencoder.image_ids(self.height, self.width, self.patch)


# ---------------------------------------------------------------------------------------------
# Construction, parameter counts.


def abstract_model(cfg: AutoencoderConfig) -> Autoencoder:
    """The model with ShapeDtypeStruct parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: Autoencoder(cfg, rngs=nnx.Rngs(0)))


_COMPONENTS = ("encoder", "decoder", "quant_conv", "post_quant_conv")


@functools.lru_cache(maxsize=8)
def _component_counts(cfg: AutoencoderConfig) -> dict[str, int]:
    model = abstract_model(cfg)
    counts = {}
    for name in _COMPONENTS:
        part = getattr(model, name)
        state = nnx.state(part, nnx.Param) if part is not None else {}
        counts[name] = sum(math.prod(x.shape) for x in jax.tree.leaves(state))
    return counts


def count_params(cfg: AutoencoderConfig, component: str | None = None) -> int:
    """Number of parameters (from shapes only, `jax.eval_shape`), of the whole model or of one
    component: "encoder", "decoder", "quant_conv" or "post_quant_conv"."""
    counts = _component_counts(cfg)
    if component is None:
        return sum(counts.values())
    if component not in counts:
        raise ValueError(f"Unknown component {component!r}; use one of {_COMPONENTS}.")
    return counts[component]
