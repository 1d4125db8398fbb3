"""Grouped rollouts: the shared ODE anchor, singular SDE branches, multi-granularity finishes, and
full SDE trajectories for the baselines.

Layout: every array is prompt-major, `[P, M, ...]` with P prompts (sharded over the mesh's
batch axes) and M samples per prompt, so that flattening to the model's batch `[P·M, ...]`
keeps each device's prompts contiguous and never moves data between devices.

The model enters only through a velocity function `velocity(x [P, M, N, C], sigma [M] | []) ->
v [P, M, N, C]` (see `make_velocity_fn`), so this module knows nothing about FLUX.
"""

from collections.abc import Callable, Sequence
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.sampling import schedules, sde

VelocityFn = Callable[[jax.Array, jax.Array], jax.Array]

STEP_FNS = {"flow_grpo": sde.flow_grpo_step, "dance_grpo": sde.dance_grpo_step}


def step_fn(name: str):
    """The SDE step function by name: "flow_grpo" (Flow-GRPO / G²RPO) or "dance_grpo"."""
    if name not in STEP_FNS:
        raise ValueError(f"Unknown SDE step {name!r}; use one of {sorted(STEP_FNS)}.")
    return STEP_FNS[name]


def make_velocity_fn(apply_fn: Callable, cond: dict, guidance: float | None,
                     quantize_timesteps: bool = False) -> VelocityFn:
    """Binds per-prompt conditioning to a model for `[P, M, ...]`-shaped latents.

    Args:
      apply_fn: `apply_fn(img, img_ids, txt, txt_ids, timesteps, y, guidance) -> v`, the common
        model signature (e.g. a merged `flux.Flux`).
      cond: per-prompt conditioning: txt [P, T, D], y [P, Dy], txt_ids [T, 3], img_ids [N, 3].
      guidance: the guidance-embedding value (FLUX.1-dev: 3.5), or None for models without.
      quantize_timesteps: feed the model int(σ·1000)/1000, as the reference code does.

    Returns:
      velocity(x [P, M, N, C], sigma [M] or []) -> v [P, M, N, C] (float32).
    """

    def velocity(x: jax.Array, sigma: jax.Array) -> jax.Array:
        p, m = x.shape[:2]

        def per_sample(a):  # [P, ...] → [P·M, ...], each prompt's row repeated M times.
            return jnp.broadcast_to(a[:, None], (p, m, *a.shape[1:])).reshape(p * m, *a.shape[1:])

        t = jnp.broadcast_to(jnp.asarray(sigma, jnp.float32), (m,))
        t = jnp.broadcast_to(t[None], (p, m)).reshape(-1)
        if quantize_timesteps:
            t = schedules.quantize_timesteps(t)
        g = None if guidance is None else jnp.full((p * m,), guidance, jnp.float32)
        v = apply_fn(x.reshape(p * m, *x.shape[2:]), cond["img_ids"], per_sample(cond["txt"]),
                     cond["txt_ids"], t, per_sample(cond["y"]), g)
        return v.astype(jnp.float32).reshape(x.shape)

    return velocity


