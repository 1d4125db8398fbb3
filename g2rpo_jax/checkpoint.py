"""Orbax checkpoints of the RL train state: written by the loop, read back by evaluation.

Layout (an Orbax CheckpointManager): WORKDIR/checkpoints/<step>/default/ holding
{"params": the policy's parameters (nnx pure dict), "opt_state": ..., "step": ...}.
"""

import os

from flax import nnx
import jax
import orbax.checkpoint as ocp

from g2rpo_jax.rl import update as update_lib

_STEP_MARKER = "_CHECKPOINT_METADATA"


def save(workdir: str, step: int, state: update_lib.TrainState) -> str:
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


def find_step(path: str) -> str | None:
    """The step folder of an Orbax checkpoint given as a training workdir, its checkpoints/
    folder (the latest step) or one step's folder; None if `path` is none of these."""
    if not os.path.isdir(path):
        return None
    if os.path.exists(os.path.join(path, _STEP_MARKER)):
        return path
    if os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    steps = [int(name) for name in os.listdir(path) if name.isdigit()
             and os.path.exists(os.path.join(path, name, _STEP_MARKER))]
    return os.path.join(path, str(max(steps))) if steps else None


def restore_params(step_dir: str, abstract_state: nnx.State, shardings: nnx.State):
    """The policy's parameters of a checkpoint step, each read straight into its sharding
    (the optimizer state is not read). `abstract_state` gives the structure, shapes and dtypes
    (the transformer the run started from)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(shardings))
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            os.path.join(step_dir, "default"),
            args=ocp.args.PyTreeRestore(item={"params": target},
                                        restore_args={"params": restore_args},
                                        partial_restore=True))
    except (ValueError, KeyError) as e:
        raise ValueError(f"The checkpoint {step_dir} does not hold this transformer's parameters "
                         f"({e}). Evaluate it with the config (model.checkpoint) it was trained "
                         "from.") from None
    state = jax.tree.map(lambda x: x, abstract_state)
    nnx.replace_by_pure_dict(state, restored["params"])
    return state
