#!/usr/bin/env bash
# Starts the job on every worker: first the same config with --config.mode=describe (in the
# foreground: a failing config stops here), then --config.mode=train, detached. Running it
# again continues the run from its newest complete checkpoint in WORKDIR (the same command).
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/run.sh [--skip-describe] [--dry-run] [--config=FILE]

On every worker of TPU_NAME: python -m g2rpo_jax.main --config=TRAIN_CONFIG
--config.paths.root=PATHS_ROOT --workdir=WORKDIR [EXTRA_FLAGS], describe then train. Logs:
~/$REMOTE_STATE/<job>.log on each worker, copied to WORKDIR/logs/<start time>/<job>-worker-<i>.log
(launch/logs.sh shows them).
  --skip-describe  start training without the describe check"

describe=1
for arg in "$@"; do
  case $arg in
    --skip-describe) describe=0 ;;
    *) common_arg "$arg" ;;
  esac
done
load_config
new_attempt
((describe)) && describe_job
start_training
((DRY_RUN)) || note "training started on every worker of $TPU_NAME; follow it with launch/logs.sh (workdir $WORKDIR)."
