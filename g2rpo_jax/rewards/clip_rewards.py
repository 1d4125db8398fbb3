"""Human-preference rewards built on CLIP: HPS-v2.1, CLIP score, PickScore, LAION aesthetics.

Every reward is `reward_fn(images [B, H, W, 3] float in [0, 1], prompts: list[str]) -> [B]`
(float32). Prompts are tokenized on the host; everything after that is one jitted function of
the images, so `reward.apply(reward.state, images, input_ids)` can sit inside a larger jit (pass
the state as an argument, not as a closed-over constant).

Preprocessing follows each reward's reference pipeline (see `Preprocess`):

| reward | model | resize | crop | scoring |
|---|---|---|---|---|
| hps | HPS-v2.1, OpenCLIP ViT-H-14 | shortest side → 224, bicubic | centre, torchvision rounding | img·txt of L2-normalised features (no scale) |
| clip_score | DFN5B-CLIP-ViT-H-14 (QuickGELU) | both sides → 224 ("squash") | none | cosine |
| pickscore | PickScore_v1, transformers CLIPModel ViT-H-14 | shortest side → 224, bicubic | centre, transformers rounding (floor) | exp(logit_scale) · cosine (≈ 100·cos; papers often report /100) |
| aesthetic | OpenAI CLIP ViT-L/14 + LAION MLP | shortest side → 224, bicubic | centre, torchvision rounding | MLP(normalised image embedding) |

All normalise with the OpenAI CLIP mean / std.

Resizing: the references resize 8-bit PIL images with PIL's antialiased bicubic (a = -0.5,
the kernel widened by the downscale factor), in fixed point, horizontally then vertically, each
pass rounded and clamped to 8 bits. `Preprocess(resample="pil")` (the default) does exactly that
in JAX (integer arithmetic, the same coefficients), so the pixels equal the references'.
`resample="float"` uses `jax.image.resize(method="bicubic", antialias=True)`: the same filter and
sample positions in float (differentiable); it matches PIL run in float mode and torch's
antialiased bicubic to ~1e-5, and differs from the 8-bit references by their rounding and by
their clamping of bicubic overshoot. Both are measured in tests/rewards/test_clip_rewards.py
(printed with `-s`). The exact path runs two int32 matmuls per image (12 images of 720² took
0.74 s on 2 CPU cores against 0.32 s for "float"; nothing next to a ViT-H forward pass).
Checkpoints are read as safetensors only, without torch and without writing beside them: the
published PyTorch files (HPS-v2.1's .pt, OpenAI's ViT-L-14.pt, the aesthetic head's .pth, an
OpenCLIP folder's .bin) are converted once by `python -m g2rpo_jax.convert SRC [DST]`
(`models/torch_checkpoints.py`).
"""

from collections.abc import Sequence
import dataclasses
import json
import os
from pathlib import Path

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.models import clip, clip_text, clip_weights, weights
from g2rpo_jax.parallel import sharding as sharding_lib

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclasses.dataclass(frozen=True)
class Preprocess:
    """Image preprocessing of one reward model (static: it fixes shapes).

    Attributes:
      size: the model's input side.
      resize_mode: "shortest" (shortest side → size keeping the aspect, the other side
        int(size · long / short) as torchvision and transformers compute it, then centre crop) or
        "squash" (both sides → size, no crop; OpenCLIP's resize_mode="squash").
      crop_rounding: where an odd margin goes: "round" (torchvision CenterCrop:
        round((H - size) / 2), half to even) or "floor" (transformers: (H - size) // 2).
      resample: "pil": PIL's 8-bit bicubic resize, exactly (the input is rounded to 8 bits, as
        the references' uint8 conversion does; not differentiable). "float":
        jax.image.resize's antialiased bicubic in float (differentiable; see the module doc).
      mean, std: per-channel normalisation.
    """

    size: int = 224
    resize_mode: str = "shortest"
    crop_rounding: str = "round"
    resample: str = "pil"
    mean: tuple[float, float, float] = OPENAI_CLIP_MEAN
    std: tuple[float, float, float] = OPENAI_CLIP_STD

    def __post_init__(self):
        if self.resample not in ("pil", "float"):
            raise ValueError(f"resample must be 'pil' or 'float', got {self.resample!r}.")
        if self.resize_mode not in ("shortest", "squash"):
            raise ValueError(f"resize_mode must be 'shortest' or 'squash', got {self.resize_mode!r}.")
        if self.crop_rounding not in ("round", "floor"):
            raise ValueError(f"crop_rounding must be 'round' or 'floor', got {self.crop_rounding!r}.")

    @classmethod
    def from_open_clip(cls, preprocess_cfg: dict, size: int) -> "Preprocess":
        """From `preprocess_cfg` of an OpenCLIP hub folder's open_clip_config.json."""
        interpolation = preprocess_cfg.get("interpolation", "bicubic")
        mode = preprocess_cfg.get("resize_mode", "shortest")
        if interpolation != "bicubic" or mode not in ("shortest", "squash"):
            raise ValueError(f"Unsupported OpenCLIP preprocessing (interpolation "
                             f"{interpolation!r}, resize_mode {mode!r}); this port does bicubic "
                             "with resize_mode 'shortest' or 'squash'.")
        return cls(size=size, resize_mode=mode,
                   mean=tuple(preprocess_cfg.get("mean", OPENAI_CLIP_MEAN)),
                   std=tuple(preprocess_cfg.get("std", OPENAI_CLIP_STD)))

    def resized_shape(self, height: int, width: int) -> tuple[int, int]:
        if self.resize_mode == "squash":
            return self.size, self.size
        if height <= width:
            return self.size, int(self.size * width / height)
        return int(self.size * height / width), self.size

    def crop_offset(self, length: int) -> int:
        margin = length - self.size
        return int(round(margin / 2.0)) if self.crop_rounding == "round" else margin // 2


