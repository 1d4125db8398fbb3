"""Never losing a run: a run killed with SIGKILL (even inside an asynchronous save)
or stopped by SIGTERM resumes to bit-identical parameters, optimizer state and metrics rows;
TensorBoard continues without duplicates; non-finite steps are skipped inside the update;
checkpoints restore onto other meshes; bad workdirs, configs and checkpoints are named."""

import json
import logging
import os
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import resume_helpers as rh

from g2rpo_jax import evaluate, parallel, tasks, train
from g2rpo_jax.models import flux
from g2rpo_jax.rl import algorithms, policy_update
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.sampling import schedules
from g2rpo_jax.tasks import generator
from g2rpo_jax.tasks import shapes as shapes_task
from g2rpo_jax.testing import tiny_rl

ROOT = rh.ROOT


def _load_short_config(data_dir, iterations=3):
    import test_train

    config = test_train.short_rl_config(data_dir, iterations=iterations)
    config.train.eval_every = 2
    config.train.checkpoint_every = 1
    return config


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


@pytest.fixture(scope="module")
def mesh():
    return parallel.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})


def _rules(config):
    return parallel.rules_from_config(config.sharding_rules)


# ---------------------------------------------------------------------------------------------
# Kill and resume in subprocesses (the shapes world; the tiny FLUX path is in test_flux_path)
# ---------------------------------------------------------------------------------------------

SHAPES_ITERATIONS = 5


def shapes_flags(workdir, data_dir, cache_dir) -> list[str]:
    return ["--config=configs/shapes_cpu.py", f"--workdir={workdir}",
            "--config.sampling.num_steps=6", "--config.algorithm.group_size=4",
            "--config.algorithm.branch_steps=(0,1)",
            f"--config.train.num_iterations={SHAPES_ITERATIONS}",
            "--config.train.prompts_per_iteration=8", "--config.train.eval_every=2",
            "--config.train.checkpoint_every=1", "--config.evaluation.num_prompts=8",
            f"--config.data.data_dir={data_dir}", f"--config.compilation_cache_dir={cache_dir}"]


