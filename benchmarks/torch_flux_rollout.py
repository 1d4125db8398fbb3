"""PyTorch counterparts of our G²RPO rollout and policy update, on diffusers'
`FluxTransformer2DModel`, for benchmarks/run.py and the parity test.

Same math as g2rpo_jax/sampling (Euler ODE steps, one Flow-GRPO SDE step with its mean-reduced
Gaussian log-prob at each branch step k, continuations with each granularity's schedule), with
the schedules taken from our numpy `ContinuationPlan`; the stepping is torch's own. Two rollouts:

  reference_rollout  the reference code's structure: Python loops over prompts, branch steps,
                     granularities and group members, one sample per transformer call; the
                     anchor trajectory (one per prompt) is the one call at each shared x_k that
                     serves the whole group.
  batched_rollout    our batching: the anchors of all prompts in one call per step, then the
                     plan's packed lanes, every prompt, lane and member of a scan step in one
                     call (the same calls our `continue_branches` makes).

`train_step` is the update: the clipped GRPO loss over the stored transitions' log-probs
recomputed under the current parameters (one forward at each shared x_k), backward, grad-norm
clipping and AdamW, all K trained steps in one batched forward.

Every function runs in float32; the caller sets the thread count.
"""

import math

import numpy as np
import torch

_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def diffusers_model(cfg, seed: int = 0):
    """A random diffusers FluxTransformer2DModel with the architecture of our FluxConfig."""
    import diffusers

    torch.manual_seed(seed)
    return diffusers.FluxTransformer2DModel(
        in_channels=cfg.in_channels, out_channels=cfg.out_channels, num_layers=cfg.num_layers,
        num_single_layers=cfg.num_single_layers, attention_head_dim=cfg.attention_head_dim,
        num_attention_heads=cfg.num_attention_heads, joint_attention_dim=cfg.joint_attention_dim,
        pooled_projection_dim=cfg.pooled_projection_dim, guidance_embeds=cfg.guidance_embeds,
        axes_dims_rope=tuple(cfg.axes_dims_rope)).eval()


