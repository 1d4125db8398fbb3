"""How much of a G²RPO policy gradient is signal? The cosine between accumulated gradients of
independent rollouts.

  python benchmarks/learning/gradient_consistency.py [--algorithm='{"group_size": 32, "branch_steps": [0]}']
      [--reps=6] [--generator=PATH]

On the shipped shapes base with the shapes_cpu G²RPO settings (overridable field by field with
--algorithm, JSON), `reps` rollouts of 8 training prompts each give one accumulated gradient
each (one plain-SGD step's parameter change). Two figures, mean ± standard error over pairs:
  same-prompt   the same 8 prompts, fresh anchors and branch noise for every rollout;
  cross-prompt  a different set of 8 prompts for every rollout (what generalises).
Pure noise gives cosines around 0 (±1/sqrt(#params)); a gradient whose signal share is f of its
norm gives about f² between two independent estimates. So the figure compares variance
reduction settings (group size, branch steps, antithetic noise, advantage scaling) at the cost
that the script also prints.
"""

import argparse
import dataclasses
import json
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from g2rpo_jax import parallel
from g2rpo_jax.data import world
from g2rpo_jax.rl import algorithms, iteration, policy_update
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator as generator_lib
from g2rpo_jax.tasks import held_out
from g2rpo_jax.tasks import shapes as shapes_task

PROMPTS = 8


def _cosines(vectors):
    unit = [v / np.linalg.norm(v) for v in vectors]
    values = [float(unit[i] @ unit[j]) for i in range(len(unit)) for j in range(i + 1, len(unit))]
    return np.mean(values), np.std(values) / np.sqrt(len(values))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--algorithm", default="{}", help="JSON overrides of the algorithm")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--generator", default=generator_lib.SHIPPED_BASE)
    args = parser.parse_args()
    overrides = json.loads(args.algorithm)
    config = config_lib.load_config(
        "shapes_cpu.py", **{f"algorithm.{field}": value for field, value in overrides.items()})
    mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    generator = generator_lib.load_generator(args.generator, mesh)
    train_prompts = world.split_prompts()["train"]
    sigmas = held_out.sigmas_from_config(config)
    graphdef, params = nnx.split(generator.flux)
    reward_fn = shapes_task.make_reward_fn(generator, ["in_domain"], train_prompts, config)
    algo = algorithms.Algorithm.from_config(config.algorithm)
    sample, finish = map(jax.jit, iteration.make_rollout_stages(
        graphdef, algo, sigmas, generator.latent_shape, [1.0], None))
    optimizer = optax.sgd(1.0)
    state = policy_update.init_state(params, optimizer, False, mesh)
    settings = dataclasses.replace(policy_update.PolicyUpdate.from_config(config), steps_per_update=0)
    update_fn = jax.jit(policy_update.make_update_fn(graphdef, optimizer, algo, settings, sigmas))

    def gradient(prompt_seed: int, key) -> np.ndarray:
        picked = np.random.default_rng(prompt_seed).choice(len(train_prompts), PROMPTS,
                                                           replace=False)
        cond = generator.encode([train_prompts[i] for i in picked], mesh)
        finals, transitions = sample(state.params, cond, key, 0)
        batch, _ = finish(jnp.asarray(reward_fn(finals, picked)), transitions)
        new_state, _ = update_fn(state, batch, cond)
        change = jax.tree.map(lambda a, b: np.asarray(a - b).ravel(), new_state.params,
                              state.params)
        return np.concatenate(jax.tree.leaves(change))

    start = time.perf_counter()
    same = [gradient(0, jax.random.key(i)) for i in range(args.reps)]
    cross = [gradient(100 + i, jax.random.key(50 + i)) for i in range(args.reps)]
    seconds = time.perf_counter() - start
    (s_mean, s_err), (c_mean, c_err) = _cosines(same), _cosines(cross)
    passes = algo.rollout_forward_passes(config.sampling.num_steps,
                                         iteration.continuation_plan(algo, sigmas))
    print(f"algorithm overrides {json.dumps(overrides)}: same-prompt cos {s_mean:+.4f} ± "
          f"{s_err:.4f}, cross-prompt cos {c_mean:+.4f} ± {c_err:.4f} ({2 * args.reps} "
          f"rollouts of {PROMPTS} prompts, {seconds:.0f} s; rollout forward passes per prompt "
          f"{passes})")


if __name__ == "__main__":
    main()
