"""Low-rank adapters (LoRA) on the FLUX transformer's linears, their files and their merging.

With `model.lora.rank` r > 0 each target linear y = x W + b of `models.flux` becomes
y = x W + b + (alpha / r) · (x A) B with A [in, r] and B [r, out] (B zero at the start, so the
adapted model computes exactly the base model's outputs). A and B are `nnx.LoRAParam`
variables (a subclass of `nnx.Param`): `nnx.split(model, nnx.LoRAParam, ...)` separates the
trainable adapters from the frozen base. They carry logical axis names (the base kernel's input
axis on A, its output axis on B, "layers" first in the stacked blocks; the rank axis is
unsharded), so they shard over the mesh like the rest (`parallel.sharding`).

Targets are named by their paths in our port, one block kind at a time
(`double_blocks.img_attn.q`, `single_blocks.mlp_in`, ...; `TARGETS`). Adapters are created
directly on the stacked blocks ([layers, in, r] / [layers, r, out]), so
`execution.run_stacked` scans over them like over any other parameter.

Files:
  save_peft / load_peft    the adapters alone, safetensors in the PEFT / diffusers LoRA layout
                           of `FluxTransformer2DModel` (`transformer.<module>.lora_A.weight`
                           [r, in], `...lora_B.weight` [out, r], alpha / r folded into B;
                           the LoraConfig in the `lora_adapter_metadata` entry), so that
                           diffusers' `load_lora_weights` / `load_lora_adapter` reads them
  merge                    our model with the adapters folded into plain linears (what
                           `python -m g2rpo_jax.export` writes as a diffusers or BFL transformer)

One of our linears may be only a part of a stored module: diffusers' single-block `proj_out`
takes cat(attention, MLP) (our `out_attn` and `out_mlp`), BFL fuses q, k, v (and the single
blocks' MLP input) into one matrix. Such a module's adapter is the block-diagonal stack of its
parts' adapters (rank k·r for k parts), which is the same update exactly.

Why not `qwix` (0.1.8) LoRA: it creates the adapters lazily, inside the first traced call, by
intercepting `dot_general` in whatever module is running. Our blocks run inside `jax.lax.scan`
on a module merged from one layer's slice of the stacked state (`execution.run_stacked`), so
adapters created there would belong to a per-iteration copy, not to the stacked model, and
they would carry no "layers" axis; it also matches every dot_general of a module (the adaLN
modulations, the embedders) rather than named linears. A wrapper of ~50 lines gives stacked
adapters with our logical axis names and no tracing at construction.
"""

from collections.abc import Mapping, Sequence
import dataclasses
import json
import math
import os
import re

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.models import flux, flux_weights, safetensors_io
from g2rpo_jax.parallel import sharding as sharding_lib

LoRAParam = nnx.LoRAParam

# Our linears that may carry adapters: attention q / k / v / out and the MLP of both block kinds.
TARGETS = (
    "double_blocks.img_attn.q", "double_blocks.img_attn.k", "double_blocks.img_attn.v",
    "double_blocks.img_out", "double_blocks.img_mlp.fc1", "double_blocks.img_mlp.fc2",
    "double_blocks.txt_attn.q", "double_blocks.txt_attn.k", "double_blocks.txt_attn.v",
    "double_blocks.txt_out", "double_blocks.txt_mlp.fc1", "double_blocks.txt_mlp.fc2",
    "single_blocks.attn.q", "single_blocks.attn.k", "single_blocks.attn.v",
    "single_blocks.mlp_in", "single_blocks.out_attn", "single_blocks.out_mlp",
)

# The key prefix of the transformer's adapters in a diffusers pipeline LoRA file.
DIFFUSERS_PREFIX = "transformer"
METADATA_KEY = "lora_adapter_metadata"   # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """`model.lora`: rank 0 = off; alpha / rank scales the update; dropout must be 0."""

    rank: int = 0
    alpha: float = 64.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(str(t) for t in self.targets))
        if self.rank < 0:
            raise ValueError(f"model.lora.rank must be ≥ 0 (0 = off), got {self.rank}.")
        if self.dropout != 0:
            raise ValueError(f"model.lora.dropout={self.dropout}: only 0 is supported.")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise ValueError(f"Unknown model.lora.targets {unknown}; choose from {list(TARGETS)}.")
        if self.rank and not self.targets:
            raise ValueError("model.lora.rank > 0 but model.lora.targets is empty.")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, section) -> "LoRAConfig":
        """From a config's `model.lora` section (a ConfigDict or mapping); None = off."""
        if section is None:
            return cls()
        values = dict(section.to_dict() if hasattr(section, "to_dict") else section)
        return cls(**values)


# ---------------------------------------------------------------------------------------------
# Pure pieces.


def delta(a: jax.Array, b: jax.Array, scale: float) -> jax.Array:
    """The kernel update scale · A B, [..., in, out] from A [..., in, r] and B [..., r, out]."""
    return scale * jnp.einsum("...ir,...ro->...io", a.astype(jnp.float32), b.astype(jnp.float32))


def adapter_shapes(kernel_shape: Sequence[int], rank: int) -> tuple[tuple, tuple]:
    """(A's shape, B's shape) for a (possibly stacked) kernel [..., in, out]."""
    *lead, d_in, d_out = kernel_shape
    return (*lead, d_in, rank), (*lead, rank, d_out)


def adapter_axes(kernel_axes: Sequence[str | None] | None, ndim: int) -> tuple[tuple, tuple]:
    """Logical axis names of A and B from the kernel's: A keeps the input axis, B the output
    axis; the rank axis is None (replicated)."""
    axes = tuple(kernel_axes) if kernel_axes else (None,) * ndim
    return (*axes[:-1], None), (*axes[:-2], None, axes[-1])


def init_a(key: jax.Array, shape: Sequence[int]) -> jax.Array:
    """PEFT's default for A (kaiming-uniform with a = √5): U(-1/√in, 1/√in), float32."""
    bound = 1.0 / math.sqrt(shape[-2])
    return jax.random.uniform(key, shape, jnp.float32, -bound, bound)


# ---------------------------------------------------------------------------------------------
# The module.


class LoRALinear(nnx.Module):
    """A frozen `nnx.Linear` (`base`) plus a low-rank update: base(x) + scale · (x A) B."""

    def __init__(self, base: nnx.Linear, rank: int, scale: float):
        self.base = base
        kernel = base.kernel
        a_shape, b_shape = adapter_shapes(kernel.shape, rank)
        a_axes, b_axes = adapter_axes(kernel.get_metadata().get("logical_axes"), kernel.ndim)
        # Shapes only; `apply` fills in the values (initialised straight into their shardings).
        self.lora_a = LoRAParam(jax.ShapeDtypeStruct(a_shape, jnp.float32), logical_axes=a_axes)
        self.lora_b = LoRAParam(jax.ShapeDtypeStruct(b_shape, jnp.float32), logical_axes=b_axes)
        self.scale = scale

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.base(x)
        dtype = self.base.dtype or x.dtype
        low = jnp.dot(x.astype(dtype), self.lora_a[...].astype(dtype))
        update = jnp.dot(low, self.lora_b[...].astype(dtype))
        return y + (self.scale * update).astype(y.dtype)


def _module_at(model: nnx.Module, path: Sequence[str]):
    for name in path:
        model = getattr(model, name)
    return model


def targets_in(model: flux.Flux) -> list[tuple[str, ...]]:
    """Paths of the LoRALinear modules in `model`, in TARGETS order."""
    return [tuple(t.split(".")) for t in TARGETS
            if isinstance(_module_at(model, t.split(".")), LoRALinear)]


def wrap(model: flux.Flux, cfg: LoRAConfig) -> flux.Flux:
    """Replaces the target linears of `model` (in place) by LoRALinear wrappers whose
    adapters hold shapes only (see `apply`). Returns the model."""
    for target in cfg.targets:
        *parent, name = target.split(".")
        owner = _module_at(model, parent)
        base = getattr(owner, name)
        if isinstance(base, LoRALinear):
            raise ValueError(f"{target} already has an adapter.")
        setattr(owner, name, LoRALinear(base, cfg.rank, cfg.scale))
    return model


