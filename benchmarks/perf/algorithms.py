r"""Forward passes per prompt and wall time of one iteration, for every algorithm preset.

  python benchmarks/perf/algorithms.py                      # counts for the paper setting + timings
  python benchmarks/perf/algorithms.py --devices=8 --prompts=8

Counts (T = 16, G = 12, k ∈ 0..7) come from the code's own continuation plan and are what one
rollout of one prompt costs; method.md's cost paragraph estimates ~1,800 (Λ = {1,2}) and ~2,200
(Λ = {1,2,3}) for G²RPO against 192 for a plain rollout group.

Timings run one full iteration (rollout → synthetic reward → advantages → update) of each preset
on a tiny random FLUX (hidden 32, 1+1 blocks, 16 latent tokens) with T = --steps, G = --group,
P = --prompts on the local CPU devices; the first call (compile) and the second (steady state)
are reported separately.
"""

import os
import time

from absl import app, flags

_DEVICES = flags.DEFINE_integer("devices", 1, "Emulated CPU devices (mesh data axis).")
_PROMPTS = flags.DEFINE_integer("prompts", 2, "Prompts per iteration.")
_STEPS = flags.DEFINE_integer("steps", 16, "Sampling steps T for the timing runs.")
_GROUP = flags.DEFINE_integer("group", 12, "Group size G for the timing runs.")


def main(_):
    import jax

    jax.config.update("jax_num_cpu_devices", _DEVICES.value)
    from flax import nnx

    from g2rpo_jax import parallel
    from g2rpo_jax.models import flux
    from g2rpo_jax.rewards import synthetic
    from g2rpo_jax.rl import algorithms, iteration, policy_update
    from g2rpo_jax.rl import optimizer as optimizer_lib
    from g2rpo_jax.run import config_lib
    from g2rpo_jax.sampling import rollout, schedules
    from g2rpo_jax.testing import tiny_rl

    print("Forward passes per prompt and iteration (T = 16, G = 12, k in 0..7):")
    sigmas16 = schedules.flux_sigmas(16, 3.0)
    print(f"  {'algorithm':14s} {'granularities':14s} {'rollout':>8s} {'computed':>9s} "
          f"{'pad':>6s} {'update':>7s}")
    for name in algorithms.PRESETS:
        for lams in ((1, 2), (1, 2, 3)) if name == "g2rpo" else (None,):
            extra = {} if lams is None else dict(granularities=lams,
                                                 granularity_weights=(1.0,) * len(lams))
            algo = algorithms.Algorithm.from_config(algorithms.preset(name, **extra))
            plan = (iteration.continuation_plan(algo, sigmas16)
                    if algo.rollout == "singular" else None)
            passes = algo.rollout_forward_passes(16, plan)
            pad = "-"
            if plan is not None:
                padded = rollout.plan_continuations(sigmas16, algo.branch_steps,
                                                    algo.granularities, packing="pad")
                pad = str(16 + algo.group_size * padded.computed_steps)
            print(f"  {name:14s} {str(algo.granularities if plan else '-'):14s} "
                  f"{passes['useful']:8d} {passes['computed']:9d} {pad:>6s} "
                  f"{algo.update_forward_passes(16):7d}")

    cfg = tiny_rl.TINY_FLUX
    mesh = parallel.make_mesh((-1, 1, 1))
    p, t, n = _PROMPTS.value, _STEPS.value, 16
    sigmas = schedules.flux_sigmas(t, 3.0)
    cond = tiny_rl.random_cond(mesh, p, n)
    opt_config = config_lib.optimizer_config(learning_rate=2e-6)
    print(f"\nOne iteration on a tiny FLUX, {jax.device_count()} CPU device(s), P={p}, T={t}, "
          f"G={_GROUP.value} (seconds):")
    print(f"  {'algorithm':14s} {'compile+run':>12s} {'run':>8s} {'rollout':>8s} {'update':>8s}")
    for name in algorithms.PRESETS:
        algo = algorithms.Algorithm.from_config(algorithms.preset(
            name, group_size=_GROUP.value, branch_steps=tuple(range(t // 2))))
        graphdef, params = nnx.split(flux.init_sharded(cfg, mesh, seed=0))
        optimizer = optimizer_lib.make_optimizer(opt_config)
        state = policy_update.init_state(params, optimizer, algo.kl_beta > 0, mesh)
        rollout_fn = jax.jit(iteration.make_rollout_fn(graphdef, algo, sigmas, (n, cfg.in_channels),
                                                       synthetic.brightness, (1.0,), 3.5))
        update_fn = None
        times = []
        with jax.set_mesh(mesh):
            for it in range(2):
                start = time.perf_counter()
                batch, _ = rollout_fn(state.params, cond, jax.random.key(it), it)
                jax.block_until_ready(batch)
                mid = time.perf_counter()
                if update_fn is None:
                    update_fn = policy_update.jit_update(policy_update.make_update_fn(
                        graphdef, optimizer, algo, policy_update.PolicyUpdate(), sigmas),
                        state, batch, cond)
                state, metrics = update_fn(state, batch, cond)
                jax.block_until_ready(state)
                times.append((time.perf_counter() - start, mid - start,
                              time.perf_counter() - mid))
        print(f"  {name:14s} {times[0][0]:12.2f} {times[1][0]:8.2f} {times[1][1]:8.2f} "
              f"{times[1][2]:8.2f}")


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    app.run(main)
