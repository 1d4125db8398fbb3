"""PyTorch checkpoints (pickles, TorchScript) converted once to safetensors.

The models read safetensors only (lazily, each device its own slices), never torch and never
writing next to their inputs (a read-only bucket or mount works). Checkpoints published as
PyTorch pickles (HPS-v2.1's `.pt`, OpenAI's TorchScript ViT-L-14.pt, the LAION aesthetic head's
`.pth`, an OpenCLIP folder's open_clip_pytorch_model.bin) are converted once, ahead of time, by
`python -m g2rpo_jax.convert SRC [DST]`, the one place that needs torch. A loader given the
pickle reads its converted file (`converted_path`) if it is there, and otherwise stops with
`NeedsConversionError`, which names the command.
"""

from collections.abc import Mapping
import os
from pathlib import Path

import numpy as np

from g2rpo_jax.models.safetensors_io import write_safetensors

# File suffixes of PyTorch pickles (what `convert_torch_checkpoint` reads).
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
# An OpenCLIP hub folder's pickle and the safetensors name its loader reads first.
_OPEN_CLIP_PICKLE, _OPEN_CLIP_SAFETENSORS = "open_clip_pytorch_model.bin", "open_clip_model.safetensors"


class NeedsConversionError(FileNotFoundError):
    """A PyTorch checkpoint was given where safetensors are read; the message has the command."""


def is_torch_checkpoint(path: str | os.PathLike) -> bool:
    return Path(path).suffix in TORCH_SUFFIXES


def converted_path(src: str | os.PathLike) -> Path:
    """Where the converter writes `src`'s safetensors by default (and where loaders look):
    beside it with the suffix .safetensors; an OpenCLIP folder's open_clip_pytorch_model.bin
    becomes the folder's open_clip_model.safetensors."""
    src = Path(src)
    if src.name == _OPEN_CLIP_PICKLE:
        return src.with_name(_OPEN_CLIP_SAFETENSORS)
    return src.with_suffix(".safetensors")


def require_converted(src: str | os.PathLike) -> Path:
    """The converted safetensors of the PyTorch checkpoint `src` (read only, never written).

    Raises:
      NeedsConversionError: no converted file beside `src`; names the command that makes it.
    """
    dst = converted_path(src)
    if dst.exists():
        return dst
    raise NeedsConversionError(
        f"{src} is a PyTorch checkpoint; the rewards read safetensors only. Convert it once "
        f"(this step alone needs torch: pip install torch):\n  python -m g2rpo_jax.convert "
        f"{src} {dst}\nthen give the .safetensors (or keep the path: the converted file beside "
        "it is read).")


def _torch_to_numpy(tensor) -> np.ndarray:
    import ml_dtypes
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16: reinterpret the bits
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def convert_torch_checkpoint(src: str | os.PathLike, dst: str | os.PathLike | None = None,
                             overwrite: bool = False) -> Path:
    """Converts a PyTorch state dict (.pt / .bin / .pth) to safetensors, once.

    Reads plain state dicts, `{"state_dict": ...}` wrappers (HPS-v2.1's
    HPS_v2.1_compressed.pt), DataParallel "module." prefixes and TorchScript archives (OpenAI's
    ViT-L-14.pt). Non-tensor entries are dropped. Needs torch, imported only here.

    Args:
      src: the PyTorch file.
      dst: the safetensors file to write; default: `converted_path(src)`.
      overwrite: rewrite dst even if it exists and is newer than src.

    Returns:
      dst.
    """
    src = Path(src)
    dst = Path(dst) if dst is not None else converted_path(src)
    if dst.exists() and not overwrite and dst.stat().st_mtime >= src.stat().st_mtime:
        return dst
    try:
        import torch
    except ImportError:
        raise ImportError(f"Converting the PyTorch checkpoint {src} needs torch (pip install "
                          "torch), or convert it on a machine that has it: "
                          "python -m g2rpo_jax.convert SRC DST") from None
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
    tensors = {}
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            tensors[key[len("module."):] if key.startswith("module.") else key] = (
                _torch_to_numpy(value))
    if not tensors:
        raise ValueError(f"{src} has no tensors (keys: {list(obj)[:8]}).")
    try:
        return write_safetensors(dst, tensors)
    except PermissionError:
        raise PermissionError(f"Cannot write {dst}; pass dst= a writable path.") from None
