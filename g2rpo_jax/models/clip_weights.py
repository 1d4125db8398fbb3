"""CLIP weights: transformers and OpenCLIP / OpenAI checkpoints, loaded into `models.clip`.

Two checkpoint layouts load into the same modules (`from_pretrained`):

* transformers (`CLIPModel`, `CLIPTextModel[WithProjection]`, `CLIPVisionModel[WithProjection]`;
  PickScore, FLUX's `text_encoder/`): `text_model.encoder.layers.N.self_attn.q_proj.weight`, ...
  (transformers 5 saves CLIPTextModel / CLIPVisionModel without the `text_model.` /
  `vision_model.` prefix; both forms load). The config comes from the folder's `config.json`.
* OpenCLIP / OpenAI (`transformer.resblocks.N.attn.in_proj_weight`, `visual.conv1.weight`, ...;
  HPS-v2.1, DFN5B-CLIP-ViT-H-14, OpenAI's ViT-L/14): the fused in_proj is split by rows. The config
  is a named one (`clip.OPEN_CLIP_CONFIGS`), an OpenCLIP model-config dict, a folder's
  `open_clip_config.json`, or inferred from tensor shapes (see `config_from_open_clip_checkpoint`
  for what shapes cannot tell).

Safetensors only, torch never imported, nothing written beside the inputs (a read-only mount
works): PyTorch pickles (`.pt`, `.pth`, `.bin`, `.ckpt`, a hub folder's
open_clip_pytorch_model.bin or pytorch_model.bin) are converted once, ahead of time, by
`python -m g2rpo_jax.convert SRC [DST]` (`models/torch_checkpoints.py`, the one place that needs
torch); given a pickle, the loader reads its converted file beside it or stops with
`torch_checkpoints.NeedsConversionError`, which names the command.
"""

from collections.abc import Callable, Mapping
import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from flax import nnx
import jax

from g2rpo_jax.models import clip, torch_checkpoints, weights
from g2rpo_jax.models.weights import linear_sources
from g2rpo_jax.parallel import sharding as sharding_lib

# Tensors whose presence tells the layout and the towers (see `detect_layout`, `_hf_prefixes`).
_HF_BARE_TEXT_KEY = "embeddings.token_embedding.weight"
_HF_BARE_VISION_KEY = "embeddings.patch_embedding.weight"
_HF_TEXT_KEY = "text_model." + _HF_BARE_TEXT_KEY
_HF_VISION_KEY = "vision_model." + _HF_BARE_VISION_KEY
_OC_TEXT_KEY = "token_embedding.weight"
_OC_VISION_KEY = "visual.conv1.weight"


# ---------------------------------------------------------------------------------------------
# Checkpoint views and key maps.


Source = weights.TensorSource


def _ln_sources(key: str) -> dict:
    return {"norm": {"scale": Source(f"{key}.weight"), "bias": Source(f"{key}.bias")}}


def _hf_layer(prefix: str) -> dict:
    return {
        "ln_1": _ln_sources(f"{prefix}.layer_norm1"),
        "attn": {name: linear_sources(f"{prefix}.self_attn.{name}_proj")
                 for name in ("q", "k", "v", "out")},
        "ln_2": _ln_sources(f"{prefix}.layer_norm2"),
        "mlp": {"fc1": linear_sources(f"{prefix}.mlp.fc1"),
                "fc2": linear_sources(f"{prefix}.mlp.fc2")},
    }


