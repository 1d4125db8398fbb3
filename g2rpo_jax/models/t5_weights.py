"""T5 encoder weights: transformers `T5EncoderModel` folders (FLUX.1-dev's `text_encoder_2/`).

The key map from our parameter paths (`models.t5`) to transformers' state dict, the config of a
folder's config.json, and `from_pretrained`, which places every tensor straight into its
sharding. A full T5 (encoder-decoder) checkpoint loads too: its decoder is ignored.
"""

import json
import os

from flax import nnx
import jax

from g2rpo_jax.models import t5, weights
from g2rpo_jax.parallel import sharding as sharding_lib

Source = weights.TensorSource

# The tied input embedding is stored under one or both names; `shared` is the tie's source.
EMBEDDING_KEYS = ("shared.weight", "encoder.embed_tokens.weight")
# A full T5 (encoder-decoder) checkpoint also loads: like T5EncoderModel, ignore the rest.
_IGNORED_PREFIXES = ("decoder.", "lm_head.")


def _embedding_key(checkpoint) -> str:
    for key in EMBEDDING_KEYS:
        if key in checkpoint:
            return key
    # Let load_state report it as missing, with the expected shape.
    return EMBEDDING_KEYS[0]


def _source_fn(cfg: t5.T5Config, embedding_key: str):
    """Our parameter path → transformers T5EncoderModel state-dict key (PyTorch [out, in])."""
    top = {
        "embedding": Source(embedding_key),
        "relative_attention_bias": Source(
            "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"),
        "final_norm.scale": Source("encoder.final_layer_norm.weight"),
    }
    ff_names = ("wi_0", "wi_1", "wo") if cfg.is_gated else ("wi", "wo")

    def layer(index: int) -> dict[str, Source]:
        attn, ff = f"encoder.block.{index}.layer.0", f"encoder.block.{index}.layer.1"
        out = {"attn_norm.scale": Source(f"{attn}.layer_norm.weight"),
               "ff_norm.scale": Source(f"{ff}.layer_norm.weight")}
        for name in ("q", "k", "v", "o"):
            out[f"attn.{name}.kernel"] = Source(f"{attn}.SelfAttention.{name}.weight", transpose=True)
        for name in ff_names:
            out[f"ff.{name}.kernel"] = Source(f"{ff}.DenseReluDense.{name}.weight", transpose=True)
        return out

    def source(path: tuple[str, ...]):
        if path[0] == "layers":
            name = ".".join(path[1:])
            return lambda index: layer(index)[name]
        return top[".".join(path)]

    return source


def load_config(path: str | os.PathLike, **overrides) -> t5.T5Config:
    """The T5Config of a transformers folder's config.json, with execution overrides."""
    path = t5.resolve_folder(os.fspath(path), "text_encoder_2", "T5 encoder",
                             "config.json + model*.safetensors")
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{path} has no config.json: expected a transformers T5 folder "
                                "(config.json + model.safetensors or model.safetensors.index.json).")
    with open(config_file) as f:
        values = json.load(f)
    model_type = values.get("model_type", "t5")
    if model_type not in ("t5", "mt5"):
        raise ValueError(f"{config_file} describes a {model_type!r} model, not T5 (model_type "
                         "'t5'); this loader reads T5 v1.1 / mT5 encoders only.")
    # transformers' "dtype" / "torch_dtype" is the STORAGE dtype; ours is the compute dtype,
    # chosen by the caller (default float32), so the file's value must not leak into it.
    values = {k: v for k, v in values.items() if k not in ("dtype", "torch_dtype")}
    values.update(overrides)
    return t5.T5Config.from_dict(values)


def from_pretrained(path: str | os.PathLike, dtype: str | None = None, *,
                    mesh: jax.sharding.Mesh | None = None, rules=sharding_lib.DEFAULT_RULES,
                    **config_overrides) -> t5.T5Encoder:
    """Loads a transformers T5 encoder checkpoint, each parameter straight into its sharding.

    Args:
      path: a transformers folder (config.json + model.safetensors, or a sharded
        model.safetensors.index.json), e.g. FLUX.1-dev's `text_encoder_2/`, or a folder that
        contains `text_encoder_2/`.
      dtype: the activations' (compute) dtype, e.g. "bfloat16"; None keeps float32. Parameters
        are `param_dtype` (default float32; the file's dtype is cast to it).
      mesh: if given, each parameter is assembled directly into its NamedSharding on this mesh
        (each device reads only its slice); otherwise parameters go to the default device.
      rules: logical axis rules for the shardings.
      **config_overrides: T5Config fields to set (param_dtype="bfloat16", scan_layers=False, ...).

    Raises:
      FileNotFoundError: no checkpoint at path.
      weights.CheckpointMismatchError: a missing, unexpected or mis-shaped tensor (named, with
        the stored and expected shapes).
    """
    if dtype is not None:
        config_overrides["dtype"] = dtype
    path = t5.resolve_folder(os.fspath(path), "text_encoder_2", "T5 encoder",
                             "config.json + model*.safetensors")
    cfg = load_config(path, **config_overrides)
    checkpoint = weights.SafetensorsCheckpoint(path)
    embedding_key = _embedding_key(checkpoint)
    hidden = {k for k in EMBEDDING_KEYS if k != embedding_key}
    hidden |= {k for k in checkpoint.keys() if k.startswith(_IGNORED_PREFIXES)}
    if mesh is not None:
        t5.validate_mesh(cfg, mesh)
    graphdef, abstract_state = nnx.split(t5.abstract_model(cfg, rules))
    shardings = (sharding_lib.state_shardings(abstract_state, mesh,
                                              sharding_lib.rules_from_config(rules))
                 if mesh is not None else None)
    view = weights.CheckpointView(checkpoint, lambda key: key not in hidden)
    state = weights.load_state(view, abstract_state,
                               _source_fn(cfg, embedding_key), shardings)
    return nnx.merge(graphdef, state)
