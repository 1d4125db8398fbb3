"""The RL iteration end to end on a tiny FLUX: ratio checks, gradient sign, sharding invariance."""

import dataclasses

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from g2rpo_jax import parallel
from g2rpo_jax.models import flux
from g2rpo_jax.rewards import synthetic
from g2rpo_jax.rl import algorithms, iteration, policy_update
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.sampling import rollout, schedules
from g2rpo_jax.testing import tiny_rl

CFG = tiny_rl.TINY_FLUX
PROMPTS, STEPS, TOKENS, TEXT = 8, 6, 16, 4
SIGMAS = schedules.flux_sigmas(STEPS, 3.0)
SGD = tiny_rl.SGD


def _algo(name, **overrides):
    overrides = {"group_size": 4, "branch_steps": (0, 1, 2), **overrides}
    if name in ("g2rpo",):
        overrides.setdefault("granularities", (1, 2))
        overrides.setdefault("granularity_weights", (1.0, 1.0))
    return algorithms.Algorithm.from_config(algorithms.preset(name, **overrides))


def _cond(mesh):
    return tiny_rl.random_cond(mesh, PROMPTS, TOKENS, TEXT)


def _run(algo, mesh, settings=None, **kwargs):
    return tiny_rl.run_iteration(algo, mesh, SIGMAS, PROMPTS, TOKENS, settings, **kwargs)


ALL = ["g2rpo", "g2rpo_no_mgai", "dance_grpo", "flow_grpo", "mix_grpo"]

# Positive controls for the "first ratio is exactly 1" checks, which a ratio stuck at 1 (old
# log-probs re-scored under the current parameters at every step, a loss that never sees the
# moved parameters) would also pass. Once the parameters have moved, |log ratio| must exceed
# MOVED. Measured on these tiny models: the first |log ratio| is rounding, ~1e-7 (the bf16
# rollout-vs-update layout gap ~4e-4); after one AdamW step at lr 1e-3 it is 1e-2 to 3e-1. MOVED
# sits 10× clear of both.
MOVED = 1e-3


@pytest.fixture
def kept_update_fns(monkeypatch):
    """The jitted updates `_run` builds, kept so that a control can apply one again without
    compiling it a second time (15 to 30 s on 2 CPU cores)."""
    kept, jit_update = [], policy_update.jit_update

    def keep(*args, **kwargs):
        kept.append(jit_update(*args, **kwargs))
        return kept[-1]

    monkeypatch.setattr(policy_update, "jit_update", keep)
    return kept


def _later_step_log_ratios(metrics) -> np.ndarray:
    """max |log ratio| of each optimizer step after the first, i.e. after u ≥ 1 steps."""
    per_step = np.asarray(metrics["log_ratio_abs_max"])                  # [U, S, M]
    assert per_step.shape[0] > 1, "needs more than one optimizer step"
    return per_step.reshape(per_step.shape[0], -1).max(-1)[1:]


def _update_again(out: dict, update_fn, mesh) -> dict:
    """The update applied a second time, from the updated state, to the SAME rollout batch,
    whose stored old log-probs are now stale. Donates the state, so takes it out of `out`."""
    with jax.set_mesh(mesh):
        _, metrics = update_fn(out.pop("state"), out["batch"], out["cond"])
    return policy_update.summarize(metrics)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_first_ratio_is_one_with_rollout_batch_larger_than_update(name, kept_update_fns):
    """DanceGRPO #57: the ratio drifted from 1 when rollout and update batches differed. Here the
    rollout scores 8 prompts × G members in one call (the continuation even more), the update
    works in micro-batches of 2 prompts."""
    mesh = parallel.make_mesh((2, 4, 1))
    out = _run(_algo(name), mesh, policy_update.PolicyUpdate(micro_batch_prompts=2))
    (update_fn,) = kept_update_fns
    first = np.asarray(out["metrics"]["log_ratio_abs_max"][0])   # the first optimizer step
    assert first.shape[-1] == PROMPTS // 2                       # every micro-batch checked
    assert first.max() < 1e-6
    summary = policy_update.summarize(out["metrics"])
    assert summary["first_update_log_ratio_abs_max"] < 1e-6
    for key in ("loss", "clip_fraction", "approx_kl", "grad_norm", "ratio_mean"):
        assert np.isfinite(summary[key])
    assert summary["grad_norm"] > 0
    # Parameters moved.
    after = jax.tree.leaves(out["state"].params)
    assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(out["before"]), after,
                                                     strict=True))
    # Positive controls: the ratio does leave 1 once the parameters have moved, (a) at every
    # later optimizer step of this update, (b) at the first step of an update from the moved
    # parameters on the same batch (the stored old log-probs are now one update old).
    later = _later_step_log_ratios(out["metrics"])
    again = _update_again(out, update_fn, mesh)
    print(f"{name}: |log ratio| first {summary['first_update_log_ratio_abs_max']:.3g}, later "
          f"steps {np.array2string(later, precision=3)}, first of a second update "
          f"{again['first_update_log_ratio_abs_max']:.3g}")
    assert later.min() > MOVED
    assert again["first_update_log_ratio_abs_max"] > MOVED


