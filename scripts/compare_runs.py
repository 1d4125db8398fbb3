"""Are two runs of the main job the same run? Compares two workdirs bit for bit: summary.json
without its wall times, the final checkpoint's arrays, generator.safetensors, and every
metrics.jsonl row without its time columns. Exits 1 on the first kind that differs.

  python scripts/compare_runs.py BEFORE_WORKDIR AFTER_WORKDIR

Used to check that a change of code that must not change behaviour (a refactor) leaves the
main job's results as they were, on the same machine: XLA's CPU code differs between
processors, so runs on two machines are not expected to match.
"""

import argparse
import json
import os
import sys

import numpy as np

# summary.json fields that are wall-clock measurements (or name the workdir), not results.
NOT_RESULTS = ("seconds", "seconds_per_iteration", "first_iteration_seconds", "timing",
               "checkpoint")


def summary(workdir: str) -> dict:
    with open(os.path.join(workdir, "summary.json")) as f:
        return {k: v for k, v in json.load(f).items() if k not in NOT_RESULTS}


def metrics_rows(workdir: str) -> list[dict]:
    rows = []
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows.append({k: v for k, v in row.items()
                         if k != "time" and not k.startswith("time/") and k != "train/seconds"})
    return rows


def checkpoint_arrays(workdir: str, iteration: int) -> dict:
    """{path: numpy array} of the checkpoint's `state` item (`checkpoint.read_arrays`)."""
    from g2rpo_jax.run import checkpoint
    return checkpoint.read_arrays(os.path.join(os.path.abspath(workdir), "checkpoints",
                                               str(iteration)))


def same_array(x: np.ndarray, y: np.ndarray) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


def file_bytes(workdir: str, name: str) -> bytes | None:
    path = os.path.join(workdir, name)
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return f.read()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before")
    parser.add_argument("after")
    args = parser.parse_args()
    checks = []
    a, b = summary(args.before), summary(args.after)
    checks.append(("summary.json (without wall times)", a == b,
                   [k for k in a.keys() | b.keys() if a.get(k) != b.get(k)]))
    checks.append(("generator.safetensors", file_bytes(args.before, "generator.safetensors")
                   == file_bytes(args.after, "generator.safetensors"), []))
    ra, rb = metrics_rows(args.before), metrics_rows(args.after)
    checks.append((f"metrics.jsonl rows ({len(ra)}, wall-time columns dropped)", ra == rb,
                   [i for i, (x, y) in enumerate(zip(ra, rb)) if x != y][:5]))
    iteration = a.get("iterations")
    la, lb = checkpoint_arrays(args.before, iteration), checkpoint_arrays(args.after, iteration)
    differing = sorted(k for k in la.keys() | lb.keys()
                       if k not in la or k not in lb or not same_array(la[k], lb[k]))
    checks.append((f"checkpoints/{iteration} arrays ({len(la)})", not differing, differing[:5]))
    for name, equal, where in checks:
        print(f"{'equal' if equal else 'DIFFERENT':>9}  {name}" + (f": {where}" if where else ""))
    sys.exit(0 if all(equal for _, equal, _ in checks) else 1)


if __name__ == "__main__":
    main()
