"""Group advantages and MGAI integration against independent NumPy float64 references."""

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.rl.advantages import group_advantages, integrate_advantages, scale_weights


def numpy_group_advantages(rewards, clip=5.0, eps=1e-8):
    """Float64 reference: unbiased std over the last axis, then the clip."""
    rewards = np.asarray(rewards, dtype=np.float64)
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True, ddof=1)
    advantages = (rewards - mean) / (std + eps)
    if clip is not None:
        advantages = np.clip(advantages, -clip, clip)
    return advantages


def numpy_integrate(rewards, weights, clip=5.0, eps=1e-8):
    """Float64 reference with an explicit loop over scales and the clip after the sum."""
    total = sum(
        w * numpy_group_advantages(r, clip=None, eps=eps)
        for w, r in zip(np.asarray(weights, np.float64), np.asarray(rewards, np.float64))
    )
    if clip is not None:
        total = np.clip(total, -clip, clip)
    return total


def one_outlier_group(group_size, value=1.0):
    """A group with a single non-zero member: the largest |A| a group of G can produce."""
    rewards = np.zeros(group_size)
    rewards[0] = value
    return rewards


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# --------------------------------------------------------------------------- group_advantages


def test_hand_computed_example():
    # mean 2.5, unbiased std sqrt(5/3): A = [-1.5, -0.5, 0.5, 1.5] / sqrt(5/3)
    expected = np.array([-1.5, -0.5, 0.5, 1.5]) / np.sqrt(5.0 / 3.0)
    np.testing.assert_allclose(
        group_advantages(jnp.array([1.0, 2.0, 3.0, 4.0])),
        [-1.161895, -0.387298, 0.387298, 1.161895],
        atol=1e-6,
    )
    np.testing.assert_allclose(
        group_advantages(jnp.array([1.0, 2.0, 3.0, 4.0])), expected, atol=1e-6
    )


def test_two_member_group_is_plus_minus_one_over_sqrt2():
    # G = 2: unbiased std is |a - b| / sqrt(2), so A = ±1/sqrt(2) whatever the rewards.
    np.testing.assert_allclose(
        group_advantages(jnp.array([3.0, -7.0])), [1 / np.sqrt(2), -1 / np.sqrt(2)], atol=1e-6
    )


def test_matches_numpy_reference(rng):
    rewards = rng.normal(size=(3, 4, 12)).astype(np.float32)
    np.testing.assert_allclose(
        group_advantages(rewards), numpy_group_advantages(rewards), rtol=1e-5, atol=1e-5
    )
    np.testing.assert_allclose(
        group_advantages(rewards, clip=None),
        numpy_group_advantages(rewards, clip=None),
        rtol=1e-5,
        atol=1e-5,
    )


def test_zero_mean_and_unit_unbiased_std_per_group(rng):
    rewards = rng.normal(loc=3.0, scale=0.2, size=(5, 12))
    advantages = np.asarray(group_advantages(rewards, clip=None), np.float64)
    np.testing.assert_allclose(advantages.mean(axis=-1), 0.0, atol=1e-6)
    np.testing.assert_allclose(advantages.std(axis=-1, ddof=1), 1.0, atol=1e-5)
    # The biased std would be sqrt((G - 1) / G) != 1: guards against ddof=0.
    assert not np.allclose(advantages.std(axis=-1, ddof=0), 1.0, atol=1e-3)


def test_invariant_to_per_group_shift_and_positive_scale(rng):
    rewards = rng.normal(size=(4, 12)).astype(np.float32)
    shift = rng.normal(scale=10.0, size=(4, 1)).astype(np.float32)
    scale = rng.uniform(0.5, 10.0, size=(4, 1)).astype(np.float32)
    base = group_advantages(rewards, clip=None)
    np.testing.assert_allclose(group_advantages(rewards + shift, clip=None), base, atol=1e-4)
    np.testing.assert_allclose(group_advantages(rewards * scale, clip=None), base, atol=1e-4)


def test_constant_group_gives_zero_not_nan():
    rewards = jnp.array([[0.7] * 12, list(range(12))], dtype=jnp.float32)
    advantages = np.asarray(group_advantages(rewards))
    assert np.all(np.isfinite(advantages))
    np.testing.assert_array_equal(advantages[0], 0.0)
    assert np.abs(advantages[1]).max() > 0.5


def test_clip_bounds_the_outlier():
    # With G = 64 a single outlier reaches (G - 1) / sqrt(G) = 7.875 before clipping.
    rewards = one_outlier_group(64)
    unclipped = np.asarray(group_advantages(rewards, clip=None))
    np.testing.assert_allclose(unclipped[0], 63 / 8, rtol=1e-5)
    clipped = np.asarray(group_advantages(rewards, clip=5.0))
    assert clipped[0] == pytest.approx(5.0)
    np.testing.assert_allclose(clipped[1:], unclipped[1:], rtol=1e-6)
    assert np.asarray(group_advantages(rewards, clip=2.0))[0] == pytest.approx(2.0)


