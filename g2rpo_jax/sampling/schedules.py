"""Sigma schedules for FLUX flow matching and the granular schedules of G²RPO.

Convention (FLUX): sigma σ runs from 1 (pure noise) to 0 (data), x_σ = (1 - σ)·x_0 + σ·ε. A
schedule is a 1-D float32 array ``sigmas`` of length T + 1 with ``sigmas[0] = 1`` and
``sigmas[T] = 0``; step i goes from ``sigmas[i]`` to ``sigmas[i + 1]`` (dt < 0).

Multi-Granularity Advantage Integration finishes each branch (taken at step k) with a coarser
schedule, :func:`granular_sigmas`: the first fine step after the branch, then every λ-th sigma of
the original grid. The schedule lengths differ per (k, λ), so the rollout plans the
continuations statically (``rollout.plan_continuations``): the (k, λ) pairs are packed back to
back into lanes that run side by side in one ``lax.scan``, one model call per scan step for all
lanes, and a lane with nothing left to do takes zero-length (identity) steps.

``k`` and ``granularity`` must be static Python ints: they decide array shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax.core.dtypes import at_least_float32

__all__ = [
    "flux_dev_sigmas",
    "flux_exponential_shift",
    "flux_mu",
    "flux_sigmas",
    "granular_sigmas",
    "quantize_timesteps",
    "time_shift",
]

ArrayLike = jax.Array | np.ndarray


def time_shift(sigmas: ArrayLike, shift: float) -> jax.Array:
    """SD3 time shift s·σ / (1 + (s - 1)·σ); s > 1 spends more steps at high noise.

    Args:
        sigmas: ``[...]`` sigmas in [0, 1].
        shift: the shift s (3.0 for the G²RPO reference setting).

    Returns:
        ``[...]`` shifted sigmas in float32 (or wider if the input is wider). 0 and 1 are fixed
        points of the map, exactly so for integer shifts.
    """
    sigmas = at_least_float32(sigmas)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def flux_sigmas(num_steps: int, shift: float = 3.0) -> jax.Array:
    """The G²RPO / DanceGRPO FLUX schedule: ``time_shift(linspace(1, 0, T + 1), shift)``.

    Args:
        num_steps: number of sampling steps T (static).
        shift: SD3 time shift s.

    Returns:
        ``[T + 1]`` float32 sigmas, exactly 1.0 first and exactly 0.0 last.
    """
    _check_num_steps(num_steps)
    base = jnp.linspace(1.0, 0.0, num_steps + 1, dtype=jnp.float32)
    return _pin_endpoints(time_shift(base, shift))


def flux_mu(
    image_seq_len: int | jax.Array,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float | jax.Array:
    """FLUX's resolution-dependent shift parameter μ (diffusers' ``calculate_shift``).

    μ interpolates linearly in the number of image tokens between ``base_shift`` at
    ``base_seq_len`` and ``max_shift`` at ``max_seq_len`` (and extrapolates outside), so larger
    images, which keep more structure at a given σ, get more high-noise steps.

    Args:
        image_seq_len: number of image tokens (e.g. 2025 for a 720×720 image: 90×90 latent in 2×2
            patches).
        base_seq_len: token count at which μ = ``base_shift``.
        max_seq_len: token count at which μ = ``max_shift``.
        base_shift: μ at ``base_seq_len``.
        max_shift: μ at ``max_seq_len``.

    Returns:
        μ, a Python float for Python inputs (otherwise an array of the input's shape).
    """
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    intercept = base_shift - slope * base_seq_len
    return image_seq_len * slope + intercept


def flux_exponential_shift(sigmas: ArrayLike, mu: float | jax.Array) -> jax.Array:
    """FLUX's exponential time shift exp(μ) / (exp(μ) + (1/σ - 1)).

    Evaluated as e^μ·σ / (e^μ·σ + (1 - σ)), which is the same function (multiply through by σ)
    but needs no 1/σ: σ = 0 maps to exactly 0 and σ = 1 to exactly 1 without inf intermediates.
    It equals :func:`time_shift` with s = e^μ.

    Args:
        sigmas: ``[...]`` sigmas in [0, 1].
        mu: the shift parameter μ, e.g. from :func:`flux_mu`.

    Returns:
        ``[...]`` shifted sigmas in float32 (or wider if the input is wider).
    """
    sigmas = at_least_float32(sigmas)
    scale = jnp.exp(jnp.asarray(mu, dtype=sigmas.dtype))
    scaled = scale * sigmas
    return scaled / (scaled + (1 - sigmas))


def flux_dev_sigmas(num_steps: int, image_seq_len: int) -> jax.Array:
    """FLUX.1-dev's default schedule: exponential shift with μ = ``flux_mu(image_seq_len)``.

    The first T values equal diffusers' FluxPipeline schedule (which shifts
    ``linspace(1, 1/T, T)`` and appends 0).

    Args:
        num_steps: number of sampling steps T (static).
        image_seq_len: number of image tokens.

    Returns:
        ``[T + 1]`` float32 sigmas, exactly 1.0 first and exactly 0.0 last.
    """
    _check_num_steps(num_steps)
    base = jnp.linspace(1.0, 0.0, num_steps + 1, dtype=jnp.float32)
    return _pin_endpoints(flux_exponential_shift(base, flux_mu(image_seq_len)))


def granular_sigmas(
    sigmas: ArrayLike, k: int, granularity: int, end_at_zero: bool = True
) -> jax.Array:
    """The schedule that finishes a branch taken at step k with granularity λ.

    ``concat(sigmas[:k + 2], sigmas[k + 2::λ])``: the shared prefix up to the branch state
    x_{k+1}, the first fine step after it (to ``sigmas[k + 2]``), then every λ-th sigma of the
    original grid. When the stride does not land on the last sigma, ``end_at_zero=True`` appends
    0.0 so that the trajectory is integrated all the way to σ = 0 (the paper's intent); with
    ``end_at_zero=False`` the schedule stops early (the reference code, whose caller then decodes
    x̂_0 = x - σ·v from the last model call).

    Whether 0.0 is appended is decided from the indices alone (is the last index of ``sigmas``
    selected?), never from values, so ``sigmas`` may be traced. This assumes ``sigmas`` is a full
    schedule that ends at σ = 0, as those of :func:`flux_sigmas` do.

    Args:
        sigmas: ``[T + 1]`` the fine schedule (NumPy or JAX; its length is static).
        k: the branch step (static), 0 <= k <= T - 1.
        granularity: the stride λ >= 1 (static); λ = 1 returns the fine schedule.
        end_at_zero: append 0.0 when the stride misses the last sigma.

    Returns:
        ``[N]`` float32 schedule, N = (k + 2) + ceil((T - k - 1) / λ), plus one if 0.0 is appended.

    Raises:
        ValueError: if ``sigmas`` is not 1-D, or k or λ is out of range.
    """
    sigmas = at_least_float32(sigmas)
    if sigmas.ndim != 1:
        raise ValueError(f"sigmas must be a 1-D schedule [T + 1], got shape {sigmas.shape}")
    indices, needs_zero = _granular_indices(sigmas.shape[0], k, granularity)
    schedule = sigmas[np.asarray(indices)]
    if end_at_zero and needs_zero:
        schedule = jnp.concatenate([schedule, jnp.zeros((1,), schedule.dtype)])
    return schedule


def quantize_timesteps(sigmas: ArrayLike) -> jax.Array:
    """The reference code's model timestep int(σ·1000) / 1000 (an option, not a default).

    Truncation toward zero, i.e. floor for the non-negative sigmas of a schedule. The product
    σ·1000 is rounded to float32 before truncating, as in the reference's float32 torch code
    (e.g. float32 0.7 = 0.69999999 gives 0.7, not 0.699).

    Args:
        sigmas: ``[...]`` sigmas.

    Returns:
        ``[...]`` quantised timesteps in float32 (or wider if the input is wider).
    """
    sigmas = at_least_float32(sigmas)
    return jnp.trunc(sigmas * 1000) / 1000


def _check_num_steps(num_steps: int) -> None:
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a Python int >= 1, got {num_steps!r}")


def _pin_endpoints(sigmas: jax.Array) -> jax.Array:
    # Consumers test σ == 1 exactly (the Flow-GRPO std special case) and rely on σ = 0 at the
    # end; a non-integer shift can land one ulp away, so set both ends explicitly.
    return sigmas.at[0].set(1.0).at[-1].set(0.0)


def _granular_indices(num_sigmas: int, k: int, granularity: int) -> tuple[list[int], bool]:
    """Indices into a fine schedule of ``num_sigmas`` sigmas, and whether the last is missed."""
    if not isinstance(k, int | np.integer) or not isinstance(granularity, int | np.integer):
        raise ValueError(
            f"k and granularity must be static Python ints, got {type(k)} and {type(granularity)}"
        )
    if not 0 <= k <= num_sigmas - 2:
        raise ValueError(
            f"branch step k must be in [0, T - 1] = [0, {num_sigmas - 2}] for a schedule of "
            f"{num_sigmas} sigmas, got k={k}"
        )
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    # k <= T - 1 keeps k + 2 <= T + 1, so the head never runs past the fine schedule.
    indices = list(range(k + 2)) + list(range(k + 2, num_sigmas, int(granularity)))
    return indices, indices[-1] != num_sigmas - 1
