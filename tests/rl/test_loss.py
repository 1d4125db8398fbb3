"""GRPO clipped loss, its gradient, metrics and the Gaussian KL, against hand-computed values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.rl.loss import gaussian_kl, grpo_clip_loss, grpo_loss

METRIC_KEYS = {
    "ratio_mean",
    "ratio_min",
    "ratio_max",
    "clip_fraction",
    "approx_kl",
    "log_ratio_abs_max",
}

# Hand-computed cases with ε = 0.1: (advantage, ratio, per-sample loss, d loss / d log_prob).
# max(-A r, -A clip(r)); the gradient of -A r w.r.t. log r is -A r, and 0 on the clipped branch.
EPS = 0.1
HAND_CASES = [
    # positive advantage
    (2.0, 1.05, -2.10, -2.10),  # inside the range: unclipped
    (2.0, 1.20, -2.20, 0.0),  # above 1+ε: clipped at -A(1+ε), no further push
    (2.0, 0.80, -1.60, -1.60),  # below 1-ε: the pessimistic unclipped term stays active
    # negative advantage
    (-1.0, 0.95, 0.95, 0.95),  # inside
    (-1.0, 0.80, 0.90, 0.0),  # below 1-ε: clipped at -A(1-ε)
    (-1.0, 1.20, 1.20, 1.20),  # above 1+ε: unclipped stays active
]


def numpy_clip_loss(log_prob, old_log_prob, advantages, clip_range, mask=None):
    """Float64 reference of the loss and its metrics."""
    log_ratio = np.asarray(log_prob, np.float64) - np.asarray(old_log_prob, np.float64)
    ratio = np.exp(log_ratio)
    advantages = np.asarray(advantages, np.float64)
    per_sample = np.maximum(
        -advantages * ratio, -advantages * np.clip(ratio, 1 - clip_range, 1 + clip_range)
    )
    valid = (
        np.ones_like(ratio, bool)
        if mask is None
        else np.broadcast_to(np.asarray(mask) > 0, ratio.shape)
    )
    return per_sample[valid].mean(), {
        "ratio_mean": ratio[valid].mean(),
        "ratio_min": ratio[valid].min(),
        "ratio_max": ratio[valid].max(),
        "clip_fraction": (np.abs(ratio[valid] - 1) > clip_range).mean(),
        "approx_kl": ((ratio - 1) - log_ratio)[valid].mean(),
        "log_ratio_abs_max": np.abs(log_ratio[valid]).max(),
    }


def hand_case_arrays():
    advantages = np.array([case[0] for case in HAND_CASES], np.float32)
    ratios = np.array([case[1] for case in HAND_CASES], np.float64)
    old_log_prob = np.linspace(-3.0, 2.0, len(HAND_CASES)).astype(np.float32)
    log_prob = (old_log_prob + np.log(ratios)).astype(np.float32)
    return log_prob, old_log_prob, advantages


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ------------------------------------------------------------------------------ clipped loss


def test_ratio_one_gives_minus_mean_advantage(rng):
    old_log_prob = rng.normal(size=12).astype(np.float32)
    advantages = rng.normal(size=12).astype(np.float32)
    loss, metrics = grpo_clip_loss(old_log_prob, old_log_prob, advantages)
    assert set(metrics) == METRIC_KEYS
    assert float(loss) == pytest.approx(-advantages.mean(), abs=1e-6)
    assert float(metrics["clip_fraction"]) == 0.0
    for key in ("ratio_mean", "ratio_min", "ratio_max"):
        assert float(metrics[key]) == 1.0
    assert float(metrics["approx_kl"]) == 0.0
    assert float(metrics["log_ratio_abs_max"]) == 0.0


@pytest.mark.parametrize("advantage, ratio, expected_loss, _grad", HAND_CASES)
def test_hand_computed_single_sample(advantage, ratio, expected_loss, _grad):
    old_log_prob = jnp.array([0.3])
    log_prob = old_log_prob + np.log(ratio)
    loss, _ = grpo_clip_loss(log_prob, old_log_prob, jnp.array([advantage]), clip_range=EPS)
    assert float(loss) == pytest.approx(expected_loss, abs=1e-5)


def test_hand_computed_batch_is_the_mean():
    log_prob, old_log_prob, advantages = hand_case_arrays()
    loss, metrics = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=EPS)
    assert float(loss) == pytest.approx(np.mean([case[2] for case in HAND_CASES]), abs=1e-5)
    # Only the 1.05 and 0.95 ratios lie inside [0.9, 1.1].
    assert float(metrics["clip_fraction"]) == pytest.approx(4 / 6)


def test_gradient_matches_hand_computed_cases():
    log_prob, old_log_prob, advantages = hand_case_arrays()
    num_samples = len(HAND_CASES)
    grad = jax.grad(lambda lp: grpo_clip_loss(lp, old_log_prob, advantages, clip_range=EPS)[0])(
        log_prob
    )
    expected = np.array([case[3] for case in HAND_CASES]) / num_samples
    np.testing.assert_allclose(grad, expected, atol=1e-5)


def test_gradient_at_ratio_one_is_minus_advantage_over_batch(rng):
    advantages = np.array([1.5, -0.5, 0.0, 2.0], np.float32)
    old_log_prob = rng.normal(size=4).astype(np.float32)
    grad = jax.grad(lambda lp: grpo_clip_loss(lp, old_log_prob, advantages)[0])(old_log_prob)
    np.testing.assert_allclose(grad, -advantages / 4, atol=1e-6)
    # Gradient descent raises the log-prob of positively advantaged samples and lowers the others.
    stepped = old_log_prob - 0.1 * np.asarray(grad)
    assert stepped[0] > old_log_prob[0] and stepped[3] > old_log_prob[3]
    assert stepped[1] < old_log_prob[1]


def test_old_log_prob_and_advantages_get_no_gradient(rng):
    # old_log_prob computed from the same parameters (first on-policy update) must not cancel
    # the policy gradient: it is a constant of the surrogate.
    advantages = rng.normal(size=6).astype(np.float32)
    features = rng.normal(size=6).astype(np.float32)

    def loss_of_param(theta):
        log_prob = theta * features
        return grpo_clip_loss(log_prob, log_prob, advantages)[0]

    grad = jax.grad(loss_of_param)(jnp.float32(0.7))
    assert float(grad) == pytest.approx(-np.mean(advantages * features), rel=1e-5)
    grads = jax.grad(lambda lp, old, adv: grpo_clip_loss(lp, old, adv)[0], argnums=(1, 2))(
        features, features, advantages
    )
    for g in grads:
        np.testing.assert_array_equal(g, 0.0)


def test_metrics_match_numpy(rng):
    old_log_prob = rng.normal(size=32).astype(np.float32)
    log_prob = (old_log_prob + rng.normal(scale=0.02, size=32)).astype(np.float32)
    advantages = rng.normal(size=32).astype(np.float32)
    loss, metrics = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=0.01)
    expected_loss, expected_metrics = numpy_clip_loss(log_prob, old_log_prob, advantages, 0.01)
    assert 0.0 < expected_metrics["clip_fraction"] < 1.0  # the case exercises both sides
    assert float(loss) == pytest.approx(expected_loss, abs=1e-5)
    for key, value in expected_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-5), key


def test_approx_kl_is_the_k3_estimator():
    log_ratio = np.array([0.2, -0.3], np.float32)
    _, metrics = grpo_clip_loss(log_ratio, np.zeros(2, np.float32), np.ones(2, np.float32))
    expected = np.mean(np.expm1(log_ratio.astype(np.float64)) - log_ratio)
    assert float(metrics["approx_kl"]) == pytest.approx(expected, rel=1e-5)
    assert float(metrics["approx_kl"]) > 0.0  # k3 is non-negative sample by sample


def test_leading_axes_reduce_like_the_flattened_batch(rng):
    old_log_prob = rng.normal(size=(3, 8)).astype(np.float32)
    log_prob = (old_log_prob + rng.normal(scale=1e-3, size=(3, 8))).astype(np.float32)
    advantages = rng.normal(size=(3, 8)).astype(np.float32)
    loss_2d, metrics_2d = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=1e-3)
    loss_1d, metrics_1d = grpo_clip_loss(
        log_prob.reshape(-1), old_log_prob.reshape(-1), advantages.reshape(-1), clip_range=1e-3
    )
    assert float(loss_2d) == pytest.approx(float(loss_1d), abs=1e-6)
    for key in METRIC_KEYS:
        assert metrics_2d[key].shape == ()
        assert float(metrics_2d[key]) == pytest.approx(float(metrics_1d[key]), abs=1e-6)


def test_mask_excludes_samples_from_loss_metrics_and_gradient():
    log_prob, old_log_prob, advantages = hand_case_arrays()
    mask = np.array([1, 0, 1, 1, 0, 0], np.float32)
    keep = mask > 0

    def masked_loss(lp):
        return grpo_clip_loss(lp, old_log_prob, advantages, clip_range=EPS, mask=mask)

    (loss, metrics), grad = jax.value_and_grad(masked_loss, has_aux=True)(log_prob)
    subset_loss, subset_metrics = grpo_clip_loss(
        log_prob[keep], old_log_prob[keep], advantages[keep], clip_range=EPS
    )
    assert float(loss) == pytest.approx(float(subset_loss), abs=1e-6)
    for key in METRIC_KEYS:
        assert float(metrics[key]) == pytest.approx(float(subset_metrics[key]), abs=1e-6), key
    np.testing.assert_array_equal(np.asarray(grad)[~keep], 0.0)
    # Normalised by the 3 valid samples, not by 6.
    expected_grad = np.array([case[3] for case in HAND_CASES])[keep] / 3
    np.testing.assert_allclose(np.asarray(grad)[keep], expected_grad, atol=1e-5)
    # A boolean mask means the same thing.
    bool_loss, _ = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=EPS, mask=keep)
    assert float(bool_loss) == pytest.approx(float(loss), abs=1e-6)


def test_mask_on_leading_axes_matches_numpy(rng):
    old_log_prob = rng.normal(size=(2, 6)).astype(np.float32)
    log_prob = (old_log_prob + rng.normal(scale=0.05, size=(2, 6))).astype(np.float32)
    advantages = rng.normal(size=(2, 6)).astype(np.float32)
    mask = rng.integers(0, 2, size=(2, 6)).astype(np.float32)
    mask[0, 0] = 1.0
    loss, metrics = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=0.02, mask=mask)
    expected_loss, expected_metrics = numpy_clip_loss(
        log_prob, old_log_prob, advantages, 0.02, mask
    )
    assert float(loss) == pytest.approx(expected_loss, abs=1e-5)
    for key, value in expected_metrics.items():
        assert float(metrics[key]) == pytest.approx(value, abs=1e-5), key


def test_all_zero_mask_gives_finite_zero_loss():
    log_prob, old_log_prob, advantages = hand_case_arrays()
    mask = np.zeros(len(HAND_CASES), np.float32)

    def fully_masked_loss(lp):
        return grpo_clip_loss(lp, old_log_prob, advantages, clip_range=EPS, mask=mask)

    (loss, metrics), grad = jax.value_and_grad(fully_masked_loss, has_aux=True)(log_prob)
    assert float(loss) == 0.0
    np.testing.assert_array_equal(grad, 0.0)
    for key, value in metrics.items():
        assert np.isfinite(float(value)), key
    assert float(metrics["ratio_min"]) == 1.0 and float(metrics["ratio_max"]) == 1.0
    assert float(metrics["log_ratio_abs_max"]) == 0.0


def test_bf16_log_probs_are_computed_in_float32():
    old_log_prob = jnp.zeros(4, jnp.bfloat16)
    loss, metrics = grpo_clip_loss(old_log_prob, old_log_prob, jnp.ones(4, jnp.bfloat16))
    assert loss.dtype == jnp.float32
    assert all(value.dtype == jnp.float32 for value in metrics.values())


# ------------------------------------------------------------------------------- gaussian_kl


def numpy_gaussian_kl(mean, ref_mean, std, reduce="mean"):
    mean = np.asarray(mean, np.float64)
    std = np.asarray(std, np.float64)
    if std.ndim == 1:
        std = std.reshape((-1,) + (1,) * (mean.ndim - 1))
    per_dim = (mean - np.asarray(ref_mean, np.float64)) ** 2 / (2 * std**2)
    per_dim = np.broadcast_to(per_dim, mean.shape)
    axes = tuple(range(1, mean.ndim))
    return per_dim.mean(axis=axes) if reduce == "mean" else per_dim.sum(axis=axes)


@pytest.mark.parametrize("reduce", ["mean", "sum"])
@pytest.mark.parametrize("std_kind", ["scalar", "per_sample", "broadcast"])
def test_gaussian_kl_matches_numpy(rng, reduce, std_kind):
    mean = rng.normal(size=(3, 4, 5, 2)).astype(np.float32)
    ref_mean = (mean + rng.normal(scale=0.1, size=mean.shape)).astype(np.float32)
    std = {
        "scalar": np.float32(0.3),
        "per_sample": np.array([0.1, 0.2, 0.5], np.float32),
        "broadcast": np.array([0.1, 0.2, 0.5], np.float32).reshape(3, 1, 1, 1),
    }[std_kind]
    kl = gaussian_kl(mean, ref_mean, std, reduce=reduce)
    assert kl.shape == (3,)
    reference_std = std.reshape(-1) if std_kind == "broadcast" else std
    np.testing.assert_allclose(
        kl, numpy_gaussian_kl(mean, ref_mean, reference_std, reduce), rtol=1e-5
    )


def test_gaussian_kl_hand_computed_and_zero_for_equal_means():
    mean = jnp.array([[1.0, 2.0], [0.0, 0.0]])
    ref_mean = jnp.array([[0.0, 0.0], [0.0, 0.0]])
    # sample 0: (1 + 4) / (2 · 0.5²) = 10 summed, 5 averaged over the 2 dims.
    np.testing.assert_allclose(
        gaussian_kl(mean, ref_mean, 0.5, reduce="sum"), [10.0, 0.0], rtol=1e-6
    )
    np.testing.assert_allclose(gaussian_kl(mean, ref_mean, 0.5), [5.0, 0.0], rtol=1e-6)


def test_gaussian_kl_gradient_flows_to_mean_only(rng):
    mean = rng.normal(size=(2, 3)).astype(np.float32)
    ref_mean = rng.normal(size=(2, 3)).astype(np.float32)
    grad_mean, grad_ref = jax.grad(lambda m, r: gaussian_kl(m, r, 0.5).sum(), argnums=(0, 1))(
        mean, ref_mean
    )
    np.testing.assert_allclose(grad_mean, (mean - ref_mean) / (0.25 * 3), rtol=1e-5)
    np.testing.assert_array_equal(grad_ref, 0.0)


def test_gaussian_kl_rejects_unknown_reduction():
    with pytest.raises(ValueError, match="reduce"):
        gaussian_kl(jnp.zeros((2, 3)), jnp.zeros((2, 3)), 1.0, reduce="max")


# --------------------------------------------------------------------------------- grpo_loss


def test_grpo_loss_without_kl_equals_clip_loss():
    log_prob, old_log_prob, advantages = hand_case_arrays()
    loss, metrics = grpo_loss(log_prob, old_log_prob, advantages, EPS)
    clip_loss, clip_metrics = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=EPS)
    assert float(loss) == pytest.approx(float(clip_loss), abs=1e-7)
    assert set(metrics) == METRIC_KEYS | {"policy_loss", "kl_mean"}
    assert float(metrics["kl_mean"]) == 0.0
    assert float(metrics["policy_loss"]) == pytest.approx(float(clip_loss), abs=1e-7)
    for key in METRIC_KEYS:
        assert float(metrics[key]) == pytest.approx(float(clip_metrics[key]), abs=1e-7)


def test_grpo_loss_adds_beta_times_mean_kl():
    log_prob, old_log_prob, advantages = hand_case_arrays()
    kl = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], np.float32)
    clip_loss, _ = grpo_clip_loss(log_prob, old_log_prob, advantages, clip_range=EPS)
    loss, metrics = grpo_loss(log_prob, old_log_prob, advantages, EPS, kl=kl, kl_beta=0.04)
    assert float(loss) == pytest.approx(float(clip_loss) + 0.04 * 0.35, abs=1e-6)
    assert float(metrics["kl_mean"]) == pytest.approx(0.35, abs=1e-6)
    # β = 0 still reports the KL but leaves the loss untouched.
    loss_zero_beta, metrics_zero_beta = grpo_loss(
        log_prob, old_log_prob, advantages, EPS, kl=kl, kl_beta=0.0
    )
    assert float(loss_zero_beta) == pytest.approx(float(clip_loss), abs=1e-7)
    assert float(metrics_zero_beta["kl_mean"]) == pytest.approx(0.35, abs=1e-6)
    # The mask applies to the KL term too: mean of the kept 0.1, 0.3 is 0.2.
    mask = np.array([1, 0, 1, 0, 0, 0], np.float32)
    masked_clip_loss, _ = grpo_clip_loss(
        log_prob, old_log_prob, advantages, clip_range=EPS, mask=mask
    )
    masked_loss, masked_metrics = grpo_loss(
        log_prob, old_log_prob, advantages, EPS, kl=kl, kl_beta=0.5, mask=mask
    )
    assert float(masked_metrics["kl_mean"]) == pytest.approx(0.2, abs=1e-6)
    assert float(masked_loss) == pytest.approx(float(masked_clip_loss) + 0.5 * 0.2, abs=1e-6)


def test_grpo_loss_kl_term_has_its_gradient(rng):
    # Flow-GRPO: the penalty pulls the policy's transition mean towards the reference's.
    mean = rng.normal(size=(4, 3)).astype(np.float32)
    ref_mean = rng.normal(size=(4, 3)).astype(np.float32)
    log_prob = rng.normal(size=4).astype(np.float32)
    advantages = rng.normal(size=4).astype(np.float32)
    beta, std = 0.02, 0.5

    def total_loss(m):
        kl = gaussian_kl(m, ref_mean, std)
        return grpo_loss(log_prob, log_prob, advantages, 1e-4, kl=kl, kl_beta=beta)[0]

    grad = jax.grad(total_loss)(mean)
    # d/dm of β · mean_b mean_d (m - r)² / (2 s²) = β (m - r) / (s² · B · D)
    np.testing.assert_allclose(grad, beta * (mean - ref_mean) / (std**2 * 4 * 3), rtol=1e-5)
