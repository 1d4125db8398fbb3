"""Algorithms as data: step sets, windows, presets and the forward-pass counts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.rl import algorithms, iteration
from g2rpo_jax.sampling import schedules


def _algo(name, **overrides):
    return algorithms.Algorithm.from_config(algorithms.preset(name, **overrides))


def test_presets_differ_only_in_data():
    g2rpo, dance, flow, mix = (_algo(n) for n in ("g2rpo", "dance_grpo", "flow_grpo", "mix_grpo"))
    assert g2rpo.rollout == "singular" and g2rpo.granularities == (1, 2, 3)
    assert _algo("g2rpo_no_mgai").granularities == (1,)
    assert dance.sde_step == "dance_grpo" and dance.eta == 0.3 and dance.train_fraction == 0.6
    assert flow.kl_beta > 0 and not flow.shared_initial_noise
    assert mix.sde_window == 4


def test_trajectory_sde_mask_and_trained_steps():
    dance = _algo("dance_grpo")
    assert bool(jnp.all(dance.sde_mask(0, 16)))
    assert dance.num_trained_steps(16) == 10  # round(0.6 · 16)
    trained = np.asarray(dance.trained_steps(jax.random.key(0), 0, 16))
    assert len(set(trained)) == 10 and trained.min() >= 0 and trained.max() < 16
    other = np.asarray(dance.trained_steps(jax.random.key(1), 0, 16))
    assert not np.array_equal(trained, other)  # a fresh random subset each iteration


def test_mix_grpo_window_slides_and_clamps():
    mix = _algo("mix_grpo", window_shift_every=10, window_stride=2)
    np.testing.assert_array_equal(np.flatnonzero(mix.sde_mask(0, 16)), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.flatnonzero(mix.sde_mask(9, 16)), [0, 1, 2, 3])
    np.testing.assert_array_equal(np.flatnonzero(mix.sde_mask(10, 16)), [2, 3, 4, 5])
    np.testing.assert_array_equal(np.flatnonzero(mix.sde_mask(1000, 16)), [12, 13, 14, 15])
    trained = np.asarray(mix.trained_steps(jax.random.key(0), 10, 16))
    np.testing.assert_array_equal(trained, [2, 3, 4, 5])


def test_validation_errors():
    with pytest.raises(ValueError, match="Unknown algorithm"):
        algorithms.preset("ppo")
    with pytest.raises(ValueError, match="group_size must be"):
        _algo("g2rpo", group_size=1)
    with pytest.raises(ValueError, match="granularity_weights"):
        _algo("g2rpo", granularity_weights=(1.0,))
    with pytest.raises(ValueError, match="Unknown algorithm fields"):
        algorithms.Algorithm.from_config({"rollout": "singular", "etaa": 0.7})
    with pytest.raises(ValueError, match=r"branch_steps \[15\] outside"):
        _algo("g2rpo", branch_steps=(0, 15)).validate(16)


def test_forward_pass_counts_match_method_cost_paragraph():
    """method.md: k ∈ 0..7, G = 12, T = 16: Λ={1,2} ≈ 1,800 passes, Λ={1,2,3} ≈ 2,200."""
    sigmas = schedules.flux_sigmas(16, 3.0)
    counts = {}
    for lams in ((1, 2), (1, 2, 3)):
        algo = _algo("g2rpo", granularities=lams, granularity_weights=(1.0,) * len(lams))
        plan = iteration.continuation_plan(algo, sigmas)
        counts[lams] = algo.rollout_forward_passes(16, plan)
    # Hand count: anchor 16 + 12 · Σ_k continuation steps (λ=1: 15−k, λ=2: 8,8,7,7,6,6,5,5,
    # λ=3: 6,6,5,5,5,4,4,4).
    assert counts[(1, 2)]["useful"] == 16 + 12 * (92 + 52) == 1744
    assert counts[(1, 2, 3)]["useful"] == 16 + 12 * (92 + 52 + 39) == 2212
    for c in counts.values():
        assert c["useful"] <= c["computed"] <= 1.15 * c["useful"]
    dance = _algo("dance_grpo")
    assert dance.rollout_forward_passes(16) == {"useful": 192, "computed": 192}
    assert dance.update_forward_passes(16) == 10 * 12
    assert _algo("g2rpo").update_forward_passes(16) == 8  # one shared anchor pass per k


@pytest.mark.parametrize("name", list(algorithms.PRESETS))
def test_config_files_select_algorithms_by_argument(name):
    from g2rpo_jax.rl import policy_update
    from g2rpo_jax.run import config_lib

    config = config_lib.load_config("flux_tiny.py", name)
    algo = algorithms.Algorithm.from_config(config.algorithm)
    assert config.algorithm.name == name
    # flux_tiny sizes every preset down (groups of 4; G²RPO branches at steps 0 and 1) and
    # keeps the rest of the preset.
    sized = dict(group_size=4)
    if algo.rollout == "singular":
        sized["branch_steps"] = (0, 1)
    assert algo == algorithms.Algorithm.from_config(algorithms.preset(name, **sized))
    settings = policy_update.PolicyUpdate.from_config(config)
    assert settings.guidance == 3.5 and settings.steps_per_update == 0


def test_antithetic_needs_singular_and_even_group():
    assert algorithms.Algorithm(antithetic=True, group_size=8).antithetic
    with pytest.raises(ValueError, match="even group_size"):
        algorithms.Algorithm(antithetic=True, group_size=7)
    with pytest.raises(ValueError, match="singular rollout"):
        algorithms.Algorithm(rollout="trajectory", antithetic=True, group_size=8)