def _open_clip_layer(prefix: str, width: int) -> dict:
    rows = {"q": ((0, width),), "k": ((width, 2 * width),), "v": ((2 * width, 3 * width),)}
    attn = {name: {"kernel": Source(f"{prefix}.attn.in_proj_weight", rows=r, transpose=True),
                   "bias": Source(f"{prefix}.attn.in_proj_bias", rows=r)}
            for name, r in rows.items()}
    attn["out"] = linear_sources(f"{prefix}.attn.out_proj")
    return {
        "ln_1": _ln_sources(f"{prefix}.ln_1"),
        "attn": attn,
        "ln_2": _ln_sources(f"{prefix}.ln_2"),
        "mlp": {"fc1": linear_sources(f"{prefix}.mlp.c_fc"),
                "fc2": linear_sources(f"{prefix}.mlp.c_proj")},
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


def _hf_key_map(cfg: clip.CLIPConfig, text_prefix: str = "text_model.",
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
    top["text_projection"] = linear_sources("text_projection", bias=False)
    top["visual_projection"] = linear_sources("visual_projection", bias=False)
    top["logit_scale"] = Source("logit_scale")
    return top, layers


def _open_clip_key_map(cfg: clip.CLIPConfig):
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


def _view(checkpoint, layout: str, cfg: clip.CLIPConfig) -> weights.CheckpointView:
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

    return weights.CheckpointView(checkpoint, keep)


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


def config_from_transformers(values: Mapping[str, Any], checkpoint=None) -> clip.CLIPConfig:
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
        text = clip.TextConfig(
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
        vision = clip.VisionConfig(
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
    return clip.CLIPConfig(text=text, vision=vision,
                           projection_dim=projection_dim if has_projection else None,
                           logit_scale=has_scale)


# Head widths of OpenCLIP ViTs that are not 64 (they cannot be read off tensor shapes).
_VISION_HEAD_WIDTH = {1280: 80, 1408: 88, 1664: 104}


def config_from_open_clip_checkpoint(checkpoint, quick_gelu: bool = False,
                                     vision_head_width: int | None = None,
                                     text_head_width: int = 64) -> clip.CLIPConfig:
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
        text = clip.TextConfig(vocab_size=vocab, width=width,
                               heads=heads(width, text_head_width, "text"),
                               layers=count("transformer.resblocks."),
                               mlp_dim=checkpoint.shape("transformer.resblocks.0.mlp.c_fc.weight")[0],
                               context_length=checkpoint.shape("positional_embedding")[0], act=act,
                               pool="argmax")
    if _OC_VISION_KEY in keys:
        width, _, patch, _ = checkpoint.shape(_OC_VISION_KEY)
        grid = math.isqrt(checkpoint.shape("visual.positional_embedding")[0] - 1)
        head_width = vision_head_width or _VISION_HEAD_WIDTH.get(width, 64)
        vision = clip.VisionConfig(
            width=width, heads=heads(width, head_width, "image"),
            layers=count("visual.transformer.resblocks."),
            mlp_dim=checkpoint.shape("visual.transformer.resblocks.0.mlp.c_fc.weight")[0],
            patch_size=patch, image_size=grid * patch, act=act)
    projection = None
    if "text_projection" in keys:
        projection = checkpoint.shape("text_projection")[-1]
    elif "visual.proj" in keys:
        projection = checkpoint.shape("visual.proj")[-1]
    return clip.CLIPConfig(text=text, vision=vision, projection_dim=projection,
                           logit_scale="logit_scale" in keys)


# ---------------------------------------------------------------------------------------------
# Loading.


def open_checkpoint(path: str | os.PathLike) -> weights.SafetensorsCheckpoint:
    """A safetensors file or folder, read lazily. For a PyTorch pickle (.pt / .pth / .bin /
    .ckpt), its converted safetensors beside it (`python -m g2rpo_jax.convert`, logged);
    without one, NeedsConversionError names the command. Torch is never imported and nothing
    is written, so a read-only folder or bucket copy works."""
    path = Path(path)
    if torch_checkpoints.is_torch_checkpoint(path):
        path = torch_checkpoints.require_converted(path)
    return weights.SafetensorsCheckpoint(path)


def _transformers_checkpoint(path: Path) -> weights.SafetensorsCheckpoint:
    """A transformers folder's model*.safetensors; a folder holding only pytorch_model.bin
    stops with the command that converts it (NeedsConversionError)."""
    pickle = path / "pytorch_model.bin"
    if pickle.exists() and not any(path.glob("model*.safetensors*")):
        torch_checkpoints.require_converted(pickle)
    return weights.SafetensorsCheckpoint(path, prefix="model")


def _resolve(path: Path, config) -> tuple[weights.SafetensorsCheckpoint, str, clip.CLIPConfig | None]:
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
            checkpoint = _transformers_checkpoint(path)
            if config is None:
                config = config_from_transformers(json.loads((path / "config.json").read_text()),
                                                  checkpoint)
            return checkpoint, detect_layout(checkpoint), config
    if not path.exists():
        raise FileNotFoundError(f"No CLIP checkpoint at {path}: give a transformers folder "
                                "(config.json + model.safetensors), an OpenCLIP folder "
                                "(open_clip_config.json + weights), or a .safetensors file (a .pt / .pth "
                                "beside its conversion by python -m g2rpo_jax.convert).")
    checkpoint = open_checkpoint(path)
    layout = detect_layout(checkpoint)
    if config is None and layout == "transformers" and (path.parent / "config.json").exists():
        config = config_from_transformers(json.loads((path.parent / "config.json").read_text()),
                                          checkpoint)
    return checkpoint, layout, config


def _as_config(config, checkpoint, layout) -> clip.CLIPConfig:
    if isinstance(config, clip.CLIPConfig):
        return config
    if isinstance(config, str):
        if config not in clip.OPEN_CLIP_CONFIGS:
            raise ValueError(f"Unknown CLIP config {config!r}; named configs: "
                             f"{sorted(clip.OPEN_CLIP_CONFIGS)} (or pass a CLIPConfig / OpenCLIP dict).")
        return clip.config_from_open_clip(clip.OPEN_CLIP_CONFIGS[config])
    if isinstance(config, Mapping):
        return clip.config_from_open_clip(config)
    if layout == "open_clip":
        return config_from_open_clip_checkpoint(checkpoint)
    raise ValueError(f"No config for the transformers-layout checkpoint {checkpoint.path}: put its "
                     "config.json beside it or pass config=CLIPConfig(...).")


def from_pretrained(path: str | os.PathLike, config: clip.CLIPConfig | str | Mapping | None = None, *,
                    towers: tuple[str, ...] | None = None, dtype: str | None = None,
                    mesh: jax.sharding.Mesh | None = None, rules=sharding_lib.DEFAULT_RULES,
                    **overrides) -> clip.CLIP:
    """Loads a CLIP checkpoint (transformers or OpenCLIP layout), straight into shardings.

    Args:
      path: a transformers folder (config.json + model.safetensors or a sharded index), an
        OpenCLIP hub folder (open_clip_config.json + open_clip_model.safetensors or
        open_clip_pytorch_model.bin, converted), or a single .safetensors file (a .pt / .pth /
        .bin / .ckpt file is read through its converted safetensors: `open_checkpoint`).
      config: a CLIPConfig, an OpenCLIP model-config dict or a name in clip.OPEN_CLIP_CONFIGS
        ("ViT-H-14" for HPS-v2.1, "ViT-H-14-quickgelu" for DFN5B, "ViT-L-14-quickgelu" for
        OpenAI's ViT-L/14); None reads config.json / open_clip_config.json or infers an OpenCLIP
        config from the shapes (GELU; see config_from_open_clip_checkpoint).
      towers: ("text",), ("vision",) or both (default: the config's); a left-out tower's
        tensors (and logit_scale) are ignored in the file.
      dtype: activations' dtype ("bfloat16", ...); parameters stay `param_dtype` (float32).
      mesh, rules: assemble each parameter directly into its NamedSharding on this mesh.
      **overrides: CLIPConfig fields (param_dtype, scan_layers, attention, ...).

    Raises:
      FileNotFoundError: nothing loadable at path.
      torch_checkpoints.NeedsConversionError (a FileNotFoundError): a PyTorch checkpoint without
        its converted safetensors; names the `python -m g2rpo_jax.convert` command.
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
    graphdef, abstract_state = nnx.split(clip.abstract_model(cfg))
    shardings = (sharding_lib.state_shardings(abstract_state, mesh,
                                              sharding_lib.rules_from_config(rules))
                 if mesh is not None else None)
    state = weights.load_state(_view(checkpoint, layout, cfg), abstract_state,
                               _source_fn(key_map), shardings)
    return nnx.merge(graphdef, state)
