#!/usr/bin/env bash
# Deletes the slice (the queued resource with its node, or the TPU VM). The bucket is kept:
# weights, datasets, checkpoints and logs stay in gs://.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/delete.sh [--yes] [--dry-run] [--config=FILE]

Deletes TPU_NAME. A running job gets SIGTERM first from the shutdown and saves a checkpoint
when it can; stop it first to be sure (see the README).
  --yes           no confirmation prompt (gcloud --quiet)"

quiet=()
for arg in "$@"; do
  case $arg in
    --yes) quiet=(--quiet) ;;
    *) common_arg "$arg" ;;
  esac
done
load_config
delete_resource "${quiet[@]}"
