"""The one attention function every model calls, so the kernel choice lives in one place.

Kernels (a model config's `attention` field):
  "auto"    the fused kernel of the platform the program is compiled for (`resolve`): "splash"
            on TPU, "cudnn" on NVIDIA GPUs for bfloat16 / float16 activations, "xla" otherwise
            and for masked attention.
  "xla"     `jax.nn.dot_product_attention`'s XLA path; runs everywhere. It materialises the
            [B, H, S, S_kv] logits (float32) and probabilities: for FLUX.1-dev at 720×720
            (2,537 tokens, 24 heads) 0.77 GiB per sample in the rollout's model call.
  "cudnn"   cuDNN's flash attention through `jax.nn.dot_product_attention` (NVIDIA GPUs,
            bfloat16 / float16).
  "splash"  Pallas' TPU splash (flash) attention kernel
            (`jax.experimental.pallas.ops.tpu.splash_attention`): the softmax runs block by
            block in VMEM, so no [S, S_kv] array reaches HBM, forward or backward. Unmasked
            attention only (FLUX); `pallas_interpret()` runs it on CPU for tests.

The platform is the one of the mesh set by `jax.set_mesh` (so an ahead-of-time compile for TPU
devices from a CPU host resolves to TPU), else `jax.default_backend()`.
"""

import contextlib
import math
import threading

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "splash")
_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# Splash's tiles: sequences are padded to a multiple of 128 (a TPU lane row) and tiled by the
# largest of these that divides the padded length (2,537 FLUX tokens → 2,560 = 5 × 512).
_BLOCKS = (512, 256, 128)
_LANES = 128

_interpret = threading.local()


@contextlib.contextmanager
def pallas_interpret():
    """Runs "splash" in Pallas' interpret mode (any backend, slowly) while tracing inside this
    block: how tests check the TPU kernel on a CPU."""
    previous = getattr(_interpret, "on", False)
    _interpret.on = True
    try:
        yield
    finally:
        _interpret.on = previous


def _interpreting() -> bool:
    return getattr(_interpret, "on", False)


def current_platform() -> str:
    """"tpu", "gpu" or "cpu": the platform of the mesh set by `jax.set_mesh` (also inside jit,
    through the abstract mesh), else of `jax.default_backend()`."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh.empty else getattr(mesh, "abstract_device", None)
    platform = getattr(device, "platform", None) or jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def resolve(implementation: str, dtype, platform: str | None = None,
            masked: bool = False) -> str:
    """The kernel that runs: `implementation` itself, or for "auto" "splash" on TPU, "cudnn" on
    GPU when `dtype` is bfloat16 / float16, and "xla" otherwise (CPU, float32 on GPU, masked
    attention, which splash here does not take).

    Raises:
      ValueError: an unknown name, or a kernel that cannot run on `platform` with `dtype` (the
        message names the setting to use instead).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"Unknown attention {implementation!r}; set the model's `attention` to "
                         f"one of {IMPLEMENTATIONS} ('auto' picks the platform's fused kernel).")
    platform = platform or current_platform()
    dtype = jnp.dtype(dtype)
    if implementation == "auto":
        if masked:
            return "xla"
        if platform == "tpu":
            return "splash"
        if platform == "gpu" and dtype in _HALF:
            return "cudnn"
        return "xla"
    if implementation == "cudnn":
        if platform != "gpu":
            raise ValueError(f"attention='cudnn' is an NVIDIA GPU kernel; this program is "
                             f"compiled for {platform!r}. Use attention='auto' or 'xla'.")
        if dtype not in _HALF:
            raise ValueError("attention='cudnn' needs bfloat16 or float16 activations; set the "
                             f"model dtype to bfloat16 or use attention='xla' (got {dtype}).")
    if implementation == "splash":
        if masked:
            raise ValueError("attention='splash' takes unmasked attention only; use 'xla' or "
                             "'auto' for a masked model.")
        if platform != "tpu" and not _interpreting():
            raise ValueError(f"attention='splash' is a TPU kernel; this program is compiled for "
                             f"{platform!r}. Use attention='auto' or 'xla' (tests run it on CPU "
                             "inside models.attention.pallas_interpret()).")
    return implementation


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          implementation: str = "auto", mask: jax.Array | None = None,
                          spec: PartitionSpec | None = None) -> jax.Array:
    """Softmax attention, non-causal, scale 1/sqrt(head_dim).

    Args:
      query: [B, S, H, D].
      key: [B, S_kv, H, D].
      value: [B, S_kv, H, D].
      implementation: one of IMPLEMENTATIONS (module docstring), resolved by `resolve`.
      mask: optional boolean [B, H or 1, S, S_kv], True = attend.
      spec: how [B, S, H, D] activations are laid out on the current mesh (batch and heads
        may be split; the sequence must not be). "splash" runs per shard under `jax.shard_map`
        with it: XLA cannot partition a Pallas kernel itself. None = replicated.

    Returns:
      [B, S, H, D] in the query's dtype.
    """
    kernel = resolve(implementation, query.dtype, masked=mask is not None)
    if kernel == "splash":
        return _splash(query, key, value, spec)
    return jax.nn.dot_product_attention(query, key, value, mask=mask, implementation=kernel)


