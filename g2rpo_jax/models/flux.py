"""FLUX.1 rectified-flow transformer (Black Forest Labs), in Flax NNX.

A port of the architecture of `diffusers.FluxTransformer2DModel` / BFL's `flux.model.Flux`:
19 double-stream blocks (image and text streams with their own weights, joint attention),
38 single-stream blocks (one stream, parallel attention + MLP), 3-axis rotary position
embeddings, adaLN-Zero modulation from (timestep + guidance + pooled text) embeddings, and
QK RMSNorm. The blocks of each kind are stacked on a leading "layers" axis and run with
`jax.lax.scan`, so a 57-block model compiles as fast as a 2-block one.

Call signature (shared by every model the samplers use):
  model(img [B, N, C], img_ids [B, N, 3] | [N, 3], txt [B, T, D_txt], txt_ids [B, T, 3] | [T, 3],
        timesteps [B] in [0, 1], y [B, P], guidance [B] | None) -> velocity [B, N, C_out]
Timesteps and guidance are unscaled (the model multiplies them by 1000), as in diffusers.
Weights of public checkpoints (diffusers, BFL) load with `models.flux_weights`.
"""

from collections.abc import Mapping
import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.models import attention as attention_lib
from g2rpo_jax.models import execution
from g2rpo_jax.models.attention import dot_product_attention
from g2rpo_jax.parallel import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class FluxConfig:
    """Architecture and execution settings. Field names follow diffusers' config.json."""

    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = True
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)
    mlp_ratio: float = 4.0
    rope_theta: float = 10000.0
    # Execution (not architecture): activations' dtype, master weights' dtype, layer loop,
    # attention kernel.
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat_policy: str = "none"
    # models.attention: "auto" (the platform's fused kernel: splash on TPU, cuDNN on GPU in
    # bf16 / fp16, else XLA), "xla", "cudnn" or "splash".
    attention: str = "auto"

    EXECUTION_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat_policy", "attention")

    def __post_init__(self):
        object.__setattr__(self, "axes_dims_rope", tuple(int(a) for a in self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must sum to attention_head_dim "
                             f"{self.attention_head_dim}.")
        if any(a % 2 for a in self.axes_dims_rope):
            raise ValueError(f"Every RoPE axis dim must be even, got {self.axes_dims_rope}.")
        execution.check_remat_policy(self.remat_policy)
        if self.attention not in attention_lib.IMPLEMENTATIONS:
            raise ValueError(f"Unknown attention {self.attention!r}; use one of "
                             f"{attention_lib.IMPLEMENTATIONS}.")
        execution.to_dtype(self.dtype), execution.to_dtype(self.param_dtype)

    def architecture(self) -> dict:
        """The fields that decide the weights' names and shapes (everything but execution)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in self.EXECUTION_FIELDS}

    @property
    def hidden_size(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def mlp_hidden_dim(self) -> int:
        return int(self.hidden_size * self.mlp_ratio)

    @property
    def output_channels(self) -> int:
        return self.out_channels or self.in_channels

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "FluxConfig":
        """Builds a config from a mapping (an ml_collections section or a diffusers config.json),
        ignoring keys that are not fields (e.g. diffusers' `_class_name`, `patch_size`)."""
        values = dict(values)
        # Configs and generator files written before the field was named `attention` (the
        # shipped base among them) call it `attention_impl`.
        if "attention_impl" in values:
            values.setdefault("attention", values.pop("attention_impl"))
        if values.get("patch_size", 1) != 1:
            raise ValueError(f"FLUX patchifies outside the transformer; patch_size must be 1, got "
                             f"{values['patch_size']}.")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})


# ---------------------------------------------------------------------------------------------
# Pure pieces.


def timestep_embedding(t: jax.Array, dim: int = 256, max_period: float = 10000.0,
                       time_factor: float = 1000.0) -> jax.Array:
    """Sinusoidal embedding [B, dim] of t [B] (scaled by time_factor), as cat(cos, sin)."""
    half = dim // 2
    # At t·1000 ≈ 1000 rad one ulp in a frequency moves the phase by ~1e-4, so the frequencies
    # are fixed constants rounded as the reference (float32 exponent, exact exp) rounds them,
    # not whatever a backend's fast exp returns.
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    freqs = np.exp((exponent / np.float32(half)).astype(np.float64)).astype(np.float32)
    args = (time_factor * t.astype(jnp.float32))[:, None] * jnp.asarray(freqs, jnp.float32)[None]
    return jnp.concatenate([jnp.cos(args), jnp.sin(args)], axis=-1)


