#!/usr/bin/env bash
# The accelerator check (issue 32): one script, at most 8 minutes on one H100, everything it
# writes under one folder.
#
#   benchmarks/device_check.sh [--dry-run] [--out=DIR]      (default DIR: device_check_out)
#
# Runs, from the repository root, on a machine with jax[cuda] and torch with CUDA installed:
#   1. nvidia-smi and the JAX devices                             → DIR/devices.txt
#   2. the GPU tests: cuDNN attention against XLA in bf16, forward and gradients
#      (benchmarks/gpu/)                                               → DIR/gpu_tests.txt
#   3. benchmarks/run.py against torch, both on CUDA, at the medium and the large size
#                                                                 → DIR/run_{medium,large}.json
#   4. the main job (configs/shapes_cpu.py) on the GPU            → DIR/main_job/summary.md
#   5. the MFU of the medium and large rollout and update: the FLOPs run.py counts over the
#      card's dense bf16 peak (H100 SXM: 989 TFLOP/s; --peak_tflops=) → DIR/mfu.json
# --dry-run prints the commands and runs none (tests/test_device_check.py runs it in CI).
set -euo pipefail

OUT=device_check_out
DRY=0
PEAK_TFLOPS=989
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY=1 ;;
    --out=*) OUT="${arg#--out=}" ;;
    --peak_tflops=*) PEAK_TFLOPS="${arg#--peak_tflops=}" ;;
    *) echo "device_check.sh: unknown argument '$arg' (known: --dry-run, --out=DIR," \
            "--peak_tflops=N)" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")/.."

step() {   # step NAME LOGFILE COMMAND...: print, then run with its output in LOGFILE
  local name=$1 log=$2; shift 2
  echo "[device_check] $name: $*"
  if [ "$DRY" = 1 ]; then return 0; fi
  local start=$SECONDS
  if "$@" > "$log" 2>&1; then
    echo "[device_check] $name: ok in $((SECONDS - start)) s"
  else
    echo "[device_check] $name: FAILED in $((SECONDS - start)) s (see $log)"
    FAILED=1
  fi
}

FAILED=0
[ "$DRY" = 1 ] || mkdir -p "$OUT"
step devices "$OUT/devices.txt" bash -c \
  "nvidia-smi; JAX_PLATFORMS=cuda python -c 'import jax; print(jax.devices())'"
step gpu_tests "$OUT/gpu_tests.txt" env JAX_PLATFORMS=cuda,cpu \
  timeout 90 python -m pytest -q -rs benchmarks/gpu
step run_medium "$OUT/run_medium.txt" timeout 150 python benchmarks/run.py --platform=gpu \
  --out="$OUT/run_medium.json"
step run_large "$OUT/run_large.txt" timeout 150 python benchmarks/run.py --platform=gpu \
  --size=large --out="$OUT/run_large.json"
step main_job "$OUT/main_job.txt" env JAX_PLATFORMS=cuda timeout 120 python -m g2rpo_jax.main \
  --config=configs/shapes_cpu.py --workdir="$OUT/main_job"
step mfu "$OUT/mfu.txt" python - "$OUT" "$PEAK_TFLOPS" <<'PY'
import json, os, sys
out, peak = sys.argv[1], float(sys.argv[2]) * 1e3          # GFLOP/s
mfu = {}
for size in ("medium", "large"):
    path = os.path.join(out, f"run_{size}.json")
    if not os.path.exists(path):
        continue
    rows = json.load(open(path))["measurements"]
    for name in ("medium_rollout", "medium_train"):
        if rows.get(name, {}).get("gflops_per_s_ours"):
            mfu[f"{size}/{name}"] = rows[name]["gflops_per_s_ours"] / peak
print(json.dumps(mfu, indent=1))
json.dump(dict(peak_tflops=peak / 1e3, mfu=mfu), open(os.path.join(out, "mfu.json"), "w"),
          indent=1)
PY
[ "$DRY" = 1 ] && exit 0
echo "[device_check] results under $OUT"
exit $FAILED
