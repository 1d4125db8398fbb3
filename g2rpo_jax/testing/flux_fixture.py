r"""A tiny FLUX.1-dev, reward checkpoints and prompt files, written by the reference libraries.

The whole FLUX path (preprocess → rollout → decode → reward → update → evaluate) runs on these
in the test suite and on any CPU, in the same folder layouts as the real checkpoints:

  write_tiny_flux_dev(DIR)    DIR/ as FLUX.1-dev on the hub (diffusers FluxPipeline layout):
                              model_index.json, scheduler/, transformer/ (FluxTransformer2DModel,
                              guidance embedding, 64 input channels = 16 latent channels packed
                              2×2), vae/ (AutoencoderKL, 16 latent channels, FLUX's scale and
                              shift), text_encoder/ + tokenizer/ (CLIPTextModel, CLIPTokenizer),
                              text_encoder_2/ + tokenizer_2/ (T5EncoderModel, T5TokenizerFast)
  write_tiny_rewards(DIR)     DIR/hps.pt (HPS-v2.1's format: {"state_dict": OpenCLIP keys}) and
                              DIR/hps.safetensors (its conversion, python -m g2rpo_jax.convert),
                              DIR/clip_score/ (an OpenCLIP hub folder, as DFN5B),
                              DIR/pickscore/ (a transformers CLIPModel folder, as PickScore_v1),
                              DIR/tokenizer/ (the CLIP tokenizer HPS and CLIP score use)
  write_prompts(DIR)          DIR/train.txt, DIR/eval.txt (HPDv2 style: one prompt per line)
  write_tiny_setup(DIR)       all three (DIR/flux, DIR/rewards, DIR/prompts); returns the
                              config overrides that point configs/flux_tiny.py at them

Tokenizers are built from local vocabularies (nothing is downloaded): CLIP's is byte-level
(every string tokenizes), T5's is a Unigram vocabulary of letters, digits, punctuation and
common prompt words. Weights are random (seeded). Needs torch, diffusers and transformers (the
`[test]` extra). From the command line:

  python -m g2rpo_jax.testing.flux_fixture DIR     # writes DIR and prints the config flags
"""

import json
import os
import sys

from g2rpo_jax.testing import clip_reference, flux_reference

# The transformer of configs/flux_tiny.py: hidden 64 (4 heads of 16), 2 double + 2 single
# blocks; the text dims are the tiny encoders' (T5 d_model 64, CLIP hidden 32), as FLUX.1's are
# T5-XXL's 4096 and CLIP-L's 768.
TRANSFORMER = dict(num_layers=2, num_single_layers=2, attention_head_dim=16,
                   num_attention_heads=4, joint_attention_dim=64, pooled_projection_dim=32,
                   in_channels=64, guidance_embeds=True, axes_dims_rope=(4, 6, 6))
# T5 v1.1's structure (gated GELU, no bias), tiny. vocab_size comes from the tokenizer.
T5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
          feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
          relative_attention_max_distance=16)
# CLIP-L's text structure, tiny; hidden 32 = the transformer's pooled_projection_dim.
CLIP_TEXT = clip_reference.text_config(hidden_size=32)
# FLUX's autoencoder structure with 2 blocks: factor 2, so 32×32 images ↔ 16×16×16 latents ↔
# 8×8 = 64 tokens of 64 channels.
VAE = dict(block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
           latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
           scaling_factor=0.3611, shift_factor=0.1159,
           down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2)
IMAGE_SIZE = 32

_WORDS = ("a an the of in on with and at by photo painting portrait of cat dog bird horse "
          "city street forest mountain river sunset night red blue green golden old young "
          "woman man child robot castle ship flowers garden sky clouds light style art "
          "detailed digital oil watercolor fantasy cyberpunk landscape").split()
_SUBJECTS = ("a cat", "an old robot", "a red fox", "two horses", "a castle", "a lighthouse",
             "a young woman", "a ship", "a dragon", "a city street", "a bowl of fruit",
             "a mountain lake")
