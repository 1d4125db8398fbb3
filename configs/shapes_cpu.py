"""The embedded default: G²RPO (or a baseline) from the shipped base generator, on a CPU.

  python -m g2rpo_jax.main --config=configs/shapes_cpu.py --workdir=DIR
  python -m g2rpo_jax.main --config=configs/shapes_cpu.py:dance_grpo --workdir=DIR

Algorithms: g2rpo (default), g2rpo_no_mgai, dance_grpo, flow_grpo, mix_grpo (same machinery,
same budget of prompts and group size; each keeps its own SDE step, η, trained steps and KL).
Runs in minutes on 2 CPU cores; docs/results.md has the base → final scores, the settings
tried around these and the algorithms compared.
"""

from g2rpo_jax.rl import algorithms
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator

# Sized for 2 CPU cores: T = 10 steps, 16 prompts × groups of 8 per iteration, G²RPO branches
# at the first 4 steps (the first half of the schedule is where the paper branches). The clip
# range (PPO's 0.2) only acts when an iteration takes several optimizer steps
# (policy_update.steps_per_update), off-policy after the first.
NUM_STEPS = 10
CPU_ALGORITHM = dict(group_size=8, branch_steps=(0, 1, 2, 3), clip_range=0.2)


def get_config(algorithm: str = "g2rpo"):
    config = config_lib.shapes_config()
    config.mode = "train"
    config.model.checkpoint = generator.SHIPPED_BASE
    config.sampling.num_steps = NUM_STEPS
    config.algorithm = algorithms.preset(algorithm, **CPU_ALGORITHM)
    if config.algorithm.rollout == "trajectory":
        config.algorithm.window_shift_every = 5
    # One accumulated, on-policy step per iteration at lr 3e-5 over 16 prompts: with 8 prompts
    # the held-out gain did not last to the end of the run (docs/results.md, "What RL does").
    config.policy_update.steps_per_update = 0  # all trained steps in one optimizer step
    config.optimizer = config_lib.optimizer_config(learning_rate=3e-5, weight_decay=0.0)
    config.train = config_lib.train_config(
        num_iterations=24, prompts_per_iteration=16, eval_every=6, images_in_grid=16,
        checkpoint_every=6)
    # Rewards trained on (the verifier); the judge and the quality probe are only reported.
    config.reward.train = ["in_domain"]
    config.reward.weights = [1.0]
    config.evaluation.num_prompts = 0
    # RL only needs the prompts: one rendered image each, so an epoch visits every training
    # prompt once.
    config.data.images_per_prompt = 1
    return config
