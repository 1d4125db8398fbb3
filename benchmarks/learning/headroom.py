"""What caps the RL gain on the embedded world: the verifier's ceiling, the base's capacity
(supervised fine-tuning on ideal scenes), and exploration (how much better the best sample of
a group is than the group's mean, by η and group size).

  python benchmarks/learning/headroom.py --out=benchmarks/results/headroom.json
      [--generator=PATH] [--parts=ceiling,base,exploration,sft] [--sft_steps=600]

Every part uses the main job's settings (configs/shapes_cpu.py: T = 10 Euler steps, the
held-out evaluation's fixed noise), so its figures sit on the same scale as the main job's
held-out in_domain:

  ceiling      ideal scenes (`world.render_prompt`, `--ceiling_samples` per held-out prompt)
               scored by the verifier: the most a perfect generator can get.
  base         the generator's held-out in_domain; then `--samples` fresh ODE samples of
               every held-out prompt: their mean and the mean of each prompt's best sample
               (best-of-G: what choosing among G starting noises could reach).
  exploration  the main job's G²RPO rollout on `--explore_prompts` training prompts, for each
               η × group size: at the finest granularity, per (branch step, prompt) group, the
               mean reward, the best-of-G reward, the within-group standard deviation, and the
               share of groups whose rewards are all equal (no advantage, no gradient).
  sft          flow-matching fine-tuning of the generator (transformer and word encoder, as in
               pre-training) on freshly rendered ideal scenes, `--sft_steps` steps of batch
               `--sft_batch` at `--sft_lr`: once on the training prompts (what supervised
               learning on perfect data generalises to) and once on the held-out prompts
               themselves (what the model can represent at all); held-out in_domain every
               third of the run.

Per-category figures (GenEval's categories) are added where the world defines them
(`world.category`). Writes `--out` (JSON) and prints a table.
"""

import argparse
import json
import os
import time

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from g2rpo_jax import parallel, pretrain
from g2rpo_jax.data import world
from g2rpo_jax.rewards import verifier
from g2rpo_jax.rl import algorithms, iteration
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator as generator_lib
from g2rpo_jax.tasks import held_out
from g2rpo_jax.tasks import shapes as shapes_task

PARTS = ("ceiling", "base", "exploration", "sft")


def _by_category(prompts, values) -> dict[str, float]:
    """Mean of per-prompt values [P, ...] by the world's categories (empty without them)."""
    if not hasattr(world, "category"):
        return {}
    values = np.asarray(values, np.float64).reshape(len(prompts), -1).mean(1)
    cats = np.array([world.category(p) for p in prompts])
    return {c: float(values[cats == c].mean()) for c in dict.fromkeys(cats)}


def ceiling(config, prompts, samples: int) -> dict:
    grid = config.world.get("placement_grid", 1)
    rng = np.random.default_rng(0)
    images = np.stack([world.render_prompt(p, rng, config.world.image_size, grid)
                       for p in prompts for _ in range(samples)])
    scores = verifier.score_batch(images, [p for p in prompts for _ in range(samples)])
    return {"in_domain": float(scores.mean()), "samples_per_prompt": samples,
            "by_category": _by_category(prompts, scores)}


def base(config, bundle, prompts, mesh, samples: int) -> dict:
    params = nnx.state(bundle.flux, nnx.Param)
    evaluator = held_out.Evaluator(config, bundle, prompts, mesh, scorers=("in_domain",))
    fixed = evaluator.evaluate(params).per_image["in_domain"]
    many = config.copy_and_resolve_references()
    many.evaluation.samples_per_prompt = samples
    many.evaluation.seed = config.evaluation.seed + 1
    scores = held_out.Evaluator(many, bundle, prompts, mesh, scorers=("in_domain",)
                                ).evaluate(params).per_image["in_domain"]       # [P, G]
    return {"in_domain": float(fixed.mean()), "by_category": _by_category(prompts, fixed),
            "samples_per_prompt": samples, "mean_of_samples": float(scores.mean()),
            "best_of_samples": float(scores.max(1).mean()),
            "best_by_category": _by_category(prompts, scores.max(1))}


def exploration(config, bundle, train_prompts, mesh, etas, groups, num_prompts: int) -> list:
    picked = np.linspace(0, len(train_prompts) - 1, num_prompts).astype(int)
    prompts = [train_prompts[i] for i in picked]
    sigmas = held_out.sigmas_from_config(config)
    graphdef, params = nnx.split(bundle.flux)
    reward_fn = shapes_task.make_reward_fn(bundle, ["in_domain"], prompts, config)
    cond = parallel.place_cond(bundle.encode(prompts), mesh)
    rows = []
    for group_size in groups:
        for eta in etas:
            fields = config.algorithm.to_dict()
            fields.update(eta=eta, group_size=group_size)
            algo = algorithms.Algorithm.from_config(fields)
            sample, _ = iteration.make_rollout_stages(graphdef, algo, sigmas,
                                                      bundle.latent_shape, (1.0,), None)
            start = time.perf_counter()
            with jax.set_mesh(mesh):
                finals, _ = jax.jit(sample)(params, cond, jax.random.key(0), 0)
            scores = reward_fn(parallel.local_rows(finals, mesh), np.arange(len(prompts)))[0]
            k, j = len(algo.branch_steps), len(algo.granularities)
            rewards = scores.reshape(len(prompts), k, j, group_size)
            finest = rewards[:, :, int(np.argmin(algo.granularities))]     # [P, K, G]
            rows.append({
                "eta": eta, "group_size": group_size, "prompts": len(prompts),
                "mean": float(finest.mean()), "best_of_group": float(finest.max(-1).mean()),
                "within_group_std": float(finest.std(-1, ddof=1).mean()),
                "all_equal_groups": float((finest.max(-1) == finest.min(-1)).mean()),
                "seconds": time.perf_counter() - start})
            print(f"  exploration η={eta} G={group_size}: {rows[-1]}", flush=True)
    return rows


