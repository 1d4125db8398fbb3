# shellcheck shell=bash
# The config's fields are assigned by name (printf -v), which shellcheck cannot follow:
# shellcheck disable=SC2153
# Shared by launch/*.sh: the launch config (launch/pod.env, --config=FILE, G2RPO_* variables),
# printing or running commands (--dry-run), and the gcloud steps every script is made of.
# Sourced, never run.

LAUNCH_DIR=${BASH_SOURCE[0]%/*}
[[ $LAUNCH_DIR == "${BASH_SOURCE[0]}" ]] && LAUNCH_DIR=.
LAUNCH_DIR=$(cd "$LAUNCH_DIR" && pwd)
REPO_DIR=${LAUNCH_DIR%/*}
SCRIPT=${0##*/}

# On every worker, relative to its home directory (an ssh command starts there).
REMOTE_REPO=g2rpo-jax           # the installed checkout
REMOTE_VENV=g2rpo-venv          # its Python environment
REMOTE_STATE=g2rpo-launch       # worker.sh's lock, local logs and job status
REMOTE_ARCHIVE=g2rpo-jax.tar.gz

FIELDS=(PROJECT ZONE TPU_NAME ACCELERATOR_TYPE RUNTIME_VERSION PROVISIONING QUEUED_RESOURCE
        CREATE_FLAGS BUCKET RUN_NAME TRAIN_CONFIG PATHS_ROOT WORKDIR COMPILATION_CACHE_DIR
        EXTRA_FLAGS GIT_REF JAX_TPU PYTHON_VERSION UV_VERSION LOG_SYNC_SECONDS POLL_SECONDS)
# The rest may be empty: they have derived defaults or add nothing.
REQUIRED=(PROJECT ZONE TPU_NAME ACCELERATOR_TYPE RUNTIME_VERSION PROVISIONING QUEUED_RESOURCE
          BUCKET RUN_NAME TRAIN_CONFIG GIT_REF JAX_TPU PYTHON_VERSION UV_VERSION
          LOG_SYNC_SECONDS POLL_SECONDS)
PLACEHOLDERS=(PROJECT=your-gcp-project BUCKET=your-bucket)

DRY_RUN=0
CONFIG_FILE=

die() {
  printf '%s: %s\n' "$SCRIPT" "$*" >&2
  exit 1
}

note() {
  printf '%s: %s\n' "$SCRIPT" "$*" >&2
}

# ---- Quoting: every printed command can be pasted into a shell as it is.
# --flag=VALUE keeps the flag bare and quotes the value alone: --format='value(state)'.
quote() {
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ ^(--[A-Za-z0-9_.-]+=)(.+)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote "${BASH_REMATCH[2]}"
  else
    local squote="'" escaped="'\\''"
    printf "'%s'" "${1//$squote/$escaped}"
  fi
}

