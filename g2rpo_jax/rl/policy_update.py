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
gradients are averaged over steps and over prompt micro-batches. `batch_steps` evaluates a
group's S steps of a micro-batch in one forward and backward of S·P·Gx samples instead of a scan
over S forwards of P·Gx: the same loss, summed in another order (larger matmuls; S times the
activations).

The update is a composition of pure functions, each usable alone:
  transition_log_prob   log π_θ of one step's transitions           [P, G]
  micro_batch_loss      the clipped loss (+ KL) of one micro-batch   scalar, metrics
  step_gradient         Σ of one trained step's micro-batch gradients
  group_gradient        Σ over an optimizer step's group of steps (a scan over steps, or with
                        `batch_steps` one batched call per micro-batch: `steps_log_prob`,
                        `steps_loss`)
  optimizer_step        one optimizer step on a group (skipped if not finite)
  rescored_log_probs    the stored transitions re-scored in the loss's layout   [K, P, G]
`make_update_fn` binds the model and settings and scans `optimizer_step` over the groups.
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

# loss_fn(params, item, cond, ref_params) -> (loss, metrics): `micro_batch_loss` with the model
# and settings bound.
LossFn = Callable[[Any, "TrainBatch", dict, Any], tuple[jax.Array, dict]]
# log_prob_fn(params, item, cond) -> (log_prob [P, G], mean [P, G, N, C], std []):
# `transition_log_prob` with the model and settings bound; with `batch_steps`, `steps_log_prob`
# bound: item [S, P, ...] → ([S, P, G], [S, P, G, N, C], [S]).
LogProbFn = Callable[[Any, "TrainBatch", dict], tuple[jax.Array, jax.Array, jax.Array]]


@struct.dataclass
class TrainBatch:
    """The K trained transitions of one iteration (shapes in the module docstring)."""

    x: jax.Array
    x_next: jax.Array
    step: jax.Array
    old_log_prob: jax.Array
    advantages: jax.Array


@struct.dataclass
class TrainState:
    params: Any             # nnx.State of the trained parameters (float32 master weights): the
                            # whole policy, or with LoRA its adapters only (nnx.LoRAParam)
    opt_state: Any
    ref_params: Any         # frozen initial policy for the KL term, or None (with LoRA: None,
                            # the reference is `frozen` with the adapters off)
    step: jax.Array         # optimizer steps taken
    frozen: Any = None      # LoRA: the frozen base (every other Variable of the policy); None
                            # without LoRA. Not trained, not in the optimizer state.

    def policy_params(self):
        """The policy's whole state (what `nnx.merge(graphdef, ...)` takes)."""
        return self.params if self.frozen is None else nnx.merge_state(self.frozen, self.params)


@dataclasses.dataclass(frozen=True)
class PolicyUpdate:
    """Static settings of the policy update (hashable; part of the compiled function's
    identity): a config's `policy_update` section and the model-call settings of `sampling`."""

    steps_per_update: int = 1        # trained steps per optimizer step (1 = per k, 0 = all)
    micro_batch_prompts: int = 0     # prompts per gradient micro-batch; 0 = all
    recompute_old_log_prob: bool = False
    # Host offload: the AdamW moments and the KL reference live in pinned host memory between
    # updates (the rollout does not need them), and the update moves them in and out.
    offload_optimizer_state: bool = False
    offload_reference: bool = False
    batch_steps: bool = False        # a group's steps in one batched forward and backward
    guidance: float | None = 3.5
    quantize_timesteps: bool = False

    @classmethod
    def from_config(cls, config) -> "PolicyUpdate":
        """From a full config (its `policy_update` and `sampling` sections)."""
        return cls(
            steps_per_update=config.policy_update.steps_per_update,
            micro_batch_prompts=config.policy_update.micro_batch_prompts,
            recompute_old_log_prob=config.policy_update.recompute_old_log_prob,
            offload_optimizer_state=config.policy_update.offload_optimizer_state,
            offload_reference=config.policy_update.offload_reference,
            batch_steps=config.policy_update.get("batch_steps", False),
            guidance=config.sampling.guidance,
            quantize_timesteps=config.sampling.quantize_timesteps)


