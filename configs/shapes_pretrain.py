"""Flow-matching pre-training of the embedded world's base generator (mode "pretrain").

  python -m g2rpo_jax.main --config=configs/shapes_pretrain.py --workdir=DIR

Trains the tiny FLUX-architecture transformer and its word encoder from scratch on rendered
images of the training prompts (the held-out prompts are never seen) and writes
DIR/generator.safetensors. The file shipped as g2rpo_jax/assets/shapes_base.safetensors is that
run continued for 6,000 more steps (docs/results.md, "The shipped base generator"):

  python -m g2rpo_jax.main --config=configs/shapes_pretrain.py --workdir=DIR2 \
      --config.pretrain.init_checkpoint=DIR/generator.safetensors \
      --config.pretrain.num_steps=6000 --config.optimizer.learning_rate=5e-4 \
      --config.optimizer.warmup_steps=100
"""

import ml_collections

from g2rpo_jax.run import config_lib


def get_config():
    config = config_lib.shapes_config()
    config.mode = "pretrain"
    num_steps = ml_collections.FieldReference(3000)  # the cosine decays over all of them
    config.pretrain = ml_collections.ConfigDict(dict(
        num_steps=num_steps, batch_size=64, log_every=25, eval_every=500,
        # A generator file to continue from (same architecture); "" = from scratch.
        init_checkpoint="",
        # Evaluate and write an exponential moving average of the weights; 0 = the raw ones.
        ema_decay=0.999,
        # Per-word probabilities of a wrong caption (world.noisy_caption): colour, count,
        # relation; 0 = the caption is the prompt the image was rendered from.
        caption_noise=ml_collections.ConfigDict(dict(colour=0.0, count=0.0, relation=0.0))))
    config.optimizer = config_lib.optimizer_config(
        learning_rate=1e-3, schedule="warmup_cosine", warmup_steps=200, decay_steps=num_steps)
    config.evaluation.num_prompts = 0
    return config
