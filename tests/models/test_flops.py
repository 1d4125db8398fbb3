"""models.flops against a count written out matmul by matmul for a tiny FLUX (its agreement
with XLA's own count on larger shapes is in tests/test_tpu_aot.py)."""

import dataclasses

import pytest

from g2rpo_jax.models import flops, flux

CFG = flux.FluxConfig(num_layers=1, num_single_layers=1, num_attention_heads=2,
                      attention_head_dim=2, axes_dims_rope=(2,), in_channels=3,
                      joint_attention_dim=5, pooled_projection_dim=6)
IMAGE, TEXT = 3, 2


def _by_hand() -> int:
    """Multiply-adds (m·n·k) of one sample, layer by layer: D = 4, MLP 16, S = 5."""
    d, m, s, heads, hd = 4, 16, IMAGE + TEXT, 2, 2
    double = sum([
        2 * d * 6 * d,                              # img_mod, txt_mod (one vector each)
        IMAGE * 4 * d * d + TEXT * 4 * d * d,       # q, k, v, out of each stream
        IMAGE * 2 * d * m + TEXT * 2 * d * m,       # fc1, fc2 of each stream
        heads * (s * s * hd + s * s * hd),          # Q·Kᵀ and P·V over the joint sequence
    ])
    single = sum([
        d * 3 * d,                                  # mod
        s * 3 * d * d + s * d * d,                  # q, k, v; out_attn
        s * d * m + s * m * d,                      # mlp_in; out_mlp
        heads * 2 * s * s * hd,                     # attention
    ])
    embed = sum([
        IMAGE * 3 * d, TEXT * 5 * d,                # img_in, txt_in
        256 * d + d * d, 256 * d + d * d,           # time_in, guidance_in
        6 * d + d * d,                              # vector_in (pooled text)
        d * 2 * d, IMAGE * d * 3,                   # norm_out's modulation, proj_out
    ])
    return double + single + embed


def test_forward_matches_the_hand_count():
    assert _by_hand() == 4824
    assert flops.flux_forward_flops(CFG, IMAGE, TEXT) == 2 * 4824
    assert flops.flux_forward_flops(CFG, IMAGE, TEXT, batch=3) == 3 * 2 * 4824


def test_without_guidance_the_guidance_embedder_is_not_counted():
    no_guidance = dataclasses.replace(CFG, guidance_embeds=False)
    d = 4
    assert flops.flux_forward_flops(no_guidance, IMAGE, TEXT) == 2 * (4824 - 256 * d - d * d)


def test_train_is_three_forwards():
    assert flops.flux_train_flops(CFG, IMAGE, TEXT, batch=2) == pytest.approx(3 * 2 * 2 * 4824)
