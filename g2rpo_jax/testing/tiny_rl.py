"""A tiny random FLUX and one RL iteration on it, shared by tests and benchmarks."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.models import flux
from g2rpo_jax.rewards import synthetic
from g2rpo_jax.rl import iteration, policy_update
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib

# hidden 32 (4 heads of 8), 1+1 blocks, 4 latent channels: an iteration compiles in seconds.
TINY_FLUX = flux.FluxConfig(num_layers=1, num_single_layers=1, attention_head_dim=8,
                            num_attention_heads=4, joint_attention_dim=16,
                            pooled_projection_dim=8, in_channels=4, axes_dims_rope=(2, 2, 4))

# AdamW at a test-sized learning rate.
ADAMW = config_lib.optimizer_config(learning_rate=1e-3)

# Plain SGD through the same AdamW code (b1 = b2 = 0, eps = 1: update ≈ lr·g for small g), for
# comparisons that Adam's first step (≈ lr·sign(g)) would blow up from rounding-level gradients.
SGD = config_lib.optimizer_config(learning_rate=1e-2, weight_decay=0.0, b1=0.0, b2=0.0, eps=1.0,
                                  grad_clip_norm=1e9)


def random_cond(mesh, prompts: int, image_tokens: int = 16, text_tokens: int = 4,
                cfg: flux.FluxConfig = TINY_FLUX, seed: int = 7) -> dict:
    """Random per-prompt text conditioning and position ids on a 4-wide latent grid."""
    keys = jax.random.split(jax.random.key(seed), 2)
    token = jnp.arange(image_tokens)
    cond = dict(txt=jax.random.normal(keys[0], (prompts, text_tokens, cfg.joint_attention_dim)),
                y=jax.random.normal(keys[1], (prompts, cfg.pooled_projection_dim)),
                txt_ids=jnp.zeros((text_tokens, 3)),
                img_ids=jnp.stack([jnp.zeros(image_tokens), token // 4, token % 4], -1))
    return parallel.place_cond(cond, mesh)


def run_iteration(algo, mesh, sigmas, prompts: int, image_tokens: int = 16,
                  settings: policy_update.PolicyUpdate | None = None,
                  optimizer_config=ADAMW, model_config: flux.FluxConfig = TINY_FLUX,
                  reward_fn=synthetic.brightness, reward_weights=(1.0,), seed: int = 0) -> dict:
    """One iteration: rollout → rewards → advantages → update, all on `mesh`.

    Returns batch, stats, the updated state, update metrics, the parameters before (numpy),
    the graphdef and the conditioning.
    """
    settings = settings or policy_update.PolicyUpdate()
    graphdef, params = nnx.split(flux.init_sharded(model_config, mesh, seed=seed))
    optimizer = optimizer_lib.make_optimizer(optimizer_config)
    state = policy_update.init_state(params, optimizer, algo.kl_beta > 0, mesh, settings)
    cond = random_cond(mesh, prompts, image_tokens, cfg=model_config)
    rollout_fn = jax.jit(iteration.make_rollout_fn(
        graphdef, algo, sigmas, (image_tokens, model_config.in_channels), reward_fn,
        reward_weights, guidance=settings.guidance))
    with jax.set_mesh(mesh):
        batch, stats = rollout_fn(state.params, cond, jax.random.key(seed), 0)
        before = jax.tree.map(np.asarray, state.params)
        update_fn = policy_update.jit_update(
            policy_update.make_update_fn(graphdef, optimizer, algo, settings, sigmas), state,
            batch, cond)
        state, metrics = update_fn(state, batch, cond)
    return dict(batch=batch, stats=stats, state=state, metrics=metrics, before=before,
                graphdef=graphdef, cond=cond)
