"""The tiny FLUX RL path (configs/flux_tiny.py, task "flux") as one JAX job of two processes
(jax.distributed on this machine, one CPU device each) against the same run in one process with
two devices: the same mesh and global batch, so the same prompts, rewards, held-out evaluations,
metrics and parameters (up to float reduction order), with a checkpoint and a resume across
processes. The shapes task's proof is tests/test_multihost.py."""

import json
import subprocess
import sys
import time

import numpy as np
import pytest
import resume_helpers as rh
from test_flux_path import tiny_config
from test_multihost import _ATOL, _RTOL, _assert_ok, _assert_same_rows, _by_step

from g2rpo_jax import preprocess
from g2rpo_jax.run import checkpoint
from g2rpo_jax.testing import flux_fixture

# Rows after the first update: Adam divides each gradient by its own root mean square, so the
# two layouts' reduction-order differences in tiny gradients become parameter differences of a
# fraction of the learning rate, and the rewards of the next images differ by up to ~3e-4
# relative (CI); a wrong prompt, noise or mesh would differ by orders of magnitude more.
_RTOL_AFTER_UPDATE = 2e-3


@pytest.fixture(scope="module")
def flux_setup(tmp_path_factory):
    """The tiny FLUX.1-dev, rewards and prompts, and their prepared embedding datasets."""
    root = str(tmp_path_factory.mktemp("flux"))
    overrides = flux_fixture.write_tiny_setup(root)
    preprocess.preprocess(tiny_config(overrides))
    return overrides


def _flags(workdir, overrides, cache_dir, iterations):
    """2 prompts per iteration (one per process), held-out evaluation of 2 prompts before and
    after every iteration, a checkpoint every iteration; the default mesh (data = all devices)
    is data=2 in both layouts."""
    return ["--config=configs/flux_tiny.py", "--config.mode=train", f"--workdir={workdir}",
            f"--config.train.num_iterations={iterations}",
            "--config.train.prompts_per_iteration=2", "--config.train.eval_every=1",
            "--config.train.checkpoint_every=1", "--config.train.images_in_grid=2",
            "--config.evaluation.num_prompts=2", "--config.mesh.data=2",
            "--config.mesh.fsdp=1", f"--config.compilation_cache_dir={cache_dir}",
            *[f"--config.{k}={v}" for k, v in overrides.items()]]


@pytest.mark.slow
def test_two_processes_train_evaluate_and_resume_like_one(flux_setup, tmp_path):
    """Two processes × 1 device, 1 iteration, then resumed to 2 in two processes, against one
    process × 2 devices running 2 iterations: every metric row (training and held-out
    evaluation) and every array of the last checkpoint agree; process 0 alone writes the
    outputs."""
    cache = tmp_path / "cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    start = time.perf_counter()
    reference = rh.run_main(_flags(single, flux_setup, cache, 2), devices=2)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-6000:]
    single_seconds = time.perf_counter() - start

    start = time.perf_counter()
    _assert_ok(rh.run_processes(_flags(multi, flux_setup, cache, 1)))
    assert checkpoint.RunCheckpoints(str(multi)).steps() == [1]
    resumed = rh.run_processes(_flags(multi, flux_setup, cache, 2))
    _assert_ok(resumed)
    multi_seconds = time.perf_counter() - start
    for result in resumed:
        assert "Resuming" in result.stdout and "from iteration 1" in result.stdout

    rows = {name: rh.computed_rows(d) for name, d in (("single", single), ("multi", multi))}
    _assert_same_rows(rows["single"], rows["multi"], rtol_after_update=_RTOL_AFTER_UPDATE)
    assert any("train/loss" in r for r in rows["multi"])
    assert any(k.startswith("eval/") for r in rows["multi"] for k in r), rows["multi"]
    a, b = rh.read_step(str(single / "checkpoints" / "2")), rh.read_step(
        str(multi / "checkpoints" / "2"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=_RTOL, atol=1e-5, err_msg=name)
    # The rewards of the same prompts and images: decoded and scored on one device per process
    # against two in one process, so equal up to the decoder's float order.
    rewards = [[r["train/reward_hps"] for r in rh.metrics_rows(d) if "train/reward_hps" in r]
               for d in (single, multi)]
    assert len(rewards[0]) == 2
    np.testing.assert_allclose(rewards[1], rewards[0], rtol=_RTOL_AFTER_UPDATE, atol=_ATOL)
    summaries = [json.loads((d / "summary.json").read_text()) for d in (single, multi)]
    for name in summaries[0]["final"]:
        np.testing.assert_allclose(summaries[1]["final"][name], summaries[0]["final"][name],
                                   rtol=_RTOL_AFTER_UPDATE, atol=_ATOL, err_msg=name)
    # The FLUX task's output is the Orbax checkpoint (FluxTask.save writes nothing more).
    for name in ("summary.json", "images/base.png", "images/final.png", "reward_curves.png"):
        assert (multi / name).exists(), name
    assert rh.loop_item(str(multi / "checkpoints" / "2"))["iteration"] == 2

    # The run exported by two processes (parameters sharded over fsdp across them, gathered
    # tensor by tensor, written by process 0) is byte for byte the one-process export.
    export_flags = [f for f in _flags(multi, flux_setup, cache, 2)
                    if f.startswith(("--config=", "--config.model.", "--config.compilation"))]
    export_flags += [f"--checkpoint={multi}", "--config.mesh.data=1", "--config.mesh.fsdp=2"]
    exported = rh.run_processes([*export_flags, f"--out={tmp_path / 'export_2p'}"],
                                module="g2rpo_jax.export")
    _assert_ok(exported)
    assert "exported" in exported[0].stdout and "exported" not in exported[1].stdout
    one = subprocess.run([sys.executable, "-m", "g2rpo_jax.export", *export_flags,
                          f"--out={tmp_path / 'export_1p'}"], cwd=rh.ROOT,
                         env=rh.environment(2), capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tmp_path / "export_2p" / weights).read_bytes() == (
        tmp_path / "export_1p" / weights).read_bytes()

    param_diff = max(float(np.abs(np.asarray(b[n], np.float64) - a[n]).max()) for n in a)
    merged = [_by_step(rows[n]) for n in ("single", "multi")]
    metric_diff = max(abs(float(merged[1][step][k]) - float(v))
                      for step in merged[0] for k, v in merged[0][step].items())
    print(f"tiny FLUX: 1 process × 2 devices {single_seconds:.0f} s (2 iterations), 2 processes "
          f"× 1 device {multi_seconds:.0f} s (1 + resumed 1); max |Δ| parameters/optimizer "
          f"{param_diff:.1e}, metrics {metric_diff:.1e}; rewards equal: "
          f"{rewards[0] == rewards[1]}")