_SCENES = ("at sunset", "in the snow", "under a starry sky", "in a garden", "on the moon",
           "in the rain")
_STYLES = ("oil painting", "digital art, highly detailed", "watercolor", "photograph, 35mm",
           "cyberpunk style", "studio ghibli style")


def _t5_tokenizer():
    """A T5TokenizerFast over a Unigram vocabulary: specials, "▁", single characters (so every
    lowercase word has a segmentation) and whole words (preferred: higher scores)."""
    from transformers import T5TokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789,.-'!?:;()"
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(c, -8.0) for c in chars]
    vocab += [(f"▁{w}", -3.0 - 0.01 * i) for i, w in enumerate(dict.fromkeys(_WORDS))]
    return T5TokenizerFast(vocab=vocab, extra_ids=0)


def _seeded(module, seed: int):
    import torch

    torch.manual_seed(seed)
    return module


def write_tiny_flux_dev(directory: str, seed: int = 0) -> str:
    """Writes a random tiny FLUX.1-dev (every component of the hub repo) to `directory`.

    The pipeline is assembled as diffusers' FluxPipeline and saved with its own
    `save_pretrained`, so the folder is exactly what the real repo's layout is (model_index.json
    names each component's class). Returns `directory`.
    """
    import diffusers
    import torch
    import transformers

    os.makedirs(directory, exist_ok=True)
    # The transformer with non-trivial random weights everywhere (flux_reference's writer).
    transformer = flux_reference.write_diffusers_flux(os.path.join(directory, "transformer"),
                                                      seed, **TRANSFORMER)
    torch.manual_seed(seed + 1)
    vae = diffusers.AutoencoderKL(**VAE).eval()
    torch.manual_seed(seed + 2)
    text_encoder = clip_reference.randomize(
        transformers.CLIPTextModel(transformers.CLIPTextConfig(**CLIP_TEXT)), seed + 2)
    tokenizer_2 = _t5_tokenizer()
    torch.manual_seed(seed + 3)
    text_encoder_2 = transformers.T5EncoderModel(
        transformers.T5Config(vocab_size=len(tokenizer_2), **T5)).eval()
    pipeline = diffusers.FluxPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae, text_encoder=text_encoder, tokenizer=clip_reference.byte_level_tokenizer(),
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipeline.save_pretrained(directory, safe_serialization=True)
    return directory


def write_tiny_rewards(directory: str, seed: int = 0) -> dict[str, str]:
    """Writes tiny reward checkpoints in each reward's published format (see the module doc);
    returns {"hps": safetensors file, "clip_score": folder, "pickscore": folder, "tokenizer":
    folder}."""
    import torch

    from g2rpo_jax.models import torch_checkpoints
    from g2rpo_jax.models.safetensors_io import write_safetensors
    from g2rpo_jax.rewards import clip_rewards

    os.makedirs(directory, exist_ok=True)
    paths = {name: os.path.join(directory, name)
             for name in ("hps.pt", "clip_score", "pickscore", "tokenizer")}
    clip_reference.byte_level_tokenizer().save_pretrained(paths["tokenizer"])
    # Heads of width 64, as every OpenCLIP text tower and ViT-L's image tower: the architecture
    # of a bare state dict is then inferred from its shapes, as for the real HPS file.
    width64 = dict(hidden_size=64, intermediate_size=128, num_attention_heads=1)
    hps = clip_reference.tiny_clip(16, seed, text=width64, vision=width64)
    torch.save({"state_dict": {k: torch.from_numpy(v) for k, v in
                               clip_reference.hf_to_open_clip(hps.state_dict()).items()}},
               paths["hps.pt"])
    # The one-time conversion a user runs (python -m g2rpo_jax.convert; the rewards read
    # safetensors only); a rewritten fixture replaces its earlier conversion.
    hps_file = str(torch_checkpoints.convert_torch_checkpoint(paths["hps.pt"], overwrite=True))
    # DFN5B's hub layout: open_clip_config.json (model and preprocessing) + weights.
    dfn = clip_reference.tiny_clip(16, seed + 1)
    os.makedirs(paths["clip_score"], exist_ok=True)
    write_safetensors(os.path.join(paths["clip_score"], "open_clip_model.safetensors"),
                      clip_reference.hf_to_open_clip(dfn.state_dict()))
    text = clip_reference.text_config()
    with open(os.path.join(paths["clip_score"], "open_clip_config.json"), "w") as f:
        json.dump({"model_cfg": {
            "embed_dim": 16,
            "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 8,
                           "patch_size": 32, "mlp_ratio": 2.0},
            "text_cfg": {"context_length": text["max_position_embeddings"],
                         "vocab_size": text["vocab_size"], "width": 32, "heads": 4, "layers": 2,
                         "mlp_ratio": 2.0}},
            "preprocess_cfg": {"mean": list(clip_rewards.OPENAI_CLIP_MEAN),
                               "std": list(clip_rewards.OPENAI_CLIP_STD),
                               "interpolation": "bicubic", "resize_mode": "squash"}}, f)
    # PickScore_v1's: a transformers CLIPModel folder with its tokenizer.
    pick = clip_reference.tiny_clip(16, seed + 2)
    pick.save_pretrained(paths["pickscore"], safe_serialization=True)
    clip_reference.byte_level_tokenizer().save_pretrained(paths["pickscore"])
    return {"hps": hps_file, "clip_score": paths["clip_score"],
            "pickscore": paths["pickscore"], "tokenizer": paths["tokenizer"]}


