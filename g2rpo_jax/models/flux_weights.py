"""FLUX.1 transformer weights: diffusers `transformer/` folders and BFL single files.

Key maps from our parameter paths (`models.flux`) to the two public layouts (diffusers'
`FluxTransformer2DModel`, separate q / k / v; BFL's `flux1-*.safetensors`, fused qkv and fused
linear1 / linear2), the config of a checkpoint (diffusers' config.json, or inferred from a BFL
file's shapes), `from_pretrained`, which places every tensor straight into its sharding, and
the way back: `stored_tensors` gives a model's weights as either layout's state dict, one
tensor at a time (`export.py` streams them into files).

  model = from_pretrained("FLUX.1-dev", "bfloat16", mesh=mesh)   # or .../transformer, or a BFL file
  cfg = load_config("FLUX.1-dev")                                 # the config only, no tensors
  specs = stored_tensors(model, "diffusers", "bfloat16")          # [TensorSpec], lazily filled
"""

import dataclasses
import json
import math
import os

from flax import nnx
import jax
from jax.experimental import multihost_utils
import numpy as np

from g2rpo_jax.models import execution, flux, weights
from g2rpo_jax.models.safetensors_io import TensorSpec
from g2rpo_jax.models.weights import linear_sources
from g2rpo_jax.parallel import sharding as sharding_lib

Source = weights.TensorSource


def _diffusers_key_map(cfg: flux.FluxConfig):
    """Our parameter path → diffusers FluxTransformer2DModel state-dict key(s)."""
    d, m = cfg.hidden_size, cfg.mlp_hidden_dim
    top = {
        "img_in": linear_sources("x_embedder"),
        "time_in.in_layer": linear_sources("time_text_embed.timestep_embedder.linear_1"),
        "time_in.out_layer": linear_sources("time_text_embed.timestep_embedder.linear_2"),
        "guidance_in.in_layer": linear_sources("time_text_embed.guidance_embedder.linear_1"),
        "guidance_in.out_layer": linear_sources("time_text_embed.guidance_embedder.linear_2"),
        "vector_in.in_layer": linear_sources("time_text_embed.text_embedder.linear_1"),
        "vector_in.out_layer": linear_sources("time_text_embed.text_embedder.linear_2"),
        "txt_in": linear_sources("context_embedder"),
        # Our final modulation is (shift, scale) like BFL; diffusers stores (scale, shift).
        "final_mod.lin": linear_sources("norm_out.linear", rows=((d, 2 * d), (0, d))),
        "proj_out": linear_sources("proj_out"),
    }

    def double(layer: int) -> dict[str, dict[str, Source]]:
        p = f"transformer_blocks.{layer}"
        return {
            "img_mod.lin": linear_sources(f"{p}.norm1.linear"),
            "txt_mod.lin": linear_sources(f"{p}.norm1_context.linear"),
            "img_attn.q": linear_sources(f"{p}.attn.to_q"),
            "img_attn.k": linear_sources(f"{p}.attn.to_k"),
            "img_attn.v": linear_sources(f"{p}.attn.to_v"),
            "img_attn.norm_q": {"scale": Source(f"{p}.attn.norm_q.weight")},
            "img_attn.norm_k": {"scale": Source(f"{p}.attn.norm_k.weight")},
            "txt_attn.q": linear_sources(f"{p}.attn.add_q_proj"),
            "txt_attn.k": linear_sources(f"{p}.attn.add_k_proj"),
            "txt_attn.v": linear_sources(f"{p}.attn.add_v_proj"),
            "txt_attn.norm_q": {"scale": Source(f"{p}.attn.norm_added_q.weight")},
            "txt_attn.norm_k": {"scale": Source(f"{p}.attn.norm_added_k.weight")},
            "img_out": linear_sources(f"{p}.attn.to_out.0"),
            "txt_out": linear_sources(f"{p}.attn.to_add_out"),
            "img_mlp.fc1": linear_sources(f"{p}.ff.net.0.proj"),
            "img_mlp.fc2": linear_sources(f"{p}.ff.net.2"),
            "txt_mlp.fc1": linear_sources(f"{p}.ff_context.net.0.proj"),
            "txt_mlp.fc2": linear_sources(f"{p}.ff_context.net.2"),
        }

    def single(layer: int) -> dict[str, dict[str, Source]]:
        p = f"single_transformer_blocks.{layer}"
        return {
            "mod.lin": linear_sources(f"{p}.norm.linear"),
            "attn.q": linear_sources(f"{p}.attn.to_q"),
            "attn.k": linear_sources(f"{p}.attn.to_k"),
            "attn.v": linear_sources(f"{p}.attn.to_v"),
            "attn.norm_q": {"scale": Source(f"{p}.attn.norm_q.weight")},
            "attn.norm_k": {"scale": Source(f"{p}.attn.norm_k.weight")},
            "mlp_in": linear_sources(f"{p}.proj_mlp"),
            "out_attn": linear_sources(f"{p}.proj_out", cols=(0, d)),
            "out_mlp": linear_sources(f"{p}.proj_out", cols=(d, d + m), bias=False),
        }

    return top, double, single


