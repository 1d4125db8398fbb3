"""Times one flow-matching pre-training step of the embedded world's generator.

  python benchmarks/perf/pretrain_step.py [--batch=64] [--override model.num_layers=3 ...]
"""

import argparse
import time

from flax import nnx
import jax
import numpy as np

from g2rpo_jax import parallel, pretrain
from g2rpo_jax.data import world
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import generator as generator_lib


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--override", nargs="*", default=[],
                        help="config fields, e.g. model.num_layers=3")
    args = parser.parse_args()
    config = config_lib.shapes_config()
    for item in args.override:
        name, value = item.split("=")
        section, field = name.split(".")
        config[section][field] = type(config[section][field])(value)
    mesh = parallel.make_mesh({"data": -1, "fsdp": 1, "tensor": 1})
    generator = generator_lib.build_generator(config, mesh)
    optimizer = optimizer_lib.make_optimizer(config.optimizer)
    fg, fp = nnx.split(generator.flux, nnx.Param)
    eg, ep = nnx.split(generator.text_encoder, nnx.Param)
    params = {"flux": fp, "text_encoder": ep}
    opt_state = jax.jit(optimizer.init)(params)
    step = jax.jit(pretrain.make_train_step(fg, eg, generator.autoencoder, optimizer,
                                            ema_decay=0.999))
    ema = jax.tree.map(jax.numpy.copy, params)
    rng = np.random.default_rng(0)
    prompts = [world.all_prompts()[i] for i in rng.integers(0, 975, args.batch)]
    images = np.stack([world.render_prompt(p, rng) for p in prompts])
    ids, mask = generator.tokenize(prompts)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    start = time.perf_counter()
    params, opt_state, ema, loss = step(params, opt_state, ema, images, ids, mask,
                                        jax.random.key(0), 0)
    loss.block_until_ready()
    compile_s = time.perf_counter() - start
    times = []
    for i in range(args.steps):
        start = time.perf_counter()
        params, opt_state, ema, loss = step(params, opt_state, ema, images, ids, mask,
                                            jax.random.key(i), i + 1)
        loss.block_until_ready()
        times.append(time.perf_counter() - start)
    print(f"params {n_params:,}  batch {args.batch}  devices {jax.device_count()}  "
          f"compile+first {compile_s:.2f} s  step {np.median(times) * 1e3:.1f} ms (median of "
          f"{len(times)})  loss {float(loss):.4f}")


if __name__ == "__main__":
    main()
