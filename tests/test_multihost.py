"""The RL loop as one JAX job of two processes (jax.distributed on this machine, one CPU device
each) against the same run in one process with two devices: the same mesh, so the same
prompts, rewards, metrics and parameters (up to float reduction order), a resume across
processes, and the start-up checks of a multi-host job."""

import os

import jax
import numpy as np
import pytest
import resume_helpers as rh
from test_resume import shapes_flags

from g2rpo_jax import parallel
from g2rpo_jax.run import checkpoint

# Float columns that sum over the batch: the two layouts reduce in another order.
_ATOL, _RTOL = 1e-6, 1e-4


def _flags(workdir, data_dir, cache_dir, iterations):
    return [f for f in shapes_flags(workdir, data_dir, cache_dir)
            if not f.startswith("--config.train.num_iterations")] + [
        f"--config.train.num_iterations={iterations}"]


def _assert_ok(results):
    for i, result in enumerate(results):
        assert result.returncode == 0, f"process {i}:\n{result.stdout[-6000:]}"


def _by_step(rows: list[dict]) -> dict[int, dict]:
    """Rows merged per step: a run that stops at an iteration and is extended writes that
    step's evaluation after its training row, an uninterrupted run before it."""
    merged: dict[int, dict] = {}
    for row in rows:
        merged.setdefault(row["step"], {}).update(row)
    return merged


def _assert_same_rows(a: list[dict], b: list[dict], rtol_after_update: float = _RTOL):
    """Every row alike; the base evaluation's (step 0) at _RTOL, later ones at
    `rtol_after_update`."""
    a, b = _by_step(a), _by_step(b)
    assert a.keys() == b.keys()
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        rtol = _RTOL if step == 0 else rtol_after_update
        for name in a[step]:
            np.testing.assert_allclose(b[step][name], a[step][name], rtol=rtol, atol=_ATOL,
                                       err_msg=f"{name} at step {step}")


@pytest.mark.slow
def test_two_processes_train_and_resume_like_one(tmp_path):
    """Two processes × 1 device, 2 iterations, then resumed to 3 in two processes, against one
    process × 2 devices running 3 iterations: every metric row and every array of the last
    checkpoint agree; process 0 alone writes the outputs."""
    data_dir, cache = tmp_path / "tfds", tmp_path / "cache"
    single, multi = tmp_path / "single", tmp_path / "multi"
    reference = rh.run_main(_flags(single, data_dir, cache, 3), devices=2)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-6000:]

    _assert_ok(rh.run_processes(_flags(multi, data_dir, cache, 2)))
    assert checkpoint.RunCheckpoints(str(multi)).steps() == [1, 2]
    resumed = rh.run_processes(_flags(multi, data_dir, cache, 3))
    _assert_ok(resumed)
    for result in resumed:
        assert "Resuming" in result.stdout and "from iteration 2" in result.stdout

    _assert_same_rows(rh.computed_rows(single), rh.computed_rows(multi))
    a, b = rh.read_step(str(single / "checkpoints" / "3")), rh.read_step(
        str(multi / "checkpoints" / "3"))
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=_RTOL, atol=1e-5, err_msg=name)
    # The reward of the two layouts comes from the same prompts and images: equal, not close.
    rewards = [[r["train/reward_in_domain"] for r in rh.metrics_rows(d)
                if "train/reward_in_domain" in r] for d in (single, multi)]
    assert rewards[0] == rewards[1]
    for name in ("summary.json", "generator.safetensors", "images/final.png",
                 "reward_curves.png"):
        assert (multi / name).exists(), name
    assert rh.loop_item(str(multi / "checkpoints" / "3"))["iteration"] == 3

    # A restart on a smaller slice (2 devices) with a mesh fixed for a larger one (fsdp 4):
    # stopped before any compute, naming the sizes; the checkpoints stay as they were.
    smaller = rh.run_main(_flags(multi, data_dir, cache, 4) + ["--config.mesh.data=1",
                                                                "--config.mesh.fsdp=4"], devices=2)
    assert smaller.returncode != 0
    assert "has 4 positions but there are 2 devices" in smaller.stderr + smaller.stdout
    assert checkpoint.RunCheckpoints(str(multi)).steps() == [1, 2, 3]


