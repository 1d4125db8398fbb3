"""g2rpo-jax: G²RPO (Granular-GRPO) for flow-matching text-to-image models in JAX/Flax."""

import os

# Host rewards (the embedded world's verifier) run as `jax.pure_callback` inside the sharded
# rollout. On the CPU backend every emulated device waits in a collective rendezvous while the
# callback scores the whole batch, and XLA aborts the process after its default terminate
# timeout (about 40 s; seen under load with 8 emulated devices). Raise it before the backend is
# created; an explicit setting in XLA_FLAGS wins.
_TIMEOUT_FLAG = "--xla_cpu_collective_call_terminate_timeout_seconds"
if _TIMEOUT_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_TIMEOUT_FLAG}=3600".strip()
