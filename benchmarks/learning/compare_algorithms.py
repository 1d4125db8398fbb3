"""G²RPO against its ablations and the baselines on the embedded shapes world, with seeds, under
equal iterations and under equal transformer calls.

  python benchmarks/learning/compare_algorithms.py --workdir=DIR
      [--seeds=0,1,2] [--methods=g2rpo,g2rpo_lambda12,...] [--budgets=equal_iterations,equal_calls]
      [--config=configs/shapes_cpu.py] [--iterations=16]
  python benchmarks/learning/compare_algorithms.py --report_only   # the .md and .png of the runs so far

Every run trains from the shipped base with the config file's settings (the main job's); only
the algorithm (a preset, with Λ where the name says so), the seed and the number of iterations
change:

  equal_iterations  every method runs `--iterations` (16: the default G²RPO run's held-out
                    score levels off between iterations 12 and 18);
  equal_calls       every method runs as many iterations as the transformer calls of plain
                    `g2rpo` over those iterations allow (rollout + update forward passes per
                    prompt, counted from the algorithm as `benchmarks/perf/algorithms.py` counts
                    them, × prompts per iteration), rounded to the nearest iteration.

Each run lives in DIR/<method>_it<iterations>_seed<k> (so plain `g2rpo`'s run serves both
budgets); one whose summary.json exists is read, not run again, one already recorded in `--out`
(same config) is kept without its folder, and one that was killed resumes from its last
checkpoint, so the sweep may span several sittings and machines. Writes `--out` (default
benchmarks/results/compare_algorithms.json: one record per method × seed × budget), a Markdown
report beside it (`.md`: mean ± std over seeds, the Λ ablation, paired differences against
`g2rpo` with 95% t intervals) and the held-out in_domain against transformer calls as a PNG
(`.png`).
"""

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
from scipy import stats

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCORES = ("in_domain", "out_of_domain", "quality")
BUDGETS = ("equal_iterations", "equal_calls")
REFERENCE = "g2rpo"

# method name → (preset, Λ or None for the preset's own). Λ = {1} is g2rpo_no_mgai.
METHODS = {
    "g2rpo": ("g2rpo", None),
    "g2rpo_lambda12": ("g2rpo", (1, 2)),
    "g2rpo_lambda13": ("g2rpo", (1, 3)),
    "g2rpo_no_mgai": ("g2rpo_no_mgai", None),
    "mix_grpo": ("mix_grpo", None),
    "dance_grpo": ("dance_grpo", None),
    "flow_grpo": ("flow_grpo", None),
}
# The paper's Table 2: G²RPO with Λ = {1}, {1, 2}, {1, 3}, {1, 2, 3}.
ABLATION = (("g2rpo_no_mgai", "{1}"), ("g2rpo_lambda12", "{1, 2}"),
            ("g2rpo_lambda13", "{1, 3}"), ("g2rpo", "{1, 2, 3}"))
EVALUATIONS_PER_RUN = 4


def method_overrides(method: str) -> dict:
    """`--config.` overrides (besides the preset) that make `method`."""
    _, lams = METHODS[method]
    if lams is None:
        return {}
    return {"algorithm.granularities": tuple(lams),
            "algorithm.granularity_weights": (1.0,) * len(lams)}


def load(config_path: str, method: str, **overrides):
    from g2rpo_jax.run import config_lib
    preset, _ = METHODS[method]
    return config_lib.load_config(config_path, preset, **method_overrides(method), **overrides)


def calls_per_iteration(config) -> int:
    """Transformer forward passes of one training iteration: the rollout's useful passes and
    the update's, per prompt, × prompts per iteration (evaluations are not counted)."""
    from g2rpo_jax.rl import algorithms, iteration
    from g2rpo_jax.tasks import held_out
    algo = algorithms.Algorithm.from_config(config.algorithm)
    num_steps = config.sampling.num_steps
    plan = (iteration.continuation_plan(algo, held_out.sigmas_from_config(config))
            if algo.rollout == "singular" else None)
    per_prompt = (algo.rollout_forward_passes(num_steps, plan)["useful"]
                  + algo.update_forward_passes(num_steps))
    return per_prompt * config.train.prompts_per_iteration


def plan_runs(config_path: str, methods, budgets, iterations: int) -> list[dict]:
    """[{method, budget, iterations, calls_per_iteration, overrides}] for one seed."""
    budget_calls = iterations * calls_per_iteration(load(config_path, REFERENCE))
    runs = []
    for budget in budgets:
        for method in methods:
            per_iteration = calls_per_iteration(load(config_path, method))
            count = (iterations if budget == "equal_iterations"
                     else max(1, round(budget_calls / per_iteration)))
            every = max(1, math.ceil(count / EVALUATIONS_PER_RUN))
            runs.append(dict(method=method, budget=budget, iterations=count,
                             calls_per_iteration=per_iteration,
                             overrides={"train.num_iterations": count,
                                        "train.eval_every": every,
                                        "train.checkpoint_every": every,
                                        **method_overrides(method)}))
    return runs


