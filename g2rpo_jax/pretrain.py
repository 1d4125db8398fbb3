"""Flow-matching pre-training of a generator (mode "pretrain": the embedded world's base model).

Rectified flow in FLUX's convention: x_σ = (1 − σ)·x₀ + σ·ε, the model predicts v = ε − x₀,
σ ~ logit-normal(0, 1) (SD3 / FLUX training). The transformer and the word encoder train
jointly; the result is one generator file (`generator.save_generator`) that the RL job loads.
With `pretrain.ema_decay` > 0 the evaluated and written weights are an exponential moving
average of the trained ones (as diffusion models are usually sampled): the raw weights of a
small model at the end of a noisy schedule draw visibly rougher images.

  python -m g2rpo_jax.main --config=configs/shapes_pretrain.py --workdir=DIR
"""

import dataclasses
import json
import os
import time

from absl import logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from g2rpo_jax import parallel
from g2rpo_jax.core import storage
from g2rpo_jax.data import reader as reader_lib
from g2rpo_jax.data import shapes_tfds, world
from g2rpo_jax.rl import optimizer as optimizer_lib
from g2rpo_jax.run import metrics as metrics_lib
from g2rpo_jax.run import wandb_logger
from g2rpo_jax.tasks import generator as generator_lib
from g2rpo_jax.tasks import held_out


def flow_matching_loss(velocity: jax.Array, x0: jax.Array, noise: jax.Array) -> jax.Array:
    """Mean squared error of a predicted velocity [B, N, C] against ε − x₀."""
    return jnp.mean(jnp.square(velocity.astype(jnp.float32) - (noise - x0)))


def noisy_latents(x0: jax.Array, noise: jax.Array, sigma: jax.Array) -> jax.Array:
    """x_σ = (1 − σ)·x₀ + σ·ε for x0, noise [B, N, C], sigma [B]."""
    s = sigma[:, None, None]
    return (1.0 - s) * x0 + s * noise


def ema_decay_at(step: jax.Array, decay: float) -> jax.Array:
    """The average's decay after `step` updates: min(decay, (1 + step) / (10 + step)), so that
    the initial weights do not linger (0.999 alone keeps 5% of them after 3,000 steps)."""
    step = jnp.asarray(step, jnp.float32)
    return jnp.minimum(decay, (1.0 + step) / (10.0 + step))


def ema_update(ema, params, decay):
    """ema ← decay·ema + (1 − decay)·params, leaf by leaf."""
    return jax.tree.map(lambda e, p: (decay * e + (1.0 - decay) * p).astype(e.dtype), ema,
                        params)


