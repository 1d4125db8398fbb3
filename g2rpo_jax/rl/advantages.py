"""Group-relative advantages and Multi-Granularity Advantage Integration (MGAI).

In G²RPO every (prompt, branch step k) owns a group of G samples that share the same anchor
state x_k, so their reward differences come from the SDE noise at step k alone. The advantage of
a member is its reward standardised within that group. MGAI scores every branch several times
(once per granularity λ and reward model) and sums the per-scale standardised advantages before
clipping, so that one noisy scale cannot dominate and the clip acts on the final signal.

Shape conventions:
    G: group size (samples of one prompt that share an anchor), always the LAST axis.
    S: "scales", the leading axis of the MGAI input; it enumerates (granularity, reward model)
        pairs, or granularities only.
    ...: any batch axes in between, e.g. prompts P and branch steps K.

The trajectory-level advantage of the baselines (DanceGRPO, Flow-GRPO, MixGRPO) is
``group_advantages(final_rewards)``; no separate function is needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from g2rpo_jax.core.dtypes import at_least_float32

__all__ = ["group_advantages", "integrate_advantages", "scale_weights"]

DEFAULT_CLIP = 5.0
DEFAULT_EPS = 1e-8


def _check_group_axis(rewards: jax.Array) -> None:
    if rewards.ndim < 1:
        raise ValueError("rewards must have a group axis (last axis of size G >= 2), got a scalar")
    group_size = rewards.shape[-1]
    if group_size < 2:
        # The unbiased std divides by G - 1: a group of one has no defined spread.
        raise ValueError(
            f"group size G (last axis of rewards) must be >= 2 for the unbiased std, "
            f"got G={group_size} in rewards of shape {rewards.shape}"
        )


def _clip(advantages: jax.Array, clip: float | None) -> jax.Array:
    if clip is None:
        return advantages
    return jnp.clip(advantages, -clip, clip)


# Jitted so that eager callers (host-side bookkeeping) pay one compile per shape, not one per op;
# ``clip`` is static because ``None`` switches the clip off.
@functools.partial(jax.jit, static_argnames=("clip", "scale_by_std"))
def group_advantages(
    rewards: jax.Array,
    clip: float | None = DEFAULT_CLIP,
    eps: float = DEFAULT_EPS,
    scale_by_std: bool = True,
) -> jax.Array:
    """Group-normalised advantages A = (r - mean(r)) / (std(r) + eps), clipped to [-clip, clip].

    The std is the UNBIASED one (ddof=1), as in the reference code. A group whose rewards are all
    equal gets advantages exactly 0 (not NaN, and not the amplified float rounding residue of its
    mean), so it contributes no gradient.

    With ``scale_by_std=False`` the advantage is only centred, A = r - mean(r) (Dr. GRPO, Liu et
    al., arXiv 2503.20783): a group whose members barely differ then weighs little instead of
    being blown up to unit spread, so near-ties (e.g. one pixel flipping a verifier's decision)
    do not enter the gradient at full strength.

    Args:
        rewards: ``[..., G]`` rewards; the last axis is the group of one prompt (and branch step),
            all leading axes are independent groups. G must be >= 2.
        clip: symmetric clip bound applied after normalisation; ``None`` disables clipping.
        eps: added to the std so that constant groups do not divide by zero.
        scale_by_std: divide by the group's std (GRPO, the paper) or only centre (static).

    Returns:
        ``[..., G]`` advantages in float32 (or wider if the input is wider).

    Raises:
        ValueError: if the static group size G (last axis) is smaller than 2.
    """
    rewards = at_least_float32(rewards)
    _check_group_axis(rewards)
    group_size = rewards.shape[-1]
    centered = rewards - jnp.mean(rewards, axis=-1, keepdims=True)
    # Second centring pass: rewards usually sit far from 0 relative to their in-group spread
    # (e.g. HPS ≈ 0.3 ± 0.01), and the float32 rounding of the first mean would otherwise bias
    # every advantage of the group by the same offset.
    centered = centered - jnp.mean(centered, axis=-1, keepdims=True)
    std = jnp.sqrt(jnp.sum(jnp.square(centered), axis=-1, keepdims=True) / (group_size - 1))
    advantages = centered / (std + eps) if scale_by_std else centered
    # A constant group has no preference to express. In float32 its mean is generally not exact,
    # so the rounding residue (~1e-8) divided by a std of the same size would turn into O(1)
    # advantages: zero such groups explicitly.
    is_constant = jnp.all(rewards == rewards[..., :1], axis=-1, keepdims=True)
    advantages = jnp.where(is_constant, jnp.zeros_like(advantages), advantages)
    return _clip(advantages, clip)


@functools.partial(jax.jit, static_argnames=("clip", "scale_by_std"))
def integrate_advantages(
    rewards: jax.Array,
    weights: jax.Array,
    clip: float | None = DEFAULT_CLIP,
    eps: float = DEFAULT_EPS,
    scale_by_std: bool = True,
) -> jax.Array:
    """Multi-Granularity Advantage Integration: A = clip(Σ_s w_s · normalise(r_s), ±clip).

    Each scale is group-normalised on its own WITHOUT clipping (one function vmapped over the
    scale axis), the results are summed with the given weights, and only the sum is clipped.
    Clipping per scale would let a scale that already saturates mask the disagreement of the
    others.

    Args:
        rewards: ``[S, ..., G]`` rewards; S enumerates scales ((granularity, reward model) pairs,
            or granularities only), G is the group axis (G >= 2). Flatten a ``[J, R, ..., G]``
            array with ``rewards.reshape(J * R, ...)`` and use :func:`scale_weights` for weights.
        weights: ``[S]`` weight of each scale (all ones in the paper).
        clip: symmetric clip bound applied AFTER the weighted sum; ``None`` disables clipping.
        eps: added to each scale's std so that constant groups do not divide by zero.
        scale_by_std: see :func:`group_advantages` (static).

    Returns:
        ``[..., G]`` integrated advantages.

    Raises:
        ValueError: if rewards lacks a scale or group axis, G < 2, or weights is not ``[S]``.
    """
    rewards = at_least_float32(rewards)
    weights = at_least_float32(weights)
    if rewards.ndim < 2:
        raise ValueError(
            f"rewards must be [S, ..., G] with a leading scale axis and a group axis, "
            f"got shape {rewards.shape}"
        )
    _check_group_axis(rewards)
    num_scales = rewards.shape[0]
    if weights.shape != (num_scales,):
        raise ValueError(
            f"weights must have shape [S] = ({num_scales},) to match rewards of shape "
            f"{rewards.shape}, got weights of shape {weights.shape}"
        )

    def normalise_one_scale(scale_rewards: jax.Array) -> jax.Array:
        return group_advantages(scale_rewards, clip=None, eps=eps, scale_by_std=scale_by_std)

    per_scale = jax.vmap(normalise_one_scale)(rewards)  # [S, ..., G]
    integrated = jnp.tensordot(weights.astype(per_scale.dtype), per_scale, axes=1)  # [..., G]
    return _clip(integrated, clip)


def scale_weights(granularity_weights: jax.Array, reward_weights: jax.Array) -> jax.Array:
    """Weights for the flattened (granularity, reward model) scale axis of MGAI.

    The weight of the pair (λ_j, reward_r) is ``granularity_weights[j] * reward_weights[r]``.
    The result is flattened row-major, i.e. in the same order as
    ``rewards.reshape(J * R, ...)`` for rewards of shape ``[J, R, ..., G]`` (index ``j * R + r``),
    so it can be passed straight to :func:`integrate_advantages`.

    Args:
        granularity_weights: ``[J]`` weight per granularity λ.
        reward_weights: ``[R]`` weight per reward model.

    Returns:
        ``[J * R]`` per-scale weights.

    Raises:
        ValueError: if either input is not one-dimensional.
    """
    granularity_weights = at_least_float32(granularity_weights)
    reward_weights = at_least_float32(reward_weights)
    if granularity_weights.ndim != 1 or reward_weights.ndim != 1:
        raise ValueError(
            f"granularity_weights [J] and reward_weights [R] must be 1-D, got shapes "
            f"{granularity_weights.shape} and {reward_weights.shape}"
        )
    return jnp.outer(granularity_weights, reward_weights).reshape(-1)
