"""T5 v1.1 encoder (FLUX.1's `text_encoder_2`, google/t5-v1_1-xxl), in Flax NNX.

A port of transformers' `T5EncoderModel`: token embeddings (not scaled), `num_layers` pre-norm
blocks of self-attention and a feed-forward net, and a final norm. T5 specifics kept exactly:
  * the norm is RMS-style (no mean subtraction, no bias), computed in float32;
  * attention does not scale q·k by 1/sqrt(d_kv); a learned relative position bias is added to
    the scores instead. Only the first layer owns the bias table; its bias is shared by all layers;
  * bidirectional, log-spaced relative position buckets;
  * v1.1's feed-forward is gated: wo(gelu_new(wi_0 x) * wi_1 x), gelu_new = tanh-GELU
    (`feed_forward_proj="gated-gelu"`); the original T5's "relu" is wo(relu(wi x)).
The layers are stacked on a leading "layers" axis and run with `jax.lax.scan`.

Call signature:
  model(input_ids [B, T] int, attention_mask [B, T] (1 = token, 0 = padding) | None)
    -> last_hidden_state [B, T, d_model]

FLUX.1-dev's pipeline (diffusers `FluxPipeline`) calls the encoder WITHOUT an attention mask on
prompts padded to 512 tokens, so pad tokens are attended to; pass attention_mask=None to match
its prompt embeddings.

Weights load with `models.t5_weights`; the tokenizer (FLUX.1-dev's `tokenizer_2/`) is here.
"""

from collections.abc import Mapping, Sequence
import dataclasses
import functools
import math
import os
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.models import execution
from g2rpo_jax.parallel import sharding as sharding_lib

# transformers' ACT2FN names that T5 configs use; "gelu_new" is the tanh approximation.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_new": functools.partial(jax.nn.gelu, approximate=True),
    "silu": jax.nn.silu,
}



