"""What the RL loop (train.py) and the evaluation run on, behind one small interface.

A task bundles what differs between the embedded shapes world and the real FLUX.1 stack: the
policy to start from, the stream of prompts and their conditioning, decoding and the training
rewards, the held-out evaluator, and how the fine-tuned policy is saved. The loop itself is the
same code for both (`base.Task` lists the interface).

  task = tasks.build(config, mesh, rules)   # config.task: "shapes" | "flux"
"""

from g2rpo_jax.tasks.base import Batch, Task

KINDS = ("shapes", "flux")


def build(config, mesh, rules, training: bool = True) -> Task:
    """The task named by `config.task` (training=False: only what evaluation needs)."""
    kind = config.task
    if kind == "shapes":
        from g2rpo_jax.tasks import shapes

        return shapes.ShapesTask(config, mesh, rules, training)
    if kind == "flux":
        from g2rpo_jax.tasks import flux

        return flux.FluxTask(config, mesh, rules, training)
    raise ValueError(f"Unknown config.task {kind!r}; choose one of {KINDS}.")


__all__ = ["Batch", "KINDS", "Task", "build"]
