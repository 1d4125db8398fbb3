"""The command-line entry point, run as a user runs it."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(*args, devices=8):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices))
    return subprocess.run([sys.executable, "-m", "g2rpo_jax.main", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_describe_tiny_with_overrides(tmp_path):
    result = _run("--config=configs/flux_tiny.py", f"--workdir={tmp_path}",
                  "--config.model.num_layers=1", "--config.mesh.data=2",
                  "--config.mesh.fsdp=2", "--config.mesh.tensor=2")
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "describe.json").read_text())
    assert report["mesh"] == {"data": 2, "fsdp": 2, "tensor": 2}
    assert report["devices"] == 8
    # hidden 64: the override removed one of the two double blocks (each 12·64² + ... params).
    full = _run("--config=configs/flux_tiny.py", f"--workdir={tmp_path}/full", devices=1)
    assert full.returncode == 0, full.stderr
    full_report = json.loads((tmp_path / "full" / "describe.json").read_text())
    assert report["parameters"] < full_report["parameters"]
    assert report["batch"]["size"] == 4  # data · fsdp
    assert report["forward_s"] > 0 and report["compile_s"] > 0
    # Per-device parameter memory shrinks with fsdp · tensor.
    assert report["parameter_mib_per_device"] < full_report["parameter_mib_per_device"]


def test_bad_mesh_fails_with_a_clear_message(tmp_path):
    result = _run("--config=configs/flux_tiny.py", f"--workdir={tmp_path}",
                  "--config.mesh.data=3")
    assert result.returncode != 0
    assert "Mesh (data=3, fsdp=1, tensor=1) has 3 positions but there are 8 devices" in result.stderr


def test_heads_must_divide_tensor(tmp_path):
    result = _run("--config=configs/flux_tiny.py", f"--workdir={tmp_path}",
                  "--config.mesh.data=1", "--config.mesh.tensor=8")
    assert result.returncode != 0
    assert "num_attention_heads=4 is not divisible by the mesh's tensor axis (8)" in result.stderr


@pytest.mark.parametrize("args", [["--helpfull"], ["--help"]])
def test_help_describes_flags(args):
    result = _run(*args, devices=1)
    assert "--config" in result.stdout and "--workdir" in result.stdout