def parse_feed_forward_proj(feed_forward_proj: str) -> tuple[bool, str]:
    """"gated-gelu" → (gated=True, "gelu_new"); "relu" → (False, "relu"), as transformers reads it."""
    parts = feed_forward_proj.split("-")
    gated = parts[0] == "gated" and len(parts) == 2
    if len(parts) > 2 or (len(parts) == 2 and not gated):
        raise ValueError(f"feed_forward_proj {feed_forward_proj!r} is not of the form "
                         "'<activation>' or 'gated-<activation>' (T5 v1.1: 'gated-gelu').")
    # transformers maps "gated-gelu" (T5 v1.1, mT5) to the tanh approximation for legacy reasons.
    activation = "gelu_new" if feed_forward_proj == "gated-gelu" else parts[-1]
    if activation not in ACTIVATIONS:
        raise ValueError(f"Unsupported activation {activation!r} in feed_forward_proj "
                         f"{feed_forward_proj!r}; supported: {sorted(ACTIVATIONS)}.")
    return gated, activation


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Architecture and execution settings. Architecture names follow transformers' T5Config;
    the defaults are the T5-v1.1-XXL encoder (FLUX.1's text_encoder_2)."""

    vocab_size: int = 32128
    d_model: int = 4096
    d_kv: int = 64
    d_ff: int = 10240
    num_layers: int = 24
    num_heads: int = 64
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "gated-gelu"
    # Execution (not architecture): activations' dtype, master weights' dtype, layer loop.
    dtype: str = "float32"
    param_dtype: str = "float32"
    scan_layers: bool = True
    remat_policy: str = "none"

    def __post_init__(self):
        parse_feed_forward_proj(self.feed_forward_proj)
        execution.check_remat_policy(self.remat_policy)
        execution.to_dtype(self.dtype), execution.to_dtype(self.param_dtype)

    @property
    def inner_dim(self) -> int:
        """Width of q, k, v (num_heads · d_kv; need not equal d_model)."""
        return self.num_heads * self.d_kv

    @property
    def is_gated(self) -> bool:
        return parse_feed_forward_proj(self.feed_forward_proj)[0]

    @property
    def activation(self) -> str:
        return parse_feed_forward_proj(self.feed_forward_proj)[1]

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "T5Config":
        """Builds a config from a mapping (an ml_collections section or a transformers
        config.json), ignoring keys that are not fields (e.g. `num_decoder_layers`)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in dict(values).items() if k in names})


# ---------------------------------------------------------------------------------------------
# Pure pieces.


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
    """T5LayerNorm: x / sqrt(mean(x²) + eps) · scale over the last dim, in float32, cast to dtype."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(dtype)


def relative_position_buckets(query_length: int, key_length: int, num_buckets: int = 32,
                              max_distance: int = 128) -> np.ndarray:
    """Bidirectional T5 buckets [Tq, Tk] (int32) of relative positions key − query.

    Half of the buckets are for keys after the query. Within a half, distances below
    num_buckets/4 have their own bucket; larger ones share log-spaced buckets up to max_distance,
    beyond which all fall in the last. Computed with numpy at trace time (lengths are static),
    in float32 with the reference's operation order, because the log-spaced boundaries fall on
    exact powers of two where a differently rounded log would move a distance by one bucket.
    """
    relative = np.arange(key_length)[None, :] - np.arange(query_length)[:, None]
    half = num_buckets // 2
    offset = (relative > 0).astype(np.int64) * half
    distance = np.abs(relative)
    max_exact = half // 2
    is_small = distance < max_exact
    # Small distances are replaced below; give them a harmless log argument (log(0) = -inf).
    ratio = np.maximum(distance, max_exact).astype(np.float32) / np.float32(max_exact)
    scaled = (np.log(ratio) / np.float32(math.log(max_distance / max_exact))
              * np.float32(half - max_exact))
    large = np.minimum(max_exact + scaled.astype(np.int64), half - 1)
    return (offset + np.where(is_small, distance, large)).astype(np.int32)


def position_bias(table: jax.Array, length: int, num_buckets: int, max_distance: int) -> jax.Array:
    """The relative position bias [H, T, T] (float32) from the bucket table [num_buckets, H]."""
    buckets = relative_position_buckets(length, length, num_buckets, max_distance)
    values = jnp.take(table.astype(jnp.float32), jnp.asarray(buckets), axis=0)  # [T, T, H]
    return jnp.transpose(values, (2, 0, 1))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array,
              mask: jax.Array) -> jax.Array:
    """T5 attention: softmax(q·kᵀ + bias) v, NOT scaled by 1/sqrt(d); masked keys get no weight.

    Args:
      q, k, v: [B, T, H, D].
      bias: [H, T, T] float32, added to every example's scores.
      mask: [B, T] bool, True = a real token (keys only: padded queries still get outputs,
        as in the reference).

    Returns:
      [B, T, H·D] in v's dtype. Scores and softmax are float32.
    """
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores + bias[None]
    # The reference adds finfo.min to masked scores; `where` gives the same weights (0) without
    # the risk of -inf - inf. A row with no real key at all becomes uniform in both.
    scores = jnp.where(mask[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return out.reshape(*out.shape[:2], -1)


# ---------------------------------------------------------------------------------------------
# Layers.


def _linear(in_features: int, out_features: int, axes: tuple[str | None, str | None],
            cfg: T5Config, rngs: nnx.Rngs) -> nnx.Linear:
    """A bias-free Linear (T5 has no biases anywhere) with logical axis names on its kernel."""
    return nnx.Linear(in_features, out_features, use_bias=False, dtype=execution.to_dtype(cfg.dtype),
                      param_dtype=execution.to_dtype(cfg.param_dtype), rngs=rngs,
                      kernel_metadata={"logical_axes": axes})


class RMSNorm(nnx.Module):
    """T5LayerNorm with a learned scale [D] (initialised to 1)."""

    def __init__(self, cfg: T5Config):
        self.scale = nnx.Param(jnp.ones((cfg.d_model,), execution.to_dtype(cfg.param_dtype)),
                               logical_axes=("embed",))
        self.eps = cfg.layer_norm_epsilon
        self.dtype = execution.to_dtype(cfg.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.scale[...], self.eps, self.dtype)


class SelfAttention(nnx.Module):
    """q, k, v, o projections around `attention` (the position bias comes from outside)."""

    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.q = _linear(cfg.d_model, cfg.inner_dim, ("embed", "heads"), cfg, rngs)
        self.k = _linear(cfg.d_model, cfg.inner_dim, ("embed", "heads"), cfg, rngs)
        self.v = _linear(cfg.d_model, cfg.inner_dim, ("embed", "heads"), cfg, rngs)
        self.o = _linear(cfg.inner_dim, cfg.d_model, ("heads", "embed"), cfg, rngs)
        self.num_heads = cfg.num_heads

    def __call__(self, x: jax.Array, bias: jax.Array, mask: jax.Array, rules) -> jax.Array:
        """x [B, T, D], bias [H, T, T], mask [B, T] → [B, T, D]."""
        b, t, _ = x.shape

        def heads(y):
            y = y.reshape(b, t, self.num_heads, -1)
            return sharding_lib.with_logical_constraint(y, ("batch", "length", "act_heads", None),
                                                        rules)

        return self.o(attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), bias, mask))


