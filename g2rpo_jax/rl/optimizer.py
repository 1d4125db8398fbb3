"""The optimizer of RL fine-tuning and of pre-training: AdamW with global-norm clipping and a
learning-rate schedule, built from a config's `optimizer` section (`config_lib.optimizer_config`).
"""

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "warmup_constant", "warmup_cosine")


def learning_rate_schedule(config) -> optax.Schedule:
    """The learning rate by optimizer step, from an `optimizer` section."""
    if config.schedule == "warmup_cosine" and config.decay_steps <= config.warmup_steps:
        raise ValueError(f"optimizer.decay_steps ({config.decay_steps}, the schedule's total "
                         f"length) must exceed optimizer.warmup_steps ({config.warmup_steps}).")
    if config.schedule == "constant":
        return optax.constant_schedule(config.learning_rate)
    if config.schedule == "warmup_constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps),
             optax.constant_schedule(config.learning_rate)], [config.warmup_steps])
    if config.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, config.learning_rate,
                                                  config.warmup_steps, config.decay_steps)
    raise ValueError(f"Unknown learning-rate schedule {config.schedule!r}; use one of "
                     f"{sorted(SCHEDULES)}.")


def stored_in(inner: optax.GradientTransformation, dtype) -> optax.GradientTransformation:
    """`inner` with its floating-point state stored in `dtype` (e.g. bfloat16 AdamW moments:
    half the bytes) and computed in float32: each update reads the state up to float32, runs
    `inner`, and rounds the new state back to `dtype`. optax's own `mu_dtype` covers the first
    moment only."""
    dtype = jnp.dtype(dtype)

    def cast(tree, to):
        def leaf(x):   # leaves without a dtype (optax's structure placeholders) pass through
            floating = hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)
            return x.astype(to) if floating else x
        return jax.tree.map(leaf, tree)

    def init(params):
        return cast(inner.init(params), dtype)

    def update(updates, state, params=None, **extra):
        updates, state = inner.update(updates, cast(state, jnp.float32), params, **extra)
        return updates, cast(state, dtype)

    return optax.GradientTransformationExtraArgs(init, update)


MOMENT_DTYPES = ("float32", "bfloat16")


def make_optimizer(config) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a schedule, from a config's `optimizer` section;
    `moments_dtype` "bfloat16" stores both moments in bfloat16 (`stored_in`)."""
    moments_dtype = config.get("moments_dtype", "float32")
    if moments_dtype not in MOMENT_DTYPES:
        raise ValueError(f"Unknown optimizer.moments_dtype {moments_dtype!r}; use one of "
                         f"{MOMENT_DTYPES}.")
    adamw = optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2,
                        eps=config.eps, weight_decay=config.weight_decay)
    if moments_dtype != "float32":
        adamw = stored_in(adamw, moments_dtype)
    return optax.chain(optax.clip_by_global_norm(config.grad_clip_norm), adamw)
