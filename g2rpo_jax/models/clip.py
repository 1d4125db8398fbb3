"""CLIP (OpenAI / OpenCLIP / transformers) text and image towers, in Flax NNX.

One implementation of the CLIP architecture serves every model the rewards and the FLUX text
encoder need:

* text tower: token + learned position embeddings, pre-LN transformer with a causal mask, final
  LayerNorm, pooled output at the end-of-text token;
* image tower (ViT): patch "conv" (a matmul over non-overlapping patches), class token, learned
  position embeddings, LayerNorm before the blocks, pre-LN transformer, LayerNorm on the class
  token;
* optional projections of both pooled outputs into the joint embedding, and the learned
  temperature `logit_scale`.

The blocks of each tower are stacked on a leading "layers" axis and run with `jax.lax.scan`.

Two checkpoint layouts load into the same modules (`from_pretrained`):

* transformers (`CLIPModel`, `CLIPTextModel[WithProjection]`, `CLIPVisionModel[WithProjection]`;
  PickScore, FLUX's `text_encoder/`): `text_model.encoder.layers.N.self_attn.q_proj.weight`, ...
  (transformers 5 saves CLIPTextModel / CLIPVisionModel without the `text_model.` /
  `vision_model.` prefix; both forms load). The config comes from the folder's `config.json`.
* OpenCLIP / OpenAI (`transformer.resblocks.N.attn.in_proj_weight`, `visual.conv1.weight`, ...;
  HPS-v2.1, DFN5B-CLIP-ViT-H-14, OpenAI's ViT-L/14): the fused in_proj is split by rows. The config
  is a named one (`OPEN_CLIP_CONFIGS`), an OpenCLIP model-config dict, a folder's
  `open_clip_config.json`, or inferred from tensor shapes (see `config_from_open_clip_checkpoint`
  for what shapes cannot tell).

PyTorch pickles (`.pt`, `.bin`, `.pth`) are converted once to safetensors by
`convert_torch_checkpoint` (needs torch; `python -m g2rpo_jax.models.clip convert SRC [DST]`).

Inputs and outputs (B batch, T tokens, D width, E joint embedding dim):
  text_model(input_ids [B, T] int) -> (last_hidden_state [B, T, D] after the final LayerNorm,
                                       pooled [B, D])
  vision_model(pixels [B, S, S, 3] normalised, channels last) -> (last_hidden_state
      [B, 1 + (S/P)², D] before the post LayerNorm, as transformers returns it, pooled [B, D])
  CLIP.encode_text(ids) -> [B, E]; CLIP.encode_image(pixels) -> [B, E] (not normalised);
  CLIP(ids, pixels) -> logits_per_image [B_img, B_txt] = exp(logit_scale) · cosine.
"""

from collections.abc import Callable, Mapping
import dataclasses
import json
import math
import os
from pathlib import Path
import sys
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.models import weights
from g2rpo_jax.models.attention import dot_product_attention
from g2rpo_jax.models.flux import to_dtype
from g2rpo_jax.models.safetensors_io import write_safetensors
from g2rpo_jax.parallel import sharding as sharding_lib

# Tensors whose presence tells the layout and the towers (see `detect_layout`, `_hf_prefixes`).
_HF_BARE_TEXT_KEY = "embeddings.token_embedding.weight"
_HF_BARE_VISION_KEY = "embeddings.patch_embedding.weight"
_HF_TEXT_KEY = "text_model." + _HF_BARE_TEXT_KEY
_HF_VISION_KEY = "vision_model." + _HF_BARE_VISION_KEY
_OC_TEXT_KEY = "token_embedding.weight"
_OC_VISION_KEY = "visual.conv1.weight"
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")



def quick_gelu(x: jax.Array) -> jax.Array:
    """OpenAI's GELU approximation x·σ(1.702x) (OpenAI CLIP, DFN5B, FLUX's CLIP-L)."""
    return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "quick_gelu": quick_gelu,
    # torch.nn.GELU() / transformers "gelu": the exact erf form, not the tanh approximation.
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
}


# ---------------------------------------------------------------------------------------------
# Configs.


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """The text transformer. `pool`: "argmax" pools at the largest token id (OpenCLIP, and
    transformers configs with the legacy eos_token_id == 2: the EOT id 49407 is the largest),
    "eos" at the first position holding `eos_token_id` (transformers otherwise)."""

    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_dim: int = 2048
    context_length: int = 77
    act: str = "quick_gelu"
    eps: float = 1e-5
    pool: str = "argmax"
    eos_token_id: int = 49407

    def __post_init__(self):
        _check_common(self)
        if self.pool not in ("argmax", "eos"):
            raise ValueError(f"TextConfig.pool must be 'argmax' or 'eos', got {self.pool!r}.")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    """The ViT image tower (square images of `image_size`, square patches)."""

    width: int = 768
    heads: int = 12
    layers: int = 12
    mlp_dim: int = 3072
    patch_size: int = 32
    image_size: int = 224
    act: str = "quick_gelu"
    eps: float = 1e-5

    def __post_init__(self):
        _check_common(self)
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not a multiple of patch_size "
                             f"{self.patch_size}.")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _check_common(cfg):
    if cfg.width % cfg.heads:
        raise ValueError(f"width {cfg.width} is not divisible by heads {cfg.heads}.")
    if cfg.act not in ACTIVATIONS:
        raise ValueError(f"Unknown activation {cfg.act!r}; use one of {sorted(ACTIVATIONS)}.")