class FeedForward(nnx.Module):
    """Gated: wo(act(wi_0 x) · wi_1 x) (T5 v1.1); plain: wo(act(wi x)) (original T5)."""

    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.gated = cfg.is_gated
        self.activation = cfg.activation
        if self.gated:
            self.wi_0 = _linear(cfg.d_model, cfg.d_ff, ("embed", "mlp"), cfg, rngs)
            self.wi_1 = _linear(cfg.d_model, cfg.d_ff, ("embed", "mlp"), cfg, rngs)
        else:
            self.wi = _linear(cfg.d_model, cfg.d_ff, ("embed", "mlp"), cfg, rngs)
        self.wo = _linear(cfg.d_ff, cfg.d_model, ("mlp", "embed"), cfg, rngs)

    def __call__(self, x: jax.Array, rules) -> jax.Array:
        """x [B, T, D] → [B, T, D]."""
        act = ACTIVATIONS[self.activation]
        hidden = act(self.wi_0(x)) * self.wi_1(x) if self.gated else act(self.wi(x))
        hidden = sharding_lib.with_logical_constraint(hidden, ("batch", "length", "act_mlp"), rules)
        return self.wo(hidden)


class T5Block(nnx.Module):
    """Pre-norm residual self-attention, then pre-norm residual feed-forward."""

    def __init__(self, cfg: T5Config, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = SelfAttention(cfg, rngs)
        self.ff_norm = RMSNorm(cfg)
        self.ff = FeedForward(cfg, rngs)

    def __call__(self, x: jax.Array, bias: jax.Array, mask: jax.Array, rules) -> jax.Array:
        """x [B, T, D] float32 (the residual stream) → [B, T, D] float32."""
        x = x + self.attn(self.attn_norm(x), bias, mask, rules).astype(jnp.float32)
        x = x + self.ff(self.ff_norm(x), rules).astype(jnp.float32)
        return sharding_lib.with_logical_constraint(x, ("batch", "length", "act_embed"), rules)


class T5Encoder(nnx.Module):
    """The T5 encoder stack. See the module docstring for the call signature."""

    def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs,
                 rules: tuple = sharding_lib.DEFAULT_RULES):
        self.cfg = cfg
        self.rules = sharding_lib.rules_from_config(rules)
        param_dtype = execution.to_dtype(cfg.param_dtype)
        # The vocabulary dim stays whole (there is no "vocab" rule); the model dim is FSDP-split.
        self.embedding = nnx.Param(
            nnx.initializers.normal(1.0)(rngs.params(), (cfg.vocab_size, cfg.d_model), param_dtype),
            logical_axes=(None, "embed"))
        # Layer 0's table in transformers; its bias is shared by every layer, so it lives here.
        self.relative_attention_bias = nnx.Param(
            nnx.initializers.normal(1.0)(rngs.params(),
                                         (cfg.relative_attention_num_buckets, cfg.num_heads),
                                         param_dtype),
            logical_axes=(None, "heads"))
        self.layers = execution.stacked(lambda r: T5Block(cfg, r), cfg.num_layers, rngs)
        self.final_norm = RMSNorm(cfg)

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        """input_ids [B, T] int, attention_mask [B, T] (nonzero = token) | None → [B, T, D]."""
        cfg, rules = self.cfg, self.rules
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {input_ids.shape}.")
        mask = (jnp.ones(input_ids.shape, bool) if attention_mask is None
                else jnp.asarray(attention_mask).astype(bool))
        if mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {mask.shape}, input_ids {input_ids.shape}: "
                             "they must match.")
        # The residual stream stays float32 whatever the compute dtype: T5-XXL's activations
        # grow large over 24 layers, and only the matmul inputs need to be narrow.
        # Gather the (FSDP-split) table whole before the lookup, as FSDP does for every weight:
        # a lookup into the split table yields rows split over the model dim, which XLA can only
        # turn into batch-split rows by replicating them (an "involuntary full rematerialization").
        table = sharding_lib.with_logical_constraint(self.embedding[...], (None, None), rules)
        x = jnp.take(table, input_ids, axis=0).astype(jnp.float32)
        x = sharding_lib.with_logical_constraint(x, ("batch", "length", "act_embed"), rules)
        bias = position_bias(self.relative_attention_bias[...], input_ids.shape[1],
                             cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance)
        (x,) = execution.run_stacked(self.layers, (x,), (bias, mask, rules), cfg.num_layers,
                                     cfg.scan_layers, cfg.remat_policy)
        return self.final_norm(x)


