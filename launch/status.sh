#!/usr/bin/env bash
# Prints the slice's state and, when it is READY, the training job's status on worker 0.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/status.sh [--job=NAME] [--dry-run] [--config=FILE]

Prints two lines: the state of TPU_NAME (READY, PREEMPTED, WAITING_FOR_RESOURCES, NOT_FOUND, ...)
and the job's status on worker 0 (running, finished, preempted, interrupted, failed <code>,
none; see launch/worker.sh).
  --job=NAME      whose status (default train)"

job=train
for arg in "$@"; do
  case $arg in
    --job=*) job=${arg#--job=} ;;
    *) common_arg "$arg" ;;
  esac
done
load_config
resource_state
((DRY_RUN)) || echo "slice $TPU_NAME: $STATE"
if [[ $(state_class "$STATE") == healthy ]]; then
  job_status "$job"
  ((DRY_RUN)) || echo "job $job: $JOB_STATUS"
fi
