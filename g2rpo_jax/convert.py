"""One-time conversion of PyTorch checkpoints to safetensors (needs torch).

  python -m g2rpo_jax.convert HPS_v2.1_compressed.pt [HPS_v2.1.safetensors]

What is read and written: `g2rpo_jax.models.torch_checkpoints`.
"""

import argparse
import sys

from g2rpo_jax.models import torch_checkpoints


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m g2rpo_jax.convert",
        description="Converts a PyTorch state dict (.pt / .bin / .pth, TorchScript too) to "
                    "safetensors. Needs torch.")
    parser.add_argument("src", help="the PyTorch file")
    parser.add_argument("dst", nargs="?", default=None,
                        help="the safetensors file to write (default: beside SRC, suffix "
                             ".safetensors)")
    args = parser.parse_args(argv)
    out = torch_checkpoints.convert_torch_checkpoint(args.src, args.dst, overwrite=True)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