def abstract_state(params, optimizer: optax.GradientTransformation, keep_reference: bool,
                   mesh: jax.sharding.Mesh, settings: PolicyUpdate = PolicyUpdate()) -> TrainState:
    """The TrainState's shapes, dtypes and shardings (`jax.ShapeDtypeStruct` leaves), nothing
    allocated: the layout `init_state` creates, and the target a checkpoint is restored into.
    The moments are laid out like the parameters explicitly: left to jit they come back on one
    device and are then replicated (89 GiB per chip for FLUX.1-dev; benchmarks/perf/tpu_aot.py).
    `settings.offload_*` put the moments / the KL reference in pinned host memory."""
    param_shardings = jax.tree.map(lambda a: a.sharding, params)
    opt_shapes = jax.eval_shape(optimizer.init, params)
    opt_shardings = parallel.optimizer_state_shardings(optimizer, opt_shapes, param_shardings,
                                                       mesh)
    as_struct = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
    abstract_params = jax.tree.map(as_struct, params, param_shardings)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    opt_state = jax.tree.map(as_struct, opt_shapes, opt_shardings)
    reference = abstract_params if keep_reference else None
    return TrainState(
        params=abstract_params,
        opt_state=(parallel.in_host_memory(opt_state) if settings.offload_optimizer_state
                   else opt_state),
        ref_params=parallel.in_host_memory(reference) if settings.offload_reference else reference,
        step=jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated))


def init_state(params, optimizer: optax.GradientTransformation, keep_reference: bool,
               mesh: jax.sharding.Mesh, settings: PolicyUpdate = PolicyUpdate(),
               frozen=None) -> TrainState:
    """A fresh train state next to the (already sharded) parameters, laid out as
    `abstract_state` (host-offloaded parts in pinned host memory); scalars replicated.
    LoRA: `params` are the adapters (`nnx.split(model, nnx.LoRAParam, ...)`), `frozen` the
    rest, and keep_reference False (the KL reference is the base, adapters off)."""
    layout = jax.tree.map(lambda a: a.sharding,
                          abstract_state(params, optimizer, keep_reference, mesh, settings))
    opt_state = jax.jit(optimizer.init, out_shardings=layout.opt_state)(params)
    ref = parallel.placed_copy(params, layout.ref_params) if keep_reference else None
    state = TrainState(params=params, opt_state=opt_state, ref_params=ref,
                       step=jnp.zeros((), jnp.int32), frozen=frozen)
    return parallel.replicate_unplaced(state, mesh)


def micro_batches(tree, count: int):
    """[P, ...] → [count, P/count, ...], micro-batch j = prompts j, j+count, ... so each stays
    spread over every device that holds prompts."""
    def split(a):
        p = a.shape[0]
        return jnp.swapaxes(a.reshape(p // count, count, *a.shape[1:]), 0, 1)
    return jax.tree.map(split, tree)


def step_micro_batches(group: "TrainBatch", count: int) -> "TrainBatch":
    """S steps' [S, P, ...] arrays → [count, S, P/count, ...] (`micro_batches` on the prompt
    axis: micro-batch j keeps prompts j, j+count, ... of every step); `step` is dropped (None)."""
    prompt_major = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), group.replace(step=None))
    return jax.tree.map(lambda a: jnp.swapaxes(a, 1, 2), micro_batches(prompt_major, count))


def micro_batch_cond(cond: dict, count: int) -> dict:
    """Splits the per-prompt conditioning into `count` micro-batches (`micro_batches`); shared
    entries are repeated, [count, ...]."""
    out = dict(micro_batches({k: cond[k] for k in parallel.PER_PROMPT_COND}, count))
    for key, value in cond.items():
        if key not in parallel.PER_PROMPT_COND:
            out[key] = jnp.broadcast_to(value, (count, *value.shape))
    return out


def group_sizes(num_steps: int, num_prompts: int, settings: PolicyUpdate) -> tuple[int, int]:
    """(trained steps per optimizer step, micro-batches per step) for a batch of `num_steps`
    trained steps and `num_prompts` prompts; raises if the settings do not divide them."""
    per = settings.steps_per_update or num_steps
    if num_steps % per:
        raise ValueError(f"steps_per_update={per} must divide the {num_steps} trained steps.")
    micro = settings.micro_batch_prompts or num_prompts
    if num_prompts % micro:
        raise ValueError(f"micro_batch_prompts={micro} must divide the {num_prompts} prompts "
                         "of a batch.")
    return per, num_prompts // micro