def _tensorboard_scalars(workdir, tag):
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(
        os.path.join(workdir, "tensorboard"), size_guidance={event_accumulator.SCALARS: 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


@pytest.mark.slow
def test_killed_and_preempted_run_resumes_bit_identically(tmp_path, data_dir):
    """Reference: 5 uninterrupted iterations. The other run is (1) killed by SIGKILL inside the
    asynchronous save of iteration 2 (files written, not committed), (2) resumed and stopped
    by SIGTERM, which saves at the next iteration boundary and exits 0, (3) resumed and killed
    by SIGKILL right after its next checkpoint's metrics row, (4) resumed to the end."""
    cache = tmp_path / "jax_cache"
    reference, chain = tmp_path / "reference", tmp_path / "chain"
    done = rh.run_main(shapes_flags(reference, data_dir, cache))
    assert done.returncode == 0, done.stderr[-3000:]

    flags = shapes_flags(chain, data_dir, cache)
    killed = rh.run_main(flags, kill_at_commit=2)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert "SIGKILL during the save of iteration 2" in killed.stderr
    leftovers = os.listdir(chain / "checkpoints")
    assert "1" in leftovers and "2" not in leftovers
    assert any(name.startswith("2.") for name in leftovers)   # the uncommitted save
    assert max(r["step"] for r in rh.metrics_rows(chain)) >= 2  # rows past the checkpoint

    # (2) SIGTERM once iteration 3's row is written: saved at the next boundary, exit 0.
    process = rh.start_main(flags, str(tmp_path / "preempted.log"))
    rh.wait_for(lambda: any(r["step"] == 3 and "train/loss" in r
                            for r in rh.metrics_rows(chain)), process, what="iteration 3")
    assert rh.kill(process, rh.signal.SIGTERM) == 0
    log = (tmp_path / "preempted.log").read_text()
    assert log.count("SIGTERM (preemption): saved iteration") == 1, log[-3000:]
    preempted_at = int(log.split("SIGTERM (preemption): saved iteration ")[1].split()[0])
    assert 3 <= preempted_at < SHAPES_ITERATIONS
    assert str(preempted_at) in os.listdir(chain / "checkpoints")
    assert not (chain / "summary.json").exists()

    # (3) SIGKILL right after the next iteration's row (during its save or the next iteration).
    process = rh.start_main(flags, str(tmp_path / "killed.log"))
    rh.wait_for(lambda: any(r["step"] == preempted_at + 1 and "train/loss" in r
                            for r in rh.metrics_rows(chain)), process,
                what=f"iteration {preempted_at + 1}")
    assert rh.kill(process) == -9

    finished = rh.run_main(flags)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "Resuming" in finished.stderr

    final = f"checkpoints/{SHAPES_ITERATIONS}"
    count = rh.assert_identical_states(rh.read_step(str(reference / final)),
                                       rh.read_step(str(chain / final)))
    assert count > 100   # params, both AdamW moments, counters, the key
    assert rh.computed_rows(chain) == rh.computed_rows(reference)
    train_steps = [r["step"] for r in rh.metrics_rows(chain) if "train/loss" in r]
    assert train_steps == list(range(1, SHAPES_ITERATIONS + 1))
    ref_summary = json.loads((reference / "summary.json").read_text())
    summary = json.loads((chain / "summary.json").read_text())
    assert summary["base"] == ref_summary["base"] and summary["final"] == ref_summary["final"]
    for name in ("generator.safetensors",):
        assert (chain / name).read_bytes() == (reference / name).read_bytes()
    # TensorBoard: each iteration once, the reference's values.
    for tag in ("train/loss", "eval/in_domain"):
        assert _tensorboard_scalars(chain, tag) == _tensorboard_scalars(reference, tag)
    print(f"bit-identical after SIGKILL in a save, SIGTERM at {preempted_at}, SIGKILL after "
          f"{preempted_at + 1}: {count} arrays, {len(rh.computed_rows(chain))} metrics rows")


# ---------------------------------------------------------------------------------------------
# In-process: non-finite steps, other meshes, extending, starting over, bad input
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, data_dir, mesh):
    """3 iterations on data=8, a checkpoint after each."""
    config = _load_short_config(data_dir)
    workdir = tmp_path_factory.mktemp("short_run")
    train.train(config, str(workdir), mesh, _rules(config))
    return config, workdir


def _copy_run(workdir, tmp_path):
    target = tmp_path / "run"
    shutil.copytree(workdir, target)
    return target


def test_run_state_is_in_every_checkpoint(short_run):
    config, workdir = short_run
    assert sorted(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit()) == [1, 2, 3]
    for step in (1, 3):
        loop = rh.loop_item(str(workdir / f"checkpoints/{step}"))
        assert loop["iteration"] == step
        # 8 prompts per iteration: the reader's position is the iteration count.
        assert loop["data"]["position"] == step and loop["data"]["epoch"] == 0
        assert set(loop["base"]) == {"in_domain", "out_of_domain", "quality"}
        rows = rh.metrics_rows(workdir)[:loop["metrics_rows"]]
        assert max(r["step"] for r in rows) == step
        state = rh.read_step(str(workdir / f"checkpoints/{step}"))
        # One optimizer step per iteration (steps_per_update=0): step and AdamW's count.
        assert int(state["['step']"]) == step
        counts = [v for k, v in state.items() if k.startswith("['opt_state']") and
                  k.endswith("['count']")]
        assert counts and all(int(c) == step for c in counts)
        mu = [v for k, v in state.items() if "['mu']" in k]
        assert mu and max(float(np.abs(m).max()) for m in mu) > 0
    stored = json.load(open(workdir / "checkpoints/3/config/metadata"))
    assert stored["train"]["num_iterations"] == 3


def test_non_finite_reward_skips_the_step_inside_the_update(tmp_path, data_dir, mesh,
                                                            monkeypatch):
    """A NaN reward in iteration 2 of 3: its step is not applied (state after it equals the
    state before, bit for bit), it is counted, and training goes on."""
    rewards = shapes_task.ShapesTask.rewards
    calls = []

    def nan_in_second(self, finals, batch):
        calls.append(1)
        scores = np.asarray(rewards(self, finals, batch)).copy()
        if len(calls) == 2:
            scores[0, 0, 0] = np.nan
        return scores

    monkeypatch.setattr(shapes_task.ShapesTask, "rewards", nan_in_second)
    config = _load_short_config(data_dir)
    config.train.eval_every = 0
    report = train.train(config, str(tmp_path), mesh, _rules(config))
    assert report["skipped_steps"] == 1
    rows = [r for r in rh.metrics_rows(tmp_path) if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 1]
    assert not np.isfinite(rows[1]["train/loss"]) and np.isfinite(rows[2]["train/loss"])
    one, two, three = (rh.read_step(str(tmp_path / f"checkpoints/{s}")) for s in (1, 2, 3))
    for name in one:
        if name == "['rng']":
            continue
        assert one[name].tobytes() == two[name].tobytes(), name   # nothing applied
    assert int(three["['step']"]) == 2
    assert any(one[n].tobytes() != three[n].tobytes() for n in one if "params" in n)


def test_consecutive_non_finite_steps_stop_with_the_last_good_checkpoint(tmp_path, data_dir,
                                                                         mesh, monkeypatch):
    rewards = shapes_task.ShapesTask.rewards
    calls = []

    def nan_from_second(self, finals, batch):
        calls.append(1)
        scores = np.asarray(rewards(self, finals, batch)).copy()
        return scores * np.nan if len(calls) >= 2 else scores

    monkeypatch.setattr(shapes_task.ShapesTask, "rewards", nan_from_second)
    config = _load_short_config(data_dir, iterations=5)
    config.train.eval_every = 0
    config.train.max_consecutive_skips = 2
    with pytest.raises(FloatingPointError, match=r"2 optimizer steps in a row .*"
                       r"checkpoints/2.*max_consecutive_skips"):
        train.train(config, str(tmp_path), mesh, _rules(config))
    steps = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert steps == [1, 2]   # complete, nothing after the failing iteration
    rows = [r for r in rh.metrics_rows(tmp_path) if "train/loss" in r]
    assert [r["train/skipped_steps"] for r in rows] == [0, 1, 2]


def test_update_skips_non_finite_steps_and_keeps_the_state():
    """The jitted update itself: with a NaN advantage the returned state equals the input."""
    mesh = parallel.make_mesh((8, 1, 1))
    algo = tiny_rl_algo()
    out = tiny_rl.run_iteration(algo, mesh, tiny_rl_sigmas(), 8)
    state, batch, cond = out["state"], out["batch"], out["cond"]
    before = jax.tree.map(np.asarray, state)
    bad = batch.replace(advantages=batch.advantages.at[0, 0, 0].set(jnp.nan))
    optimizer = optimizer_lib.make_optimizer(tiny_rl.ADAMW)
    update_fn = policy_update.jit_update(policy_update.make_update_fn(
        out["graphdef"], optimizer, algo, policy_update.PolicyUpdate(), tiny_rl_sigmas()),
        state, bad, cond)
    with jax.set_mesh(mesh):
        after, metrics = update_fn(state, bad, cond)
    skipped = np.asarray(metrics["skipped"])
    assert skipped[0] and not skipped[1:].any()   # only the first k's step had the NaN
    assert policy_update.summarize(metrics)["skipped_steps"] == 1
    # The first step was not applied, the others were: the step counter says 2 of 3.
    assert int(after.step) == int(before.step) + len(skipped) - 1
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(after.params))


