#!/usr/bin/env bash
# Encodes the prompts files into the embedding datasets (python -m g2rpo_jax.preprocess) on
# every worker, detached: the step before the first training run on a new PATHS_ROOT. Each
# worker encodes its share of the chunks; an interrupted run continues where it stopped.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/preprocess.sh [--dry-run] [--config=FILE]

On every worker of TPU_NAME: python -m g2rpo_jax.preprocess --config=TRAIN_CONFIG
--config.paths.root=PATHS_ROOT [EXTRA_FLAGS], detached; writes PATHS_ROOT/tfds/. Follow it with
launch/logs.sh --job=preprocess; start training when it has finished."

for arg in "$@"; do
  common_arg "$arg"
done
load_config
new_attempt
ssh_all "$(worker_command preprocess DETACH python -m g2rpo_jax.preprocess \
  --config="$TRAIN_CONFIG" --config.paths.root="$PATHS_ROOT" "${EXTRA[@]}")"