def transition_log_prob(params, item: TrainBatch, cond: dict, *, graphdef, algo: Algorithm,
                        settings: PolicyUpdate, sigmas: jax.Array):
    """log π_θ of one trained step's transitions under `params`.

    Args:
      params: the policy's nnx.State.
      item: one step of a TrainBatch: x [P, Gx, N, C], x_next [P, G, N, C], step [].
      cond: the conditioning of the P prompts.
      graphdef, algo, settings, sigmas: the policy's graphdef, the algorithm (its SDE step, η
        and log-prob reduction), the update's settings, the [T+1] schedule.

    Returns:
      (log_prob [P, G], mean [P, G, N, C], std []) of the step's Gaussian.
    """
    velocity = rollout.make_velocity_fn(nnx.merge(graphdef, params), cond, settings.guidance,
                                        settings.quantize_timesteps)
    v = velocity(item.x, sigmas[item.step])
    return rollout.step_log_prob(v, item.x, item.x_next, sigmas, item.step, algo.eta,
                                 sde_step=algo.sde_step, reduce=algo.log_prob_reduce)


def micro_batch_loss(params, item: TrainBatch, cond: dict, ref_params, *,
                     log_prob_fn: LogProbFn, algo: Algorithm) -> tuple[jax.Array, dict]:
    """The clipped GRPO loss of one micro-batch of one trained step, plus β·KL to `ref_params`
    when the algorithm has a KL term.

    Args:
      params: the policy's parameters (differentiated).
      item: one step's micro-batch of a TrainBatch (x_next [P, G, N, C], old_log_prob and
        advantages [P, G]).
      cond: the micro-batch's conditioning.
      ref_params: the frozen reference policy (used only when algo.kl_beta > 0).
      log_prob_fn: `transition_log_prob` with the model and settings bound.
      algo: the algorithm (clip range, KL weight, log-prob reduction).

    Returns:
      (loss, metrics): the scalar loss and `loss_lib.grpo_loss`'s metrics plus `loss` and
      `log_ratio` [P, G] (log π/π_old of each sample).
    """
    lp, mean, std = log_prob_fn(params, item, cond)
    ref_mean = None
    if algo.kl_beta > 0:
        _, ref_mean, _ = log_prob_fn(jax.lax.stop_gradient(ref_params), item, cond)
    return _loss_of_log_probs(lp, mean, std, ref_mean, item, algo)


def _loss_of_log_probs(lp, mean, std, ref_mean, item: TrainBatch, algo: Algorithm):
    """`micro_batch_loss` from one step's log-probs [P, G], means [P, G, N, C] and std [] (and
    the reference's means when the algorithm has a KL term)."""
    kl = None
    if ref_mean is not None:
        p, g = item.x_next.shape[:2]
        kl = loss_lib.gaussian_kl(mean.reshape(p * g, *mean.shape[2:]),
                                  ref_mean.reshape(p * g, *mean.shape[2:]), std,
                                  reduce=algo.log_prob_reduce).reshape(p, g)
    loss, metrics = loss_lib.grpo_loss(lp, item.old_log_prob, item.advantages,
                                       algo.clip_range, kl=kl, kl_beta=algo.kl_beta)
    # Per sample [P, G], for the run's histograms (train.py).
    log_ratio = jax.lax.stop_gradient(lp - item.old_log_prob)
    return loss, dict(metrics, loss=loss, log_ratio=log_ratio)


def steps_log_prob(params, group: TrainBatch, cond: dict, *, graphdef, algo: Algorithm,
                   settings: PolicyUpdate, sigmas: jax.Array):
    """`transition_log_prob` of S trained steps at once: one model call on S·P·Gx samples.

    Args:
      group: S steps of a TrainBatch: x [S, P, Gx, N, C], x_next [S, P, G, N, C], step [S].
      (the rest as `transition_log_prob`)

    Returns:
      (log_prob [S, P, G], mean [S, P, G, N, C], std [S]).
    """
    s, p, gx = group.x.shape[:3]
    velocity = rollout.make_velocity_fn(nnx.merge(graphdef, params), cond, settings.guidance,
                                        settings.quantize_timesteps)
    # Prompt-major [P, S·Gx, ...], so that each prompt's conditioning serves its S·Gx samples;
    # column j of a prompt is step j // Gx.
    x = jnp.swapaxes(group.x, 0, 1).reshape(p, s * gx, *group.x.shape[3:])
    v = velocity(x, jnp.repeat(sigmas[group.step], gx))
    v = jnp.swapaxes(v.reshape(p, s, gx, *v.shape[2:]), 0, 1)            # [S, P, Gx, N, C]
    return jax.vmap(lambda v_k, x_k, next_k, step_k: rollout.step_log_prob(
        v_k, x_k, next_k, sigmas, step_k, algo.eta, sde_step=algo.sde_step,
        reduce=algo.log_prob_reduce))(v, group.x, group.x_next, group.step)


