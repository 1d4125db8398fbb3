"""One RL iteration's rollout side: sample, score, form advantages, package the TrainBatch.

`make_rollout_fn` returns a pure function of (params, cond, key, iteration) that the caller
jits once; `make_rollout_stages` gives the same as two functions around the reward, for rewards
computed on the host. The algorithm's fields (not its name) decide the rollout shape:

  singular   [P] anchors → [K, P, G] branches → [K, J, P, G] finals → rewards [K, J, R, P, G]
             → advantages integrated over the J·R scales (vmap) → [K, P, G]
  trajectory [P, G] trajectories → rewards [R, P, G] → advantages [P, G], the same for each of
             the K trained steps

The reward is a function argument: `reward_fn(latents [P, M, N, C], cond) -> [R, P, M]` (decode
and score; R reward models), so synthetic rewards and real reward models plug in alike.
"""

from collections.abc import Callable

from flax import nnx, struct
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.rl import advantages as adv_lib
from g2rpo_jax.rl.algorithms import Algorithm
from g2rpo_jax.rl.policy_update import TrainBatch
from g2rpo_jax.sampling import rollout

RewardFn = Callable[[jax.Array, dict], jax.Array]


@struct.dataclass
class SampledTransitions:
    """What `sample` hands to `finish`: the iteration's K trained transitions, whose advantages
    `finish` forms from the rewards. The same type for both rollout families.

      batch     TrainBatch with zero advantages
      sde_mask  [T] bool, the steps a trajectory rollout sampled with the SDE (reported in the
                stats); None for a singular rollout
    """

    batch: TrainBatch
    sde_mask: jax.Array | None = None


def continuation_plan(algo: Algorithm, sigmas) -> rollout.ContinuationPlan:
    return rollout.plan_continuations(np.asarray(sigmas), algo.branch_steps, algo.granularities,
                                      algo.end_at_zero, algo.packing, algo.max_lanes or None)


