"""One-time conversion of PyTorch checkpoints to safetensors: the one program that needs torch.

  python -m g2rpo_jax.convert HPS_v2.1_compressed.pt   # → HPS_v2.1_compressed.safetensors
  python -m g2rpo_jax.convert ViT-L-14.pt                          # OpenAI's TorchScript CLIP
  python -m g2rpo_jax.convert sac+logos+ava1-l14-linearMSE.pth     # the LAION aesthetic head
  python -m g2rpo_jax.convert DFN5B-CLIP-ViT-H-14-378/open_clip_pytorch_model.bin
  python -m g2rpo_jax.convert gs://BUCKET/rewards/HPS_v2.1_compressed.pt   # a bucket, too

The rewards read safetensors only and never import torch; given a PyTorch file they read the
converted file beside it (the default DST, `torch_checkpoints.converted_path`) or stop with this
command. An existing DST is kept unless --overwrite. What is read and written:
`g2rpo_jax.models.torch_checkpoints`.
"""

import argparse
import sys

from g2rpo_jax.models import torch_checkpoints


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m g2rpo_jax.convert",
        description="Converts a PyTorch state dict (.pt / .pth / .bin / .ckpt, TorchScript "
                    "too) to safetensors, once. Needs torch (pip install torch); nothing else "
                    "in g2rpo_jax does.")
    parser.add_argument("src", help="the PyTorch file (local or gs://)")
    parser.add_argument("dst", nargs="?", default=None,
                        help="the safetensors file to write (local or gs://; default: beside "
                             "SRC with the suffix .safetensors; an OpenCLIP folder's "
                             "open_clip_pytorch_model.bin becomes its open_clip_model.safetensors, "
                             "a transformers folder's pytorch_model.bin its model.safetensors)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        out = torch_checkpoints.convert_torch_checkpoint(args.src, args.dst,
                                                         overwrite=args.overwrite)
    except FileExistsError as error:
        parser.error(str(error))   # exit status 2, with the usage
    except (ImportError, OSError, ValueError) as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
