"""RL fine-tuning of a generator (mode "train"): rollout → rewards → advantages → clipped GRPO
update, with held-out evaluation, logs, image grids, a reward-curve plot and an Orbax checkpoint.
One loop for every task (`config.task`, g2rpo_jax.tasks): the embedded shapes world, or the
real FLUX.1 stack with preprocessed prompt embeddings and reward models.

  python -m g2rpo_jax.main --config=configs/shapes_cpu.py[:algorithm] --workdir=DIR
  python -m g2rpo_jax.main --config=configs/flux_tiny.py --config.mode=train --workdir=DIR ...

Outputs in DIR:
  metrics.jsonl, tensorboard/     per-iteration training scalars and periodic eval/* scores
  images/base.png, images/final.png   held-out samples (same prompts, same noise) before/after
  reward_curves.png               training reward, held-out scores, policy-ratio statistics
  checkpoints/<iteration>/        Orbax checkpoint of the train state (params, optimizer, step)
                                  (train.checkpoint_every: also every that many iterations)
  generator.safetensors           shapes task: the fine-tuned generator (loadable as a base)
  summary.json                    {"base": {...}, "final": {...}, "iterations": n, "seconds": s}
"""

import json
import os
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from g2rpo_jax import checkpoint as checkpoint_lib
from g2rpo_jax import evaluation, tasks
from g2rpo_jax import metrics as metrics_lib
from g2rpo_jax.rl import iteration as iteration_lib
from g2rpo_jax.rl import update as update_lib
from g2rpo_jax.rl.algorithms import Algorithm
from g2rpo_jax.tasks import shapes as shapes_task

# The shapes world's training reward (kept here for the benchmarks that build it directly).
make_reward_fn = shapes_task.make_reward_fn


