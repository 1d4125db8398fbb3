#!/usr/bin/env bash
# Runs one job of launch/ on this TPU VM worker (run.sh and preprocess.sh start it on every
# worker through gcloud ... ssh --worker=all), or reports the job's status.
#
#   bash launch/worker.sh --job=NAME --log-url=URL [--detach] [--sync-seconds=N] -- COMMAND...
#   bash launch/worker.sh --status --job=NAME
#
# The job's output goes to ~/g2rpo-launch/NAME.log, copied to URL/NAME-worker-<i>.log every N
# seconds and at exit (gcloud storage cp for gs:// URLs; a process cannot write its stdout to
# gs:// itself). One job at a time per worker (a lock): two would fight over the TPU chips.
# --detach returns at once and leaves the job running after the ssh session ends. The status
# (~/g2rpo-launch/NAME.status) is one of: running, finished, preempted (SIGTERM: the trainer saved
# and exited), interrupted (killed without a word), failed <exit code>, none (never run here).
set -euo pipefail

job='' log_url='' sync_seconds=60 detach=0 background=0 status=0 index=''
state_dir=$HOME/g2rpo-launch
venv=$HOME/g2rpo-venv

die() {
  printf 'worker.sh: %s\n' "$*" >&2
  exit 1
}

usage() {   # the comment at the top of this file
  local line first=1
  while IFS= read -r line; do
    ((first)) && { first=0; continue; }
    [[ $line == '#'* ]] || break
    line=${line#\#}
    printf '%s\n' "${line# }"
  done <"$0"
}

args=("$@")
while (($#)); do
  case $1 in
    --job=*) job=${1#--job=} ;;
    --log-url=*) log_url=${1#--log-url=} ;;
    --sync-seconds=*) sync_seconds=${1#--sync-seconds=} ;;
    --detach) detach=1 ;;
    --background) background=1 ;;   # set by --detach for the job it starts: no terminal
    --status) status=1 ;;
    --worker-index=*) index=${1#--worker-index=} ;;   # default: from the TPU VM's metadata
    --state-dir=*) state_dir=${1#--state-dir=} ;;
    --venv=*) venv=${1#--venv=} ;;
    -h | --help) usage; exit 0 ;;
    --) shift; break ;;
    *) die "unknown argument $1 (see --help)." ;;
  esac
  shift
done
[[ $job =~ ^[a-z0-9_-]+$ ]] || die "--job=NAME is required (letters, digits, - and _)."
mkdir -p "$state_dir"
lock=$state_dir/lock
log=$state_dir/$job.log
status_file=$state_dir/$job.status

lock_is_free() {
  flock -n "$lock" true
}

if ((status)); then
  if ! lock_is_free; then
    echo running
  elif [[ -s $status_file ]]; then
    word=$(<"$status_file")
    # "running" in the file with the lock free: the job died without writing its end.
    [[ $word == running ]] && word=interrupted
    echo "$word"
  else
    echo none
  fi
  exit 0
fi

