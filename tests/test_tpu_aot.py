"""benchmarks/perf/tpu_aot.py: its flop model against XLA's own count, its pieces on the local CPU
devices with a tiny config, and its error without libtpu."""

import functools
import importlib.util
import json
import os
import subprocess
import sys

from flax import nnx
import jax
import jax.numpy as jnp
import pytest

from g2rpo_jax.models import flops, flux

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "perf", "tpu_aot.py")


@functools.cache
def tpu_aot():
    spec = importlib.util.spec_from_file_location("tpu_aot", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("layers,singles,heads,image,text", [(1, 1, 4, 64, 16), (2, 3, 8, 128, 32)])
def test_flop_model_matches_xla_without_loops(layers, singles, heads, image, text):
    """Unrolled blocks on one device: no loop XLA could count once. XLA also counts the
    elementwise work (norms, softmax, GELU), so it is a little above the matmul count."""
    cfg = flux.FluxConfig(num_layers=layers, num_single_layers=singles, attention_head_dim=64,
                          num_attention_heads=heads, axes_dims_rope=(16, 24, 24),
                          joint_attention_dim=128, pooled_projection_dim=64, in_channels=16,
                          scan_layers=False)
    graphdef, params = nnx.split(flux.abstract_model(cfg))
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    args = dict(img=s(1, image, 16), img_ids=s(image, 3), txt=s(1, text, 128), txt_ids=s(text, 3),
                timesteps=s(1), y=s(1, 64), guidance=s(1))
    compiled = jax.jit(lambda p, a: nnx.merge(graphdef, p)(**a)).lower(params, args).compile()
    ratio = compiled.cost_analysis()["flops"] / flops.flux_forward_flops(cfg, image, text)
    assert 1.0 <= ratio < 1.03, ratio


def test_flux_dev_forward_flops():
    """FLUX.1-dev at 720×720 with a 512-token prompt: 57 blocks × (12·D² per token + 2·S²·D)
    multiply-adds ≈ 37 TFLOP per sample."""
    count = flops.flux_forward_flops(flux.FluxConfig(), 2025, 512)
    d, s = 3072, 2537
    assert count == pytest.approx(2 * 57 * (12 * d * d * s + 2 * s * s * d), rel=0.01)
    assert 3.7e13 < count < 3.8e13


@pytest.mark.slow
def test_pieces_compile_on_cpu_devices(tmp_path):
    out = tmp_path / "aot.json"
    result = _run("--topology=cpu", "--config=configs/flux_tiny.py",
                  "--pieces=forward,sample,update", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["chips"] == 8 and report["prompts_per_iteration"] == 8
    rows = {row["piece"]: row for row in report["pieces"]}
    assert set(rows) == {"forward", "sample", "update"}
    for row in rows.values():
        assert row["total_gib"] > 0 and row["compile_s"] > 0 and row["model_flops_per_chip"] > 0
    # The update donates the train state: its parameters and moments alias the outputs.
    assert rows["update"]["alias_gib"] > 0
    # The rollout runs beside the resident AdamW moments.
    assert rows["sample"]["resident_gib"] > 0
    assert rows["sample"]["host_resident_gib"] == 0
    # Offloaded to pinned host memory they are not in the rollout's device peak, and the
    # update takes them as host arguments.
    result = _run("--topology=cpu", "--config=configs/flux_tiny.py", "--pieces=sample,update",
                  "--config.policy_update.offload_optimizer_state=True", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    offloaded = {row["piece"]: row for row in json.loads(out.read_text())["pieces"]}
    assert offloaded["sample"]["resident_gib"] == 0
    assert offloaded["sample"]["host_resident_gib"] == pytest.approx(
        rows["sample"]["resident_gib"])
    assert offloaded["sample"]["peak_gib"] == pytest.approx(
        rows["sample"]["peak_gib"] - rows["sample"]["resident_gib"])
    # LoRA: the moments are the adapters' (rank 2: a small fraction of the full moments), and
    # the update takes the frozen base beside them.
    result = _run("--topology=cpu", "--config=configs/flux_tiny.py", "--pieces=sample,update",
                  "--config.model.lora.rank=2", f"--out={out}")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    adapted = {row["piece"]: row for row in report["pieces"]}
    assert report["model"]["lora_rank"] == 2
    assert 0 < adapted["sample"]["resident_gib"] < 0.2 * rows["sample"]["resident_gib"]
    assert adapted["update"]["argument_gib"] < rows["update"]["argument_gib"]


def test_without_libtpu_the_error_names_the_install_command():
    # libtpu belongs in a separate environment (benchmarks/perf/tpu_aot.py's docstring), never in
    # the test one: the default install and CI stay CPU-only.
    assert importlib.util.find_spec("libtpu") is None, (
        "libtpu is installed in the test environment; install it in a separate venv "
        "(python -m venv --system-site-packages ~/tpuenv) as benchmarks/perf/tpu_aot.py says.")
    result = _run("--topology=v5p:2x2x2", "--pieces=forward")
    assert result.returncode != 0
    assert 'pip install "jax[tpu]==' in result.stderr
