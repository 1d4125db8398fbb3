"""One sampling step of the flow-matching ODE and of the SDEs used by G²RPO and its baselines.

Conventions (FLUX): σ runs from 1 (noise) to 0 (data) and the model predicts the velocity v, so
x_0 ≈ x - σ·v. ``sigmas`` is a 1-D schedule; step ``i`` goes from σ = ``sigmas[i]`` to
``sigmas[i + 1]`` and dt = ``sigmas[i + 1] - sigmas[i]`` < 0. ``i`` may be a traced int32 scalar
(it is used for dynamic indexing, which clamps out-of-range indices instead of raising).

Shapes: ``x``, ``v`` and ``x_next`` are ``[B, ...]`` with any trailing dims; log-probs are
``[B]``, reduced over every non-batch dim.

Precision: all step math is float32 even for bfloat16 latents. A sampled ``x_next`` is returned in
``x.dtype`` and its log-prob is computed from that cast value, so that the stored sample is
exactly what a later re-scoring (``x_next=`` given) evaluates: the PPO ratio starts at exactly 1.

The two SDE steps share the drift-corrected mean
    μ = x·(1 + c·dt) + v·(1 + c·(1 - σ))·dt,   c = std_t² / (2σ),
and differ in std_t and in the std of the transition Gaussian:
    Flow-GRPO (Liu et al., arXiv 2505.05470), used by G²RPO: std_t = η·sqrt(σ / (1 - σ)),
        s = std_t·sqrt(-dt).
    DanceGRPO (Xue et al., arXiv 2505.07818, ``flux_step`` of its FLUX training script):
        std_t = η (constant), s = η·sqrt(-dt).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

__all__ = [
    "dance_grpo_step",
    "euler_step",
    "flow_grpo_std",
    "flow_grpo_step",
    "gaussian_log_prob",
]

REDUCTIONS = ("mean", "sum")
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)

StepOutput = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def euler_step(
    x: jax.Array, v: jax.Array, sigma: jax.Array | float, sigma_next: jax.Array | float
) -> jax.Array:
    """The deterministic (ODE) step x + v·(σ_next - σ).

    Args:
        x: ``[B, ...]`` current latents.
        v: ``[B, ...]`` predicted velocity at x.
        sigma: current σ (scalar, or broadcastable to x).
        sigma_next: next σ (scalar, or broadcastable to x).

    Returns:
        ``[B, ...]`` next latents in ``x.dtype``; the update itself is computed in float32 so
        that bf16 trajectories do not accumulate bf16 rounding of the small per-step increments.
    """
    x32, v32 = jnp.asarray(x, jnp.float32), jnp.asarray(v, jnp.float32)
    dt = jnp.asarray(sigma_next, jnp.float32) - jnp.asarray(sigma, jnp.float32)
    return (x32 + v32 * dt).astype(jnp.asarray(x).dtype)


def flow_grpo_std(sigmas: jax.Array, i: jax.Array | int, eta: jax.Array | float) -> jax.Array:
    """Flow-GRPO's noise level std_t = η·sqrt(σ / (1 - σ')) at step i.

    σ' = σ, except at σ = 1 where σ' = ``sigmas[1]``: the first step of a schedule starting at
    pure noise would otherwise divide by zero.

    Args:
        sigmas: ``[N]`` schedule.
        i: step index (Python int or traced int32 scalar).
        eta: noise scale η (0.7 in the G²RPO paper).

    Returns:
        ``[]`` float32 std_t (the diffusion coefficient, not yet scaled by sqrt(-dt)).
    """
    sigmas = jnp.asarray(sigmas, jnp.float32)
    sigma = sigmas[i]
    sigma_prime = _flow_grpo_sigma_prime(sigmas, sigma)
    return jnp.asarray(eta, jnp.float32) * jnp.sqrt(sigma / (1 - sigma_prime))


def gaussian_log_prob(
    x_next: jax.Array, mean: jax.Array, std: jax.Array | float, reduce: str = "mean"
) -> jax.Array:
    """log N(x_next; mean, std²) per element, reduced over all non-batch dims.

    Per element: -(x' - μ)² / (2s²) - log s - ½·log(2π). ``reduce="mean"`` averages over the
    non-batch dims (the reference code; it divides the log-ratio by the number of dims),
    ``reduce="sum"`` is the density of the whole latent.

    A zero std (η = 0, or a zero-length padded step) makes the transition deterministic and the
    density undefined. Such elements contribute 0, with zero gradient, instead of NaN/inf, so
    that steps masked out by the caller poison neither values nor gradients. Do not read them as
    densities.

    Args:
        x_next: ``[B, ...]`` the sample.
        mean: ``[B, ...]`` (or broadcastable) Gaussian mean.
        std: Gaussian std s, scalar or broadcastable to ``x_next``.
        reduce: ``"mean"`` or ``"sum"`` over the non-batch dims (static).

    Returns:
        ``[B]`` float32 log-probs.

    Raises:
        ValueError: if ``reduce`` is not one of ``"mean"``, ``"sum"``.
    """
    _check_reduce(reduce)
    x_next, mean, std = (jnp.asarray(a, jnp.float32) for a in (x_next, mean, std))
    is_random = std > 0
    # Double where: the unused branch must be finite too, or its NaN gradient leaks through.
    safe_std = jnp.where(is_random, std, 1.0)
    log_prob = (
        -jnp.square(x_next - mean) / (2 * jnp.square(safe_std)) - jnp.log(safe_std) - _HALF_LOG_2PI
    )
    log_prob = jnp.where(is_random, log_prob, 0.0)
    non_batch_axes = tuple(range(1, log_prob.ndim))
    if reduce == "mean":
        return jnp.mean(log_prob, axis=non_batch_axes)
    return jnp.sum(log_prob, axis=non_batch_axes)


def flow_grpo_step(
    x: jax.Array,
    v: jax.Array,
    sigmas: jax.Array,
    i: jax.Array | int,
    eta: jax.Array | float,
    key: jax.Array | None = None,
    x_next: jax.Array | None = None,
    reduce: str = "mean",
) -> StepOutput:
    """One Flow-GRPO SDE step from ``sigmas[i]`` to ``sigmas[i + 1]`` and its log-probability.

    μ = x·(1 + std_t²/(2σ)·dt) + v·(1 + std_t²(1 - σ)/(2σ))·dt,   x' = μ + std_t·sqrt(-dt)·ε,
    with std_t from :func:`flow_grpo_std`. The ratio std_t²/σ is evaluated as η²/(1 - σ'), which
    is the same number for σ > 0 and stays finite at σ = 0 (zero-length padded steps at the end
    of a schedule), where the step is then the identity.

    Exactly one of ``key`` (sample a new x') and ``x_next`` (score a given x', drawing no noise)
    must be given. With η = 0 the step is the Euler step (the noise term is exactly 0) and the
    log-prob is undefined (returned as 0, see :func:`gaussian_log_prob`).

    Args:
        x: ``[B, ...]`` current latents (any float dtype).
        v: ``[B, ...]`` predicted velocity at x.
        sigmas: ``[N]`` schedule.
        i: step index (Python int or traced int32 scalar).
        eta: noise scale η.
        key: PRNG key for sampling; the noise is ``jax.random.normal(key, x.shape, float32)``.
        x_next: ``[B, ...]`` a sample to score instead of drawing one.
        reduce: ``"mean"`` or ``"sum"`` over non-batch dims for the log-prob (static).

    Returns:
        ``(x_next, log_prob, mean, std)``:
            x_next: ``[B, ...]`` the sample, in ``x.dtype`` when drawn, or the given ``x_next``.
            log_prob: ``[B]`` float32 log π(x_next | x), computed from x_next exactly as returned.
            mean: ``[B, ...]`` float32 Gaussian mean μ.
            std: ``[]`` float32 std of the transition Gaussian s = std_t·sqrt(-dt) (not std_t).

    Raises:
        ValueError: if not exactly one of ``key``, ``x_next`` is given, or ``reduce`` is invalid.
    """
    _check_key_or_sample(key, x_next)
    _check_reduce(reduce)
    sigmas = jnp.asarray(sigmas, jnp.float32)
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    std_t = flow_grpo_std(sigmas, i, eta)
    std_t_sq_over_sigma = (jnp.square(jnp.asarray(eta, jnp.float32))
                           / (1 - _flow_grpo_sigma_prime(sigmas, sigma)))
    mean = _drift_corrected_mean(jnp.asarray(x, jnp.float32), jnp.asarray(v, jnp.float32), sigma,
                                 dt, std_t_sq_over_sigma)
    std = std_t * jnp.sqrt(-dt)
    return _sample_and_score(x, mean, std, key, x_next, reduce)


def dance_grpo_step(
    x: jax.Array,
    v: jax.Array,
    sigmas: jax.Array,
    i: jax.Array | int,
    eta: jax.Array | float,
    key: jax.Array | None = None,
    x_next: jax.Array | None = None,
    reduce: str = "mean",
) -> StepOutput:
    """One DanceGRPO SDE step (the DanceGRPO baseline) and its log-probability.

    Source: DanceGRPO (arXiv 2505.07818), ``flux_step`` of its FLUX training script, restated in
    our notation (dt = σ_next - σ < 0, x̂_0 = x - σ·v):
        score = -(x - (1 - σ)·x̂_0) / σ²  (= -(x + (1 - σ)·v) / σ)
        μ = x + v·dt - ½·η²·score·dt
        s = η·sqrt(-dt),   x' = μ + s·ε
    and the Gaussian log-density with std s (mean over non-batch dims in the reference). This is
    the drift-corrected mean of :func:`flow_grpo_step` with a constant std_t = η. The score is
    evaluated in its simplified form, which avoids the cancellation in x - (1 - σ)·x̂_0 at small σ;
    at σ = 0 (only on zero-length padded steps) σ is replaced by 1 so the identity step stays
    finite.

    Exactly one of ``key`` and ``x_next`` must be given. With η = 0 the step is the Euler step and
    the log-prob is undefined (returned as 0, see :func:`gaussian_log_prob`).

    Args:
        x: ``[B, ...]`` current latents (any float dtype).
        v: ``[B, ...]`` predicted velocity at x.
        sigmas: ``[N]`` schedule.
        i: step index (Python int or traced int32 scalar).
        eta: noise scale η (0.3 in the DanceGRPO FLUX setting).
        key: PRNG key for sampling; the noise is ``jax.random.normal(key, x.shape, float32)``.
        x_next: ``[B, ...]`` a sample to score instead of drawing one.
        reduce: ``"mean"`` (the reference) or ``"sum"`` over non-batch dims (static).

    Returns:
        ``(x_next, log_prob, mean, std)`` as in :func:`flow_grpo_step`, with std s = η·sqrt(-dt).

    Raises:
        ValueError: if not exactly one of ``key``, ``x_next`` is given, or ``reduce`` is invalid.
    """
    _check_key_or_sample(key, x_next)
    _check_reduce(reduce)
    sigmas = jnp.asarray(sigmas, jnp.float32)
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    eta = jnp.asarray(eta, jnp.float32)
    safe_sigma = jnp.where(sigma > 0, sigma, 1.0)
    mean = _drift_corrected_mean(jnp.asarray(x, jnp.float32), jnp.asarray(v, jnp.float32), sigma,
                                 dt, jnp.square(eta) / safe_sigma)
    std = eta * jnp.sqrt(-dt)
    return _sample_and_score(x, mean, std, key, x_next, reduce)


def _drift_corrected_mean(
    x: jax.Array,
    v: jax.Array,
    sigma: jax.Array,
    dt: jax.Array,
    std_t_sq_over_sigma: jax.Array,
) -> jax.Array:
    """μ = x·(1 + c·dt) + v·(1 + c·(1 - σ))·dt with c = std_t² / (2σ); float32 in, float32 out."""
    half_c = 0.5 * std_t_sq_over_sigma
    # With c = 0 every factor is exactly 1, so η = 0 reproduces euler_step bit for bit.
    return x * (1 + half_c * dt) + v * ((1 + half_c * (1 - sigma)) * dt)


def _sample_and_score(
    x: jax.Array,
    mean: jax.Array,
    std: jax.Array,
    key: jax.Array | None,
    x_next: jax.Array | None,
    reduce: str,
) -> StepOutput:
    if x_next is None:
        noise = jax.random.normal(key, mean.shape, dtype=jnp.float32)
        # Cast before scoring: the stored sample, not its float32 precursor, is what the
        # training step re-scores, and the two log-probs must agree for the ratio to start at 1.
        x_next = (mean + std * noise).astype(jnp.asarray(x).dtype)
    else:
        x_next = jnp.asarray(x_next)
    log_prob = gaussian_log_prob(x_next, mean, std, reduce)
    return x_next, log_prob, mean, std


def _flow_grpo_sigma_prime(sigmas: jax.Array, sigma: jax.Array) -> jax.Array:
    return jnp.where(sigma == 1, sigmas[1], sigma)


def _check_reduce(reduce: str) -> None:
    if reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")


def _check_key_or_sample(key: jax.Array | None, x_next: jax.Array | None) -> None:
    if (key is None) == (x_next is None):
        raise ValueError(
            "exactly one of `key` (draw a new sample) and `x_next` (score a given sample) must "
            f"be given, got key={'None' if key is None else 'set'} and "
            f"x_next={'None' if x_next is None else 'set'}"
        )