HPS_PREPROCESS = Preprocess()
CLIP_SCORE_PREPROCESS = Preprocess(resize_mode="squash")
PICKSCORE_PREPROCESS = Preprocess(crop_rounding="floor")
AESTHETIC_PREPROCESS = Preprocess()


def _pil_bicubic_weights(in_size: int, out_size: int) -> np.ndarray:
    """[out, in] float64: PIL's antialiased bicubic coefficients (Resample.c, a = -0.5)."""

    def cubic(x: np.ndarray) -> np.ndarray:
        a = -0.5
        x = np.abs(x)
        return np.where(x < 1.0, ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
                        np.where(x < 2.0, (((x - 5.0) * x + 8.0) * x - 4.0) * a, 0.0))

    scale = in_size / out_size
    filter_scale = max(scale, 1.0)
    support = 2.0 * filter_scale
    out = np.zeros((out_size, in_size), np.float64)
    for i in range(out_size):
        center = (i + 0.5) * scale
        # C's (int) cast truncates toward zero; the clamps make it the same as floor here.
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), in_size)
        w = cubic((np.arange(lo, hi) - center + 0.5) / filter_scale)
        total = w.sum()
        out[i, lo:hi] = w / total if total != 0 else w
    return out


_PRECISION_BITS = 32 - 8 - 2  # PIL's fixed-point coefficients for 8-bit images


def _pil_fixed_point(weights_: np.ndarray) -> np.ndarray:
    scaled = weights_ * (1 << _PRECISION_BITS)
    return np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5)).astype(np.int32)


def _pil_pass(x: jax.Array, in_size: int, out_size: int, axis: int) -> jax.Array:
    """One 8-bit resampling pass of int32 pixels along axis 1 (rows) or 2 (columns)."""
    k = jnp.asarray(_pil_fixed_point(_pil_bicubic_weights(in_size, out_size)))
    spec = "bhwc,oh->bowc" if axis == 1 else "bhwc,ow->bhoc"
    acc = jnp.einsum(spec, x, k, preferred_element_type=jnp.int32)
    return jnp.clip((acc + (1 << (_PRECISION_BITS - 1))) >> _PRECISION_BITS, 0, 255)


def resize_like_pil(images: jax.Array, height: int, width: int) -> jax.Array:
    """PIL's `Image.resize((width, height), BICUBIC)` of 8-bit images, bit for bit.

    Args:
      images: [B, H, W, C] in [0, 1] (rounded to 8 bits first).
    Returns:
      [B, height, width, C] float32 in [0, 1], multiples of 1/255.
    """
    b, h, w, _ = images.shape
    x = jnp.round(jnp.clip(images.astype(jnp.float32), 0.0, 1.0) * 255.0).astype(jnp.int32)
    if width != w:  # PIL resamples horizontally first, then vertically
        x = _pil_pass(x, w, width, axis=2)
    if height != h:
        x = _pil_pass(x, h, height, axis=1)
    return x.astype(jnp.float32) / 255.0


