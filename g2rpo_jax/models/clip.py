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

Weights of the public layouts (transformers, OpenCLIP / OpenAI) load with `models.clip_weights`;
a config is one of the named OpenCLIP ones here (`OPEN_CLIP_CONFIGS`), or read from a checkpoint
there.

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
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from g2rpo_jax.models import execution
from g2rpo_jax.models.attention import dot_product_attention


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
      attention: the attention kernel, models.attention.IMPLEMENTATIONS ("splash" takes no
        mask: the text tower needs "xla", "cudnn" or "auto").
    """

    text: TextConfig | None = dataclasses.field(default_factory=TextConfig)
    vision: VisionConfig | None = dataclasses.field(default_factory=VisionConfig)
    projection_dim: int | None = 512
    logit_scale: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    attention: str = "xla"

    def __post_init__(self):
        if self.text is None and self.vision is None:
            raise ValueError("A CLIPConfig needs at least one tower (text or vision).")
        execution.to_dtype(self.dtype), execution.to_dtype(self.param_dtype)


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
    return nnx.Linear(din, dout, use_bias=use_bias, dtype=execution.to_dtype(cfg.dtype),
                      param_dtype=execution.to_dtype(cfg.param_dtype), rngs=rngs,
                      kernel_init=nnx.initializers.normal(0.02),
                      kernel_metadata={"logical_axes": axes},
                      bias_metadata={"logical_axes": (axes[1],)})


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple, cfg: CLIPConfig,
           std: float = 0.02) -> nnx.Param:
    value = std * jax.random.normal(rngs.params(), shape, execution.to_dtype(cfg.param_dtype))
    return nnx.Param(value, logical_axes=axes)


class LayerNorm(nnx.Module):
    """LayerNorm with scale and bias over the last dim, statistics in float32 (two-pass
    variance, as torch computes it), output in the activations' dtype."""

    def __init__(self, dim: int, eps: float, cfg: CLIPConfig, rngs: nnx.Rngs):
        self.norm = nnx.LayerNorm(dim, epsilon=eps, dtype=jnp.float32,
                                  param_dtype=execution.to_dtype(cfg.param_dtype), use_fast_variance=False,
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
        self.impl = cfg.attention

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


def _block_shape(tower: TextConfig | VisionConfig) -> _BlockShape:
    return _BlockShape(tower.width, tower.heads, tower.mlp_dim, tower.act, tower.eps)


def _stacked_blocks(tower: TextConfig | VisionConfig, cfg: CLIPConfig, rngs: nnx.Rngs):
    """The tower's blocks, parameters stacked on a leading "layers" axis."""
    shape = _block_shape(tower)
    return execution.stacked(lambda r: ResidualBlock(shape, cfg, r), tower.layers, rngs)


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
        self.dtype = execution.to_dtype(cfg.dtype)
        # The vocabulary dim stays whole (no rule shards it); the width follows "embed".
        self.token_embedding = _param(rngs, (tc.vocab_size, tc.width), (None, "embed"), cfg)
        self.position_embedding = _param(rngs, (tc.context_length, tc.width), (None, "embed"),
                                         cfg, std=0.01)
        self.blocks = _stacked_blocks(tc, cfg, rngs)
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
        (x,) = execution.run_stacked(self.blocks, (x,), (causal,), self.tc.layers, self.scan)
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
        self.dtype = execution.to_dtype(cfg.dtype)
        p = vc.patch_size
        # PyTorch's Conv2d layout [D, 3, P, P], so both checkpoint layouts load it verbatim.
        self.patch_embedding = _param(rngs, (vc.width, 3, p, p), ("embed", None, None, None), cfg)
        self.class_embedding = _param(rngs, (vc.width,), ("embed",), cfg)
        self.position_embedding = _param(rngs, (vc.num_patches + 1, vc.width), (None, "embed"),
                                         cfg)
        self.pre_ln = LayerNorm(vc.width, vc.eps, cfg, rngs)
        self.blocks = _stacked_blocks(vc, cfg, rngs)
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
        (x,) = execution.run_stacked(self.blocks, (x,), (None,), self.vc.layers, self.scan)
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
        self.logit_scale = (nnx.Param(jnp.asarray(math.log(1 / 0.07), execution.to_dtype(cfg.param_dtype)),
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