def _bfl_key_map(cfg: flux.FluxConfig):
    """Our parameter path → BFL `flux1-*.safetensors` key(s) (fused qkv, fused linear1/2)."""
    d, m = cfg.hidden_size, cfg.mlp_hidden_dim
    q_rows, k_rows, v_rows = ((0, d),), ((d, 2 * d),), ((2 * d, 3 * d),)
    top = {
        "img_in": linear_sources("img_in"),
        "time_in.in_layer": linear_sources("time_in.in_layer"),
        "time_in.out_layer": linear_sources("time_in.out_layer"),
        "guidance_in.in_layer": linear_sources("guidance_in.in_layer"),
        "guidance_in.out_layer": linear_sources("guidance_in.out_layer"),
        "vector_in.in_layer": linear_sources("vector_in.in_layer"),
        "vector_in.out_layer": linear_sources("vector_in.out_layer"),
        "txt_in": linear_sources("txt_in"),
        "final_mod.lin": linear_sources("final_layer.adaLN_modulation.1"),
        "proj_out": linear_sources("final_layer.linear"),
    }

    def double(layer: int) -> dict[str, dict[str, Source]]:
        p = f"double_blocks.{layer}"
        out = {}
        for stream in ("img", "txt"):
            out.update({
                f"{stream}_mod.lin": linear_sources(f"{p}.{stream}_mod.lin"),
                f"{stream}_attn.q": linear_sources(f"{p}.{stream}_attn.qkv", rows=q_rows),
                f"{stream}_attn.k": linear_sources(f"{p}.{stream}_attn.qkv", rows=k_rows),
                f"{stream}_attn.v": linear_sources(f"{p}.{stream}_attn.qkv", rows=v_rows),
                f"{stream}_attn.norm_q": {"scale": Source(f"{p}.{stream}_attn.norm.query_norm.scale")},
                f"{stream}_attn.norm_k": {"scale": Source(f"{p}.{stream}_attn.norm.key_norm.scale")},
                f"{stream}_out": linear_sources(f"{p}.{stream}_attn.proj"),
                f"{stream}_mlp.fc1": linear_sources(f"{p}.{stream}_mlp.0"),
                f"{stream}_mlp.fc2": linear_sources(f"{p}.{stream}_mlp.2"),
            })
        return out

    def single(layer: int) -> dict[str, dict[str, Source]]:
        p = f"single_blocks.{layer}"
        return {
            "mod.lin": linear_sources(f"{p}.modulation.lin"),
            "attn.q": linear_sources(f"{p}.linear1", rows=q_rows),
            "attn.k": linear_sources(f"{p}.linear1", rows=k_rows),
            "attn.v": linear_sources(f"{p}.linear1", rows=v_rows),
            "attn.norm_q": {"scale": Source(f"{p}.norm.query_norm.scale")},
            "attn.norm_k": {"scale": Source(f"{p}.norm.key_norm.scale")},
            "mlp_in": linear_sources(f"{p}.linear1", rows=((3 * d, 3 * d + m),)),
            "out_attn": linear_sources(f"{p}.linear2", cols=(0, d)),
            "out_mlp": linear_sources(f"{p}.linear2", cols=(d, d + m), bias=False),
        }

    return top, double, single


