"""Does RL learn? A short run that overfits one fixed batch of the embedded world.

`fixed_prompt_run` trains the shipped shapes base for a few iterations on one batch: the same
prompts, starting noise and SDE noise every iteration (the library's own rollout, advantage and
update programs, as `train.py` calls them), and returns the batch's mean training reward before
the first update and after each. Overfitting one batch is the fastest learning the embedded world
shows: with fresh noise every iteration a gradient from 8 prompts is nearly all noise
(`benchmarks/learning/gradient_consistency.py`: same-prompt cosine about 0), with fixed noise the reward
climbs within a few updates. The controls that `benchmarks/learning/learning_signal.py` measures
and the test's margin is set from: `reward_scale` multiplies the rewards before the advantages
(−1 flips the objective, 0 removes it), and `shuffle_rewards` permutes each prompt's rewards
among its samples every iteration (updates of the same size that carry no signal: the gain's
noise).
"""

from flax import nnx
import jax
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.data import world
from g2rpo_jax.rl import algorithms, iteration, policy_update
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator, held_out
from g2rpo_jax.tasks import shapes as shapes_task

# 8 training prompts, evenly spaced over the sorted train split (count and relation prompts).
NUM_PROMPTS = 8
# The fixed small setting: 6 ODE/SDE steps, groups of 8, G²RPO branching at k ∈ {0, 1, 2},
# AdamW at 5e-5 (2e-4 overshoots: the reward peaks after 2–4 updates, then collapses).
SETTING = dict(num_steps=6, group_size=8, branch_steps=(0, 1, 2), learning_rate=5e-5,
               iterations=8)


def fixed_prompts() -> list[str]:
    train = world.split_prompts()["train"]
    return [train[i] for i in np.linspace(0, len(train) - 1, NUM_PROMPTS).astype(int)]


def fixed_prompt_config(algorithm: str, *, num_steps: int, learning_rate: float, seed: int = 0,
                        **algorithm_fields):
    """configs/shapes_cpu.py with `algorithm`, shrunk to the fixed small setting; fields of
    the algorithm section that the rollout does not use (branch_steps of a trajectory
    rollout) are dropped."""
    config = config_lib.load_config("shapes_cpu.py", algorithm)
    config.seed = seed
    config.sampling.num_steps = num_steps
    config.optimizer.learning_rate = learning_rate
    for field, value in algorithm_fields.items():
        if field == "branch_steps" and config.algorithm.rollout != "singular":
            continue
        config.algorithm[field] = value
    return config


def fixed_prompt_run(algorithm: str, mesh, *, seed: int = 0, reward_scale: float = 1.0,
                     shuffle_rewards: bool = False, **setting) -> list[float]:
    """Trains `algorithm` from the shipped base on one batch of `fixed_prompts()` and returns its
    mean training reward (in_domain, unscaled) before the first update and after each of the
    `iterations` updates: [iterations + 1]. `setting` overrides `SETTING`'s fields. One
    process (the host's rewards are taken as the whole batch's)."""
    setting = {**SETTING, **setting}
    iterations = setting.pop("iterations")
    prompts = fixed_prompts()
    config = fixed_prompt_config(algorithm, seed=seed, **setting)
    algo = algorithms.Algorithm.from_config(config.algorithm)
    sigmas = held_out.sigmas_from_config(config)
    bundle = generator.load_generator(generator.SHIPPED_BASE, mesh)
    graphdef, params = nnx.split(bundle.flux)
    optimizer = optimizer_lib.make_optimizer(config.optimizer)
    settings = policy_update.PolicyUpdate.from_config(config)
    state = policy_update.init_state(params, optimizer, algo.kl_beta > 0, mesh, settings)
    sample, finish = map(jax.jit, iteration.make_rollout_stages(
        graphdef, algo, sigmas, bundle.latent_shape, (1.0,), None))
    update = policy_update.make_update_fn(graphdef, optimizer, algo, settings, sigmas)
    reward_fn = shapes_task.make_reward_fn(bundle, ["in_domain"], prompts, config)
    cond = parallel.place_cond(bundle.encode(prompts), mesh)
    prompt_ids = np.arange(len(prompts))
    key = jax.random.key(seed)   # every iteration's: the same noise
    shuffler = np.random.default_rng(seed)
    rewards, compiled = [], None
    for it in range(iterations + 1):
        with jax.set_mesh(mesh):
            finals, transitions = sample(state.params, cond, key, it)
        scores = reward_fn(parallel.local_rows(finals, mesh), prompt_ids)    # [1, P, M]
        rewards.append(float(scores.mean()))
        if it == iterations:
            break
        if shuffle_rewards:
            scores = shuffler.permuted(scores, axis=-1)
        with jax.set_mesh(mesh):
            batch, _ = finish(parallel.replicated(reward_scale * scores, mesh), transitions)
            compiled = compiled or policy_update.jit_update(update, state, batch, cond)
            state, _ = compiled(state, batch, cond)
    return rewards
