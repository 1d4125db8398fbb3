"""The PyTorch → safetensors converter (`python -m g2rpo_jax.convert`, the one program that
needs torch) and the run-time rule: loaders read safetensors only, never torch, never writing."""

import builtins
import os
import subprocess
import sys

from gcs_emulator import GcsEmulator
import ml_dtypes
import numpy as np
import pytest
import torch

from g2rpo_jax import convert
from g2rpo_jax.models import clip_weights, torch_checkpoints, weights
from g2rpo_jax.testing.clip_reference import tiny_clip


def _no_torch(monkeypatch):
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)


def test_converter_handles_prefixes_bf16_and_extras(tmp_path):
    torch.save({"module.a": torch.ones(2, 3, dtype=torch.bfloat16), "module.b": torch.arange(4),
                "note": "not a tensor"}, tmp_path / "x.bin")
    out = torch_checkpoints.convert_torch_checkpoint(tmp_path / "x.bin")
    checkpoint = weights.SafetensorsCheckpoint(out)
    assert checkpoint.keys() == ["a", "b"]
    assert checkpoint.dtype("a") == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(checkpoint.array("b"), np.arange(4))


class _Head(torch.nn.Module):
    """A module standing in for the published files' models (their state-dict structure)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, x):
        return self.proj(x) * self.scale


@pytest.mark.parametrize("published", ["hps_state_dict", "torchscript", "plain_pth"])
def test_the_three_published_formats_convert_to_the_same_tensors(tmp_path, published):
    """HPS-v2.1's {"state_dict": ...} .pt, OpenAI's TorchScript ViT-L-14.pt, the aesthetic
    head's plain .pth: each becomes the module's state dict, value for value."""
    torch.manual_seed(0)
    head = _Head()
    src = tmp_path / {"hps_state_dict": "HPS.pt", "torchscript": "ViT.pt",
                      "plain_pth": "head.pth"}[published]
    if published == "hps_state_dict":
        torch.save({"state_dict": head.state_dict(), "epoch": 3}, src)
    elif published == "torchscript":
        torch.jit.save(torch.jit.script(head), src)
    else:
        torch.save(head.state_dict(), src)
    out = torch_checkpoints.convert_torch_checkpoint(src)
    assert out == src.with_suffix(".safetensors")
    converted = weights.SafetensorsCheckpoint(out)
    assert sorted(converted.keys()) == sorted(head.state_dict())
    for key, value in head.state_dict().items():
        np.testing.assert_array_equal(converted.array(key), value.numpy())


def test_run_time_reads_safetensors_only_and_writes_nothing(tmp_path, monkeypatch):
    """A .pt given to a loader: without its conversion, an error with the exact command, even
    with torch installed, and nothing written; after the one-time conversion, the converted
    file is read, without torch."""
    torch.save({"state_dict": {"w": torch.arange(6.0).reshape(2, 3)}}, tmp_path / "m.pt")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(torch_checkpoints.NeedsConversionError, match=(
            rf"m\.pt is a PyTorch checkpoint.*pip install torch.*\n  python -m "
            rf"g2rpo_jax\.convert {tmp_path}/m\.pt {tmp_path}/m\.safetensors")):
        clip_weights.open_checkpoint(tmp_path / "m.pt")
    assert sorted(os.listdir(tmp_path)) == before
    torch_checkpoints.convert_torch_checkpoint(tmp_path / "m.pt")
    before = sorted(os.listdir(tmp_path))
    os.chmod(tmp_path, 0o555)  # read-only (ignored by root: the listing check always holds)
    try:
        _no_torch(monkeypatch)
        checkpoint = clip_weights.open_checkpoint(tmp_path / "m.pt")
        assert checkpoint.path == tmp_path / "m.safetensors"
        np.testing.assert_array_equal(checkpoint.array("w"), np.arange(6.0).reshape(2, 3))
    finally:
        os.chmod(tmp_path, 0o755)
    assert sorted(os.listdir(tmp_path)) == before


def test_an_open_clip_folder_with_only_its_bin_names_the_conversion(tmp_path):
    folder = tmp_path / "DFN5B"
    folder.mkdir()
    (folder / "open_clip_config.json").write_text('{"model_cfg": {}}')
    torch.save({"w": torch.ones(2)}, folder / "open_clip_pytorch_model.bin")
    with pytest.raises(torch_checkpoints.NeedsConversionError,
                       match=r"open_clip_pytorch_model\.bin .*open_clip_model\.safetensors"):
        clip_weights.from_pretrained(folder)
    assert torch_checkpoints.converted_path(folder / "open_clip_pytorch_model.bin") == (
        folder / "open_clip_model.safetensors")


def test_a_transformers_folder_with_only_its_bin_names_the_conversion(tmp_path):
    """PickScore-like: config.json + pytorch_model.bin → the folder's model.safetensors."""
    model = tiny_clip(16, seed=0)
    model.save_pretrained(tmp_path)   # config.json (+ model.safetensors, replaced below)
    for written in tmp_path.glob("*.safetensors"):
        written.unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(torch_checkpoints.NeedsConversionError,
                       match=rf"convert {tmp_path}/pytorch_model\.bin "
                             rf"{tmp_path}/model\.safetensors"):
        clip_weights.from_pretrained(tmp_path)
    assert convert.main([str(tmp_path / "pytorch_model.bin")]) == 0
    loaded = clip_weights.from_pretrained(tmp_path)
    np.testing.assert_array_equal(
        loaded.text_model.token_embedding[...],
        model.state_dict()["text_model.embeddings.token_embedding.weight"].numpy())