def initial_adapters(abstract: nnx.State, key: jax.Array) -> nnx.State:
    """Initial values of an adapter state of shapes (`nnx.state(model, LoRAParam)`): A from
    `init_a` (one key per target), B zero. Pure; jit it with out_shardings to place them."""
    flat = []
    for i, (path, variable) in enumerate(nnx.to_flat_state(abstract)):
        if path[-1] == "lora_a":
            value = init_a(jax.random.fold_in(key, i), variable.shape)
        else:
            value = jnp.zeros(variable.shape, jnp.float32)
        flat.append((path, variable.replace(value)))
    return nnx.from_flat_state(flat)


def apply(model: flux.Flux, cfg: LoRAConfig, key: jax.Array | int = 0,
          mesh: jax.sharding.Mesh | None = None, rules=sharding_lib.DEFAULT_RULES) -> flux.Flux:
    """Adds adapters to `model` (in place) as `cfg` says (nothing if rank is 0), initialised
    (A random, B zero) straight into their shardings on `mesh` (by the logical axis rules).
    Returns the model."""
    if not cfg.enabled:
        return model
    if isinstance(key, int):
        key = jax.random.key(key)
    wrap(model, cfg)
    abstract = nnx.state(model, LoRAParam)
    shardings = (sharding_lib.state_shardings(abstract, mesh,
                                              sharding_lib.rules_from_config(rules))
                 if mesh is not None else None)
    values = jax.jit(initial_adapters, out_shardings=shardings)(abstract, key)
    nnx.update(model, values)
    return model


def from_config(model: flux.Flux, model_config, seed: int = 0, mesh=None,
                rules=sharding_lib.DEFAULT_RULES) -> flux.Flux:
    """`apply` with a config's `model` section (its `lora` subsection; absent = off)."""
    section = model_config.get("lora") if hasattr(model_config, "get") else None
    return apply(model, LoRAConfig.from_config(section), jax.random.key(seed), mesh, rules)


def merge(model: flux.Flux) -> flux.Flux:
    """Folds every adapter into its base linear (kernel += scale · A B) and puts the base back
    in the adapter's place, in place: the result is a plain `flux.Flux` (its state has the
    paths of a model without LoRA), computing the adapted model's function. Returns it."""
    for path in targets_in(model):
        owner = _module_at(model, path[:-1])
        wrapped = getattr(owner, path[-1])
        base = wrapped.base
        kernel = base.kernel[...]
        base.kernel[...] = (kernel.astype(jnp.float32) + delta(
            wrapped.lora_a[...], wrapped.lora_b[...], wrapped.scale)).astype(kernel.dtype)
        setattr(owner, path[-1], base)
    return model


# ---------------------------------------------------------------------------------------------
# Stored layouts: which stored module (and which of its rows / columns) each target is.


def _parts(cfg: flux.FluxConfig, layout: str, targets: Sequence[str]):
    """{stored module: [(target, layer, rows ranges | None, cols range | None), ...]} for the
    targets in every layer, in a stable order (the order of the block-diagonal stack)."""
    key_map = (flux_weights._diffusers_key_map(cfg) if layout == "diffusers"
               else flux_weights._bfl_key_map(cfg))
    _, double, single = key_map
    modules: dict[str, list] = {}
    for kind, count, per_layer in (("double_blocks", cfg.num_layers, double),
                                   ("single_blocks", cfg.num_single_layers, single)):
        for layer in range(count):
            sources = per_layer(layer)
            for target in targets:
                if not target.startswith(kind + "."):
                    continue
                source = sources[target[len(kind) + 1:]]["kernel"]
                module = source.key.removesuffix(".weight")
                modules.setdefault(module, []).append((target, layer, source.rows, source.cols))
    return modules


