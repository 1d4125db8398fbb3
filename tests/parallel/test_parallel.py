"""Mesh construction, logical axis rules and multi-process start-up."""

import os
import socket
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import ml_collections
import numpy as np
import pytest

from g2rpo_jax import parallel


@pytest.mark.parametrize("sizes, expected", [
    ((8, 1, 1), (8, 1, 1)),
    ((-1, 2, 1), (4, 2, 1)),
    ({"fsdp": -1}, (1, 8, 1)),
    ({"data": 2, "tensor": 2, "fsdp": -1}, (2, 2, 2)),
])
def test_resolve_mesh_shape(sizes, expected):
    assert parallel.resolve_mesh_shape(sizes, 8) == expected


@pytest.mark.parametrize("sizes, message", [
    ((3, 1, 1), "3 positions but there are 8 devices"),
    ((-1, 3, 1), "multiply to 3, which does not divide 8"),
    ((-1, -1, 1), "at most one axis may be -1"),
    ((0, 8, 1), "positive or -1"),
    ({"model": 8}, "Unknown mesh axes"),
    ((8, 1), "needs 3 sizes"),
])
def test_bad_mesh_is_a_clear_error(sizes, message):
    with pytest.raises(parallel.MeshError, match=message):
        parallel.resolve_mesh_shape(sizes, 8)


def test_make_mesh_uses_all_devices_with_axis_names():
    mesh = parallel.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
    assert mesh.axis_names == parallel.MESH_AXES
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert mesh.devices.size == jax.device_count() == 8
    with pytest.raises(parallel.MeshError, match="axis_types"):
        parallel.make_mesh((8, 1, 1), axis_types="manual")


def test_mesh_from_config():
    cfg = ml_collections.ConfigDict(dict(data=1, fsdp=-1, tensor=4, axis_types="explicit"))
    mesh = parallel.mesh_from_config(cfg)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 2, "tensor": 4}
    assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def test_logical_to_spec_hand_cases():
    rules = parallel.DEFAULT_RULES
    mesh = parallel.make_mesh((2, 2, 2))
    # [layers, embed, heads] → (None, fsdp, tensor)
    assert parallel.logical_to_spec(("layers", "embed", "heads"), rules, (4, 8, 8), mesh) == \
        P(None, "fsdp", "tensor")
    # batch takes data and fsdp together.
    assert parallel.logical_to_spec(("batch", None), rules, (8, 3), mesh) == P(("data", "fsdp"))
    # batch of 2 cannot be split 4 ways: keep the leading axis that divides it.
    assert parallel.logical_to_spec(("batch", None), rules, (2, 3), mesh) == P("data")
    # Odd sizes stay replicated; a mesh axis is never used twice in one array.
    assert parallel.logical_to_spec(("embed", "mlp"), rules, (7, 8), mesh) == P(None, "tensor")
    custom = (("a", "tensor"), ("b", "tensor"))
    assert parallel.logical_to_spec(("a", "b"), custom, (4, 4), mesh) == P("tensor")
    # Without a mesh the full mapping is returned; fsdp, taken by batch, is not reused.
    assert parallel.logical_to_spec(("batch", "embed", "heads"), rules) == \
        P(("data", "fsdp"), None, "tensor")
    with pytest.raises(ValueError, match="has no rule"):
        parallel.logical_to_spec(("nonsense",), rules)


def test_mesh_axes_of_size_one_are_dropped():
    mesh = parallel.make_mesh((8, 1, 1))
    assert parallel.logical_to_spec(("layers", "embed", "heads"), parallel.DEFAULT_RULES,
                                    (4, 8, 8), mesh) == P()


def test_rules_from_config_round_trip():
    as_lists = [list(rule) for rule in parallel.DEFAULT_RULES]
    assert parallel.rules_from_config(as_lists) == parallel.DEFAULT_RULES
    with pytest.raises(ValueError, match="logical_name, mesh_axes"):
        parallel.rules_from_config([["batch"]])


def test_logical_constraint_is_identity_without_mesh_and_shards_with_one():
    x = jnp.arange(16.0).reshape(8, 2)
    assert parallel.with_logical_constraint(x, ("batch", None)) is x
    mesh = parallel.make_mesh((4, 2, 1))

    @jax.jit
    def f(x):
        return parallel.with_logical_constraint(x * 2, ("batch", None))

    with jax.set_mesh(mesh):
        y = f(x)
    assert y.sharding.spec == P(("data", "fsdp"))
    np.testing.assert_array_equal(y, x * 2)


_WORKER = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    import ml_collections
    import numpy as np
    from g2rpo_jax import parallel
    port, pid = sys.argv[1], int(sys.argv[2])
    parallel.initialize_distributed(ml_collections.ConfigDict(dict(
        enabled=True, coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)))
    mesh = parallel.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    sharding = parallel.batch_sharding(mesh, (4,))
    local = np.arange(2, dtype=np.float32) + 2 * pid      # process 0: [0, 1], process 1: [2, 3]
    x = jax.make_array_from_process_local_data(sharding, local, (4,))
    total = jax.jit(lambda x: x.sum(), out_shardings=parallel.batch_sharding(mesh, ()))(x)
    print(f"RESULT {pid} {jax.device_count()} {mesh.devices.size} {float(total)}")