def ode_trajectory(velocity: VelocityFn, x_init: jax.Array,
                   sigmas: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Deterministic (Euler) trajectory keeping every state and velocity.

    Args:
      velocity: see `make_velocity_fn`.
      x_init: [P, M, N, C] noise at σ = sigmas[0].
      sigmas: [T+1] schedule.

    Returns:
      xs [T+1, P, M, N, C] (xs[i] at sigmas[i]) and vs [T, P, M, N, C] (velocity at xs[i]).
    """

    def body(x, i):
        v = velocity(x, sigmas[i])
        return sde.euler_step(x, v, sigmas[i], sigmas[i + 1]), (x, v)

    steps = jnp.arange(sigmas.shape[0] - 1)
    x_last, (xs, vs) = jax.lax.scan(body, x_init.astype(jnp.float32), steps)
    return jnp.concatenate([xs, x_last[None]], axis=0), vs


def antithetic_noise(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Standard normal noise [P, G, ...] whose group members come in ± pairs: member G/2 + i
    is −(member i). Each member is still N(0, I), so the branch's policy is unchanged; in the
    group's advantage-weighted noise Σ_i A_i ε_i the even part of the reward (in ε) cancels,
    leaving its odd (gradient) part: the variance reduction of antithetic evolution
    strategies."""
    p, g = shape[:2]
    if g % 2:
        raise ValueError(f"Antithetic branches need an even group_size, got {g}.")
    half = jax.random.normal(key, (p, g // 2, *shape[2:]), jnp.float32)
    return jnp.concatenate([half, -half], axis=1)


def singular_branches(xs: jax.Array, vs: jax.Array, sigmas: jax.Array,
                      branch_steps: Sequence[int], group_size: int, eta: float, key: jax.Array,
                      sde_step: str = "flow_grpo", reduce: str = "mean",
                      antithetic: bool = False):
    """One SDE step from the anchor's x_k for every k and group member (no model calls: the
    anchor's velocity at x_k serves the whole group).

    Args:
      xs: [T+1, P, 1, N, C] anchor states; vs: [T, P, 1, N, C] anchor velocities.
      sigmas: [T+1] schedule.
      branch_steps: the K step indices k (static).
      group_size: G.
      eta: SDE noise level.
      key: PRNG key.
      sde_step, reduce: the SDE step and its log-prob reduction.
      antithetic: draw the group's noise in ± pairs (`antithetic_noise`); G must be even.

    Returns:
      x_next [K, P, G, N, C] (at sigmas[k+1]) and old log-probs [K, P, G].
    """
    ks = np.asarray(branch_steps, np.int32)
    step = step_fn(sde_step)

    def branch(x_k, v_k, k, key):  # x_k, v_k [P, 1, N, C]
        p = x_k.shape[0]
        grouped = (p, group_size, *x_k.shape[2:])
        shape = (p * group_size, *x_k.shape[2:])
        x = jnp.broadcast_to(x_k, grouped).reshape(shape)
        v = jnp.broadcast_to(v_k, grouped).reshape(shape)
        if antithetic:
            # The step's own mean and std, then x' = μ + s·ε with paired ε, scored as given.
            _, _, mean, std = step(x, v, sigmas, k, eta, x_next=x, reduce=reduce)
            noise = antithetic_noise(key, grouped).reshape(shape)
            x_next = (mean + std * noise).astype(x.dtype)
            _, log_prob, _, _ = step(x, v, sigmas, k, eta, x_next=x_next, reduce=reduce)
        else:
            x_next, log_prob, _, _ = step(x, v, sigmas, k, eta, key=key, reduce=reduce)
        return x_next.reshape(grouped), log_prob.reshape(p, group_size)

    keys = jax.random.split(key, len(ks))
    return jax.vmap(branch)(xs[ks], vs[ks], jnp.asarray(ks), keys)


@dataclasses.dataclass(frozen=True)
class ContinuationPlan:
    """A static schedule for finishing every (branch step k, granularity λ) pair in one scan.

    Each pair ("combo") c needs `steps[c]` Euler steps over its own sub-schedule. Combos are
    packed into `num_lanes` lanes that run side by side (one model call per scan step covers all
    lanes); a lane runs its combos back to back. Tables are [length, num_lanes]; a lane with
    nothing to do takes zero-length steps (dt = 0, an identity) on combo index `num_combos`.
    """

    combo_steps: tuple[int, ...]          # k per combo
    combo_granularities: tuple[int, ...]  # λ per combo
    steps: tuple[int, ...]                # Euler steps per combo
    lane_combo: np.ndarray                # [L, W] int32
    lane_start: np.ndarray                # [L, W] bool: load the combo's branch state first
    lane_end: np.ndarray                  # [L, W] bool: the combo's last step
    lane_sigma: np.ndarray                # [L, W] float32
    lane_sigma_next: np.ndarray           # [L, W] float32

    @property
    def num_combos(self) -> int:
        return len(self.steps)

    @property
    def length(self) -> int:
        return self.lane_combo.shape[0]

    @property
    def num_lanes(self) -> int:
        return self.lane_combo.shape[1]

    @property
    def useful_steps(self) -> int:
        """Euler steps per member that the method needs (Σ over combos)."""
        return sum(self.steps)

    @property
    def computed_steps(self) -> int:
        """Model calls per member the scan actually makes (useful + idle lanes)."""
        return self.length * self.num_lanes


def _continuation_schedule(sigmas: np.ndarray, k: int, granularity: int,
                           end_at_zero: bool) -> np.ndarray:
    """σ values from the branch's end (position k+1) to the finish, for one combo.

    With end_at_zero=False (the reference code) the trajectory is not finished when the stride
    misses σ = 0: the image is the x̂0 = x - σ·v prediction of the last model call. That equals
    one Euler step from the last called σ straight to 0, i.e. the schedule with its final σ
    replaced by 0.
    """
    schedule = np.asarray(schedules.granular_sigmas(sigmas, k, granularity, end_at_zero),
                          np.float32)
    if not end_at_zero:
        schedule = schedule.copy()
        schedule[-1] = 0.0
    return schedule[k + 1:]


def _pack(steps: Sequence[int], num_lanes: int) -> list[list[int]]:
    """Longest-processing-time packing of combos into lanes."""
    lanes: list[list[int]] = [[] for _ in range(num_lanes)]
    loads = [0] * num_lanes
    for combo in sorted(range(len(steps)), key=lambda c: -steps[c]):
        lane = int(np.argmin(loads))
        lanes[lane].append(combo)
        loads[lane] += steps[combo]
    return lanes


def plan_continuations(sigmas, branch_steps: Sequence[int], granularities: Sequence[int],
                       end_at_zero: bool = True, packing: str = "pack",
                       max_lanes: int | None = None) -> ContinuationPlan:
    """Builds the static continuation plan (numpy; no tracing).

    Args:
      sigmas: [T+1] schedule (concrete).
      branch_steps: the K branch steps.
      granularities: Λ.
      end_at_zero: finish every sub-schedule at σ = 0 (default) or the reference's x̂0 decode.
      packing: "pad" (one lane per combo, all padded to the longest) or "pack" (combos packed
        back to back into fewer lanes, choosing the lane count with the fewest model calls).
      max_lanes: an upper bound on lanes (bounds the per-step batch, i.e. activation memory).
    """
    sigmas = np.asarray(sigmas, np.float32)
    combos = [(k, lam) for k in branch_steps for lam in granularities]
    subs = [_continuation_schedule(sigmas, k, lam, end_at_zero) for k, lam in combos]
    steps = [len(s) - 1 for s in subs]
    if packing == "pad":
        lanes = [[c] for c in range(len(combos))]
    elif packing == "pack":
        limit = min(len(combos), max_lanes or len(combos))
        candidates = []
        for width in range(1, limit + 1):
            packed = _pack(steps, width)
            length = max(sum(steps[c] for c in lane) for lane in packed)
            # Fewest model calls first; then the shortest scan (more parallel work per step).
            candidates.append((length * width, length, packed))
        _, _, lanes = min(candidates, key=lambda c: (c[0], c[1]))
    else:
        raise ValueError(f"Unknown packing {packing!r}; use 'pack' or 'pad'.")
    if max_lanes is not None and len(lanes) > max_lanes:
        raise ValueError(f"{len(lanes)} lanes with packing='pad' exceed max_lanes={max_lanes}; "
                         "use packing='pack'.")
    length = max(sum(steps[c] for c in lane) for lane in lanes)
    width = len(lanes)
    length = max(length, 1)  # all combos already final: one idle step keeps the scan non-empty
    lane_combo = np.full((length, width), len(combos), np.int32)
    lane_start = np.zeros((length, width), bool)
    lane_end = np.zeros((length, width), bool)
    lane_sigma = np.zeros((length, width), np.float32)
    lane_sigma_next = np.zeros((length, width), np.float32)
    for w, lane in enumerate(lanes):
        s = 0
        for c in lane:
            sub = subs[c]
            for j in range(steps[c]):
                lane_combo[s, w] = c
                lane_sigma[s, w], lane_sigma_next[s, w] = sub[j], sub[j + 1]
                lane_start[s, w] = j == 0
                lane_end[s, w] = j == steps[c] - 1
                s += 1
    return ContinuationPlan(
        combo_steps=tuple(k for k, _ in combos), combo_granularities=tuple(g for _, g in combos),
        steps=tuple(steps), lane_combo=lane_combo, lane_start=lane_start, lane_end=lane_end,
        lane_sigma=lane_sigma, lane_sigma_next=lane_sigma_next)


def continue_branches(velocity: VelocityFn, branch_x: jax.Array, plan: ContinuationPlan,
                      granularities: Sequence[int]) -> jax.Array:
    """Finishes every branch at every granularity with the ODE, in one scan.

    Args:
      velocity: see `make_velocity_fn`.
      branch_x: [K, P, G, N, C] branch states at sigmas[k+1] (from `singular_branches`).
      plan: `plan_continuations(sigmas, branch_steps, granularities, ...)`.
      granularities: Λ, in the plan's order.

    Returns:
      [K, J, P, G, N, C] final latents (σ = 0) per branch step and granularity.
    """
    num_k, p, g = branch_x.shape[:3]
    tail = branch_x.shape[3:]
    num_j = len(granularities)
    c_total = plan.num_combos
    # Combo c = k·J + j starts from the branch of k; [P, C+1, G, ...] with a dummy last row.
    starts = jnp.repeat(jnp.moveaxis(branch_x, 0, 1), num_j, axis=1)
    starts = jnp.concatenate([starts, jnp.zeros_like(starts[:, :1])], axis=1)
    lanes = plan.num_lanes

    def body(carry, table):
        x, out = carry                       # x [P, W, G, ...], out [P, C+1, G, ...]
        combo, start, end, sigma, sigma_next = table
        loaded = jnp.take(starts, combo, axis=1)
        x = jnp.where(start.reshape(1, lanes, 1, *([1] * len(tail))), loaded, x)
        sig = jnp.repeat(sigma, g)           # per sample of [W·G]
        v = velocity(x.reshape(p, lanes * g, *tail), sig).reshape(x.shape)
        dt = (sigma_next - sigma).reshape(1, lanes, 1, *([1] * len(tail)))
        x = x + v * dt
        target = jnp.where(end, combo, c_total)
        out = out.at[:, target].set(x)
        return (x, out), None

    # `out` starts as the branch states, so a combo with no steps left (a branch at the last
    # step) is already final.
    init = (jnp.zeros((p, lanes, g, *tail), jnp.float32), starts)
    tables = tuple(jnp.asarray(t) for t in (plan.lane_combo, plan.lane_start, plan.lane_end,
                                            plan.lane_sigma, plan.lane_sigma_next))
    (_, out), _ = jax.lax.scan(body, init, tables)
    out = out[:, :c_total].reshape(p, num_k, num_j, g, *tail)
    return jnp.moveaxis(out, 0, 2)            # [K, J, P, G, ...]


def sde_trajectory(velocity: VelocityFn, x_init: jax.Array, sigmas: jax.Array,
                   sde_mask: jax.Array, eta: float, key: jax.Array, sde_step: str = "flow_grpo",
                   reduce: str = "mean"):
    """Per-member trajectories with SDE steps where sde_mask is set, ODE elsewhere (baselines).

    Args:
      velocity: see `make_velocity_fn`.
      x_init: [P, G, N, C] initial noise (the same for a group when the algorithm shares it).
      sigmas: [T+1]; sde_mask: [T] bool (may be traced: a moving window does not recompile).
      eta, key, sde_step, reduce: the SDE step's settings.

    Returns:
      xs [T+1, P, G, N, C] and log-probs [T, P, G] (0 at ODE steps).
    """
    step = step_fn(sde_step)
    p, g = x_init.shape[:2]
    tail = x_init.shape[2:]

    def body(x, inputs):
        i, stochastic, key = inputs
        v = velocity(x, sigmas[i])
        flat = lambda a: a.reshape(p * g, *tail)
        x_sde, log_prob, _, _ = step(flat(x), flat(v), sigmas, i, eta, key=key, reduce=reduce)
        x_ode = sde.euler_step(x, v, sigmas[i], sigmas[i + 1])
        x_next = jnp.where(stochastic, x_sde.reshape(x.shape), x_ode)
        return x_next, (x, jnp.where(stochastic, log_prob.reshape(p, g), 0.0))

    num_steps = sigmas.shape[0] - 1
    keys = jax.random.split(key, num_steps)
    x_last, (xs, log_probs) = jax.lax.scan(
        body, x_init.astype(jnp.float32), (jnp.arange(num_steps), sde_mask, keys))
    return jnp.concatenate([xs, x_last[None]], axis=0), log_probs


def step_log_prob(v: jax.Array, x: jax.Array, x_next: jax.Array, sigmas: jax.Array,
                  step: jax.Array, eta: float, sde_step: str = "flow_grpo", reduce: str = "mean"):
    """Log-prob [P, G] of stored transitions x [P, Gx] → x_next [P, G] given v [P, Gx].

    Gx is 1 when the group shares x (G²RPO's anchor: one velocity serves the group) or G.
    Returns (log_prob [P, G], mean [P, G, ...], std []).
    """
    p, g = x_next.shape[:2]
    tail = x_next.shape[2:]
    flat = lambda a: jnp.broadcast_to(a, (p, g, *tail)).reshape(p * g, *tail)
    _, log_prob, mean, std = step_fn(sde_step)(flat(x), flat(v), sigmas, step, eta,
                                               x_next=flat(x_next), reduce=reduce)
    return log_prob.reshape(p, g), mean.reshape(p, g, *tail), std
