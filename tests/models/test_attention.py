"""models.attention: the kernel choice ("auto" per platform, clear errors) and the TPU splash
kernel (run in Pallas' interpret mode on CPU) against XLA's attention on FLUX's joint text +
image attention with RoPE, at sequence lengths that are not a multiple of its 128-token tile.

Tolerances: float32 inputs agree to 2e-5 (abs.; |out| ≤ ~3): the kernel's online softmax sums
blocks in another order. bfloat16 inputs to 2e-2 (a few bf16 ulps of outputs of size ~1; the
kernel scales q in bf16 before the logits, XLA scales the fp32 logits).
"""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax import parallel
from g2rpo_jax.models import attention, flux

TINY = flux.FluxConfig(num_layers=1, num_single_layers=1, attention_head_dim=16,
                       num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=16,
                       in_channels=16, axes_dims_rope=(4, 6, 6), attention="xla")
TEXT, SIDE = 7, 5                 # 7 text + 25 image tokens = 32: tiles pad it to 128


# ---------------------------------------------------------------------------------------------
# The choice.


@pytest.mark.parametrize("platform, dtype, masked, expected", [
    ("cpu", jnp.float32, False, "xla"),
    ("cpu", jnp.bfloat16, False, "xla"),
    ("tpu", jnp.bfloat16, False, "splash"),
    ("tpu", jnp.float32, False, "splash"),
    ("tpu", jnp.bfloat16, True, "xla"),
    ("gpu", jnp.bfloat16, False, "cudnn"),
    ("gpu", jnp.float16, False, "cudnn"),
    ("gpu", jnp.float32, False, "xla"),
])
def test_auto_per_platform(platform, dtype, masked, expected):
    assert attention.resolve("auto", dtype, platform, masked) == expected


def test_auto_resolves_from_the_mesh_and_backend():
    assert attention.current_platform() == "cpu"
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    with jax.set_mesh(mesh):
        seen = []
        jax.jit(lambda x: seen.append(attention.current_platform()) or x)(jnp.ones(2))
    assert seen == ["cpu"]
    assert attention.resolve("auto", jnp.bfloat16) == "xla"


@pytest.mark.parametrize("name, platform, dtype, match", [
    ("flash", "cpu", jnp.float32, "Unknown attention 'flash'.*one of"),
    ("cudnn", "cpu", jnp.bfloat16, "NVIDIA GPU kernel.*attention='auto' or 'xla'"),
    ("cudnn", "tpu", jnp.bfloat16, "NVIDIA GPU kernel"),
    ("cudnn", "gpu", jnp.float32, "bfloat16 or float16.*attention='xla'"),
    ("splash", "cpu", jnp.float32, "TPU kernel.*attention='auto' or 'xla'"),
    ("splash", "gpu", jnp.bfloat16, "TPU kernel"),
])
def test_errors_name_the_fix(name, platform, dtype, match):
    with pytest.raises(ValueError, match=match):
        attention.resolve(name, dtype, platform)


def test_splash_refuses_a_mask():
    with pytest.raises(ValueError, match="unmasked attention only"):
        attention.resolve("splash", jnp.float32, "tpu", masked=True)


def test_config_refuses_an_unknown_name():
    with pytest.raises(ValueError, match="Unknown attention 'flash'"):
        dataclasses.replace(TINY, attention="flash")
    assert flux.FluxConfig().attention == "auto"


