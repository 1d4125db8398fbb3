"""The optimizer of RL fine-tuning and of pre-training: AdamW with global-norm clipping and a
learning-rate schedule, built from a config's `optimizer` section (`config_lib.optimizer_config`).
"""

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


def make_optimizer(config) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a schedule, from a config's `optimizer` section."""
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                    weight_decay=config.weight_decay))