def rope_angles(ids: jax.Array, axes_dims: tuple[int, ...], theta: float) -> tuple[jax.Array, jax.Array]:
    """Rotary angles for 3-axis positions.

    Args:
      ids: [B, S, A] positions (A = len(axes_dims)); float or int.
      axes_dims: rotary dims per position axis (each even; they sum to the head dim).
      theta: the RoPE base.

    Returns:
      (cos, sin), each [B, S, head_dim // 2], float32. Pair j of the head dim rotates by
      angle[j]; axis a owns pairs [sum(axes_dims[:a]) / 2, sum(axes_dims[:a+1]) / 2).
    """
    freqs = np.concatenate([
        1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim) for dim in axes_dims])
    owner = np.concatenate([np.full(dim // 2, a) for a, dim in enumerate(axes_dims)])
    positions = ids.astype(jnp.float32)[..., owner]  # [B, S, D/2]
    angles = positions * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates adjacent pairs (x[2j], x[2j+1]) of x [B, S, H, D] by the angles [B, S, D/2]."""
    b, s, h, d = x.shape
    pairs = x.astype(jnp.float32).reshape(b, s, h, d // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    rotated = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
    return rotated.reshape(b, s, h, d).astype(x.dtype)


def layer_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """LayerNorm over the last dim without affine parameters, computed in float32."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    return ((x32 - mean) * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def modulate(x: jax.Array, shift: jax.Array, scale: jax.Array) -> jax.Array:
    """adaLN: LayerNorm(x) · (1 + scale) + shift, with shift/scale [B, 1, D] broadcast over tokens."""
    return layer_norm(x) * (1 + scale) + shift


# ---------------------------------------------------------------------------------------------
# Layers.


def _linear(in_features: int, out_features: int, axes: tuple[str | None, str | None],
            cfg: FluxConfig, rngs: nnx.Rngs, use_bias: bool = True) -> nnx.Linear:
    return nnx.Linear(
        in_features, out_features, use_bias=use_bias, dtype=execution.to_dtype(cfg.dtype),
        param_dtype=execution.to_dtype(cfg.param_dtype), rngs=rngs,
        kernel_init=nnx.initializers.xavier_uniform(),
        kernel_metadata={"logical_axes": axes}, bias_metadata={"logical_axes": (axes[1],)})


class QKNorm(nnx.Module):
    """RMSNorm over the head dim with a learned scale [D] (FLUX's QK norm), in float32."""

    def __init__(self, head_dim: int, cfg: FluxConfig, eps: float = 1e-6):
        self.scale = nnx.Param(jnp.ones((head_dim,), execution.to_dtype(cfg.param_dtype)),
                               logical_axes=("head_dim",))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class MLPEmbedder(nnx.Module):
    """Linear → SiLU → Linear: embeds timesteps, guidance and the pooled text vector."""

    def __init__(self, in_dim: int, cfg: FluxConfig, rngs: nnx.Rngs):
        self.in_layer = _linear(in_dim, cfg.hidden_size, ("input", "embed"), cfg, rngs)
        self.out_layer = _linear(cfg.hidden_size, cfg.hidden_size, ("embed", None), cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out_layer(jax.nn.silu(self.in_layer(x)))


class MLP(nnx.Module):
    """Linear → GELU (tanh) → Linear, the transformer MLP."""

    def __init__(self, cfg: FluxConfig, rngs: nnx.Rngs):
        self.fc1 = _linear(cfg.hidden_size, cfg.mlp_hidden_dim, ("embed", "mlp"), cfg, rngs)
        self.fc2 = _linear(cfg.mlp_hidden_dim, cfg.hidden_size, ("mlp", "embed"), cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


class Modulation(nnx.Module):
    """SiLU → Linear from the conditioning vector [B, D] to `count` chunks, each [B, 1, D]."""

    def __init__(self, count: int, cfg: FluxConfig, rngs: nnx.Rngs):
        self.count = count
        self.lin = _linear(cfg.hidden_size, count * cfg.hidden_size, ("embed", "modulation"),
                           cfg, rngs)

    def __call__(self, vec: jax.Array) -> list[jax.Array]:
        out = self.lin(jax.nn.silu(vec))[:, None, :]
        return jnp.split(out, self.count, axis=-1)


class QKVProjection(nnx.Module):
    """Separate q, k, v projections (so tensor parallelism splits whole heads) and QK norm."""

    def __init__(self, cfg: FluxConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.q = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.k = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.v = _linear(d, d, ("embed", "heads"), cfg, rngs)
        self.norm_q = QKNorm(cfg.attention_head_dim, cfg)
        self.norm_k = QKNorm(cfg.attention_head_dim, cfg)
        self.num_heads = cfg.num_attention_heads

    def __call__(self, x: jax.Array, rules) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, S, D] → q, k, v each [B, S, H, D/H]."""
        b, s, _ = x.shape

        def heads(t):
            t = t.reshape(b, s, self.num_heads, -1)
            return sharding_lib.with_logical_constraint(t, ("batch", "length", "act_heads", None),
                                                        rules)

        return (self.norm_q(heads(self.q(x))), self.norm_k(heads(self.k(x))), heads(self.v(x)))


def _attend(q, k, v, cos, sin, implementation, rules):
    """RoPE on q, k, then attention; [B, S, H, D] in, [B, S, H·D] out. The activations' layout
    (batch over data / fsdp, heads over tensor) goes with them for kernels that run per shard."""
    mesh = jax.sharding.get_abstract_mesh()
    spec = None if mesh.empty else sharding_lib.logical_to_spec(
        ("batch", "length", "act_heads", None), rules, q.shape, mesh)
    out = dot_product_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v,
                                implementation, spec=spec)
    return out.reshape(*out.shape[:2], -1)


class DoubleStreamBlock(nnx.Module):
    """Image and text streams with separate weights and one joint attention over [txt; img]."""

    def __init__(self, cfg: FluxConfig, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.img_mod = Modulation(6, cfg, rngs)
        self.txt_mod = Modulation(6, cfg, rngs)
        self.img_attn = QKVProjection(cfg, rngs)
        self.txt_attn = QKVProjection(cfg, rngs)
        self.img_out = _linear(d, d, ("heads", "embed"), cfg, rngs)
        self.txt_out = _linear(d, d, ("heads", "embed"), cfg, rngs)
        self.img_mlp = MLP(cfg, rngs)
        self.txt_mlp = MLP(cfg, rngs)
        self.attention = cfg.attention

    def __call__(self, img, txt, vec, cos, sin, rules):
        """img [B, N, D], txt [B, T, D], vec [B, D], cos/sin [B, T+N, D_head/2]."""
        img_shift1, img_scale1, img_gate1, img_shift2, img_scale2, img_gate2 = self.img_mod(vec)
        txt_shift1, txt_scale1, txt_gate1, txt_shift2, txt_scale2, txt_gate2 = self.txt_mod(vec)
        img_q, img_k, img_v = self.img_attn(modulate(img, img_shift1, img_scale1), rules)
        txt_q, txt_k, txt_v = self.txt_attn(modulate(txt, txt_shift1, txt_scale1), rules)
        joint = [jnp.concatenate(pair, axis=1)
                 for pair in ((txt_q, img_q), (txt_k, img_k), (txt_v, img_v))]
        attn = _attend(*joint, cos, sin, self.attention, rules)
        txt_len = txt.shape[1]
        img = img + img_gate1 * self.img_out(attn[:, txt_len:])
        img = img + img_gate2 * self.img_mlp(modulate(img, img_shift2, img_scale2))
        txt = txt + txt_gate1 * self.txt_out(attn[:, :txt_len])
        txt = txt + txt_gate2 * self.txt_mlp(modulate(txt, txt_shift2, txt_scale2))
        return img, txt


class SingleStreamBlock(nnx.Module):
    """One stream over [txt; img]: attention and MLP in parallel from one modulated input."""

    def __init__(self, cfg: FluxConfig, rngs: nnx.Rngs):
        d, m = cfg.hidden_size, cfg.mlp_hidden_dim
        self.mod = Modulation(3, cfg, rngs)
        self.attn = QKVProjection(cfg, rngs)
        self.mlp_in = _linear(d, m, ("embed", "mlp"), cfg, rngs)
        # BFL's linear2 acts on cat(attn, mlp); two kernels summed are the same map and let
        # tensor parallelism split each input along its own axis.
        self.out_attn = _linear(d, d, ("heads", "embed"), cfg, rngs)
        self.out_mlp = _linear(m, d, ("mlp", "embed"), cfg, rngs, use_bias=False)
        self.attention = cfg.attention

    def __call__(self, x, vec, cos, sin, rules):
        """x [B, T+N, D], vec [B, D]."""
        shift, scale, gate = self.mod(vec)
        x_mod = modulate(x, shift, scale)
        attn = _attend(*self.attn(x_mod, rules), cos, sin, self.attention, rules)
        mlp = jax.nn.gelu(self.mlp_in(x_mod), approximate=True)
        return x + gate * (self.out_attn(attn) + self.out_mlp(mlp))


class Flux(nnx.Module):
    """The FLUX.1 transformer. See the module docstring for the call signature."""

    def __init__(self, cfg: FluxConfig, *, rngs: nnx.Rngs,
                 rules: tuple = sharding_lib.DEFAULT_RULES):
        self.cfg = cfg
        self.rules = sharding_lib.rules_from_config(rules)
        d = cfg.hidden_size
        self.img_in = _linear(cfg.in_channels, d, ("input", "embed"), cfg, rngs)
        self.time_in = MLPEmbedder(256, cfg, rngs)
        self.guidance_in = MLPEmbedder(256, cfg, rngs) if cfg.guidance_embeds else None
        self.vector_in = MLPEmbedder(cfg.pooled_projection_dim, cfg, rngs)
        self.txt_in = _linear(cfg.joint_attention_dim, d, ("input", "embed"), cfg, rngs)
        self.double_blocks = execution.stacked(lambda r: DoubleStreamBlock(cfg, r),
                                               cfg.num_layers, rngs)
        self.single_blocks = execution.stacked(lambda r: SingleStreamBlock(cfg, r),
                                               cfg.num_single_layers, rngs)
        self.final_mod = Modulation(2, cfg, rngs)
        self.proj_out = _linear(d, cfg.output_channels, ("embed", None), cfg, rngs)

    def __call__(self, img: jax.Array, img_ids: jax.Array, txt: jax.Array, txt_ids: jax.Array,
                 timesteps: jax.Array, y: jax.Array, guidance: jax.Array | None = None) -> jax.Array:
        """Predicts the flow velocity [B, N, C_out] (see the module docstring)."""
        cfg, rules = self.cfg, self.rules
        dtype = execution.to_dtype(cfg.dtype)
        batch = img.shape[0]
        if guidance is None and cfg.guidance_embeds:
            raise ValueError("This FLUX model has guidance embeddings (guidance_embeds=True): pass "
                             "guidance [B] (FLUX.1-dev uses 3.5).")
        if guidance is not None and not cfg.guidance_embeds:
            raise ValueError("guidance was given but the model has no guidance embeddings "
                             "(guidance_embeds=False): pass guidance=None.")

        vec = self.time_in(timestep_embedding(jnp.broadcast_to(timesteps, (batch,))).astype(dtype))
        if self.guidance_in is not None:
            g_emb = timestep_embedding(jnp.broadcast_to(guidance, (batch,))).astype(dtype)
            vec = vec + self.guidance_in(g_emb)
        vec = vec + self.vector_in(y.astype(dtype))

        def batched_ids(ids):
            return jnp.broadcast_to(ids, (batch, *ids.shape[-2:])) if ids.ndim == 2 else ids

        ids = jnp.concatenate([batched_ids(txt_ids), batched_ids(img_ids)], axis=1)
        cos, sin = rope_angles(ids, cfg.axes_dims_rope, cfg.rope_theta)

        constrain = lambda t: sharding_lib.with_logical_constraint(
            t, ("batch", "length", "act_embed"), rules)
        img = constrain(self.img_in(img.astype(dtype)))
        txt = constrain(self.txt_in(txt.astype(dtype)))
        img, txt = execution.run_stacked(self.double_blocks, (img, txt), (vec, cos, sin, rules),
                                         cfg.num_layers, cfg.scan_layers, cfg.remat_policy)
        x = jnp.concatenate([txt, img], axis=1)
        (x,) = execution.run_stacked(self.single_blocks, (x,), (vec, cos, sin, rules),
                                     cfg.num_single_layers, cfg.scan_layers, cfg.remat_policy)
        img = x[:, txt.shape[1]:]
        shift, scale = self.final_mod(vec)
        return self.proj_out(modulate(img, shift, scale))


# ---------------------------------------------------------------------------------------------
# Construction, parameter counts, sharded initialisation.


def abstract_model(cfg: FluxConfig, rules=sharding_lib.DEFAULT_RULES) -> Flux:
    """The model with ShapeDtypeStruct parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: Flux(cfg, rngs=nnx.Rngs(0), rules=rules))


def count_params(cfg: FluxConfig) -> int:
    """Number of parameters, computed from shapes only (`jax.eval_shape`)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def validate_mesh(cfg: FluxConfig, mesh: jax.sharding.Mesh) -> None:
    """Checks that the model can be split over the mesh's tensor axis."""
    tensor = mesh.shape.get("tensor", 1)
    if cfg.num_attention_heads % tensor:
        raise ValueError(
            f"num_attention_heads={cfg.num_attention_heads} is not divisible by the mesh's "
            f"tensor axis ({tensor}): tensor parallelism splits whole heads. Use a tensor size "
            f"that divides {cfg.num_attention_heads}.")
    if cfg.mlp_hidden_dim % tensor:
        raise ValueError(f"The MLP width {cfg.mlp_hidden_dim} is not divisible by the mesh's tensor "
                         f"axis ({tensor}).")


def init_sharded(cfg: FluxConfig, mesh: jax.sharding.Mesh, seed: int = 0,
                 rules=sharding_lib.DEFAULT_RULES) -> Flux:
    """Randomly initialised model whose parameters are created directly in their shardings."""
    validate_mesh(cfg, mesh)
    graphdef, abstract_state = nnx.split(abstract_model(cfg, rules))
    shardings = sharding_lib.state_shardings(abstract_state, mesh, sharding_lib.rules_from_config(rules))

    def init():
        return nnx.state(Flux(cfg, rngs=nnx.Rngs(seed), rules=rules))

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)