def _index(ranges, size: int) -> np.ndarray:
    ranges = ranges or ((0, size),)
    return np.concatenate([np.arange(a, b) for a, b in ranges])


def _module_shape(cfg: flux.FluxConfig, layout: str, module: str) -> tuple[int, int]:
    """(out, in) of a stored linear, from the key map (every one of ours covers its module's
    rows / columns together with its siblings)."""
    d, m = cfg.hidden_size, cfg.mlp_hidden_dim
    if layout == "bfl" and module.endswith("linear1"):
        return 3 * d + m, d
    if module.endswith(("qkv",)):
        return 3 * d, d
    if module.endswith(("linear2", "proj_out")) and "single" in module:
        return d, d + m
    if module.endswith(("mlp.0", "ff.net.0.proj", "ff_context.net.0.proj", "proj_mlp")):
        return m, d
    if module.endswith(("mlp.2", "ff.net.2", "ff_context.net.2")):
        return d, m
    return d, d


def _adapter_arrays(model: flux.Flux) -> dict[str, tuple[np.ndarray, np.ndarray, float]]:
    """{target: (A [L, in, r], B [L, r, out], scale)} on the host (float32)."""
    out = {}
    for path in targets_in(model):
        wrapped = _module_at(model, path)
        out[".".join(path)] = (np.asarray(jax.device_get(wrapped.lora_a[...]), np.float32),
                               np.asarray(jax.device_get(wrapped.lora_b[...]), np.float32),
                               float(wrapped.scale))
    return out


def peft_state_dict(model: flux.Flux, prefix: str = DIFFUSERS_PREFIX
                    ) -> tuple[dict[str, np.ndarray], dict]:
    """The adapters as a PEFT / diffusers FluxTransformer2DModel LoRA state dict
    ({`<prefix>.<module>.lora_A.weight`: [R, in], `...lora_B.weight`: [out, R]}, float32) and
    its LoraConfig fields (r, lora_alpha, rank_pattern, alpha_pattern, target_modules). A module
    fed by k of our targets (the single blocks' proj_out) gets rank k·r. Our alpha / r is folded
    into lora_B and every module's alpha is its rank (scale 1): diffusers' convention for files
    without alphas, and `load_lora_adapter` given a file path does not read the metadata (diffusers
    0.42.1), so the file means the same whichever way it is read."""
    arrays = _adapter_arrays(model)
    if not arrays:
        raise ValueError("The model has no adapters (model.lora.rank is 0).")
    cfg = model.cfg
    tensors, ranks, alphas = {}, {}, {}
    rank = next(iter(arrays.values()))[0].shape[-1]
    scale = next(iter(arrays.values()))[2]
    for module, parts in _parts(cfg, "diffusers", list(arrays)).items():
        out_dim, in_dim = _module_shape(cfg, "diffusers", module)
        k = len(parts)
        lora_a = np.zeros((k * rank, in_dim), np.float32)
        lora_b = np.zeros((out_dim, k * rank), np.float32)
        for j, (target, layer, rows, cols) in enumerate(parts):
            a, b, _ = arrays[target]
            c0, c1 = cols or (0, in_dim)
            lora_a[j * rank:(j + 1) * rank, c0:c1] = a[layer].T
            lora_b[_index(rows, out_dim), j * rank:(j + 1) * rank] = scale * b[layer].T
        name = f"{prefix}.{module}" if prefix else module
        tensors[f"{name}.lora_A.weight"] = lora_a
        tensors[f"{name}.lora_B.weight"] = lora_b
        if k != 1:
            ranks[module], alphas[module] = k * rank, k * rank
    peft_config = {"r": rank, "lora_alpha": rank, "rank_pattern": ranks,
                   "alpha_pattern": alphas,
                   "target_modules": sorted(_parts(cfg, "diffusers", list(arrays))),
                   "lora_dropout": 0.0, "bias": "none", "init_lora_weights": True}
    return tensors, peft_config