def tiny_rl_algo():
    return algorithms.Algorithm.from_config(algorithms.preset(
        "g2rpo", group_size=4, branch_steps=(0, 1, 2), granularities=(1, 2),
        granularity_weights=(1.0, 1.0)))


def tiny_rl_sigmas():
    return schedules.flux_sigmas(6, 3.0)


def test_checkpoint_restores_onto_other_meshes(short_run, tmp_path, data_dir):
    """Saved on data=8: continued on (2, 2, 2) and evaluated on one device."""
    config, workdir = short_run
    run = _copy_run(workdir, tmp_path)
    saved = rh.read_step(str(run / "checkpoints/3"))
    config = config.copy_and_resolve_references()
    config.train.num_iterations = 4
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 2, 2, 2
    other = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    # Restored straight into the (2, 2, 2) layout, values bit for bit.
    ckpt = checkpoint_lib.RunCheckpoints(str(run))
    task = tasks.build(config, other, _rules(config), training=False)
    graphdef, params = nnx.split(task.policy)
    optimizer = optimizer_lib.make_optimizer(config.optimizer)
    target = policy_update.abstract_state(params, optimizer, False, other)
    step, state, _, loop = ckpt.restore_latest(target, config)
    ckpt.close()
    assert step == 3 and loop["iteration"] == 3
    restored = {jax.tree_util.keystr(p): v for p, v in
                jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state.params))[0]}
    for name, value in restored.items():
        assert value.sharding.mesh.shape == other.shape
        np.testing.assert_array_equal(np.asarray(value), saved["['params']" + name])
    report = train.train(config, str(run), other, _rules(config))
    assert report["iterations"] == 4
    assert [r["step"] for r in rh.metrics_rows(run) if "train/loss" in r] == [1, 2, 3, 4]
    one_device = parallel.make_mesh({"data": 1, "fsdp": 1, "tensor": 1},
                                    devices=jax.devices()[:1])
    evaluated = evaluate.evaluate(config, str(run), one_device, _rules(config),
                                  output=str(tmp_path / "eval.json"))
    summary = json.loads((run / "summary.json").read_text())
    final = summary["final"]
    assert evaluated["in_domain"]["in_domain"]["mean"] == pytest.approx(final["in_domain"],
                                                                        abs=0.02)
    # The prompts ask for the same objects on any mesh.
    assert (evaluated["object_counts"]["objects_asked"]
            == summary["object_counts"]["final"]["objects_asked"])