def test_converted_paths():
    assert torch_checkpoints.converted_path("r/HPS_v2.1_compressed.pt").name == (
        "HPS_v2.1_compressed.safetensors")
    assert torch_checkpoints.converted_path("gs://b/r/ViT-L-14.pt") == "gs://b/r/ViT-L-14.safetensors"
    assert torch_checkpoints.converted_path("gs://b/DFN/open_clip_pytorch_model.bin") == (
        "gs://b/DFN/open_clip_model.safetensors")
    assert [torch_checkpoints.is_torch_checkpoint(f"m{s}") for s in (
        ".pt", ".pth", ".bin", ".ckpt", ".safetensors")] == [True] * 4 + [False]


def test_an_existing_dst_is_kept_unless_overwrite(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "m.pt")
    (tmp_path / "m.safetensors").write_bytes(b"someone's file")
    with pytest.raises(FileExistsError, match=r"m\.safetensors exists; pass --overwrite"):
        torch_checkpoints.convert_torch_checkpoint(tmp_path / "m.pt")
    assert (tmp_path / "m.safetensors").read_bytes() == b"someone's file"
    torch_checkpoints.convert_torch_checkpoint(tmp_path / "m.pt", overwrite=True)
    np.testing.assert_array_equal(
        weights.SafetensorsCheckpoint(tmp_path / "m.safetensors").array("w"), np.ones(2))


def test_without_torch_the_converter_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "m.pt").write_bytes(b"not read")
    _no_torch(monkeypatch)
    with pytest.raises(ImportError, match=r"needs torch \(pip install torch\).*python -m "
                                          r"g2rpo_jax\.convert SRC DST"):
        torch_checkpoints.convert_torch_checkpoint(tmp_path / "m.pt")
    with pytest.raises(SystemExit) as exit_info:
        convert.main([str(tmp_path / "m.pt")])
    assert exit_info.value.code == 1
    assert "needs torch (pip install torch)" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["m.pt"]


def test_command_line(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "m.pth")
    command = [sys.executable, "-m", "g2rpo_jax.convert", str(tmp_path / "m.pth"),
               str(tmp_path / "out.safetensors")]
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert f"wrote {tmp_path / 'out.safetensors'}" in done.stdout
    np.testing.assert_array_equal(
        weights.SafetensorsCheckpoint(tmp_path / "out.safetensors").array("w"), np.ones(3))
    again = subprocess.run(command, capture_output=True, text=True)
    assert again.returncode == 2 and "exists; pass --overwrite" in again.stderr
    assert subprocess.run(command + ["--overwrite"], capture_output=True).returncode == 0
    usage = subprocess.run([sys.executable, "-m", "g2rpo_jax.convert"], capture_output=True,
                           text=True)
    assert usage.returncode == 2 and "usage" in usage.stderr


_GS_SCRIPT = """
import sys
from g2rpo_jax.core import storage
from g2rpo_jax.models import torch_checkpoints, weights
from g2rpo_jax.tasks.flux import RewardModels
import ml_collections

step, src = sys.argv[1], sys.argv[2]
if step == "upload":
    storage.put(sys.argv[3], src)
elif step == "before":
    try:
        torch_checkpoints.require_converted(src)
        raise SystemExit("no NeedsConversionError")
    except torch_checkpoints.NeedsConversionError as error:
        print(error)
else:  # the reward task's path resolution: the converted file's local copy
    config = ml_collections.ConfigDict(dict(reward=dict(models={}, root=src.rsplit("/", 1)[0])))
    local = RewardModels(config, None, None, None)._resolve(src.rsplit("/", 1)[1])
    print(local, weights.SafetensorsCheckpoint(local).array("w").tolist())
"""


def test_gs_source_and_destination(tmp_path):
    """SRC and DST in a bucket: the command the loader names for a gs:// pickle converts it
    there, and the reward task then downloads the converted file, never the pickle."""
    torch.save({"state_dict": {"w": torch.arange(3.0)}}, tmp_path / "m.pt")
    with GcsEmulator() as gcs:
        src = f"gs://{gcs.bucket}/rewards/m.pt"
        def run(*argv, cache="cache"):
            env = dict(gcs.env, G2RPO_CACHE_DIR=str(tmp_path / cache), JAX_PLATFORMS="cpu")
            done = subprocess.run([sys.executable, *argv], capture_output=True, text=True,
                                  env=env, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            return done.stdout

        run("-c", _GS_SCRIPT, "upload", src, str(tmp_path / "m.pt"))
        command = f"python -m g2rpo_jax.convert {src} gs://{gcs.bucket}/rewards/m.safetensors"
        assert command in run("-c", _GS_SCRIPT, "before", src)
        converted = run(*command.split()[1:], cache="convert_cache")
        assert f"wrote gs://{gcs.bucket}/rewards/m.safetensors" in converted
        assert set(gcs.objects("rewards/")) == {"rewards/m.pt", "rewards/m.safetensors"}
        local, values = run("-c", _GS_SCRIPT, "after", src).split(" ", 1)
        assert local.endswith("rewards/m.safetensors") and values.strip() == "[0.0, 1.0, 2.0]"
        cached = [f for _, _, names in os.walk(tmp_path / "cache") for f in names]
        assert "m.pt" not in cached
