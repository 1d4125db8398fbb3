"""The PyTorch → safetensors converter (`python -m g2rpo_jax.convert`)."""

import builtins
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from g2rpo_jax.models import clip_weights, torch_checkpoints, weights


def test_converter_handles_prefixes_bf16_and_extras(tmp_path):
    torch.save({"module.a": torch.ones(2, 3, dtype=torch.bfloat16), "module.b": torch.arange(4),
                "note": "not a tensor"}, tmp_path / "x.bin")
    out = torch_checkpoints.convert_torch_checkpoint(tmp_path / "x.bin")
    checkpoint = weights.SafetensorsCheckpoint(out)
    assert checkpoint.keys() == ["a", "b"]
    assert checkpoint.dtype("a") == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(checkpoint.array("b"), np.arange(4))


def test_open_checkpoint_converts_a_pickle_once(tmp_path):
    torch.save({"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}}, tmp_path / "m.pt")
    checkpoint = clip_weights.open_checkpoint(tmp_path / "m.pt")
    assert checkpoint.path == tmp_path / "m.safetensors"
    np.testing.assert_array_equal(checkpoint.array("w"), np.arange(6.0).reshape(2, 3))
    written = (tmp_path / "m.safetensors").stat().st_mtime_ns
    clip_weights.open_checkpoint(tmp_path / "m.pt")  # up to date: not written again
    assert (tmp_path / "m.safetensors").stat().st_mtime_ns == written


def test_without_torch_the_error_says_how_to_convert(tmp_path, monkeypatch):
    (tmp_path / "m.pt").write_bytes(b"not read")
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(ImportError, match=r"needs torch.*python -m g2rpo_jax\.convert SRC DST"):
        torch_checkpoints.convert_torch_checkpoint(tmp_path / "m.pt")


def test_command_line(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pth")
    done = subprocess.run([sys.executable, "-m", "g2rpo_jax.convert", str(tmp_path / "m.pth"),
                           str(tmp_path / "out.safetensors")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'out.safetensors'}" in done.stdout
    np.testing.assert_array_equal(
        weights.SafetensorsCheckpoint(tmp_path / "out.safetensors").array("w"), np.ones(3))
    usage = subprocess.run([sys.executable, "-m", "g2rpo_jax.convert"], capture_output=True,
                           text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr
