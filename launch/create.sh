#!/usr/bin/env bash
# Creates the TPU slice of the launch config: a queued resource (QUEUED_RESOURCE=true) or a TPU
# VM, spot / on-demand / reserved, then waits until it is READY.
set -euo pipefail
here=${BASH_SOURCE[0]%/*}
[[ $here == "${BASH_SOURCE[0]}" ]] && here=.
# shellcheck source=launch/common.sh
source "$here/common.sh"

USAGE="Usage: launch/create.sh [--no-wait] [--dry-run] [--config=FILE]

Creates TPU_NAME (ACCELERATOR_TYPE, RUNTIME_VERSION, PROVISIONING in ZONE of PROJECT) and
waits until it is READY; a queued resource may wait for capacity a long time.
  --no-wait       return once the request is made (launch/status.sh shows the state)"

wait=1
for arg in "$@"; do
  case $arg in
    --no-wait) wait=0 ;;
    *) common_arg "$arg" ;;
  esac
done
load_config
create_resource
((wait)) && wait_until_ready
exit 0