def sft(config, bundle, train_prompts, eval_prompts, mesh, steps: int, batch: int, lr: float
        ) -> dict:
    """Flow-matching fine-tuning from `bundle` on ideal scenes of `train_prompts`."""
    opt_config = config_lib.optimizer_config(learning_rate=lr, schedule="warmup_constant",
                                             warmup_steps=min(50, steps // 4),
                                             weight_decay=0.0)
    optimizer = optimizer_lib.make_optimizer(opt_config)
    flux_graphdef, flux_params = nnx.split(bundle.flux, nnx.Param)
    enc_graphdef, enc_params = nnx.split(bundle.text_encoder, nnx.Param)
    params = jax.tree.map(jnp.copy, {"flux": flux_params, "text_encoder": enc_params})
    opt_state = jax.jit(optimizer.init)(params)
    step_fn = jax.jit(pretrain.make_train_step(flux_graphdef, enc_graphdef, bundle.autoencoder,
                                               optimizer), donate_argnums=(0, 1))
    evaluator = held_out.Evaluator(config, bundle, eval_prompts, mesh, scorers=("in_domain",))
    grid, size = config.world.get("placement_grid", 1), config.world.image_size
    rng = np.random.default_rng(1)
    key = jax.random.key(1)
    curve, start = [], time.perf_counter()

    def evaluate(step):
        scores = evaluator.evaluate(params["flux"], nnx.merge(enc_graphdef,
                                                              params["text_encoder"]))
        per_image = scores.per_image["in_domain"]
        curve.append({"step": step, "in_domain": float(per_image.mean()),
                      "by_category": _by_category(eval_prompts, per_image),
                      "seconds": time.perf_counter() - start})
        print(f"  sft step {step}: {curve[-1]}", flush=True)

    evaluate(0)
    with jax.set_mesh(mesh):
        for step in range(steps):
            picked = rng.integers(len(train_prompts), size=batch)
            prompts = [train_prompts[i] for i in picked]
            images = np.stack([world.render_prompt(p, rng, size, grid) for p in prompts])
            ids, mask = bundle.tokenize(prompts)
            params, opt_state, _, loss = step_fn(params, opt_state, None, images, ids, mask,
                                                 jax.random.fold_in(key, step), step)
            if (step + 1) % max(1, steps // 3) == 0 or step + 1 == steps:
                if curve[-1]["step"] != step + 1:
                    evaluate(step + 1)
    return {"steps": steps, "batch": batch, "learning_rate": lr, "curve": curve,
            "final": curve[-1]["in_domain"], "final_loss": float(loss)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "headroom.json"))
    parser.add_argument("--generator", default=generator_lib.SHIPPED_BASE)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--ceiling_samples", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--etas", default="0.3,0.7,1.0")
    parser.add_argument("--groups", default="8,16")
    parser.add_argument("--explore_prompts", type=int, default=32)
    parser.add_argument("--sft_steps", type=int, default=600)
    parser.add_argument("--sft_batch", type=int, default=64)
    parser.add_argument("--sft_lr", type=float, default=2e-4)
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; the parts are {list(PARTS)}")

    config = config_lib.load_config("shapes_cpu.py")
    mesh = parallel.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    bundle = generator_lib.load_generator(args.generator, mesh)
    prompts = held_out.held_out_prompts(config)
    split = world.split_prompts(config.world.split_seed, config.world.held_out_fraction)
    report = {"generator": os.path.basename(args.generator), "held_out_prompts": len(prompts),
              "num_steps": config.sampling.num_steps,
              "branch_steps": list(config.algorithm.branch_steps),
              "granularities": list(config.algorithm.granularities)}
    if os.path.exists(args.out):
        with open(args.out) as f:
            report = {**json.load(f), **report}
    start = time.perf_counter()
    if "ceiling" in parts:
        report["ceiling"] = ceiling(config, prompts, args.ceiling_samples)
        print("ceiling:", report["ceiling"], flush=True)
    if "base" in parts:
        report["base"] = base(config, bundle, prompts, mesh, args.samples)
        print("base:", report["base"], flush=True)
    if "exploration" in parts:
        report["exploration"] = exploration(
            config, bundle, split["train"], mesh, [float(e) for e in args.etas.split(",")],
            [int(g) for g in args.groups.split(",")], args.explore_prompts)
    if "sft" in parts:
        report["sft"] = {
            name: sft(config, bundle, data, prompts, mesh, args.sft_steps, args.sft_batch,
                      args.sft_lr)
            for name, data in (("train_prompts", split["train"]), ("held_out_prompts", prompts))}
    report["seconds"] = time.perf_counter() - start
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