@dataclasses.dataclass(frozen=True)
class CLIPConfig:
    """Towers (either may be None), projections and execution settings.

    Attributes:
      text, vision: the towers; None leaves a tower out (e.g. FLUX's text encoder, or the image
        tower alone for the aesthetic predictor).
      projection_dim: the joint embedding dim E; None: no projections (transformers'
        CLIPTextModel / CLIPVisionModel). Otherwise every present tower has one (no bias).
      logit_scale: whether the model has the learned temperature.
      dtype, param_dtype: activations' and parameters' dtypes. LayerNorm and softmax statistics
        are computed in float32 either way.
      scan_layers: run the blocks with lax.scan (fast compiles) or unrolled.
      attention_impl: "xla" or "cudnn" (see models.attention).
    """

    text: TextConfig | None = dataclasses.field(default_factory=TextConfig)
    vision: VisionConfig | None = dataclasses.field(default_factory=VisionConfig)
    projection_dim: int | None = 512
    logit_scale: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    attention_impl: str = "xla"

    def __post_init__(self):
        if self.text is None and self.vision is None:
            raise ValueError("A CLIPConfig needs at least one tower (text or vision).")
        to_dtype(self.dtype), to_dtype(self.param_dtype)


def config_from_open_clip(model_cfg: Mapping[str, Any], **overrides) -> CLIPConfig:
    """A CLIPConfig from an OpenCLIP model-config dict (the format of open_clip's
    `model_configs/*.json` and of `model_cfg` in a hub folder's `open_clip_config.json`).

    Raises:
      ValueError: options this port does not implement (named), e.g. a timm or HF text tower.
    """
    model_cfg = dict(model_cfg)
    vision = dict(model_cfg.get("vision_cfg") or {})
    text = dict(model_cfg.get("text_cfg") or {})
    unsupported = []
    for section, values, allowed in (
            ("vision_cfg", vision, {"image_size", "layers", "width", "head_width", "mlp_ratio",
                                    "patch_size", "pool_type", "output_tokens", "patch_dropout"}),
            ("text_cfg", text, {"context_length", "vocab_size", "width", "heads", "layers",
                                "mlp_ratio", "pool_type", "hf_tokenizer_name", "tokenizer_kwargs",
                                "output_tokens"})):
        for key, value in values.items():
            if key not in allowed and value not in (None, False, 0, 0.0, "", {}):
                unsupported.append(f"{section}.{key}={value!r}")
    if vision.get("pool_type", "tok") != "tok":
        unsupported.append(f"vision_cfg.pool_type={vision['pool_type']!r} (only 'tok')")
    if text.get("pool_type", "argmax") != "argmax":
        unsupported.append(f"text_cfg.pool_type={text['pool_type']!r} (only 'argmax')")
    if isinstance(vision.get("layers"), list | tuple):
        unsupported.append("vision_cfg.layers as a list (a ModifiedResNet image tower)")
    if unsupported:
        raise ValueError("This OpenCLIP model config uses options the JAX CLIP does not "
                         f"implement: {unsupported}. Supported: plain ViT + text transformer CLIP.")
    act = "quick_gelu" if model_cfg.get("quick_gelu", False) else "gelu"
    v_width = int(vision.get("width", 768))
    t_width = int(text.get("width", 512))
    cfg = CLIPConfig(
        text=TextConfig(
            vocab_size=int(text.get("vocab_size", 49408)), width=t_width,
            heads=int(text.get("heads", 8)), layers=int(text.get("layers", 12)),
            mlp_dim=int(t_width * float(text.get("mlp_ratio", 4.0))),
            context_length=int(text.get("context_length", 77)), act=act, pool="argmax"),
        vision=VisionConfig(
            width=v_width, heads=v_width // int(vision.get("head_width", 64)),
            layers=int(vision.get("layers", 12)),
            mlp_dim=int(v_width * float(vision.get("mlp_ratio", 4.0))),
            patch_size=int(vision.get("patch_size", 16)),
            image_size=int(vision.get("image_size", 224)), act=act),
        projection_dim=int(model_cfg.get("embed_dim", 512)), logit_scale=True)
    return dataclasses.replace(cfg, **overrides)


# OpenCLIP model configs (open_clip's model_configs/*.json) of the checkpoints this project uses.
OPEN_CLIP_CONFIGS: dict[str, dict[str, Any]] = {
    # HPS-v2.1 (fine-tuned from laion2B-s32B-b79K; nn.GELU).
    "ViT-H-14": {
        "embed_dim": 1024,
        "vision_cfg": {"image_size": 224, "layers": 32, "width": 1280, "head_width": 80,
                       "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 1024, "heads": 16,
                     "layers": 24},
    },
    # OpenAI's CLIP ViT-L/14 (the LAION aesthetic predictor's features; QuickGELU).
    "ViT-L-14-quickgelu": {
        "embed_dim": 768, "quick_gelu": True,
        "vision_cfg": {"image_size": 224, "layers": 24, "width": 1024, "patch_size": 14},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 768, "heads": 12,
                     "layers": 12},
    },
}
# DFN5B-CLIP-ViT-H-14 (the CLIP-score reward) is ViT-H-14 trained with QuickGELU.
OPEN_CLIP_CONFIGS["ViT-H-14-quickgelu"] = dict(OPEN_CLIP_CONFIGS["ViT-H-14"], quick_gelu=True)
OPEN_CLIP_CONFIGS["ViT-L-14"] = dict(OPEN_CLIP_CONFIGS["ViT-L-14-quickgelu"], quick_gelu=False)


def vit_h_14(quick_gelu: bool = False, **overrides) -> CLIPConfig:
    """OpenCLIP ViT-H-14 (HPS-v2.1; with quick_gelu: DFN5B-CLIP-ViT-H-14): ≈ 986M parameters."""
    return config_from_open_clip(
        OPEN_CLIP_CONFIGS["ViT-H-14-quickgelu" if quick_gelu else "ViT-H-14"], **overrides)


def clip_l14_text(**overrides) -> CLIPConfig:
    """FLUX.1's `text_encoder/`: transformers CLIPTextModel of openai/clip-vit-large-patch14
    (768 wide, 12 layers, no projection, legacy eos_token_id 2 → argmax pooling): ≈ 123M."""
    text = TextConfig(width=768, heads=12, layers=12, mlp_dim=3072, act="quick_gelu",
                      pool="argmax", eos_token_id=2)
    return dataclasses.replace(CLIPConfig(text=text, vision=None, projection_dim=None,
                                          logit_scale=False), **overrides)


