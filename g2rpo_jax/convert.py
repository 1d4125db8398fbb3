"""One-time conversion of PyTorch checkpoints to safetensors: the one program that needs torch.

  python -m g2rpo_jax.convert HPS_v2.1_compressed.pt [HPS_v2.1_compressed.safetensors]
  python -m g2rpo_jax.convert ViT-L-14.pt                          # OpenAI's TorchScript CLIP
  python -m g2rpo_jax.convert sac+logos+ava1-l14-linearMSE.pth     # the LAION aesthetic head
  python -m g2rpo_jax.convert DFN5B-CLIP-ViT-H-14-378/open_clip_pytorch_model.bin

The rewards read safetensors only; given a PyTorch file they read the converted file beside it
(the default DST, `torch_checkpoints.converted_path`). What is read and written:
`g2rpo_jax.models.torch_checkpoints`.
"""

import argparse
import os
import sys

from g2rpo_jax.models import torch_checkpoints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m g2rpo_jax.convert",
        description="Converts a PyTorch state dict (.pt / .bin / .pth, TorchScript too) to "
                    "safetensors. Needs torch.")
    parser.add_argument("src", help="the PyTorch file")
    parser.add_argument("dst", nargs="?", default=None,
                        help="the safetensors file to write (default: beside SRC with the suffix "
                             ".safetensors; an OpenCLIP folder's open_clip_pytorch_model.bin "
                             "becomes its open_clip_model.safetensors)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    args = parser.parse_args(argv)
    dst = args.dst or torch_checkpoints.converted_path(args.src)
    if os.path.exists(dst) and not args.overwrite:
        parser.error(f"{dst} exists; pass --overwrite to replace it.")
    out = torch_checkpoints.convert_torch_checkpoint(args.src, dst, overwrite=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
