"""GRPO clipped policy loss and the Flow-GRPO Gaussian KL penalty.

Shape conventions:
    B: samples (e.g. the G members of every group of one branch step, flattened).
    K: optional leading axes (e.g. branch steps); every reduction runs over ALL axes, so ``[B]``
        and ``[K, B]`` inputs are both accepted and every sample counts once.

All log-probabilities here are per-sample log π(x_{k+1} | x_k) of one SDE step, as produced by the
sampler; the ratio of a single Gaussian step is what the clip acts on.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from g2rpo_jax.core.dtypes import at_least_float32

__all__ = ["gaussian_kl", "grpo_clip_loss", "grpo_loss"]

DEFAULT_CLIP_RANGE = 1e-4


def _masked_mean(values: jax.Array, mask: jax.Array | None) -> jax.Array:
    if mask is None:
        return jnp.mean(values)
    mask = jnp.broadcast_to(mask, values.shape).astype(values.dtype)
    # max(count, 1): an all-zero mask yields 0 instead of 0/0 = NaN.
    return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _masked_extreme(
    values: jax.Array, mask: jax.Array | None, reducer, fill: float, empty_value: float
) -> jax.Array:
    """min/max over the valid entries; ``empty_value`` when none is valid (avoids ±inf)."""
    if mask is None:
        return reducer(values)
    valid = jnp.broadcast_to(mask, values.shape) > 0
    extreme = reducer(jnp.where(valid, values, fill))
    return jnp.where(jnp.any(valid), extreme, jnp.asarray(empty_value, values.dtype))


# Jitted so that eager callers pay one compile per shape, not one per op; ``None`` for
# ``mask``/``kl`` is an empty pytree, so the optional arguments need no static marking.
@jax.jit
def grpo_clip_loss(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    clip_range: float = DEFAULT_CLIP_RANGE,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO/GRPO clipped surrogate: mean_i max(-A_i · r_i, -A_i · clip(r_i, 1-ε, 1+ε)).

    ``old_log_prob`` and ``advantages`` are treated as constants (``stop_gradient``), so passing
    ``old_log_prob`` computed from the same parameters in the same graph (the on-policy first
    update, where the ratio is exactly 1) still gives the policy gradient and not zero.

    Gradient w.r.t. ``log_prob_i`` (no mask, N samples): ``-A_i · r_i / N`` while the unclipped
    term is active, and 0 once the ratio has left [1-ε, 1+ε] in the direction the advantage
    favours (r > 1+ε for A > 0, r < 1-ε for A < 0).

    Args:
        log_prob: ``[..., B]`` log π_θ of the stored transitions under the current parameters.
        old_log_prob: ``[..., B]`` log π_old recorded at sampling time.
        advantages: ``[..., B]`` (or broadcastable) per-sample advantages.
        clip_range: ε of the ratio clip (1e-4 in G²RPO).
        mask: optional ``[..., B]`` (or broadcastable) 0/1 weights; masked-out samples do not
            count in the mean or in any metric. An all-zero mask gives loss 0, not NaN.

    Returns:
        ``(loss, metrics)``: the scalar loss and a dict of scalar diagnostics computed without
        gradient: ``ratio_mean``, ``ratio_min``, ``ratio_max``, ``clip_fraction`` (fraction of
        samples with |r - 1| > ε), ``approx_kl`` (k3 estimator mean((r - 1) - log r) of
        KL(π_old || π_θ)) and ``log_ratio_abs_max``. With an all-zero mask the extremes report the
        neutral values 1 (ratios) and 0 (log-ratio).
    """
    log_prob = at_least_float32(log_prob)
    old_log_prob = jax.lax.stop_gradient(at_least_float32(old_log_prob))
    advantages = jax.lax.stop_gradient(at_least_float32(advantages))
    shape = jnp.broadcast_shapes(log_prob.shape, old_log_prob.shape, advantages.shape)
    log_prob = jnp.broadcast_to(log_prob, shape)
    advantages = jnp.broadcast_to(advantages, shape)
    if mask is not None:
        mask = jax.lax.stop_gradient(jnp.asarray(mask))

    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_range, 1.0 + clip_range)
    # Pessimistic bound: the larger loss wins, which removes the incentive to push the ratio
    # further out of the trust region once it is outside.
    per_sample = jnp.maximum(unclipped, clipped)
    loss = _masked_mean(per_sample, mask)

    ratio_ng = jax.lax.stop_gradient(ratio)
    log_ratio_ng = jax.lax.stop_gradient(log_ratio)
    is_clipped = (jnp.abs(ratio_ng - 1.0) > clip_range).astype(ratio_ng.dtype)
    metrics = {
        "ratio_mean": _masked_mean(ratio_ng, mask),
        "ratio_min": _masked_extreme(ratio_ng, mask, jnp.min, jnp.inf, 1.0),
        "ratio_max": _masked_extreme(ratio_ng, mask, jnp.max, -jnp.inf, 1.0),
        "clip_fraction": _masked_mean(is_clipped, mask),
        "approx_kl": _masked_mean((ratio_ng - 1.0) - log_ratio_ng, mask),
        "log_ratio_abs_max": _masked_extreme(jnp.abs(log_ratio_ng), mask, jnp.max, 0.0, 0.0),
    }
    return loss, metrics