# ---------------------------------------------------------------------------------------------
# Splash attention.


def _block(length: int) -> int:
    return next(b for b in _BLOCKS if length % b == 0)


def _splash_kernel(heads: int, q_len: int, kv_len: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    bq, bkv = _block(q_len), _block(kv_len)
    blocks = splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                               block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                               block_q_dq=bq, block_kv_dq=bkv)
    mask = splash.MultiHeadMask([splash.FullMask((q_len, kv_len))] * heads)
    # Built inside the trace (not cached): its block tables become constants of the program
    # being traced, wherever it will run.
    return splash.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)


def _splash_local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Splash on one shard: [B, S, H, D] in and out; pads both sequences to the kernel's tile
    and gives padded keys zero weight with segment ids (padded queries are dropped)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import SegmentIds

    b, s, h, d = q.shape
    s_kv = k.shape[1]
    q_len, kv_len = -(-s // _LANES) * _LANES, -(-s_kv // _LANES) * _LANES
    # Splash does not scale the logits; XLA's path scales by 1/sqrt(D).
    q = q * jnp.asarray(1.0 / math.sqrt(d), q.dtype)

    def heads_major(x, length):
        x = jnp.swapaxes(x, 1, 2)                                     # [B, H, S, D]
        return jnp.pad(x, ((0, 0), (0, 0), (0, length - x.shape[2]), (0, 0)))

    q, k, v = heads_major(q, q_len), heads_major(k, kv_len), heads_major(v, kv_len)
    # Keys of segment 1 (padding) are seen by no query (all of segment 0): every softmax row
    # keeps its s_kv real keys, and padded queries' rows are sliced off below.
    segments = SegmentIds(q=jnp.zeros((q_len,), jnp.int32),
                          kv=(jnp.arange(kv_len) >= s_kv).astype(jnp.int32))
    kernel = _splash_kernel(h, q_len, kv_len, _interpreting())
    out = jax.vmap(kernel, in_axes=(0, 0, 0, None))(q, k, v, segments)
    return jnp.swapaxes(out[:, :, :s], 1, 2)


def _splash(q: jax.Array, k: jax.Array, v: jax.Array, spec: PartitionSpec | None) -> jax.Array:
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return _splash_local(q, k, v)
    spec = PartitionSpec() if spec is None else spec
    if len(spec) > 1 and spec[1] is not None:
        raise ValueError(f"attention='splash' needs the whole sequence on each chip; the "
                         f"activations' spec {spec} splits it. Map the logical axis 'length' "
                         "to no mesh axis.")
    local = jax.shard_map(_splash_local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                          check_vma=False)
    return local(q, k, v)

