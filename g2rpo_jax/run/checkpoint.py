"""Checkpoints of an RL run, and resuming from them.

One `RunCheckpoints` per run keeps an Orbax CheckpointManager open on WORKDIR/checkpoints.
Every step's folder, WORKDIR/checkpoints/<iteration>/, holds three items:

  state/   the train state's arrays: {"params", "opt_state", "step", "rng" (the loop's key
           data), "ref_params" (the KL reference, where the algorithm has one)}
  loop/    JSON, what the loop needs to continue exactly: the iteration, the prompt reader's
           position, the base / latest / final held-out scores, the number of metrics.jsonl
           rows written, the skipped-step counters, the seconds spent
  config/  JSON, the run's config, compared with the config of a resumed run

Orbax writes a step into a temporary folder and renames it once every item is complete (on
object stores: a commit marker), so a save interrupted by a kill is never listed as a step;
the manager removes such leftovers when it is opened again. WORKDIR may be a gs:// path
(g2rpo_jax.core.storage; Orbax writes the arrays with tensorstore, TENSORSTORE_GCS_HTTP_URL for an
emulator).
"""

import json
import logging
import os
import uuid

from flax import nnx
import jax
import numpy as np
import orbax.checkpoint as ocp

from g2rpo_jax.core import storage
from g2rpo_jax.rl import policy_update

logger = logging.getLogger(__name__)

_STEP_MARKER = "_CHECKPOINT_METADATA"
CHECKPOINTS = "checkpoints"

# Config fields that may differ between a killed run and its resumption: how long the run goes
# on and how often it evaluates or saves, where it runs (mesh, processes, sharding rules), how
# the same computation is laid out in memory, and where it is logged (logging.*: e.g. W&B
# turned on for the rest of a run). Any other difference is refused by name.
# An entry ending in "." covers a whole section. model.attention_impl is the attention field's
# name in configs saved by older versions, so their runs resume.
RESUMABLE_FIELDS = (
    "train.num_iterations", "train.eval_every", "train.images_in_grid",
    "train.checkpoint_every", "train.checkpoint_every_seconds", "train.checkpoints_to_keep",
    "train.async_checkpointing", "train.start_over", "train.max_consecutive_skips",
    "train.samples_every", "train.sample_prompts", "train.hacking_margin",
    "train.hacking_window",
    "mesh.", "distributed.", "sharding_rules", "describe.", "compilation_cache_dir",
    "model.remat_policy", "model.attention", "model.attention_impl",
    "policy_update.micro_batch_prompts", "reward.batch_size", "data.data_dir", "logging.",
)

