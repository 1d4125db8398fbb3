"""Tests for g2rpo_jax.sampling.sde against independent NumPy float64 versions of the formulas."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.sampling import schedules, sde

NUM_STEPS = 16
SHAPE = (3, 4, 5)  # [B, ...] with two trailing dims

# (i, eta): the σ = 1 special case, early, middle and the last step (σ = 1/6 -> 0).
STEP_CASES = [(0, 0.7), (1, 0.7), (7, 0.3), (12, 1.0), (15, 0.7)]


@pytest.fixture(scope="module")
def sigmas():
    return schedules.flux_sigmas(NUM_STEPS, 3.0)


@pytest.fixture(scope="module")
def xv():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    v = rng.standard_normal(SHAPE).astype(np.float32)
    return x, v


# --- NumPy float64 references, written from method.md and the DanceGRPO script ---------------


def np_flow_grpo(x, v, sigmas, i, eta):
    """Flow-GRPO mean and transition std, literally as in method.md."""
    x, v, sigmas = (np.asarray(a, np.float64) for a in (x, v, sigmas))
    sigma, sigma_next = sigmas[i], sigmas[i + 1]
    dt = sigma_next - sigma
    sigma_prime = sigmas[1] if sigma == 1 else sigma
    std_t = eta * math.sqrt(sigma / (1 - sigma_prime))
    mean = (
        x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return mean, std_t * math.sqrt(-dt), std_t


def np_dance_grpo(x, v, sigmas, i, eta):
    """DanceGRPO's FLUX step, in the reference's own variable names."""
    latents, model_output, sigmas = (np.asarray(a, np.float64) for a in (x, v, sigmas))
    sigma = sigmas[i]
    dsigma = sigmas[i + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[i + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
    log_term = -0.5 * eta**2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    return prev_sample_mean, std_dev_t


def np_log_prob(x_next, mean, std, reduce="mean"):
    x_next = np.asarray(x_next, np.float64)
    per_elem = (
        -((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))
    )
    axes = tuple(range(1, per_elem.ndim))
    return per_elem.mean(axis=axes) if reduce == "mean" else per_elem.sum(axis=axes)


STEPS = {"flow": (sde.flow_grpo_step, np_flow_grpo), "dance": (sde.dance_grpo_step, np_dance_grpo)}


def _reference(name, x, v, sigmas, i, eta):
    out = STEPS[name][1](x, v, sigmas, i, eta)
    return out[0], out[1]  # mean, transition std


def _near_mean_sample(mean, std, seed=1):
    # A plausible x_next (a few std from μ) keeps the log-prob O(1), so tolerances stay meaningful.
    noise = np.random.default_rng(seed).standard_normal(mean.shape)
    return (mean + std * noise).astype(np.float32)


# --- euler_step and flow_grpo_std ---------------------------------------------------------------


def test_euler_step(xv, sigmas):
    x, v = xv
    got = sde.euler_step(x, v, sigmas[3], sigmas[4])
    expected = x.astype(np.float64) + v * (float(sigmas[4]) - float(sigmas[3]))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
    assert got.dtype == jnp.float32
    assert sde.euler_step(x.astype(jnp.bfloat16), v, 0.5, 0.4).dtype == jnp.bfloat16


@pytest.mark.parametrize("i, eta", STEP_CASES)
def test_flow_grpo_std(sigmas, i, eta):
    expected_std_t = np_flow_grpo(np.zeros((1, 1)), np.zeros((1, 1)), sigmas, i, eta)[2]
    np.testing.assert_allclose(sde.flow_grpo_std(sigmas, i, eta), expected_std_t, rtol=1e-6)


def test_flow_grpo_std_first_step_uses_next_sigma(sigmas):
    # σ = 1: std_t = η·sqrt(1 / (1 - sigmas[1])), finite instead of 1/0.
    sigma_1 = float(sigmas[1])
    np.testing.assert_allclose(
        sde.flow_grpo_std(sigmas, 0, 0.7), 0.7 * math.sqrt(1 / (1 - sigma_1)), rtol=1e-6
    )


# --- mean, std and log-prob against NumPy -------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("i, eta", STEP_CASES)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_step_matches_numpy(xv, sigmas, name, i, eta, reduce):
    x, v = xv
    step = STEPS[name][0]
    ref_mean, ref_std = _reference(name, x, v, sigmas, i, eta)
    x_next = _near_mean_sample(ref_mean, ref_std)

    got_next, log_prob, mean, std = step(x, v, sigmas, i, eta, x_next=x_next, reduce=reduce)
    np.testing.assert_array_equal(got_next, x_next)
    assert log_prob.shape == (SHAPE[0],) and log_prob.dtype == jnp.float32
    assert mean.dtype == jnp.float32 and std.shape == ()
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(std, ref_std, rtol=1e-5)
    # ``sum`` adds 20 elements of O(1): scale the absolute tolerance with the element count.
    atol = 1e-4 if reduce == "mean" else 2e-3
    np.testing.assert_allclose(
        log_prob, np_log_prob(x_next, ref_mean, ref_std, reduce), rtol=1e-5, atol=atol
    )


@pytest.mark.parametrize("name", sorted(STEPS))
def test_sampled_log_prob_matches_numpy(xv, sigmas, name):
    x, v = xv
    step = STEPS[name][0]
    for i, eta in STEP_CASES:
        x_next, log_prob, _, _ = step(x, v, sigmas, i, eta, key=jax.random.key(i))
        ref_mean, ref_std = _reference(name, x, v, sigmas, i, eta)
        assert x_next.dtype == jnp.float32 and x_next.shape == SHAPE
        np.testing.assert_allclose(
            log_prob, np_log_prob(np.asarray(x_next), ref_mean, ref_std), rtol=1e-5, atol=1e-4
        )


def test_sum_is_mean_times_elements(xv, sigmas):
    x, v = xv
    key = jax.random.key(0)
    _, lp_mean, _, _ = sde.flow_grpo_step(x, v, sigmas, 2, 0.7, key=key, reduce="mean")
    _, lp_sum, _, _ = sde.flow_grpo_step(x, v, sigmas, 2, 0.7, key=key, reduce="sum")
    np.testing.assert_allclose(lp_sum, lp_mean * 20, rtol=1e-5)


def test_gaussian_log_prob_matches_numpy():
    rng = np.random.default_rng(3)
    x_next, mean = rng.standard_normal((2, 2, 3, 7)).astype(np.float32)
    std = 0.37
    for reduce in ("mean", "sum"):
        np.testing.assert_allclose(
            sde.gaussian_log_prob(x_next, mean, std, reduce),
            np_log_prob(x_next, mean.astype(np.float64), std, reduce),
            rtol=1e-5,
        )
    # One-dimensional input: nothing to reduce, the log-density of each element.
    np.testing.assert_allclose(
        sde.gaussian_log_prob(x_next[0, :, 0], mean[0, :, 0], std),
        np_log_prob(x_next[0, :, 0], mean[0, :, 0].astype(np.float64), std),
        rtol=1e-5,
    )


# --- sampling statistics -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("i, eta", [(0, 0.7), (10, 0.7)])
def test_sample_moments(sigmas, name, i, eta):
    num_samples, dims = 20000, 4
    rng = np.random.default_rng(5)
    x = np.broadcast_to(rng.standard_normal((1, dims)), (num_samples, dims)).astype(np.float32)
    v = np.broadcast_to(rng.standard_normal((1, dims)), (num_samples, dims)).astype(np.float32)
    ref_mean, ref_std = _reference(name, x[:1], v[:1], sigmas, i, eta)

    x_next, _, _, _ = STEPS[name][0](x, v, sigmas, i, eta, key=jax.random.key(42))
    x_next = np.asarray(x_next, np.float64)
    # 5 standard errors: the mean's is s/sqrt(n), the variance's about s²·sqrt(2/n).
    np.testing.assert_allclose(
        x_next.mean(axis=0), ref_mean[0], atol=5 * ref_std / math.sqrt(num_samples)
    )
    np.testing.assert_allclose(
        x_next.var(axis=0, ddof=1), ref_std**2, rtol=5 * math.sqrt(2 / num_samples)
    )


# --- eta = 0 is Euler ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STEPS))
@pytest.mark.parametrize("i", [0, 7, 15])
def test_eta_zero_is_euler(xv, sigmas, name, i):
    x, v = xv
    step = STEPS[name][0]
    euler = sde.euler_step(x, v, sigmas[i], sigmas[i + 1])
    x_next, log_prob, mean, std = step(x, v, sigmas, i, 0.0, key=jax.random.key(0))
    assert float(std) == 0.0
    np.testing.assert_array_equal(mean, euler)
    np.testing.assert_array_equal(x_next, euler)
    # Undefined density: guarded to finite zeros so masked steps cannot inject NaN.
    np.testing.assert_array_equal(log_prob, np.zeros(SHAPE[0]))

    def total_log_prob(velocity):
        return step(x, velocity, sigmas, i, 0.0, x_next=x_next)[1].sum()

    assert np.all(np.isfinite(np.asarray(jax.grad(total_log_prob)(jnp.asarray(v)))))


def test_padded_zero_length_step_is_identity(xv):
    # Padding repeats σ = 0 at the end of a granular schedule: both SDE steps must be identities.
    x, v = xv
    padded = jnp.asarray([1.0, 0.5, 0.0, 0.0], jnp.float32)
    for step in (sde.flow_grpo_step, sde.dance_grpo_step):
        x_next, log_prob, mean, std = step(x, v, padded, 2, 0.7, key=jax.random.key(0))
        np.testing.assert_array_equal(x_next, x)
        np.testing.assert_array_equal(mean, x)
        assert float(std) == 0.0
        assert np.all(np.isfinite(np.asarray(log_prob)))


# --- scoring a given sample, errors ------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STEPS))
def test_scoring_draws_no_noise(xv, sigmas, name):
    x, v = xv
    step = STEPS[name][0]
    sampled, old_log_prob, _, _ = step(x, v, sigmas, 3, 0.7, key=jax.random.key(7))
    first = step(x, v, sigmas, 3, 0.7, x_next=sampled)
    second = step(x, v, sigmas, 3, 0.7, x_next=sampled)
    np.testing.assert_array_equal(first[0], sampled)
    np.testing.assert_array_equal(first[1], second[1])
    # Re-scoring the stored sample reproduces the rollout's log-prob (PPO ratio exactly 1).
    np.testing.assert_array_equal(first[1], old_log_prob)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_bf16_rescoring_is_consistent(xv, sigmas, name):
    x, v = (jnp.asarray(a, jnp.bfloat16) for a in xv)
    step = STEPS[name][0]
    for i in (0, 7, 15):
        x_next, old_log_prob, mean, _ = step(x, v, sigmas, i, 0.7, key=jax.random.key(i))
        assert x_next.dtype == jnp.bfloat16
        assert mean.dtype == jnp.float32 and old_log_prob.dtype == jnp.float32
        _, new_log_prob, _, _ = step(x, v, sigmas, i, 0.7, x_next=x_next)
        np.testing.assert_allclose(new_log_prob, old_log_prob, rtol=0, atol=1e-6)
        # Same under jit, as the training step would run it.
        jitted = jax.jit(functools.partial(step, sigmas=sigmas, i=i, eta=0.7))
        _, jit_log_prob, _, _ = jitted(x, v, x_next=x_next)
        np.testing.assert_allclose(jit_log_prob, old_log_prob, rtol=0, atol=1e-5)


@pytest.mark.parametrize("step", [sde.flow_grpo_step, sde.dance_grpo_step])
def test_key_xor_sample_is_required(xv, sigmas, step):
    x, v = xv
    with pytest.raises(ValueError, match="exactly one of"):
        step(x, v, sigmas, 0, 0.7)
    with pytest.raises(ValueError, match="exactly one of"):
        step(x, v, sigmas, 0, 0.7, key=jax.random.key(0), x_next=x)


def test_bad_reduce_raises(xv, sigmas):
    x, v = xv
    for call in (
        lambda: sde.gaussian_log_prob(x, v, 1.0, reduce="max"),
        lambda: sde.flow_grpo_step(x, v, sigmas, 0, 0.7, x_next=x, reduce="avg"),
        lambda: sde.dance_grpo_step(x, v, sigmas, 0, 0.7, x_next=x, reduce="none"),
    ):
        with pytest.raises(ValueError, match="'mean', 'sum'"):
            call()


# --- transformations ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(STEPS))
def test_jit_with_traced_step_and_eta(xv, sigmas, name):
    x, v = xv
    step = STEPS[name][0]
    jitted = jax.jit(functools.partial(step, reduce="sum"))
    for i, eta in [(0, 0.7), (9, 0.3)]:
        key = jax.random.key(11)
        got = jitted(x, v, sigmas, jnp.int32(i), jnp.float32(eta), key=key)
        eager = step(x, v, sigmas, i, eta, key=key, reduce="sum")
        for a, b in zip(got, eager):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", sorted(STEPS))
def test_vmap_over_steps(xv, sigmas, name):
    # Different branch steps k for different rows, as when all k are batched in one call.
    x, v = xv
    step = STEPS[name][0]
    steps = jnp.asarray([0, 6, 15], jnp.int32)
    keys = jax.random.split(jax.random.key(3), 3)

    def one_row(x_row, v_row, i, key):
        x_next, log_prob, _, std = step(x_row[None], v_row[None], sigmas, i, 0.7, key=key)
        return x_next[0], log_prob[0], std

    x_next, log_prob, std = jax.vmap(one_row)(x, v, steps, keys)
    for row, i in enumerate([0, 6, 15]):
        ref_mean, ref_std = _reference(name, x[row : row + 1], v[row : row + 1], sigmas, i, 0.7)
        np.testing.assert_allclose(std[row], ref_std, rtol=1e-5)
        np.testing.assert_allclose(
            log_prob[row],
            np_log_prob(np.asarray(x_next[row : row + 1]), ref_mean, ref_std)[0],
            rtol=1e-5,
            atol=1e-4,
        )


def test_log_prob_gradient_wrt_velocity(xv, sigmas):
    # The training signal: d log π / d v = (x' - μ) / s² · dμ/dv / D, dμ/dv = (1 + c(1 - σ))·dt.
    x, v = xv
    i, eta = 4, 0.7
    ref_mean, ref_std, std_t = np_flow_grpo(x, v, sigmas, i, eta)
    x_next = _near_mean_sample(ref_mean, ref_std)

    def total_log_prob(velocity):
        return sde.flow_grpo_step(x, velocity, sigmas, i, eta, x_next=x_next)[1].sum()

    grad = jax.grad(total_log_prob)(jnp.asarray(v))
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dmean_dv = (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * (sigma_next - sigma)
    expected = (x_next - ref_mean) / ref_std**2 * dmean_dv / 20
    np.testing.assert_allclose(grad, expected, rtol=1e-4, atol=1e-5)
