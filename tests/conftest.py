"""Test set-up: 8 emulated CPU devices, configured before anything else imports jax."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

import g2rpo_jax  # noqa: E402,F401  (sets XLA_FLAGS before the backend starts)

jax.config.update("jax_num_cpu_devices", 8)
# Parity tests compare against float32 references: keep matmuls in full precision.
jax.config.update("jax_default_matmul_precision", "highest")
