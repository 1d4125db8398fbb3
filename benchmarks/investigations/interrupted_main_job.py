"""The README's main job (configs/shapes_cpu.py, 24 iterations) run twice: once without a stop,
once stopped by SIGTERM (preemption: saves at the next iteration boundary, exits 0) and killed
by SIGKILL, each time rerun with the same command; prints whether the two end bit-identical
(every array of the final checkpoint, metrics rows without wall-time columns, summary scores,
generator.safetensors) and the wall time of each.

  python benchmarks/investigations/interrupted_main_job.py [--root=DIR] [--sigterm_after=9] [--sigkill_after=15]
      [--reference=DIR (an uninterrupted run's workdir, reused instead of run again)]
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMING = ("time", "train/seconds")


def rows(workdir):
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def command(workdir):
    return [sys.executable, "-m", "g2rpo_jax.main", "--config=configs/shapes_cpu.py",
            f"--workdir={workdir}"]


def run_until(workdir, step, sig, log):
    """Starts the job, sends `sig` once iteration `step`'s training row is written."""
    start = time.perf_counter()
    with open(log, "a") as out:
        process = subprocess.Popen(command(workdir), cwd=ROOT, stdout=out,
                                   stderr=subprocess.STDOUT)
        while not any(r["step"] == step and "train/loss" in r for r in rows(workdir)):
            if process.poll() is not None:
                raise SystemExit(f"the job ended (rc {process.returncode}) before {step}")
            time.sleep(0.05)
        process.send_signal(sig)
        rc = process.wait()
    return rc, time.perf_counter() - start


def read_state(step_dir):
    from g2rpo_jax.run import checkpoint

    return {k: v.tobytes() for k, v in checkpoint.read_arrays(step_dir).items()}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="")
    parser.add_argument("--reference", default="")
    parser.add_argument("--sigterm_after", type=int, default=9)
    parser.add_argument("--sigkill_after", type=int, default=15)
    args = parser.parse_args()
    root = args.root or tempfile.mkdtemp(prefix="interrupted_main_job_")
    os.makedirs(root, exist_ok=True)
    reference, interrupted = args.reference, os.path.join(root, "interrupted")
    log = os.path.join(root, "interrupted.log")
    if not reference:
        reference = os.path.join(root, "reference")
        start = time.perf_counter()
        subprocess.run(command(reference), cwd=ROOT, check=True, capture_output=True)
        print(f"uninterrupted: {time.perf_counter() - start:.0f} s", flush=True)
    rc, seconds = run_until(interrupted, args.sigterm_after, signal.SIGTERM, log)
    print(f"SIGTERM after iteration {args.sigterm_after}: exit {rc} after {seconds:.0f} s",
          flush=True)
    rc, seconds = run_until(interrupted, args.sigkill_after, signal.SIGKILL, log)
    print(f"SIGKILL after iteration {args.sigkill_after}: exit {rc} after {seconds:.0f} s",
          flush=True)
    start = time.perf_counter()
    with open(log, "a") as out:
        subprocess.run(command(interrupted), cwd=ROOT, check=True, stdout=out,
                       stderr=subprocess.STDOUT)
    print(f"rerun to the end: {time.perf_counter() - start:.0f} s", flush=True)

    a, b = (read_state(os.path.join(d, "checkpoints", "24")) for d in (reference, interrupted))
    same_state = a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    strip = lambda rs: [{k: v for k, v in r.items()
                         if k not in TIMING and not k.startswith("time/")} for r in rs]
    same_rows = strip(rows(reference)) == strip(rows(interrupted))
    summaries = [json.load(open(os.path.join(d, "summary.json"))) for d in (reference,
                                                                          interrupted)]
    same_scores = all(summaries[0][k] == summaries[1][k] for k in ("base", "final"))
    generators = []
    for d in (reference, interrupted):
        with open(os.path.join(d, "generator.safetensors"), "rb") as f:
            generators.append(f.read())
    same_generator = generators[0] == generators[1]
    with open(log) as f:
        preemption_lines = f.read().count("SIGTERM (preemption): saved iteration")
    print(f"bit-identical final checkpoint ({len(a)} arrays): {same_state}; metrics rows "
          f"({len(rows(interrupted))}): {same_rows}; summary base/final: {same_scores}; "
          f"generator.safetensors: {same_generator}; preemption log lines: {preemption_lines}; "
          f"final scores {summaries[1]['final']}")


if __name__ == "__main__":
    main()
