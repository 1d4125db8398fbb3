#!/usr/bin/env bash
# Brings a run back after a preemption: reads the slice's state; a slice that is gone
# (PREEMPTED, SUSPENDED, FAILED, TERMINATED, NOT_FOUND) is deleted, created again, installed
# and the same command rerun; on a READY slice whose job stopped (interrupted, preempted, not
# installed) the job is rerun. The trainer resumes from its newest complete checkpoint in
# WORKDIR. --watch does this every POLL_SECONDS until the run has finished.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/recover.sh [--watch] [--dry-run [--assume-state=S] [--assume-job=J]] [--config=FILE]

  --watch           keep checking every POLL_SECONDS; stops when the run has finished, or with
                    an error when it failed (a failed job is not rerun: read its log, fix, run
                    launch/run.sh)
  --assume-state=S  with --dry-run: the state the slice is taken to be in (default PREEMPTED;
                    READY shows the rerun of a stopped job)
  --assume-job=J    with --dry-run and a READY slice: the job's status (default interrupted)"

watch=0
ASSUME_STATE=PREEMPTED
for arg in "$@"; do
  case $arg in
    --watch) watch=1 ;;
    --assume-state=*) ASSUME_STATE=${arg#--assume-state=} ;;
    --assume-job=*) ASSUME_JOB=${arg#--assume-job=} ;;
    *) common_arg "$arg" ;;
  esac
done
load_config

rerun() {
  new_attempt
  describe_job
  start_training
}

# One look at the slice and the job; returns 0 when nothing is left to do (finished).
recover_once() {
  resource_state
  case $(state_class "$STATE") in
    pending)
      note "$TPU_NAME is $STATE; waiting."
      return 1 ;;
    gone)
      note "$TPU_NAME is $STATE: creating it again, then resuming the run."
      [[ $STATE == NOT_FOUND ]] || delete_resource --quiet
      create_resource
      wait_until_ready
      install_project
      rerun
      return 1 ;;
  esac
  job_status train
  case $JOB_STATUS in
    running) note "$TPU_NAME is $STATE and the job is running." ;;
    finished) note "the run has finished (WORKDIR $WORKDIR)."; return 0 ;;
    failed*) die "the job on $TPU_NAME ended with '$JOB_STATUS': read launch/logs.sh --gcs, fix the cause, then launch/run.sh (it resumes)." ;;
    not-installed)
      note "$TPU_NAME has no launch/ installed: installing, then resuming the run."
      install_project
      rerun ;;
    *)
      note "the job on $TPU_NAME is $JOB_STATUS: rerunning it (it resumes from its newest checkpoint)."
      rerun ;;
  esac
  return 1
}

if ((!watch || DRY_RUN)); then
  recover_once || true
  exit 0
fi
until recover_once; do
  sleep "$POLL_SECONDS"
done
