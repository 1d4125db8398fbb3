r"""Compile time and forward time of the FLUX transformer on this machine, plus parameter counts.

  python benchmarks/perf/flux_forward.py            # tiny and medium on the local devices
  python benchmarks/perf/flux_forward.py --sizes=tiny --batch=2 --image_tokens=256

Prints one table row per config: parameters, compile seconds (lower + compile), and the best
of --runs forward times, with the achieved GFLOP/s from XLA's cost analysis.
"""

import time

from absl import app, flags
from flax import nnx
import jax
import jax.numpy as jnp

from g2rpo_jax.models import flux

_SIZES = flags.DEFINE_list("sizes", ["tiny", "medium"], "Configs to time.")
_BATCH = flags.DEFINE_integer("batch", 1, "Batch size.")
_IMAGE_TOKENS = flags.DEFINE_integer("image_tokens", 256, "Image tokens (16x16 latent patches).")
_TEXT_TOKENS = flags.DEFINE_integer("text_tokens", 64, "Text tokens.")
_RUNS = flags.DEFINE_integer("runs", 5, "Timed runs (best is reported).")

CONFIGS = {
    # The test-suite size: hidden 64, 2+2 blocks.
    "tiny": dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
                 joint_attention_dim=64, pooled_projection_dim=32, in_channels=16,
                 axes_dims_rope=(4, 6, 6)),
    # hidden 512, 4+8 blocks, FLUX's input widths.
    "medium": dict(num_layers=4, num_single_layers=8, attention_head_dim=64, num_attention_heads=8,
                   joint_attention_dim=4096, pooled_projection_dim=768, in_channels=64,
                   axes_dims_rope=(8, 28, 28)),
}


def time_config(name: str) -> dict:
    cfg = flux.FluxConfig(**CONFIGS[name])
    model = flux.Flux(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    b, n, t = _BATCH.value, _IMAGE_TOKENS.value, _TEXT_TOKENS.value
    keys = jax.random.split(jax.random.key(1), 3)
    side = int(n ** 0.5)
    token = jnp.arange(n)
    batch = dict(
        img=jax.random.normal(keys[0], (b, n, cfg.in_channels)),
        img_ids=jnp.stack([jnp.zeros(n), token // side, token % side], -1),
        txt=jax.random.normal(keys[1], (b, t, cfg.joint_attention_dim)),
        txt_ids=jnp.zeros((t, 3)),
        timesteps=jax.random.uniform(keys[2], (b,)),
        y=jnp.ones((b, cfg.pooled_projection_dim)),
        guidance=jnp.full((b,), 3.5),
    )

    @jax.jit
    def forward(state, batch):
        return nnx.merge(graphdef, state)(**batch)

    start = time.perf_counter()
    compiled = forward.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    compiled(state, batch).block_until_ready()
    times = []
    for _ in range(_RUNS.value):
        start = time.perf_counter()
        compiled(state, batch).block_until_ready()
        times.append(time.perf_counter() - start)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    flops = float(cost.get("flops", 0.0))
    return dict(name=name, params=flux.count_params(cfg), compile_s=compile_s,
                forward_s=min(times), gflops=flops / 1e9, gflops_per_s=flops / 1e9 / min(times))


def main(_):
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}; batch {_BATCH.value}, "
          f"{_IMAGE_TOKENS.value} image + {_TEXT_TOKENS.value} text tokens")
    print(f"FLUX.1-dev parameters (jax.eval_shape): {flux.count_params(flux.FluxConfig()):,}")
    print(f"{'config':8s} {'params':>12s} {'compile s':>10s} {'forward s':>10s} "
          f"{'GFLOP':>8s} {'GFLOP/s':>8s}")
    for name in _SIZES.value:
        r = time_config(name)
        print(f"{r['name']:8s} {r['params']:12,d} {r['compile_s']:10.2f} {r['forward_s']:10.4f} "
              f"{r['gflops']:8.2f} {r['gflops_per_s']:8.1f}")


if __name__ == "__main__":
    app.run(main)