def _source_fn(key_map):
    top, double, single = key_map

    def source(path: tuple[str, ...]):
        *module, leaf = path
        if module and module[0] in ("double_blocks", "single_blocks"):
            per_layer = double if module[0] == "double_blocks" else single
            name = ".".join(module[1:])
            return lambda layer: per_layer(layer)[name][leaf]
        return top[".".join(module)][leaf]

    return source


def bfl_config_from_checkpoint(checkpoint: weights.SafetensorsCheckpoint,
                               **overrides) -> flux.FluxConfig:
    """Infers a FluxConfig from a BFL single-file checkpoint's tensor shapes."""
    keys = checkpoint.keys()

    def count(prefix):
        return len({k.split(".")[1] for k in keys if k.startswith(prefix + ".")})

    hidden, in_channels = checkpoint.shape("img_in.weight")
    head_dim = checkpoint.shape("double_blocks.0.img_attn.norm.query_norm.scale")[0]
    inferred = dict(
        in_channels=in_channels,
        out_channels=checkpoint.shape("final_layer.linear.weight")[0],
        num_layers=count("double_blocks"),
        num_single_layers=count("single_blocks"),
        attention_head_dim=head_dim,
        num_attention_heads=hidden // head_dim,
        joint_attention_dim=checkpoint.shape("txt_in.weight")[1],
        pooled_projection_dim=checkpoint.shape("vector_in.in_layer.weight")[1],
        guidance_embeds="guidance_in.in_layer.weight" in checkpoint,
        mlp_ratio=checkpoint.shape("double_blocks.0.img_mlp.0.weight")[0] / hidden,
    )
    if head_dim == 128:  # FLUX.1 dev / schnell
        inferred["axes_dims_rope"] = (16, 56, 56)
    inferred.update(overrides)
    if "axes_dims_rope" not in inferred:
        raise ValueError(f"Cannot infer axes_dims_rope for head dim {head_dim} from a BFL file; "
                         "pass axes_dims_rope=(...) (they sum to the head dim).")
    return flux.FluxConfig(**inferred)


def _open_pretrained(path: str | os.PathLike, **config_overrides):
    """(FluxConfig, checkpoint, "diffusers" | "bfl") of a checkpoint path (tensors not read)."""
    path = os.fspath(path)
    if os.path.isdir(path) and os.path.isdir(os.path.join(path, "transformer")):
        path = os.path.join(path, "transformer")
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        if not os.path.exists(config_file):
            raise FileNotFoundError(f"{path} has no config.json: expected a diffusers transformer/ "
                                    "folder (config.json + diffusion_pytorch_model*.safetensors).")
        with open(config_file) as f:
            values = json.load(f)
        values.update(config_overrides)
        return flux.FluxConfig.from_dict(values), weights.SafetensorsCheckpoint(path), "diffusers"
    if os.path.isfile(path):
        checkpoint = weights.SafetensorsCheckpoint(path)
        return bfl_config_from_checkpoint(checkpoint, **config_overrides), checkpoint, "bfl"
    raise FileNotFoundError(f"No FLUX checkpoint at {path}: give a diffusers transformer/ "
                            "folder or a BFL flux1-*.safetensors file.")


def load_config(path: str | os.PathLike, **config_overrides) -> flux.FluxConfig:
    """The FluxConfig of a checkpoint (as `from_pretrained` reads it), without its weights."""
    return _open_pretrained(path, **config_overrides)[0]


