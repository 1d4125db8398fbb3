"""Tiny FLUX checkpoints written by the reference libraries, and their outputs.

These are the oracles our FLUX port is checked against: diffusers builds and saves a tiny
random `FluxTransformer2DModel`; the same weights are also re-packed into Black Forest Labs'
single-file key layout. Needs torch and diffusers (the `[test]` extra).
"""

import os
import types

import numpy as np


def tiny_diffusers_config(**overrides) -> dict:
    """A small FluxTransformer2DModel config (hidden 32) suitable for CPU tests."""
    config = dict(num_layers=2, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                  joint_attention_dim=32, pooled_projection_dim=16, in_channels=16,
                  guidance_embeds=True, axes_dims_rope=(4, 6, 6))
    config.update(overrides)
    return config


def write_diffusers_flux(directory: str, seed: int = 0, **config):
    """Builds a random diffusers FluxTransformer2DModel, `save_pretrained`s it, returns the model."""
    import diffusers
    import torch

    torch.manual_seed(seed)
    model = diffusers.FluxTransformer2DModel(**tiny_diffusers_config(**config)).eval()
    # Random non-zero weights everywhere make the parity check sensitive to every parameter.
    # Scale 0.1 keeps the outputs O(1), like real FLUX velocities; much larger weights turn the
    # timestep embedding's float32 phase rounding (t·1000 rad) into large output differences
    # that say nothing about the port (torch's own float32 exp differs from the exactly
    # rounded one there).
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.1)
    model.save_pretrained(directory)
    return model


