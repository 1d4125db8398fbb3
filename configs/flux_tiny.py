"""A tiny FLUX-architecture transformer (hidden 64, 2+2 blocks) that runs anywhere in seconds.

  python -m g2rpo_jax.main --config=configs/flux_tiny.py --workdir=/tmp/flux_tiny
"""

from g2rpo_jax import config_lib
from g2rpo_jax.rl import algorithms


def get_config(algorithm: str = "g2rpo"):
    config = config_lib.base_config()
    config.algorithm = algorithms.preset(algorithm)
    config.model = config_lib.flux_model_config(
        num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=64, pooled_projection_dim=32, in_channels=16,
        axes_dims_rope=(4, 6, 6), guidance_embeds=True)
    config.describe.image_tokens = 64
    config.describe.text_tokens = 16
    return config