def save_peft(path: str | os.PathLike, model: flux.Flux) -> str:
    """Writes the adapters alone as a diffusers-loadable LoRA safetensors file
    (`pipe.load_lora_weights(dir, weight_name=...)`, or `transformer.load_lora_adapter(file,
    prefix="transformer")`). Returns the path."""
    tensors, peft_config = peft_state_dict(model)
    metadata = {f"{DIFFUSERS_PREFIX}.{k}": v for k, v in peft_config.items()}
    safetensors_io.write_safetensors(path, tensors, {
        METADATA_KEY: json.dumps(metadata, indent=2, sort_keys=True), "format": "pt"})
    return os.fspath(path)


def _file_scales(metadata: Mapping[str, str]) -> tuple[float | None, dict, dict]:
    """(alpha / r, rank_pattern, alpha_pattern) from a file's LoRA metadata (None if absent)."""
    raw = metadata.get(METADATA_KEY)
    if not raw:
        return None, {}, {}
    config = {k.split(".", 1)[1] if k.startswith(DIFFUSERS_PREFIX + ".") else k: v
              for k, v in json.loads(raw).items()}
    return (config["lora_alpha"] / config["r"], config.get("rank_pattern") or {},
            config.get("alpha_pattern") or {})


def load_peft(path: str | os.PathLike, model: flux.Flux) -> flux.Flux:
    """Reads a PEFT / diffusers FLUX LoRA file (ours, or one whose modules each have one part
    of ours or a block-diagonal stack of them) into `model`'s adapters, in place: A and B by
    part, B rescaled from the file's alpha / r to the model's. Every adapter of the model must
    be in the file. Returns the model."""
    checkpoint = safetensors_io.SafetensorsCheckpoint(path)
    base_scale, _, alphas = _file_scales(checkpoint.metadata)
    arrays = _adapter_arrays(model)
    if not arrays:
        raise ValueError("The model has no adapters: set model.lora.rank > 0 before loading.")
    cfg, updates = model.cfg, {t: [np.array(a), np.array(b)] for t, (a, b, _) in arrays.items()}
    for module, parts in _parts(cfg, "diffusers", list(arrays)).items():
        name = f"{DIFFUSERS_PREFIX}.{module}"
        if f"{name}.lora_A.weight" not in checkpoint:
            raise KeyError(f"{path} has no adapter for {module} (needed by "
                           f"{sorted({p[0] for p in parts})}).")
        lora_a = np.asarray(checkpoint.array(f"{name}.lora_A.weight"), np.float32)
        lora_b = np.asarray(checkpoint.array(f"{name}.lora_B.weight"), np.float32)
        file_rank = lora_a.shape[0]
        if base_scale is None:
            scale = 1.0   # no metadata: the PEFT / diffusers convention alpha = rank
        else:
            pattern = next((v for k, v in alphas.items() if re.fullmatch(rf"(.*\.)?{k}", module)),
                           None)
            scale = (pattern / file_rank) if pattern is not None else base_scale
        for j, (target, layer, rows, cols) in enumerate(parts):
            a, b = updates[target]
            rank = a.shape[-1]
            block = slice(j * rank, (j + 1) * rank) if file_rank == len(parts) * rank else \
                slice(0, rank) if file_rank == rank else None
            if block is None:
                raise ValueError(f"{module} has rank {file_rank} in {path}; the model's "
                                 f"adapters have rank {rank} ({len(parts)} part(s)).")
            c0, c1 = cols or (0, lora_a.shape[1])
            a[layer] = lora_a[block, c0:c1].T
            b[layer] = lora_b[_index(rows, lora_b.shape[0]), block].T * (
                scale / arrays[target][2])
    for target, (a, b) in updates.items():
        wrapped = _module_at(model, target.split("."))
        wrapped.lora_a[...] = _like(a, wrapped.lora_a[...])
        wrapped.lora_b[...] = _like(b, wrapped.lora_b[...])
    return model


def _like(value: np.ndarray, template: jax.Array) -> jax.Array:
    sharding = getattr(template, "sharding", None)
    value = jnp.asarray(value, template.dtype)
    return jax.device_put(value, sharding) if sharding is not None else value