def preprocess(images: jax.Array, spec: Preprocess = HPS_PREPROCESS) -> jax.Array:
    """[B, H, W, 3] in [0, 1] → normalised [B, size, size, 3] float32 (see `Preprocess`)."""
    images = jnp.asarray(images)
    if images.ndim != 4 or images.shape[-1] != 3:
        raise ValueError(f"images must be [batch, height, width, 3] in [0, 1], got shape "
                         f"{images.shape}.")
    b, h, w, _ = images.shape
    nh, nw = spec.resized_shape(h, w)
    if spec.resample == "pil":
        x = resize_like_pil(images, nh, nw)
    else:
        x = images.astype(jnp.float32)
        if (nh, nw) != (h, w):
            x = jax.image.resize(x, (b, nh, nw, 3), method="bicubic", antialias=True)
    if spec.resize_mode == "shortest":
        top, left = spec.crop_offset(nh), spec.crop_offset(nw)
        x = x[:, top:top + spec.size, left:left + spec.size]
    mean = jnp.asarray(spec.mean, jnp.float32)
    std = jnp.asarray(spec.std, jnp.float32)
    return (x - mean) / std


# ---------------------------------------------------------------------------------------------
# Image-text rewards.


class ClipReward:
    """A CLIP image-text reward: `reward(images, prompts) -> [B]` (see the module docstring).

    Attributes:
      state: the model's parameters (an nnx.State); graphdef: its structure.
      preprocess: the `Preprocess` spec. scale: "none" or "logit_scale".
    """

    def __init__(self, model: clip.CLIP, tokenizer, *, preprocess: Preprocess,
                 scale: str = "none", name: str = "clip"):
        if scale not in ("none", "logit_scale"):
            raise ValueError(f"scale must be 'none' or 'logit_scale', got {scale!r}.")
        cfg = model.cfg
        if cfg.text is None or cfg.vision is None or cfg.projection_dim is None:
            raise ValueError(f"{name} needs both CLIP towers and their projections; the loaded "
                             f"model has text={cfg.text is not None}, vision="
                             f"{cfg.vision is not None}, projection_dim={cfg.projection_dim}.")
        if scale == "logit_scale" and not cfg.logit_scale:
            raise ValueError(f"{name} multiplies by exp(logit_scale), but the model has none.")
        if cfg.vision.image_size != preprocess.size:
            raise ValueError(f"{name}: the image tower takes {cfg.vision.image_size}px inputs but "
                             f"preprocessing makes {preprocess.size}px; set Preprocess(size=...).")
        self.name = name
        self.tokenizer = tokenizer
        self.context_length = cfg.text.context_length
        self.preprocess = preprocess
        self.scale = scale
        self.graphdef, self.state = nnx.split(model)
        self._jitted = jax.jit(self.apply)

    def tokenize(self, prompts: Sequence[str]) -> np.ndarray:
        """[B, context_length] int32 token ids."""
        return clip_text.tokenize(self.tokenizer, list(prompts), self.context_length)

    def score_pixels(self, state, pixels: jax.Array, input_ids: jax.Array) -> jax.Array:
        """Scores preprocessed pixels [B, S, S, 3] against token ids [B, T] → [B] float32."""
        model = nnx.merge(self.graphdef, state)
        image = clip.l2_normalize(model.encode_image(pixels).astype(jnp.float32))
        text = clip.l2_normalize(model.encode_text(input_ids).astype(jnp.float32))
        score = jnp.sum(image * text, axis=-1)
        if self.scale == "logit_scale":
            score = jnp.exp(model.logit_scale[...].astype(jnp.float32)) * score
        return score

    def apply(self, state, images: jax.Array, input_ids: jax.Array) -> jax.Array:
        """The pure, jittable reward: images [B, H, W, 3] in [0, 1], ids [B, T] → [B]."""
        return self.score_pixels(state, preprocess(images, self.preprocess), input_ids)

    def __call__(self, images: jax.Array, prompts: Sequence[str]) -> jax.Array:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if len(prompts) != images.shape[0]:
            raise ValueError(f"{self.name}: {images.shape[0]} images but {len(prompts)} prompts; "
                             "pass one prompt per image.")
        return self._jitted(self.state, images, self.tokenize(prompts))