# ---------------------------------------------------------------------------------------------
# Layers.


def _linear(din: int, dout: int, axes: tuple, cfg: CLIPConfig, rngs: nnx.Rngs,
            use_bias: bool = True) -> nnx.Linear:
    return nnx.Linear(din, dout, use_bias=use_bias, dtype=to_dtype(cfg.dtype),
                      param_dtype=to_dtype(cfg.param_dtype), rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02),
                      kernel_metadata={"logical_axes": axes},
                      bias_metadata={"logical_axes": (axes[1],)})


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, cfg: CLIPConfig,
           std: float = 0.02) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, to_dtype(cfg.param_dtype))
    return nnx.Param(value, logical_axes=axes)


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias over the last dim, statistics in float32 (two-pass
    variance, as torch computes it), output in the activations' dtype."""

    def __init__(self, dim: int, eps: float, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, epsilon=eps, dtype=jnp.float32,
                                  param_dtype=to_dtype(cfg.param_dtype), use_fast_variance=False,
                                  rngs=rngs, scale_metadata={"logical_axes": ("embed",)},
                                  bias_metadata={"logical_axes": ("embed",)})

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(x.astype(jnp.float32)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class _BlockShape:
    width: int
    heads: int
    mlp_dim: int
    act: str
    eps: float


class Attention(nnx.Module):
    """Multi-head self-attention with separate q, k, v projections (tensor parallelism splits
    whole heads); the fused OpenCLIP in_proj is split into them at load time."""

    def __init__(self, shape: _BlockShape, cfg: CLIPConfig, rngs: nnx.Rngs):
        d = shape.width
        self.q = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.k = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.v = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.out = _linear(d, d, ("heads", "embed"), cfg, rngs)
        self.heads = shape.heads
        self.impl = cfg.attention_impl

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        """x [B, S, D], mask [1, 1, S, S] bool (True = attend) or None → [B, S, D]."""
        b, s, _ = x.shape
        q, k, v = (proj(x).reshape(b, s, self.heads, -1) for proj in (self.q, self.k, self.v))
        out = dot_product_attention(q, k, v, self.impl, mask=mask)
        return self.out(out.reshape(b, s, -1))


class MLP(nnx.Module):
    """Linear → GELU (exact) or QuickGELU → Linear."""

    def __init__(self, shape: _BlockShape, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.fc1 = _linear(shape.width, shape.mlp_dim, ("embed", "mlp"), cfg, rngs)
        self.fc2 = _linear(shape.mlp_dim, shape.width, ("mlp", "embed"), cfg, rngs)
        self.act = shape.act

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class ResidualBlock(nnx.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)); x + mlp(ln_2(x))."""

    def __init__(self, shape: _BlockShape, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.ln_1 = LayerNorm(shape.width, shape.eps, cfg, rngs)
        self.attn = Attention(shape, cfg, rngs)
        self.ln_2 = LayerNorm(shape.width, shape.eps, cfg, rngs)
        self.mlp = MLP(shape, cfg, rngs)

    def __call__(self, x: jax.Array, mask: jax.Array | None) -> jax.Array:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


def _stacked_blocks(shape: _BlockShape, count: int, cfg: CLIPConfig, rngs: nnx.Rngs):
    """`count` blocks with parameters stacked on a leading "layers" axis."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0,
              transform_metadata={nnx.PARTITION_NAME: None, "logical_axes": "layers"})
    def make(rngs):
        return ResidualBlock(shape, cfg, rngs)

    return make(rngs)


def _run_blocks(blocks: nnx.Module, x: jax.Array, mask, count: int, scan: bool) -> jax.Array:
    graphdef, state = nnx.split(blocks)

    def body(x, layer_state):
        return nnx.merge(graphdef, layer_state)(x, mask), None

    if scan:
        return jax.lax.scan(body, x, state)[0]
    for layer in range(count):
        x, _ = body(x, jax.tree.map(lambda a, layer=layer: a[layer], state))
    return x


def _block_shape(tower: TextConfig | VisionConfig) -> _BlockShape:
    return _BlockShape(tower.width, tower.heads, tower.mlp_dim, tower.act, tower.eps)


# ---------------------------------------------------------------------------------------------
# Towers.