def test_processes_with_different_configs_stop_naming_the_fields(tmp_path):
    results = rh.run_processes(
        _flags(tmp_path / "run", tmp_path / "tfds", tmp_path / "cache", 2),
        extra={1: ["--config.optimizer.learning_rate=1e-5", "--config.seed=3"]}, timeout=300)
    assert all(r.returncode != 0 for r in results)
    assert "do not run the same config: process(es) [1] differ" in results[0].stdout
    assert ("optimizer.learning_rate: 1e-05 here, 3e-05 on process 0; seed: 3 here, 0 on "
            "process 0") in results[1].stdout
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_config_fields_that_differ_are_named():
    import ml_collections

    from g2rpo_jax.parallel import agreement

    base = ml_collections.ConfigDict(dict(seed=0, train=dict(lr=1.0, steps=3),
                                          distributed=dict(process_id=0)))
    other = ml_collections.ConfigDict(base.to_dict())
    other.train.lr, other.distributed.process_id = 2.0, 1
    other.train.extra = "x"
    ours, theirs = agreement.config_json(other), agreement.config_json(base)
    assert agreement.config_json(base) != agreement.config_json(other)
    assert agreement.differing_fields(ours, theirs) == [
        'train.extra: "x" here, (absent) on process 0', "train.lr: 2.0 here, 1.0 on process 0"]
    other.train.lr, other.train.extra = 1.0, None
    del other.train["extra"]
    # The distributed section differs by design.
    assert agreement.config_json(other) == agreement.config_json(base)


def _placement(hosts: int, devices_per_host: int, batch_shards: int, rows: int):
    """(process, slice) per device of a pod whose batch axes have `batch_shards` positions in
    device order (the rest, e.g. a tensor axis, replicates), devices numbered host-major."""
    per_shard = rows // batch_shards
    devices = hosts * devices_per_host
    return [(d // devices_per_host, slice((d * batch_shards // devices) * per_shard,
                                          (d * batch_shards // devices + 1) * per_shard))
            for d in range(devices)]


def test_hosts_read_the_rows_of_their_devices():
    # 4 hosts × 4 chips, batch over fsdp=8, tensor=2: each host holds 2 of the 8 shards.
    rows = parallel.rows_by_process(_placement(4, 4, 8, 16), 16, 4)
    assert [r.tolist() for r in rows] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11],
                                          [12, 13, 14, 15]]
    # More hosts than batch shards (32 hosts, 16 shards of one prompt): pairs of hosts share a
    # shard and read the same prompt; none is left without prompts.
    rows = parallel.rows_by_process(_placement(32, 4, 16, 16), 16, 32)
    assert [r.tolist() for r in rows] == [[i // 2] for i in range(32)]
    with pytest.raises(ValueError, match=r"give the 3 processes \[2, 4\] rows each.*multiple"):
        parallel.rows_by_process([(0, slice(0, 2)), (1, slice(2, 4)), (2, slice(4, 8))], 8, 3)


def test_one_process_owns_every_row_and_round_trips():
    mesh = parallel.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    assert parallel.host_row_indices(mesh, 8).tolist() == list(range(8))
    x = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    placed = parallel.from_local_rows(x, mesh, 8)
    assert placed.sharding.spec[0] == ("data", "fsdp")
    np.testing.assert_array_equal(parallel.local_rows(placed, mesh), x)
    np.testing.assert_array_equal(parallel.gather_rows(x.T, mesh, 8, axis=1), x.T)
    key = parallel.replicated(jax.random.key(3), mesh)
    assert key.sharding.is_fully_replicated
    np.testing.assert_array_equal(jax.random.key_data(key),
                                  jax.random.key_data(jax.random.key(3)))
