r"""g2rpo-jax entry point.

  python -m g2rpo_jax.main --config=configs/<name>.py --workdir=DIR [--config.a.b=value ...]

The config file's `get_config()` gives every setting; any field can be overridden on the
command line (e.g. `--config.model.num_layers=2 --config.mesh.fsdp=4`). `config.mode` selects
what runs:
  describe  build the mesh and the model, report parameter counts and shardings, and time one
            forward pass on a dummy batch (writes DIR/describe.json).
  pretrain  flow-matching pre-training of a generator (g2rpo_jax/pretrain.py).
  train     RL fine-tuning with the configured algorithm (g2rpo_jax/train.py) on the task
            `config.task`: "shapes" (the embedded world) or "flux" (FLUX.1 with preprocessed
            prompt embeddings: python -m g2rpo_jax.preprocess first).
Held-out evaluation of a checkpoint: python -m g2rpo_jax.evaluate (g2rpo_jax/evaluate.py).
"""

import os
import time

from absl import app, flags, logging
from flax import nnx
import jax
import jax.numpy as jnp

from g2rpo_jax import parallel
from g2rpo_jax.core import storage
from g2rpo_jax.models import flux, flux_weights, lora
from g2rpo_jax.run import checkpoint, config_lib

_CONFIG = config_lib.define_config_flag()
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for outputs (created if missing).")


def _build_model(config, mesh, rules) -> flux.Flux:
    """From the checkpoint if the config names one (straight into shardings), else random."""
    if config.model.checkpoint:
        execution = config_lib.execution_fields(config.model)
        return flux_weights.from_pretrained(
            storage.local(config.model.checkpoint, parts=("transformer",)), mesh=mesh, rules=rules,
            **execution)
    return flux.init_sharded(config_lib.to_flux_config(config.model), mesh, config.seed, rules)