(($#)) || die "no command after --."
[[ -n $log_url ]] || die "--log-url=URL is required."
[[ $sync_seconds =~ ^[1-9][0-9]*$ ]] || die "--sync-seconds must be a whole number > 0."
[[ -d $venv/bin ]] || die "no Python environment at $venv: run launch/install.sh first."
# A detached job's starter has checked already; the job itself waits for the lock below, so that
# another probe holding it for an instant cannot make it give up.
((background)) || lock_is_free ||
  die "a launch/ job is already running on $(hostname) (lock $lock); wait for it, or stop it before starting another."

if ((detach)); then
  # setsid + nohup: the job outlives the ssh session; its output goes to the log, not to ssh.
  rest=()
  for arg in "${args[@]}"; do
    if [[ $arg == --detach ]]; then rest+=(--background); else rest+=("$arg"); fi
  done
  rm -f "$status_file"
  setsid nohup bash "$0" "${rest[@]}" >/dev/null 2>&1 </dev/null &
  starter=$!
  # Return once the job holds the lock, so that a --status right after says running (up to
  # 60 s: a loaded VM may take seconds to start a process). The job writes its status file only
  # once it holds the lock; polling the lock instead would take it for instants of its own, and
  # an instant that met the job's own check made the start look failed.
  for _ in $(seq 600); do
    [[ -s $status_file ]] && break
    kill -0 "$starter" 2>/dev/null || break
    sleep 0.1
  done
  [[ -s $status_file ]] || die "$job did not start on $(hostname); see $log."
  if lock_is_free; then   # the job has ended already (it writes its last status before it exits)
    echo "worker.sh: $job on $(hostname) has already ended: $(<"$status_file")."
    exit 0
  fi
  echo "worker.sh: started $job on $(hostname); its log: $log, copied to $log_url/"
  exit 0
fi

exec 9>"$lock"
# Wait a little: lock_is_free (a --status, or the --detach starter's check) takes the lock for an
# instant to test it, and must not make a job give up.
flock -w 10 9 || die "a launch/ job is already running on $(hostname)."
if [[ -z $index ]]; then
  index=$(curl -sf --max-time 5 -H 'Metadata-Flavor: Google' \
    http://metadata.google.internal/computeMetadata/v1/instance/attributes/agent-worker-number) ||
    index=$(hostname)
fi
remote_log=$log_url/$job-worker-$index.log
export PATH=$venv/bin:$PATH

copy_log() {
  if [[ $log_url == gs://* ]]; then
    gcloud storage cp --quiet "$log" "$remote_log" >/dev/null 2>&1 || true
    gcloud storage cp --quiet "$status_file" "${remote_log%.log}.status" >/dev/null 2>&1 || true
  else   # a local or mounted folder
    mkdir -p "$log_url" && cp "$log" "$remote_log" && cp "$status_file" "${remote_log%.log}.status" || true
  fi
}

echo running >"$status_file"
: >"$log"
{
  printf 'worker.sh: %s on %s (worker %s) at %s:' "$job" "$(hostname)" "$index" "$(date -u +%FT%TZ)"
  printf ' %q' "$@"
  echo
} >>"$log"
# The periodic copy; its own output nowhere (it must not hold the ssh session or a caller's pipe
# open), and its sleep ended with it.
(
  trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  while :; do
    sleep "$sync_seconds" &
    nap=$!
    wait "$nap"
    copy_log
  done
) 9>&- >/dev/null 2>&1 </dev/null &
shipper=$!

terminated=0
# On a preemption every process gets SIGTERM; pass it on in case only this one did, and wait
# for the trainer to save its checkpoint before the last copy of the log.
# shellcheck disable=SC2329  # called by the trap below
on_term() {
  terminated=1
  kill -TERM "$child" 2>/dev/null || true
}
"$@" >>"$log" 2>&1 &
child=$!
echo "$$" >"$state_dir/$job.pid"   # kill -TERM it to stop the job (the trainer saves first)
trap on_term TERM INT HUP
tailer=
if ((!background)); then   # in the foreground (describe): the log on the terminal as well
  tail -n +1 -F --pid="$child" "$log" 2>/dev/null &
  tailer=$!
fi
while :; do
  if wait "$child"; then rc=0; else rc=$?; fi
  kill -0 "$child" 2>/dev/null || break
done
trap - TERM INT HUP
[[ -n $tailer ]] && { wait "$tailer" || true; }

if ((terminated)) || grep -q 'SIGTERM (preemption)' "$log"; then
  word=preempted
elif ((rc == 0)); then
  word=finished
else
  word="failed $rc"
fi
printf 'worker.sh: %s ended at %s: %s\n' "$job" "$(date -u +%FT%TZ)" "$word" >>"$log"
echo "$word" >"$status_file"
kill "$shipper" 2>/dev/null || true
copy_log
rm -f "$state_dir/$job.pid"
exit "$rc"