def test_recomputed_old_log_probs_match_the_rollout(kept_update_fns):
    mesh = parallel.make_mesh((8, 1, 1))
    out = _run(_algo("g2rpo"), mesh,
               policy_update.PolicyUpdate(micro_batch_prompts=4, recompute_old_log_prob=True))
    (update_fn,) = kept_update_fns
    gap = float(out["metrics"]["rollout_log_prob_gap"])
    first = float(np.max(out["metrics"]["log_ratio_abs_max"][0]))
    assert gap < 1e-6
    assert first < 1e-6
    # Positive controls: old log-probs are re-scored once per update, not per optimizer step, so
    # (a) the later steps see a ratio away from 1; (b) from the moved parameters the re-scored
    # values differ from the (stale) stored ones, and the first ratio is 1 again.
    later = _later_step_log_ratios(out["metrics"])
    again = _update_again(out, update_fn, mesh)
    print(f"gap {gap:.3g}, |log ratio| first {first:.3g}, later steps "
          f"{np.array2string(later, precision=3)}; second update: gap "
          f"{again['rollout_log_prob_gap']:.3g}, "
          f"first {again['first_update_log_ratio_abs_max']:.3g}")
    assert later.min() > MOVED
    assert again["rollout_log_prob_gap"] > MOVED
    assert again["first_update_log_ratio_abs_max"] < 1e-6


def test_g2rpo_batch_layout_and_advantages():
    algo = _algo("g2rpo")
    out = _run(algo, parallel.make_mesh((8, 1, 1)), reward_fn=synthetic.brightness_and_contrast,
               reward_weights=(1.0, 0.5))
    batch, stats = out["batch"], out["stats"]
    k, g, j = len(algo.branch_steps), algo.group_size, len(algo.granularities)
    assert batch.x.shape == (k, PROMPTS, 1, TOKENS, CFG.in_channels)       # shared anchor
    assert batch.x_next.shape == (k, PROMPTS, g, TOKENS, CFG.in_channels)
    rewards = np.asarray(stats["rewards"])                                 # [K, J, R, P, G]
    assert rewards.shape == (k, j, 2, PROMPTS, g)
    # Independent recomputation of MGAI: normalise each (k, λ, reward, prompt) group, weight,
    # sum over λ and rewards, clip after the sum.
    normed = (rewards - rewards.mean(-1, keepdims=True)) / (rewards.std(-1, ddof=1, keepdims=True)
                                                            + 1e-8)
    weights = np.array([1.0, 0.5])[None, None, :, None, None]
    expected = np.clip((normed * weights).sum(axis=(1, 2)), -5, 5)
    np.testing.assert_allclose(np.asarray(batch.advantages), expected, atol=1e-4)


@pytest.mark.parametrize("name", ["g2rpo", "dance_grpo"])
def test_rollout_stages_hand_over_one_type(name):
    """`sample` hands `finish` a SampledTransitions in both rollout families; only the
    trajectory rollout has an SDE mask."""
    algo = _algo(name)
    mesh = parallel.make_mesh((8, 1, 1))
    graphdef, params = nnx.split(flux.init_sharded(CFG, mesh, seed=0))
    sample, _ = iteration.make_rollout_stages(graphdef, algo, SIGMAS, (TOKENS, CFG.in_channels),
                                              (1.0,), 3.5)
    _, transitions = jax.eval_shape(sample, params, _cond(mesh), jax.random.key(0), 0)
    assert isinstance(transitions, iteration.SampledTransitions)
    assert transitions.batch.advantages.shape == transitions.batch.old_log_prob.shape
    assert (transitions.sde_mask is None) == (algo.rollout == "singular")


