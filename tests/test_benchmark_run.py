"""benchmarks/run.py: its smoke run, and that the PyTorch rollouts it times against compute what
ours computes (same weights, same branch noise), with the transformer calls our plan counts."""

import copy as copy_module
import functools
import importlib.util
import os
import re
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.models import flops, flux, flux_weights
from g2rpo_jax.rl import algorithms, iteration
from g2rpo_jax.sampling import rollout, schedules, sde
from g2rpo_jax.testing import flux_reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")
LAST_LINE = re.compile(r"rollout_speedup_vs_reference_loop=(\d+\.\d\d) "
                       r"rollout_speedup_vs_torch_batched=(\d+\.\d\d) "
                       r"train_speedup_vs_torch=(\d+\.\d\d) cpu_peak_fraction=(\d+\.\d\d)")


@functools.cache
def _module(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCHMARKS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_toy_run_prints_the_summary_line(tmp_path):
    out = tmp_path / "run.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("JAX_NUM_CPU_DEVICES", None)
    proc = subprocess.run([sys.executable, os.path.join(BENCHMARKS, "run.py"), "--size=toy",
                           f"--out={out}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    match = LAST_LINE.fullmatch(lines[-1])
    assert match, lines[-1]
    table = "\n".join(lines)
    for name in ("tiny_rollout", "medium_rollout", "medium_train", "matmul_peak"):
        assert re.search(rf"^{name}\s", table, re.M), name
    import json
    result = json.loads(out.read_text())
    assert result["size"] == "toy"
    # The toy sizes time sub-millisecond calls, so a ratio can print as 0.00 on a loaded machine:
    # the printed line must agree with the file, whose ratios must be positive and finite.
    keys = ("rollout_speedup_vs_reference_loop", "rollout_speedup_vs_torch_batched",
            "train_speedup_vs_torch", "cpu_peak_fraction")
    for key, printed in zip(keys, match.groups()):
        assert 0 < result[key] < np.inf, (key, result[key])
        assert printed == f"{result[key]:.2f}", (key, printed, result[key])
    for m in result["measurements"].values():
        assert m["ours"]["peak_rss_mib"] > 0 and m["torch"]["peak_rss_mib"] > 0
    assert result["measurements"]["tiny_rollout"]["torch"]["last"]["finite"]
    assert result["measurements"]["medium_rollout"]["ours"]["last"]["finite"]


# Hidden 32, 2 + 2 blocks, with the guidance embedding; 3×4 image tokens, 5 text tokens.
P, T, G, ETA, GUIDANCE = 2, 6, 2, 0.7, 3.5
BRANCH_STEPS, GRANULARITIES = (0, 2, 3), (1, 2, 3)


@pytest.fixture(scope="module")
def same_weights(tmp_path_factory):
    """(diffusers model, our model) with the same random weights, diffusers' own files."""
    directory = str(tmp_path_factory.mktemp("flux"))
    torch_model = ref.write_diffusers_flux(directory, seed=3, guidance_embeds=True)
    return torch_model, flux_weights.from_pretrained(directory)


def test_flop_counter_matches_the_issue_figure():
    """The medium config's forward at batch 12 × (256 + 32) tokens: about 290 GFLOP (the figure
    benchmarks/run.py's W rests on); a double block more adds its own hand count."""
    cfg = flux.FluxConfig(num_layers=4, num_single_layers=8, attention_head_dim=64,
                          num_attention_heads=8, axes_dims_rope=(8, 28, 28))
    per_sample = flops.flux_forward_flops(cfg, 256, 32)
    assert 280e9 < 12 * per_sample < 300e9
    more = flux.FluxConfig(num_layers=5, num_single_layers=8, attention_head_dim=64,
                           num_attention_heads=8, axes_dims_rope=(8, 28, 28))
    h, seq = 512, 288
    double = 2 * 2 * seq * seq * h + 2 * 2 * h * 6 * h + 2 * seq * h * (3 * h + h + 8 * h)
    assert flops.flux_forward_flops(more, 256, 32) - per_sample == double
    assert flops.flux_train_flops(cfg, 256, 32, 4) == 12 * per_sample


def test_torch_rollouts_match_ours(same_weights):
    torch_model, model = same_weights
    tfr = _module("torch_flux_rollout")
    config = ref.tiny_diffusers_config(guidance_embeds=True)
    inputs = ref.random_inputs(config, batch=P, seed=5)
    cond = dict(txt=inputs["txt"], y=inputs["y"], img_ids=inputs["img_ids"],
                txt_ids=inputs["txt_ids"])
    n, c = inputs["img"].shape[1:]
    sigmas = np.asarray(schedules.flux_sigmas(T, 3.0), np.float32)
    algo = algorithms.Algorithm.from_config(algorithms.preset(
        "g2rpo", group_size=G, branch_steps=BRANCH_STEPS, granularities=GRANULARITIES,
        granularity_weights=(1.0,) * len(GRANULARITIES), eta=ETA))
    plan = iteration.continuation_plan(algo, sigmas)
    graphdef, params = nnx.split(model)
    sample, _ = iteration.make_rollout_stages(graphdef, algo, sigmas, (n, c), (1.0,), GUIDANCE)
    jcond = {k: jnp.asarray(v) for k, v in cond.items()}
    finals, transitions = jax.jit(sample)(params, jcond, jax.random.key(7), 0)
    num_k, num_j = len(BRANCH_STEPS), len(GRANULARITIES)
    finals = np.asarray(finals).reshape(P, num_k, num_j, G, n, c).transpose(1, 2, 0, 3, 4, 5)
    batch = transitions.batch
    x_k, x_next = np.asarray(batch.x), np.asarray(batch.x_next)

    # The branch noise ours drew: ε = (x_{k+1} - μ) / s from the anchor's velocity at x_k.
    velocity = rollout.make_velocity_fn(model, jcond, GUIDANCE)
    eps = []
    for i, k in enumerate(BRANCH_STEPS):
        v = velocity(jnp.asarray(x_k[i]), sigmas[k])
        flat = lambda a: jnp.broadcast_to(a, (P, G, n, c)).reshape(P * G, n, c)
        _, _, mean, std = sde.flow_grpo_step(flat(x_k[i]), flat(v), sigmas, k, ETA,
                                             x_next=flat(x_next[i]))
        eps.append(((flat(x_next[i]) - mean) / std).reshape(P, G, n, c))
    eps = np.asarray(jnp.stack(eps))
    x_init = x_k[0, :, 0]  # branch step 0 starts at the initial noise

    passes = algo.rollout_forward_passes(T, plan)
    outs = {}
    for name, fn in (("reference", tfr.reference_rollout), ("batched", tfr.batched_rollout)):
        v_torch = tfr.Velocity(torch_model, cond, GUIDANCE)
        outs[name] = {k: v.numpy() for k, v in fn(v_torch, x_init, sigmas, BRANCH_STEPS, G, ETA,
                                                  plan, branch_noise=eps).items()}
        if name == "reference":  # one sample per call; the anchor serves the group at x_k
            assert v_torch.samples == v_torch.calls == P * passes["useful"]
        else:                    # ours: the anchor's T calls, then one call per scan step
            assert v_torch.calls == T + plan.length
            assert v_torch.samples == P * passes["computed"]
        out = outs[name]
        np.testing.assert_allclose(out["anchor"][list(BRANCH_STEPS)], x_k[:, :, 0], atol=1e-4)
        np.testing.assert_allclose(out["x_next"], x_next, atol=1e-4)
        np.testing.assert_allclose(out["log_prob"], np.asarray(batch.old_log_prob), atol=1e-4)
        np.testing.assert_allclose(out["finals"], finals, atol=1e-4)
    # Packing and looping agree more tightly than either does with the JAX port.
    np.testing.assert_allclose(outs["batched"]["finals"], outs["reference"]["finals"], atol=1e-5)
    # The finals differ between granularities and between members by far more than the
    # tolerance, so a mixed-up schedule or noise would fail the comparisons above.
    for j in range(num_j - 1):
        assert np.abs(finals[0, j] - finals[0, j + 1]).max() > 1e-2
    assert np.abs(finals[0, 0, :, 0] - finals[0, 0, :, 1]).max() > 1e-2


def test_torch_train_step_loss_matches_ours(same_weights):
    """The torch update's loss on a TrainBatch is ours: the ratio starts at 1, so the loss is
    -mean(A), and its log-probs re-scored under the same weights agree with the rollout's."""
    torch_model, model = same_weights
    tfr = _module("torch_flux_rollout")
    inputs = ref.random_inputs(ref.tiny_diffusers_config(guidance_embeds=True), batch=P, seed=6)
    cond = dict(txt=inputs["txt"], y=inputs["y"], img_ids=inputs["img_ids"],
                txt_ids=inputs["txt_ids"])
    n, c = inputs["img"].shape[1:]
    sigmas = np.asarray(schedules.flux_sigmas(T, 3.0), np.float32)
    algo = algorithms.Algorithm.from_config(algorithms.preset(
        "g2rpo", group_size=G, branch_steps=(0, 2), granularities=(1,),
        granularity_weights=(1.0,), eta=ETA, clip_range=0.2))
    graphdef, params = nnx.split(model)
    sample, _ = iteration.make_rollout_stages(graphdef, algo, sigmas, (n, c), (1.0,), GUIDANCE)
    _, transitions = jax.jit(sample)(params, {k: jnp.asarray(v) for k, v in cond.items()},
                                     jax.random.key(1), 0)
    batch = {k: np.asarray(getattr(transitions.batch, k))
             for k in ("x", "x_next", "step", "old_log_prob")}
    adv = np.random.default_rng(0).normal(size=batch["old_log_prob"].shape).astype(np.float32)
    batch["advantages"] = adv
    copy = copy_module.deepcopy(torch_model)
    velocity = tfr.Velocity(copy.train(), cond, GUIDANCE)
    opt = tfr.make_optimizer(copy, dict(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8,
                                        weight_decay=0.0))
    before = [p.detach().clone() for p in copy.parameters()]
    loss = tfr.train_step(velocity, opt, batch, sigmas, ETA, 0.2, 1.0)
    assert loss == pytest.approx(-adv.mean(axis=(1, 2)).mean(), abs=1e-4)
    assert velocity.calls == 1 and velocity.samples == 2 * P
    moved = [float((p.detach() - b).abs().max()) for p, b in zip(copy.parameters(), before)]
    assert max(moved) > 0
