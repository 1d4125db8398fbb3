"""g2rpo-jax: G²RPO (Granular-GRPO) for flow-matching text-to-image models in JAX/Flax."""
