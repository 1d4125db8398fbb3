"""The margin of the learning test (`tests/rl/test_learning.py`): how much a short RL run on a
fixed batch raises its training reward, how much that gain varies, and what a flipped
objective or zeroed advantages give, and what updates without signal give.

  python benchmarks/learning/learning_signal.py [--seeds=0,1,2,3,4] [--control-seeds=0,1,2]
      [--out=benchmarks/results/learning_signal.json]

Each run is `g2rpo_jax.testing.learning.fixed_prompt_run` (the same prompts, starting noise and
SDE noise every iteration: one batch, overfitted), for G²RPO and DanceGRPO:
  trained   the method as it trains (`--seeds`);
  shuffled  each prompt's rewards permuted among its samples: updates of the same size without
            signal, so their gains are the noise a real gain must clear (`--seeds`);
  flipped   reward_scale −1: what a flipped gradient sign does (`--control-seeds`);
  zeroed    reward_scale 0: no advantages, the parameters cannot move (the first control seed).
The gain is the training reward of the final parameters' rollout minus the base's, on the
same noise. Prints one line per run and the mean ± std per (method, control).
"""

import argparse
import json
import os
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
METHODS = ("g2rpo", "dance_grpo")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--control-seeds", default="0,1,2")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices (data axis)")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="AdamW rate (default: testing.learning.SETTING's)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="updates per run (default: testing.learning.SETTING's)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "learning_signal.json"))
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", args.devices)
    import numpy as np

    from g2rpo_jax import parallel
    from g2rpo_jax.testing import learning

    mesh = parallel.make_mesh({"data": args.devices, "fsdp": 1, "tensor": 1})
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    control_seeds = [int(s) for s in args.control_seeds.split(",") if s.strip()]
    setting = {k: v for k, v in (("learning_rate", args.learning_rate),
                                 ("iterations", args.iterations)) if v is not None}
    runs = []
    controls = (("trained", dict(), seeds), ("shuffled", dict(shuffle_rewards=True), seeds),
                ("flipped", dict(reward_scale=-1.0), control_seeds),
                ("zeroed", dict(reward_scale=0.0), control_seeds[:1]))
    for method in METHODS:
        for control, options, chosen in controls:
            for seed in chosen:
                began = time.perf_counter()
                rewards = learning.fixed_prompt_run(method, mesh, seed=seed, **options,
                                                    **setting)
                runs.append(dict(method=method, control=control, seed=seed,
                                 gain=rewards[-1] - rewards[0], rewards=rewards,
                                 seconds=round(time.perf_counter() - began, 1)))
                print(f"{method:10s} {control:8s} seed {seed}: training reward "
                      f"{rewards[0]:.3f} → {rewards[-1]:.3f} ({runs[-1]['gain']:+.3f}), "
                      f"{runs[-1]['seconds']:.0f} s", flush=True)
    summary = {}
    for method in METHODS:
        for control, _, _ in controls:
            gains = [r["gain"] for r in runs if r["method"] == method
                     and r["control"] == control]
            summary[f"{method} {control}"] = dict(
                mean=float(np.mean(gains)), std=float(np.std(gains, ddof=1)) if len(gains) > 1
                else 0.0, min=float(np.min(gains)), max=float(np.max(gains)), runs=len(gains))
    for name, s in summary.items():
        print(f"{name:22s} gain {s['mean']:+.3f} ± {s['std']:.3f} (min {s['min']:+.3f}, "
              f"max {s['max']:+.3f}, {s['runs']} runs)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(command="python benchmarks/learning/learning_signal.py " + " ".join(
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
            if k != "out" and v is not None),
            setting={**learning.SETTING, **setting}, prompts=learning.fixed_prompts(), runs=runs,
            summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
