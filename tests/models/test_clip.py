"""CLIP in JAX (models.clip, loaded by models.clip_weights; models.clip_text): parity with
transformers and OpenCLIP, both checkpoint layouts, errors, sizes.

OpenCLIP (open_clip_torch 3.3.0) is a test-only reference, installed by the README's test
command without its dependencies (`pip install --no-deps open_clip_torch==3.3.0`), because its
torchvision dependency from PyPI is a CUDA build that cannot load next to the CPU torch and then
breaks every `transformers` model import. open_clip's model code needs torchvision only for
names it imports at module level (image transforms, FrozenBatchNorm2d), so `_import_open_clip`
imports it with a placeholder torchvision that is removed right after. The OpenCLIP layout is
also checked by writing it from a transformers model with the key mapping `hf_to_open_clip`
(g2rpo_jax/testing/clip_reference.py).
"""

import contextlib
import dataclasses
import functools
import json
import sys
import types

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from g2rpo_jax import convert, parallel
from g2rpo_jax.models import clip, clip_text, clip_weights, weights
from g2rpo_jax.models.safetensors_io import write_safetensors
from g2rpo_jax.testing.clip_reference import byte_level_tokenizer, hf_to_open_clip, randomize

TEXT = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=16)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=8)
TOL = 1e-4


# ---------------------------------------------------------------------------------------------
# Reference models.


def tiny_hf_clip(eos_token_id: int, text_act: str, vision_act: str, seed: int, **overrides):
    from transformers import CLIPConfig, CLIPModel

    cfg = CLIPConfig(text_config=dict(TEXT, eos_token_id=eos_token_id, hidden_act=text_act),
                     vision_config=dict(VISION, hidden_act=vision_act), projection_dim=16,
                     **overrides)
    torch.manual_seed(seed)
    return randomize(CLIPModel(cfg), seed)