def prompts(count: int, offset: int = 0) -> list[str]:
    """`count` distinct HPDv2-like prompts (subject, scene, style), deterministic."""
    out = []
    for i in range(offset, offset + count):
        subject = _SUBJECTS[i % len(_SUBJECTS)]
        scene = _SCENES[(i // len(_SUBJECTS)) % len(_SCENES)]
        style = _STYLES[(i // (len(_SUBJECTS) * len(_SCENES)) + i) % len(_STYLES)]
        out.append(f"{subject} {scene}, {style}")
    return out


def write_prompts(directory: str, train: int = 24, held_out: int = 8) -> dict[str, str]:
    """DIR/train.txt and DIR/eval.txt, disjoint; returns {"train": path, "eval": path}."""
    os.makedirs(directory, exist_ok=True)
    paths = {"train": os.path.join(directory, "train.txt"),
             "eval": os.path.join(directory, "eval.txt")}
    for name, lines in (("train", prompts(train)), ("eval", prompts(held_out, offset=train))):
        with open(paths[name], "w") as f:
            f.write("\n".join(lines) + "\n")
    return paths


def config_overrides(root: str) -> dict[str, str]:
    """configs/flux_tiny.py's fields that point it at a `write_tiny_setup(root)` folder."""
    return {"model.checkpoint": os.path.join(root, "flux"),
            "data.prompts_file": os.path.join(root, "prompts", "train.txt"),
            "data.eval_prompts_file": os.path.join(root, "prompts", "eval.txt"),
            "data.data_dir": os.path.join(root, "tfds"),
            "reward.root": os.path.join(root, "rewards")}


def write_tiny_setup(root: str, seed: int = 0) -> dict[str, str]:
    """Everything the tiny FLUX path needs under `root`; returns `config_overrides(root)`."""
    write_tiny_flux_dev(os.path.join(root, "flux"), seed)
    write_tiny_rewards(os.path.join(root, "rewards"), seed)
    write_prompts(os.path.join(root, "prompts"))
    return config_overrides(root)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m g2rpo_jax.testing.flux_fixture DIR", file=sys.stderr)
        return 2
    root = os.path.abspath(argv[1])
    overrides = write_tiny_setup(root)
    flags = " ".join(f"--config.{k}={v}" for k, v in overrides.items())
    print(f"Wrote the tiny FLUX.1-dev, rewards and prompts to {root}. Use them with\n"
          f"  --config=configs/flux_tiny.py {flags}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