def test_extending_a_finished_run(short_run, tmp_path, mesh):
    """train.num_iterations may grow: the finished run goes on from its last iteration; the
    base scores are the original run's."""
    config, workdir = short_run
    run = _copy_run(workdir, tmp_path)
    base = json.loads((run / "summary.json").read_text())["base"]
    rows_before = rh.metrics_rows(run)
    config = config.copy_and_resolve_references()
    config.train.num_iterations = 4
    report = train.train(config, str(run), mesh, _rules(config))
    assert report["base"] == base and report["iterations"] == 4
    rows = rh.metrics_rows(run)
    assert rows[:len(rows_before)] == rows_before
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/in_domain" in r] == [0, 2, 3, 4]


def test_rerun_of_a_finished_run_changes_nothing(short_run, tmp_path, mesh):
    config, workdir = short_run
    run = _copy_run(workdir, tmp_path)
    rows = rh.metrics_rows(run)
    report = train.train(config, str(run), mesh, _rules(config))
    assert rh.metrics_rows(run) == rows
    assert report["final"] == json.loads((workdir / "summary.json").read_text())["final"]


def test_start_over_is_explicit(short_run, tmp_path, mesh, monkeypatch):
    config, workdir = short_run
    run = _copy_run(workdir, tmp_path)
    config = config.copy_and_resolve_references()
    config.train.start_over = True
    config.train.num_iterations = 1
    train.train(config, str(run), mesh, _rules(config))
    assert sorted(n for n in os.listdir(run / "checkpoints") if n.isdigit()) == ["1"]
    assert [r["step"] for r in rh.metrics_rows(run)] == [0, 1, 1]


def test_workdir_of_another_model_names_keys_shapes_and_fields(short_run, tmp_path, mesh):
    config, workdir = short_run
    run = _copy_run(workdir, tmp_path)
    other = config.copy_and_resolve_references()
    other.model.num_layers = 1
    one_layer = generator.build_generator(other, mesh, seed=1)
    path = str(tmp_path / "one_layer.safetensors")
    generator.save_generator(path, one_layer)
    other.model.checkpoint = path
    with pytest.raises(checkpoint_lib.CheckpointError) as error:
        train.train(other, str(run), mesh, _rules(other))
    message = str(error.value)
    assert "belongs to another model" in message
    assert ("params/double_blocks/img_attn/q/kernel: (2, 128, 128) float32 in the checkpoint, "
            "model (1, 128, 128)") in message
    assert "model.checkpoint" in message and "model.num_layers" in message
    assert "start_over=True" in message


def test_changed_config_field_is_named_and_allowed_fields_are_not(short_run, tmp_path):
    config, workdir = short_run
    current = checkpoint_lib.config_json(config)
    stored = json.load(open(workdir / "checkpoints/3/config/metadata"))
    assert checkpoint_lib.config_differences(stored, current) == {}
    changed = config.copy_and_resolve_references()
    changed.optimizer.learning_rate = 1e-3
    changed.train.num_iterations = 10
    changed.mesh.fsdp = 2
    differences = checkpoint_lib.config_differences(stored, checkpoint_lib.config_json(changed))
    assert set(differences) == {"optimizer.learning_rate", "train.num_iterations", "mesh.fsdp"}
    assert [k for k in differences if not checkpoint_lib.is_resumable_field(k)] == [
        "optimizer.learning_rate"]
    run = _copy_run(workdir, tmp_path)
    with pytest.raises(checkpoint_lib.CheckpointError,
                       match=r"(?s)optimizer.learning_rate: 3e-05 in the checkpoint, 0.001 now"
                       r".*start_over=True"):
        train.train(changed, str(run), parallel.make_mesh({"data": 8, "fsdp": 1, "tensor": 1}),
                    _rules(changed))


