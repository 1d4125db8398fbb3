"""LoRA against full fine-tuning on the embedded shapes world: the main job
(configs/shapes_cpu.py, G²RPO from the shipped base) trained once with every parameter and once
per LoRA setting (`model.lora.rank`, alpha, learning rate), on the same seeds, and compared by
the held-out scores at the same evaluation iterations.

Each run lives in WORKDIR/<name>_seed<k>; a run whose summary.json exists is read, not run
again, so the sweep may be stopped and continued. Writes a JSON record per run (settings,
base and final scores, the held-out curve, wall seconds, trained parameter count) and prints a
Markdown table of the curves, mean over seeds.

  python benchmarks/learning/lora_shapes.py --workdir=/tmp/lora_shapes \
      [--seeds=0,1] [--lora=32:64:3e-4] [--out=benchmarks/results/lora_shapes.json]

`--lora` takes rank:alpha:learning_rate triples, comma-separated; full fine-tuning runs with the
config's own learning rate.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCORES = ("in_domain", "out_of_domain", "quality")


def parse_lora(spec: str) -> list[dict]:
    """"32:64:3e-4,128:128:1e-4" → [{rank 32, alpha 64.0, learning_rate 3e-4}, ...]."""
    settings = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        parts = item.split(":")
        if len(parts) != 3:
            raise SystemExit(f"--lora item {item!r}: expected rank:alpha:learning_rate.")
        settings.append(dict(rank=int(parts[0]), alpha=float(parts[1]),
                             learning_rate=float(parts[2])))
    return settings


def run_name(setting: dict | None) -> str:
    if setting is None:
        return "full"
    return f"lora_r{setting['rank']}_a{setting['alpha']:g}_lr{setting['learning_rate']:g}"


def held_out_curve(workdir: str) -> dict[int, dict[str, float]]:
    """{iteration: {score: value}} from the run's metrics.jsonl (the eval/* rows)."""
    from g2rpo_jax.run import metrics
    return metrics.by_step(metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl")), "eval/")


def trained_parameters(workdir: str) -> int | None:
    """Parameters the run trained, from the file the main job writes: the adapters of a LoRA
    run (lora.safetensors), else the policy's tensors ("flux.*") of generator.safetensors (its
    text encoder is frozen)."""
    from safetensors import safe_open
    for name, prefix in (("lora.safetensors", ""), ("generator.safetensors", "flux.")):
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            with safe_open(path, framework="numpy") as f:
                return int(sum(np.prod(f.get_slice(k).get_shape()) for k in f.keys()
                               if k.startswith(prefix)))
    return None


def train(workdir: str, seed: int, setting: dict | None) -> dict:
    summary_path = os.path.join(workdir, "summary.json")
    wall = None
    if not os.path.exists(summary_path):
        command = [sys.executable, "-m", "g2rpo_jax.main", "--config=configs/shapes_cpu.py",
                   f"--workdir={workdir}", f"--config.seed={seed}"]
        if setting is not None:
            command += [f"--config.model.lora.rank={setting['rank']}",
                        f"--config.model.lora.alpha={setting['alpha']}",
                        f"--config.optimizer.learning_rate={setting['learning_rate']}"]
        print("running", " ".join(command), flush=True)
        began = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = round(time.perf_counter() - began, 1)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    with open(summary_path) as f:
        summary = json.load(f)
    return dict(name=run_name(setting), seed=seed, lora=setting,
                base=summary["base"], final=summary["final"],
                curve={str(k): v for k, v in held_out_curve(workdir).items()},
                wall_s=wall if wall is not None else summary.get("seconds"),
                trained_parameters=trained_parameters(workdir))


def table(records: list[dict]) -> str:
    """Markdown: held-out in_domain per evaluation iteration and the final − base change of
    each score, mean ± std over seeds."""
    names = list(dict.fromkeys(r["name"] for r in records))
    steps = sorted({int(s) for r in records for s in r["curve"]})
    lines = ["| run | seeds | trained params | " + " | ".join(f"it {s}" for s in steps)
             + " | " + " | ".join(f"{score} final − base" for score in SCORES) + " |",
             "|---|---:|---:|" + "---:|" * (len(steps) + len(SCORES))]
    for name in names:
        runs = [r for r in records if r["name"] == name]
        cells = []
        for step in steps:
            values = [r["curve"][str(step)]["in_domain"] for r in runs if str(step) in r["curve"]]
            cells.append(f"{np.mean(values):.3f} ± {np.std(values):.3f}" if values else "")
        for score in SCORES:
            gains = [r["final"][score] - r["base"][score] for r in runs]
            cells.append(f"{np.mean(gains):+.3f} ± {np.std(gains):.3f}")
        lines.append(f"| {name} | {len(runs)} | {runs[0]['trained_parameters'] or ''} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", required=True, help="where the runs live (kept, resumable)")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--lora", default="32:64:3e-4", help="rank:alpha:learning_rate,...")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "lora_shapes.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit("--seeds is empty: give at least one seed, e.g. --seeds=0.")
    settings = [None] + parse_lora(args.lora)
    records = []
    for seed in seeds:          # seed-major: an interrupted sweep has whole comparisons
        for setting in settings:
            workdir = os.path.join(args.workdir, f"{run_name(setting)}_seed{seed}")
            records.append(train(workdir, seed, setting))
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dict(command=" ".join(sys.argv), runs=records), f, indent=1)
    print(table(records))


if __name__ == "__main__":
    main()
