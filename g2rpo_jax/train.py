"""RL fine-tuning of a generator (mode "train"): rollout → rewards → advantages → clipped GRPO
update, with held-out evaluation, logs, image grids, a reward-curve plot and an Orbax checkpoint.

  python -m g2rpo_jax.main --config=configs/shapes_cpu.py[:algorithm] --workdir=DIR

Outputs in DIR:
  metrics.jsonl, tensorboard/     per-iteration training scalars and periodic eval/* scores
  images/base.png, images/final.png   held-out samples (same prompts, same noise) before/after
  reward_curves.png               training reward, held-out scores, policy-ratio statistics
  checkpoints/<iteration>/        Orbax checkpoint of the train state (params, optimizer, step)
  generator.safetensors           the fine-tuned generator (loadable as a base / for evaluation)
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
import orbax.checkpoint as ocp
import tqdm

from g2rpo_jax import config_lib, evaluation, generator
from g2rpo_jax import metrics as metrics_lib
from g2rpo_jax.data import shapes_tfds, world
from g2rpo_jax.rl import iteration as iteration_lib
from g2rpo_jax.rl import update as update_lib
from g2rpo_jax.rl.algorithms import Algorithm


def make_reward_fn(gen: generator.Generator, names, prompts, config):
    """The training reward, computed on the host between the rollout's two jitted stages:
    `reward_fn(latents [P, M, N, C], prompt_ids [P] (indices into prompts)) -> float32
    [R, P, M]` over the named scores (`evaluation.score_images`)."""
    unknown = [n for n in names if n not in evaluation.SCORES]
    if unknown or not names:
        raise ValueError(f"reward.train must name rewards from {evaluation.SCORES}; got "
                         f"{list(names)}.")
    judge = evaluation.judge_fn(config, prompts) if "out_of_domain" in names else None
    decode = jax.jit(gen.decode)

    def reward_fn(latents, prompt_ids):
        images = np.asarray(decode(latents))                          # [P, M, H, W, 3]
        scores = evaluation.score_images(images, [prompts[i] for i in prompt_ids], names,
                                         judge, prompt_ids)
        return np.stack([scores[n] for n in names])
    return reward_fn


def _prompt_stream(config, mesh):
    """Per-host batches of training prompts from the TFDS train split (shuffled per epoch)."""
    data_dir = config.data.data_dir or None
    source = shapes_tfds.load_split(data_dir, "train", shapes_tfds.config_from(config))
    per_host = config.train.prompts_per_iteration // jax.process_count()
    reader = shapes_tfds.Reader(source, per_host, seed=config.seed)
    return reader


def _save_checkpoint(workdir: str, step: int, state: update_lib.TrainState) -> str:
    """An Orbax checkpoint of the train state; Orbax writes to a temporary directory and renames
    it when complete, so an interrupted save never leaves a half-written checkpoint."""
    directory = os.path.abspath(os.path.join(workdir, "checkpoints"))
    manager = ocp.CheckpointManager(directory, options=ocp.CheckpointManagerOptions(
        max_to_keep=2, create=True))
    tree = {"params": nnx.to_pure_dict(state.params), "opt_state": state.opt_state,
            "step": state.step}
    manager.save(step, args=ocp.args.StandardSave(tree))
    manager.wait_until_finished()
    manager.close()
    return os.path.join(directory, str(step))


def train(config, workdir: str, mesh, rules) -> dict:
    start = time.perf_counter()
    if not config.model.checkpoint:
        raise ValueError("config.model.checkpoint is empty: RL starts from a generator file "
                         "(the shipped base: configs/shapes_cpu.py sets it).")
    execution = config_lib.execution_fields(config.model)
    gen = generator.load_generator(config.model.checkpoint, mesh, rules, **execution)
    algo = Algorithm.from_config(config.algorithm)
    settings = config.train
    sigmas = evaluation.sigmas_from_config(config)
    train_prompts = world.split_prompts(config.world.split_seed,
                                        config.world.held_out_fraction)["train"]
    prompt_index = {p: i for i, p in enumerate(train_prompts)}
    reader = _prompt_stream(config, mesh)
    evaluator = evaluation.Evaluator(config, gen, evaluation.held_out_prompts(config), mesh)
    reward_names = list(config.reward.train)
    reward_fn = make_reward_fn(gen, reward_names, train_prompts, config)

    graphdef, params = nnx.split(gen.flux)
    optimizer = update_lib.make_optimizer(config.optimizer)
    state = update_lib.init_state(params, optimizer, algo.kl_beta > 0, mesh)
    sample_fn, finish_fn = map(jax.jit, iteration_lib.make_rollout_stages(
        graphdef, algo, sigmas, gen.latent_shape, config.reward.weights,
        guidance=config.sampling.guidance,
        quantize_timesteps=config.sampling.quantize_timesteps))
    update_fn = update_lib.make_update_fn(graphdef, optimizer, algo,
                                          update_lib.settings_from_config(config), sigmas)
    logger = metrics_lib.MetricsLogger(workdir)
    images_dir = os.path.join(workdir, "images")
    os.makedirs(images_dir, exist_ok=True)
    grid_count = min(settings.images_in_grid, len(evaluator.prompts))

    def evaluate(iteration, name=None):
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
    bar = tqdm.trange(settings.num_iterations, desc=f"train {config.algorithm.name}",
                      dynamic_ncols=True, disable=jax.process_index() != 0)
    for it in bar:
        tick = time.perf_counter()
        prompts = next(reader)["prompt"]
        cond = gen.encode(prompts, mesh)
        ids = np.asarray([prompt_index[p] for p in prompts], np.int32)
        with jax.set_mesh(mesh):
            finals, carry = sample_fn(state.params, cond, jax.random.fold_in(key, it), it)
            scores = reward_fn(finals, ids)
            batch, stats = finish_fn(jnp.asarray(scores), carry)
            if compiled_update is None:
                compiled_update = update_lib.jit_update(update_fn, state, batch, cond)
            state, metrics = compiled_update(state, batch, cond)
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
        bar.set_postfix({"reward": f"{reward_mean[0]:.3f}",
                         "ratio": f"[{summary['ratio_min']:.3f},{summary['ratio_max']:.3f}]",
                         "clip": f"{summary['clip_fraction']:.2f}",
                         "held_out": f"{latest.get('in_domain', float('nan')):.3f}"})
    iterations = settings.num_iterations
    final = evaluate(iterations, "final")
    seconds = time.perf_counter() - start
    checkpoint_dir = _save_checkpoint(workdir, iterations, state)
    report = {"base": base, "final": final, "iterations": iterations, "seconds": seconds,
              "seconds_per_iteration": float(np.median(iteration_seconds[1:] or
                                                       iteration_seconds or [0.0])),
              "first_iteration_seconds": iteration_seconds[0] if iteration_seconds else 0.0,
              "algorithm": config.algorithm.name, "seed": config.seed,
              "checkpoint": checkpoint_dir}
    if jax.process_index() == 0:
        gen.flux = nnx.merge(graphdef, state.params)
        generator.save_generator(os.path.join(workdir, "generator.safetensors"), gen,
                                 {"rl": {k: report[k] for k in ("base", "final", "iterations",
                                                                "algorithm", "seed")}})
        rows = metrics_lib.read_jsonl(logger.path)
        metrics_lib.plot_curves(rows, {
            "training reward": [f"train/reward_{n}" for n in reward_names],
            "held-out scores": [f"eval/{k}" for k in evaluation.SCORES],
            "policy ratio": ["train/ratio_min", "train/ratio_max", "train/clip_fraction"],
        }, os.path.join(workdir, "reward_curves.png"),
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
