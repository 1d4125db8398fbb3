r"""The first update's |log ratio| (must be 0: the policy has not moved yet), float32 vs bfloat16
compute, with and without re-scoring the rollout's transitions in the update's layout.

  python benchmarks/ratio_check.py

The rollout scores 8 prompts (and G members, and the packed continuation lanes) per call; the
update works in micro-batches of 2 prompts. A bf16 model rounds differently at different batch
shapes, which is the drift the DanceGRPO authors report (their issue #57).
"""

import os

from absl import app


def main(_):
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import dataclasses

    from g2rpo_jax import parallel
    from g2rpo_jax.rl import algorithms, policy_update
    from g2rpo_jax.sampling import schedules
    from g2rpo_jax.testing import tiny_rl

    sigmas = schedules.flux_sigmas(6, 3.0)
    mesh = parallel.make_mesh((2, 4, 1))
    print(f"{'algorithm':12s} {'dtype':9s} {'recompute':>9s} {'first |log ratio|':>18s} "
          f"{'rollout gap':>12s}")
    for name in ("g2rpo", "dance_grpo"):
        algo = algorithms.Algorithm.from_config(algorithms.preset(
            name, group_size=4, branch_steps=(0, 1, 2), granularities=(1, 2),
            granularity_weights=(1.0, 1.0)))
        for dtype in ("float32", "bfloat16"):
            for recompute in (False, True):
                out = tiny_rl.run_iteration(
                    algo, mesh, sigmas, prompts=8,
                    settings=policy_update.PolicyUpdate(micro_batch_prompts=2,
                                                   recompute_old_log_prob=recompute),
                    model_config=dataclasses.replace(tiny_rl.TINY_FLUX, dtype=dtype))
                s = policy_update.summarize(out["metrics"])
                print(f"{name:12s} {dtype:9s} {str(recompute):>9s} "
                      f"{s['first_update_log_ratio_abs_max']:18.2e} "
                      f"{s['rollout_log_prob_gap']:12.2e}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    app.run(main)
