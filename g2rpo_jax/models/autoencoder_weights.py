"""Autoencoder weights: diffusers `AutoencoderKL` folders (FLUX.1-dev's `vae/`).

Our parameter paths (`models.autoencoder`) are diffusers' keys with `kernel` / `scale` →
`weight`, so the key map is a rename, plus diffusers' attention names from before 0.15. The
channels-last conv kernels [kH, kW, C_in, C_out] are lazy transposed views of PyTorch's
[C_out, C_in, kH, kW].
"""

import json
import os

from flax import nnx
import jax

from g2rpo_jax.models import autoencoder, weights
from g2rpo_jax.parallel import sharding as sharding_lib

# diffusers' attention names before 0.15 (`_convert_deprecated_attention_blocks`) → current.
_LEGACY_ATTENTION = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out": "proj_attn"}
_LEAF_NAMES = {"kernel": "weight", "scale": "weight", "bias": "bias"}
_LAYOUT_NOTE = ("(conv kernels are shown in our layout [kH, kW, C_in, C_out]; PyTorch stores "
                "[C_out, C_in, kH, kW])")


class _ChannelsLastView:
    """A checkpoint as our layout sees it: 4-D conv weights [O, I, kH, kW] appear as
    [kH, kW, I, O] (a lazy transposed view of the memory map), everything else unchanged."""

    def __init__(self, checkpoint: weights.SafetensorsCheckpoint):
        self._checkpoint = checkpoint
        self.path = checkpoint.path

    def keys(self) -> list[str]:
        return self._checkpoint.keys()

    def __contains__(self, key: object) -> bool:
        return key in self._checkpoint

    def shape(self, key: str) -> tuple[int, ...]:
        shape = tuple(self._checkpoint.shape(key))
        return (shape[2], shape[3], shape[1], shape[0]) if len(shape) == 4 else shape

    def array(self, key: str):
        array = self._checkpoint.array(key)
        return array.transpose(2, 3, 1, 0) if array.ndim == 4 else array


def _source_fn(checkpoint):
    """Our parameter path → its TensorSource in a diffusers AutoencoderKL state dict."""

    def source(path: tuple[str, ...]) -> weights.TensorSource:
        *module, leaf = path
        name = ".".join(module)
        if module and module[-1] in _LEGACY_ATTENTION:
            prefix = ".".join(module[:-1])
            current = f"{prefix}.{module[-1]}" + (".0" if module[-1] == "to_out" else "")
            legacy = f"{prefix}.{_LEGACY_ATTENTION[module[-1]]}"
            suffix = _LEAF_NAMES[leaf]
            if f"{current}.{suffix}" not in checkpoint and f"{legacy}.{suffix}" in checkpoint:
                current = legacy
            # Linear weights are PyTorch [out, in]; nnx.Linear's kernel is [in, out].
            return weights.TensorSource(f"{current}.{suffix}", transpose=leaf == "kernel")
        return weights.TensorSource(f"{name}.{_LEAF_NAMES[leaf]}")

    return source


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "config.json")
    if not os.path.exists(config_file):
        raise FileNotFoundError(f"{path} has no config.json: expected a diffusers vae/ folder "
                                "(config.json + diffusion_pytorch_model.safetensors).")
    with open(config_file) as f:
        values = json.load(f)
    if values.get("_class_name", "AutoencoderKL") != "AutoencoderKL":
        raise ValueError(f"{config_file} describes a {values['_class_name']}, not an "
                         "AutoencoderKL.")
    return values


def from_pretrained(path: str | os.PathLike, dtype: str | None = None, *,
                    mesh: jax.sharding.Mesh | None = None, **config_overrides) -> autoencoder.Autoencoder:
    """Loads a diffusers AutoencoderKL (e.g. FLUX.1-dev's `vae/`).

    Args:
      path: a diffusers `vae/` folder (config.json + diffusion_pytorch_model.safetensors, a
        sharded index too), a model folder that contains `vae/`, or a single safetensors file
        with diffusers' keys (the config then comes from the defaults, FLUX.1-dev's, and the
        overrides).
      dtype: the activations' (compute) dtype, e.g. "bfloat16"; None keeps float32. The
        parameters' dtype is `param_dtype` (default float32; the file's dtype is cast to it).
      mesh: if given, every parameter is placed replicated on this mesh (the VAE is small:
        84M parameters); otherwise on the default device.
      **config_overrides: AutoencoderConfig fields (e.g. param_dtype="bfloat16").

    Raises:
      FileNotFoundError: no checkpoint at path.
      weights.CheckpointMismatchError: missing, unexpected or mis-shaped tensors, by name.
    """
    path = os.fspath(path)
    if dtype is not None:
        config_overrides["dtype"] = dtype
    if os.path.isdir(path) and os.path.isdir(os.path.join(path, "vae")):
        path = os.path.join(path, "vae")
    if os.path.isdir(path):
        values = _read_config(path)
        checkpoint = weights.SafetensorsCheckpoint(path, prefix="diffusion_pytorch_model")
    elif os.path.isfile(path):
        values = {}
        checkpoint = weights.SafetensorsCheckpoint(path)
    else:
        raise FileNotFoundError(f"No autoencoder checkpoint at {path}: give a diffusers vae/ "
                                "folder or a folder that contains vae/.")
    if "encoder.down.0.block.0.norm1.weight" in checkpoint:
        raise weights.CheckpointMismatchError(
            f"{checkpoint.path} is in the original (LDM / BFL ae.safetensors) key layout, which "
            "this loader does not read; use the diffusers vae/ folder of the same model.")
    values.update(config_overrides)
    cfg = autoencoder.AutoencoderConfig.from_dict(values)
    graphdef, abstract_state = nnx.split(autoencoder.abstract_model(cfg))
    # No logical axes on any parameter: state_shardings replicates them all.
    shardings = sharding_lib.state_shardings(abstract_state, mesh) if mesh is not None else None
    try:
        state = weights.load_state(_ChannelsLastView(checkpoint), abstract_state,
                                   _source_fn(checkpoint), shardings)
    except weights.CheckpointMismatchError as e:
        raise weights.CheckpointMismatchError(f"{e}\n{_LAYOUT_NOTE}") from None
    return nnx.merge(graphdef, state)