class Velocity:
    """v(x [B, N, C], prompt rows [B], sigma [B]) with a call counter: `calls` transformer
    calls and `samples` (Σ of their batch sizes)."""

    def __init__(self, model, cond: dict, guidance: float | None):
        self.model = model
        t = lambda a: torch.as_tensor(np.asarray(a, np.float32))
        self.txt, self.y = t(cond["txt"]), t(cond["y"])
        self.img_ids, self.txt_ids = t(cond["img_ids"]), t(cond["txt_ids"])
        self.guidance = guidance
        self.calls = 0
        self.samples = 0

    def __call__(self, x: torch.Tensor, rows: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        self.calls += 1
        self.samples += b
        txt, y = self.txt[rows], self.y[rows]
        guidance = None if self.guidance is None else torch.full((b,), self.guidance)
        return self.model(hidden_states=x, encoder_hidden_states=txt, pooled_projections=y,
                          timestep=sigma.expand(b), img_ids=self.img_ids, txt_ids=self.txt_ids,
                          guidance=guidance, return_dict=False)[0]


def flow_grpo_mean_std(x, v, sigmas: np.ndarray, k: int, eta: float):
    """sde.flow_grpo_step's drift-corrected mean μ and transition std s at step k."""
    sigma, sigma_next = float(sigmas[k]), float(sigmas[k + 1])
    dt = sigma_next - sigma
    sigma_prime = float(sigmas[1]) if sigma == 1 else sigma
    std_t = eta * math.sqrt(sigma / (1 - sigma_prime))
    half_c = 0.5 * eta ** 2 / (1 - sigma_prime)
    mean = x * (1 + half_c * dt) + v * ((1 + half_c * (1 - sigma)) * dt)
    return mean, std_t * math.sqrt(-dt)


def gaussian_log_prob(x_next, mean, std):
    """log N(x_next; mean, std²) averaged over the non-batch dims (the reference's "mean")."""
    lp = -(x_next - mean) ** 2 / (2 * std ** 2) - math.log(std) - _HALF_LOG_2PI
    return lp.flatten(1).mean(1)


def combo_schedules(plan) -> list[np.ndarray]:
    """Each (k, λ) combo's σ sub-schedule, read back from the plan's lane tables."""
    out = []
    for c in range(plan.num_combos):
        rows, lanes = np.nonzero(plan.lane_combo == c)  # one lane per combo, rows in order
        sig = plan.lane_sigma[rows, lanes]
        out.append(np.append(sig, plan.lane_sigma_next[rows[-1], lanes[-1]])
                   if len(rows) else np.zeros(1, np.float32))
    return out


def _noise(shape, generator):
    return torch.randn(shape, generator=generator)


@torch.inference_mode()
def reference_rollout(velocity: Velocity, x_init, sigmas, branch_steps, group_size: int,
                      eta: float, plan, branch_noise=None, seed: int = 0):
    """The reference code's loops. x_init [P, N, C]; branch_noise [K, P, G, N, C] or None
    (drawn). Returns dict(anchor [T+1, P, N, C], x_next [K, P, G, N, C], log_prob [K, P, G],
    finals [K, J, P, G, N, C])."""
    sigmas = np.asarray(sigmas, np.float32)
    gen = torch.Generator().manual_seed(seed)
    x_init = torch.tensor(np.asarray(x_init, np.float32))
    p_count, num_steps = x_init.shape[0], len(sigmas) - 1
    subs = combo_schedules(plan)
    num_j = plan.num_combos // len(branch_steps)
    anchors, x_nexts, log_probs, finals = [], [], [], []
    for p in range(p_count):
        row = torch.tensor([p])
        x, xs, vs = x_init[p:p + 1], [x_init[p:p + 1]], []
        for i in range(num_steps):
            v = velocity(x, row, torch.tensor(float(sigmas[i])))
            x = x + v * float(sigmas[i + 1] - sigmas[i])
            xs.append(x)
            vs.append(v)
        anchors.append(torch.cat(xs))
        per_k_next, per_k_lp, per_k_final = [], [], []
        for ki, k in enumerate(branch_steps):
            # The anchor's call at x_k serves the whole group: one SDE step per member.
            mean, std = flow_grpo_mean_std(xs[k], vs[k], sigmas, k, eta)
            eps = (_noise((group_size, *x.shape[1:]), gen) if branch_noise is None
                   else torch.as_tensor(np.asarray(branch_noise[ki, p], np.float32)))
            x_next = mean + std * eps
            per_k_next.append(x_next)
            per_k_lp.append(gaussian_log_prob(x_next, mean, std))
            per_j = []
            for j in range(num_j):
                sub = subs[ki * num_j + j]
                members = []
                for g in range(group_size):
                    x = x_next[g:g + 1]
                    for s in range(len(sub) - 1):
                        v = velocity(x, row, torch.tensor(float(sub[s])))
                        x = x + v * float(sub[s + 1] - sub[s])
                    members.append(x)
                per_j.append(torch.cat(members))
            per_k_final.append(torch.stack(per_j))
        x_nexts.append(torch.stack(per_k_next))
        log_probs.append(torch.stack(per_k_lp))
        finals.append(torch.stack(per_k_final))
    return dict(anchor=torch.stack(anchors, 1), x_next=torch.stack(x_nexts, 1),
                log_prob=torch.stack(log_probs, 1), finals=torch.stack(finals, 2))


@torch.inference_mode()
def batched_rollout(velocity: Velocity, x_init, sigmas, branch_steps, group_size: int,
                    eta: float, plan, branch_noise=None, seed: int = 0):
    """Our batching in torch eager; arguments and results as `reference_rollout`."""
    sigmas = np.asarray(sigmas, np.float32)
    gen = torch.Generator().manual_seed(seed)
    x = torch.tensor(np.asarray(x_init, np.float32))
    p_count, num_steps = x.shape[0], len(sigmas) - 1
    tail = x.shape[1:]
    rows = torch.arange(p_count)
    xs, vs = [x], []
    for i in range(num_steps):
        v = velocity(x, rows, torch.tensor(float(sigmas[i])))
        x = x + v * float(sigmas[i + 1] - sigmas[i])
        xs.append(x)
        vs.append(v)
    num_k, g = len(branch_steps), group_size
    if branch_noise is None:
        branch_noise = _noise((num_k, p_count, g, *tail), gen)
    branch_noise = torch.as_tensor(np.asarray(branch_noise, np.float32))
    x_next, log_prob = [], []
    for ki, k in enumerate(branch_steps):  # no model calls: elementwise over [P, G]
        mean, std = flow_grpo_mean_std(xs[k][:, None], vs[k][:, None], sigmas, k, eta)
        nxt = mean + std * branch_noise[ki]
        x_next.append(nxt)
        log_prob.append(gaussian_log_prob(nxt.flatten(0, 1), mean.expand_as(nxt).flatten(0, 1),
                                          std).reshape(p_count, g))
    x_next = torch.stack(x_next)                                   # [K, P, G, N, C]
    num_j = plan.num_combos // num_k
    lanes = plan.num_lanes
    # Combo c = k·J + j starts from the branch of k; a zero row for idle lanes.
    starts = x_next.repeat_interleave(num_j, dim=0)
    starts = torch.cat([starts, torch.zeros_like(starts[:1])])      # [C+1, P, G, N, C]
    out = starts.clone()
    lane_x = torch.zeros((p_count, lanes, g, *tail))
    lane_rows = rows.repeat_interleave(lanes * g)
    for s in range(plan.length):
        combo = torch.as_tensor(plan.lane_combo[s], dtype=torch.long)
        start = torch.as_tensor(plan.lane_start[s])
        if start.any():
            loaded = starts[combo].transpose(0, 1)                  # [P, W, G, N, C]
            lane_x = torch.where(start.view(1, lanes, 1, 1, 1), loaded, lane_x)
        sigma = torch.as_tensor(plan.lane_sigma[s]).repeat_interleave(g).repeat(p_count)
        v = velocity(lane_x.reshape(-1, *tail), lane_rows, sigma).reshape(lane_x.shape)
        dt = torch.as_tensor(plan.lane_sigma_next[s] - plan.lane_sigma[s])
        lane_x = lane_x + v * dt.view(1, lanes, 1, 1, 1)
        for w in np.nonzero(plan.lane_end[s])[0]:
            out[plan.lane_combo[s, w]] = lane_x[:, w]
    finals = out[:-1].reshape(num_k, num_j, p_count, g, *tail)
    return dict(anchor=torch.stack(xs), x_next=x_next, log_prob=torch.stack(log_prob),
                finals=finals)


def make_optimizer(model, opt_config):
    return torch.optim.AdamW(model.parameters(), lr=opt_config["learning_rate"],
                             betas=(opt_config["b1"], opt_config["b2"]), eps=opt_config["eps"],
                             weight_decay=opt_config["weight_decay"])


def train_step(velocity: Velocity, optimizer, batch: dict, sigmas, eta: float,
               clip_range: float, grad_clip_norm: float) -> float:
    """One accumulated optimizer step over the K trained steps of a TrainBatch (numpy arrays:
    x [K, P, 1, N, C], x_next [K, P, G, N, C], step [K], old_log_prob and advantages
    [K, P, G]): all K·P shared-x_k forwards in one call. Returns the loss."""
    sigmas = np.asarray(sigmas, np.float32)
    t = lambda a: torch.as_tensor(np.asarray(a, np.float32))
    x, x_next = t(batch["x"]), t(batch["x_next"])
    old, adv = t(batch["old_log_prob"]), t(batch["advantages"])
    steps = [int(k) for k in np.asarray(batch["step"])]
    num_k, p_count, g = x_next.shape[:3]
    tail = x.shape[3:]
    rows = torch.arange(p_count).repeat(num_k)
    sigma = torch.as_tensor(sigmas[steps]).repeat_interleave(p_count)
    optimizer.zero_grad(set_to_none=True)
    v = velocity(x.reshape(num_k * p_count, *tail), rows, sigma).reshape(x.shape)
    losses = []
    for ki, k in enumerate(steps):
        mean, std = flow_grpo_mean_std(x[ki], v[ki], sigmas, k, eta)
        lp = gaussian_log_prob(x_next[ki].flatten(0, 1),
                               mean.expand_as(x_next[ki]).flatten(0, 1), std).reshape(p_count, g)
        ratio = torch.exp(lp - old[ki])
        clipped = torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
        losses.append(torch.maximum(-adv[ki] * ratio, -adv[ki] * clipped).mean())
    loss = torch.stack(losses).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(velocity.model.parameters(), grad_clip_norm)
    optimizer.step()
    return float(loss.detach())