@functools.partial(jax.jit, static_argnames=("reduce",))
def gaussian_kl(
    mean: jax.Array,
    ref_mean: jax.Array,
    std: jax.Array,
    reduce: str = "mean",
) -> jax.Array:
    """Closed-form KL(N(mean, s²I) || N(ref_mean, s²I)) of one SDE step, per sample (Flow-GRPO).

    Both policies share the step's std, so the KL is ||mean - ref_mean||² / (2 s²). Flow-GRPO
    averages it over the latent dimensions (``reduce="mean"``, consistent with the mean-over-dims
    log-prob); ``reduce="sum"`` gives the textbook KL of the full Gaussian. ``ref_mean`` comes from
    the frozen reference model and is treated as a constant.

    Args:
        mean: ``[B, ...]`` transition mean μ_θ under the current policy.
        ref_mean: ``[B, ...]`` transition mean μ_ref under the reference policy.
        std: the transition std s = std_t · sqrt(-dt) (not std_t alone): a scalar, ``[B]``
            (one per sample), or an array broadcastable to ``mean``.
        reduce: ``"mean"`` or ``"sum"`` over the non-batch dimensions.

    Returns:
        ``[B]`` per-sample KL.

    Raises:
        ValueError: if ``reduce`` is not ``"mean"`` or ``"sum"``.
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    mean = at_least_float32(mean)
    ref_mean = jax.lax.stop_gradient(at_least_float32(ref_mean))
    std = jax.lax.stop_gradient(at_least_float32(std))
    if std.ndim == 1 and mean.ndim > 1 and std.shape[0] == mean.shape[0]:
        # A [B] std is per sample: align it with the batch axis, not the trailing one.
        std = std.reshape(std.shape + (1,) * (mean.ndim - 1))
    per_dim = jnp.square(mean - ref_mean) / (2.0 * jnp.square(std))
    per_dim = jnp.broadcast_to(per_dim, jnp.broadcast_shapes(per_dim.shape, mean.shape))
    non_batch_axes = tuple(range(1, per_dim.ndim))
    if reduce == "mean":
        return jnp.mean(per_dim, axis=non_batch_axes)
    return jnp.sum(per_dim, axis=non_batch_axes)


@jax.jit
def grpo_loss(
    log_prob: jax.Array,
    old_log_prob: jax.Array,
    advantages: jax.Array,
    clip_range: float = DEFAULT_CLIP_RANGE,
    kl: jax.Array | None = None,
    kl_beta: float = 0.0,
    mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped GRPO loss plus an optional KL penalty: ``policy_loss + kl_beta · mean(kl)``.

    G²RPO itself uses no KL (``kl=None``); Flow-GRPO adds ``gaussian_kl`` to a frozen reference
    with β in 0.01–0.04.

    Args:
        log_prob: ``[..., B]`` log π_θ of the stored transitions.
        old_log_prob: ``[..., B]`` log π_old recorded at sampling time.
        advantages: ``[..., B]`` per-sample advantages.
        clip_range: ε of the ratio clip.
        kl: optional ``[..., B]`` per-sample KL to the reference (e.g. from :func:`gaussian_kl`);
            it keeps its gradient.
        kl_beta: weight of the KL term.
        mask: optional ``[..., B]`` 0/1 weights, applied to both terms.

    Returns:
        ``(loss, metrics)``: the scalar loss and the metrics of :func:`grpo_clip_loss` plus
        ``policy_loss`` and ``kl_mean`` (0 when ``kl`` is None, so the dict has the same keys in
        every configuration).
    """
    policy_loss, metrics = grpo_clip_loss(
        log_prob, old_log_prob, advantages, clip_range=clip_range, mask=mask
    )
    if kl is None:
        loss = policy_loss
        kl_mean = jnp.zeros((), policy_loss.dtype)
    else:
        kl_mean = _masked_mean(at_least_float32(kl), mask)
        loss = policy_loss + kl_beta * kl_mean
    metrics = dict(metrics)
    metrics["policy_loss"] = jax.lax.stop_gradient(policy_loss)
    metrics["kl_mean"] = jax.lax.stop_gradient(kl_mean)
    return loss, metrics