def test_run_past_num_iterations_is_refused(short_run, tmp_path, mesh):
    config, workdir = short_run
    run = _copy_run(workdir, tmp_path)
    config = config.copy_and_resolve_references()
    config.train.num_iterations = 2
    with pytest.raises(ValueError, match="at iteration 3, past train.num_iterations=2"):
        train.train(config, str(run), mesh, _rules(config))


def test_unwritable_workdir_fails_before_any_compute(tmp_path, data_dir, mesh, monkeypatch):
    monkeypatch.setattr(tasks, "build", lambda *a, **k: pytest.fail("computed"))
    (tmp_path / "a_file").write_text("x")
    config = _load_short_config(data_dir)
    with pytest.raises(PermissionError, match=r"workdir .*a_file/run is not writable"):
        train.train(config, str(tmp_path / "a_file" / "run"), mesh, _rules(config))


# ---------------------------------------------------------------------------------------------
# RunCheckpoints on its own: corrupted or truncated checkpoints, saving twice
# ---------------------------------------------------------------------------------------------


def _tiny_state(mesh, keep_reference=False, settings=None):
    settings = settings or policy_update.PolicyUpdate()
    _, params = nnx.split(flux.init_sharded(tiny_rl.TINY_FLUX, mesh, seed=0))
    optimizer = optimizer_lib.make_optimizer(tiny_rl.ADAMW)
    return (policy_update.init_state(params, optimizer, keep_reference, mesh, settings),
            policy_update.abstract_state(params, optimizer, keep_reference, mesh, settings))


def _config():
    config = config_lib.base_config()
    config.train = config_lib.train_config()
    return config


def _corrupt(step_dir):
    """Truncates every data file of the step's arrays to half its size."""
    for root, _, files in os.walk(os.path.join(step_dir, "state")):
        for name in files:
            path = os.path.join(root, name)
            if "ocdbt.process" in root or root.endswith("/d"):
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    f.truncate(size // 2)


def test_corrupted_latest_checkpoint_falls_back_to_the_one_before(tmp_path, caplog):
    mesh = parallel.make_mesh((8, 1, 1))
    state, target = _tiny_state(mesh)
    config = _config()
    run = checkpoint_lib.RunCheckpoints(str(tmp_path))
    key = jax.random.key(3)
    run.save(1, state, key, {"iteration": 1}, config, wait=True)
    moved = state.replace(params=jax.tree.map(lambda p: p + 1, state.params),
                          step=state.step + 1)
    run.save(2, moved, key, {"iteration": 2}, config, wait=True)
    with pytest.raises(checkpoint_lib.CheckpointError, match="already saved"):
        run.save(2, moved, key, {"iteration": 2}, config)
    _corrupt(run.step_dir(2))
    with caplog.at_level(logging.WARNING):
        step, restored, rng, loop = run.restore_latest(target, config)
    assert step == 1 and loop == {"iteration": 1}
    assert "cannot be read" in caplog.text and "checkpoints/2" in caplog.text
    for a, b in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(jax.random.key_data(rng), jax.random.key_data(key))
    _corrupt(run.step_dir(1))
    with pytest.raises(checkpoint_lib.CheckpointError, match="No checkpoint .* can be read"):
        run.restore_latest(target, config)
    run.close()


@pytest.mark.parametrize("offload", [False, True])
def test_adamw_state_and_kl_reference_round_trip_with_their_structure(tmp_path, offload):
    """offload: both saved from and restored into pinned host memory (host-offloaded moments
    and KL reference; policy_update.PolicyUpdate.offload_*)."""
    mesh = parallel.make_mesh((2, 4, 1))
    settings = policy_update.PolicyUpdate(offload_optimizer_state=offload,
                                          offload_reference=offload)
    state, target = _tiny_state(mesh, keep_reference=True, settings=settings)
    state = state.replace(ref_params=jax.tree.map(lambda p: p * 2, state.ref_params))
    run = checkpoint_lib.RunCheckpoints(str(tmp_path), async_save=False)
    run.save(5, state, jax.random.key(0), {}, _config())
    _, restored, _, _ = run.restore_latest(target, _config())
    run.close()
    assert jax.tree.structure(restored.opt_state) == jax.tree.structure(state.opt_state)
    assert isinstance(restored.opt_state[1][0], optax.ScaleByAdamState)
    assert restored.ref_params is not None
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    kind = "pinned_host" if offload else "device"
    assert {a.sharding.memory_kind for a in jax.tree.leaves(
        (restored.opt_state, restored.ref_params))} == {kind}
