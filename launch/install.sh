#!/usr/bin/env bash
# Installs the project on every worker of the slice: this checkout's commit at GIT_REF (sent as
# a git archive, so the workers need no access to the repository), a Python PYTHON_VERSION
# environment made by uv, then pip install -e . with JAX_TPU.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/install.sh [--dry-run] [--config=FILE]

Copies the commit GIT_REF of this checkout to ~/$REMOTE_REPO on every worker of TPU_NAME and
installs it (with JAX_TPU) into ~/$REMOTE_VENV. Refused on a worker where a job is running."

for arg in "$@"; do
  common_arg "$arg"
done
load_config
install_project