def make_train_step(flux_graphdef, encoder_graphdef, autoencoder, optimizer,
                    ema_decay: float = 0.0):
    """step(params, opt_state, ema, images [B,H,W,3] uint8, ids/mask [B,T], key, step) →
    (params, opt_state, ema, loss); params = {"flux": ..., "text_encoder": ...}; `ema` is None
    when ema_decay is 0."""
    img_ids = autoencoder.image_ids()

    def loss_fn(params, images, ids, mask, key):
        cond = nnx.merge(encoder_graphdef, params["text_encoder"])(ids, mask)
        x0 = autoencoder.encode(images.astype(jnp.float32) / 255.0)
        noise_key, sigma_key = jax.random.split(key)
        noise = jax.random.normal(noise_key, x0.shape)
        sigma = jax.nn.sigmoid(jax.random.normal(sigma_key, (x0.shape[0],)))
        model = nnx.merge(flux_graphdef, params["flux"])
        v = model(noisy_latents(x0, noise, sigma), img_ids, cond["txt"], cond["txt_ids"], sigma,
                  cond["y"])
        return flow_matching_loss(v, x0, noise)

    def step(params, opt_state, ema, images, ids, mask, key, step_index):
        loss, grads = jax.value_and_grad(loss_fn)(params, images, ids, mask, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        if ema_decay:
            ema = ema_update(ema, params, ema_decay_at(step_index, ema_decay))
        return params, opt_state, ema, loss

    return step


def pretrain(config, workdir: str, mesh, rules) -> dict:
    """Trains a generator from scratch on the world's training split; writes
    DIR/generator.safetensors, DIR/metrics.jsonl and DIR/pretrain.json."""
    settings = config.pretrain
    wandb_logger.validate(config.get("logging"))   # before any compute
    if settings.get("init_checkpoint"):
        # Continue from a generator file (e.g. the shipped base) with a fresh schedule.
        generator = generator_lib.load_generator(settings.init_checkpoint, mesh, rules)
        differences = generator_lib.architecture_differences(
            generator.config, generator_lib.generator_config(config))
        if differences:
            raise ValueError(f"pretrain.init_checkpoint {settings.init_checkpoint} holds a "
                             f"different architecture or vocabulary than this config's model/"
                             f"world sections (differing: {', '.join(differences)}); start from "
                             "scratch (init_checkpoint='') or match the config to the file.")
    else:
        generator = generator_lib.build_generator(config, mesh, config.seed, rules)
    data_dir = config.data.data_dir or os.path.join(workdir, "tfds")
    train_source = shapes_tfds.load_split(data_dir, "train", shapes_tfds.config_from(config))
    reader = reader_lib.Reader(train_source, settings.batch_size, seed=config.seed,
                               rows=parallel.host_row_indices(mesh, settings.batch_size, rules))
    held_out_prompts = held_out.held_out_prompts(config)
    caption_noise = {k: float(v) for k, v in settings.get("caption_noise", {}).items() if v}
    if caption_noise:
        # Corrupted captions stay within the training split: no held-out prompt is ever seen.
        training_prompts = frozenset(world.split_prompts(
            config.world.split_seed, config.world.held_out_fraction)["train"])

    optimizer = optimizer_lib.make_optimizer(config.optimizer)
    flux_graphdef, flux_params = nnx.split(generator.flux, nnx.Param)
    enc_graphdef, enc_params = nnx.split(generator.text_encoder, nnx.Param)
    params = parallel.replicate_unplaced({"flux": flux_params, "text_encoder": enc_params}, mesh)
    opt_state = parallel.replicate_unplaced(jax.jit(optimizer.init)(params), mesh)
    ema_decay = float(settings.get("ema_decay", 0.0))
    if not 0.0 <= ema_decay < 1.0:
        raise ValueError(f"pretrain.ema_decay is {ema_decay}; use 0 (no average) or a value in "
                         "(0, 1), e.g. 0.999.")
    ema = jax.tree.map(jnp.copy, params) if ema_decay else None
    step_fn = jax.jit(make_train_step(flux_graphdef, enc_graphdef, generator.autoencoder,
                                      optimizer, ema_decay), donate_argnums=(0, 1, 2))

    def sampled_weights():
        """The weights that are evaluated and written: the average when there is one."""
        return ema if ema_decay else params

    logger = metrics_lib.MetricsLogger(workdir, config=config)
    evaluator = held_out.Evaluator(config, generator, held_out_prompts, mesh,
                                   scorers=("in_domain", "quality"))

    def evaluate(step):
        weights = sampled_weights()
        scores = evaluator.scores(
            weights["flux"], text_encoder=nnx.merge(enc_graphdef, weights["text_encoder"]))
        logger.write(step, {f"eval/{k}": v for k, v in scores.items()})
        return scores

    key = jax.random.key(config.seed)
    start = time.perf_counter()
    bar = tqdm.trange(settings.num_steps, desc="pretrain", dynamic_ncols=True,
                      disable=jax.process_index() != 0)
    scores, loss_ema = {}, None
    with jax.set_mesh(mesh):
        for step in bar:
            batch = next(reader)
            captions = list(batch["prompt"])
            if caption_noise:
                rng = np.random.default_rng((config.seed, step))
                captions = [world.noisy_caption(p, rng, caption_noise, training_prompts)
                            for p in captions]
            ids, mask = generator.tokenize(captions)
            arrays = [parallel.from_local_rows(a, mesh, settings.batch_size, rules=rules)
                      for a in (batch["image"], ids, mask)]
            params, opt_state, ema, loss = step_fn(params, opt_state, ema, *arrays,
                                                   jax.random.fold_in(key, step), step)
            if step % settings.log_every == 0 or step == settings.num_steps - 1:
                loss = float(loss)
                if not jnp.isfinite(loss):
                    raise FloatingPointError(f"Pre-training loss is {loss} at step {step}; lower "
                                             "optimizer.learning_rate or check the data.")
                loss_ema = loss if loss_ema is None else 0.9 * loss_ema + 0.1 * loss
                logger.write(step, {"train/loss": loss})
                bar.set_postfix(loss=f"{loss_ema:.4f}", **{k: f"{v:.3f}"
                                                          for k, v in scores.items()})
            if settings.eval_every and (step + 1) % settings.eval_every == 0:
                scores = evaluate(step + 1)
        scores = evaluate(settings.num_steps)
    seconds = time.perf_counter() - start
    weights = sampled_weights()
    trained = dataclasses.replace(
        generator, flux=nnx.merge(flux_graphdef, weights["flux"]),
        text_encoder=nnx.merge(enc_graphdef, weights["text_encoder"]),
        config=generator_lib.generator_config(config))   # not the init file's metadata
    report = {"steps": settings.num_steps, "batch_size": settings.batch_size,
              "seconds": seconds, "held_out": scores, "seed": config.seed,
              "ema_decay": ema_decay, "caption_noise": caption_noise,
              "placement_grid": config.world.get("placement_grid", 1),
              "init_checkpoint": os.path.basename(settings.get("init_checkpoint") or "")}
    if jax.process_index() == 0:
        path = generator_lib.save_generator(os.path.join(workdir, "generator.safetensors"),
                                            trained, {"pretrain": report})
        with storage.open_atomic(os.path.join(workdir, "pretrain.json"), "w") as f:
            json.dump(report, f, indent=2)
        logging.info("Wrote %s; held-out scores %s after %.0f s.", path, scores, seconds)
    logger.close()
    return report