def test_trajectory_advantages_are_per_trajectory():
    algo = _algo("dance_grpo")
    out = _run(algo, parallel.make_mesh((8, 1, 1)))
    adv = np.asarray(out["batch"].advantages)                              # [K, P, G]
    assert adv.shape[0] == algo.num_trained_steps(STEPS)
    np.testing.assert_array_equal(adv, np.broadcast_to(adv[:1], adv.shape))
    np.testing.assert_allclose(adv[0].mean(-1), 0, atol=1e-5)


@pytest.mark.parametrize("steps_per_update", [3, 0])  # 0: all trained steps, here 3
def test_positive_advantage_raises_that_samples_log_prob(steps_per_update):
    """One SGD step on the clipped loss with a single positive advantage raises its log-prob."""
    algo = _algo("g2rpo", clip_range=10.0)    # keep the step inside the clip region
    mesh = parallel.make_mesh((8, 1, 1))
    model = flux.init_sharded(CFG, mesh, seed=0)
    graphdef, params = nnx.split(model)
    cond = _cond(mesh)
    rollout_fn = jax.jit(iteration.make_rollout_fn(graphdef, algo, SIGMAS,
                                                   (TOKENS, CFG.in_channels),
                                                   synthetic.brightness, (1.0,), 3.5))
    with jax.set_mesh(mesh):
        batch, _ = rollout_fn(params, cond, jax.random.key(0), 0)
    adv = np.zeros(batch.advantages.shape, np.float32)
    adv[0, 3, 1] = 1.0                                                      # k=0, prompt 3, member 1
    batch = batch.replace(advantages=jax.device_put(adv, batch.advantages.sharding))
    optimizer = optimizer_lib.make_optimizer(SGD)
    state = policy_update.init_state(jax.tree.map(jnp.copy, params), optimizer, False, mesh)

    def log_prob(params):
        velocity = rollout.make_velocity_fn(nnx.merge(graphdef, params), cond, 3.5)
        v = velocity(batch.x[0], SIGMAS[0])
        return rollout.step_log_prob(v, batch.x[0], batch.x_next[0], SIGMAS, 0, algo.eta)[0]

    with jax.set_mesh(mesh):
        before = np.asarray(jax.jit(log_prob)(state.params))
        settings = policy_update.PolicyUpdate(steps_per_update=steps_per_update)
        update_fn = policy_update.jit_update(
            policy_update.make_update_fn(graphdef, optimizer, algo, settings, SIGMAS),
            state, batch, cond)
        state, _ = update_fn(state, batch, cond)
        after = np.asarray(jax.jit(log_prob)(state.params))
    assert after[3, 1] > before[3, 1]
    # It is the sample the update targeted whose log-prob rose the most.
    assert np.argmax(after - before) == 3 * algo.group_size + 1


