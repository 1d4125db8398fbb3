"""FLOPs of the FLUX transformer counted from the shapes.

XLA's cost_analysis counts the body of a scanned layer stack once, so it undercounts our
(scanned) model; this counter is independent of how the model is compiled. Counted per sample
with N image and T text tokens, L = N + T, hidden H, MLP width F, as 2·m·n·k per matmul:

  embedders   img_in N·C_in·H, txt_in T·D_txt·H, the timestep / guidance (256 → H → H) and
              pooled (D_y → H → H) MLPs
  double      per stream (image N rows, text T rows): modulation H·6H (one row), qkv H·3H,
              out proj H·H, MLP H·F + F·H; joint attention QKᵀ and PV over L: 2 · L·L·H
  single      modulation H·3H (one row), linear1 H·(3H + F), attention 2 · L·L·H,
              linear2 (H + F)·H, all over L rows
  final       adaLN H·2H (one row), proj_out N·H·C_out

Not counted: normalisations, RoPE, softmax, activations, residual adds and the sampler's
elementwise steps (all O(L·H), under 1 % here). A backward pass is counted as 2 × the forward,
so a training forward + backward is 3 × forward; the optimizer's elementwise update is not
counted.
"""


def forward_flops(cfg, image_tokens: int, text_tokens: int) -> int:
    """FLOPs of one sample's forward pass (see the module docstring for what is counted)."""
    h = cfg.num_attention_heads * cfg.attention_head_dim
    f = int(h * cfg.mlp_ratio)
    n, t = image_tokens, text_tokens
    seq = n + t
    out_channels = cfg.out_channels or cfg.in_channels

    def mm(m, k, n_out):
        return 2 * m * k * n_out

    attention = 2 * mm(seq, h, seq)  # QKᵀ and PV, all heads together
    embed = mm(n, cfg.in_channels, h) + mm(t, cfg.joint_attention_dim, h)
    embed += mm(1, 256, h) + mm(1, h, h)                                   # timestep
    embed += mm(1, cfg.pooled_projection_dim, h) + mm(1, h, h)             # pooled text
    if cfg.guidance_embeds:
        embed += mm(1, 256, h) + mm(1, h, h)
    double = attention
    for rows in (n, t):
        double += mm(1, h, 6 * h) + mm(rows, h, 3 * h) + mm(rows, h, h)
        double += mm(rows, h, f) + mm(rows, f, h)
    single = mm(1, h, 3 * h) + mm(seq, h, 3 * h + f) + attention + mm(seq, h + f, h)
    final = mm(1, h, 2 * h) + mm(n, h, out_channels)
    return embed + cfg.num_layers * double + cfg.num_single_layers * single + final


def train_flops(cfg, image_tokens: int, text_tokens: int, samples: int) -> int:
    """Forward + backward (2 × forward) over `samples` model inputs."""
    return 3 * samples * forward_flops(cfg, image_tokens, text_tokens)
