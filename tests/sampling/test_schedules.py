"""Tests for g2rpo_jax.sampling.schedules against NumPy formulas, diffusers and hand-made tables."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.sampling import schedules

NUM_STEPS = 16
SHIFT = 3.0

# Expected sigma indices of granular_sigmas(flux_sigmas(16), k, λ), written out by hand from the
# rule concat(sigmas[:k + 2], sigmas[k + 2::λ]). ``True`` marks the schedules whose stride misses
# index 16 (σ = 0), so that end_at_zero=True appends a literal 0.0.
_ALL_17 = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
EXPECTED_GRANULAR_INDICES = {
    # λ = 1: the fine schedule, whatever k.
    (0, 1): (_ALL_17, False),
    (1, 1): (_ALL_17, False),
    (2, 1): (_ALL_17, False),
    (3, 1): (_ALL_17, False),
    (4, 1): (_ALL_17, False),
    (5, 1): (_ALL_17, False),
    (6, 1): (_ALL_17, False),
    (7, 1): (_ALL_17, False),
    # λ = 2: the tail starts at k + 2; it hits 16 iff k is even.
    (0, 2): ([0, 1, 2, 4, 6, 8, 10, 12, 14, 16], False),
    (1, 2): ([0, 1, 2, 3, 5, 7, 9, 11, 13, 15], True),
    (2, 2): ([0, 1, 2, 3, 4, 6, 8, 10, 12, 14, 16], False),
    (3, 2): ([0, 1, 2, 3, 4, 5, 7, 9, 11, 13, 15], True),
    (4, 2): ([0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 16], False),
    (5, 2): ([0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 13, 15], True),
    (6, 2): ([0, 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16], False),
    (7, 2): ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 13, 15], True),
    # λ = 3: it hits 16 iff (16 - (k + 2)) is a multiple of 3, i.e. k in {2, 5}.
    (0, 3): ([0, 1, 2, 5, 8, 11, 14], True),
    (1, 3): ([0, 1, 2, 3, 6, 9, 12, 15], True),
    (2, 3): ([0, 1, 2, 3, 4, 7, 10, 13, 16], False),
    (3, 3): ([0, 1, 2, 3, 4, 5, 8, 11, 14], True),
    (4, 3): ([0, 1, 2, 3, 4, 5, 6, 9, 12, 15], True),
    (5, 3): ([0, 1, 2, 3, 4, 5, 6, 7, 10, 13, 16], False),
    (6, 3): ([0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 14], True),
    (7, 3): ([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 15], True),
}


def _np_time_shift(sigmas, shift):
    sigmas = np.asarray(sigmas, np.float64)
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def _np_flux_mu(seq_len, base_seq_len=256, max_seq_len=4096, base_shift=0.5, max_shift=1.15):
    return base_shift + (max_shift - base_shift) * (seq_len - base_seq_len) / (
        max_seq_len - base_seq_len
    )


def _np_exponential_shift(sigmas, mu):
    sigmas = np.asarray(sigmas, np.float64)
    out = np.zeros_like(sigmas)
    positive = sigmas > 0
    out[positive] = np.exp(mu) / (np.exp(mu) + (1 / sigmas[positive] - 1))
    return out


@pytest.fixture(scope="module")
def sigmas():
    return schedules.flux_sigmas(NUM_STEPS, SHIFT)


# --- FLUX schedules ------------------------------------------------------------------------------


def test_time_shift_matches_formula():
    base = np.linspace(1, 0, 33)
    for shift in (1.0, 3.0, 5.0):
        np.testing.assert_allclose(
            schedules.time_shift(base, shift), _np_time_shift(base, shift), rtol=1e-6, atol=1e-7
        )


def test_flux_sigmas_matches_formula_and_endpoints(sigmas):
    assert sigmas.shape == (NUM_STEPS + 1,)
    assert sigmas.dtype == jnp.float32
    assert float(sigmas[0]) == 1.0 and float(sigmas[-1]) == 0.0
    expected = _np_time_shift(np.linspace(1, 0, NUM_STEPS + 1), SHIFT)
    np.testing.assert_allclose(sigmas, expected, rtol=1e-6, atol=1e-7)
    assert np.all(np.diff(np.asarray(sigmas)) < 0)
    # Hand values: shift_3(0.5) = 1.5 / 2 = 0.75 and shift_3(1/16) = (3/16) / (18/16) = 1/6.
    assert float(sigmas[8]) == pytest.approx(0.75, abs=1e-7)
    assert float(sigmas[15]) == pytest.approx(1 / 6, abs=1e-7)


def test_flux_mu_interpolates():
    assert schedules.flux_mu(256) == pytest.approx(0.5)
    assert schedules.flux_mu(4096) == pytest.approx(1.15)
    assert schedules.flux_mu(2176) == pytest.approx(0.825)  # the midpoint
    assert schedules.flux_mu(2025) == pytest.approx(_np_flux_mu(2025))
    assert schedules.flux_mu(1000, 100, 1100, 0.0, 1.0) == pytest.approx(0.9)


def test_flux_exponential_shift_matches_formula():
    base = np.linspace(1, 0, 17)
    for mu in (0.5, 0.8, 1.15):
        shifted = schedules.flux_exponential_shift(base, mu)
        np.testing.assert_allclose(shifted, _np_exponential_shift(base, mu), rtol=2e-6, atol=1e-7)
        assert float(shifted[0]) == 1.0 and float(shifted[-1]) == 0.0
        assert np.all(np.isfinite(np.asarray(shifted)))


@pytest.mark.parametrize("image_seq_len", [256, 2025, 4096])
def test_flux_dev_sigmas_matches_formula(image_seq_len):
    got = schedules.flux_dev_sigmas(NUM_STEPS, image_seq_len)
    assert got.shape == (NUM_STEPS + 1,) and got.dtype == jnp.float32
    assert float(got[0]) == 1.0 and float(got[-1]) == 0.0
    expected = _np_exponential_shift(np.linspace(1, 0, NUM_STEPS + 1), _np_flux_mu(image_seq_len))
    np.testing.assert_allclose(got, expected, rtol=2e-6, atol=1e-7)


def test_flux_schedules_match_diffusers():
    diffusers = pytest.importorskip("diffusers")
    scheduler_cls = diffusers.FlowMatchEulerDiscreteScheduler
    first_t = np.linspace(1.0, 1.0 / NUM_STEPS, NUM_STEPS)  # FluxPipeline's input sigmas

    dynamic = scheduler_cls(use_dynamic_shifting=True)
    for image_seq_len in (256, 2025, 4096):
        dynamic.set_timesteps(sigmas=first_t, mu=schedules.flux_mu(image_seq_len))
        ours = schedules.flux_dev_sigmas(NUM_STEPS, image_seq_len)
        np.testing.assert_allclose(ours[:NUM_STEPS], dynamic.sigmas.numpy()[:NUM_STEPS], atol=1e-6)

    static = scheduler_cls(shift=SHIFT)
    static.set_timesteps(sigmas=first_t)
    np.testing.assert_allclose(
        schedules.flux_sigmas(NUM_STEPS, SHIFT)[:NUM_STEPS],
        static.sigmas.numpy()[:NUM_STEPS],
        atol=1e-6,
    )


def test_flux_sigmas_rejects_bad_num_steps():
    with pytest.raises(ValueError, match="num_steps"):
        schedules.flux_sigmas(0)


def test_quantize_timesteps(sigmas):
    got = np.asarray(schedules.quantize_timesteps(sigmas))
    # Hand values: 0.9782609 -> 0.978, 0.75 -> 0.75, 1/6 -> 0.166, 1 -> 1, 0 -> 0. σ_9 = 0.7 is
    # 0.69999999 in float32, but its float32 product with 1000 rounds to 700 (as in the
    # reference's float32 torch code), so it stays 0.7.
    np.testing.assert_allclose(
        got[[0, 1, 8, 9, 15, 16]], [1.0, 0.978, 0.75, 0.7, 0.166, 0.0], atol=1e-7
    )
    expected = np.trunc(np.asarray(sigmas, np.float32) * np.float32(1000)) / 1000
    np.testing.assert_allclose(got, expected, atol=1e-7)


# --- granular schedules --------------------------------------------------------------------------


def test_expected_table_is_complete():
    assert sorted(EXPECTED_GRANULAR_INDICES) == [(k, lam) for k in range(8) for lam in (1, 2, 3)]


@pytest.mark.parametrize("k, granularity", sorted(EXPECTED_GRANULAR_INDICES))
def test_granular_sigmas_matches_hand_table(sigmas, k, granularity):
    indices, appends_zero = EXPECTED_GRANULAR_INDICES[(k, granularity)]
    np_sigmas = np.asarray(sigmas)

    reference = schedules.granular_sigmas(sigmas, k, granularity, end_at_zero=False)
    np.testing.assert_array_equal(reference, np_sigmas[indices])

    expected = np_sigmas[indices]
    if appends_zero:
        expected = np.concatenate([expected, [0.0]])
    full = schedules.granular_sigmas(sigmas, k, granularity)  # end_at_zero=True by default
    assert full.dtype == jnp.float32
    np.testing.assert_array_equal(full, expected)
    assert float(full[-1]) == 0.0
    # The branch step k -> k + 1 and the first fine step after it are always kept.
    np.testing.assert_array_equal(full[: k + 3], np_sigmas[: k + 3])


def test_granular_sigmas_accepts_numpy_and_traced_input(sigmas):
    from_numpy = schedules.granular_sigmas(np.asarray(sigmas), 1, 3)
    traced = jax.jit(lambda s: schedules.granular_sigmas(s, 1, 3))(sigmas)
    np.testing.assert_array_equal(from_numpy, traced)
    np.testing.assert_array_equal(from_numpy, schedules.granular_sigmas(sigmas, 1, 3))


def test_granular_sigmas_last_branch_step(sigmas):
    # k = T - 1: the branch step is the last step, nothing is left to coarsen.
    for granularity in (1, 2, 3):
        np.testing.assert_array_equal(
            schedules.granular_sigmas(sigmas, NUM_STEPS - 1, granularity), sigmas
        )


@pytest.mark.parametrize(
    "k, granularity, match",
    [(-1, 2, "branch step"), (NUM_STEPS, 2, "branch step"), (0, 0, "granularity")],
)
def test_granular_sigmas_rejects_bad_arguments(sigmas, k, granularity, match):
    with pytest.raises(ValueError, match=match):
        schedules.granular_sigmas(sigmas, k, granularity)


def test_granular_sigmas_rejects_non_1d(sigmas):
    with pytest.raises(ValueError, match="1-D"):
        schedules.granular_sigmas(sigmas[None], 0, 2)