def test_integer_and_bf16_rewards_are_promoted():
    assert group_advantages(jnp.array([1, 2, 3, 4])).dtype == jnp.float32
    assert group_advantages(jnp.array([1, 2, 3, 4], dtype=jnp.bfloat16)).dtype == jnp.float32


@pytest.mark.parametrize("shape", [(1,), (3, 1), ()])
def test_group_smaller_than_two_raises(shape):
    with pytest.raises(ValueError, match="G"):
        group_advantages(jnp.zeros(shape))


def test_group_advantages_jits(rng):
    rewards = rng.normal(size=(2, 12)).astype(np.float32)
    np.testing.assert_allclose(
        jax.jit(group_advantages)(rewards), group_advantages(rewards), atol=1e-6
    )


# ----------------------------------------------------------------------- integrate_advantages


def test_integrate_matches_numpy_loop_reference(rng):
    rewards = rng.normal(size=(4, 3, 2, 12)).astype(np.float32)  # [S, P, K, G]
    weights = np.array([1.0, 0.5, 2.0, 0.25], np.float32)
    result = integrate_advantages(rewards, weights)
    assert result.shape == (3, 2, 12)
    np.testing.assert_allclose(result, numpy_integrate(rewards, weights), rtol=1e-5, atol=1e-5)


def test_integrate_equals_sum_of_per_scale_results_without_clip(rng):
    rewards = rng.normal(size=(3, 5, 12)).astype(np.float32)
    loop_sum = sum(group_advantages(rewards[s], clip=None) for s in range(3))
    np.testing.assert_allclose(
        integrate_advantages(rewards, jnp.ones(3), clip=None), loop_sum, rtol=1e-5, atol=1e-5
    )


def test_weights_are_applied(rng):
    rewards = rng.normal(size=(2, 12)).astype(np.float32)
    first_only = integrate_advantages(rewards, jnp.array([1.0, 0.0]), clip=None)
    np.testing.assert_allclose(first_only, group_advantages(rewards[0], clip=None), atol=1e-6)
    weighted = integrate_advantages(rewards, jnp.array([3.0, -0.5]), clip=None)
    expected = 3.0 * group_advantages(rewards[0], clip=None) - 0.5 * group_advantages(
        rewards[1], clip=None
    )
    np.testing.assert_allclose(weighted, expected, atol=1e-5)


def test_clip_is_applied_after_the_sum():
    # G = 12: one outlier gives 11 / sqrt(12) = 3.175 per scale, within ±5; two scales sum to 6.35.
    group_size = 12
    outlier = one_outlier_group(group_size)
    rewards = np.stack([outlier, outlier])
    per_scale = 11 / np.sqrt(12)
    result = np.asarray(integrate_advantages(rewards, jnp.ones(2)))
    clip_before_sum = 2 * np.clip(per_scale, -5, 5)
    assert clip_before_sum == pytest.approx(6.3509, abs=1e-3)
    assert result[0] == pytest.approx(5.0)
    np.testing.assert_allclose(result[1:], 2 * (-1 / 12) / (np.sqrt(1 / 12)), rtol=1e-5)


def test_clip_after_sum_differs_from_clip_before_sum_with_a_saturated_scale():
    # G = 64: scale 0 alone gives member 0 about 7.875 (beyond 5), scale 1 about -1.7.
    # Clip after the sum: clip(6.15) = 5. Clip before: 5 - 1.7 = 3.3. Only the former is MGAI.
    group_size = 64
    scale0 = one_outlier_group(group_size)
    scale1 = np.linspace(0.0, 1.0, group_size)  # member 0 is the lowest → negative advantage
    rewards = np.stack([scale0, scale1])
    a0 = numpy_group_advantages(scale0, clip=None)
    a1 = numpy_group_advantages(scale1, clip=None)
    assert a0[0] > 5.0 and -5.0 < a1[0] < 0.0
    expected_after = np.clip(a0 + a1, -5, 5)
    clip_before = np.clip(a0, -5, 5) + np.clip(a1, -5, 5)
    assert abs(expected_after[0] - clip_before[0]) > 0.5
    result = np.asarray(integrate_advantages(rewards, jnp.ones(2)))
    np.testing.assert_allclose(result, expected_after, rtol=1e-5, atol=1e-5)