class TextTransformer(nnx.Module):
    """CLIP's text tower: `(input_ids [B, T]) -> (last_hidden_state [B, T, D], pooled [B, D])`.

    T ≤ context_length; position embeddings [0, T) are used. The mask is causal only (no padding
    mask): tokens after the end-of-text token never reach the pooled output, so padding with 0
    (OpenCLIP) or with the EOT id (transformers) gives the same pooled features.
    """

    def __init__(self, tc: TextConfig, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.tc = tc
        self.scan = cfg.scan_layers
        self.dtype = to_dtype(cfg.dtype)
        # The vocabulary dim stays whole (no rule shards it); the width follows "embed".
        self.token_embedding = _param(rngs, (tc.vocab_size, tc.width), (None, "embed"), cfg)
        self.position_embedding = _param(rngs, (tc.context_length, tc.width), (None, "embed"),
                                         cfg, std=0.01)
        self.blocks = _stacked_blocks(_block_shape(tc), tc.layers, cfg, rngs)
        self.final_ln = LayerNorm(tc.width, tc.eps, cfg, rngs)

    def pool_index(self, input_ids: jax.Array) -> jax.Array:
        """[B] position of the end-of-text token (see TextConfig.pool)."""
        if self.tc.pool == "argmax":
            return jnp.argmax(input_ids, axis=-1)
        return jnp.argmax((input_ids == self.tc.eos_token_id).astype(jnp.int32), axis=-1)

    def __call__(self, input_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {input_ids.shape}.")
        length = input_ids.shape[1]
        if length > self.tc.context_length:
            raise ValueError(f"{length} tokens exceed the context length {self.tc.context_length}; "
                             f"tokenize with max_length={self.tc.context_length} and truncation.")
        table = self.token_embedding[...].astype(self.dtype)
        x = jnp.take(table, input_ids, axis=0)
        x = x + self.position_embedding[...][:length].astype(self.dtype)
        causal = jnp.tril(jnp.ones((length, length), jnp.bool_))[None, None]
        x = _run_blocks(self.blocks, x, causal, self.tc.layers, self.scan)
        x = self.final_ln(x)
        index = self.pool_index(input_ids)
        pooled = jnp.take_along_axis(x, index[:, None, None], axis=1)[:, 0]
        return x, pooled


class VisionTransformer(nnx.Module):
    """CLIP's ViT: `(pixels [B, S, S, 3]) -> (last_hidden_state [B, 1 + N, D], pooled [B, D])`.

    Pixels are normalised and channels-last. last_hidden_state is the blocks' output before the
    post LayerNorm (as transformers returns it); pooled is the post-LayerNormed class token.
    """

    def __init__(self, vc: VisionConfig, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.vc = vc
        self.scan = cfg.scan_layers
        self.dtype = to_dtype(cfg.dtype)
        p = vc.patch_size
        # PyTorch's Conv2d layout [D, 3, P, P], so both checkpoint layouts load it verbatim.
        self.patch_embedding = _param(rngs, (vc.width, 3, p, p), ("embed", None, None, None), cfg)
        self.class_embedding = _param(rngs, (vc.width,), ("embed",), cfg)
        self.position_embedding = _param(rngs, (vc.num_patches + 1, vc.width), (None, "embed"),
                                         cfg)
        self.pre_ln = LayerNorm(vc.width, vc.eps, cfg, rngs)
        self.blocks = _stacked_blocks(_block_shape(vc), vc.layers, cfg, rngs)
        self.post_ln = LayerNorm(vc.width, vc.eps, cfg, rngs)

    def embed_patches(self, pixels: jax.Array) -> jax.Array:
        """[B, S, S, 3] → [B, (S/P)², D], patches in row-major order (the conv's flatten)."""
        b, h, w, c = pixels.shape
        p, g = self.vc.patch_size, self.vc.image_size // self.vc.patch_size
        patches = pixels.astype(self.dtype).reshape(b, g, p, g, p, c)
        kernel = self.patch_embedding[...].astype(self.dtype)
        return jnp.einsum("bipjqc,dcpq->bijd", patches, kernel).reshape(b, g * g, -1)

    def __call__(self, pixels: jax.Array) -> tuple[jax.Array, jax.Array]:
        pixels = jnp.asarray(pixels)
        size = self.vc.image_size
        if pixels.ndim != 4 or pixels.shape[1:] != (size, size, 3):
            raise ValueError(f"pixels must be [batch, {size}, {size}, 3] (normalised, channels "
                             f"last), got shape {pixels.shape}; resize / crop first (see "
                             "rewards.clip_rewards.preprocess).")
        x = self.embed_patches(pixels)
        cls = jnp.broadcast_to(self.class_embedding[...].astype(self.dtype),
                               (x.shape[0], 1, x.shape[-1]))
        x = jnp.concatenate([cls, x], axis=1) + self.position_embedding[...].astype(self.dtype)
        x = self.pre_ln(x)
        x = _run_blocks(self.blocks, x, None, self.vc.layers, self.scan)
        return x, self.post_ln(x[:, 0])


class CLIP(nnx.Module):
    """Text and/or image tower, their projections and the temperature (see the module doc)."""

    def __init__(self, cfg: CLIPConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.text_model = TextTransformer(cfg.text, cfg, rngs) if cfg.text else None
        self.vision_model = VisionTransformer(cfg.vision, cfg, rngs) if cfg.vision else None
        e = cfg.projection_dim
        self.text_projection = (_linear(cfg.text.width, e, ("embed", None), cfg, rngs, False)
                                if cfg.text and e else None)
        self.visual_projection = (_linear(cfg.vision.width, e, ("embed", None), cfg, rngs, False)
                                  if cfg.vision and e else None)
        self.logit_scale = (nnx.Param(jnp.asarray(math.log(1 / 0.07), to_dtype(cfg.param_dtype)),
                                      logical_axes=()) if cfg.logit_scale else None)

    def _need(self, what: str, present) -> None:
        if present is None:
            raise ValueError(f"This CLIP model has no {what} (config: {self.cfg}); load a "
                             "checkpoint that has it or leave it in `towers`.")

    def encode_text(self, input_ids: jax.Array) -> jax.Array:
        """[B, T] token ids → [B, E] text embeddings (projected pooled output, not normalised)."""
        self._need("text tower", self.text_model)
        self._need("text projection", self.text_projection)
        return self.text_projection(self.text_model(input_ids)[1])

    def encode_image(self, pixels: jax.Array) -> jax.Array:
        """[B, S, S, 3] normalised pixels → [B, E] image embeddings (not normalised)."""
        self._need("image tower", self.vision_model)
        self._need("visual projection", self.visual_projection)
        return self.visual_projection(self.vision_model(pixels)[1])

    def __call__(self, input_ids: jax.Array, pixels: jax.Array) -> jax.Array:
        """logits_per_image [B_img, B_txt] = exp(logit_scale) · cos(image_i, text_j)."""
        self._need("logit_scale", self.logit_scale)
        image = l2_normalize(self.encode_image(pixels).astype(jnp.float32))
        text = l2_normalize(self.encode_text(input_ids).astype(jnp.float32))
        return jnp.exp(self.logit_scale[...].astype(jnp.float32)) * image @ text.T


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-12) -> jax.Array:
    """x / max(‖x‖, eps), as torch.nn.functional.normalize."""
    norm = jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))
    return x / jnp.maximum(norm, eps)


# ---------------------------------------------------------------------------------------------
# Construction and parameter counts.


def abstract_model(cfg: CLIPConfig) -> CLIP:
    """The model with ShapeDtypeStruct parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: CLIP(cfg, rngs=nnx.Rngs(0)))


def count_params(cfg: CLIPConfig) -> int:
    """Number of parameters, from shapes only (`jax.eval_shape`)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


# ---------------------------------------------------------------------------------------------
# Checkpoint views and key maps.


class CheckpointView:
    """A checkpoint with some tensors hidden, so `weights.load_state` neither needs nor reports
    them: non-parameter buffers (`position_ids`), or the tower a model leaves out."""

    def __init__(self, checkpoint, keep: Callable[[str], bool]):
        self._checkpoint = checkpoint
        self._keys = [k for k in checkpoint.keys() if keep(k)]
        self._key_set = set(self._keys)
        self.path = checkpoint.path

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._key_set

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._checkpoint.shape(key)

    def array(self, key: str) -> np.ndarray:
        return self._checkpoint.array(key)

    def __getitem__(self, key: str) -> np.ndarray:
        return self.array(key)


Source = weights.TensorSource


def _linear_sources(key: str, bias: bool = True) -> dict:
    """A PyTorch Linear ([out, in] weight) as our [in, out] kernel (and bias)."""
    out = {"kernel": Source(f"{key}.weight", transpose=True)}
    if bias:
        out["bias"] = Source(f"{key}.bias")
    return out


def _ln_sources(key: str) -> dict:
    return {"norm": {"scale": Source(f"{key}.weight"), "bias": Source(f"{key}.bias")}}


def _hf_layer(prefix: str) -> dict:
    return {
        "ln_1": _ln_sources(f"{prefix}.layer_norm1"),
        "attn": {name: _linear_sources(f"{prefix}.self_attn.{name}_proj")
                 for name in ("q", "k", "v", "out")},
        "ln_2": _ln_sources(f"{prefix}.layer_norm2"),
        "mlp": {"fc1": _linear_sources(f"{prefix}.mlp.fc1"),
                "fc2": _linear_sources(f"{prefix}.mlp.fc2")},
    }


def _open_clip_layer(prefix: str, width: int) -> dict:
    rows = {"q": ((0, width),), "k": ((width, 2 * width),), "v": ((2 * width, 3 * width),)}
    attn = {name: {"kernel": Source(f"{prefix}.attn.in_proj_weight", rows=r, transpose=True),
                   "bias": Source(f"{prefix}.attn.in_proj_bias", rows=r)}
            for name, r in rows.items()}
    attn["out"] = _linear_sources(f"{prefix}.attn.out_proj")
    return {
        "ln_1": _ln_sources(f"{prefix}.ln_1"),
        "attn": attn,
        "ln_2": _ln_sources(f"{prefix}.ln_2"),
        "mlp": {"fc1": _linear_sources(f"{prefix}.mlp.c_fc"),
                "fc2": _linear_sources(f"{prefix}.mlp.c_proj")},
    }


def _hf_prefixes(keys) -> tuple[str | None, str | None]:
    """The text / vision towers' key prefixes: "text_model." / "vision_model." (CLIPModel, and
    CLIPTextModel / CLIPVisionModel saved by transformers 4), "" (those two saved by
    transformers 5, which dropped the prefix), or None (no such tower)."""
    keys = set(keys)
    text = ("text_model." if "text_model." + _HF_BARE_TEXT_KEY in keys
            else "" if _HF_BARE_TEXT_KEY in keys else None)
    vision = ("vision_model." if "vision_model." + _HF_BARE_VISION_KEY in keys
              else "" if _HF_BARE_VISION_KEY in keys else None)
    return text, vision


def _hf_key_map(cfg: CLIPConfig, text_prefix: str = "text_model.",
                vision_prefix: str = "vision_model."):
    """Our parameter tree → transformers CLIP keys; per-layer parts as functions of the layer."""
    top: dict[str, Any] = {}
    layers: dict[str, Callable[[int], dict]] = {}
    if cfg.text:
        t = text_prefix or ""
        top["text_model"] = {
            "token_embedding": Source(f"{t}embeddings.token_embedding.weight"),
            "position_embedding": Source(f"{t}embeddings.position_embedding.weight"),
            "final_ln": _ln_sources(f"{t}final_layer_norm"),
        }
        layers["text_model.blocks"] = lambda i: _hf_layer(f"{t}encoder.layers.{i}")
    if cfg.vision:
        v = vision_prefix or ""
        top["vision_model"] = {
            "patch_embedding": Source(f"{v}embeddings.patch_embedding.weight"),
            "class_embedding": Source(f"{v}embeddings.class_embedding"),
            "position_embedding": Source(f"{v}embeddings.position_embedding.weight"),
            "pre_ln": _ln_sources(f"{v}pre_layrnorm"),  # sic: transformers' spelling
            "post_ln": _ln_sources(f"{v}post_layernorm"),
        }
        layers["vision_model.blocks"] = lambda i: _hf_layer(f"{v}encoder.layers.{i}")
    top["text_projection"] = _linear_sources("text_projection", bias=False)
    top["visual_projection"] = _linear_sources("visual_projection", bias=False)
    top["logit_scale"] = Source("logit_scale")
    return top, layers


def _open_clip_key_map(cfg: CLIPConfig):
    """Our parameter tree → OpenCLIP / OpenAI CLIP keys."""
    top: dict[str, Any] = {}
    layers: dict[str, Callable[[int], dict]] = {}
    if cfg.text:
        w = cfg.text.width
        top["text_model"] = {
            "token_embedding": Source("token_embedding.weight"),
            "position_embedding": Source("positional_embedding"),
            "final_ln": _ln_sources("ln_final"),
        }
        layers["text_model.blocks"] = lambda i: _open_clip_layer(f"transformer.resblocks.{i}", w)
        # A bare [D, E] parameter used as x @ P: already our kernel's layout.
        top["text_projection"] = {"kernel": Source("text_projection")}
    if cfg.vision:
        vw = cfg.vision.width
        top["vision_model"] = {
            "patch_embedding": Source("visual.conv1.weight"),
            "class_embedding": Source("visual.class_embedding"),
            "position_embedding": Source("visual.positional_embedding"),
            "pre_ln": _ln_sources("visual.ln_pre"),
            "post_ln": _ln_sources("visual.ln_post"),
        }
        layers["vision_model.blocks"] = (
            lambda i: _open_clip_layer(f"visual.transformer.resblocks.{i}", vw))
        top["visual_projection"] = {"kernel": Source("visual.proj")}
    top["logit_scale"] = Source("logit_scale")
    return top, layers


def _lookup(tree: Mapping, names: list[str]):
    node = tree
    for name in names:
        node = node[name]
    if not isinstance(node, Source):
        raise KeyError(".".join(names))
    return node


def _source_fn(key_map):
    top, layers = key_map

    def source(path: tuple[str, ...]):
        name = ".".join(path)
        for prefix, per_layer in layers.items():
            if name.startswith(prefix + "."):
                rest = name[len(prefix) + 1:].split(".")
                return lambda layer: _lookup(per_layer(layer), rest)
        return _lookup(top, list(path))

    return source


# Tensors in public checkpoints that are buffers or metadata, not parameters.
_IGNORED_SUFFIXES = ("position_ids", "attn_mask")
_IGNORED_KEYS = ("input_resolution", "context_length", "vocab_size")


def _tower_keys(layout: str, keys):
    """(is a text-tower key, is a vision-tower key) predicates for a layout."""
    if layout == "transformers":
        text_prefix, vision_prefix = _hf_prefixes(keys)
        # A prefix-less checkpoint holds one tower only: all its keys belong to that tower.
        return (lambda k: (k.startswith("text_model.") or k == "text_projection.weight"
                           or text_prefix == ""),
                lambda k: (k.startswith("vision_model.") or k == "visual_projection.weight"
                           or vision_prefix == ""))
    return (lambda k: not k.startswith("visual.") and k != "logit_scale",
            lambda k: k.startswith("visual."))


def _view(checkpoint, layout: str, cfg: CLIPConfig) -> CheckpointView:
    is_text, is_vision = _tower_keys(layout, checkpoint.keys())

    def keep(key: str) -> bool:
        if key.endswith(_IGNORED_SUFFIXES) or key in _IGNORED_KEYS:
            return False
        if key == "logit_scale":
            return cfg.logit_scale
        if is_vision(key):
            return cfg.vision is not None
        if is_text(key):
            return cfg.text is not None
        return True

    return CheckpointView(checkpoint, keep)


def detect_layout(checkpoint) -> str:
    """"transformers" or "open_clip" from the tensor names."""
    keys = set(checkpoint.keys())
    if any(k in keys for k in (_HF_TEXT_KEY, _HF_VISION_KEY, _HF_BARE_TEXT_KEY,
                               _HF_BARE_VISION_KEY)):
        return "transformers"
    if _OC_TEXT_KEY in keys or _OC_VISION_KEY in keys:
        return "open_clip"
    raise ValueError(
        f"{checkpoint.path} is not a CLIP checkpoint this loader knows: expected "
        f"{_HF_TEXT_KEY!r} / {_HF_VISION_KEY!r} (transformers) or {_OC_TEXT_KEY!r} / "
        f"{_OC_VISION_KEY!r} (OpenCLIP); first keys: {sorted(keys)[:8]}.")


# ---------------------------------------------------------------------------------------------
# Configs from checkpoints.


def config_from_transformers(values: Mapping[str, Any], checkpoint=None) -> CLIPConfig:
    """A CLIPConfig from a transformers config.json (model_type clip, clip_text_model or
    clip_vision_model). Whether projections exist is read from the checkpoint when given
    (CLIPTextModel and CLIPTextModelWithProjection share model_type and config)."""
    model_type = values.get("model_type", "clip")

    def sub(name: str) -> dict:
        return dict(values.get(name) or values.get(f"{name}_dict") or {})

    if model_type == "clip":
        text_values, vision_values = sub("text_config"), sub("vision_config")
    elif model_type == "clip_text_model":
        text_values, vision_values = dict(values), None
    elif model_type == "clip_vision_model":
        text_values, vision_values = None, dict(values)
    else:
        raise ValueError(f"config.json has model_type {model_type!r}; expected 'clip', "
                         "'clip_text_model' or 'clip_vision_model'.")
    text = vision = None
    if text_values is not None:
        eos = int(text_values.get("eos_token_id", 49407))
        text = TextConfig(
            vocab_size=int(text_values.get("vocab_size", 49408)),
            width=int(text_values.get("hidden_size", 512)),
            heads=int(text_values.get("num_attention_heads", 8)),
            layers=int(text_values.get("num_hidden_layers", 12)),
            mlp_dim=int(text_values.get("intermediate_size", 2048)),
            context_length=int(text_values.get("max_position_embeddings", 77)),
            act=text_values.get("hidden_act", "quick_gelu"),
            eps=float(text_values.get("layer_norm_eps", 1e-5)),
            # transformers' rule: the legacy eos_token_id 2 means "pool at the largest id".
            pool="argmax" if eos == 2 else "eos", eos_token_id=eos)
    if vision_values is not None:
        if int(vision_values.get("num_channels", 3)) != 3:
            raise ValueError("Only 3-channel CLIP image towers are supported.")
        vision = VisionConfig(
            width=int(vision_values.get("hidden_size", 768)),
            heads=int(vision_values.get("num_attention_heads", 12)),
            layers=int(vision_values.get("num_hidden_layers", 12)),
            mlp_dim=int(vision_values.get("intermediate_size", 3072)),
            patch_size=int(vision_values.get("patch_size", 32)),
            image_size=int(vision_values.get("image_size", 224)),
            act=vision_values.get("hidden_act", "quick_gelu"),
            eps=float(vision_values.get("layer_norm_eps", 1e-5)))
    projection_dim = int(values.get("projection_dim", 512))
    if model_type == "clip":
        has_projection, has_scale = True, True
    else:
        key = "text_projection.weight" if text else "visual_projection.weight"
        architectures = values.get("architectures") or []
        has_projection = (key in checkpoint if checkpoint is not None
                          else any(a.endswith("WithProjection") for a in architectures))
        has_scale = False
    return CLIPConfig(text=text, vision=vision,
                      projection_dim=projection_dim if has_projection else None,
                      logit_scale=has_scale)


# Head widths of OpenCLIP ViTs that are not 64 (they cannot be read off tensor shapes).
_VISION_HEAD_WIDTH = {1280: 80, 1408: 88, 1664: 104}


def config_from_open_clip_checkpoint(checkpoint, quick_gelu: bool = False,
                                     vision_head_width: int | None = None,
                                     text_head_width: int = 64) -> CLIPConfig:
    """Infers an OpenCLIP CLIPConfig from tensor shapes.

    Shapes cannot tell the activation (QuickGELU for OpenAI and DFN5B models, GELU for
    LAION / HPS: pass `quick_gelu`) nor the head counts: text heads are width / 64 (every
    OpenCLIP text tower), vision heads width / head width with the head widths of open_clip's
    configs (80 for ViT-H, 88 for ViT-g, 104 for ViT-bigG, else 64) unless given.
    """
    keys = set(checkpoint.keys())

    def count(prefix: str) -> int:
        return len({k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)})

    def heads(width: int, head_width: int, tower: str) -> int:
        if width % head_width:
            raise ValueError(f"Cannot infer the {tower} tower's heads: width {width} is not a "
                             f"multiple of the head width {head_width}; pass config= (a name in "
                             "OPEN_CLIP_CONFIGS, an OpenCLIP model-config dict or a CLIPConfig).")
        return width // head_width

    act = "quick_gelu" if quick_gelu else "gelu"
    text = vision = None
    if _OC_TEXT_KEY in keys:
        vocab, width = checkpoint.shape(_OC_TEXT_KEY)
        text = TextConfig(vocab_size=vocab, width=width, heads=heads(width, text_head_width, "text"),
                          layers=count("transformer.resblocks."),
                          mlp_dim=checkpoint.shape("transformer.resblocks.0.mlp.c_fc.weight")[0],
                          context_length=checkpoint.shape("positional_embedding")[0], act=act,
                          pool="argmax")
    if _OC_VISION_KEY in keys:
        width, _, patch, _ = checkpoint.shape(_OC_VISION_KEY)
        grid = math.isqrt(checkpoint.shape("visual.positional_embedding")[0] - 1)
        head_width = vision_head_width or _VISION_HEAD_WIDTH.get(width, 64)
        vision = VisionConfig(
            width=width, heads=heads(width, head_width, "image"),
            layers=count("visual.transformer.resblocks."),
            mlp_dim=checkpoint.shape("visual.transformer.resblocks.0.mlp.c_fc.weight")[0],
            patch_size=patch, image_size=grid * patch, act=act)
    projection = None
    if "text_projection" in keys:
        projection = checkpoint.shape("text_projection")[-1]
    elif "visual.proj" in keys:
        projection = checkpoint.shape("visual.proj")[-1]
    return CLIPConfig(text=text, vision=vision, projection_dim=projection,
                      logit_scale="logit_scale" in keys)


