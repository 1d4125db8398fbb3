"""The policy update: re-score stored transitions under the current parameters, clipped GRPO
loss, Optax AdamW. One `jax.jit` with explicit in/out shardings that donates the state.

Data (prompt-major, P sharded over the mesh's batch axes; K trained steps per iteration):
  TrainBatch.x            [K, P, Gx, N, C]  the state the transition starts from (Gx = 1 when
                                             the group shares it: G²RPO's anchor x_k)
  TrainBatch.x_next       [K, P, G, N, C]   the sampled next state
  TrainBatch.step         [K]               the step index into sigmas
  TrainBatch.old_log_prob [K, P, G]         log π_old(x_next | x) from the rollout
  TrainBatch.advantages   [K, P, G]

`steps_per_update` groups the K steps: 1 = one optimizer step per k (the reference code; later
k are slightly off-policy), K (or 0) = one accumulated step over all k (on-policy). Within a group,
gradients are averaged over steps and over prompt micro-batches.
"""

from collections.abc import Callable
import dataclasses
import functools
from typing import Any

from flax import nnx, struct
import jax
import jax.numpy as jnp
import optax

from g2rpo_jax import parallel
from g2rpo_jax.rl import loss as loss_lib
from g2rpo_jax.rl.algorithms import Algorithm
from g2rpo_jax.sampling import rollout


@struct.dataclass
class TrainBatch:
    x: jax.Array
    x_next: jax.Array
    step: jax.Array
    old_log_prob: jax.Array
    advantages: jax.Array


@struct.dataclass
class TrainState:
    params: Any             # nnx.State of the policy (float32 master weights)
    opt_state: Any
    ref_params: Any         # frozen initial policy for the KL term, or None
    step: jax.Array         # optimizer steps taken


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """Static settings of the update (hashable; part of the compiled function's identity)."""

    steps_per_update: int = 1        # trained steps per optimizer step (1 = per k, 0 = all)
    micro_batch_prompts: int = 0     # prompts per gradient micro-batch; 0 = all
    recompute_old_log_prob: bool = False
    guidance: float | None = 3.5
    quantize_timesteps: bool = False


def settings_from_config(config) -> UpdateSettings:
    """UpdateSettings from a full config (its `update_step` and `sampling` sections)."""
    return UpdateSettings(
        steps_per_update=config.update_step.steps_per_update,
        micro_batch_prompts=config.update_step.micro_batch_prompts,
        recompute_old_log_prob=config.update_step.recompute_old_log_prob,
        guidance=config.sampling.guidance, quantize_timesteps=config.sampling.quantize_timesteps)


def make_optimizer(config) -> optax.GradientTransformation:
    """AdamW with global-norm clipping and a schedule, from a config's `optimizer` section."""
    schedules = {
        "constant": lambda: optax.constant_schedule(config.learning_rate),
        "warmup_constant": lambda: optax.join_schedules(
            [optax.linear_schedule(0.0, config.learning_rate, config.warmup_steps),
             optax.constant_schedule(config.learning_rate)], [config.warmup_steps]),
        "warmup_cosine": lambda: optax.warmup_cosine_decay_schedule(
            0.0, config.learning_rate, config.warmup_steps, config.decay_steps),
    }
    if config.schedule == "warmup_cosine" and config.decay_steps <= config.warmup_steps:
        raise ValueError(f"optimizer.decay_steps ({config.decay_steps}, the schedule's total "
                         f"length) must exceed optimizer.warmup_steps ({config.warmup_steps}).")
    if config.schedule not in schedules:
        raise ValueError(f"Unknown learning-rate schedule {config.schedule!r}; use one of "
                         f"{sorted(schedules)}.")
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip_norm),
        optax.adamw(schedules[config.schedule](), b1=config.b1, b2=config.b2, eps=config.eps,
                    weight_decay=config.weight_decay))