def held_out_curve(workdir: str, calls_per_iter: int) -> list[dict]:
    """[{iteration, calls, score: value...}] from the run's metrics.jsonl eval/* rows."""
    from g2rpo_jax.run import metrics
    rows = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
    return [dict(iteration=step, calls=step * calls_per_iter, **scores)
            for step, scores in metrics.by_step(rows, "eval/").items()]


def _flag(value) -> str:
    return str(value).replace(" ", "") if isinstance(value, tuple) else str(value)


def train(workdir: str, config_path: str, seed: int, run: dict) -> dict:
    summary_path = os.path.join(workdir, "summary.json")
    if not os.path.exists(summary_path):
        preset, _ = METHODS[run["method"]]
        # One compilation cache for the sweep: a method's programs compile once, not per seed.
        cache = os.path.join(os.path.dirname(os.path.abspath(workdir)), "compilation_cache")
        command = [sys.executable, "-m", "g2rpo_jax.main", f"--config={config_path}:{preset}",
                   f"--workdir={workdir}", f"--config.seed={seed}",
                   f"--config.compilation_cache_dir={cache}"]
        command += [f"--config.{k}={_flag(v)}" for k, v in run["overrides"].items()]
        print(f"[{time.strftime('%H:%M:%S')}] {' '.join(command[1:])}", flush=True)
        result = subprocess.run(command, cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        if result.returncode != 0:
            sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    with open(summary_path) as f:
        summary = json.load(f)
    if summary["iterations"] != run["iterations"]:
        sys.exit(f"{workdir} holds a run of {summary['iterations']} iterations, the sweep asks "
                 f"for {run['iterations']}: remove the folder or use another --workdir.")
    return dict(method=run["method"], seed=seed, budget=run["budget"],
                iterations=run["iterations"],
                transformer_calls=run["iterations"] * run["calls_per_iteration"],
                calls_per_iteration=run["calls_per_iteration"],
                base=summary["base"], final=summary["final"],
                wall_s=round(summary["timing"]["wall_s"], 1),   # the job's own, set-up included
                curve=held_out_curve(workdir, run["calls_per_iteration"]))


# --- report ------------------------------------------------------------------------------


def _gain(record: dict, score: str = "in_domain") -> float:
    return record["final"][score] - record["base"][score]


def _mean_std(values) -> str:
    if len(values) < 2:
        return f"{np.mean(values):+.3f}"
    return f"{np.mean(values):+.3f} ± {np.std(values, ddof=1):.3f}"


def paired_difference(records: list[dict], method: str, budget: str,
                      reference: str = REFERENCE) -> tuple[float, float, int] | None:
    """(mean, 95% t half-width, seeds) of final in_domain, `method` − `reference`, paired by
    seed; None with fewer than 2 shared seeds."""
    by_seed = {(r["method"], r["seed"]): r for r in records if r["budget"] == budget}
    seeds = sorted(s for (m, s) in by_seed if m == method and (reference, s) in by_seed)
    if len(seeds) < 2:
        return None
    diffs = np.array([by_seed[(method, s)]["final"]["in_domain"]
                      - by_seed[(reference, s)]["final"]["in_domain"] for s in seeds])
    half = stats.t.ppf(0.975, len(seeds) - 1) * diffs.std(ddof=1) / math.sqrt(len(seeds))
    return float(diffs.mean()), float(half), len(seeds)


def report(records: list[dict], command: str) -> str:
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    lines = ["# Comparing algorithms on the embedded world", "",
             f"`{command}`", "",
             "Held-out scores (195 prompts, fixed noise, ODE), final − base, mean ± std over "
             "seeds; `vs g2rpo` is the final in_domain difference paired by seed, mean ± 95% t "
             "half-width (an interval that excludes 0 is a significant difference).", ""]
    for budget in BUDGETS:
        rows = [r for r in records if r["budget"] == budget]
        if not rows:
            continue
        lines += [f"## {budget.replace('_', ' ')}", "",
                  "| method | seeds | iterations | transformer calls | final in_domain | "
                  "in_domain gain | out_of_domain gain | quality change | vs g2rpo | wall s |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for method in methods:
            runs = [r for r in rows if r["method"] == method]
            if not runs:
                continue
            paired = paired_difference(records, method, budget)
            versus = ("" if method == REFERENCE or paired is None
                      else f"{paired[0]:+.3f} ± {paired[1]:.3f}")
            finals = [r["final"]["in_domain"] for r in runs]
            lines.append(
                f"| {method} | {len(runs)} | {runs[0]['iterations']} | "
                f"{runs[0]['transformer_calls']:,} | {np.mean(finals):.3f} | "
                + " | ".join(_mean_std([_gain(r, s) for r in runs]) for s in SCORES)
                + f" | {versus} | {np.mean([r['wall_s'] for r in runs]):.0f} |")
        lines.append("")
    ablation = [(m, lams) for m, lams in ABLATION if m in methods]
    if ablation:
        lines += ["## Λ ablation (the paper's Table 2), in_domain gain", "",
                  "| Λ | " + " | ".join(b.replace("_", " ") for b in BUDGETS) + " |",
                  "|---|" + "---:|" * len(BUDGETS)]
        for method, lams in ablation:
            cells = []
            for budget in BUDGETS:
                runs = [r for r in records if r["method"] == method and r["budget"] == budget]
                cells.append(_mean_std([_gain(r) for r in runs]) if runs else "")
            lines.append(f"| {lams} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    budgets = [b for b in BUDGETS if any(r["budget"] == b for r in records)]
    fig, axes = plt.subplots(1, len(budgets), figsize=(6.5 * len(budgets), 4.5), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for method in METHODS:
            runs = [r for r in records if r["budget"] == budget and r["method"] == method]
            if not runs:
                continue
            length = min(len(r["curve"]) for r in runs)
            calls = np.array([p["calls"] for p in runs[0]["curve"][:length]]) / 1e6
            values = np.array([[p["in_domain"] for p in r["curve"][:length]] for r in runs])
            mean, std = values.mean(0), values.std(0)
            line, = ax.plot(calls, mean, marker="o", ms=3, label=f"{method} ({len(runs)})")
            ax.fill_between(calls, mean - std, mean + std, color=line.get_color(), alpha=0.15)
        ax.set_title(budget.replace("_", " "))
        ax.set_xlabel("transformer calls (millions)")
        ax.set_ylabel("held-out in_domain")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _list(text: str, known, what: str) -> list[str]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in items if s not in known]
    if unknown or not items:
        raise SystemExit(f"--{what} {text!r}: unknown {unknown}; choose from {list(known)}.")
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", help="where the runs live (kept, resumable)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--budgets", default=",".join(BUDGETS))
    parser.add_argument("--config", default="configs/shapes_cpu.py")
    parser.add_argument("--iterations", type=int, default=16, help="equal-iterations length")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "compare_algorithms.json"))
    parser.add_argument("--report_only", action="store_true",
                        help="write the .md and .png of the runs already in --out, train nothing")
    args = parser.parse_args()
    stem = os.path.splitext(args.out)[0]
    if args.report_only:
        with open(args.out) as f:
            recorded = json.load(f)
        write_report(recorded["runs"], recorded["command"], stem)
        return
    if not args.workdir:
        raise SystemExit("--workdir is required: the folder where the runs live (kept, so that "
                         "a stopped sweep continues).")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit("--seeds is empty: give at least one seed, e.g. --seeds=0.")
    methods = _list(args.methods, METHODS, "methods")
    budgets = _list(args.budgets, BUDGETS, "budgets")
    if "equal_calls" in budgets and REFERENCE not in methods:
        methods = [REFERENCE] + methods   # the budget is counted from it
    runs = plan_runs(args.config, methods, budgets, args.iterations)
    # The command as recorded (the workdir is this machine's: DIR).
    command = ("python benchmarks/learning/compare_algorithms.py --workdir=DIR "
               f"--seeds={args.seeds} --iterations={args.iterations} --config={args.config} "
               f"--methods={','.join(methods)} --budgets={','.join(budgets)}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    kept = recorded_runs(args.out, args.config)
    records = []
    for seed in seeds:          # seed-major: a sweep stopped early holds whole comparisons
        for run in runs:
            workdir = os.path.join(args.workdir,
                                   f"{run['method']}_it{run['iterations']}_seed{seed}")
            record = kept.get((run["method"], seed, run["budget"], run["iterations"]))
            if record is None or os.path.exists(os.path.join(workdir, "summary.json")):
                record = train(workdir, args.config, seed, run)
            records.append(record)
            with open(args.out, "w") as f:
                json.dump(dict(command=command, config=args.config, runs=records), f, indent=1)
    write_report(records, command, stem)


def recorded_runs(path: str, config_path: str) -> dict:
    """The records already in `path` from the same config, by (method, seed, budget,
    iterations): a sweep continued on another machine (without the earlier workdirs) keeps
    them instead of training them again."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        recorded = json.load(f)
    if recorded.get("config") != config_path:
        return {}
    return {(r["method"], r["seed"], r["budget"], r["iterations"]): r for r in recorded["runs"]}


def write_report(records: list[dict], command: str, stem: str) -> None:
    text = report(records, command)
    with open(stem + ".md", "w") as f:
        f.write(text + "\n")
    plot(records, stem + ".png")
    print(text)


if __name__ == "__main__":
    main()