# ---------------------------------------------------------------------------------------------
# PyTorch pickles → safetensors.


def _torch_to_numpy(tensor) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def convert_torch_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None,
                             overwrite: bool = False) -> Path:
    """Converts a PyTorch state dict (.pt / .bin / .pth) to safetensors, once.

    Reads plain state dicts, `{"state_dict": ...}` wrappers (HPS-v2.1's
    HPS_v2.1_compressed.pt), DataParallel "module." prefixes and TorchScript archives (OpenAI's
    ViT-L-14.pt). Non-tensor entries are dropped. Needs torch, imported only here.

    Args:
      src: the PyTorch file.
      dst: the safetensors file to write; default: beside src with the suffix .safetensors.
      overwrite: rewrite dst even if it exists and is newer than src.

    Returns:
      dst.
    """
    src = Path(src)
    dst = Path(dst) if dst is not None else src.with_suffix(".safetensors")
    if dst.exists() and not overwrite and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    try:
        import torch
    except ImportError:
        raise ImportError(f"Reading the PyTorch checkpoint {src} needs torch (pip install torch), "
                          "or convert it to safetensors on a machine that has it: "
                          "python -m g2rpo_jax.models.clip convert SRC DST") from None
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as load_error:  # TorchScript archives are not pickled state dicts.
        try:
            obj = torch.jit.load(src, map_location="cpu").state_dict()
        except Exception:
            raise ValueError(f"Cannot read {src} as a PyTorch state dict: {load_error}") from None
    if not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)):
        obj = obj.state_dict()  # torch.load handed a TorchScript archive to torch.jit.load
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{src} holds a {type(obj).__name__}, not a state dict of tensors.")
    tensors = {}
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            tensors[key[len("module."):] if key.startswith("module.") else key] = (
                _torch_to_numpy(value))
    if not tensors:
        raise ValueError(f"{src} has no tensors (keys: {list(obj)[:8]}).")
    try:
        return write_safetensors(dst, tensors)
    except PermissionError:
        raise PermissionError(f"Cannot write {dst}; pass dst= a writable path.") from None