# ---------------------------------------------------------------------------------------------
# LAION aesthetic predictor.


AESTHETIC_WIDTHS = (768, 1024, 128, 64, 16, 1)
# improved-aesthetic-predictor's nn.Sequential: Linear, Dropout, Linear, Dropout, Linear, Dropout,
# Linear, Linear: the Linear layers are its entries 0, 2, 4, 6, 7.
_AESTHETIC_INDICES = (0, 2, 4, 6, 7)


class AestheticHead(nnx.Module):
    """The MLP of LAION's improved aesthetic predictor: [B, 768] normalised features → [B].

    Dropout is the identity at inference, and there are no activations between the Linears
    (the published model has none)."""

    def __init__(self, rngs: nnx.Rngs, widths: tuple[int, ...] = AESTHETIC_WIDTHS):
        for index, (din, dout) in zip(_AESTHETIC_INDICES, zip(widths[:-1], widths[1:]),
                                      strict=True):
            setattr(self, f"layer{index}", nnx.Linear(
                din, dout, rngs=rngs, kernel_metadata={"logical_axes": (None, None)},
                bias_metadata={"logical_axes": (None,)}))

    def __call__(self, features: jax.Array) -> jax.Array:
        x = features.astype(jnp.float32)
        for index in _AESTHETIC_INDICES:
            x = getattr(self, f"layer{index}")(x)
        return x[..., 0]


def load_aesthetic_head(path: str | os.PathLike) -> AestheticHead:
    """Loads the predictor's state dict (`layers.{0,2,4,6,7}.{weight,bias}`) from safetensors
    (sac+logos+ava1-l14-linearMSE.pth converted once by `python -m g2rpo_jax.convert`; given the
    .pth, its converted file beside it is read, and without one NeedsConversionError names the
    command: `clip_weights.open_checkpoint`)."""
    checkpoint = clip_weights.open_checkpoint(path)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: AestheticHead(nnx.Rngs(0))))

    def source(path: tuple[str, ...]):
        module, leaf = path
        index = int(module[len("layer"):])
        name = "weight" if leaf == "kernel" else "bias"
        return weights.TensorSource(f"layers.{index}.{name}", transpose=leaf == "kernel")

    return nnx.merge(graphdef, weights.load_state(checkpoint, abstract, source))


class AestheticReward:
    """`reward(images, prompts) -> [B]`: the LAION aesthetic score (prompts are ignored)."""

    def __init__(self, model: clip.CLIP, head: AestheticHead, *,
                 preprocess: Preprocess = AESTHETIC_PREPROCESS):
        if model.cfg.vision is None or model.cfg.projection_dim is None:
            raise ValueError("The aesthetic predictor needs a CLIP image tower with its "
                             "projection (OpenAI ViT-L/14: 768-d embeddings).")
        if model.cfg.projection_dim != AESTHETIC_WIDTHS[0]:
            raise ValueError(f"The aesthetic MLP takes {AESTHETIC_WIDTHS[0]}-d CLIP embeddings; "
                             f"this CLIP makes {model.cfg.projection_dim}-d ones (use ViT-L/14).")
        self.name = "aesthetic"
        self.preprocess = preprocess
        self.graphdef, self.state = nnx.split((model, head))
        self._jitted = jax.jit(self.apply)

    def apply(self, state, images: jax.Array, input_ids=None) -> jax.Array:
        del input_ids
        model, head = nnx.merge(self.graphdef, state)
        features = model.encode_image(preprocess(images, self.preprocess))
        return head(clip.l2_normalize(features.astype(jnp.float32)))

    def __call__(self, images: jax.Array, prompts: Sequence[str] | None = None) -> jax.Array:
        del prompts
        return self._jitted(self.state, images)


# ---------------------------------------------------------------------------------------------
# Factories (what registry.get calls).


def _tokenizer(tokenizer, fallback: Path | None, name: str):
    if tokenizer is None and fallback is not None and fallback.is_dir() and any(
            (fallback / f).exists() for f in ("tokenizer.json", "vocab.json")):
        tokenizer = fallback
    if tokenizer is None:
        raise ValueError(
            f"{name} needs tokenizer=: a folder with a CLIP tokenizer (vocab.json + merges.txt or "
            "tokenizer.json; FLUX.1-dev's tokenizer/ has the same BPE as OpenCLIP) or OpenCLIP's "
            "bpe_simple_vocab_16e6.txt.gz.")
    if isinstance(tokenizer, str | os.PathLike):
        return clip_text.load_tokenizer(tokenizer)
    return tokenizer


