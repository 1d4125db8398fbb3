"""Seconds and bytes of one RL checkpoint (g2rpo_jax.run.checkpoint.RunCheckpoints): the train
state (float32 parameters, both AdamW moments after one step, counters, the key) and the loop's
JSON, for the shapes world's base generator and the tiny FLUX.1-dev fixture's transformer.

  python benchmarks/perf/checkpoint_io.py [--devices=8] [--repeats=3] [--output=FILE.json]

Per model: `blocking` is what the training loop waits for in an asynchronous save (the arrays
copied off the devices, the write started), `save` the time until the step is committed,
`restore` reading it back into the same shardings; the best of the repeats after one warm-up
save (the first save of a process also starts Orbax's machinery: reported as `first_save`).
"""

import argparse
import json
import os
import tempfile
import time

import jax
import optax


def _bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, name))
               for root, _, files in os.walk(path) for name in files)


def measure(name, model, mesh, repeats: int, config) -> dict:
    from flax import nnx

    from g2rpo_jax.rl import optimizer as optimizer_lib
    from g2rpo_jax.rl import policy_update
    from g2rpo_jax.run import checkpoint

    _, params = nnx.split(model)
    optimizer = optimizer_lib.make_optimizer(config.optimizer)
    state = policy_update.init_state(params, optimizer, False, mesh)
    # One AdamW step on random gradients, so the moments hold real (incompressible) values as
    # in a run, not the zeros of a fresh state.
    leaves, tree = jax.tree.flatten(state.params)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    grads = jax.tree.unflatten(tree, [jax.random.normal(k, x.shape, x.dtype) * 1e-3
                                      for k, x in zip(keys, leaves)])
    updates, opt_state = jax.jit(optimizer.update)(grads, state.opt_state, state.params)
    state = state.replace(params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state, step=state.step + 1)
    target = policy_update.abstract_state(params, optimizer, False, mesh)
    key = jax.random.key(0)
    loop = {"iteration": 0, "data": {"epoch": 0, "position": 0}}
    parameters = sum(x.size for x in jax.tree.leaves(params))
    with tempfile.TemporaryDirectory() as workdir:
        run = checkpoint.RunCheckpoints(workdir, max_to_keep=0)
        tick = time.perf_counter()
        run.save(1, state, key, loop, config, wait=True)
        first = time.perf_counter() - tick
        blocking, saves, restores = [], [], []
        for step in range(2, 2 + repeats):
            tick = time.perf_counter()
            run.save(step, state, key, loop, config)
            blocking.append(time.perf_counter() - tick)
            run.wait()
            saves.append(time.perf_counter() - tick)
            tick = time.perf_counter()
            restored = run.restore_latest(target, config)
            jax.block_until_ready(restored[1])
            restores.append(time.perf_counter() - tick)
        size = _bytes(run.step_dir(1 + repeats))
        run.close()
    result = {"model": name, "parameters": int(parameters), "bytes": size,
              "bytes_per_parameter": round(size / parameters, 2), "first_save_s": first,
              "blocking_s": min(blocking), "save_s": min(saves), "restore_s": min(restores)}
    print(f"{name}: {parameters:,} parameters, checkpoint {size / 2**20:.1f} MiB "
          f"({size / parameters:.2f} B/parameter); async save blocks {min(blocking):.3f} s, "
          f"committed in {min(saves):.3f} s (first save {first:.2f} s); restore "
          f"{min(restores):.3f} s (best of {repeats})", flush=True)
    return result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--output", default="")
    args = parser.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    jax.config.update("jax_num_cpu_devices", args.devices)

    from g2rpo_jax import parallel
    from g2rpo_jax.models import flux
    from g2rpo_jax.run import config_lib
    from g2rpo_jax.tasks import generator
    from g2rpo_jax.testing import flux_fixture

    mesh = parallel.make_mesh({"data": 2, "fsdp": -1, "tensor": 1})
    shapes = config_lib.shapes_config()
    shapes.train = config_lib.train_config()
    tiny = config_lib.flux_config()
    results = [
        measure("shapes base (configs/shapes_cpu.py)",
                generator.load_generator(generator.SHIPPED_BASE, mesh).flux, mesh,
                args.repeats, shapes),
        measure("tiny FLUX.1-dev fixture (configs/flux_tiny.py)",
                flux.init_sharded(flux.FluxConfig(**flux_fixture.TRANSFORMER), mesh, 0), mesh,
                args.repeats, tiny),
    ]
    report = {"devices": jax.device_count(), "mesh": dict(mesh.shape), "results": results}
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
