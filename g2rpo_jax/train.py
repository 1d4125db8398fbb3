"""RL fine-tuning of a generator (mode "train"): rollout → rewards → advantages → clipped GRPO
update, with held-out evaluation, logs, image grids, a reward-curve plot and Orbax checkpoints
from which a killed or preempted run resumes exactly. One loop for every task (`config.task`,
g2rpo_jax.tasks): the embedded shapes world, or the real FLUX.1 stack with preprocessed prompt
embeddings and reward models.

  python -m g2rpo_jax.main --config=configs/shapes_cpu.py[:algorithm] --workdir=DIR
  python -m g2rpo_jax.main --config=configs/flux_tiny.py --config.mode=train --workdir=DIR ...

The same command with the same DIR continues the run from its latest complete checkpoint
(g2rpo_jax.run.checkpoint); `--config.train.start_over=True` starts again instead. SIGTERM saves
at the next iteration boundary and exits 0. A step with a non-finite loss or gradient is not
applied (counted as train/skipped_steps); train.max_consecutive_skips in a row stop the run.

Outputs in DIR:
  metrics.jsonl, tensorboard/     per-iteration training scalars (train/*; time/*: seconds per
                                  phase, metrics_lib.PhaseTimer) and periodic eval/* scores
  images/base.png, images/final.png   held-out samples (same prompts, same noise) before/after
  reward_curves.png               training reward, held-out scores, policy-ratio statistics
  checkpoints/<iteration>/        the run's state (train.checkpoint_every, ..._seconds, the end)
  generator.safetensors           shapes task: the fine-tuned generator (loadable as a base)
  summary.json                    {"base": {...}, "final": {...}, "iterations": n, "seconds": s,
                                   "timing": {...} (where the time went: `_timing`)}
"""

import concurrent.futures
import contextlib
import os
import threading
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from g2rpo_jax import parallel, tasks
from g2rpo_jax.core import storage
from g2rpo_jax.models import lora
from g2rpo_jax.rl import advantages as advantages_lib
from g2rpo_jax.rl import iteration as iteration_lib
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.rl import policy_update
from g2rpo_jax.rl.algorithms import Algorithm
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import metrics as metrics_lib
from g2rpo_jax.run import preemption, wandb_logger
from g2rpo_jax.tasks import held_out

# Compile the loop's programs ahead (`_CompileAhead`) on a CPU backend too. Off: there the base
# evaluation already runs on the same cores, and on the 2-core development machine compiling
# beside it saved no wall time and cost 4-15 s more CPU time (docs/results.md, "Where the time
# goes"). With an accelerator the host's cores are free while it evaluates.
COMPILE_AHEAD_ON_CPU = False


def _fresh_loop_state() -> dict:
    """What the loop carries between iterations besides the train state (the checkpoint's
    `loop` item)."""
    return {"iteration": 0, "data": None, "base": None, "latest": {}, "final": None,
            "metrics_rows": 0, "elapsed_seconds": 0.0, "iteration_seconds": [],
            "session_starts": [], "phase_seconds": [], "compile_seconds": {},
            "other_seconds": {},
            "skipped_steps": 0, "consecutive_skips": 0, "evaluations": [], "warnings": [],
            "counts": [], "categories": []}


def _sum_seconds(*parts: dict) -> dict:
    out = {}
    for part in parts:
        for name, seconds in part.items():
            out[name] = out.get(name, 0.0) + seconds
    return out


def _add_seconds(totals: dict, seconds: dict) -> None:
    totals.update(_sum_seconds(totals, seconds))


def _shardings(tree) -> list:
    return [leaf.sharding for leaf in jax.tree.leaves(tree)]


