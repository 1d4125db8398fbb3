"""Tiny CLIP checkpoints written by transformers, in the layouts the reward models ship in.

The oracles behind the CLIP and reward tests, and the reward checkpoints of the tiny FLUX
fixture (`flux_fixture`): a byte-level CLIP tokenizer (no download), a random transformers
`CLIPModel`, and the key mapping from transformers' layout to OpenCLIP's (HPS-v2.1, DFN5B).
Needs torch and transformers (the `[test]` extra).
"""

import numpy as np

from g2rpo_jax.models import clip_text

# The byte-level tokenizer's special ids: 256 byte symbols, the same with "</w>", then these.
BOS_ID, EOS_ID = 512, 513
VOCAB_SIZE = 514


def byte_level_tokenizer():
    """A CLIP tokenizer with only the byte symbols (no merges): ids 0..513, 513 = end token.
    Every string tokenizes (one token per byte), so any prompt works with the tiny models."""
    from transformers import CLIPTokenizer

    symbols = list(clip_text._bytes_to_unicode().values())
    vocab = symbols + [s + "</w>" for s in symbols] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={t: i for i, t in enumerate(vocab)}, merges=[])


def text_config(**overrides) -> dict:
    """A tiny CLIP text tower (hidden 32, 2 layers) over the byte-level tokenizer's ids."""
    config = dict(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=77,
                  eos_token_id=EOS_ID, bos_token_id=BOS_ID, pad_token_id=EOS_ID,
                  hidden_act="gelu")
    config.update(overrides)
    return config


def randomize(model, seed: int, scale: float = 0.1):
    """Perturbs every parameter (so zero biases and unit norms are exercised too); eval mode."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model.eval()


def tiny_clip(projection_dim: int, seed: int, text: dict | None = None,
              vision: dict | None = None):
    """A random transformers CLIPModel: the text tower above, a 224px ViT with 32px patches
    (7×7 tokens, so the rewards' real preprocessing sizes apply unchanged); `text` / `vision`
    override their config fields."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(
        text_config=text_config(**(text or {})),
        vision_config=dict(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, image_size=224, patch_size=32,
                                hidden_act="gelu"), **(vision or {})),
        projection_dim=projection_dim)
    torch.manual_seed(seed)
    return randomize(CLIPModel(cfg), seed)


def hf_to_open_clip(sd) -> dict[str, np.ndarray]:
    """The documented mapping transformers CLIPModel → OpenCLIP state dict (numpy):

    text_model.embeddings.token_embedding.weight    → token_embedding.weight
    text_model.embeddings.position_embedding.weight → positional_embedding
    text_model.encoder.layers.N.{layer_norm1,layer_norm2} → transformer.resblocks.N.{ln_1,ln_2}
    ....self_attn.{q,k,v}_proj.{weight,bias}        → ....attn.in_proj_{weight,bias} (rows q;k;v)
    ....self_attn.out_proj                          → ....attn.out_proj
    ....mlp.fc1 / mlp.fc2                           → ....mlp.c_fc / mlp.c_proj
    text_model.final_layer_norm                     → ln_final
    text_projection.weight [E, D]                   → text_projection [D, E] (transposed)
    vision_model.embeddings.{patch_embedding.weight, class_embedding, position_embedding.weight}
                                 → visual.{conv1.weight, class_embedding, positional_embedding}
    vision_model.{pre_layrnorm, post_layernorm}     → visual.{ln_pre, ln_post}
    vision_model.encoder.layers.N...                → visual.transformer.resblocks.N... (as text)
    visual_projection.weight [E, D]                 → visual.proj [D, E]; logit_scale as is.
    """
    sd = {k: v.detach().numpy() for k, v in sd.items() if not k.endswith("position_ids")}
    out = {
        "token_embedding.weight": sd["text_model.embeddings.token_embedding.weight"],
        "positional_embedding": sd["text_model.embeddings.position_embedding.weight"],
        "ln_final.weight": sd["text_model.final_layer_norm.weight"],
        "ln_final.bias": sd["text_model.final_layer_norm.bias"],
        "text_projection": sd["text_projection.weight"].T,
        "visual.conv1.weight": sd["vision_model.embeddings.patch_embedding.weight"],
        "visual.class_embedding": sd["vision_model.embeddings.class_embedding"],
        "visual.positional_embedding": sd["vision_model.embeddings.position_embedding.weight"],
        "visual.proj": sd["visual_projection.weight"].T,
        "logit_scale": sd["logit_scale"],
    }
    for ours, theirs in (("ln_pre", "pre_layrnorm"), ("ln_post", "post_layernorm")):
        for leaf in ("weight", "bias"):
            out[f"visual.{ours}.{leaf}"] = sd[f"vision_model.{theirs}.{leaf}"]
    for tower, target in (("text_model", "transformer"), ("vision_model", "visual.transformer")):
        layers = {int(k.split(".")[3]) for k in sd if k.startswith(f"{tower}.encoder.layers.")}
        for i in sorted(layers):
            src, dst = f"{tower}.encoder.layers.{i}", f"{target}.resblocks.{i}"
            for leaf in ("weight", "bias"):
                out[f"{dst}.attn.in_proj_{leaf}"] = np.concatenate(
                    [sd[f"{src}.self_attn.{p}_proj.{leaf}"] for p in "qkv"])
                pairs = (("attn.out_proj", "self_attn.out_proj"), ("ln_1", "layer_norm1"),
                         ("ln_2", "layer_norm2"), ("mlp.c_fc", "mlp.fc1"),
                         ("mlp.c_proj", "mlp.fc2"))
                for a, b in pairs:
                    out[f"{dst}.{a}.{leaf}"] = sd[f"{src}.{b}.{leaf}"]
    return {k: np.asarray(v, order="C") for k, v in out.items()}  # keeps 0-d logit_scale 0-d
