"""Does a GRPO update raise the expected reward of the branch step it was computed from?

  python benchmarks/policy_gradient_check.py [--lr=2.0] [--batches=3]

On the shipped shapes base with the shapes_cpu G²RPO settings: 8 fixed training prompts,
branches at steps 0–3. `--batches` rollouts (groups of 8) give one accumulated plain-SGD update
of size lr; the expected verifier reward of each branch step is then measured before and after
at the same anchors and branch noise (common random numbers; 64 branch members per anchor, 3
anchors per prompt). A positive `diff` at small lr means the update is an ascent direction; a
negative lr flips the step (a sign check).
"""

import argparse
import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from g2rpo_jax import config_lib, held_out, parallel
from g2rpo_jax import generator as generator_lib
from g2rpo_jax.data import world
from g2rpo_jax.rl import algorithms, iteration, policy_update
from g2rpo_jax.tasks import shapes as shapes_task


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=2.0)
    parser.add_argument("--batches", type=int, default=3)
    args = parser.parse_args()
    config = config_lib.load_config("shapes_cpu.py")
    mesh = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
    generator = generator_lib.load_generator(generator_lib.SHIPPED_BASE, mesh)
    train_prompts = world.split_prompts()["train"]
    picked = np.random.default_rng(0).choice(len(train_prompts), 8, replace=False)
    prompts = [train_prompts[i] for i in picked]
    reward_fn = shapes_task.make_reward_fn(generator, ["in_domain"], train_prompts, config)
    sigmas = held_out.sigmas_from_config(config)
    graphdef, params = nnx.split(generator.flux)
    cond = generator.encode(prompts, mesh)
    shapes_cpu = algorithms.Algorithm.from_config(config.algorithm)

    def stages(group_size):
        algo = dataclasses.replace(shapes_cpu, group_size=group_size)
        sample, finish = iteration.make_rollout_stages(graphdef, algo, sigmas,
                                                       generator.latent_shape, [1.0], None)
        return algo, jax.jit(sample), jax.jit(finish)

    algo, sample, finish = stages(8)
    _, sample_many, _ = stages(64)
    num_k = len(algo.branch_steps)
    optimizer = optax.sgd(args.lr)
    state = policy_update.init_state(params, optimizer, False, mesh)
    settings = dataclasses.replace(policy_update.PolicyUpdate.from_config(config), steps_per_update=0)
    update_fn = jax.jit(policy_update.make_update_fn(graphdef, optimizer, algo, settings, sigmas))
    ids = np.asarray(picked, np.int32)
    keys = [jax.random.key(100 + i) for i in range(3)]

    def expected_reward(p):
        per_k = []
        for key in keys:
            finals, _ = sample_many(p, cond, key, 0)
            scores = reward_fn(finals, ids).reshape(8, num_k, -1, 64)[:, :, 0]  # finest λ
            per_k.append(scores.mean(axis=(0, 2)))
        return np.mean(per_k, axis=0)

    before = expected_reward(state.params)
    new_state = state
    for b in range(args.batches):
        finals, transitions = sample(state.params, cond, keys[b % len(keys)], 0)  # same anchors
        batch, _ = finish(jnp.asarray(reward_fn(finals, ids)), transitions)
        new_state, metrics = update_fn(new_state, batch, cond)
        print(f"batch {b}: grad norm {float(np.mean(metrics['grad_norm'])):.4f}")
    after = expected_reward(new_state.params)
    print("| branch step | before | after | diff |\n|---|---|---|---|")
    for k, (b, a) in enumerate(zip(before, after)):
        print(f"| {algo.branch_steps[k]} | {b:.4f} | {a:.4f} | {a - b:+.4f} |")
    print(f"lr {args.lr}, {args.batches} batches: mean diff {np.mean(after - before):+.4f}")


if __name__ == "__main__":
    main()