def _abstract(tree):
    """Shapes, dtypes and shardings of a program's outputs, as arguments to lower another."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding,
                                                       weak_type=a.weak_type), tree)


class _CompileAhead:
    """Compiles the loop's three programs (sample, finish, update) on a background thread for
    the arguments of the session's first iteration, while the loop's thread does the setup and
    the base evaluation; otherwise the first iteration compiles them one after the other on the
    critical path.

    `jitted.lower(...).compile()` fills the cache the jitted call itself looks up (the same
    lowering gives the same executable), so the loop calls its usual functions and finds them
    compiled: the results are those of compiling in the loop. finish and update are lowered
    from the previous program's output shapes and shardings, before any rollout has run. The
    thread only traces and compiles (nothing runs on a device, so nothing can interleave with
    the loop's collectives). If it fails, the loop compiles as it would have (a warning).
    """

    STAGES = ("sample", "finish", "update")

    def __init__(self, sample_fn, finish_fn, update_fn, state, cond, key, iteration: int,
                 mesh, num_rewards: int):
        self._futures = {name: concurrent.futures.Future() for name in self.STAGES}
        self._thread = threading.Thread(
            target=self._run, name="compile-ahead", daemon=True,
            args=(sample_fn, finish_fn, update_fn, state, cond, key, iteration, mesh,
                  num_rewards))
        self._thread.start()

    def _run(self, sample_fn, finish_fn, update_fn, state, cond, key, iteration, mesh,
             num_rewards):
        try:
            with jax.set_mesh(mesh):
                sample = sample_fn.lower(state.policy_params(), cond, key, iteration).compile()
                self._futures["sample"].set_result(None)
                finals, transitions = sample.out_info
                scores = jax.ShapeDtypeStruct(   # task.rewards, placed by parallel.replicated
                    (num_rewards, *finals.shape[:2]), jnp.float32,
                    sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
                finish = finish_fn.lower(scores, _abstract(transitions)).compile()
                self._futures["finish"].set_result(None)
                batch = _abstract(finish.out_info[0])
                update = policy_update.jit_update(update_fn, state, batch, cond)
                update.lower(state, batch, cond).compile()
                self._futures["update"].set_result((update, _shardings(batch)))
        except Exception as e:  # noqa: BLE001 -- the loop compiles instead
            logging.warning("Compiling the loop's programs ahead failed (%s: %s); the first "
                            "iteration compiles them.", type(e).__name__, e)
        finally:
            for future in self._futures.values():
                if not future.done():
                    future.set_result(None)

    def wait(self, stage: str) -> None:
        """Blocks until `stage` ("sample" or "finish") is compiled (or compiling failed)."""
        self._futures[stage].result()

    def update_for(self, train_batch):
        """The update's jitted function, compiled for batches laid out like `train_batch`; None
        if compiling ahead failed or the real batch is laid out otherwise (its shardings are
        the update's in_shardings, so a batch placed differently would be refused)."""
        compiled = self._futures["update"].result()
        if compiled is None:
            return None
        update, shardings = compiled
        if _shardings(train_batch) != shardings:
            logging.warning("The rollout's batch is not laid out as compiled ahead; the update "
                            "compiles again.")
            return None
        return update

    def close(self) -> None:
        self._thread.join()


def _split_policy(policy):
    """(graphdef, trained state, frozen state): with LoRA adapters (model.lora.rank > 0) the
    adapters are trained and the rest is frozen; without, everything is trained (frozen None)."""
    graphdef = nnx.graphdef(policy)
    if lora.targets_in(policy):
        adapters, frozen = nnx.state(policy, nnx.LoRAParam, ...)
        return graphdef, adapters, frozen
    return graphdef, nnx.state(policy), None


def _count_skips(loop: dict, skipped) -> None:
    """Adds this iteration's skipped optimizer steps [U] (in order) to the counters."""
    for flag in np.asarray(skipped).reshape(-1):
        loop["skipped_steps"] += int(flag)
        loop["consecutive_skips"] = loop["consecutive_skips"] + 1 if flag else 0


def _log_distributions(logger, step: int, reward_names, scores, train_batch, metrics) -> None:
    """TensorBoard histograms of one iteration: each training reward over the samples, the
    trained transitions' advantages, the update's per-sample log-ratios log π/π_old and the
    gradient norm of each optimizer step. Every process calls it (gathers)."""
    advantages = parallel.to_host(train_batch.advantages)
    log_ratio = parallel.to_host(metrics["log_ratio"])
    grad_norms = parallel.to_host(metrics["grad_norm"])
    for name, values in zip(reward_names, np.asarray(scores)):
        logger.histogram(step, f"train/rewards/{name}", values)
    logger.histogram(step, "train/advantages", advantages)
    logger.histogram(step, "train/log_ratio", log_ratio)
    logger.histogram(step, "train/grad_norm_per_step", grad_norms)


def _log_samples(logger, step: int, task, finals, scores, batch, algo, mesh, rules,
                 prompts: int) -> None:
    """TensorBoard image of the first `prompts` of process 0's training prompts: one group each
    (the first branch step and granularity; a trajectory rollout's G samples), captioned with
    the weighted reward and the sample's advantage within that group."""
    rows = parallel.host_row_indices(mesh, scores.shape[1], rules)[:prompts]
    local = parallel.local_rows(finals, mesh, rules=rules)[:len(rows), :algo.group_size]
    if jax.process_index() != 0 or not len(rows):
        return
    group = np.asarray(scores)[:, rows, :algo.group_size]                  # [R, p, G]
    weights = np.asarray(task.reward_weights, np.float32)[:, None, None]
    reward = np.sum(weights * group, axis=0)
    advantage = np.sum(weights * np.asarray(advantages_lib.group_advantages(
        jnp.asarray(group), clip=algo.advantage_clip)), axis=0)
    images = task.decode(local)                                             # [p, G, H, W, 3]
    captions = [f"r {r:.3f} A {a:+.2f}" for r, a in zip(reward.ravel(), advantage.ravel())]
    grid = held_out.grid_image(images.reshape(-1, *images.shape[2:]), captions,
                               columns=algo.group_size, scale=max(1, 128 // images.shape[2]),
                               title=f"iteration {step}: one group per prompt (r: reward, "
                                     "A: advantage in the group)")
    logger.image(step, "train/samples", np.asarray(grid))
    logger.text(step, "train/samples_prompts", "\n".join(
        f"{i + 1}. {batch.prompts[i]}" for i in range(len(rows))))


def train(config, workdir: str, mesh, rules) -> dict:
    """RL fine-tuning on the task `config.task` (g2rpo_jax.tasks: "shapes" or "flux"); resumes
    the run in `workdir` if it has a checkpoint (docs/configs.md, "Checkpoints and resuming")."""
    settings = config.train
    wandb_logger.validate(config.get("logging"))   # before any compute
    checkpoint_lib.ensure_writable(workdir)
    if settings.start_over:
        checkpoint_lib.start_over(workdir)
    with contextlib.ExitStack() as cleanup:   # closed last to first, also on an error
        run = checkpoint_lib.RunCheckpoints(workdir, settings.checkpoints_to_keep,
                                            settings.async_checkpointing)
        # Closing waits for a save in flight: no checkpoint is left half-written.
        cleanup.callback(run.close)
        return _train(config, workdir, mesh, rules, run, cleanup)


class _Stages:
    """One iteration's four stages (docs/architecture.md, "One iteration"), each timed as its
    phase: the prompts' batch, sample (the jitted rollout), reward (host side, outside the
    global mesh: a task may decode and score on each process's own devices), advantages (the
    jitted finish) and update (the jitted, donated policy update).

    The waits at the ends of the rollout and the advantages are where the host needs the
    result next anyway (the reward decodes the finals; the update's dispatch is all that waits
    on the advantages), so they cost the loop nothing but attribute device time to the phase
    that ran it.
    """

    def __init__(self, task, sample_fn, finish_fn, update_fn, timer, mesh):
        self.task, self.timer, self.mesh = task, timer, mesh
        self._sample_fn, self._finish_fn, self._update_fn = sample_fn, finish_fn, update_fn
        self._first_batch = None   # fetched early when compiling ahead
        self._ahead = None
        self._compiled_update = None

    def compile_ahead(self, state, key, iteration: int, num_rewards: int, cleanup) -> None:
        """Fetches the first iteration's batch now and compiles its programs on a background
        thread (`_CompileAhead`) while the loop's thread evaluates the base."""
        with self.timer.phase("data"):
            self._first_batch = self.task.next_batch()
        self._ahead = _CompileAhead(self._sample_fn, self._finish_fn, self._update_fn, state,
                                    self._first_batch.cond, jax.random.fold_in(key, iteration),
                                    iteration, self.mesh, num_rewards)
        cleanup.callback(self._ahead.close)

    def data(self):
        with self.timer.phase("data"):
            batch, self._first_batch = self._first_batch or self.task.next_batch(), None
            return batch

    def sample(self, state, cond, key, iteration: int):
        """→ (finals, transitions), on the device."""
        with self.timer.phase("rollout"), jax.set_mesh(self.mesh):
            if self._ahead:
                self._ahead.wait("sample")
            finals, transitions = self._sample_fn(state.policy_params(), cond,
                                                  jax.random.fold_in(key, iteration), iteration)
            jax.block_until_ready(finals)
            return finals, transitions

    def reward(self, finals, batch):
        """→ scores [R, P, M] (every process holds all of them)."""
        with self.timer.phase("reward"):
            return self.task.rewards(finals, batch)

    def advantages(self, scores, transitions):
        """→ (TrainBatch with advantages [K, P, G], stats)."""
        with self.timer.phase("advantages"), jax.set_mesh(self.mesh):
            if self._ahead:
                self._ahead.wait("finish")
            train_batch, stats = self._finish_fn(parallel.replicated(scores, self.mesh),
                                                 transitions)
            jax.block_until_ready(train_batch)
            return train_batch, stats

    def update(self, state, train_batch, cond):
        """→ (new state, metrics, their host summary); the old state is donated."""
        with self.timer.phase("update"), jax.set_mesh(self.mesh):
            if self._compiled_update is None:
                self._compiled_update = (self._ahead and self._ahead.update_for(train_batch)) \
                    or policy_update.jit_update(self._update_fn, state, train_batch, cond)
                self._ahead = None
            state, metrics = self._compiled_update(state, train_batch, cond)
            return state, metrics, policy_update.summarize(metrics)   # waits for the update


class _Session:
    """One session of a run and its side effects: the task and its programs, the train state
    (restored from the latest checkpoint or fresh), the loop's bookkeeping (`loop`, saved in
    every checkpoint), the logger, the held-out evaluations, checkpoints, the SIGTERM watcher,
    the phase timer and the progress bar. `_train` drives it one iteration at a time."""

    def __init__(self, config, workdir: str, mesh, rules, run, cleanup: contextlib.ExitStack):
        self.config, self.workdir, self.mesh, self.rules = config, workdir, mesh, rules
        self.run, self.settings = run, config.train
        self.num_iterations = self.settings.num_iterations
        self.timer = metrics_lib.PhaseTimer()
        cleanup.callback(self.timer.close)
        self.task = tasks.build(config, mesh, rules)
        self.algo = Algorithm.from_config(config.algorithm)
        self.reward_names = list(self.task.reward_names)
        self._restore_or_init()
        sigmas = held_out.sigmas_from_config(config)
        sample_fn, finish_fn = map(jax.jit, iteration_lib.make_rollout_stages(
            self.graphdef, self.algo, sigmas, self.task.latent_shape, self.task.reward_weights,
            guidance=config.sampling.guidance,
            quantize_timesteps=config.sampling.quantize_timesteps))
        update_fn = policy_update.make_update_fn(self.graphdef, self._optimizer, self.algo,
                                                 self._update_settings, sigmas)
        self.stages = _Stages(self.task, sample_fn, finish_fn, update_fn, self.timer, mesh)
        loop = self.loop
        self.logger = metrics_lib.MetricsLogger(
            workdir, keep_rows=loop["metrics_rows"],
            purge_step=loop["iteration"] + 1 if self.resumed else 0,
            elapsed=loop["elapsed_seconds"], config=config)
        cleanup.callback(self.logger.close)
        if not self.resumed:
            self.logger.text(0, "config", "```\n" + config.to_json_best_effort(indent=2) + "\n```")
        # The held-out score the progress bar shows (the task's first).
        self.progress_score = self.task.score_names[0] if self.task.score_names else None
        self.images_dir = os.path.join(workdir, "images")
        storage.makedirs(self.images_dir)
        evaluator = self.task.evaluator
        self.grid_count = (min(self.settings.images_in_grid, len(evaluator.prompts))
                           if evaluator else 0)
        self._start(cleanup)

    def _restore_or_init(self) -> None:
        """The train state, key and loop bookkeeping: from the latest checkpoint, else fresh."""
        config, settings = self.config, self.settings
        self.graphdef, params, frozen = _split_policy(self.task.policy)
        self._optimizer = optimizer_lib.make_optimizer(config.optimizer)
        keep_reference = self.algo.kl_beta > 0 and frozen is None  # LoRA: the reference is the base
        self._update_settings = policy_update.PolicyUpdate.from_config(config)
        restored = self.run.restore_latest(policy_update.abstract_state(
            params, self._optimizer, keep_reference, self.mesh, self._update_settings), config)
        self.resumed = restored is not None
        if restored is None:
            self.state = policy_update.init_state(params, self._optimizer, keep_reference,
                                                  self.mesh, self._update_settings,
                                                  frozen=frozen)
            self.key = parallel.replicated(jax.random.key(config.seed), self.mesh)
            self.loop = _fresh_loop_state()
            return
        start_iteration, state, self.key, loop = restored
        del params   # the restored parameters replace the starting point's
        self.state = state.replace(frozen=frozen)   # LoRA: the base is not in the checkpoint
        if start_iteration > settings.num_iterations:
            raise ValueError(
                f"The run in {self.workdir} is at iteration {start_iteration}, past "
                f"train.num_iterations={settings.num_iterations}: raise num_iterations to "
                "extend it, or evaluate its checkpoint (python -m g2rpo_jax.evaluate).")
        self.task.restore_data_state(loop["data"])
        # A checkpoint written before the loop timed its phases: those iterations have none.
        loop.setdefault("phase_seconds", [{} for _ in loop["iteration_seconds"]])
        for name, empty in (("compile_seconds", {}), ("other_seconds", {}), ("evaluations", []),
                            ("warnings", []), ("counts", []), ("categories", [])):
            loop.setdefault(name, empty)
        self.loop = loop
        logging.info("Resuming %s from iteration %d (%s).", self.workdir, start_iteration,
                     self.run.step_dir(start_iteration))

    def _start(self, cleanup) -> None:
        """Before the first iteration: compile ahead (on an accelerator), the base evaluation,
        this session's setup seconds, the SIGTERM watcher and the progress bar."""
        loop, mesh = self.loop, self.mesh
        if loop["iteration"] < self.num_iterations:
            loop["final"] = None   # an extended run evaluates again at its new end
            # This process's first iteration compiles: kept out of the per-iteration median.
            loop["session_starts"].append(len(loop["iteration_seconds"]))
            if COMPILE_AHEAD_ON_CPU or mesh.devices.flat[0].platform != "cpu":
                self.stages.compile_ahead(self.state, self.key, loop["iteration"],
                                          len(self.reward_names), cleanup)
        if loop["base"] is None:
            with self.timer.phase("evaluation"):
                loop["base"] = loop["latest"] = self.evaluate(0, "base")
            logging.info("Base held-out scores: %s", loop["base"])
        # Building the task, restoring and the base evaluation: this session's setup.
        setup = self.timer.lap()
        _add_seconds(loop["other_seconds"], {
            "setup": setup["time/iteration_s"], "setup_compile": setup["time/compile_s"],
            "setup_compile_background": setup["time/compile_background_s"],
            "base_evaluation": setup["time/evaluation_s"]})
        self._compiled_before = dict(loop["compile_seconds"])   # earlier sessions' seconds
        self._last_save = time.monotonic()
        self.watcher = preemption.Watcher()
        cleanup.callback(self.watcher.close)
        self.bar = tqdm.tqdm(range(loop["iteration"], self.num_iterations),
                             initial=loop["iteration"], total=self.num_iterations,
                             desc=f"train {self.config.algorithm.name}", dynamic_ncols=True,
                             disable=jax.process_index() != 0)

    def evaluate(self, iteration: int, name: str | None = None) -> dict:
        """Held-out scores of the current policy, logged with their grid (and, named, written
        to images/<name>.png); checks them for reward hacking."""
        evaluator, loop, logger = self.task.evaluator, self.loop, self.logger
        if evaluator is None:  # no held-out prompts configured
            return {}
        evaluation = evaluator.evaluate(self.state.policy_params())
        scores = evaluation.means()
        if jax.process_index() == 0:
            # The same prompts and noise at every evaluation, so grids compare across
            # iterations and runs.
            title = f"iteration {iteration}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in scores.items())
            grid = held_out.grid_image(evaluation.first_images[:self.grid_count, 0],
                                       evaluator.prompts[:self.grid_count], title=title)
            logger.image(iteration, "eval/samples", np.asarray(grid))
            logger.text(iteration, "eval/scores", title)
            if name:
                with storage.open_atomic(os.path.join(self.images_dir, f"{name}.png")) as f:
                    grid.save(f, format="PNG")
        counts = evaluation.totals()
        categories = evaluation.by_category()
        logger.write(iteration, {**{f"eval/{k}": v for k, v in {**scores, **counts}.items()},
                                 **{f"eval/{name}/{c}": v for c, by_score in categories.items()
                                    if by_score for name, v in by_score.items()}})
        loop["evaluations"].append([iteration, scores])
        if counts:
            loop["counts"].append([iteration, counts])
        if categories:
            loop["categories"].append([iteration, categories])
        for line in metrics_lib.hacking_warnings(
                loop["evaluations"], self.task.in_domain,
                [k for k in self.task.score_names if k not in self.task.in_domain],
                self.settings.hacking_margin, self.settings.hacking_window):
            logging.warning(line)
            loop["warnings"].append(line)
        return scores

    def save(self, iteration: int, wait: bool = False):
        self.loop.update(iteration=iteration, data=self.task.data_state(),
                         metrics_rows=self.logger.rows, elapsed_seconds=self.logger.elapsed)
        return self.run.save(iteration, self.state, self.key, self.loop, self.config, wait=wait)

    def record(self, it: int, tick: float, batch, finals, scores, train_batch, stats, metrics,
               summary) -> None:
        """After iteration `it`'s update: the skip counters (and the stop after too many in a
        row), histograms and sample grids, the periodic evaluation, and the iteration's row
        (its scalars and the seconds of every phase since the previous row's)."""
        loop, settings, logger = self.loop, self.settings, self.logger
        _count_skips(loop, metrics["skipped"])
        _log_distributions(logger, it + 1, self.reward_names, scores, train_batch, metrics)
        if settings.samples_every and (it + 1) % settings.samples_every == 0:
            _log_samples(logger, it + 1, self.task, finals, scores, batch, self.algo, self.mesh,
                         parallel.rules_from_config(self.rules), settings.sample_prompts)
        reward_mean = np.asarray(stats["reward_mean"])
        row = {f"train/reward_{n}": float(v) for n, v in zip(self.reward_names, reward_mean)}
        row["train/reward_std"] = float(np.mean(stats["reward_std"]))
        row.update({f"train/{k}": v for k, v in summary.items()})
        row["train/skipped_steps"] = loop["skipped_steps"]   # over the run, not this update
        loop["iteration_seconds"].append(time.perf_counter() - tick)
        row["train/seconds"] = loop["iteration_seconds"][-1]
        if loop["consecutive_skips"] >= settings.max_consecutive_skips:
            logger.write(it + 1, row)
            steps = self.run.steps()
            raise FloatingPointError(
                f"{loop['consecutive_skips']} optimizer steps in a row had a non-finite "
                f"loss or gradient (loss {summary['loss']}, gradient norm "
                f"{summary['grad_norm']}) up to iteration {it + 1} ({self.algo}); none was "
                "applied. The last good checkpoint is "
                f"{self.run.step_dir(steps[-1]) if steps else 'none (no iteration was saved)'}"
                ". Check the rewards for NaN, or lower optimizer.learning_rate or "
                "algorithm.advantage_clip (train.max_consecutive_skips sets the limit).")
        if settings.eval_every and (it + 1) % settings.eval_every == 0 \
                and it + 1 < self.num_iterations:
            with self.timer.phase("evaluation"):
                loop["latest"] = self.evaluate(it + 1)
        times = self.timer.lap()
        loop["phase_seconds"].append(times)
        loop["compile_seconds"] = _sum_seconds(self._compiled_before,
                                               self.timer.compile_by_phase())
        row.update(times)
        logger.write(it + 1, row)
        self.bar.set_postfix({
            "reward": f"{reward_mean[0]:.3f}",
            "ratio": f"[{summary['ratio_min']:.3f},{summary['ratio_max']:.3f}]",
            "clip": f"{summary['clip_fraction']:.2f}", "skipped": loop["skipped_steps"],
            "held_out": f"{loop['latest'].get(self.progress_score, float('nan')):.3f}"})

    def preempted(self, iteration: int) -> dict | None:
        """After a SIGTERM (agreed across processes): saves `iteration`, waiting for the save,
        and returns what `train` returns; else None."""
        if not self.watcher.reached(iteration):
            return None
        path = self.save(iteration, wait=True)
        self.bar.close()
        logging.warning("SIGTERM (preemption): saved iteration %d to %s; run the same "
                        "command to resume.", iteration, path)
        return {"preempted": True, "iteration": iteration, "checkpoint": path}

    def checkpoint_if_due(self, iteration: int) -> None:
        """Saves every train.checkpoint_every iterations and train.checkpoint_every_seconds
        (both optional)."""
        settings = self.settings
        periodic = settings.checkpoint_every and iteration % settings.checkpoint_every == 0
        timed = settings.checkpoint_every_seconds and preemption.agree(
            time.monotonic() - self._last_save >= settings.checkpoint_every_seconds)
        if periodic or timed:
            with self.timer.phase("checkpoint"):
                self.save(iteration)
            self._last_save = time.monotonic()

    def finish(self) -> dict:
        """The final evaluation and save, then summary.json, the task's output file and the
        plot (`_finish`)."""
        loop, timer = self.loop, self.timer
        self.bar.close()
        self.watcher.close()   # a SIGTERM from here on ends the process as usual
        timer.lap()
        if loop["final"] is None:
            with timer.phase("evaluation"):
                loop["final"] = self.evaluate(self.num_iterations, "final")
        if self.num_iterations not in self.run.steps():
            with timer.phase("checkpoint"):
                self.save(self.num_iterations, wait=True)
        # After the last save: the summary has these, the checkpoint does not.
        final = timer.lap()
        _add_seconds(loop["other_seconds"], {
            "final_evaluation": final["time/evaluation_s"],
            "final_checkpoint": final["time/checkpoint_s"],
            "final_compile": final["time/compile_s"],
            "final_compile_background": final["time/compile_background_s"]})
        loop["compile_seconds"] = _sum_seconds(self._compiled_before, timer.compile_by_phase())
        return _finish(self.config, self.workdir, self.run, self.task, self.graphdef,
                       self.state, loop, self.reward_names)


def _train(config, workdir: str, mesh, rules, run, cleanup: contextlib.ExitStack) -> dict:
    """The loop: each iteration's four stages, then its record, the preemption check and the
    periodic checkpoint; the session (`_Session`) owns everything around them."""
    session = _Session(config, workdir, mesh, rules, run, cleanup)
    stages = session.stages
    # Each row's time/* columns cover the wall time since the previous row's (the loop's start
    # for the first): the iteration's phases, and the previous iteration's checkpoint save.
    for it in session.bar:
        tick = time.perf_counter()
        batch = stages.data()
        finals, transitions = stages.sample(session.state, batch.cond, session.key, it)
        scores = stages.reward(finals, batch)
        train_batch, stats = stages.advantages(scores, transitions)
        session.state, metrics, summary = stages.update(session.state, train_batch, batch.cond)
        session.record(it, tick, batch, finals, scores, train_batch, stats, metrics, summary)
        if it + 1 == session.num_iterations:
            break   # the final evaluation and save follow
        preempted = session.preempted(it + 1)
        if preempted:
            return preempted
        session.checkpoint_if_due(it + 1)
    return session.finish()


def _finish(config, workdir, run, task, graphdef, state, loop, reward_names) -> dict:
    """summary.json, the task's own output file and the reward-curve plot (process 0)."""
    iterations = config.train.num_iterations
    seconds = loop["iteration_seconds"]
    steady = [t for i, t in enumerate(seconds) if i not in loop["session_starts"]]
    report = {"base": loop["base"], "final": loop["final"], "iterations": iterations,
              "seconds": loop["elapsed_seconds"],
              "seconds_per_iteration": float(np.median(steady or seconds or [0.0])),
              "first_iteration_seconds": seconds[0] if seconds else 0.0,
              "skipped_steps": loop["skipped_steps"],
              "algorithm": config.algorithm.name, "seed": config.seed,
              "checkpoint": run.step_dir(iterations),
              "warnings": list(loop["warnings"]),
              "timing": _timing(loop)}
    if loop["counts"]:   # the embedded world's object counts, base and final evaluation
        report["object_counts"] = {"base": loop["counts"][0][1], "final": loop["counts"][-1][1]}
    if loop["categories"]:   # per-category held-out scores, base and final evaluation
        report["categories"] = {"base": loop["categories"][0][1],
                                "final": loop["categories"][-1][1]}
    if jax.process_index() == 0:
        policy = nnx.merge(graphdef, state.policy_params())
        if state.frozen is not None:   # LoRA: the adapters alone, then folded into the base
            lora.save_peft(os.path.join(workdir, "lora.safetensors"), policy)
            policy = lora.merge(policy)
        task.save(workdir, policy,
                  {k: report[k] for k in ("base", "final", "iterations", "algorithm", "seed")})
        rows = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
        rows, changes = metrics_lib.changes_since_base(
            rows, task.in_domain, [k for k in task.score_names if k not in task.in_domain])
        panels = {"training reward": [f"train/reward_{n}" for n in reward_names],
                  "held-out scores": [f"eval/{k}" for k in task.score_names],
                  "held-out change since base: trained vs not": changes,
                  "held-out object counts": [f"eval/{k}" for k in
                                             report.get("object_counts", {}).get("base", {})],
                  "policy ratio": ["train/ratio_min", "train/ratio_max", "train/clip_fraction"]}
        metrics_lib.plot_curves(rows, {k: v for k, v in panels.items() if v},
                                os.path.join(workdir, "reward_curves.png"),
                                title=f"{config.algorithm.name}, seed {config.seed}")
        storage.write_json(os.path.join(workdir, "summary.json"), report)
        markdown = summary_markdown(report, workdir, _outputs(workdir, state, config))
        storage.write_text(os.path.join(workdir, "summary.md"), markdown)
        print_summary(report)
        print(markdown.split("## Outputs", 1)[1].strip(), flush=True)
    return report


def _outputs(workdir: str, state, config) -> list[tuple[str, str]]:
    """(path relative to the workdir, what it is) of the run's outputs."""
    out = [(f"checkpoints/{config.train.num_iterations}/", "the final Orbax checkpoint "
            "(resume, `python -m g2rpo_jax.evaluate`, `python -m g2rpo_jax.export`)")]
    if config.task == "shapes":
        out.append(("generator.safetensors", "the fine-tuned generator"))
    if state.frozen is not None:
        out.append(("lora.safetensors", "the LoRA adapters (PEFT / diffusers layout)"))
    out += [("metrics.jsonl", "every logged scalar, one row per step"),
            ("tensorboard/", "scalars, sample grids, histograms, the config"),
            ("reward_curves.png", "training reward, held-out scores and their change since "
             "base (trained vs not), policy ratio"),
            ("images/base.png, images/final.png", "held-out samples before and after"),
            ("summary.json", "this summary as JSON")]
    return out


def summary_markdown(report: dict, workdir: str, outputs) -> str:
    """summary.md: held-out scores base → final, seconds per phase, the outputs and the
    command that opens TensorBoard."""
    lines = [f"# {report['algorithm']}, seed {report['seed']}: {report['iterations']} "
             f"iterations in {report['seconds']:.0f} s", "",
             *_change_table("held-out score", report["base"], report["final"], ".4f")]
    if report.get("categories"):
        lines += ["", *held_out.category_table(
            [("base", report["base"], report["categories"]["base"]),
             ("final", report["final"], report["categories"]["final"])])]
    counts = report.get("object_counts")
    if counts:
        lines += ["", *_change_table("held-out objects (all images)", counts["base"],
                                     counts["final"], "d")]
    timing = report.get("timing") or {}
    if timing:
        lines += ["", f"{report['seconds_per_iteration']:.2f} s per iteration after the first "
                  f"({report['first_iteration_seconds']:.1f} s, compiling); "
                  f"{report['skipped_steps']} optimizer steps skipped.", "",
                  "| phase | seconds | first iteration | median later |", "|---|---:|---:|---:|"]
        for name in (*metrics_lib.PHASES, "compile"):
            phase = timing["phases"].get(name, {})
            lines.append(f"| {name} | {phase.get('total_s', 0.0):.1f} | "
                         f"{phase.get('first_s', 0.0):.1f} | {phase.get('median_s', 0.0):.2f} |")
        lines.append(f"| setup (base evaluation {timing['base_evaluation_s']:.1f}) | "
                     f"{timing['setup_s']:.1f} | | |")
        lines.append(f"| final evaluation + save | "
                     f"{timing['final_evaluation_s'] + timing['final_checkpoint_s']:.1f} | | |")
    if report.get("warnings"):
        lines += ["", "## Warnings", ""] + [f"- {line}" for line in report["warnings"]]
    lines += ["", "## Outputs", "", f"In `{storage.absolute(workdir)}`:", ""]
    lines += [f"- `{path}`: {what}" for path, what in outputs]
    lines += ["", f"Open TensorBoard: `tensorboard --logdir {storage.absolute(workdir)}/tensorboard`",
              ""]
    return "\n".join(lines)


def _change_table(title: str, base: dict, final: dict, number: str) -> list[str]:
    """Markdown rows: one per name of `base` (as logged: eval/<name>), its base, final and
    change in format `number`."""
    lines = [f"| {title} | base | final | change |", "|---|---:|---:|---:|"]
    for name, before in base.items():
        after = final[name]
        lines.append(f"| {name} | {before:{number}} | {after:{number}} | "
                     f"{after - before:+{number}} |")
    return lines


def _timing(loop: dict) -> dict:
    """summary.json's "timing": where the wall time went, on process 0's clock (each process
    times its own loop; process 0 writes). `phases`: per phase (metrics_lib.PHASES, plus
    `compile`, `compile_background` and the whole `iteration`) the total over the run's
    iterations, the first iteration's, and the median over the later iterations in which it
    ran (the first of each session compiles). `compile_s`: seconds in JAX's tracing, lowering
    and XLA compilation (persistent-cache hits included) on the loop's thread, all of the run;
    `compile_by_phase_s`: the part of it inside each phase, base and final evaluation
    included; `compile_background_s`: compiling on other threads (the programs compiled
    ahead), overlapping the rest. `setup_s`: before the first iteration of each session
    (building the task, restoring, the base evaluation)."""
    other = loop["other_seconds"]
    rows = loop["phase_seconds"]
    phases = metrics_lib.phase_summary(rows, skip=loop["session_starts"])
    return {
        # What the timer covered: setup, every iteration, the final evaluation and save.
        "wall_s": other.get("setup", 0.0) + phases["iteration"]["total_s"]
        + other.get("final_evaluation", 0.0) + other.get("final_checkpoint", 0.0),
        "setup_s": other.get("setup", 0.0),
        "base_evaluation_s": other.get("base_evaluation", 0.0),
        "final_evaluation_s": other.get("final_evaluation", 0.0),
        "final_checkpoint_s": other.get("final_checkpoint", 0.0),
        "compile_s": other.get("setup_compile", 0.0) + other.get("final_compile", 0.0)
        + phases["compile"]["total_s"],
        "compile_background_s": other.get("setup_compile_background", 0.0)
        + other.get("final_compile_background", 0.0) + phases["compile_background"]["total_s"],
        "compile_by_phase_s": dict(loop["compile_seconds"]),
        "phases": phases,
    }


def print_summary(report: dict) -> None:
    lines = [f"{'score':<16}{'base':>10}{'final':>10}{'change':>10}"]
    for name in report["base"]:
        b, f = report["base"][name], report["final"][name]
        lines.append(f"{name:<16}{b:>10.3f}{f:>10.3f}{f - b:>+10.3f}")
    lines.append(f"{report['algorithm']}, seed {report['seed']}: {report['iterations']} "
                 f"iterations in {report['seconds']:.0f} s "
                 f"({report['seconds_per_iteration']:.1f} s per iteration after the first)")
    timing = report.get("timing")
    if timing:
        phases = timing["phases"]
        lines.append("seconds: setup {:.0f} (base evaluation {:.0f}), ".format(
            timing["setup_s"], timing["base_evaluation_s"]) + ", ".join(
            f"{name} {phases[name]['total_s']:.0f}" for name in metrics_lib.PHASES) +
            ", final evaluation + save {:.0f}; compiling {:.0f} in the loop's thread, "
            "{:.0f} ahead".format(timing["final_evaluation_s"] + timing["final_checkpoint_s"],
                                  timing["compile_s"], timing["compile_background_s"]))
    print("\n".join(lines), flush=True)