def test_constant_scale_contributes_zero(rng):
    varying = rng.normal(size=(12,)).astype(np.float32)
    rewards = np.stack([np.full(12, 0.3, np.float32), varying])
    result = np.asarray(integrate_advantages(rewards, jnp.ones(2)))
    assert np.all(np.isfinite(result))
    np.testing.assert_allclose(result, group_advantages(varying), atol=1e-6)


def test_integrate_traces_without_a_python_loop_over_scales(rng):
    # A vmapped body yields the same program whatever S is; a Python loop would grow with S.
    def count_equations(jaxpr):
        # Recurse into nested jaxprs (jit, vmap bodies) so the whole program is counted.
        total = 0
        for eqn in jaxpr.eqns:
            total += 1
            for param in eqn.params.values():
                if isinstance(param, jax.extend.core.ClosedJaxpr):
                    total += count_equations(param.jaxpr)
                elif isinstance(param, jax.extend.core.Jaxpr):
                    total += count_equations(param)
        return total

    def num_equations(num_scales):
        rewards = jnp.zeros((num_scales, 3, 12))
        return count_equations(
            jax.make_jaxpr(integrate_advantages)(rewards, jnp.ones(num_scales)).jaxpr
        )

    assert num_equations(2) > 5  # the nested bodies were really counted

    assert num_equations(2) == num_equations(6)
    rewards = rng.normal(size=(3, 2, 12)).astype(np.float32)
    weights = jnp.array([1.0, 2.0, 0.5])
    np.testing.assert_allclose(
        jax.jit(integrate_advantages)(rewards, weights),
        integrate_advantages(rewards, weights),
        atol=1e-6,
    )


def test_weights_shape_mismatch_raises():
    with pytest.raises(ValueError, match=r"weights.*\(3,\).*\(2,\)"):
        integrate_advantages(jnp.zeros((3, 12)), jnp.ones(2))
    with pytest.raises(ValueError, match="weights"):
        integrate_advantages(jnp.zeros((3, 12)), jnp.ones((3, 1)))


def test_integrate_rejects_missing_axes_and_small_groups():
    with pytest.raises(ValueError, match="S"):
        integrate_advantages(jnp.zeros(12), jnp.ones(12))
    with pytest.raises(ValueError, match="G"):
        integrate_advantages(jnp.zeros((2, 5, 1)), jnp.ones(2))


# ------------------------------------------------------------------------------ scale_weights


def test_scale_weights_order_matches_reshape(rng):
    num_granularities, num_rewards = 3, 2
    granularity_weights = np.array([1.0, 0.5, 2.0], np.float32)
    reward_weights = np.array([1.0, 0.1], np.float32)
    weights = np.asarray(scale_weights(granularity_weights, reward_weights))
    np.testing.assert_allclose(weights, [1.0, 0.1, 0.5, 0.05, 2.0, 0.2], rtol=1e-6)

    rewards = rng.normal(size=(num_granularities, num_rewards, 4, 12)).astype(
        np.float32
    )  # [J, R, P, G]
    flat = rewards.reshape(num_granularities * num_rewards, 4, 12)
    expected = np.clip(
        sum(
            granularity_weights[j]
            * reward_weights[r]
            * numpy_group_advantages(rewards[j, r], clip=None)
            for j in range(num_granularities)
            for r in range(num_rewards)
        ),
        -5,
        5,
    )
    np.testing.assert_allclose(integrate_advantages(flat, weights), expected, rtol=1e-5, atol=1e-5)


def test_scale_weights_rejects_non_vectors():
    with pytest.raises(ValueError):
        scale_weights(jnp.ones((2, 2)), jnp.ones(2))


def test_centred_only_advantages_hand_computed():
    """scale_by_std=False (Dr. GRPO): A = r - mean(r), no division; the MGAI sum and the clip
    act on these centred values."""
    rewards = jnp.array([[0.25, 0.25, 0.5, 0.0], [0.3, 0.3, 0.3, 0.3]])
    expected = np.array([[0.0, 0.0, 0.25, -0.25], [0.0, 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(group_advantages(rewards, scale_by_std=False), expected, atol=1e-7)
    scales = jnp.stack([rewards, 2 * rewards])
    np.testing.assert_allclose(
        integrate_advantages(scales, jnp.array([1.0, 1.0]), clip=0.5, scale_by_std=False),
        np.clip(3 * expected, -0.5, 0.5), atol=1e-7)
    # A near-tie weighs in proportion to its spread instead of being standardised to ±1.
    tie = jnp.array([0.5, 0.5, 0.5, 0.5 + 1e-3])
    assert float(jnp.max(jnp.abs(group_advantages(tie, scale_by_std=False)))) < 1e-3
    assert float(jnp.max(jnp.abs(group_advantages(tie)))) > 1.0