def steps_loss(params, group: TrainBatch, cond: dict, ref_params, *, log_prob_fn: LogProbFn,
               algo: Algorithm) -> tuple[jax.Array, dict]:
    """The sum over S steps of `micro_batch_loss`, from one batched `steps_log_prob` call
    (`log_prob_fn`). Returns (loss, metrics with a leading [S] axis)."""
    lp, mean, std = log_prob_fn(params, group, cond)
    ref_mean = None
    if algo.kl_beta > 0:
        _, ref_mean, _ = log_prob_fn(jax.lax.stop_gradient(ref_params), group, cond)
    per_step = lambda lp_k, mean_k, std_k, ref_k, item_k: _loss_of_log_probs(
        lp_k, mean_k, std_k, ref_k, item_k, algo)
    losses, metrics = jax.vmap(per_step)(lp, mean, std, ref_mean, group)
    return jnp.sum(losses), metrics


def steps_gradient(loss_fn: LossFn, params, ref_params, group: TrainBatch, cond_micro: dict,
                   count: int):
    """`group_gradient` with `batch_steps`: per prompt micro-batch, one batched forward and
    backward over the group's S steps (`loss_fn` is `steps_loss` bound). Returns (gradient,
    metrics [S, M])."""
    micro = step_micro_batches(group, count)

    def add_micro_batch(total, inputs):
        micro_group, micro_cond = inputs
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, micro_group.replace(step=group.step), micro_cond, ref_params)
        return jax.tree.map(jnp.add, total, grads), metrics

    zeros = jax.tree.map(jnp.zeros_like, params)
    grads, metrics = jax.lax.scan(add_micro_batch, zeros, (micro, cond_micro))
    return grads, jax.tree.map(lambda m: jnp.swapaxes(m, 0, 1), metrics)   # [M, S] → [S, M]


def step_gradient(loss_fn: LossFn, params, ref_params, item: TrainBatch, cond_micro: dict,
                  count: int, total):
    """Adds the gradients of one trained step's `count` prompt micro-batches, in order, to
    `total` (a tree like `params`).

    `item` is one step of a TrainBatch ([P, ...] arrays, scalar step); `cond_micro` is
    `micro_batch_cond(cond, count)`. Returns (total, metrics with a leading [M = count] axis).
    """
    items = micro_batches(item.replace(step=None), count)

    def add_micro_batch(total, inputs):
        micro_item, micro_cond = inputs
        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, micro_item.replace(step=item.step), micro_cond, ref_params)
        return jax.tree.map(jnp.add, total, grads), metrics

    return jax.lax.scan(add_micro_batch, total, (items, cond_micro))


def group_gradient(loss_fn: LossFn, params, ref_params, group: TrainBatch, cond_micro: dict,
                   count: int):
    """The summed (not yet averaged) gradient over an optimizer step's group: S trained steps
    (`group`'s leading axis) × `count` micro-batches each. Returns (gradient, metrics [S, M])."""
    zeros = jax.tree.map(jnp.zeros_like, params)
    return jax.lax.scan(
        lambda total, item: step_gradient(loss_fn, params, ref_params, item, cond_micro, count,
                                          total),
        zeros, group)


def optimizer_step(state: TrainState, group: TrainBatch, *, loss_fn: LossFn,
                   optimizer: optax.GradientTransformation, cond_micro: dict, count: int,
                   gradient_fn: Callable = group_gradient):
    """One optimizer step on the gradient averaged over a group's S steps and micro-batches
    (`gradient_fn`: `group_gradient`, or `steps_gradient` with a `steps_loss` loss_fn).

    A step whose loss or gradient is not finite (a NaN reward, an overflow) is not applied:
    parameters, moments and counters stay as they were.

    Returns:
      (state, (metrics [S, M], grad_norm [], skipped [] bool)).
    """
    per = group.step.shape[0]
    grads, metrics = gradient_fn(loss_fn, state.params, state.ref_params, group, cond_micro,
                                 count)
    grads = jax.tree.map(lambda g: g / (per * count), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    new_state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(grad_norm) & jnp.all(jnp.isfinite(metrics["loss"]))
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old), new_state, state)
    return new_state, (metrics, grad_norm, ~finite)