def test_host_offloaded_state_gives_the_same_update():
    """offload_optimizer_state / offload_reference: the moments and the KL reference sit in
    pinned host memory before and after the update (the rollout runs without them in device
    memory) and the update is bit-identical to keeping them on the device."""
    algo = _algo("flow_grpo", kl_beta=0.1)     # a KL reference to offload
    mesh = parallel.make_mesh((2, 4, 1))
    kept = _run(algo, mesh, policy_update.PolicyUpdate(steps_per_update=1))
    offloaded = _run(algo, mesh, policy_update.PolicyUpdate(
        steps_per_update=1, offload_optimizer_state=True, offload_reference=True))
    kinds = lambda tree: {a.sharding.memory_kind for a in jax.tree.leaves(tree)}
    assert kinds(offloaded["state"].opt_state) == {"pinned_host"}
    assert kinds(offloaded["state"].ref_params) == {"pinned_host"}
    assert kinds(offloaded["state"].params) == {"device"}
    assert kinds(kept["state"].opt_state) == {"device"}
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, offloaded["state"]),
                 jax.tree.map(np.asarray, kept["state"]))
    # A moved state: the comparison above is not between two untouched initial states.
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(),
                         offloaded["state"].params, offloaded["before"])
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["g2rpo", "dance_grpo"])
def test_sharded_iterations_match_unsharded(name):
    """Rollout and update on (8,1,1) and (2,2,2) meshes agree with one device.

    The rollout is compared on its outputs. The update is compared on the SAME rollout batch:
    group-normalised advantages divide by the group's reward spread, which for a random model's
    synthetic reward is tiny, so rounding-level differences in the samples would otherwise show
    up magnified in the advantages and say nothing about the update's sharding.
    """
    algo = _algo(name)
    settings = policy_update.PolicyUpdate(steps_per_update=1)
    single = parallel.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    reference = _run(algo, single, settings, optimizer_config=SGD)
    ref_batch = jax.tree.map(np.asarray, reference["batch"])
    for shape in ((8, 1, 1), (2, 2, 2)):
        mesh = parallel.make_mesh(shape)
        out = _run(algo, mesh, settings, optimizer_config=SGD)
        np.testing.assert_allclose(np.asarray(out["batch"].x_next), ref_batch.x_next, atol=1e-5)
        np.testing.assert_allclose(np.asarray(out["batch"].old_log_prob), ref_batch.old_log_prob,
                                   atol=1e-5)
        np.testing.assert_allclose(np.asarray(out["stats"]["reward_mean"]),
                                   np.asarray(reference["stats"]["reward_mean"]), atol=1e-6)

        # The update, sharded, on the reference rollout.
        model = flux.init_sharded(CFG, mesh, seed=0)
        graphdef, params = nnx.split(model)
        optimizer = optimizer_lib.make_optimizer(SGD)
        state = policy_update.init_state(params, optimizer, False, mesh)
        batch = jax.tree.map(lambda ref, placed: jax.device_put(ref, placed.sharding), ref_batch,
                             out["batch"])
        cond = _cond(mesh)
        with jax.set_mesh(mesh):
            update_fn = policy_update.jit_update(
                policy_update.make_update_fn(graphdef, optimizer, algo, settings, SIGMAS),
                state, batch, cond)
            state, metrics = update_fn(state, batch, cond)
        # The loss is -mean(A·ratio) with mean(A) = 0: O(1) terms cancel, so the tolerance is
        # absolute, at float32 rounding of the terms.
        np.testing.assert_allclose(np.asarray(metrics["loss"]),
                                   np.asarray(reference["metrics"]["loss"]), atol=2e-6)
        np.testing.assert_allclose(np.asarray(metrics["grad_norm"]),
                                   np.asarray(reference["metrics"]["grad_norm"]), rtol=1e-4)
        # Updated parameters agree to a small fraction of how far the update moved them.
        for a, b, start in zip(jax.tree.leaves(state.params),
                               jax.tree.leaves(reference["state"].params),
                               jax.tree.leaves(reference["before"]), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            moved = np.abs(b - start).max()
            assert moved > 0
            assert np.abs(a - b).max() <= 1e-2 * moved
        if shape == (2, 2, 2):  # the parameters really are split
            kernel = state.params["double_blocks"]["img_attn"]["q"]["kernel"][...]
            assert kernel.addressable_shards[0].data.size == kernel.size // 4


def test_policy_update_errors():
    algo = _algo("g2rpo")
    mesh = parallel.make_mesh((8, 1, 1))
    with pytest.raises(ValueError, match="steps_per_update=2 must divide the 3 trained steps"):
        _run(algo, mesh, policy_update.PolicyUpdate(steps_per_update=2))
    with pytest.raises(ValueError, match="micro_batch_prompts=3 must divide the 8 prompts"):
        _run(algo, mesh, policy_update.PolicyUpdate(micro_batch_prompts=3))




def test_bfloat16_ratio_is_one_with_recomputed_old_log_probs(kept_update_fns):
    """In bf16 the rollout's batch shapes round differently from the update's (the peers'
    DanceGRPO #57); re-scoring the stored transitions in the update's layout makes the first
    ratio exactly 1, and the rollout-vs-update gap is reported."""
    mesh = parallel.make_mesh((2, 4, 1))
    out = _run(_algo("g2rpo"), mesh,
               policy_update.PolicyUpdate(micro_batch_prompts=2, recompute_old_log_prob=True),
               model_config=dataclasses.replace(CFG, dtype="bfloat16"))
    (update_fn,) = kept_update_fns
    summary = policy_update.summarize(out["metrics"])
    assert summary["first_update_log_ratio_abs_max"] < 1e-6
    assert np.isfinite(summary["rollout_log_prob_gap"])
    # Positive controls, as in the float32 case; in bf16 the moved parameters must also stand
    # out above the layout gap of the first update.
    later = _later_step_log_ratios(out["metrics"])
    again = _update_again(out, update_fn, mesh)
    print(f"gap {summary['rollout_log_prob_gap']:.3g}, |log ratio| first "
          f"{summary['first_update_log_ratio_abs_max']:.3g}, later steps "
          f"{np.array2string(later, precision=3)}; second update: gap "
          f"{again['rollout_log_prob_gap']:.3g}, "
          f"first {again['first_update_log_ratio_abs_max']:.3g}")
    assert later.min() > MOVED
    assert again["rollout_log_prob_gap"] > max(MOVED, 10 * summary["rollout_log_prob_gap"])
    assert again["first_update_log_ratio_abs_max"] < 1e-6


# --------------------------------------------------------------------------------------------
# The update's pieces, alone, on a toy linear loss: ∇_w Σ w·x = Σ x.
# --------------------------------------------------------------------------------------------


def _toy_batch(num_steps, prompts, scale=1.0):
    x = scale * jnp.arange(num_steps * prompts * 2, dtype=jnp.float32).reshape(
        num_steps, prompts, 2)
    zeros = jnp.zeros((num_steps, prompts), jnp.float32)
    return policy_update.TrainBatch(x=x, x_next=x, step=jnp.arange(num_steps),
                                    old_log_prob=zeros, advantages=zeros)


def _toy_cond(prompts):
    return {"txt": jnp.arange(prompts, dtype=jnp.float32)[:, None],
            "y": jnp.zeros((prompts, 1)), "img_ids": jnp.zeros((3,))}


def _toy_loss(params, item, cond, ref_params):
    del cond, ref_params
    loss = jnp.sum(params["w"] * item.x)
    return loss, {"loss": loss}


def test_micro_batches_interleave_prompts():
    split = policy_update.micro_batches(jnp.arange(6), 3)
    np.testing.assert_array_equal(split, [[0, 3], [1, 4], [2, 5]])
    cond = policy_update.micro_batch_cond(_toy_cond(6), 3)
    np.testing.assert_array_equal(cond["txt"][..., 0], [[0, 3], [1, 4], [2, 5]])
    assert cond["img_ids"].shape == (3, 3)                  # shared entries repeated


def test_group_gradient_sums_steps_and_micro_batches():
    group = _toy_batch(num_steps=2, prompts=4)
    params = {"w": jnp.ones((2,))}
    grads, metrics = policy_update.group_gradient(
        _toy_loss, params, None, group, policy_update.micro_batch_cond(_toy_cond(4), 2), 2)
    np.testing.assert_allclose(grads["w"], group.x.sum(axis=(0, 1)))
    assert metrics["loss"].shape == (2, 2)                  # [S, M]
    np.testing.assert_allclose(metrics["loss"].sum(), group.x.sum())


@pytest.mark.parametrize("scale, skipped", [(1.0, False), (jnp.nan, True)])
def test_optimizer_step_averages_and_skips_non_finite(scale, skipped):
    optimizer = optax.sgd(0.1)
    params = {"w": jnp.ones((2,))}
    state = policy_update.TrainState(params=params, opt_state=optimizer.init(params),
                                     ref_params=None, step=jnp.zeros((), jnp.int32))
    group = _toy_batch(num_steps=2, prompts=4, scale=scale)
    new, (_, grad_norm, was_skipped) = policy_update.optimizer_step(
        state, group, loss_fn=_toy_loss, optimizer=optimizer,
        cond_micro=policy_update.micro_batch_cond(_toy_cond(4), 2), count=2)
    assert bool(was_skipped) == skipped
    if skipped:
        np.testing.assert_array_equal(new.params["w"], params["w"])
        assert int(new.step) == 0
    else:
        mean_grad = group.x.sum(axis=(0, 1)) / (2 * 2)      # S steps × micro-batches
        np.testing.assert_allclose(new.params["w"], params["w"] - 0.1 * mean_grad, rtol=1e-6)
        np.testing.assert_allclose(grad_norm, np.linalg.norm(mean_grad), rtol=1e-6)
        assert int(new.step) == 1


@pytest.mark.parametrize("name", ["g2rpo", "flow_grpo"])   # flow_grpo: the KL reference too
def test_lora_update_trains_only_the_adapters(name):
    """With LoRA the train state's params are the adapters: the optimizer state holds only
    them, the update moves them, and the frozen base comes out bit-identical."""
    from g2rpo_jax.models import lora

    algo = _algo(name, **({"kl_beta": 0.1} if name == "flow_grpo" else {}))
    mesh = parallel.make_mesh((2, 4, 1))
    model = lora.apply(flux.init_sharded(CFG, mesh, seed=0), lora.LoRAConfig(rank=2, alpha=4.0),
                       0, mesh=mesh)
    graphdef = nnx.graphdef(model)
    adapters, frozen = nnx.state(model, nnx.LoRAParam, ...)
    cond = _cond(mesh)
    rollout_fn = jax.jit(iteration.make_rollout_fn(graphdef, algo, SIGMAS,
                                                   (TOKENS, CFG.in_channels),
                                                   synthetic.brightness, (1.0,), 3.5))
    optimizer = optimizer_lib.make_optimizer(SGD)
    state = policy_update.init_state(jax.tree.map(jnp.copy, adapters), optimizer, False, mesh,
                                     frozen=frozen)
    size = lambda tree: sum(np.size(a) for a in jax.tree.leaves(tree))
    assert size(state.opt_state) <= 2 * size(adapters) + 8 < size(frozen)   # moments: adapters
    frozen_before = jax.tree.map(np.asarray, frozen)
    adapters_before = jax.tree.map(np.asarray, adapters)
    with jax.set_mesh(mesh):
        batch, _ = rollout_fn(state.policy_params(), cond, jax.random.key(0), 0)
        batch = batch.replace(advantages=jax.device_put(
            np.random.default_rng(0).normal(size=batch.advantages.shape).astype(np.float32),
            batch.advantages.sharding))
        update_fn = policy_update.jit_update(
            policy_update.make_update_fn(graphdef, optimizer, algo,
                                         policy_update.PolicyUpdate(steps_per_update=1), SIGMAS),
            state, batch, cond)
        state, metrics = update_fn(state, batch, cond)
    assert float(np.sum(metrics["skipped"])) == 0
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, state.frozen),
                 frozen_before)
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), state.params,
                         adapters_before)
    assert max(jax.tree.leaves(moved)) > 0


