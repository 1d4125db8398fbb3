"""The pre-training weight average (pretrain.ema_decay): hand-computed decays and updates, and
the train step's average following the trained weights."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax import parallel, pretrain
from g2rpo_jax.data import world
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator as generator_lib


@pytest.mark.parametrize("step, want", [(0, 0.1), (90, 0.91), (990, 0.991), (10**6, 0.999)])
def test_decay_warms_up_then_caps(step, want):
    # min(0.999, (1 + t) / (10 + t)): 1/10, 91/100, 991/1000, then the cap.
    np.testing.assert_allclose(float(pretrain.ema_decay_at(step, 0.999)), want, rtol=1e-6)


def test_update_is_the_convex_combination():
    ema = {"a": jnp.array([1.0, 2.0]), "b": {"c": jnp.array(4.0)}}
    params = {"a": jnp.array([3.0, -2.0]), "b": {"c": jnp.array(0.0)}}
    got = pretrain.ema_update(ema, params, 0.75)
    # 0.75·ema + 0.25·params, by hand.
    np.testing.assert_allclose(got["a"], [1.5, 1.0])
    np.testing.assert_allclose(got["b"]["c"], 3.0)


def test_train_step_averages_the_updated_weights():
    config = config_lib.shapes_config()
    generator = generator_lib.build_generator(
        config, parallel.make_mesh({"data": -1, "fsdp": 1, "tensor": 1}), 0)
    fg, fp = nnx.split(generator.flux, nnx.Param)
    eg, ep = nnx.split(generator.text_encoder, nnx.Param)
    params = {"flux": fp, "text_encoder": ep}
    optimizer = optimizer_lib.make_optimizer(
        config_lib.optimizer_config(learning_rate=1e-2, weight_decay=0.0))
    step = jax.jit(pretrain.make_train_step(fg, eg, generator.autoencoder, optimizer,
                                            ema_decay=0.999))
    rng = np.random.default_rng(0)
    prompts = world.all_prompts()[:4]
    images = np.stack([world.render_prompt(p, rng) for p in prompts])
    ids, mask = generator.tokenize(prompts)
    ema0 = jax.tree.map(jnp.copy, params)
    new_params, _, ema, loss = step(params, optimizer.init(params), ema0, images, ids, mask,
                                    jax.random.key(0), 0)
    assert np.isfinite(float(loss))
    # Step 0's decay is 1/10: the average moves 90% of the way to the trained weights.
    moved = [float(jnp.max(jnp.abs(n - p))) for n, p in zip(jax.tree.leaves(new_params),
                                                              jax.tree.leaves(ema0))]
    assert max(moved) > 1e-3  # the weights did train
    jax.tree.map(lambda e, e0, n: np.testing.assert_allclose(e, 0.1 * e0 + 0.9 * n, atol=1e-6),
                 ema, ema0, new_params)