def _dummy_batch(cfg: flux.FluxConfig, batch: int, image_tokens: int, text_tokens: int, mesh,
                 rules):
    keys = jax.random.split(jax.random.key(0), 4)
    side = max(1, int(image_tokens ** 0.5))
    token = jnp.arange(image_tokens)
    img_ids = jnp.stack([jnp.zeros(image_tokens), token // side, token % side],
                        -1).astype(jnp.float32)
    arrays = dict(
        img=jax.random.normal(keys[0], (batch, image_tokens, cfg.in_channels)),
        txt=jax.random.normal(keys[1], (batch, text_tokens, cfg.joint_attention_dim)),
        timesteps=jax.random.uniform(keys[2], (batch,)),
        y=jax.random.normal(keys[3], (batch, cfg.pooled_projection_dim)),
    )
    if cfg.guidance_embeds:
        arrays["guidance"] = jnp.full((batch,), 3.5)
    arrays = {k: jax.device_put(v, parallel.batch_sharding(mesh, v.shape, rules))
              for k, v in arrays.items()}
    return dict(arrays, img_ids=img_ids, txt_ids=jnp.zeros((text_tokens, 3), jnp.float32))


def compilation_cache_dir(config, workdir: str) -> str:
    """JAX's persistent compilation cache: config.compilation_cache_dir, else WORKDIR/
    compilation_cache (local or gs://, like the workdir)."""
    return config.get("compilation_cache_dir") or os.path.join(storage.absolute(workdir),
                                                               "compilation_cache")


def describe(config, workdir: str, mesh, rules) -> dict:
    """Reports parameters, shardings and (optionally) one forward pass's compile/run time."""
    cfg = config_lib.to_flux_config(config.model)
    flux.validate_mesh(cfg, mesh)
    model = flux.abstract_model(cfg, rules)
    lora_config = lora.LoRAConfig.from_config(config.model.get("lora"))
    adapters = None
    if lora_config.enabled:   # the trained part: adapters, their gradients and AdamW moments
        _, adapters, abstract_state = nnx.split(lora.wrap(model, lora_config), nnx.LoRAParam,
                                                ...)
    else:
        _, abstract_state = nnx.split(model)
    leaves = jax.tree.leaves(abstract_state)
    num_params = sum(x.size for x in leaves)
    num_bytes = sum(x.size * x.dtype.itemsize for x in leaves)
    report = {"mesh": dict(mesh.shape), "devices": jax.device_count(),
              "parameters": num_params, "parameter_bytes": num_bytes}
    logging.info("Mesh %s over %d devices (%s).", dict(mesh.shape), jax.device_count(),
                 jax.devices()[0].platform)
    logging.info("FLUX transformer: %s parameters, %.2f GiB as %s.", f"{num_params:,}",
                 num_bytes / 2**30, cfg.param_dtype)
    rows = sorted(parallel.sharding_table(abstract_state, mesh, rules),
                  key=lambda row: -row["bytes_per_device"])
    limit = config.describe.max_param_lines
    for row in rows if limit < 0 else rows[:limit]:
        logging.info("  %-56s %-20s %-36s %9.2f MiB/device", row["path"], row["shape"],
                     row["spec"], row["bytes_per_device"] / 2**20)
    per_device = sum(row["bytes_per_device"] for row in rows) / 2**20
    report["parameter_mib_per_device"] = per_device
    logging.info("Parameters per device: %.1f MiB.", per_device)
    if adapters is not None:
        report["lora"] = {"rank": lora_config.rank, "alpha": lora_config.alpha,
                          "parameters": sum(x.size for x in jax.tree.leaves(adapters))}
        logging.info("LoRA rank %d (alpha %g) on %d target linears of every block: %s trained "
                     "parameters; the base above is frozen.", lora_config.rank, lora_config.alpha,
                     len(lora_config.targets), f"{report['lora']['parameters']:,}")

    if config.describe.forward:
        start = time.perf_counter()
        model = _build_model(config, mesh, rules)
        report["load_s"] = time.perf_counter() - start
        batch_size = config.describe.batch_size
        if batch_size <= 0:
            batch_size = mesh.shape["data"] * mesh.shape["fsdp"]
        batch = _dummy_batch(model.cfg, batch_size, config.describe.image_tokens,
                             config.describe.text_tokens, mesh, rules)
        graphdef, state = nnx.split(model)

        @jax.jit
        def forward(state, batch):
            return nnx.merge(graphdef, state)(**batch)

        with jax.set_mesh(mesh):
            start = time.perf_counter()
            compiled = forward.lower(state, batch).compile()
            report["compile_s"] = time.perf_counter() - start
            compiled(state, batch).block_until_ready()
            times = []
            for _ in range(max(1, config.describe.num_runs)):
                start = time.perf_counter()
                compiled(state, batch).block_until_ready()
                times.append(time.perf_counter() - start)
        report["forward_s"] = min(times)
        report["batch"] = {"size": batch_size, "image_tokens": config.describe.image_tokens,
                           "text_tokens": config.describe.text_tokens}
        logging.info("Forward [B=%d, N=%d, T=%d]: compile %.2f s, run %.4f s (best of %d).",
                     batch_size, config.describe.image_tokens, config.describe.text_tokens,
                     report["compile_s"], report["forward_s"], len(times))
    if jax.process_index() == 0:
        storage.write_json(os.path.join(workdir, "describe.json"), report)
    return report


def pretrain(config, workdir: str, mesh, rules) -> dict:
    from g2rpo_jax import pretrain as pretrain_lib

    return pretrain_lib.pretrain(config, workdir, mesh, rules)


def train(config, workdir: str, mesh, rules) -> dict:
    from g2rpo_jax import train as train_lib

    return train_lib.train(config, workdir, mesh, rules)


MODES = {"describe": describe, "pretrain": pretrain, "train": train}


def _quiet_library_logs() -> None:
    """Orbax logs every step of a checkpoint write at INFO, gcsfs every file it opens; keep
    their warnings, drop the rest."""
    import logging as std_logging

    def keep(record) -> bool:
        return record.levelno >= std_logging.WARNING or not any(
            name in record.pathname for name in ("orbax", "gcsfs", "fsspec"))

    logging.get_absl_handler().addFilter(keep)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    _quiet_library_logs()
    config = _CONFIG.value
    if config.mode not in MODES:
        raise app.UsageError(f"Unknown mode {config.mode!r}; choose one of {sorted(MODES)}.")
    # Before anything compiles: a restarted job (a preempted slice) loads its programs from
    # here instead of compiling them again.
    jax.config.update("jax_compilation_cache_dir", compilation_cache_dir(config, _WORKDIR.value))
    parallel.initialize_distributed(config.distributed)
    parallel.check_same_config(config)
    workdir = checkpoint.ensure_writable(_WORKDIR.value)
    mesh = parallel.mesh_from_config(config.mesh)
    rules = parallel.rules_from_config(config.sharding_rules)
    MODES[config.mode](config, workdir, mesh, rules)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(main)