def abstract_state(params, optimizer: optax.GradientTransformation, keep_reference: bool,
                   mesh: jax.sharding.Mesh) -> TrainState:
    """The TrainState's shapes, dtypes and shardings (`jax.ShapeDtypeStruct` leaves), nothing
    allocated: the layout `init_state` creates, and the target a checkpoint is restored into.
    The moments are laid out like the parameters explicitly: left to jit they come back on one
    device and are then replicated (89 GiB per chip for FLUX.1-dev; benchmarks/tpu_aot.py)."""
    param_shardings = jax.tree.map(lambda a: a.sharding, params)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_shardings = parallel.optimizer_state_shardings(optimizer, opt_shapes, param_shardings,
                                                       mesh)
    as_struct = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    abstract_params = jax.tree.map(as_struct, params, param_shardings)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    return TrainState(params=abstract_params,
                      opt_state=jax.tree.map(as_struct, opt_shapes, opt_shardings),
                      ref_params=abstract_params if keep_reference else None,
                      step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))


def init_state(params, optimizer: optax.GradientTransformation, keep_reference: bool,
               mesh: jax.sharding.Mesh) -> TrainState:
    """A fresh train state next to the (already sharded) parameters, laid out as
    `abstract_state`; scalars replicated."""
    shardings = jax.tree.map(lambda a: a.sharding,
                             abstract_state(params, optimizer, keep_reference, mesh).opt_state)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings)(params)
    ref = jax.tree.map(jnp.copy, params) if keep_reference else None
    state = TrainState(params=params, opt_state=opt_state, ref_params=ref,
                       step=jnp.zeros((), jnp.int32))
    return parallel.replicate_unplaced(state, mesh)


def _micro_batch_cond(cond: dict, count: int) -> dict:
    """Splits the per-prompt conditioning into micro-batches; shared entries are repeated."""
    out = dict(_micro_batches({k: cond[k] for k in rollout.PER_PROMPT_COND}, count))
    for key, value in cond.items():
        if key not in rollout.PER_PROMPT_COND:
            out[key] = jnp.broadcast_to(value, (count, *value.shape))
    return out