# What train.start_over removes from a used workdir (the outputs of the run there; with the
# W&B run id gone the new run is a new W&B run, and wandb/ holds the old one's local files).
RUN_OUTPUTS = (CHECKPOINTS, "metrics.jsonl", "tensorboard", "summary.json", "summary.md",
               "wandb_run_id", "wandb")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (another model, another config, unreadable)."""


def ensure_writable(workdir: str) -> str:
    """Creates `workdir` if needed (local) and proves it writable by writing a probe file (a
    gs:// workdir: an object), before any compute; raises a clear error otherwise.

    Raises:
      PermissionError: not writable, or (gs://) the bucket does not exist.
      ConnectionError: the storage endpoint does not answer (storage.probe).
    """
    if not workdir:
        raise PermissionError("No workdir given: pass --workdir=DIR (a local directory or a "
                              "gs://bucket/path).")
    try:
        storage.makedirs(workdir)
        probe = os.path.join(workdir, f".write-test-{uuid.uuid4().hex}")
        storage.write_text(probe, "ok")
        storage.path(probe).unlink()
    except ConnectionError:
        raise   # names the endpoint already
    except (OSError, ValueError) as e:   # gcsfs: FileNotFoundError (no bucket), OSError (403)
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e).strip()
        where = ("a gs://bucket/path in an existing bucket this job may write (its "
                 "credentials need storage.objects.create and delete there)"
                 if storage.is_remote(workdir) else "a directory this job can create and write")
        raise PermissionError(
            f"The workdir {workdir} is not writable ({reason}): give --workdir {where} "
            "(checkpoints, metrics and images go there).") from None
    return workdir


def start_over(workdir: str) -> list[str]:
    """train.start_over: removes the outputs of an earlier run in `workdir` (process 0) and
    returns what it removed."""
    removed = []
    if jax.process_index() == 0:
        for name in RUN_OUTPUTS:
            path = os.path.join(workdir, name)
            if storage.remove(path):
                removed.append(path)
        if removed:
            logger.warning("train.start_over: removed the earlier run's %s.", ", ".join(removed))
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("g2rpo_jax.run.checkpoint.start_over")
    return removed


def config_json(config) -> dict:
    """The config as plain JSON values (tuples become lists), as stored in a checkpoint."""
    return json.loads(config.to_json_best_effort())


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_differences(stored: dict, current: dict) -> dict[str, tuple]:
    """{field: (value in the checkpoint, value now)} for every field that differs ("<absent>"
    where one side lacks it)."""
    a, b = _flatten(stored), _flatten(current)
    missing = "<absent>"
    return {k: (a.get(k, missing), b.get(k, missing)) for k in sorted(set(a) | set(b))
            if a.get(k, missing) != b.get(k, missing)}


def is_resumable_field(name: str) -> bool:
    return any(name == f or (f.endswith(".") and name.startswith(f)) for f in RESUMABLE_FIELDS)


def _first_lines(lines: list[str], limit: int = 12) -> str:
    return "\n".join(lines[:limit]) + (
        f"\n  ... and {len(lines) - limit} more" if len(lines) > limit else "")


def _describe_differences(differences: dict, limit: int = 12) -> str:
    lines = [f"  {k}: {a!r} in the checkpoint, {b!r} now"
             for k, (a, b) in list(differences.items())[:limit]]
    if len(differences) > limit:
        lines.append(f"  ... and {len(differences) - limit} more")
    return "\n".join(lines)


def _state_tree(state: policy_update.TrainState, rng) -> dict:
    tree = {"params": nnx.to_pure_dict(state.params), "opt_state": state.opt_state,
            "step": state.step, "rng": rng}
    if state.ref_params is not None:
        tree["ref_params"] = nnx.to_pure_dict(state.ref_params)
    return tree


def _shapes_by_path(tree) -> dict[str, tuple]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path):
            (tuple(leaf.shape), np.dtype(leaf.dtype).name) for path, leaf in flat}


def model_differences(stored_params, target_params) -> list[str]:
    """Lines naming the parameters that are missing, extra or of another shape or dtype."""
    stored, target = _shapes_by_path(stored_params), _shapes_by_path(target_params)
    lines = [f"  params/{k}: not in the checkpoint (model {target[k][0]})"
             for k in sorted(set(target) - set(stored))]
    lines += [f"  params/{k}: only in the checkpoint {stored[k][0]}"
              for k in sorted(set(stored) - set(target))]
    lines += [f"  params/{k}: {stored[k][0]} {stored[k][1]} in the checkpoint, model "
              f"{target[k][0]} {target[k][1]}" for k in sorted(set(stored) & set(target))
              if stored[k] != target[k]]
    return lines


class RunCheckpoints:
    """The checkpoints of one run (see the module docstring), opened once for the run.

      run = RunCheckpoints(workdir, max_to_keep=3, async_save=True)
      restored = run.restore_latest(abstract_state, config)     # None: nothing to resume
      run.save(iteration, state, rng, loop, config)             # asynchronous unless wait
      run.close()                                                # waits for a save in flight
    """

    def __init__(self, workdir: str, max_to_keep: int = 3, async_save: bool = True):
        self.directory = storage.absolute(os.path.join(workdir, CHECKPOINTS))
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep or None, create=True, cleanup_tmp_directories=True,
                enable_async_checkpointing=async_save),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "loop": ocp.JsonCheckpointHandler(),
                           "config": ocp.JsonCheckpointHandler()})

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def save(self, step: int, state: policy_update.TrainState, rng, loop: dict, config,
             wait: bool = False) -> str:
        """Saves the step (asynchronously: the arrays are copied off the devices before this
        returns, then written in the background). A step that is already saved is an error,
        never silently skipped."""
        if step in self.manager.all_steps():
            raise CheckpointError(f"Iteration {step} is already saved in {self.directory}.")
        saved = self.manager.save(step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(_state_tree(state, jax.random.key_data(rng))),
            loop=ocp.args.JsonSave(json.loads(json.dumps(loop))),
            config=ocp.args.JsonSave(config_json(config))))
        if not saved:
            raise CheckpointError(f"Orbax did not save iteration {step} in {self.directory}.")
        if wait:
            self.wait()
        return self.step_dir(step)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.close()

    def _check_compatible(self, step: int, target_tree: dict, config) -> None:
        stored_config = self.manager.restore(step, args=ocp.args.Composite(
            config=ocp.args.JsonRestore()))["config"]
        differences = config_differences(stored_config, config_json(config))
        metadata = self.manager.item_metadata(step)["state"]
        stored_params = metadata.tree["params"] if metadata is not None else None
        if stored_params is not None:
            mismatched = model_differences(stored_params, target_tree["params"])
            if mismatched:
                raise CheckpointError(
                    f"The checkpoint {self.step_dir(step)} belongs to another model:\n"
                    f"{_first_lines(mismatched)}\n"
                    f"Config fields that differ:\n{_describe_differences(differences)}\n"
                    "Resume with the config it was written with, use another --workdir, or "
                    "start over there with --config.train.start_over=True.")
        refused = {k: v for k, v in differences.items() if not is_resumable_field(k)}
        if refused:
            raise CheckpointError(
                f"The config differs from the one {self.step_dir(step)} was written with, in "
                f"fields a resumed run may not change:\n{_describe_differences(refused)}\n"
                "Restore those values to resume, or start over with "
                "--config.train.start_over=True (or use another --workdir). Fields that may "
                f"change: {', '.join(RESUMABLE_FIELDS)}.")

    def restore_latest(self, target: policy_update.TrainState, config):
        """(iteration, state, rng, loop) of the latest complete, readable checkpoint, each array
        read straight into the sharding of `target` (policy_update.abstract_state: any mesh), or None
        if the run has no checkpoint. An unreadable latest step (truncated, corrupted) falls
        back to the one before with a warning; none readable is an error."""
        steps = self.steps()
        if not steps:
            return None
        target_tree = _state_tree(target, jax.ShapeDtypeStruct(
            (2,), np.uint32, sharding=target.step.sharding))
        failures = []
        for step in reversed(steps):
            try:
                self._check_compatible(step, target_tree, config)
                restored = self.manager.restore(step, args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(target_tree), loop=ocp.args.JsonRestore()))
            except CheckpointError:
                raise   # readable, but another model or config: falling back would not help
            except Exception as e:  # noqa: BLE001  (any unreadable file: try an older step)
                failures.append(f"iteration {step}: {type(e).__name__}: {str(e)[:300]}")
                logger.warning("The checkpoint %s cannot be read (%s: %s); falling back to the "
                               "one before.", self.step_dir(step), type(e).__name__,
                               str(e)[:300])
                continue
            tree = restored["state"]
            state = target.replace(
                params=_replace(target.params, tree["params"]), opt_state=tree["opt_state"],
                step=tree["step"],
                ref_params=(_replace(target.ref_params, tree["ref_params"])
                            if target.ref_params is not None else None))
            return step, state, jax.random.wrap_key_data(tree["rng"]), restored["loop"]
        raise CheckpointError(
            f"No checkpoint in {self.directory} can be read:\n  " + "\n  ".join(failures) +
            "\nStart over with --config.train.start_over=True, or use another --workdir.")


def _replace(abstract: nnx.State, pure: dict) -> nnx.State:
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _is_step(folder) -> bool:
    """A complete step: Orbax's metadata, and finalized (renamed; on object stores, which
    Orbax writes in place, its commit marker)."""
    return (folder / _STEP_MARKER).exists() and ocp.utils.is_checkpoint_finalized(folder)


def find_step(path: str) -> str | None:
    """The step folder of an Orbax checkpoint given as a training workdir, its checkpoints/
    folder (the latest step) or one step's folder (local or gs://); None if `path` is none of
    these."""
    folder = storage.path(path)
    if not folder.is_dir():
        return None
    if _is_step(folder):
        return path
    if (folder / CHECKPOINTS).is_dir():
        path, folder = os.path.join(path, CHECKPOINTS), folder / CHECKPOINTS
    steps = [int(child.name) for child in folder.iterdir() if child.name.isdigit()
             and _is_step(child)]
    return os.path.join(path, str(max(steps))) if steps else None


def restore_params(step_dir: str, abstract_state: nnx.State, shardings: nnx.State):
    """The policy's parameters of a checkpoint step, each read straight into its sharding
    (nothing else is read). `abstract_state` gives the structure, shapes and dtypes (the
    transformer the run started from)."""
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract_state), nnx.to_pure_dict(shardings))
    restore_args = jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding), target)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            os.path.join(step_dir, "state"),
            args=ocp.args.PyTreeRestore(item={"params": target},
                                        restore_args={"params": restore_args},
                                        partial_restore=True))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ValueError(f"The checkpoint {step_dir} does not hold this transformer's parameters "
                         f"({e}). Evaluate it with the config (model.checkpoint) it was trained "
                         "from.") from None
    return _replace(abstract_state, restored["params"])


def read_step_config(step_dir: str) -> dict:
    """The config (JSON, as `config_json` wrote it) a checkpoint step was saved with."""
    return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
        os.path.join(step_dir, "config"))


def check_params(step_dir: str, abstract_params, config) -> None:
    """Raises CheckpointError if a step's parameters do not fit `abstract_params` (a pure dict
    of ShapeDtypeStructs, the model `config` builds), naming the parameters that differ and
    the `model.*` config fields that differ from the run's."""
    metadata = ocp.PyTreeCheckpointer().metadata(os.path.join(step_dir, "state"))
    stored = metadata.item_metadata.tree.get("params")
    mismatched = model_differences(stored or {}, abstract_params)
    fields = {k: v for k, v in config_differences(read_step_config(step_dir),
                                                  config_json(config)).items()
              if k.startswith("model.")}
    if mismatched:
        raise CheckpointError(
            f"The checkpoint {step_dir} belongs to another model:\n{_first_lines(mismatched)}\n"
            "Model config fields "
            f"that differ from the run's:\n{_describe_differences(fields) or '  (none)'}\nUse the "
            "config the run was trained with (saved in the step's config/ folder).")


def read_arrays(step_dir: str) -> dict[str, np.ndarray]:
    """A checkpoint step's `state` item on the host, flat {path: numpy array} (e.g.
    "['params']['final_layer']['linear']['kernel']"): for inspecting and comparing runs."""
    path = os.path.join(step_dir, "state")
    checkpointer = ocp.PyTreeCheckpointer()
    metadata = checkpointer.metadata(path).item_metadata.tree
    restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata)
    tree = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}