def from_pretrained(path: str | os.PathLike, dtype: str | None = None, *,
                    mesh: jax.sharding.Mesh | None = None, rules=sharding_lib.DEFAULT_RULES,
                    **config_overrides) -> flux.Flux:
    """Loads FLUX weights from a diffusers folder or a BFL single file, straight into shardings.

    Args:
      path: a diffusers `transformer/` folder (config.json + safetensors, sharded index too), a
        model folder that contains `transformer/`, or BFL's single `flux1-*.safetensors` file.
      dtype: the activations' (compute) dtype, e.g. "bfloat16"; None keeps float32. The
        parameters' dtype is `param_dtype` (default float32; the file's dtype is cast to it).
      mesh: if given, each parameter is assembled directly into its NamedSharding on this mesh,
        each device reading only its own slice (no full replica anywhere); otherwise the
        parameters go to the default device.
      rules: logical axis rules for the shardings.
      **config_overrides: FluxConfig fields to set (e.g. param_dtype="bfloat16",
        scan_layers=False, remat_policy="full").

    Raises:
      FileNotFoundError: no checkpoint at path.
      weights.CheckpointMismatchError: a missing, unexpected or mis-shaped tensor (named).
    """
    if dtype is not None:
        config_overrides["dtype"] = dtype
    cfg, checkpoint, layout = _open_pretrained(path, **config_overrides)
    key_map = _diffusers_key_map(cfg) if layout == "diffusers" else _bfl_key_map(cfg)
    if mesh is not None:
        flux.validate_mesh(cfg, mesh)
    graphdef, abstract_state = nnx.split(flux.abstract_model(cfg, rules))
    shardings = (sharding_lib.state_shardings(abstract_state, mesh, sharding_lib.rules_from_config(rules))
                 if mesh is not None else None)
    state = weights.load_state(checkpoint, abstract_state, _source_fn(key_map), shardings)
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------
# The way back: our parameters as a public layout's state dict.

LAYOUTS = ("diffusers", "bfl")

# diffusers' FluxTransformer2DModel config.json: the class and the architecture fields it takes
# (its MLP ratio 4 and RoPE theta 10000 are fixed in its code, not configurable).
DIFFUSERS_CLASS = "FluxTransformer2DModel"
DIFFUSERS_FIELDS = ("in_channels", "out_channels", "num_layers", "num_single_layers",
                    "attention_head_dim", "num_attention_heads", "joint_attention_dim",
                    "pooled_projection_dim", "guidance_embeds", "axes_dims_rope")


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """One tensor of a public layout and the parts of our parameters it is made of.

    Attributes:
      key: its name in the layout's state dict.
      shape: its stored shape (PyTorch's [out, in] for linears).
      parts: (our parameter path, layer index in a stacked parameter or None, the TensorSource
        that `from_pretrained` reads that parameter's values with), in the layout's row order.
    """

    key: str
    shape: tuple[int, ...]
    parts: tuple[tuple[tuple[str, ...], int | None, weights.TensorSource], ...]


def _key_map(cfg: flux.FluxConfig, layout: str):
    if layout not in LAYOUTS:
        raise ValueError(f"Unknown FLUX weight layout {layout!r}; use one of {LAYOUTS}.")
    return _diffusers_key_map(cfg) if layout == "diffusers" else _bfl_key_map(cfg)


def check_exportable(cfg: flux.FluxConfig, layout: str) -> None:
    """Raises ValueError naming the fields a layout cannot express for this architecture."""
    _key_map(cfg, layout)
    fixed = {"mlp_ratio": 4.0, "rope_theta": 10000.0}
    wrong = {k: getattr(cfg, k) for k, v in fixed.items() if getattr(cfg, k) != v}
    if wrong:
        raise ValueError(f"The {layout} FLUX layout fixes {fixed} in its loaders' code; this "
                         f"transformer has {wrong}, which a {layout} file cannot carry.")


def stored_layout(cfg: flux.FluxConfig, layout: str) -> list[StoredTensor]:
    """Every tensor of the layout's state dict for this architecture, in our parameter order,
    each with the parts of our parameters that fill it; the inverse of `from_pretrained`'s
    key map (every stored value is covered exactly once: checked)."""
    source_fn = _source_fn(_key_map(cfg, layout))
    _, abstract = nnx.split(flux.abstract_model(cfg))
    pieces: dict[str, list] = {}
    for path, variable in nnx.to_flat_state(abstract):
        path = tuple(map(str, path))
        axes = variable.get_metadata().get("logical_axes") or ()
        source = source_fn(path)
        if axes and axes[0] == "layers":
            per_layer = tuple(variable.shape[1:])
            for layer in range(variable.shape[0]):
                pieces.setdefault(source(layer).key, []).append(
                    (path, layer, source(layer), per_layer))
        else:
            pieces.setdefault(source.key, []).append((path, None, source, tuple(variable.shape)))
    out = []
    for key, parts in pieces.items():
        shape = _stored_shape(parts)
        covered = sum(math.prod(ours) for *_, ours in parts)
        if covered != math.prod(shape):
            raise AssertionError(f"{key}: our parameters cover {covered} of its "
                                 f"{math.prod(shape)} values ({layout} key map)")
        out.append(StoredTensor(key, shape, tuple(p[:3] for p in parts)))
    return out


