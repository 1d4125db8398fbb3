"""PyTorch checkpoints (pickles, TorchScript) converted once to safetensors.

The models read safetensors only (lazily, each device its own slices), never torch and never
writing next to their inputs (a read-only bucket or mount works). Checkpoints published as
PyTorch pickles (HPS-v2.1's `.pt`, OpenAI's TorchScript ViT-L-14.pt, the LAION aesthetic head's
`.pth`, an OpenCLIP folder's open_clip_pytorch_model.bin, a transformers folder's
pytorch_model.bin) are converted once, ahead of time, by `python -m g2rpo_jax.convert SRC [DST]`,
the one place that needs torch. A loader given the pickle reads its converted file
(`converted_path`, beside it) if it is there, so a config may keep naming the published file;
otherwise it stops with `NeedsConversionError`, which names the command. SRC and DST may be
gs:// URLs (`g2rpo_jax.core.storage`).
"""

from collections.abc import Mapping
import logging
import os
from pathlib import Path
import tempfile

import numpy as np

from g2rpo_jax.core import storage
from g2rpo_jax.models.safetensors_io import write_safetensors

# File suffixes of PyTorch pickles (what `convert_torch_checkpoint` reads).
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# Pickles of hub folders → the safetensors name each folder's loader reads (OpenCLIP,
# transformers).
_FOLDER_PICKLES = {"open_clip_pytorch_model.bin": "open_clip_model.safetensors",
                   "pytorch_model.bin": "model.safetensors"}

_log = logging.getLogger(__name__)


class NeedsConversionError(FileNotFoundError):
    """A PyTorch checkpoint was given where safetensors are read; the message has the command."""


def is_torch_checkpoint(path: str | os.PathLike) -> bool:
    return os.fspath(path).endswith(TORCH_SUFFIXES)


def _converted_name(name: str) -> str:
    if name in _FOLDER_PICKLES:
        return _FOLDER_PICKLES[name]
    stem, _ = os.path.splitext(name)
    return stem + ".safetensors"


def converted_path(src: str | os.PathLike) -> Path | str:
    """Where the converter writes `src`'s safetensors by default, and where loaders look:
    beside it with the suffix .safetensors; a hub folder's pickle becomes the name its loader
    reads (open_clip_pytorch_model.bin → open_clip_model.safetensors, pytorch_model.bin →
    model.safetensors). A Path for a local `src`, a str for a URL (a Path would fold its //)."""
    if storage.is_remote(src):
        folder, name = os.fspath(src).rstrip("/").rsplit("/", 1)
        return f"{folder}/{_converted_name(name)}"
    src = Path(src)
    return src.with_name(_converted_name(src.name))


def conversion_command(src: str | os.PathLike, dst: str | os.PathLike | None = None) -> str:
    """The command line that converts `src` (to `dst`, default `converted_path(src)`)."""
    return f"python -m g2rpo_jax.convert {src} {dst if dst is not None else converted_path(src)}"


def require_converted(src: str | os.PathLike) -> Path | str:
    """The converted safetensors of the PyTorch checkpoint `src`: read only, never written,
    torch not imported. Found beside `src` (`converted_path`), it is logged and returned.

    Raises:
      NeedsConversionError: no converted file beside `src`; names the command that makes it.
    """
    dst = converted_path(src)
    if storage.path(dst).exists():
        _log.info("%s is a PyTorch checkpoint: reading its converted safetensors %s.", src, dst)
        return dst
    raise NeedsConversionError(
        f"{src} is a PyTorch checkpoint; the rewards read safetensors only. Convert it once "
        f"(this step alone needs torch: pip install torch):\n  {conversion_command(src, dst)}\n"
        "then give the .safetensors (or keep the path: the converted file beside it is read).")


def _torch_to_numpy(tensor) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def _import_torch(src):
    try:
        import torch
    except ImportError:
        raise ImportError(f"Converting the PyTorch checkpoint {src} needs torch (pip install "
                          "torch), or convert it on a machine that has it: "
                          "python -m g2rpo_jax.convert SRC DST") from None
    return torch


def _load_state_dict(src: str) -> Mapping:
    """The tensors' mapping of a pickled state dict, a {"state_dict": ...} wrapper or a
    TorchScript archive (as torch objects)."""
    torch = _import_torch(src)
    try:
        obj = torch.load(src, map_location="cpu", weights_only=True)
    except Exception as load_error:  # TorchScript archives are not pickled state dicts.
        try:
            obj = torch.jit.load(src, map_location="cpu").state_dict()
        except Exception:
            raise ValueError(f"Cannot read {src} as a PyTorch state dict: {load_error}") from None
    if not isinstance(obj, Mapping) and callable(getattr(obj, "state_dict", None)):
        obj = obj.state_dict()  # torch.load handed a TorchScript archive to torch.jit.load
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping):
        raise ValueError(f"{src} holds a {type(obj).__name__}, not a state dict of tensors.")
    return obj


def _numpy_tensors(obj: Mapping, src) -> dict[str, np.ndarray]:
    """The tensors of a state dict as numpy, DataParallel's "module." prefix dropped and
    non-tensor entries (epochs, notes) skipped."""
    import torch

    tensors = {}
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            tensors[key[len("module."):] if key.startswith("module.") else key] = (
                _torch_to_numpy(value))
    if not tensors:
        raise ValueError(f"{src} has no tensors (keys: {list(obj)[:8]}).")
    return tensors


def _write(dst: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes atomically: a local file renamed into place, or one upload of a URL."""
    try:
        if not storage.is_remote(dst):
            write_safetensors(dst, tensors)
            return
        with tempfile.TemporaryDirectory() as scratch:
            storage.put(str(write_safetensors(Path(scratch) / "converted.safetensors", tensors)),
                        dst)
    except PermissionError:
        raise PermissionError(f"Cannot write {dst}; give a writable DST "
                              f"(python -m g2rpo_jax.convert SRC DST).") from None


def convert_torch_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None,
                             overwrite: bool = False) -> Path | str:
    """Converts a PyTorch state dict (.pt / .bin / .pth / .ckpt) to safetensors, once.

    Reads plain state dicts, `{"state_dict": ...}` wrappers (HPS-v2.1's
    HPS_v2.1_compressed.pt), DataParallel "module." prefixes and TorchScript archives (OpenAI's
    ViT-L-14.pt). Non-tensor entries are dropped. Needs torch, imported only here.

    Args:
      src: the PyTorch file, local or a URL (read through the download cache).
      dst: the safetensors file to write, local or a URL; default: `converted_path(src)`.
      overwrite: replace an existing dst (otherwise that is an error: a stale or unrelated
        file is never replaced silently).

    Returns:
      dst.

    Raises:
      FileExistsError: dst exists and overwrite is False.
      ImportError: no torch (the message says how to get it).
      ValueError: src holds no state dict of tensors.
    """
    dst = converted_path(src) if dst is None else (
        os.fspath(dst) if storage.is_remote(dst) else Path(dst))
    if not overwrite and storage.path(dst).exists():
        raise FileExistsError(f"{dst} exists; pass --overwrite (overwrite=True) to replace it.")
    _import_torch(src)   # before a remote src is downloaded
    local_src = storage.local(src)
    _write(os.fspath(dst), _numpy_tensors(_load_state_dict(local_src), src))
    return dst