def make_rollout_stages(graphdef, algo: Algorithm, sigmas, latent_shape: tuple[int, int],
                        reward_weights, guidance: float | None,
                        quantize_timesteps: bool = False) -> tuple[Callable, Callable]:
    """The rollout in two pure stages around the reward, so that a reward computed on the host
    (a verifier in numpy, a remote model) runs between two jitted programs rather than as a
    callback inside one sharded program:

      sample(params, cond, key, iteration) -> (finals [P, M, N, C], SampledTransitions)
      finish(scores [R, P, M], SampledTransitions) -> (TrainBatch, stats)

    Args:
      graphdef: the policy's nnx graphdef (params are passed to `sample`).
      algo: the algorithm.
      sigmas: [T+1] concrete schedule.
      latent_shape: (N, C) of one sample's packed latents.
      reward_weights: [R] weights of the reward models in the advantage.
      guidance: FLUX guidance-embedding value, or None.
      quantize_timesteps: the reference code's int(σ·1000)/1000 model timesteps.

    `stats` holds `rewards` (the raw scores: [K, J, R, P, G] or [R, P, G]) and `reward_mean`
    [R] (over finals at the finest granularity, or over trajectories).
    """
    sigmas_np = np.asarray(sigmas, np.float32)
    num_steps = len(sigmas_np) - 1
    algo.validate(num_steps)
    g = algo.group_size
    reward_weights = jnp.asarray(reward_weights, jnp.float32)
    plan = continuation_plan(algo, sigmas_np) if algo.rollout == "singular" else None

    def velocity_fn(params, cond):
        return rollout.make_velocity_fn(nnx.merge(graphdef, params), cond, guidance,
                                        quantize_timesteps)

    def singular_sample(params, cond, key, iteration):
        del iteration
        sig = jnp.asarray(sigmas_np)
        velocity = velocity_fn(params, cond)
        p = cond["y"].shape[0]
        noise_key, branch_key = jax.random.split(key)
        x_init = jax.random.normal(noise_key, (p, 1, *latent_shape), jnp.float32)
        xs, vs = rollout.ode_trajectory(velocity, x_init, sig)
        branch_x, old_log_prob = rollout.singular_branches(
            xs, vs, sig, algo.branch_steps, g, algo.eta, branch_key, algo.sde_step,
            algo.log_prob_reduce, algo.antithetic)
        finals = rollout.continue_branches(velocity, branch_x, plan, algo.granularities)
        k, j = finals.shape[:2]
        # Prompt-major for the reward: [P, K·J·G, N, C].
        per_prompt = jnp.moveaxis(finals, 2, 0).reshape(p, k * j * g, *latent_shape)
        ks = jnp.asarray(algo.branch_steps, jnp.int32)
        transitions = SampledTransitions(batch=TrainBatch(
            x=xs[ks], x_next=branch_x, step=ks, old_log_prob=old_log_prob,
            advantages=jnp.zeros(branch_x.shape[:3], jnp.float32)))
        return per_prompt, transitions

    def singular_finish(scores, transitions):
        k, p = transitions.batch.x_next.shape[:2]
        j = len(algo.granularities)
        r = scores.shape[0]
        rewards = jnp.moveaxis(scores.reshape(r, p, k, j, g), (2, 3), (0, 1))  # [K, J, R, P, G]
        scales = jnp.moveaxis(rewards, 0, 2).reshape(j * r, k, p, g)           # [J·R, K, P, G]
        weights = adv_lib.scale_weights(jnp.asarray(algo.granularity_weights), reward_weights)
        advantages = adv_lib.integrate_advantages(scales, weights, clip=algo.advantage_clip,
                                                  scale_by_std=algo.advantage_std)
        finest = int(np.argmin(algo.granularities))
        stats = {"rewards": rewards,
                 "reward_mean": jnp.mean(rewards[:, finest], axis=(0, 2, 3)),
                 "reward_std": jnp.mean(jnp.std(rewards[:, finest], axis=-1, ddof=1),
                                        axis=(0, 2))}
        return transitions.batch.replace(advantages=advantages), stats

    def trajectory_sample(params, cond, key, iteration):
        sig = jnp.asarray(sigmas_np)
        velocity = velocity_fn(params, cond)
        p = cond["y"].shape[0]
        noise_key, sde_key, pick_key = jax.random.split(key, 3)
        if algo.shared_initial_noise:
            x_init = jnp.broadcast_to(
                jax.random.normal(noise_key, (p, 1, *latent_shape), jnp.float32),
                (p, g, *latent_shape))
        else:
            x_init = jax.random.normal(noise_key, (p, g, *latent_shape), jnp.float32)
        mask = algo.sde_mask(iteration, num_steps)
        xs, log_probs = rollout.sde_trajectory(velocity, x_init, sig, mask, algo.eta, sde_key,
                                               algo.sde_step, algo.log_prob_reduce)
        trained = algo.trained_steps(pick_key, iteration, num_steps)
        transitions = SampledTransitions(
            batch=TrainBatch(x=xs[trained], x_next=xs[trained + 1], step=trained,
                             old_log_prob=log_probs[trained],
                             advantages=jnp.zeros((trained.shape[0], p, g), jnp.float32)),
            sde_mask=mask)
        return xs[-1], transitions

    def trajectory_finish(scores, transitions):
        batch = transitions.batch
        rewards = scores                                            # [R, P, G]
        advantages = adv_lib.integrate_advantages(rewards, reward_weights,
                                                  clip=algo.advantage_clip,
                                                  scale_by_std=algo.advantage_std)   # [P, G]
        stats = {"rewards": rewards, "reward_mean": jnp.mean(rewards, axis=(1, 2)),
                 "reward_std": jnp.mean(jnp.std(rewards, axis=-1, ddof=1), axis=1),
                 "sde_mask": transitions.sde_mask}
        return batch.replace(advantages=jnp.broadcast_to(advantages, batch.advantages.shape)), \
            stats

    if algo.rollout == "singular":
        return singular_sample, singular_finish
    return trajectory_sample, trajectory_finish


def make_rollout_fn(graphdef, algo: Algorithm, sigmas, latent_shape: tuple[int, int],
                    reward_fn: RewardFn, reward_weights, guidance: float | None,
                    quantize_timesteps: bool = False) -> Callable:
    """`rollout_fn(params, cond, key, iteration) -> (TrainBatch, stats)`: the two stages of
    `make_rollout_stages` joined by a traceable `reward_fn` (see the module docstring), so the
    whole iteration can be one jit."""
    sample, finish = make_rollout_stages(graphdef, algo, sigmas, latent_shape, reward_weights,
                                         guidance, quantize_timesteps)

    def rollout_fn(params, cond, key, iteration):
        finals, transitions = sample(params, cond, key, iteration)
        return finish(reward_fn(finals, cond), transitions)

    return rollout_fn