def _stored_shape(parts) -> tuple[int, ...]:
    """The stored tensor's shape from the regions its parts fill (rows: dim 0, cols: dim 1)."""
    dims: list[int] = []
    for _, _, source, ours in parts:
        region = list(reversed(ours)) if source.transpose else list(ours)
        if source.rows is not None:
            region[0] = max(b for _, b in source.rows)
        if source.cols is not None:
            region[1] = source.cols[1]
        dims = [max(a, b) for a, b in zip(dims, region)] if dims else region
    return tuple(dims)


def _host_value(array: jax.Array, layer: int | None) -> np.ndarray:
    """One parameter (one layer of a stacked one) on this host, whatever its sharding (on
    several processes every process must call this in the same order: it gathers)."""
    value = array if layer is None else array[layer]
    if not value.is_fully_addressable:
        value = multihost_utils.process_allgather(value, tiled=True)
    return np.asarray(jax.device_get(value))


def stored_tensors(model: flux.Flux, layout: str, dtype: str = "bfloat16") -> list[TensorSpec]:
    """The model's weights as the layout's state dict ("diffusers": FluxTransformer2DModel's,
    "bfl": flux1-*.safetensors'), cast to `dtype`: one TensorSpec per tensor, whose `produce()`
    gathers just that tensor's parts from the devices (so writing them one by one holds one
    tensor in host memory). A model with LoRA adapters must be merged first (`lora.merge`)."""
    check_exportable(model.cfg, layout)
    out_dtype = np.dtype(execution.to_dtype(dtype))
    state = dict(nnx.to_flat_state(nnx.state(model)))
    state = {tuple(map(str, k)): v for k, v in state.items()}

    def produce(stored: StoredTensor):
        def fill() -> np.ndarray:
            out = np.empty(stored.shape, np.float32)
            for path, layer, source in stored.parts:
                if path not in state:
                    raise ValueError(f"The model has no parameter {'.'.join(path)} (merge LoRA "
                                     "adapters with lora.merge before exporting).")
                value = _host_value(state[path].get_value(), layer).astype(np.float32)
                value = value.T if source.transpose else value
                rows = source.row_index(stored.shape[0])
                if value.ndim == 1:
                    out[rows] = value
                else:
                    c0, c1 = source.col_range(stored.shape[1])
                    out[rows, c0:c1] = value
            return out.astype(out_dtype)
        return fill

    layout_tensors = stored_layout(model.cfg, layout)
    missing = sorted({".".join(p) for t in layout_tensors for p, _, _ in t.parts} -
                     {".".join(p) for p in state})
    if missing:
        raise ValueError(f"The model lacks parameters the {layout} layout needs: {missing[:5]} "
                         "(merge LoRA adapters with lora.merge before exporting).")
    return [TensorSpec(t.key, t.shape, out_dtype, produce(t)) for t in layout_tensors]


def diffusers_config(cfg: flux.FluxConfig, base: dict | None = None) -> dict:
    """The config.json of a diffusers transformer/ folder for this architecture; the entries of
    `base` (the config.json the run started from, e.g. its `_diffusers_version`) are kept
    unless an architecture field overrides them."""
    check_exportable(cfg, "diffusers")
    values = dict(base or {})
    values["_class_name"] = DIFFUSERS_CLASS
    values.update({k: getattr(cfg, k) for k in DIFFUSERS_FIELDS})
    values["axes_dims_rope"] = list(cfg.axes_dims_rope)
    values["patch_size"] = 1
    return values
