#!/usr/bin/env bash
# Shows a worker's log: live from the worker (tail -F over ssh), or the copy in WORKDIR/logs/
# (--gcs), which outlives the slice.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/logs.sh [--worker=N] [--job=train|describe|preprocess] [--gcs [--attempt=T]]
                      [--dry-run] [--config=FILE]

  --worker=N      which worker (default 0: the one that writes metrics and checkpoints' metadata)
  --job=NAME      whose log (default train)
  --gcs           print the copy in WORKDIR/logs/<start time>/ instead of following the live log
                  (the newest start unless --attempt=T names one; copies are made every
                  LOG_SYNC_SECONDS)"

worker=0 job=train gcs=0 attempt=''
for arg in "$@"; do
  case $arg in
    --worker=*) worker=${arg#--worker=} ;;
    --job=*) job=${arg#--job=} ;;
    --gcs) gcs=1 ;;
    --attempt=*) attempt=${arg#--attempt=} ;;
    *) common_arg "$arg" ;;
  esac
done
[[ $worker =~ ^[0-9]+$ ]] || die "--worker=N takes a worker number, not '$worker'."
[[ $job =~ ^[a-z0-9_-]+$ ]] || die "--job=NAME: letters, digits, - and _ only."
load_config
if ((gcs)); then
  if [[ -z $attempt ]]; then
    if ((DRY_RUN)); then
      run gcloud storage ls "$WORKDIR/logs/"
      attempt='<newest>'
    else
      attempt=$(gcloud storage ls "$WORKDIR/logs/" | sort | tail -n 1) ||
        die "no logs in $WORKDIR/logs/ yet."
      attempt=${attempt%/}
      attempt=${attempt##*/}
      [[ -n $attempt ]] || die "no logs in $WORKDIR/logs/ yet."
    fi
  fi
  run gcloud storage cat "$WORKDIR/logs/$attempt/$job-worker-$worker.log"
else
  where
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker="$worker" \
    --command="tail -n 200 -F $REMOTE_STATE/$job.log"
fi
