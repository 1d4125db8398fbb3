"""FLUX.1-dev (12B): the paper's transformer. `describe` reports its parameters and shardings.

  python -m g2rpo_jax.main --config=configs/flux_dev.py --workdir=/tmp/flux_dev \
      --config.model.checkpoint=/path/to/FLUX.1-dev
Without a checkpoint only shapes are computed (no memory is allocated for the weights).
"""

from g2rpo_jax.rl import algorithms
from g2rpo_jax.run import config_lib


def get_config(algorithm: str = "g2rpo"):
    config = config_lib.base_config()
    config.algorithm = algorithms.preset(algorithm)
    config.model = config_lib.flux_model_config(dtype="bfloat16", param_dtype="float32",
                                                remat_policy="dots_no_batch")
    config.mesh.data = 1
    config.mesh.fsdp = -1
    # A 12B forward pass needs an accelerator; with a checkpoint on a TPU slice set it to True.
    config.describe.forward = False
    return config