# For words inside a remote --command (itself quoted once more): double quotes where they
# mean the same as single ones, which reads better than '\''...'\''.
quote_inner() {
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  elif [[ $1 =~ ^(--[A-Za-z0-9_.-]+=)(.+)$ ]]; then
    printf '%s' "${BASH_REMATCH[1]}"
    quote_inner "${BASH_REMATCH[2]}"
  elif [[ $1 != *[\"\$\`\\!]* ]]; then
    printf '"%s"' "$1"
  else
    quote "$1"
  fi
}

quote_all() {  # [--inner] WORDS...
  local out="" arg how=quote
  if [[ ${1:-} == --inner ]]; then
    how=quote_inner
    shift
  fi
  for arg in "$@"; do
    out+="${out:+ }$("$how" "$arg")"
  done
  printf '%s' "$out"
}

# Runs a command that changes something; --dry-run prints it (stdout, one line) instead.
run() {
  if ((DRY_RUN)); then
    printf '%s\n' "$(quote_all "$@")"
    return 0
  fi
  printf '+ %s\n' "$(quote_all "$@")" >&2
  "$@"
}

# ---- The launch config.
strip_quotes() {
  local value=$1
  if [[ ${#value} -ge 2 && (($value == \"*\" && $value == *\") || ($value == \'*\' && $value == *\')) ]]; then
    value=${value:1:${#value}-2}
  fi
  printf '%s' "$value"
}

is_field() {
  local field
  for field in "${FIELDS[@]}"; do
    [[ $field == "$1" ]] && return 0
  done
  return 1
}

# KEY=VALUE lines, read as data: a config file never runs code on this machine.
read_config_file() {
  local file=$1 line key value number=0
  [[ -f $file ]] || die "launch config $file does not exist."
  while IFS= read -r line || [[ -n $line ]]; do
    number=$((number + 1))
    line=${line%$'\r'}
    [[ $line =~ ^[[:space:]]*(#.*)?$ ]] && continue
    if [[ ! $line =~ ^[[:space:]]*([A-Za-z_][A-Za-z0-9_]*)[[:space:]]*=(.*)$ ]]; then
      die "$file:$number: expected KEY=VALUE, got: $line"
    fi
    key=${BASH_REMATCH[1]}
    value=${BASH_REMATCH[2]}
    value=${value#"${value%%[![:space:]]*}"}
    value=${value%"${value##*[![:space:]]}"}
    is_field "$key" || die "$file:$number: unknown key $key (the keys are: ${FIELDS[*]})."
    printf -v "$key" '%s' "$(strip_quotes "$value")"
  done <"$file"
}

# The common arguments; a script handles its own first and passes the rest here.
common_arg() {
  case $1 in
    --dry-run) DRY_RUN=1 ;;
    --config=*) CONFIG_FILE=${1#--config=} ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument $1 (see $SCRIPT --help)." ;;
  esac
}

# Each script sets USAGE (what it does, its own options) before calling common_arg.
usage() {
  printf '%s\n\n%s\n' "$USAGE" "Common options:
  --dry-run       print the commands (one a line, quoted for pasting) and run none; needs no
                  gcloud and no other argument
  --config=FILE   a launch config read on top of launch/pod.env; G2RPO_<KEY> environment
                  variables win over both (e.g. G2RPO_ZONE=europe-west4-b)
  -h, --help      this text"
}

positive_int() {
  [[ ${!1} =~ ^[1-9][0-9]*$ ]] || die "launch config: $1 must be a whole number of seconds > 0, not '${!1}'."
}

# Reads and checks the config, then derives the run's paths and the job's flags.
load_config() {
  local field var item
  unset "${FIELDS[@]}"
  read_config_file "$LAUNCH_DIR/pod.env"
  [[ -n $CONFIG_FILE ]] && read_config_file "$CONFIG_FILE"
  for field in "${FIELDS[@]}"; do
    var=G2RPO_$field
    [[ -v $var ]] && printf -v "$field" '%s' "${!var}"
  done
  for field in "${REQUIRED[@]}"; do
    [[ -n ${!field:-} ]] || die "launch config: $field is missing or empty; set it in launch/pod.env, in a --config=FILE or as G2RPO_$field=..."
  done
  if ((!DRY_RUN)); then
    for item in "${PLACEHOLDERS[@]}"; do
      field=${item%%=*}
      [[ ${!field} == "${item#*=}" ]] && die "launch config: $field is still the placeholder '${item#*=}'; set your own in launch/pod.env, a --config=FILE or G2RPO_$field=..."
    done
  fi
  case $PROVISIONING in
    spot | on-demand | reserved) ;;
    *) die "launch config: PROVISIONING must be spot, on-demand or reserved, not '$PROVISIONING'." ;;
  esac
  case $QUEUED_RESOURCE in
    true | false) ;;
    *) die "launch config: QUEUED_RESOURCE must be true or false, not '$QUEUED_RESOURCE'." ;;
  esac
  positive_int LOG_SYNC_SECONDS
  positive_int POLL_SECONDS
  BUCKET=${BUCKET#gs://}
  BUCKET=${BUCKET%/}
  [[ $BUCKET == */* ]] && die "launch config: BUCKET is a bucket name (gs://NAME), not a path: '$BUCKET'; set PATHS_ROOT or WORKDIR for folders inside it."
  [[ $TRAIN_CONFIG == *.py* ]] || die "launch config: TRAIN_CONFIG is a config file with its argument, e.g. configs/flux_tpu.py:g2rpo,hps_clip, not '$TRAIN_CONFIG'."
  PATHS_ROOT=${PATHS_ROOT:-gs://$BUCKET/flux}
  WORKDIR=${WORKDIR:-gs://$BUCKET/runs/$RUN_NAME}
  WORKDIR=${WORKDIR%/}
  COMPILATION_CACHE_DIR=${COMPILATION_CACHE_DIR:-$WORKDIR/compilation_cache}
  [[ $COMPILATION_CACHE_DIR == off ]] && COMPILATION_CACHE_DIR=
  read -r -a EXTRA <<<"$EXTRA_FLAGS"
  for item in "${EXTRA[@]}"; do
    case $item in
      --config.train.start_over=* | --config.train.start_over)
        die "EXTRA_FLAGS: $item would delete the run's checkpoints; launch/ always resumes. Start a new run under another RUN_NAME (or WORKDIR) instead." ;;
      --config.mode=* | --workdir=* | --config=* | --config.paths.root=* | --config.compilation_cache_dir=*)
        die "EXTRA_FLAGS: launch/ sets ${item%%=*} itself (from TRAIN_CONFIG, WORKDIR, PATHS_ROOT, COMPILATION_CACHE_DIR); remove it from EXTRA_FLAGS." ;;
      --config.*=*) ;;
      *) die "EXTRA_FLAGS: '$item' is not a --config.FIELD=VALUE override." ;;
    esac
  done
  read -r -a CREATE_EXTRA <<<"$CREATE_FLAGS"
  if ((!DRY_RUN)); then
    command -v gcloud >/dev/null || die "gcloud is not on PATH: install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install) and run 'gcloud auth login', or add --dry-run to see the commands."
  fi
}

WHERE=()
where() {
  WHERE=(--zone="$ZONE" --project="$PROJECT")
}

# ---- The job's command lines.
# python -m g2rpo_jax.main for mode describe or train: the same config, root and workdir.
MAIN=()
main_command() {
  MAIN=(python -m g2rpo_jax.main --config="$TRAIN_CONFIG" --config.mode="$1"
        --config.paths.root="$PATHS_ROOT" --workdir="$WORKDIR")
  [[ -n $COMPILATION_CACHE_DIR ]] && MAIN+=(--config.compilation_cache_dir="$COMPILATION_CACHE_DIR")
  MAIN+=("${EXTRA[@]}")
}

new_attempt() {
  ATTEMPT=$(date -u +%Y%m%dT%H%M%SZ)
}

# The ssh --command that runs one job through launch/worker.sh on every worker.
worker_command() {  # JOB FOREGROUND|DETACH CMD...
  local job=$1 how=$2
  shift 2
  local args=(bash launch/worker.sh --job="$job" --log-url="$WORKDIR/logs/$ATTEMPT"
              --sync-seconds="$LOG_SYNC_SECONDS")
  [[ $how == DETACH ]] && args+=(--detach)
  printf 'cd %s && %s -- %s' "$REMOTE_REPO" "$(quote_all --inner "${args[@]}")" "$(quote_all --inner "$@")"
}

ssh_all() {  # COMMAND
  where
  run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command="$1"
}

# ---- The slice: state, create, wait, delete.
# One word: the queued resource's state (and, when it is ACTIVE, its node's), or the TPU VM's;
# NOT_FOUND when there is none. --dry-run prints the queries and answers $ASSUME_STATE.
ASSUME_STATE=READY
describe_state() {  # queued-resources|tpu-vm FORMAT
  local out
  where
  if ((DRY_RUN)); then
    run gcloud compute tpus "$1" describe "$TPU_NAME" "${WHERE[@]}" --format="$2"
    return 0
  fi
  if out=$(gcloud compute tpus "$1" describe "$TPU_NAME" "${WHERE[@]}" --format="$2" 2>&1); then
    printf '%s' "${out:-STATE_UNSPECIFIED}"
  elif [[ $out == *NOT_FOUND* || $out == *"not found"* ]]; then
    printf 'NOT_FOUND'
  else
    die "cannot read the state of $TPU_NAME: $out"
  fi
}

resource_state() {
  local state
  if ((DRY_RUN)); then
    if [[ $QUEUED_RESOURCE == true ]]; then
      describe_state queued-resources 'value(state.state)'
      [[ $ASSUME_STATE == READY ]] && describe_state tpu-vm 'value(state)'
    else
      describe_state tpu-vm 'value(state)'
    fi
    STATE=$ASSUME_STATE
    return 0
  fi
  if [[ $QUEUED_RESOURCE == true ]]; then
    state=$(describe_state queued-resources 'value(state.state)') || exit 1
    # ACTIVE says the slice was granted; its node says whether it still runs.
    if [[ $state == ACTIVE ]]; then
      state=$(describe_state tpu-vm 'value(state)') || exit 1
    fi
  else
    state=$(describe_state tpu-vm 'value(state)') || exit 1
  fi
  STATE=$state
}

# healthy: usable; pending: on its way up or down, ask again later; gone: to be re-created.
state_class() {
  case $1 in
    READY) echo healthy ;;
    NOT_FOUND | PREEMPTED | TERMINATED | STOPPED | SUSPENDED | FAILED) echo gone ;;
    *) echo pending ;;   # CREATING, ACCEPTED, WAITING_FOR_RESOURCES, PROVISIONING, ACTIVE, ...
  esac
}

create_resource() {
  local provisioning=()
  case $PROVISIONING in
    spot) provisioning=(--spot) ;;
    reserved) provisioning=(--reserved) ;;
  esac
  where
  if [[ $QUEUED_RESOURCE == true ]]; then
    run gcloud compute tpus queued-resources create "$TPU_NAME" --node-id="$TPU_NAME" "${WHERE[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --runtime-version="$RUNTIME_VERSION" \
      "${provisioning[@]}" "${CREATE_EXTRA[@]}"
  else
    run gcloud compute tpus tpu-vm create "$TPU_NAME" "${WHERE[@]}" \
      --accelerator-type="$ACCELERATOR_TYPE" --version="$RUNTIME_VERSION" \
      "${provisioning[@]}" "${CREATE_EXTRA[@]}"
  fi
}

# A queued resource may wait for capacity for a long time; this waits with it.
wait_until_ready() {
  local class
  while :; do
    resource_state
    ((DRY_RUN)) && return 0
    class=$(state_class "$STATE")
    case $class in
      healthy) note "$TPU_NAME is $STATE."; return 0 ;;
      gone) die "$TPU_NAME is $STATE instead of coming up (capacity or quota in $ZONE?); launch/status.sh shows it; launch/recover.sh re-creates it." ;;
    esac
    note "$TPU_NAME is $STATE; asking again in $POLL_SECONDS s."
    sleep "$POLL_SECONDS"
  done
}

delete_resource() {  # [--quiet]: no confirmation prompt
  where
  if [[ $QUEUED_RESOURCE == true ]]; then
    # --force deletes the node first; without it a queued resource with a node is refused.
    run gcloud compute tpus queued-resources delete "$TPU_NAME" "${WHERE[@]}" --force "$@"
  else
    run gcloud compute tpus tpu-vm delete "$TPU_NAME" "${WHERE[@]}" "$@"
  fi
}

# ---- Install: this checkout's tree at GIT_REF, as a tarball, on every worker.
install_project() {
  local commit archive git_dir remote
  commit=$(git -C "$REPO_DIR" rev-parse --verify --quiet "$GIT_REF^{commit}") ||
    die "launch config: GIT_REF '$GIT_REF' is not a commit of the checkout at $REPO_DIR."
  if [[ -n $(git -C "$REPO_DIR" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    note "uncommitted changes are not installed: the workers get commit $commit ($GIT_REF)."
  fi
  # Inside .git: never committed, and no temporary file to clean up on this machine.
  git_dir=$(git -C "$REPO_DIR" rev-parse --absolute-git-dir)
  archive=$git_dir/g2rpo-launch-$commit.tar.gz
  run git -C "$REPO_DIR" archive --format=tar.gz --output="$archive" "$commit"
  where
  run gcloud compute tpus tpu-vm scp "$archive" "$TPU_NAME:$REMOTE_ARCHIVE" "${WHERE[@]}" --worker=all
  # One line on the worker: refuse while a job runs (its files would change under it), unpack,
  # make the environment with uv (the image's Python may be older than 3.11), install.
  remote="set -e; mkdir -p $REMOTE_STATE"
  remote+="; if ! flock -n $REMOTE_STATE/lock true; then echo \"a launch/ job is running on \$(hostname); stop it before installing\" >&2; exit 1; fi"
  remote+="; rm -rf $REMOTE_REPO; mkdir $REMOTE_REPO; tar -xzf $REMOTE_ARCHIVE -C $REMOTE_REPO"
  remote+="; echo $commit > $REMOTE_REPO/.launch-commit"
  remote+="; python3 -m pip install --user --quiet $(quote_inner "uv==$UV_VERSION") || python3 -m pip install --user --quiet --break-system-packages $(quote_inner "uv==$UV_VERSION")"
  remote+="; ~/.local/bin/uv venv --allow-existing --python $(quote_inner "$PYTHON_VERSION") $REMOTE_VENV"
  remote+="; ~/.local/bin/uv pip install --python $REMOTE_VENV/bin/python -e ./$REMOTE_REPO $(quote_inner "$JAX_TPU")"
  ssh_all "$remote"
}

# ---- Run: describe (a check, in the foreground), then train (detached) on every worker.
describe_job() {
  main_command describe
  ssh_all "$(worker_command describe FOREGROUND "${MAIN[@]}")"
}

start_training() {
  main_command train
  ssh_all "$(worker_command train DETACH "${MAIN[@]}")"
}

# The job's status on worker 0 (launch/worker.sh --status) in JOB_STATUS; "not-installed" when
# the worker has no launch/ (a new slice). --dry-run prints the query and answers $ASSUME_JOB.
ASSUME_JOB=interrupted
job_status() {  # JOB
  local command out
  command="bash $REMOTE_REPO/launch/worker.sh --status --job=$1"
  where
  if ((DRY_RUN)); then
    run gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker=0 --command="$command"
    JOB_STATUS=$ASSUME_JOB
    return 0
  fi
  out=$(gcloud compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker=0 \
    --command="if [ -f $REMOTE_REPO/launch/worker.sh ]; then $command; else echo not-installed; fi") ||
    die "cannot reach worker 0 of $TPU_NAME over ssh (gcloud's message is above)."
  # shellcheck disable=SC2034  # read by the scripts
  JOB_STATUS=${out##*$'\n'}
}