def open_checkpoint(path: str | os.PathLike) -> weights.SafetensorsCheckpoint:
    """A safetensors file or folder; a PyTorch pickle is converted beside it first."""
    path = Path(path)
    if path.is_file() and path.suffix in _TORCH_SUFFIXES:
        path = convert_torch_checkpoint(path)
    return weights.SafetensorsCheckpoint(path)


# ---------------------------------------------------------------------------------------------
# Loading.


def _resolve(path: Path, config) -> tuple[weights.SafetensorsCheckpoint, str, CLIPConfig | None]:
    """(checkpoint, layout, config or None to infer) for a file or folder."""
    if path.is_dir():
        open_clip_json = path / "open_clip_config.json"
        if open_clip_json.exists():
            files = [path / name for name in ("open_clip_model.safetensors",
                                              "open_clip_pytorch_model.bin")]
            found = next((f for f in files if f.exists()), None)
            if found is None:
                raise FileNotFoundError(f"{path} has open_clip_config.json but neither "
                                        f"{[f.name for f in files]}.")
            if config is None:
                config = json.loads(open_clip_json.read_text())["model_cfg"]
            path = found
        elif (path / "config.json").exists():
            checkpoint = weights.SafetensorsCheckpoint(path, prefix="model")
            if config is None:
                config = config_from_transformers(json.loads((path / "config.json").read_text()),
                                                  checkpoint)
            return checkpoint, detect_layout(checkpoint), config
    if not path.exists():
        raise FileNotFoundError(f"No CLIP checkpoint at {path}: give a transformers folder "
                                "(config.json + model.safetensors), an OpenCLIP folder "
                                "(open_clip_config.json + weights), or a .safetensors / .pt file.")
    checkpoint = open_checkpoint(path)
    layout = detect_layout(checkpoint)
    if config is None and layout == "transformers" and (path.parent / "config.json").exists():
        config = config_from_transformers(json.loads((path.parent / "config.json").read_text()),
                                          checkpoint)
    return checkpoint, layout, config


