"""What JAX's persistent compilation cache saves a restarted job: the shapes main job
(configs/shapes_cpu.py, a few iterations) started twice on the same settings, first with an
empty cache (WORKDIR/compilation_cache, the default), then as a restart would (a new process,
the cache already filled, here in a fresh workdir so both do the same work). Prints and writes
each start's wall time, its first iteration's seconds (compile + run) and the median of the
later ones. `--min_compile_seconds` sets JAX's threshold below which a program is not cached
(jax_persistent_cache_min_compile_time_secs; JAX's default is 1 s).

  python benchmarks/perf/compile_cache.py [--iterations=3] [--out=benchmarks/results/compile_cache.json]
  python benchmarks/perf/compile_cache.py --min_compile_seconds=0 \
      --out=benchmarks/results/compile_cache_min0.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start(workdir: str, cache: str, iterations: int, min_compile_seconds: float | None) -> dict:
    command = [sys.executable, "-m", "g2rpo_jax.main", "--config=configs/shapes_cpu.py",
               f"--workdir={workdir}", f"--config.compilation_cache_dir={cache}",
               f"--config.train.num_iterations={iterations}",
               f"--config.train.checkpoint_every={iterations}"]
    began = time.perf_counter()
    env = dict(os.environ)
    if min_compile_seconds is not None:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(min_compile_seconds)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - began
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    with open(os.path.join(workdir, "summary.json")) as f:
        summary = json.load(f)
    entries = sum(len(files) for _, _, files in os.walk(cache))
    return {"wall_s": round(wall, 1),
            "first_iteration_s": round(summary["first_iteration_seconds"], 1),
            "later_iteration_s": round(summary["seconds_per_iteration"], 2),
            "cache_files": entries}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--min_compile_seconds", type=float, default=None,
                        help="cache only programs that compile at least this long (JAX: 1)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "compile_cache.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="g2rpo_compile_cache_") as root:
        cache = os.path.join(root, "first", "compilation_cache")
        first = start(os.path.join(root, "first"), cache, args.iterations,
                      args.min_compile_seconds)
        second = start(os.path.join(root, "second"), cache, args.iterations,
                       args.min_compile_seconds)
    command = f"python benchmarks/perf/compile_cache.py --iterations={args.iterations}"
    if args.min_compile_seconds is not None:
        command += f" --min_compile_seconds={args.min_compile_seconds:g}"
    report = {"command": command, "config": "configs/shapes_cpu.py",
              "iterations": args.iterations,
              "min_compile_seconds": args.min_compile_seconds,
              "cold_cache": first, "warm_cache": second,
              "wall_saved_s": round(first["wall_s"] - second["wall_s"], 1),
              "first_iteration_speedup": round(first["first_iteration_s"]
                                               / max(second["first_iteration_s"], 1e-9), 2)}
    print(f"{'start':<12}{'wall s':>9}{'first it. s':>13}{'later it. s':>13}{'cache files':>13}")
    for name in ("cold_cache", "warm_cache"):
        r = report[name]
        print(f"{name:<12}{r['wall_s']:>9.1f}{r['first_iteration_s']:>13.1f}"
              f"{r['later_iteration_s']:>13.2f}{r['cache_files']:>13}")
    print(f"a restart saves {report['wall_saved_s']} s; its first iteration is "
          f"{report['first_iteration_speedup']}x faster")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
