"""The FLUX path at toy size: FLUX.1-dev's architecture family (hidden 64, 2+2 blocks, T5 and
CLIP text encoders, the FLUX autoencoder, CLIP-based rewards), random weights written by the
test fixture. Runs anywhere in seconds.

  python -m g2rpo_jax.main --config=configs/flux_tiny.py --workdir=/tmp/flux_tiny   # describe

The whole path on the tiny checkpoints (docs/flux.md):

  python -m g2rpo_jax.testing.flux_fixture DIR          # prints the --config.* flags below
  python -m g2rpo_jax.preprocess --config=configs/flux_tiny.py FLAGS
  python -m g2rpo_jax.main --config=configs/flux_tiny.py --config.mode=train --workdir=W FLAGS
  python -m g2rpo_jax.evaluate --config=configs/flux_tiny.py --checkpoint=W/checkpoints FLAGS

with FLAGS = --config.model.checkpoint=DIR/flux --config.data.prompts_file=DIR/prompts/train.txt
--config.data.eval_prompts_file=DIR/prompts/eval.txt --config.data.data_dir=DIR/tfds
--config.reward.root=DIR/rewards.
"""


from g2rpo_jax.run import config_lib
from g2rpo_jax.testing import flux_fixture


def get_config(algorithm: str = "g2rpo"):
    config = config_lib.flux_config(algorithm)
    # describe by default (the tiny transformer's parameters, shardings and forward time);
    # --config.mode=train runs RL, which needs the fixture's checkpoints.
    config.mode = "describe"
    config.model = config_lib.flux_model_config(**flux_fixture.TRANSFORMER)
    config.describe.image_tokens = 64
    config.describe.text_tokens = 16

    config.autoencoder.dtype = "float32"
    config.text.dtype = "float32"
    config.text.t5_max_length = 16
    config.image.height = config.image.width = flux_fixture.IMAGE_SIZE
    config.data.max_prompts = 0
    config.data.storage_dtype = "float32"
    config.data.chunk_size = 8

    # 6 steps, groups of 4, branches at steps 0 and 1; Λ = {1, 2, 3} as the paper's.
    config.sampling.num_steps = 6
    config.algorithm.group_size = 4
    if config.algorithm.rollout == "singular":
        config.algorithm.branch_steps = (0, 1)
    config.optimizer.learning_rate = 1e-4
    config.policy_update.steps_per_update = 0   # one accumulated step per iteration
    config.train = config_lib.train_config(
        num_iterations=2, prompts_per_iteration=8, eval_every=1, checkpoint_every=0,
        images_in_grid=8)

    # The fixture's reward checkpoints (flux_fixture.write_tiny_rewards) under reward.root;
    # architectures are read from the files (config "" = inferred).
    config.reward.batch_size = 0
    config.reward.models.hps.path = "hps.safetensors"
    config.reward.models.hps.tokenizer = "tokenizer"
    config.reward.models.hps.config = ""
    config.reward.models.clip_score.path = "clip_score"
    config.reward.models.clip_score.tokenizer = "tokenizer"
    config.reward.models.pickscore.path = "pickscore"
    return config