def _as_config(config, checkpoint, layout) -> CLIPConfig:
    if isinstance(config, CLIPConfig):
        return config
    if isinstance(config, str):
        if config not in OPEN_CLIP_CONFIGS:
            raise ValueError(f"Unknown CLIP config {config!r}; named configs: "
                             f"{sorted(OPEN_CLIP_CONFIGS)} (or pass a CLIPConfig / OpenCLIP dict).")
        return config_from_open_clip(OPEN_CLIP_CONFIGS[config])
    if isinstance(config, Mapping):
        return config_from_open_clip(config)
    if layout == "open_clip":
        return config_from_open_clip_checkpoint(checkpoint)
    raise ValueError(f"No config for the transformers-layout checkpoint {checkpoint.path}: put its "
                     "config.json beside it or pass config=CLIPConfig(...).")


def from_pretrained(path: str | os.PathLike, config: CLIPConfig | str | Mapping | None = None, *,
                    towers: tuple[str, ...] | None = None, dtype: str | None = None,
                    mesh: jax.sharding.Mesh | None = None, rules=sharding_lib.DEFAULT_RULES,
                    **overrides) -> CLIP:
    """Loads a CLIP checkpoint (transformers or OpenCLIP layout), straight into shardings.

    Args:
      path: a transformers folder (config.json + model.safetensors or a sharded index), an
        OpenCLIP hub folder (open_clip_config.json + open_clip_model.safetensors or
        open_clip_pytorch_model.bin), or a single .safetensors / .pt / .bin / .pth file
        (PyTorch files are converted once to a .safetensors beside them).
      config: a CLIPConfig, an OpenCLIP model-config dict or a name in OPEN_CLIP_CONFIGS
        ("ViT-H-14" for HPS-v2.1, "ViT-H-14-quickgelu" for DFN5B, "ViT-L-14-quickgelu" for
        OpenAI's ViT-L/14); None reads config.json / open_clip_config.json or infers an OpenCLIP
        config from the shapes (GELU; see config_from_open_clip_checkpoint).
      towers: ("text",), ("vision",) or both (default: the config's); a left-out tower's
        tensors (and logit_scale) are ignored in the file.
      dtype: activations' dtype ("bfloat16", ...); parameters stay `param_dtype` (float32).
      mesh, rules: assemble each parameter directly into its NamedSharding on this mesh.
      **overrides: CLIPConfig fields (param_dtype, scan_layers, attention_impl, ...).

    Raises:
      FileNotFoundError: nothing loadable at path.
      weights.CheckpointMismatchError: missing, unused or mis-shaped tensors, each named with
        both shapes.
    """
    checkpoint, layout, found = _resolve(Path(os.fspath(path)), config)
    cfg = _as_config(found, checkpoint, layout)
    if towers is not None:
        unknown = set(towers) - {"text", "vision"}
        if unknown or not towers:
            raise ValueError(f"towers must be a non-empty subset of ('text', 'vision'), got "
                             f"{towers}.")
        missing = [t for t in towers if getattr(cfg, t) is None]
        if missing:
            raise ValueError(f"The checkpoint {checkpoint.path} has no {missing} tower(s).")
        cfg = dataclasses.replace(cfg, text=cfg.text if "text" in towers else None,
                                  vision=cfg.vision if "vision" in towers else None,
                                  logit_scale=cfg.logit_scale and len(towers) == 2)
    if dtype is not None:
        overrides["dtype"] = dtype
    cfg = dataclasses.replace(cfg, **overrides)
    key_map = (_hf_key_map(cfg, *_hf_prefixes(checkpoint.keys())) if layout == "transformers"
               else _open_clip_key_map(cfg))
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    shardings = (sharding_lib.state_shardings(abstract_state, mesh,
                                              sharding_lib.rules_from_config(rules))
                 if mesh is not None else None)
    state = weights.load_state(_view(checkpoint, layout, cfg), abstract_state,
                               _source_fn(key_map), shardings)
    return nnx.merge(graphdef, state)


def _main(argv: list[str]) -> int:
    usage = "usage: python -m g2rpo_jax.models.clip convert SRC.pt [DST.safetensors]"
    if len(argv) not in (2, 3) or argv[0] != "convert":
        print(usage, file=sys.stderr)
        return 2
    out = convert_torch_checkpoint(argv[1], argv[2] if len(argv) == 3 else None, overwrite=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
