"""FLOPs of the FLUX transformer counted from its shapes: the one counter for utilisation (MFU)
and time-at-peak figures (benchmarks/perf/tpu_aot.py and others).

Counted: every matmul, 2·m·n·k FLOPs (one multiply-add = 2), and attention's two batched
matmuls, Q·Kᵀ and P·V (2·S·S_kv·D each, per head summed: 4·S²·D per block for hidden size D).
Not counted: elementwise work (norms, RoPE, softmax, GELU, modulation arithmetic), a few % of
XLA's own count (tests/test_tpu_aot.py). The kernel does not change the count: a flash kernel
does the same matmuls (its backward recomputes the probabilities; not counted either).
"""

from g2rpo_jax.models.flux import FluxConfig

# The backward pass of a matmul is two matmuls of the same size (the input's and the weight's
# gradients): 2× the forward.
BACKWARD_FACTOR = 2.0


def flux_forward_flops(cfg: FluxConfig, image_tokens: int, text_tokens: int,
                       batch: int = 1) -> float:
    """Matmul FLOPs of one forward pass of `batch` samples of `image_tokens` + `text_tokens`.

    Per block every token meets 12·D² weights (double blocks: its own stream's q, k, v, out and
    the 4× MLP; single blocks: q, k, v, the MLP's input and the two output halves) and
    attention costs 2·S²·D multiply-adds (S = text + image tokens, the joint sequence). Per
    sample: the adaLN modulation (12·D² per double block, 3·D² per single, 2·D² at the output),
    the input projections, the output projection and the timestep / guidance (when the
    model has it) / pooled-text embedders.
    """
    d, m = cfg.hidden_size, cfg.mlp_hidden_dim
    s = image_tokens + text_tokens
    blocks = cfg.num_layers + cfg.num_single_layers
    tokens = s * blocks * (4 * d * d + 2 * d * m) + blocks * 2 * s * s * d
    modulation = d * d * (12 * cfg.num_layers + 3 * cfg.num_single_layers + 2)
    # Timestep, optional guidance and pooled-text embedders: an input layer and a d×d layer each.
    embedders = 3 if cfg.guidance_embeds else 2
    embed = (image_tokens * cfg.in_channels * d + text_tokens * cfg.joint_attention_dim * d
             + image_tokens * d * cfg.output_channels
             + ((embedders - 1) * 256 + cfg.pooled_projection_dim) * d + embedders * d * d)
    return 2.0 * batch * (tokens + modulation + embed)


def flux_train_flops(cfg: FluxConfig, image_tokens: int, text_tokens: int,
                     batch: int = 1) -> float:
    """Forward + backward (2× forward) matmul FLOPs; a rematerialised forward is not counted
    (model FLOPs, not hardware FLOPs)."""
    return (1.0 + BACKWARD_FACTOR) * flux_forward_flops(cfg, image_tokens, text_tokens, batch)