def rescored_log_probs(log_prob_fn: LogProbFn, params, batch: TrainBatch, cond: dict,
                       count: int, steps_per_call: int = 0) -> jax.Array:
    """log π_θ [K, P, G] of the batch's stored transitions under `params`, computed in the
    `count` prompt micro-batches the loss uses, so that the loss's first ratio is 1 by
    construction whatever the rollout's batch shape or precision. `steps_per_call` > 0: the
    `batch_steps` layout (`log_prob_fn` is `steps_log_prob` bound, called on groups of that
    many steps)."""
    num_prompts = batch.x.shape[1]
    if steps_per_call:
        num_k = batch.step.shape[0]
        groups = jax.tree.map(lambda a: a.reshape(num_k // steps_per_call, steps_per_call,
                                                  *a.shape[1:]), batch)
        conds = micro_batch_cond(cond, count)

        def rescore_group(group):   # [S, P, ...] → [S, P, G]
            micro = step_micro_batches(group, count)                      # [M, S, P/M, ...]
            lps = jax.lax.map(lambda ic: log_prob_fn(params, ic[0].replace(step=group.step),
                                                     ic[1])[0], (micro, conds))  # [M, S, P/M, G]
            return jnp.swapaxes(lps, 0, 1).swapaxes(1, 2).reshape(steps_per_call, num_prompts,
                                                                 -1)

        return jax.lax.map(rescore_group, groups).reshape(num_k, num_prompts, -1)

    def rescore_step(item):
        items = micro_batches(item.replace(step=None), count)
        conds = micro_batch_cond(cond, count)
        lps = jax.lax.map(lambda ic: log_prob_fn(params, ic[0].replace(step=item.step),
                                                 ic[1])[0], (items, conds))
        return jnp.swapaxes(lps, 0, 1).reshape(num_prompts, -1)

    return jax.lax.map(rescore_step, batch)


def make_update_fn(graphdef, optimizer: optax.GradientTransformation, algo: Algorithm,
                   settings: PolicyUpdate, sigmas: jax.Array) -> Callable:
    """Builds `update(state, batch, cond) -> (state, metrics)` (not yet jitted; see `jit_update`).

    Metrics are stacked [U, S, M] (updates, steps per update, micro-batches) per scalar, plus
    grad_norm [U] and skipped [U] (the optimizer steps not applied because their loss or
    gradient was not finite); `summarize` reduces them.
    """
    bound = dict(graphdef=graphdef, algo=algo, settings=settings, sigmas=sigmas)
    if settings.batch_steps:
        log_prob_fn = functools.partial(steps_log_prob, **bound)
        loss_fn = functools.partial(steps_loss, log_prob_fn=log_prob_fn, algo=algo)
        gradient_fn = steps_gradient
    else:
        log_prob_fn = functools.partial(transition_log_prob, **bound)
        loss_fn = functools.partial(micro_batch_loss, log_prob_fn=log_prob_fn, algo=algo)
        gradient_fn = group_gradient

    def update(state: TrainState, batch: TrainBatch, cond: dict):
        loss, log_prob = loss_fn, log_prob_fn
        if state.frozen is not None:
            # LoRA: differentiate the adapters only; the frozen base rides along, and the KL
            # reference is the base with the adapters off (zero, so exactly the base).
            full = functools.partial(nnx.merge_state, state.frozen)
            loss = lambda p, item, c, ref: loss_fn(full(p), item, c, jax.lax.stop_gradient(
                full(jax.tree.map(jnp.zeros_like, p))))
            log_prob = lambda p, item, c: log_prob_fn(full(p), item, c)
        host_reference = state.ref_params
        if settings.offload_optimizer_state:
            state = state.replace(opt_state=parallel.move_to_memory(state.opt_state, "device"))
        if settings.offload_reference:
            state = state.replace(ref_params=parallel.move_to_memory(state.ref_params,
                                                                     "device"))
        num_k = batch.step.shape[0]
        per, count = group_sizes(num_k, batch.x.shape[1], settings)
        if settings.recompute_old_log_prob:
            recomputed = rescored_log_probs(log_prob, state.params, batch, cond, count,
                                            per if settings.batch_steps else 0)
            rollout_gap = jnp.max(jnp.abs(recomputed - batch.old_log_prob))
            batch = batch.replace(old_log_prob=recomputed)
        else:
            rollout_gap = jnp.zeros(())
        grouped = jax.tree.map(lambda a: a.reshape(num_k // per, per, *a.shape[1:]), batch)
        step = functools.partial(optimizer_step, loss_fn=loss, optimizer=optimizer,
                                 cond_micro=micro_batch_cond(cond, count), count=count,
                                 gradient_fn=gradient_fn)
        state, (metrics, grad_norms, skipped) = jax.lax.scan(step, state, grouped)
        if settings.offload_optimizer_state:
            state = state.replace(opt_state=parallel.move_to_memory(state.opt_state,
                                                                    "pinned_host"))
        if settings.offload_reference:
            state = state.replace(ref_params=host_reference)   # unchanged, never copied back
        return state, dict(metrics, grad_norm=grad_norms, skipped=skipped,
                           rollout_log_prob_gap=rollout_gap)

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