@pytest.mark.parametrize("name, overrides, settings", [
    # G²RPO: the group shares x_k (Gx = 1); all trained steps in one optimizer step, with
    # prompt micro-batches and re-scored old log-probs.
    ("g2rpo", {}, dict(steps_per_update=0, micro_batch_prompts=4, recompute_old_log_prob=True)),
    # Flow-GRPO: one x per member (Gx = G), a KL reference, groups of 2 of its steps.
    ("flow_grpo", dict(kl_beta=0.1, branch_steps=(0, 1, 2, 3)), dict(steps_per_update=2)),
])
def test_batched_steps_equal_the_scan_over_steps(name, overrides, settings):
    """batch_steps: the S steps of a group in one forward and backward is the same loss as the
    scan over steps, summed in another order: states and metrics agree to float32 rounding."""
    algo = _algo(name, **overrides)
    mesh = parallel.make_mesh((2, 4, 1))
    scanned = _run(algo, mesh, policy_update.PolicyUpdate(**settings))
    batched = _run(algo, mesh, policy_update.PolicyUpdate(batch_steps=True, **settings))
    moved = [np.abs(np.asarray(a) - b).max() for a, b in zip(
        jax.tree.leaves(scanned["state"].params), jax.tree.leaves(scanned["before"]))]
    assert max(moved) > 1e-4          # the states compared are not the untouched initial one
    for a, b in zip(jax.tree.leaves(batched["state"].params),
                    jax.tree.leaves(scanned["state"].params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)
    for key in ("loss", "log_ratio_abs_max", "grad_norm", "clip_fraction"):
        got, want = np.asarray(batched["metrics"][key]), np.asarray(scanned["metrics"][key])
        assert got.shape == want.shape, key
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=key)
    if settings.get("recompute_old_log_prob"):
        assert float(batched["metrics"]["rollout_log_prob_gap"]) < 1e-5
        assert float(np.max(batched["metrics"]["log_ratio_abs_max"][0])) < 1e-6
