"""A run's configuration and side effects, around the math: the config pieces (config_lib.py),
checkpoints (checkpoint.py), metrics and TensorBoard (metrics.py), the optional W&B run
(wandb_logger.py) and SIGTERM at iteration boundaries (preemption.py)."""