@contextlib.contextmanager
def _placeholder_torchvision():
    """Placeholder torchvision modules whose every attribute is a dummy class (see the module
    docstring), removed again on exit."""

    class _Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return cls

    class _Dummy(metaclass=_Meta):
        def __init__(self, *args, **kwargs):
            pass

    def module(name):
        mod = types.ModuleType(name)

        def getattr_(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Meta(attr, (_Dummy,), {})

        mod.__getattr__ = getattr_
        return mod

    names = ["torchvision", "torchvision.ops", "torchvision.ops.misc", "torchvision.transforms",
             "torchvision.transforms.functional"]
    if any(n in sys.modules for n in names):  # a real torchvision is already imported
        yield
        return
    mods = {n: module(n) for n in names}
    for name, mod in mods.items():
        if "." in name:
            parent, child = name.rsplit(".", 1)
            setattr(mods[parent], child, mod)
    sys.modules.update(mods)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def _import_open_clip():
    try:
        import open_clip  # noqa: F401  (a full install whose torchvision matches torch)

        return sys.modules["open_clip"]
    except ImportError:  # not installed, or installed without torchvision
        broken = ("open_clip",)
    except Exception:  # noqa: BLE001 (a CUDA torchvision next to CPU torch fails differently)
        broken = ("open_clip", "torchvision")
    for name in [n for n in sys.modules if n.split(".")[0] in broken]:
        del sys.modules[name]  # half-imported modules would shadow the next attempt
    # Everything transformers checks or imports eagerly must be in place before the placeholder.
    import transformers  # noqa: F401
    import transformers.modeling_outputs  # noqa: F401

    try:
        with _placeholder_torchvision():
            import open_clip
    except ImportError as e:
        raise ImportError("The OpenCLIP parity tests need open_clip_torch: run the README's test "
                          "command (pip install --no-deps open_clip_torch==3.3.0).") from e
    return open_clip


open_clip = _import_open_clip()


# ---------------------------------------------------------------------------------------------
# Helpers.


def _inputs(eos: int, seed: int = 0, batch: int = 3, length: int = 12, image: int = 32):
    """Token ids with the end token `eos` at different positions, larger ids elsewhere only when
    eos < 99 (so "first eos" and "argmax" pooling pick different tokens), and pixels."""
    gen = torch.Generator().manual_seed(seed)
    low = eos + 1 if eos < 90 else 3
    ids = torch.randint(low, 99, (batch, length), generator=gen)
    for b, pos in enumerate([5, length - 1, 2][:batch]):
        ids[b, pos] = eos
    pixels = torch.randn(2, 3, image, image, generator=gen)
    return ids, pixels


def _nhwc(pixels: torch.Tensor) -> np.ndarray:
    return pixels.permute(0, 2, 3, 1).numpy()


_RUNNERS = {}  # one compiled forward per model structure, shared by the tests


def _jax_outputs(model: clip.CLIP, ids, pixels) -> dict[str, np.ndarray]:
    graphdef, state = nnx.split(model)
    if graphdef not in _RUNNERS:
        _RUNNERS[graphdef] = jax.jit(functools.partial(_forward, graphdef))
    return jax.tree.map(np.asarray, _RUNNERS[graphdef](state, np.asarray(ids), _nhwc(pixels)))


def _forward(graphdef, state, ids, pixels):
    """Every output of the model, in one jitted function."""
    m = nnx.merge(graphdef, state)
    out = {}
    if m.text_model is not None:
        out["text_hidden"], out["text_pooled"] = m.text_model(ids)
        if m.text_projection is not None:
            out["text_embeds"] = m.encode_text(ids)
    if m.vision_model is not None:
        out["vision_hidden"], out["vision_pooled"] = m.vision_model(pixels)
        if m.visual_projection is not None:
            out["image_embeds"] = m.encode_image(pixels)
    if m.logit_scale is not None:
        out["logits_per_image"] = m(ids, pixels)
    return out


def _hf_outputs(model, ids, pixels) -> dict[str, np.ndarray]:
    with torch.no_grad():
        text = model.text_model(input_ids=ids)
        vision = model.vision_model(pixel_values=pixels)
        return {
            "text_hidden": text.last_hidden_state.numpy(),
            "text_pooled": text.pooler_output.numpy(),
            "text_embeds": model.text_projection(text.pooler_output).numpy(),
            "vision_hidden": vision.last_hidden_state.numpy(),
            "vision_pooled": vision.pooler_output.numpy(),
            "image_embeds": model.visual_projection(vision.pooler_output).numpy(),
            "logits_per_image": model(input_ids=ids, pixel_values=pixels).logits_per_image.numpy(),
        }


def _compare(name: str, got: dict, expected: dict, tol: float = TOL) -> None:
    for key, value in expected.items():
        err = float(np.abs(got[key] - value).max())
        print(f"{name} {key}: max abs err {err:.2e}")
        assert got[key].shape == value.shape, key
        assert err <= tol, (key, err)


# ---------------------------------------------------------------------------------------------
# transformers layout.

# (text eos_token_id, text act, vision act): the legacy id 2 pools at argmax, others at first eos.
HF_VARIANTS = {"legacy_eos": (2, "quick_gelu", "gelu"), "eos_id": (50, "gelu", "quick_gelu")}


@pytest.fixture(scope="module")
def hf_checkpoints(tmp_path_factory):
    out = {}
    for seed, (name, (eos, text_act, vision_act)) in enumerate(HF_VARIANTS.items()):
        model = tiny_hf_clip(eos, text_act, vision_act, seed)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(directory, safe_serialization=True)
        out[name] = (directory, model)
    return out


@pytest.mark.parametrize("variant", list(HF_VARIANTS))
def test_transformers_clip_parity(hf_checkpoints, variant):
    directory, torch_model = hf_checkpoints[variant]
    model = clip_weights.from_pretrained(directory)
    eos, text_act, vision_act = HF_VARIANTS[variant]
    assert model.cfg.text.pool == ("argmax" if eos == 2 else "eos")
    assert (model.cfg.text.act, model.cfg.vision.act) == (text_act, vision_act)
    ids, pixels = _inputs(99 if eos == 2 else eos)
    if eos == 2:
        ids[1, 3] = 99  # two end tokens: argmax takes the first
    _compare(f"transformers {variant}", _jax_outputs(model, ids, pixels),
             _hf_outputs(torch_model, ids, pixels))


def test_clip_text_model_for_flux(tmp_path):
    """FLUX.1-dev's text_encoder/: a transformers CLIPTextModel, loaded by clip_text."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    torch.manual_seed(3)
    cfg = CLIPTextConfig(**TEXT, eos_token_id=2, projection_dim=16)
    text_model = randomize(CLIPTextModel(cfg), 3)
    text_model.save_pretrained(tmp_path / "flux" / "text_encoder", safe_serialization=True)
    ids, _ = _inputs(99, seed=4)
    with torch.no_grad():
        ref = text_model(input_ids=ids)
    # transformers 5 saves CLIPTextModel without the "text_model." prefix; FLUX.1-dev's file
    # (transformers 4) has it, and old files also keep the position_ids buffer.
    v4 = tmp_path / "v4" / "text_encoder"
    v4.mkdir(parents=True)
    tensors = {f"text_model.{k}": v.numpy() for k, v in text_model.state_dict().items()}
    tensors["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
    write_safetensors(v4 / "model.safetensors", tensors)
    (v4 / "config.json").write_text((tmp_path / "flux" / "text_encoder" / "config.json").read_text())
    encode = nnx.jit(lambda encoder, ids: encoder(ids))
    for path in (tmp_path / "flux", tmp_path / "flux" / "text_encoder", tmp_path / "v4"):
        encoder = clip_text.from_pretrained(path)
        assert isinstance(encoder, clip.TextTransformer)
        hidden, pooled = encode(encoder, ids.numpy())
        _compare("CLIPTextModel", {"hidden": np.asarray(hidden), "pooled": np.asarray(pooled)},
                 {"hidden": ref.last_hidden_state.numpy(), "pooled": ref.pooler_output.numpy()})

    projected = randomize(CLIPTextModelWithProjection(cfg), 5)
    projected.save_pretrained(tmp_path / "with_projection", safe_serialization=True)
    model = clip_weights.from_pretrained(tmp_path / "with_projection")
    assert model.cfg.vision is None and model.cfg.projection_dim == 16
    with torch.no_grad():
        expected = projected(input_ids=ids).text_embeds.numpy()
    _compare("CLIPTextModelWithProjection", {"text_embeds": np.asarray(model.encode_text(ids.numpy()))},
             {"text_embeds": expected})


def test_one_tower_from_a_full_checkpoint_in_bfloat16(hf_checkpoints):
    """The image tower alone (text tensors and logit_scale ignored), computing in bfloat16."""
    directory, torch_model = hf_checkpoints["legacy_eos"]
    model = clip_weights.from_pretrained(directory, towers=("vision",), dtype="bfloat16")
    assert model.text_model is None and model.logit_scale is None
    ids, pixels = _inputs(99)
    got = _jax_outputs(model, ids, pixels)["image_embeds"]
    assert got.dtype == jnp.bfloat16
    expected = _hf_outputs(torch_model, ids, pixels)["image_embeds"]
    rel = np.abs(got.astype(np.float32) - expected).max() / np.abs(expected).max()
    print(f"vision tower only, bfloat16: max rel err {rel:.2e}")
    assert rel < 5e-2


def test_scan_and_unrolled_layers_agree(hf_checkpoints):
    directory, _ = hf_checkpoints["eos_id"]
    ids, pixels = _inputs(50)
    scanned = _jax_outputs(clip_weights.from_pretrained(directory), ids, pixels)
    unrolled = _jax_outputs(clip_weights.from_pretrained(directory, scan_layers=False), ids, pixels)
    for key in scanned:
        np.testing.assert_allclose(unrolled[key], scanned[key], rtol=1e-5, atol=1e-5)


def test_sharded_load_matches_unsharded(hf_checkpoints):
    directory, _ = hf_checkpoints["legacy_eos"]
    ids, pixels = _inputs(99, batch=3)
    expected = _jax_outputs(clip_weights.from_pretrained(directory), ids, pixels)
    mesh = parallel.make_mesh((1, 2, 4))
    model = clip_weights.from_pretrained(directory, mesh=mesh)
    kernel = model.text_model.blocks.attn.q.kernel[...]
    # [layers, embed, heads]: embed over fsdp, heads over tensor.
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    assert kernel.addressable_shards[0].data.size == kernel.size // 8
    with jax.set_mesh(mesh):
        got = _jax_outputs(model, ids, pixels)
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], atol=1e-5)


# ---------------------------------------------------------------------------------------------
# OpenCLIP layout.

OPEN_CLIP_TINY = dict(embed_dim=16,
                      vision_cfg=dict(image_size=32, layers=2, width=32, head_width=8, patch_size=8),
                      text_cfg=dict(context_length=16, vocab_size=100, width=32, heads=4, layers=2))


def _open_clip_outputs(model, ids, pixels) -> dict[str, np.ndarray]:
    with torch.no_grad():
        return {"text_embeds": model.encode_text(ids).numpy(),
                "image_embeds": model.encode_image(pixels).numpy(),
                "logits_per_image": model.get_logits(pixels, ids)[0].numpy()}


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_open_clip_parity(tmp_path, quick_gelu):
    torch.manual_seed(7)
    reference = randomize(open_clip.CLIP(**OPEN_CLIP_TINY, quick_gelu=quick_gelu), 7)
    state = {k: v.detach().contiguous().numpy() for k, v in reference.state_dict().items()}
    write_safetensors(tmp_path / "tiny.safetensors", state)
    model_cfg = dict(OPEN_CLIP_TINY, quick_gelu=quick_gelu)
    model = clip_weights.from_pretrained(tmp_path / "tiny.safetensors", model_cfg)
    ids, pixels = _inputs(99, seed=8, length=16)
    ids[0, 9] = 0  # OpenCLIP pads with 0 after the end token
    expected = _open_clip_outputs(reference, ids, pixels)
    _compare(f"open_clip quick_gelu={quick_gelu}", _jax_outputs(model, ids, pixels), expected)

    # HPS-v2.1 ships a torch pickle {"state_dict": ...}: converted once beside it, then read
    # given either name. An OpenCLIP hub folder has open_clip_config.json +
    # open_clip_model.safetensors. All: the same weights.
    torch.save({"state_dict": reference.state_dict(), "epoch": 1}, tmp_path / "hps_like.pt")
    assert convert.main([str(tmp_path / "hps_like.pt")]) == 0
    hub = tmp_path / "hub"
    hub.mkdir()
    write_safetensors(hub / "open_clip_model.safetensors", state)
    (hub / "open_clip_config.json").write_text(json.dumps({"model_cfg": model_cfg}))
    for other in (clip_weights.from_pretrained(tmp_path / "hps_like.pt", model_cfg),
                  clip_weights.from_pretrained(tmp_path / "hps_like.safetensors", model_cfg),
                  clip_weights.from_pretrained(hub)):
        assert other.cfg == model.cfg
        for a, b in zip(jax.tree.leaves(nnx.state(other)), jax.tree.leaves(nnx.state(model)),
                        strict=True):
            np.testing.assert_array_equal(a, b)

    # Shapes give everything but the activation and the head width.
    inferred = clip_weights.config_from_open_clip_checkpoint(
        weights.SafetensorsCheckpoint(tmp_path / "tiny.safetensors"), quick_gelu=quick_gelu,
        vision_head_width=8, text_head_width=8)
    assert inferred == clip.config_from_open_clip(model_cfg)


def test_open_clip_layout_from_transformers_keys(hf_checkpoints, tmp_path):
    """The OpenCLIP layout written from a transformers model by `hf_to_open_clip` loads to the
    same model (the test that runs without open_clip)."""
    directory, torch_model = hf_checkpoints["legacy_eos"]
    write_safetensors(tmp_path / "open_clip.safetensors", hf_to_open_clip(torch_model.state_dict()))
    cfg = clip_weights.config_from_transformers(json.loads((directory / "config.json").read_text()))
    model = clip_weights.from_pretrained(tmp_path / "open_clip.safetensors", cfg)
    ids, pixels = _inputs(99, seed=12)
    _compare("OpenCLIP layout from transformers", _jax_outputs(model, ids, pixels),
             _hf_outputs(torch_model, ids, pixels))


# ---------------------------------------------------------------------------------------------
# Errors.


def test_loading_errors_name_keys_and_shapes(hf_checkpoints, tmp_path):
    directory, torch_model = hf_checkpoints["legacy_eos"]
    cfg = clip_weights.config_from_transformers(json.loads((directory / "config.json").read_text()))
    wrong = dataclasses.replace(cfg, text=dataclasses.replace(cfg.text, layers=3, vocab_size=120))
    with pytest.raises(weights.CheckpointMismatchError) as info:
        clip_weights.from_pretrained(directory, wrong)
    message = str(info.value)
    print(message)
    assert ("'text_model.embeddings.token_embedding.weight' has shape (100, 32), but "
            "text_model.token_embedding needs (120, 32)") in message
    assert ("missing tensor 'text_model.encoder.layers.2.self_attn.q_proj.weight' (for "
            "text_model.blocks.attn.q.kernel, expected shape (32, 32))") in message

    tensors = hf_to_open_clip(torch_model.state_dict())
    del tensors["visual.proj"]
    tensors["ln_final.weight"] = np.zeros(7, np.float32)
    write_safetensors(tmp_path / "broken.safetensors", tensors)
    with pytest.raises(weights.CheckpointMismatchError) as info:
        clip_weights.from_pretrained(tmp_path / "broken.safetensors", cfg)
    message = str(info.value)
    print(message)
    assert "missing tensor 'visual.proj' (for visual_projection.kernel, expected shape (32, 16))" \
        in message
    assert "'ln_final.weight' has shape (7,), but text_model.final_ln.norm.scale needs (32,)" \
        in message

    write_safetensors(tmp_path / "other.safetensors", {"foo.weight": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match="not a CLIP checkpoint"):
        clip_weights.from_pretrained(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="ViT-H-14-quickgelu"):
        clip_weights.from_pretrained(tmp_path / "broken.safetensors", "ViT-Z-99")
    with pytest.raises(FileNotFoundError, match="No CLIP checkpoint"):
        clip_weights.from_pretrained(tmp_path / "absent")
    text_only = {k: v for k, v in hf_to_open_clip(torch_model.state_dict()).items()
                 if not k.startswith("visual.") and k != "logit_scale"}
    write_safetensors(tmp_path / "text_only.safetensors", text_only)
    with pytest.raises(ValueError, match="has no \\['vision'\\] tower"):
        clip_weights.from_pretrained(tmp_path / "text_only.safetensors",
                                     dataclasses.replace(cfg, vision=None, logit_scale=False),
                                     towers=("vision",))
    with pytest.raises(ValueError, match="no text tower"):
        model = clip_weights.from_pretrained(directory, towers=("vision",))
        model.encode_text(np.zeros((1, 4), np.int32))


# ---------------------------------------------------------------------------------------------
# Tokenizers and sizes.


def test_tokenize_layout(tmp_path):
    byte_level_tokenizer().save_pretrained(tmp_path / "tokenizer")
    tokenizer = clip_text.load_tokenizer(tmp_path)  # finds tokenizer/ inside
    ids = clip_text.tokenize(tokenizer, ["a cat", "x" * 200])
    assert ids.shape == (2, 77) and ids.dtype == np.int32
    bos, eos = 512, 513
    # "a cat" → <s> a</w> c a t</w> </s>, then padding with the end token.
    assert ids[0, :6].tolist() == [bos, symbol_id("a", True), symbol_id("c"), symbol_id("a"),
                                   symbol_id("t", True), eos]
    assert (ids[0, 6:] == eos).all()
    assert ids[1, 0] == bos and ids[1, -1] == eos  # truncated, the end token kept


def symbol_id(char: str, end_of_word: bool = False) -> int:
    symbols = list(clip_text._bytes_to_unicode().values())
    return symbols.index(char) + (256 if end_of_word else 0)


def test_open_clip_bpe_tokenizer_matches_open_clip():
    from open_clip.tokenizer import default_bpe

    tokenizer = clip_text.load_tokenizer(default_bpe())
    prompts = ["a photo of a cat", "Café   au LAIT, 12 éclairs! 🙂", "",
               "a very long prompt with many words " * 12]
    ours = clip_text.tokenize(tokenizer, prompts)
    reference = open_clip.tokenize(prompts).numpy()
    for row, ref in zip(ours, reference, strict=True):
        end = int(np.argmax(ref))  # OpenCLIP pads with 0, transformers with the end token
        np.testing.assert_array_equal(row[:end + 1], ref[:end + 1])


def test_parameter_counts():
    vit_h = clip.count_params(clip.vit_h_14())
    vit_h_image = clip.count_params(clip.vit_h_14(text=None))
    flux_text = clip.count_params(clip.clip_l14_text())
    vit_l = clip.count_params(clip.config_from_open_clip(clip.OPEN_CLIP_CONFIGS["ViT-L-14-quickgelu"]))
    print(f"OpenCLIP ViT-H-14: {vit_h:,} (image tower + projection + scale {vit_h_image:,}); "
          f"CLIP-L/14 text (FLUX text_encoder): {flux_text:,}; OpenAI ViT-L/14: {vit_l:,}")
    assert vit_h == 986_109_441  # open_clip: 986.11M
    assert flux_text == 123_060_480  # transformers CLIPTextModel(openai/clip-vit-large-patch14)
    assert vit_l == 427_616_513
