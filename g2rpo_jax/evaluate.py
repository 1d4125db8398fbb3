r"""Held-out evaluation of a checkpoint, as the paper's Table 1: every configured reward on the
held-out prompts, mean ± std, in-domain (the rewards trained on) vs out-of-domain (the others).

  python -m g2rpo_jax.evaluate --config=configs/flux_tiny.py --checkpoint=PATH \
      [--output=FILE.json] [--config.x.y=...]

`--checkpoint`: a pretrained transformer (a FLUX.1 diffusers folder, its transformer/, or a BFL
flux1-*.safetensors; for the shapes world a generator file), or an Orbax checkpoint written by
`mode=train` (the training workdir, its checkpoints/ folder for the latest step, or one step's
folder; the architecture then comes from config.model.checkpoint, the run's starting point).
Images are sampled with the ODE sampler from fixed noise (config.evaluation.seed) for the
prompts of the evaluation dataset (config.data.eval_prompts_file, preprocessed; num_prompts 0 =
all, e.g. HPDv2's 400 test prompts) and scored by config.reward.evaluate.

Writes FILE.json (default: evaluation.json in the training workdir for an Orbax checkpoint, else
in the current directory) and a grid of the first images beside it (FILE.png).
"""

import os
import time

from absl import app, flags, logging
from flax import nnx
import jax
import numpy as np

from g2rpo_jax import parallel, tasks
from g2rpo_jax.core import storage
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import held_out

_FLAGS = {}


def define_flags() -> None:
    """Command-line flags, defined only when run as a program (so that importing this module
    next to another entry point does not define --config twice)."""
    _FLAGS["config"] = config_lib.define_config_flag()
    _FLAGS["checkpoint"] = flags.DEFINE_string(
        "checkpoint", None, "A pretrained transformer (diffusers folder / BFL file; shapes: a "
        "generator file) or an Orbax checkpoint of mode=train (workdir, checkpoints/ or a step).")
    _FLAGS["output"] = flags.DEFINE_string("output", "", "The JSON report (default: see the "
                                           "module docstring).")
    flags.mark_flags_as_required(["config", "checkpoint"])


def summarize(per_image: dict[str, np.ndarray], trained_on) -> dict:
    """{name: [P, M] scores} → {"in_domain": {name: {mean, std}}, "out_of_domain": {...}}
    (std over all P·M images)."""
    report = {"in_domain": {}, "out_of_domain": {}}
    for name, values in per_image.items():
        side = "in_domain" if name in trained_on else "out_of_domain"
        report[side][name] = {"mean": float(np.mean(values)), "std": float(np.std(values))}
    return report


def format_table(report: dict, label: str) -> str:
    """Table 1's layout: one column per reward, in-domain first, `mean ± std`."""
    groups = [("in-domain", report["in_domain"]), ("out-of-domain", report["out_of_domain"])]
    cells = [(side, name, f"{v['mean']:.4f} ± {v['std']:.4f}")
             for side, scores in groups for name, v in scores.items()]
    width = max([len(c) for _, n, c in cells] + [len(n) for _, n, _ in cells] + [13]) + 2
    first = max(len(label), 10) + 2
    header_groups, names, values = " " * first, "reward".ljust(first), label.ljust(first)
    for side, scores in groups:
        if not scores:
            continue
        span = width * len(scores)
        header_groups += f"| {side}".ljust(span + 2)
        names += "| " + "".join(n.ljust(width) for n in scores)
        values += "| " + "".join(c.ljust(width) for s, n, c in cells if s == side)
    return "\n".join(line.rstrip() for line in (header_groups, names, values))


def _default_output(checkpoint: str, step_dir: str | None) -> str:
    if step_dir is None:
        return os.path.abspath("evaluation.json")
    step_dir = storage.absolute(step_dir).rstrip("/")
    workdir = os.path.dirname(os.path.dirname(step_dir))
    return os.path.join(workdir, f"evaluation-{os.path.basename(step_dir)}.json")


def evaluate(config, checkpoint: str, mesh, rules, output: str = "") -> dict:
    """Samples and scores the held-out prompts with `checkpoint`'s transformer; returns the
    report (also written as JSON by process 0)."""
    start = time.perf_counter()
    step_dir = checkpoint_lib.find_step(checkpoint)
    config = config.copy_and_resolve_references()
    if step_dir is None:
        if not storage.path(checkpoint).exists():
            raise FileNotFoundError(f"No checkpoint at {checkpoint}: give a pretrained "
                                    "transformer or an Orbax checkpoint written by mode=train.")
        config.model.checkpoint = checkpoint
    task = tasks.build(config, mesh, rules, training=False)
    evaluator = task.evaluator
    if evaluator is None:
        raise ValueError("No held-out prompts to evaluate on: set config.data.eval_prompts_file "
                         "and preprocess it (python -m g2rpo_jax.preprocess).")
    params = nnx.state(task.policy)
    if step_dir is not None:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
        shardings = jax.tree.map(lambda x: x.sharding, params)
        params = checkpoint_lib.restore_params(step_dir, abstract, shardings)
    evaluation = evaluator.evaluate(params)
    trained_on = tuple(task.reward_names)
    report = dict(summarize(evaluation.per_image, trained_on), checkpoint=storage.absolute(step_dir or
                                                                                checkpoint),
                  trained_on=list(trained_on), prompts=len(evaluator.prompts),
                  samples_per_prompt=evaluator.samples, seed=config.evaluation.seed,
                  num_steps=config.sampling.num_steps,
                  seconds=round(time.perf_counter() - start, 2))
    if evaluation.counts:   # the embedded world's object counts over all the images
        report["object_counts"] = evaluation.totals()
    categories = evaluation.by_category()
    if categories:   # GenEval's layout: the overall mean, then each category
        report["categories"] = categories
    output = output or _default_output(checkpoint, step_dir)
    if jax.process_index() == 0:
        storage.write_json(output, report)
        count = min(16, len(evaluator.prompts))
        held_out.save_grid(os.path.splitext(output)[0] + ".png",
                           evaluation.first_images[:count, 0], evaluator.prompts[:count])
        label = (f"step {os.path.basename(step_dir)}" if step_dir
                 else os.path.basename(os.path.normpath(checkpoint)))
        print(f"{len(evaluator.prompts)} held-out prompts × {evaluator.samples} sample(s), "
              f"trained on {', '.join(trained_on)}:\n{format_table(report, label)}\n"
              + ("\n".join(held_out.category_table(
                  [(label, evaluation.means(), categories)])) + "\n" if categories else "")
              + "".join(f"{name.replace('_', ' ')}: {total}\n"
                        for name, total in report.get("object_counts", {}).items())
              + f"written to {output}", flush=True)
    report["output"] = output
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _FLAGS["config"].value
    parallel.initialize_distributed(config.distributed)
    mesh = parallel.mesh_from_config(config.mesh)
    rules = parallel.rules_from_config(config.sharding_rules)
    report = evaluate(config, _FLAGS["checkpoint"].value, mesh, rules, _FLAGS["output"].value)
    logging.info("Evaluation took %.1f s.", report["seconds"])


if __name__ == "__main__":
    define_flags()
    app.run(main)
