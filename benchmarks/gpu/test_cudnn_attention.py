"""The cuDNN attention kernel against XLA's on FLUX's joint text + image attention with RoPE,
in bfloat16, forward and gradients. Needs an NVIDIA GPU: `benchmarks/device_check.sh` runs it
(JAX_PLATFORMS=cuda,cpu). It lives outside tests/ (CI has no GPU); without one it fails to
collect with an error that says so.

Tolerances (bfloat16 inputs, outputs of size ~1): forward 2e-2 absolute, a few bf16 ulps (the
kernel's fused softmax rounds in another order); gradients 5e-2, the backward rounds twice.
"""

import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.models import flux

GPUS = [d for d in jax.devices() if d.platform == "gpu"]
if not GPUS:
    raise RuntimeError(f"These checks need an NVIDIA GPU; JAX sees {jax.devices()}. Run them "
                       "with benchmarks/device_check.sh on a machine with one.")

HEADS, HEAD_DIM, TEXT, SIDE = 8, 64, 32, 16     # 32 text + 256 image tokens, FLUX's head width
ROPE = (8, 28, 28)


def _joint_qkv(seed: int, batch: int):
    keys = jax.random.split(jax.random.key(seed), 3)
    s = TEXT + SIDE * SIDE
    q, k, v = (jax.random.normal(key, (batch, s, HEADS, HEAD_DIM)).astype(jnp.bfloat16)
               for key in keys)
    rows, cols = np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij")
    img_ids = np.stack([np.zeros(SIDE * SIDE), rows.ravel(), cols.ravel()], -1)
    ids = np.concatenate([np.zeros((TEXT, 3)), img_ids])[None].repeat(batch, 0)
    cos, sin = flux.rope_angles(jnp.asarray(ids), ROPE, 10000.0)
    return jax.device_put((q, k, v, cos, sin), GPUS[0])


def _attend(implementation, q, k, v, cos, sin):
    return flux._attend(q, k, v, cos, sin, implementation, parallel.DEFAULT_RULES)


def test_cudnn_matches_xla_forward_bf16():
    q, k, v, cos, sin = _joint_qkv(0, 2)
    expected = jax.jit(lambda *a: _attend("xla", *a))(q, k, v, cos, sin)
    got = jax.jit(lambda *a: _attend("cudnn", *a))(q, k, v, cos, sin)
    assert got.shape == expected.shape and got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               atol=2e-2, rtol=0)


def test_cudnn_gradients_match_xla_bf16():
    q, k, v, cos, sin = _joint_qkv(1, 2)

    def grads(implementation):
        loss = lambda q, k, v: jnp.sum(jnp.sin(_attend(implementation, q, k, v, cos, sin)
                                               .astype(jnp.float32)))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for got, want in zip(grads("cudnn"), grads("xla"), strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   atol=5e-2, rtol=0)