def diffusers_to_bfl(state_dict: dict, num_layers: int, num_single_layers: int) -> dict:
    """Re-packs a diffusers FLUX state dict into BFL's `flux1-*.safetensors` layout.

    The inverse of `diffusers.loaders.single_file_utils.convert_flux_transformer_checkpoint_to_
    diffusers` (checked against it in the tests): fused qkv, fused single-block linear1, and the
    final adaLN's (shift, scale) order.
    """
    import torch

    sd, out = state_dict, {}
    for suffix in ("weight", "bias"):
        simple = {
            "img_in": "x_embedder", "txt_in": "context_embedder",
            "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
            "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
            "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
            "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
            "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
            "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
            "final_layer.linear": "proj_out",
        }
        for bfl, diff in simple.items():
            if f"{diff}.{suffix}" in sd:
                out[f"{bfl}.{suffix}"] = sd[f"{diff}.{suffix}"]
        scale, shift = sd[f"norm_out.linear.{suffix}"].chunk(2, dim=0)
        out[f"final_layer.adaLN_modulation.1.{suffix}"] = torch.cat([shift, scale], dim=0)
        for i in range(num_layers):
            p, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
            out[f"{b}.img_mod.lin.{suffix}"] = sd[f"{p}.norm1.linear.{suffix}"]
            out[f"{b}.txt_mod.lin.{suffix}"] = sd[f"{p}.norm1_context.linear.{suffix}"]
            out[f"{b}.img_attn.qkv.{suffix}"] = torch.cat(
                [sd[f"{p}.attn.to_{n}.{suffix}"] for n in "qkv"], dim=0)
            out[f"{b}.txt_attn.qkv.{suffix}"] = torch.cat(
                [sd[f"{p}.attn.add_{n}_proj.{suffix}"] for n in "qkv"], dim=0)
            out[f"{b}.img_attn.proj.{suffix}"] = sd[f"{p}.attn.to_out.0.{suffix}"]
            out[f"{b}.txt_attn.proj.{suffix}"] = sd[f"{p}.attn.to_add_out.{suffix}"]
            out[f"{b}.img_mlp.0.{suffix}"] = sd[f"{p}.ff.net.0.proj.{suffix}"]
            out[f"{b}.img_mlp.2.{suffix}"] = sd[f"{p}.ff.net.2.{suffix}"]
            out[f"{b}.txt_mlp.0.{suffix}"] = sd[f"{p}.ff_context.net.0.proj.{suffix}"]
            out[f"{b}.txt_mlp.2.{suffix}"] = sd[f"{p}.ff_context.net.2.{suffix}"]
        for i in range(num_single_layers):
            p, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
            out[f"{b}.modulation.lin.{suffix}"] = sd[f"{p}.norm.linear.{suffix}"]
            out[f"{b}.linear1.{suffix}"] = torch.cat(
                [sd[f"{p}.attn.to_{n}.{suffix}"] for n in "qkv"] + [sd[f"{p}.proj_mlp.{suffix}"]],
                dim=0)
            out[f"{b}.linear2.{suffix}"] = sd[f"{p}.proj_out.{suffix}"]
    for i in range(num_layers):
        p, b = f"transformer_blocks.{i}", f"double_blocks.{i}"
        for stream, (q, k) in (("img", ("norm_q", "norm_k")), ("txt", ("norm_added_q", "norm_added_k"))):
            out[f"{b}.{stream}_attn.norm.query_norm.scale"] = sd[f"{p}.attn.{q}.weight"]
            out[f"{b}.{stream}_attn.norm.key_norm.scale"] = sd[f"{p}.attn.{k}.weight"]
    for i in range(num_single_layers):
        p, b = f"single_transformer_blocks.{i}", f"single_blocks.{i}"
        out[f"single_blocks.{i}.norm.query_norm.scale"] = sd[f"{p}.attn.norm_q.weight"]
        out[f"single_blocks.{i}.norm.key_norm.scale"] = sd[f"{p}.attn.norm_k.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def diffusers_bfl_converter(hidden_size: int):
    """diffusers' own BFL → diffusers converter, with its hard-coded FLUX width (3072) replaced.

    The converter splits the single blocks' fused linear1 with `inner_dim = 3072`; rebuilding the
    function with another constant lets the reference library convert tiny checkpoints too.
    """
    from diffusers.loaders import single_file_utils

    fn = single_file_utils.convert_flux_transformer_checkpoint_to_diffusers
    consts = tuple(hidden_size if c == 3072 else c for c in fn.__code__.co_consts)
    return types.FunctionType(fn.__code__.replace(co_consts=consts), fn.__globals__)


def write_bfl_flux(path: str, model) -> None:
    """Writes a diffusers model's weights as a BFL single file at `path`."""
    from safetensors.torch import save_file

    cfg = model.config
    bfl = diffusers_to_bfl(model.state_dict(), cfg.num_layers, cfg.num_single_layers)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_file(bfl, path)


def random_inputs(config: dict, batch: int = 2, height: int = 3, width: int = 4,
                  text_len: int = 5, seed: int = 0, guidance: bool = True) -> dict:
    """Random model inputs (numpy, float32) for a diffusers-style config."""
    rng = np.random.default_rng(seed)
    rows, cols = np.meshgrid(np.arange(height), np.arange(width), indexing="ij")
    img_ids = np.stack([np.zeros_like(rows), rows, cols], -1).reshape(-1, 3).astype(np.float32)
    return dict(
        img=rng.normal(size=(batch, height * width, config["in_channels"])).astype(np.float32),
        img_ids=img_ids,
        txt=rng.normal(size=(batch, text_len, config["joint_attention_dim"])).astype(np.float32),
        txt_ids=np.zeros((text_len, 3), np.float32),
        timesteps=rng.uniform(0.05, 1.0, size=(batch,)).astype(np.float32),
        y=rng.normal(size=(batch, config["pooled_projection_dim"])).astype(np.float32),
        guidance=(rng.uniform(1.0, 5.0, size=(batch,)).astype(np.float32) if guidance else None),
    )


def diffusers_forward(model, inputs: dict) -> np.ndarray:
    """The diffusers model's velocity for our input dict."""
    import torch

    t = {k: (torch.from_numpy(v) if v is not None else None) for k, v in inputs.items()}
    with torch.no_grad():
        out = model(hidden_states=t["img"], encoder_hidden_states=t["txt"],
                    pooled_projections=t["y"], timestep=t["timesteps"], img_ids=t["img_ids"],
                    txt_ids=t["txt_ids"], guidance=t["guidance"])
    return out.sample.numpy()