def _micro_batches(tree, count: int):
    """[P, ...] → [count, P/count, ...], micro-batch j = prompts j, j+count, ... so each stays
    spread over every device that holds prompts."""
    def split(a):
        p = a.shape[0]
        return jnp.swapaxes(a.reshape(p // count, count, *a.shape[1:]), 0, 1)
    return jax.tree.map(split, tree)


def make_update_fn(graphdef, optimizer: optax.GradientTransformation, algo: Algorithm,
                   settings: UpdateSettings, sigmas: jax.Array) -> Callable:
    """Builds `update(state, batch, cond) -> (state, metrics)` (not yet jitted; see `jit_update`).

    Metrics are stacked [U, S, M] (updates, steps per update, micro-batches) per scalar, plus
    grad_norm [U] and skipped [U] (the optimizer steps not applied because their loss or
    gradient was not finite); `summarize` reduces them.
    """
    step_log_prob = functools.partial(rollout.step_log_prob, sde_step=algo.sde_step,
                                      reduce=algo.log_prob_reduce)

    def velocity_of(params, cond):
        return rollout.make_velocity_fn(nnx.merge(graphdef, params), cond, settings.guidance,
                                        settings.quantize_timesteps)

    def log_prob(params, item, cond):
        v = velocity_of(params, cond)(item.x, sigmas[item.step])
        return step_log_prob(v, item.x, item.x_next, sigmas, item.step, algo.eta)

    def loss_fn(params, item, cond, ref_params):
        lp, mean, std = log_prob(params, item, cond)
        kl = None
        if algo.kl_beta > 0:
            _, ref_mean, _ = log_prob(jax.lax.stop_gradient(ref_params), item, cond)
            p, g = item.x_next.shape[:2]
            kl = loss_lib.gaussian_kl(mean.reshape(p * g, *mean.shape[2:]),
                                      ref_mean.reshape(p * g, *mean.shape[2:]), std,
                                      reduce=algo.log_prob_reduce).reshape(p, g)
        loss, metrics = loss_lib.grpo_loss(lp, item.old_log_prob, item.advantages,
                                           algo.clip_range, kl=kl, kl_beta=algo.kl_beta)
        return loss, dict(metrics, loss=loss)

    def update(state: TrainState, batch: TrainBatch, cond: dict):
        num_k = batch.step.shape[0]
        per = settings.steps_per_update or num_k
        if num_k % per:
            raise ValueError(f"steps_per_update={per} must divide the {num_k} trained steps.")
        num_prompts = batch.x.shape[1]
        micro = settings.micro_batch_prompts or num_prompts
        if num_prompts % micro:
            raise ValueError(f"micro_batch_prompts={micro} must divide the {num_prompts} prompts "
                             "of a batch.")
        count = num_prompts // micro

        if settings.recompute_old_log_prob:
            # Score the stored transitions with the same layout the loss uses, so the first
            # ratio is 1 by construction whatever the rollout's batch shape or precision.
            def rescore(item):
                items = _micro_batches(item.replace(step=None), count)
                conds = _micro_batch_cond(cond, count)
                lps = jax.lax.map(lambda ic: log_prob(state.params, ic[0].replace(step=item.step),
                                                      ic[1])[0], (items, conds))
                return jnp.swapaxes(lps, 0, 1).reshape(num_prompts, -1)
            recomputed = jax.lax.map(rescore, batch)
            rollout_gap = jnp.max(jnp.abs(recomputed - batch.old_log_prob))
            batch = batch.replace(old_log_prob=recomputed)
        else:
            rollout_gap = jnp.zeros(())

        # [K, ...] → [U, S, ...]
        grouped = jax.tree.map(lambda a: a.reshape(num_k // per, per, *a.shape[1:]), batch)
        cond_micro = _micro_batch_cond(cond, count)

        def one_update(state, group):
            def one_step(grads, item):
                items = _micro_batches(item.replace(step=None), count)

                def one_micro(grads, inputs):
                    micro_item, micro_cond = inputs
                    micro_item = micro_item.replace(step=item.step)
                    (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(
                        state.params, micro_item, micro_cond, state.ref_params)
                    return jax.tree.map(jnp.add, grads, g), metrics

                return jax.lax.scan(one_micro, grads, (items, cond_micro))

            zeros = jax.tree.map(jnp.zeros_like, state.params)
            grads, metrics = jax.lax.scan(one_step, zeros, group)
            grads = jax.tree.map(lambda g: g / (per * count), grads)
            updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
            # A step whose loss or gradient is not finite (a NaN reward, an overflow) is not
            # applied: parameters, moments and counters stay as they were.
            grad_norm = optax.tree.norm(grads)
            finite = jnp.isfinite(grad_norm) & jnp.all(jnp.isfinite(metrics["loss"]))
            new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state,
                                     state)
            return new_state, (metrics, grad_norm, ~finite)

        state, (metrics, grad_norms, skipped) = jax.lax.scan(one_update, state, grouped)
        metrics = dict(metrics, grad_norm=grad_norms, skipped=skipped,
                       rollout_log_prob_gap=rollout_gap)
        return state, metrics

    return update


def jit_update(update_fn: Callable, state: TrainState, batch: TrainBatch, cond: dict):
    """jit with in/out shardings taken from the (already placed) arguments; donates the state."""
    shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
    return jax.jit(update_fn, in_shardings=(shardings(state), shardings(batch), shardings(cond)),
                   out_shardings=(shardings(state), None), donate_argnums=(0,))


def summarize(metrics: dict) -> dict[str, float]:
    """Scalar summary of stacked update metrics; `first_update_*` are the on-policy checks."""
    out = {}
    for name in ("loss", "policy_loss", "kl_mean", "clip_fraction", "approx_kl", "ratio_mean"):
        if name in metrics:
            out[name] = float(jnp.mean(metrics[name]))
    out["ratio_min"] = float(jnp.min(metrics["ratio_min"]))
    out["ratio_max"] = float(jnp.max(metrics["ratio_max"]))
    out["grad_norm"] = float(jnp.mean(metrics["grad_norm"]))
    out["skipped_steps"] = float(jnp.sum(metrics["skipped"]))
    out["first_update_log_ratio_abs_max"] = float(jnp.max(metrics["log_ratio_abs_max"][0]))
    out["rollout_log_prob_gap"] = float(metrics["rollout_log_prob_gap"])
    return out