def train(config, workdir: str, mesh, rules) -> dict:
    """RL fine-tuning on the task `config.task` (g2rpo_jax.tasks: "shapes" or "flux")."""
    start = time.perf_counter()
    task = tasks.build(config, mesh, rules)
    algo = Algorithm.from_config(config.algorithm)
    settings = config.train
    sigmas = evaluation.sigmas_from_config(config)
    reward_names = list(task.reward_names)

    graphdef, params = nnx.split(task.policy)
    optimizer = update_lib.make_optimizer(config.optimizer)
    state = update_lib.init_state(params, optimizer, algo.kl_beta > 0, mesh)
    sample_fn, finish_fn = map(jax.jit, iteration_lib.make_rollout_stages(
        graphdef, algo, sigmas, task.latent_shape, task.reward_weights,
        guidance=config.sampling.guidance,
        quantize_timesteps=config.sampling.quantize_timesteps))
    update_fn = update_lib.make_update_fn(graphdef, optimizer, algo,
                                          update_lib.settings_from_config(config), sigmas)
    logger = metrics_lib.MetricsLogger(workdir)
    images_dir = os.path.join(workdir, "images")
    os.makedirs(images_dir, exist_ok=True)
    evaluator = task.evaluator
    grid_count = min(settings.images_in_grid, len(evaluator.prompts)) if evaluator else 0

    def evaluate(iteration, name=None):
        if evaluator is None:  # no held-out prompts configured
            return {}
        scores = evaluator.scores(state.params)
        logger.write(iteration, {f"eval/{k}": v for k, v in scores.items()})
        if name and jax.process_index() == 0:
            evaluation.save_grid(
                os.path.join(images_dir, f"{name}.png"), evaluator.last_images[:grid_count, 0],
                evaluator.prompts[:grid_count],
                title=f"{name} (iteration {iteration}): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in scores.items()))
        return scores

    base = evaluate(0, "base")
    logging.info("Base held-out scores: %s", base)
    key = jax.random.key(config.seed)
    compiled_update = None
    latest, iteration_seconds = base, []
    headline = task.score_names[0] if task.score_names else None
    checkpoint_every = settings.get("checkpoint_every", 0)
    bar = tqdm.trange(settings.num_iterations, desc=f"train {config.algorithm.name}",
                      dynamic_ncols=True, disable=jax.process_index() != 0)
    for it in bar:
        tick = time.perf_counter()
        batch = task.next_batch()
        cond = batch.cond
        with jax.set_mesh(mesh):
            finals, carry = sample_fn(state.params, cond, jax.random.fold_in(key, it), it)
            scores = task.rewards(finals, batch)
            train_batch, stats = finish_fn(jnp.asarray(scores), carry)
            if compiled_update is None:
                compiled_update = update_lib.jit_update(update_fn, state, train_batch, cond)
            state, metrics = compiled_update(state, train_batch, cond)
        summary = update_lib.summarize(metrics)
        reward_mean = np.asarray(stats["reward_mean"])
        row = {f"train/reward_{n}": float(v) for n, v in zip(reward_names, reward_mean)}
        row["train/reward_std"] = float(np.mean(stats["reward_std"]))
        row.update({f"train/{k}": v for k, v in summary.items()})
        if not np.isfinite(summary["loss"]):
            raise FloatingPointError(
                f"The loss is {summary['loss']} at iteration {it} ({algo}); no checkpoint was "
                "written. Lower optimizer.learning_rate or algorithm.advantage_clip.")
        iteration_seconds.append(time.perf_counter() - tick)
        row["train/seconds"] = iteration_seconds[-1]
        if settings.eval_every and (it + 1) % settings.eval_every == 0 \
                and it + 1 < settings.num_iterations:
            latest = evaluate(it + 1)
        logger.write(it + 1, row)
        if checkpoint_every and (it + 1) % checkpoint_every == 0 \
                and it + 1 < settings.num_iterations:
            checkpoint_lib.save(workdir, it + 1, state)
        bar.set_postfix({"reward": f"{reward_mean[0]:.3f}",
                         "ratio": f"[{summary['ratio_min']:.3f},{summary['ratio_max']:.3f}]",
                         "clip": f"{summary['clip_fraction']:.2f}",
                         "held_out": f"{latest.get(headline, float('nan')):.3f}"})
    iterations = settings.num_iterations
    final = evaluate(iterations, "final")
    seconds = time.perf_counter() - start
    checkpoint_dir = checkpoint_lib.save(workdir, iterations, state)
    report = {"base": base, "final": final, "iterations": iterations, "seconds": seconds,
              "seconds_per_iteration": float(np.median(iteration_seconds[1:] or
                                                       iteration_seconds or [0.0])),
              "first_iteration_seconds": iteration_seconds[0] if iteration_seconds else 0.0,
              "algorithm": config.algorithm.name, "seed": config.seed,
              "checkpoint": checkpoint_dir}
    if jax.process_index() == 0:
        task.save(workdir, nnx.merge(graphdef, state.params),
                  {k: report[k] for k in ("base", "final", "iterations", "algorithm", "seed")})
        rows = metrics_lib.read_jsonl(logger.path)
        panels = {"training reward": [f"train/reward_{n}" for n in reward_names],
                  "held-out scores": [f"eval/{k}" for k in task.score_names],
                  "policy ratio": ["train/ratio_min", "train/ratio_max", "train/clip_fraction"]}
        metrics_lib.plot_curves(rows, {k: v for k, v in panels.items() if v},
                                os.path.join(workdir, "reward_curves.png"),
                                title=f"{config.algorithm.name}, seed {config.seed}")
        with open(os.path.join(workdir, "summary.json"), "w") as f:
            json.dump(report, f, indent=2)
        print_summary(report)
    logger.close()
    return report


def print_summary(report: dict) -> None:
    lines = [f"{'score':<16}{'base':>10}{'final':>10}{'change':>10}"]
    for name in report["base"]:
        b, f = report["base"][name], report["final"][name]
        lines.append(f"{name:<16}{b:>10.3f}{f:>10.3f}{f - b:>+10.3f}")
    lines.append(f"{report['algorithm']}, seed {report['seed']}: {report['iterations']} "
                 f"iterations in {report['seconds']:.0f} s "
                 f"({report['seconds_per_iteration']:.1f} s per iteration after the first)")
    print("\n".join(lines), flush=True)
