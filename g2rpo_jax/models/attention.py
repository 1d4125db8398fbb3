"""The one attention function every model calls, so the kernel can change in one place."""

import jax
import jax.numpy as jnp

IMPLEMENTATIONS = ("xla", "cudnn")


def dot_product_attention(query: jax.Array, key: jax.Array, value: jax.Array,
                          implementation: str = "xla", mask: jax.Array | None = None) -> jax.Array:
    """Softmax attention, non-causal, scale 1/sqrt(head_dim).

    Args:
      query: [B, S, H, D].
      key: [B, S_kv, H, D].
      value: [B, S_kv, H, D].
      implementation: "xla" (portable, runs everywhere; XLA fuses it on TPU) or "cudnn" (the
        fused flash kernel on NVIDIA GPUs, bf16/fp16 only).
      mask: optional boolean [B, H or 1, S, S_kv], True = attend.

    Returns:
      [B, S, H, D] in the query's dtype.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"Unknown attention implementation {implementation!r}; choose one of "
                         f"{IMPLEMENTATIONS}.")
    if implementation == "cudnn" and query.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError("cudnn attention needs bfloat16 or float16 activations; set the model "
                         f"dtype to bfloat16 or use implementation='xla' (got {query.dtype}).")
    return jax.nn.dot_product_attention(query, key, value, mask=mask,
                                        implementation=implementation)
