"""Test set-up: 8 emulated CPU devices, configured before anything else imports jax."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Test modules import shared helpers (resume_helpers, test_train's configs) by name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
# One persistent compilation cache for the session (the controller makes it; xdist workers
# inherit the variable): the many short RL runs compile the same programs once.
if "G2RPO_TEST_COMPILATION_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["G2RPO_TEST_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="g2rpo_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["G2RPO_TEST_COMPILATION_CACHE"], True)
jax.config.update("jax_compilation_cache_dir", os.environ["G2RPO_TEST_COMPILATION_CACHE"])
# Parity tests compare against float32 references: keep matmuls in full precision.
jax.config.update("jax_default_matmul_precision", "highest")