def _load(path, config, dtype, mesh, rules, towers=None) -> clip.CLIP:
    return clip_weights.from_pretrained(path, config, towers=towers, dtype=dtype, mesh=mesh,
                                        rules=rules)


def hps(path: str | os.PathLike, *, tokenizer=None, config="ViT-H-14", dtype: str | None = None,
        mesh=None, rules=sharding_lib.DEFAULT_RULES,
        preprocess: Preprocess = HPS_PREPROCESS) -> ClipReward:
    """HPS-v2.1: OpenCLIP ViT-H-14 (HPS_v2.1_compressed.pt converted once to
    HPS_v2.1_compressed.safetensors; given the .pt, that file beside it is read); score =
    normalised image · normalised text (HPSv2's `diagonal(image_features @ text_features.T)`)."""
    model = _load(path, config, dtype, mesh, rules)
    return ClipReward(model, _tokenizer(tokenizer, None, "hps"), preprocess=preprocess,
                      scale="none", name="hps")


def clip_score(path: str | os.PathLike, *, tokenizer=None, config=None, dtype: str | None = None,
               mesh=None, rules=sharding_lib.DEFAULT_RULES,
               preprocess: Preprocess | None = None) -> ClipReward:
    """CLIP score = cosine(image, text) with DFN5B-CLIP-ViT-H-14: an OpenCLIP hub folder (its
    open_clip_config.json gives the model and the preprocessing), or its weights file (then
    config "ViT-H-14-quickgelu" and CLIP_SCORE_PREPROCESS, open_clip's dfn5b settings)."""
    path = Path(os.fspath(path))
    hub_config = path / "open_clip_config.json"
    if config is None and not hub_config.exists() and not (path / "config.json").exists():
        config = "ViT-H-14-quickgelu"
    model = _load(path, config, dtype, mesh, rules)
    if preprocess is None:
        preprocess = CLIP_SCORE_PREPROCESS
        if hub_config.exists():
            values = json.loads(hub_config.read_text()).get("preprocess_cfg")
            if values:
                preprocess = Preprocess.from_open_clip(values, model.cfg.vision.image_size)
    return ClipReward(model, _tokenizer(tokenizer, path if path.is_dir() else None, "clip_score"),
                      preprocess=preprocess, scale="none", name="clip_score")


def pickscore(path: str | os.PathLike, *, tokenizer=None, dtype: str | None = None, mesh=None,
              rules=sharding_lib.DEFAULT_RULES,
              preprocess: Preprocess = PICKSCORE_PREPROCESS) -> ClipReward:
    """PickScore_v1 (a transformers CLIPModel folder): exp(logit_scale) · cosine. Its tokenizer
    is laion/CLIP-ViT-H-14's (the CLIP BPE): taken from the folder if there, else tokenizer=."""
    path = Path(os.fspath(path))
    model = _load(path, None, dtype, mesh, rules)
    return ClipReward(model, _tokenizer(tokenizer, path if path.is_dir() else None, "pickscore"),
                      preprocess=preprocess, scale="logit_scale", name="pickscore")


def aesthetic(path: str | os.PathLike, *, clip_path: str | os.PathLike, clip_config=None,
              dtype: str | None = None, mesh=None, rules=sharding_lib.DEFAULT_RULES,
              preprocess: Preprocess = AESTHETIC_PREPROCESS) -> AestheticReward:
    """LAION improved aesthetic predictor: `path` is its MLP state dict; `clip_path` OpenAI's
    CLIP ViT-L/14 (a transformers folder, or OpenAI's TorchScript ViT-L-14.pt converted once to
    safetensors: config "ViT-L-14-quickgelu" is then used). Only the image tower is loaded."""
    clip_path = Path(os.fspath(clip_path))
    if clip_config is None and clip_path.is_file() and not (clip_path.parent / "config.json").exists():
        # An OpenAI / OpenCLIP-layout file: shapes cannot tell its QuickGELU.
        clip_config = "ViT-L-14-quickgelu"
    model = _load(clip_path, clip_config, dtype, mesh, rules, towers=("vision",))
    return AestheticReward(model, load_aesthetic_head(path), preprocess=preprocess)