# ---------------------------------------------------------------------------------------------
# Construction and parameter counts.


def abstract_model(cfg: T5Config, rules=sharding_lib.DEFAULT_RULES) -> T5Encoder:
    """The model with ShapeDtypeStruct parameters (no memory, no compute)."""
    return nnx.eval_shape(lambda: T5Encoder(cfg, rngs=nnx.Rngs(0), rules=rules))


def count_params(cfg: T5Config) -> int:
    """Number of parameters, computed from shapes only (`jax.eval_shape`)."""
    state = nnx.state(abstract_model(cfg), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def validate_mesh(cfg: T5Config, mesh: jax.sharding.Mesh) -> None:
    """Checks that heads and feed-forward units split evenly over the mesh's tensor axis."""
    tensor = mesh.shape.get("tensor", 1)
    if cfg.num_heads % tensor:
        raise ValueError(f"num_heads={cfg.num_heads} is not divisible by the mesh's tensor axis "
                         f"({tensor}): tensor parallelism splits whole heads. Use a tensor size "
                         f"that divides {cfg.num_heads}.")
    if cfg.d_ff % tensor:
        raise ValueError(f"d_ff={cfg.d_ff} is not divisible by the mesh's tensor axis ({tensor}).")


# ---------------------------------------------------------------------------------------------
# Folders and the tokenizer (FLUX.1-dev's `text_encoder_2/`, `tokenizer_2/`).


def resolve_folder(path: str, subfolder: str, what: str, wanted: str) -> str:
    """path itself, or path/subfolder when path is a whole FLUX repo; a clear error otherwise.
    (The tokenizer's folder here, the encoder's in `t5_weights`.)"""
    if os.path.isdir(os.path.join(path, subfolder)):
        return os.path.join(path, subfolder)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No {what} at {path}: give a folder with {wanted} (FLUX.1-dev's "
                                f"{subfolder}/) or the model folder that contains {subfolder}/.")
    return path


def load_tokenizer(path: str | os.PathLike):
    """transformers' T5TokenizerFast from a local folder (`tokenizer_2/` or its parent folder)."""
    path = resolve_folder(os.fspath(path), "tokenizer_2", "T5 tokenizer",
                           "tokenizer.json / spiece.model")
    # Imported here: only tokenization needs transformers, the model does not.
    from transformers import T5TokenizerFast

    return T5TokenizerFast.from_pretrained(path, local_files_only=True)


def tokenize(tokenizer, prompts: Sequence[str], max_length: int = 512
             ) -> tuple[np.ndarray, np.ndarray]:
    """Prompts → (input_ids [P, max_length] int32, attention_mask [P, max_length] int32).

    Each prompt ends with </s>, is truncated to max_length tokens and padded with <pad> (id 0)
    to exactly max_length, as FLUX.1-dev's pipeline tokenizes (max_length 512 for dev).
    """
    if isinstance(prompts, str):
        raise TypeError("tokenize takes a sequence of prompts; wrap a single prompt in a list.")
    encoded = tokenizer(list(prompts), padding="max_length", max_length=max_length,
                        truncation=True, return_tensors="np")
    return (np.asarray(encoded["input_ids"], np.int32),
            np.asarray(encoded["attention_mask"], np.int32))
