#!/usr/bin/env bash
# The test command (README, .ci/run): installs the package with its test extra and runs the
# suite on 8 emulated CPU devices. Extra arguments go to pytest (e.g. tests/rl -x).
# open_clip_torch, the OpenCLIP reference, is a second pip step without its dependencies
# because the torchvision it would pull from PyPI is a CUDA build that breaks the CPU torch.
set -euo pipefail
cd "$(dirname "$0")/.."
pip install -e ".[test]"
pip install --no-deps open_clip_torch==3.3.0
python -m pytest -n 2 tests "$@"