def test_cudnn_on_cpu_fails_at_trace_time():
    q = jnp.zeros((1, 4, 2, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="NVIDIA GPU kernel"):
        attention.dot_product_attention(q, q, q, "cudnn")


# ---------------------------------------------------------------------------------------------
# Splash (interpret mode) against XLA.


def _joint_qkv(seed: int, batch: int, dtype):
    """q, k, v [B, T+N, H, D] and FLUX's RoPE angles for 7 text + 5×5 image positions."""
    keys = jax.random.split(jax.random.key(seed), 3)
    s = TEXT + SIDE * SIDE
    h, d = TINY.num_attention_heads, TINY.attention_head_dim
    q, k, v = (jax.random.normal(key, (batch, s, h, d), jnp.float32).astype(dtype)
               for key in keys)
    rows, cols = np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij")
    img_ids = np.stack([np.zeros(SIDE * SIDE), rows.ravel(), cols.ravel()], -1)
    ids = np.concatenate([np.zeros((TEXT, 3)), img_ids])[None].repeat(batch, 0)
    cos, sin = flux.rope_angles(jnp.asarray(ids), TINY.axes_dims_rope, TINY.rope_theta)
    return q, k, v, cos, sin


def _attend(implementation, q, k, v, cos, sin):
    return flux._attend(q, k, v, cos, sin, implementation, parallel.DEFAULT_RULES)


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
def test_splash_matches_xla_on_joint_attention_with_rope(dtype, tol):
    q, k, v, cos, sin = _joint_qkv(0, 2, dtype)
    expected = _attend("xla", q, k, v, cos, sin)
    with attention.pallas_interpret():
        got = jax.jit(lambda *a: _attend("splash", *a))(q, k, v, cos, sin)
    assert got.shape == expected.shape == (2, TEXT + SIDE * SIDE, TINY.hidden_size)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               atol=tol, rtol=0)


def test_splash_gives_padded_keys_no_weight():
    """130 keys pad to 256: with all real logits equal the output is the mean of the real
    values exactly; any weight on the 126 zero-padded keys would shrink it."""
    v = jax.random.normal(jax.random.key(1), (1, 130, 1, 16))
    q = jnp.zeros((1, 3, 1, 16))
    with attention.pallas_interpret():
        out = attention.dot_product_attention(q, jnp.zeros_like(v), v, "splash")
    np.testing.assert_allclose(np.asarray(out[0, :, 0]),
                               np.broadcast_to(np.asarray(v[0, :, 0].mean(0)), (3, 16)),
                               atol=1e-6)


def test_splash_gradients_match_xla():
    q, k, v, cos, sin = _joint_qkv(2, 1, jnp.float32)

    def loss(implementation):
        return lambda q, k, v: jnp.sum(jnp.sin(_attend(implementation, q, k, v, cos, sin)))

    expected = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, k, v)
    with attention.pallas_interpret():
        got = jax.jit(jax.grad(loss("splash"), argnums=(0, 1, 2)))(q, k, v)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), atol=5e-5, rtol=0)


def _inputs(batch: int):
    keys = jax.random.split(jax.random.key(3), 4)
    n = SIDE * SIDE
    rows, cols = np.meshgrid(np.arange(SIDE), np.arange(SIDE), indexing="ij")
    return dict(
        img=jax.random.normal(keys[0], (batch, n, TINY.in_channels)),
        img_ids=jnp.asarray(np.stack([np.zeros(n), rows.ravel(), cols.ravel()], -1),
                            jnp.float32),
        txt=jax.random.normal(keys[1], (batch, TEXT, TINY.joint_attention_dim)),
        txt_ids=jnp.zeros((TEXT, 3)),
        timesteps=jax.random.uniform(keys[2], (batch,)),
        y=jax.random.normal(keys[3], (batch, TINY.pooled_projection_dim)),
        guidance=jnp.full((batch,), 3.5))


def test_flux_forward_splash_matches_xla_sharded():
    """The whole tiny transformer, batch over (data, fsdp) and heads over tensor on 8 CPU
    devices: splash runs per shard under jax.shard_map."""
    model = flux.Flux(TINY, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    inputs = _inputs(4)
    expected = model(**inputs)
    splash_graphdef, _ = nnx.split(flux.Flux(dataclasses.replace(TINY, attention="splash"),
                                             rngs=nnx.Rngs(0)))
    mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})

    def forward(state, inputs):
        return nnx.merge(splash_graphdef, state)(**inputs)

    with jax.set_mesh(mesh), attention.pallas_interpret():
        got = jax.jit(forward)(state, inputs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-5, rtol=0)
    del graphdef