""")


def test_place_cond_shards_per_prompt_entries():
    mesh = parallel.make_mesh((8, 1, 1))
    cond = {"txt": np.arange(8 * 5 * 3, dtype=np.float32).reshape(8, 5, 3),
            "y": np.arange(8 * 4, dtype=np.float32).reshape(8, 4) + 0.5,
            "txt_ids": np.arange(5 * 3, dtype=np.float32).reshape(5, 3),
            "img_ids": np.arange(4 * 3, dtype=np.float32).reshape(4, 3) + 1000}
    placed = parallel.place_cond(cond, mesh)
    assert set(placed) == set(cond)
    for name in ("txt", "y"):
        arr = placed[name]
        np.testing.assert_array_equal(np.asarray(arr), cond[name])
        expected = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
        assert arr.sharding.is_equivalent_to(expected, arr.ndim), arr.sharding
        shards = arr.addressable_shards
        assert len(shards) == 8
        rows = sorted(s.index[0].start for s in shards)
        assert rows == list(range(8))
        for s in shards:
            assert s.data.shape == (1, *cond[name].shape[1:])
            np.testing.assert_array_equal(np.asarray(s.data), cond[name][s.index])
    for name in ("txt_ids", "img_ids"):
        arr = placed[name]
        assert arr.sharding.is_fully_replicated
        assert len(arr.sharding.device_set) == 8
        np.testing.assert_array_equal(np.asarray(arr), cond[name])


@pytest.mark.slow
def test_two_processes_form_one_global_mesh(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [p.communicate(timeout=180)[0] for p in procs]
    for i, out in enumerate(outputs):
        assert procs[i].returncode == 0, out
        result = [line for line in out.splitlines() if line.startswith("RESULT")]
        assert result == [f"RESULT {i} 4 4 6.0"], out


def test_optimizer_state_follows_the_parameters():
    """AdamW's moments take the parameters' FSDP layout; jit alone would leave them on one
    device (then replicated: 2 × 44 GiB per chip for FLUX.1-dev)."""
    import optax

    mesh = parallel.make_mesh({"fsdp": -1})
    sharding = jax.sharding.NamedSharding(mesh, P("fsdp"))
    params = {"w": jax.device_put(jnp.ones((16, 4)), sharding), "b": jnp.zeros((3,))}
    params["b"] = jax.device_put(params["b"], jax.sharding.NamedSharding(mesh, P()))
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    assert not isinstance(jax.jit(optimizer.init)(params)[1][0].mu["w"].sharding,
                          jax.sharding.NamedSharding)
    shardings = parallel.optimizer_state_shardings(
        optimizer, jax.eval_shape(optimizer.init, params),
        jax.tree.map(lambda a: a.sharding, params), mesh)
    state = jax.jit(optimizer.init, out_shardings=shardings)(params)
    adam = state[1][0]
    assert adam.mu["w"].sharding.spec == P("fsdp") and adam.nu["w"].sharding.spec == P("fsdp")
    assert adam.mu["b"].sharding.spec == P() and adam.count.sharding.spec == P()
    assert adam.count.sharding.mesh == mesh


_NO_CLUSTER = textwrap.dedent("""
    import jax
    import ml_collections
    from g2rpo_jax import parallel
    config = ml_collections.ConfigDict(dict(enabled=True, coordinator_address="",
                                            num_processes=-1, process_id=-1))
    try:
        parallel.initialize_distributed(config)
    except ValueError as e:
        print("ERROR", e)
    config.single_process_fallback = True
    parallel.initialize_distributed(config)   # warns and stays one process
    print("PROCESSES", jax.process_count())
""")


def test_distributed_without_a_cluster():
    """Before any computation (as main calls it), in a fresh process."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", _NO_CLUSTER], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "distributed.enabled=False for a single process" in out.stdout
    assert "PROCESSES 1" in out.stdout and "no cluster environment was detected" in out.stderr


def test_mesh_that_needs_split_physical_axes(monkeypatch):
    """jax.make_mesh refuses sizes that are not products of whole torus axes (fsdp=8 on a
    4x4x4 v5p); make_mesh then splits physical axes instead."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("Failed to find assignment for logical_axis_index 1 of size 8.")

    monkeypatch.setattr(jax, "make_mesh", refuse)
    mesh = parallel.make_mesh({"data": 2, "fsdp": 4})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))
    assert mesh.axis_types == (jax.sharding.AxisType.Auto,) * 3


def test_init_state_lays_adam_moments_out_like_the_parameters():
    """rl.policy_update.init_state: AdamW's moments take the parameters' FSDP sharding (left to jit
    they would land on one device and be replicated)."""
    import optax

    from g2rpo_jax.rl import policy_update

    mesh = parallel.make_mesh({"data": 2, "fsdp": 4, "tensor": 1})
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
    params = {"w": jax.device_put(jnp.ones((8, 4)), spec)}
    state = policy_update.init_state(params, optax.adamw(1e-3), False, mesh)
    mu, nu = state.opt_state[0].mu["w"], state.opt_state[0].nu["w"]
    for moment in (mu, nu):
        assert moment.sharding.is_equivalent_to(spec, 2)
        assert moment.addressable_shards[0].data.shape == (2, 4)
