"""The optimizer built from a config's `optimizer` section (config_lib.optimizer_config)."""

import numpy as np
import pytest

from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib


@pytest.mark.parametrize("schedule, steps, expected", [
    ("constant", (0, 5, 50), (1e-3, 1e-3, 1e-3)),
    ("warmup_constant", (0, 5, 50), (0.0, 5e-4, 1e-3)),
    ("warmup_cosine", (0, 10, 110), (0.0, 1e-3, 0.0)),
])
def test_learning_rate_schedules(schedule, steps, expected):
    config = config_lib.optimizer_config(learning_rate=1e-3, schedule=schedule,
                                         warmup_steps=10, decay_steps=110)
    lr = optimizer_lib.learning_rate_schedule(config)
    np.testing.assert_allclose([float(lr(s)) for s in steps], expected, atol=1e-9)


def test_optimizer_errors():
    with pytest.raises(ValueError, match="Unknown learning-rate schedule"):
        optimizer_lib.make_optimizer(config_lib.optimizer_config(schedule="magic"))
    with pytest.raises(ValueError, match="must exceed optimizer.warmup_steps"):
        optimizer_lib.make_optimizer(config_lib.optimizer_config(
            schedule="warmup_cosine", warmup_steps=10, decay_steps=10))
    with pytest.raises(ValueError, match="Unknown optimizer fields"):
        config_lib.optimizer_config(lr=1e-3)


def _numpy_adamw(params, grads, lr, b1, b2, eps, wd, round_moments):
    """AdamW by its published formulas (Loshchilov & Hutter), float64; with `round_moments`
    the moments are stored in bfloat16 between steps (each step's update uses the moments
    before they are rounded for storage)."""
    import ml_dtypes

    mu, nu = np.zeros_like(params), np.zeros_like(params)
    for t, g in enumerate(grads, start=1):
        mu = b1 * mu + (1 - b1) * g
        nu = b2 * nu + (1 - b2) * g * g
        m_hat, v_hat = mu / (1 - b1 ** t), nu / (1 - b2 ** t)
        params = params - lr * (m_hat / (np.sqrt(v_hat) + eps) + wd * params)
        if round_moments:
            mu = mu.astype(ml_dtypes.bfloat16).astype(np.float64)
            nu = nu.astype(ml_dtypes.bfloat16).astype(np.float64)
    return params


@pytest.mark.parametrize("moments_dtype", ["float32", "bfloat16"])
def test_moments_dtype_stores_both_moments_and_follows_adamw(moments_dtype):
    import jax
    import jax.numpy as jnp

    from g2rpo_jax import parallel

    config = config_lib.optimizer_config(learning_rate=1e-2, weight_decay=0.1,
                                         grad_clip_norm=1e9, moments_dtype=moments_dtype)
    optimizer = optimizer_lib.make_optimizer(config)
    rng = np.random.default_rng(0)
    params = {"w": rng.normal(size=(8, 16)).astype(np.float32)}
    grads = [rng.normal(size=(8, 16)).astype(np.float32) * 10.0 ** -rng.integers(0, 4)
             for _ in range(6)]
    state = optimizer.init(jax.tree.map(jnp.asarray, params))
    moments = [leaf for leaf in jax.tree.leaves(state) if leaf.ndim == 2]
    assert len(moments) == 2 and {m.dtype for m in moments} == {jnp.dtype(moments_dtype)}
    p = jax.tree.map(jnp.asarray, params)
    for g in grads:
        updates, state = optimizer.update({"w": jnp.asarray(g)}, state, p)
        p = jax.tree.map(lambda a, u: a + u, p, updates)
    assert {m.dtype for m in jax.tree.leaves(state) if m.ndim == 2} == {jnp.dtype(moments_dtype)}
    expected = _numpy_adamw(params["w"].astype(np.float64), grads, 1e-2, 0.9, 0.999, 1e-8, 0.1,
                            round_moments=moments_dtype == "bfloat16")
    # Measured: 4e-7 (float32), 5e-7 (bfloat16) against the float64 reference.
    atol = 5e-6
    np.testing.assert_allclose(np.asarray(p["w"]), expected, rtol=0, atol=atol)
    if moments_dtype == "bfloat16":   # the rounding is visible: not float32 AdamW
        plain = _numpy_adamw(params["w"].astype(np.float64), grads, 1e-2, 0.9, 0.999, 1e-8, 0.1,
                             round_moments=False)
        assert np.abs(np.asarray(p["w"]) - plain).max() > 4 * atol      # measured 8e-5
    # The moments take the parameters' layout (optax.tree_map_params sees through the wrapper).
    mesh = parallel.make_mesh((1, 8, 1))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
    shardings = parallel.optimizer_state_shardings(
        optimizer, jax.eval_shape(optimizer.init, params), {"w": sharding}, mesh)
    assert sum(s == sharding for s in jax.tree.leaves(shardings)) == 2


def test_unknown_moments_dtype_is_named():
    with pytest.raises(ValueError, match="moments_dtype 'float16'"):
        optimizer_lib.make_optimizer(config_lib.optimizer_config(moments_dtype="float16"))
