"""CLIP rewards: preprocessing against the reference pipelines, scoring rules, end-to-end parity
with the references on tiny models, the registry, and the remote reward on a loopback server.

References: torchvision-on-PIL preprocessing is written with PIL + numpy (torchvision resizes a
PIL image with `Image.resize(..., BICUBIC)`, crops at round((H - 224) / 2) and divides by 255;
torchvision itself is not installed, see tests/models/test_clip.py), PickScore's with
transformers' PIL image processor, models with transformers.
"""

import base64
import builtins
import collections
import email.utils
import http.server
import io
import json
import logging
import os
import random
import shutil
import socket
import struct
import threading
import time
import urllib.parse
import uuid

from flax import nnx
import jax
import numpy as np
from PIL import Image
import pytest
import torch

from g2rpo_jax import convert
from g2rpo_jax.models import clip, clip_text, clip_weights, torch_checkpoints
from g2rpo_jax.models.safetensors_io import write_safetensors
from g2rpo_jax.rewards import clip_rewards as cr
from g2rpo_jax.rewards import registry
from g2rpo_jax.testing.clip_reference import byte_level_tokenizer, hf_to_open_clip, tiny_clip

MEAN = np.asarray(cr.OPENAI_CLIP_MEAN, np.float32)
STD = np.asarray(cr.OPENAI_CLIP_STD, np.float32)
# (720, 720): the training resolution; odd sizes exercise the crop rounding and upscaling.
SIZES = [(720, 720), (241, 322), (96, 128)]


def known_image(height: int, width: int, seed: int = 0) -> np.ndarray:
    """A fixed 8-bit test picture: smooth waves, a hard-edged checkerboard, a ramp, noise."""
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    red = 0.5 + 0.5 * np.sin(xx / 7.0) * np.cos(yy / 11.0)
    green = ((xx // 16 + yy // 16) % 2) * 0.8 + 0.1
    blue = np.clip((xx + yy) / (height + width), 0.0, 1.0)
    noise = 0.05 * np.random.default_rng(seed).standard_normal((height, width, 3))
    image = np.stack([red, green, blue], axis=-1) + noise
    return np.round(np.clip(image, 0.0, 1.0) * 255.0).astype(np.uint8)


def reference_pixels(image: np.ndarray, mode: str = "shortest") -> np.ndarray:
    """torchvision's Resize(224, BICUBIC) + CenterCrop(224) (or, mode="squash", Resize((224,
    224))) + ToTensor + Normalize(OpenAI) on a PIL image, as [224, 224, 3]."""
    pil = Image.fromarray(image)
    w, h = pil.size
    if mode == "squash":
        nh, nw = 224, 224
    elif h <= w:
        nh, nw = 224, int(224 * w / h)
    else:
        nh, nw = int(224 * h / w), 224
    resized = pil.resize((nw, nh), Image.BICUBIC)
    top, left = int(round((nh - 224) / 2.0)), int(round((nw - 224) / 2.0))
    cropped = resized.crop((left, top, left + 224, top + 224))
    return (np.asarray(cropped, np.float32) / 255.0 - MEAN) / STD


def _err(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32)).max())


# ---------------------------------------------------------------------------------------------
# Preprocessing.


@pytest.mark.parametrize("shape", SIZES)
def test_pil_resample_is_the_torchvision_pil_pipeline(shape):
    """HPS-v2.1 / aesthetic (shortest side + centre crop) and DFN5B (squash), bit for bit."""
    image = known_image(*shape)
    for spec, mode in ((cr.HPS_PREPROCESS, "shortest"), (cr.CLIP_SCORE_PREPROCESS, "squash")):
        got = np.asarray(cr.preprocess(image[None] / 255.0, spec))[0]
        err = _err(got, reference_pixels(image, mode))
        print(f"{shape} {mode}: max abs err vs torchvision-on-PIL {err:.1e}")
        assert err <= 1e-5  # float rounding of the normalisation only: the 8-bit pixels agree


@pytest.mark.parametrize("shape", [(720, 720), (241, 322)])
def test_pickscore_preprocessing_is_the_transformers_processor(shape):
    from transformers import CLIPImageProcessorPil  # PickScore's (PIL) CLIPImageProcessor

    image = known_image(*shape)
    expected = CLIPImageProcessorPil()(Image.fromarray(image), return_tensors="np")
    expected = np.transpose(expected["pixel_values"][0], (1, 2, 0))
    got = np.asarray(cr.preprocess(image[None] / 255.0, cr.PICKSCORE_PREPROCESS))[0]
    err = _err(got, expected)
    print(f"{shape} PickScore: max abs err vs transformers CLIPImageProcessorPil {err:.1e}")
    assert err <= 1e-5


def test_float_resample_measured_against_references():
    """jax.image.resize's antialiased bicubic (resample="float") against float PIL, torch's
    antialiased bicubic, and the 8-bit references (normalised units; x0.27 for [0, 1] units)."""
    import torch.nn.functional as F

    spec = cr.Preprocess(resample="float")
    for shape in SIZES:
        image = known_image(*shape)
        nh, nw = spec.resized_shape(*shape)
        top, left = spec.crop_offset(nh), spec.crop_offset(nw)
        got = np.asarray(cr.preprocess(image[None] / 255.0, spec))[0]
        float_pil = np.stack([np.asarray(Image.fromarray(image[..., c] / np.float32(255), "F")
                                         .resize((nw, nh), Image.BICUBIC)) for c in range(3)], -1)
        tensor = torch.from_numpy(image).permute(2, 0, 1)[None].float() / 255.0
        torch_aa = F.interpolate(tensor, size=(nh, nw), mode="bicubic", antialias=True,
                                 align_corners=False)[0].permute(1, 2, 0).numpy()
        crop = (slice(top, top + 224), slice(left, left + 224))
        errors = {"float PIL": _err(got, (float_pil[crop] - MEAN) / STD),
                  "torch antialias": _err(got, (torch_aa[crop] - MEAN) / STD)}
        diff = np.abs(got - reference_pixels(image))
        print(f"{shape} float resample: max abs err vs float PIL {errors['float PIL']:.1e}, vs "
              f"torch bicubic antialias {errors['torch antialias']:.1e}; vs 8-bit PIL max "
              f"{diff.max():.3f} mean {diff.mean():.4f}")
        assert max(errors.values()) <= 1e-4
        # 8-bit rounding twice, plus the references' clamping of bicubic overshoot at hard edges
        # (large when upscaling a checkerboard); at the training size it stays about 2/255.
        assert diff.mean() <= 0.01
        if shape == (720, 720):
            assert diff.max() <= 0.03


def test_preprocess_errors():
    with pytest.raises(ValueError, match="resample"):
        cr.Preprocess(resample="lanczos")
    with pytest.raises(ValueError, match="height, width, 3"):
        cr.preprocess(np.zeros((2, 8, 8)))


# ---------------------------------------------------------------------------------------------
# Tiny models, written by the reference libraries (g2rpo_jax/testing/clip_reference.py).


TINY_CONFIG = clip.CLIPConfig(
    text=clip.TextConfig(vocab_size=514, width=32, heads=4, layers=2, mlp_dim=64, act="gelu"),
    vision=clip.VisionConfig(width=32, heads=4, layers=2, mlp_dim=64, patch_size=32, act="gelu"),
    projection_dim=16)
PROMPTS = ["a red cat", "two dogs playing in the snow, photograph"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Checkpoints on disk in each reward's published format, the torch models and images."""
    root = tmp_path_factory.mktemp("rewards")
    byte_level_tokenizer().save_pretrained(root / "tokenizer")
    model = tiny_clip(16, seed=0)
    # HPS-v2.1's format: a torch pickle {"state_dict": OpenCLIP keys}.
    torch.save({"state_dict": {k: torch.from_numpy(v) for k, v in
                               hf_to_open_clip(model.state_dict()).items()}}, root / "hps.pt")
    write_safetensors(root / "dfn5b.safetensors", hf_to_open_clip(model.state_dict()))
    # DFN5B's hub folder: open_clip_config.json (model and preprocessing) + weights, here the
    # PyTorch open_clip_pytorch_model.bin (converted below into the folder).
    (root / "dfn5b").mkdir()
    torch.save({k: torch.from_numpy(v) for k, v in hf_to_open_clip(model.state_dict()).items()},
               root / "dfn5b" / "open_clip_pytorch_model.bin")
    (root / "dfn5b" / "open_clip_config.json").write_text(json.dumps({
        "model_cfg": {"embed_dim": 16,
                      "vision_cfg": {"image_size": 224, "layers": 2, "width": 32, "head_width": 8,
                                     "patch_size": 32, "mlp_ratio": 2.0},
                      "text_cfg": {"context_length": 77, "vocab_size": 514, "width": 32,
                                   "heads": 4, "layers": 2, "mlp_ratio": 2.0}},
        "preprocess_cfg": {"mean": list(cr.OPENAI_CLIP_MEAN), "std": list(cr.OPENAI_CLIP_STD),
                           "interpolation": "bicubic", "resize_mode": "squash"}}))
    # PickScore's: a transformers CLIPModel folder (here with its tokenizer in it).
    model.save_pretrained(root / "pickscore", safe_serialization=True)
    byte_level_tokenizer().save_pretrained(root / "pickscore")
    # The aesthetic predictor: a 768-d CLIP image tower + LAION's MLP state dict (.pth).
    aesthetic_clip = tiny_clip(768, seed=1)
    aesthetic_clip.save_pretrained(root / "clip_l14", safe_serialization=True)
    # ... and as OpenAI publishes ViT-L-14.pt: a TorchScript archive, OpenCLIP key names.
    torch.jit.save(openai_torchscript(hf_to_open_clip(aesthetic_clip.state_dict())),
                   root / "ViT-L-14.pt")
    head = LaionMLP()
    torch.save(head.state_dict(), root / "aesthetic.pth")
    # The one-time conversion a user runs: the rewards read the safetensors, given either path.
    for name in ("hps.pt", "aesthetic.pth", "ViT-L-14.pt", "dfn5b/open_clip_pytorch_model.bin"):
        assert convert.main([str(root / name)]) == 0
    images = np.stack([known_image(241, 322, seed=s) for s in (1, 2)]) / 255.0
    return dict(root=root, model=model, aesthetic_clip=aesthetic_clip, head=head,
                images=images.astype(np.float32))


def openai_torchscript(tensors: dict[str, np.ndarray]) -> torch.jit.ScriptModule:
    """A TorchScript module whose state dict is `tensors` plus the int buffers of OpenAI's
    archives (input_resolution, context_length, vocab_size), as in ViT-L-14.pt."""
    root = torch.nn.Module()
    extras = {"input_resolution": 224, "context_length": 77, "vocab_size": 514}
    for key, value in {**tensors, **extras}.items():
        *path, leaf = key.split(".")
        module = root
        for name in path:
            if name not in module._modules:
                module.add_module(name, torch.nn.Module())
            module = module._modules[name]
        module.register_buffer(leaf, torch.as_tensor(value))
    return torch.jit.script(root)


class LaionMLP(torch.nn.Module):
    """improved-aesthetic-predictor's MLP (its state-dict keys: layers.{0,2,4,6,7})."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(768, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
            torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
            torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
        with torch.no_grad():  # weights large enough that the image changes the score
            for layer in self.layers:
                if isinstance(layer, torch.nn.Linear):
                    layer.weight.normal_(0.0, 3.0 / layer.in_features ** 0.5)
                    layer.bias.normal_(0.0, 0.1)
        self.eval()

    def forward(self, x):
        return self.layers(x)


def _reference_features(model, images: np.ndarray, prompts, mode="shortest", pixels=None):
    """Normalised (image, text) features of the torch model on the reference pipeline."""
    if pixels is None:
        pixels = np.stack([reference_pixels(np.round(im * 255).astype(np.uint8), mode)
                           for im in images])
    tokenizer = byte_level_tokenizer()
    ids = torch.from_numpy(clip_text.tokenize(tokenizer, prompts).astype(np.int64))
    with torch.no_grad():
        image = model.get_image_features(
            pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2)).pooler_output
        text = model.get_text_features(input_ids=ids).pooler_output
    return (torch.nn.functional.normalize(image, dim=-1).numpy(),
            torch.nn.functional.normalize(text, dim=-1).numpy())


# ---------------------------------------------------------------------------------------------
# End to end, against the reference pipelines.


@pytest.mark.parametrize("name", ["hps", "clip_score"])
def test_open_clip_rewards_match_reference(setup, name):
    root = setup["root"]
    if name == "hps":
        reward = registry.get("hps", root / "hps.safetensors", tokenizer=root / "tokenizer",
                              config=TINY_CONFIG)
    else:  # the hub folder: config and preprocessing from its open_clip_config.json
        reward = registry.get("clip_score", root / "dfn5b", tokenizer=root / "tokenizer")
        assert reward.preprocess == cr.CLIP_SCORE_PREPROCESS
    got = np.asarray(reward(setup["images"], PROMPTS))
    image, text = _reference_features(setup["model"], setup["images"], PROMPTS,
                                      "shortest" if name == "hps" else "squash")
    expected = np.sum(image * text, axis=-1)  # HPSv2: diagonal(image @ text.T), no scale
    print(f"{name}: {got} vs reference {expected}: max abs err {_err(got, expected):.1e}")
    assert got.shape == (2,) and got.dtype == np.float32
    assert _err(got, expected) <= 1e-5
    # The image side is one jittable function of (state, images, token ids).
    ids = reward.tokenize(PROMPTS)
    again = jax.jit(reward.apply)(reward.state, setup["images"], ids)
    np.testing.assert_allclose(np.asarray(again), got, atol=1e-6)


def test_pickscore_matches_reference(setup):
    from transformers import CLIPImageProcessorPil

    reward = registry.get("pickscore", setup["root"] / "pickscore")  # tokenizer from the folder
    got = np.asarray(reward(setup["images"], PROMPTS))
    processor = CLIPImageProcessorPil()
    pixels = np.stack([np.transpose(processor(Image.fromarray(np.round(im * 255).astype(np.uint8)),
                                              return_tensors="np")["pixel_values"][0], (1, 2, 0))
                       for im in setup["images"]])
    image, text = _reference_features(setup["model"], setup["images"], PROMPTS, pixels=pixels)
    expected = setup["model"].logit_scale.exp().item() * np.sum(image * text, axis=-1)
    print(f"pickscore: {got} vs reference {expected}: max abs err {_err(got, expected):.1e}")
    assert _err(got, expected) <= 1e-4


@pytest.mark.parametrize("clip_source", ["transformers_folder", "openai_torchscript"])
def test_aesthetic_matches_reference(setup, clip_source):
    """The head from its converted .pth; the CLIP from a transformers folder or from OpenAI's
    TorchScript .pt, converted (OpenCLIP keys; its architecture given, as shapes cannot tell the
    activation)."""
    root = setup["root"]
    if clip_source == "transformers_folder":
        reward = registry.get("aesthetic", root / "aesthetic.pth", clip_path=root / "clip_l14")
    else:
        cfg = clip_weights.config_from_transformers(
            json.loads((root / "clip_l14" / "config.json").read_text()))
        reward = registry.get("aesthetic", root / "aesthetic.safetensors",
                              clip_path=root / "ViT-L-14.pt", clip_config=cfg)
    got = np.asarray(reward(setup["images"], PROMPTS))
    pixels = np.stack([reference_pixels(np.round(im * 255).astype(np.uint8))
                       for im in setup["images"]])
    with torch.no_grad():
        features = setup["aesthetic_clip"].get_image_features(
            pixel_values=torch.from_numpy(pixels).permute(0, 3, 1, 2)).pooler_output.numpy()
        features = features / np.linalg.norm(features, axis=-1, keepdims=True)  # LAION's normalized()
        expected = setup["head"](torch.from_numpy(features))[:, 0].numpy()
    err = _err(got, expected) / np.abs(expected).max()
    print(f"aesthetic: {got} vs reference {expected}: max rel err {err:.1e}")
    assert abs(expected[0] - expected[1]) > 1e-2 * np.abs(expected).max()
    assert err <= 1e-5


def test_scoring_rules_on_hand_computed_features(setup):
    """HPS / CLIP score = dot of L2-normalised features; PickScore = exp(logit_scale) · that."""
    root = setup["root"]
    hps = registry.get("hps", root / "hps.pt", tokenizer=root / "tokenizer", config=TINY_CONFIG)
    model = nnx.merge(hps.graphdef, hps.state)
    pick = cr.ClipReward(model, hps.tokenizer, preprocess=cr.HPS_PREPROCESS, scale="logit_scale",
                         name="pickscore")
    pixels = np.asarray(jax.jit(cr.preprocess)(setup["images"]))
    ids = hps.tokenize(PROMPTS)

    @jax.jit
    def features(state, pixels, ids):
        m = nnx.merge(hps.graphdef, state)
        return m.encode_image(pixels), m.encode_text(ids), m.logit_scale[...]

    image, text, logit_scale = (np.asarray(a, np.float64) for a in features(hps.state, pixels, ids))
    cosine = np.sum(image * text, -1) / (np.linalg.norm(image, axis=-1) *
                                         np.linalg.norm(text, axis=-1))
    np.testing.assert_allclose(jax.jit(hps.score_pixels)(hps.state, pixels, ids), cosine,
                               atol=1e-6)
    np.testing.assert_allclose(jax.jit(pick.score_pixels)(pick.state, pixels, ids),
                               np.exp(logit_scale) * cosine, rtol=1e-5)
    assert np.all(np.abs(cosine) <= 1.0)
    with pytest.raises(ValueError, match="2 images but 1 prompts"):
        hps(setup["images"], ["only one"])


def test_reward_factories_explain_what_is_missing(setup):
    with pytest.raises(ValueError, match="needs tokenizer="):
        registry.get("hps", setup["root"] / "hps.pt", config=TINY_CONFIG)
    with pytest.raises(ValueError, match="768-d"):
        registry.get("aesthetic", setup["root"] / "aesthetic.pth",
                     clip_path=setup["root"] / "pickscore")


def _no_torch(monkeypatch):
    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"torch imported at run time: import {name}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)


def _listing(folder) -> list[tuple[str, int]]:
    """Every file under `folder` with its modification time, sorted."""
    return sorted((os.path.relpath(os.path.join(d, n), folder),
                   os.stat(os.path.join(d, n)).st_mtime_ns)
                  for d, _, names in os.walk(folder) for n in names)


def test_published_names_read_their_conversions_without_torch_or_writes(setup, tmp_path,
                                                                         monkeypatch):
    """Given the published PyTorch files (converted once beside them), the rewards read the
    safetensors: torch is not imported, and nothing is written, in a folder made read-only
    (root ignores that mode; the unchanged listing is the check that always holds)."""
    root = setup["root"]
    ro = tmp_path / "read_only"
    shutil.copytree(root, ro)
    before = _listing(ro)
    for d, _, _ in os.walk(ro):
        os.chmod(d, 0o555)
    try:
        _no_torch(monkeypatch)
        hps = registry.get("hps", ro / "hps.pt", tokenizer=ro / "tokenizer", config=TINY_CONFIG)
        score = registry.get("clip_score", ro / "dfn5b", tokenizer=ro / "tokenizer")
        cfg = clip_weights.config_from_transformers(
            json.loads((ro / "clip_l14" / "config.json").read_text()))
        aesthetic = registry.get("aesthetic", ro / "aesthetic.pth", clip_path=ro / "ViT-L-14.pt",
                                 clip_config=cfg)
        monkeypatch.undo()
        expected = registry.get("hps", root / "hps.safetensors", tokenizer=root / "tokenizer",
                                config=TINY_CONFIG)
        np.testing.assert_array_equal(hps(setup["images"], PROMPTS),
                                      expected(setup["images"], PROMPTS))
        assert np.all(np.isfinite(score(setup["images"], PROMPTS)))
        assert np.all(np.isfinite(aesthetic(setup["images"], PROMPTS)))
        assert _listing(ro) == before
    finally:
        for d, _, _ in os.walk(ro):
            os.chmod(d, 0o755)


@pytest.mark.parametrize("published", ["hps_pt", "aesthetic_pth", "openai_pt", "open_clip_bin"])
def test_unconverted_pytorch_files_name_the_converter(setup, tmp_path, published):
    """A PyTorch file without its conversion: NeedsConversionError with the exact command, even
    though torch is installed here, and nothing written beside it."""
    root = setup["root"]
    if published == "open_clip_bin":
        folder = tmp_path / "dfn5b"
        folder.mkdir()
        for name in ("open_clip_config.json", "open_clip_pytorch_model.bin"):
            shutil.copy(root / "dfn5b" / name, folder / name)
        src, dst = folder / "open_clip_pytorch_model.bin", folder / "open_clip_model.safetensors"
        make = lambda: registry.get("clip_score", folder, tokenizer=root / "tokenizer")
    else:
        name = {"hps_pt": "hps.pt", "aesthetic_pth": "aesthetic.pth",
                "openai_pt": "ViT-L-14.pt"}[published]
        src = tmp_path / name
        shutil.copy(root / name, src)
        dst = src.with_suffix(".safetensors")
        make = {
            "hps_pt": lambda: registry.get("hps", src, tokenizer=root / "tokenizer",
                                           config=TINY_CONFIG),
            "aesthetic_pth": lambda: registry.get("aesthetic", src, clip_path=root / "clip_l14"),
            "openai_pt": lambda: registry.get(
                "aesthetic", root / "aesthetic.pth", clip_path=src,
                clip_config=clip_weights.config_from_transformers(
                    json.loads((root / "clip_l14" / "config.json").read_text()))),
        }[published]
    before = _listing(tmp_path)
    with pytest.raises(torch_checkpoints.NeedsConversionError) as info:
        make()
    assert f"python -m g2rpo_jax.convert {src} {dst}" in str(info.value)
    assert "pip install torch" in str(info.value)
    assert _listing(tmp_path) == before
    # The command it names makes the reward load.
    assert convert.main([str(src), str(dst)]) == 0
    assert make() is not None


# ---------------------------------------------------------------------------------------------
# Registry.


def test_registry_names_and_errors():
    assert {"hps", "clip_score", "pickscore", "aesthetic", "remote"} <= set(registry.names())
    with pytest.raises(KeyError) as info:
        registry.get("imagereward", "somewhere")
    assert "'imagereward'" in str(info.value) and "'pickscore'" in str(info.value)
    factory = lambda path=None, scale=1.0: (lambda images, prompts: scale * np.ones(len(prompts)))
    registry.register("test_constant", factory)
    try:
        assert list(registry.get("test_constant", scale=2.0)(None, ["a", "b"])) == [2.0, 2.0]
        with pytest.raises(ValueError, match="already registered"):
            registry.register("test_constant", factory)
        registry.register("test_constant", factory, overwrite=True)
    finally:
        registry._FACTORIES.pop("test_constant", None)
    with pytest.raises(ValueError, match="needs its endpoint"):
        registry.get("remote")


# ---------------------------------------------------------------------------------------------
# The remote reward, against a scoring server on 127.0.0.1 (loopback only, a handful of requests).

_REQUESTS = collections.Counter()   # request path (with its query) -> requests received
_REQUESTS_LOCK = threading.Lock()


class _ScoringHandler(http.server.BaseHTTPRequestHandler):
    """Scores = mean pixel value in [0, 1] + number of characters of the prompt.

    Failures on demand: /flaky?fail=K&how=H&id=... fails its first K requests (fail=always:
    every one) with HTTP status H, or drops (how=drop) or resets (how=reset) the connection;
    retry_after=S adds a Retry-After header. Every path counts its requests in _REQUESTS (the
    tests give each URL a unique id)."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        url = urllib.parse.urlsplit(self.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        with _REQUESTS_LOCK:
            _REQUESTS[self.path] += 1
            count = _REQUESTS[self.path]
        if url.path == "/flaky" and (query["fail"] == "always" or count <= int(query["fail"])):
            how = query.get("how", "503")
            if how in ("drop", "reset"):
                if how == "reset":   # close with an RST instead of a FIN
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                self.close_connection = True
                return None
            extra = {"Retry-After": query["retry_after"]} if "retry_after" in query else {}
            return self._send(int(how), b"busy, try later", extra)
        if url.path == "/error":
            return self._send(500, b"the model crashed")
        if url.path == "/notjson":
            return self._send(200, b"<html>scores</html>")
        if url.path == "/slow":
            time.sleep(1.0)
        if self.headers["Content-Type"] == "application/json":
            request = json.loads(body)
            images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(i)))) for i in
                      request["images"]]
            prompts = request["prompts"]
        else:
            archive = np.load(io.BytesIO(body), allow_pickle=False)
            images, prompts = list(archive["images"]), [str(p) for p in archive["prompts"]]
        scores = [float(im.mean()) / 255.0 + len(p) for im, p in zip(images, prompts, strict=True)]
        if url.path == "/short":
            scores = scores[:-1]
        if url.path == "/nan":
            scores[0] = float("nan")
        self._send(200, json.dumps({"scores": scores}).encode())

    def _send(self, status, payload: bytes, extra_headers=None):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for key, value in (extra_headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        try:
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass

    def log_message(self, *args):  # keep the test output quiet
        pass


@pytest.fixture(scope="module")
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ScoringHandler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def _unique(server: str, path: str, **query) -> str:
    """server + path + query with a fresh id, so that its request count starts at 0."""
    query["id"] = uuid.uuid4().hex[:12]
    return f"{server}{path}?{urllib.parse.urlencode(query)}"


def _requests(url: str) -> int:
    split = urllib.parse.urlsplit(url)
    with _REQUESTS_LOCK:
        return _REQUESTS[f"{split.path}?{split.query}"]


_IMAGES = np.stack([np.full((8, 8, 3), 0.5, np.float32), np.zeros((8, 8, 3), np.float32)])
_PROMPTS = ["a cat", "a dog on a sofa"]
_EXPECTED = [128 / 255 + 5, 0 + 15]


def _fast(url: str, waits: list, **kw) -> registry.RemoteReward:
    """A remote reward that records its waits instead of sleeping (no jitter: exact waits)."""
    kw = dict(timeout=10, retries=3, backoff_seconds=0.01, max_backoff_seconds=1.0, jitter=0.0,
              sleep=waits.append) | kw
    return registry.get("remote", url, **kw)


@pytest.mark.parametrize("image_format", ["png", "npz"])
def test_remote_reward_round_trip(server, image_format):
    images = np.stack([known_image(24, 32, seed=s) for s in (3, 4)]) / 255.0
    prompts = ["a cat", "a much longer prompt"]
    reward = registry.get("remote", url=server + "/score", image_format=image_format, timeout=10)
    got = reward(jax.numpy.asarray(images), prompts)
    pixels = np.round(images * 255.0)
    expected = [pixels[i].mean() / 255.0 + len(p) for i, p in enumerate(prompts)]
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert got.dtype == np.float32


def test_remote_reward_errors(server):
    images = np.zeros((2, 8, 8, 3), np.float32)
    prompts = ["a", "b"]
    with pytest.raises(registry.RemoteRewardError, match="HTTP 500.*the model crashed"):
        registry.get("remote", server + "/error", retries=0)(images, prompts)
    with pytest.raises(registry.RemoteRewardError, match="expected .*2 numbers"):
        registry.get("remote", server + "/short")(images, prompts)
    with pytest.raises(registry.RemoteRewardError, match="no answer within 0.3 s"):
        registry.get("remote", server + "/slow", timeout=0.3, retries=0)(images, prompts)
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    with pytest.raises(registry.RemoteRewardError, match="cannot connect"):
        registry.get("remote", f"http://127.0.0.1:{closed}/score", timeout=2,
                     retries=0)(images, prompts)
    with pytest.raises(ValueError, match="http"):
        registry.get("remote", url="ftp://example")


@pytest.mark.parametrize("how", ["503", "502", "429", "408", "drop", "reset"])
def test_remote_reward_retries_transient_failures(server, how, caplog):
    url = _unique(server, "/flaky", fail=2, how=how)
    waits = []
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        got = _fast(url, waits)(_IMAGES, _PROMPTS)
    np.testing.assert_allclose(got, _EXPECTED, rtol=1e-6)
    assert _requests(url) == 3                       # 2 failures, then the answer
    assert waits == [0.01, 0.02]                     # backoff_seconds, doubled
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    for attempt, message in enumerate(warnings, start=1):
        assert f"attempt {attempt} of 4 failed" in message and url in message
        if how.isdigit():
            assert f"HTTP {how}" in message
        else:
            assert "connection lost" in message or "cannot connect" in message


def test_remote_reward_gives_up_after_retries(server):
    url = _unique(server, "/flaky", fail="always", how=503)
    waits = []
    reward = _fast(url, waits, retries=4, max_backoff_seconds=0.05)
    with pytest.raises(registry.RemoteRewardError) as error:
        reward(_IMAGES, _PROMPTS)
    assert _requests(url) == 5                       # retries + 1 attempts
    assert waits == [0.01, 0.02, 0.04, 0.05]         # doubling, capped at max_backoff_seconds
    message = str(error.value)
    for part in (url, "gave up after 5 attempts", "0.12 s of it waiting", "HTTP 503",
                 "busy, try later", "Check that the service is up", "retries= (now 4)",
                 "timeout= (now 10 s)"):
        assert part in message, (part, message)


def test_remote_reward_retries_refused_connections_with_real_sleeps():
    with socket.socket() as s:  # a loopback port with nobody listening
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    reward = registry.get("remote", f"http://127.0.0.1:{closed}/score", timeout=2, retries=2,
                          backoff_seconds=0.05, jitter=0.0)
    start = time.monotonic()
    with pytest.raises(registry.RemoteRewardError,
                       match=r"gave up after 3 attempts .*0\.15 s of it waiting.*cannot connect"):
        reward(_IMAGES, _PROMPTS)
    assert 0.15 <= time.monotonic() - start < 5      # it did sleep 0.05 + 0.1 s, no more


def test_remote_reward_retries_timeouts(server):
    url = _unique(server, "/slow")
    waits = []
    with pytest.raises(registry.RemoteRewardError,
                       match=r"gave up after 2 attempts.*no answer within 0\.3 s"):
        _fast(url, waits, timeout=0.3, retries=1)(_IMAGES, _PROMPTS)
    assert _requests(url) == 2 and waits == [0.01]


@pytest.mark.parametrize("path, query, match", [
    ("/flaky", dict(fail="always", how=400), "HTTP 400.*busy, try later"),
    ("/flaky", dict(fail="always", how=404), "HTTP 404"),
    ("/flaky", dict(fail="always", how=501), "HTTP 501"),
    ("/short", {}, "expected .*2 numbers"),
    ("/notjson", {}, "not JSON"),
    ("/nan", {}, "non-finite"),
])
def test_remote_reward_does_not_retry_permanent_failures(server, path, query, match):
    url = _unique(server, path, **query)
    waits = []
    with pytest.raises(registry.RemoteRewardError, match=match) as error:
        _fast(url, waits)(_IMAGES, _PROMPTS)
    assert _requests(url) == 1 and waits == []
    assert "gave up" not in str(error.value) and url in str(error.value)


@pytest.mark.parametrize("retry_after, expected", [
    ("0.25", 0.25),     # honoured when longer than the backoff
    ("0.001", 0.01),    # the backoff when shorter
    ("3600", 0.5),      # capped at max_backoff_seconds
    ("soon", 0.01),     # unreadable: ignored
])
def test_remote_reward_honours_retry_after(server, retry_after, expected):
    url = _unique(server, "/flaky", fail=1, how=429, retry_after=retry_after)
    waits = []
    got = _fast(url, waits, max_backoff_seconds=0.5)(_IMAGES, _PROMPTS)
    np.testing.assert_allclose(got, _EXPECTED, rtol=1e-6)
    assert _requests(url) == 2 and waits == [expected]


def test_remote_reward_retry_after_dates():
    assert registry._retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0     # in the past
    future = email.utils.formatdate(time.time() + 100, usegmt=True)
    assert 98 <= registry._retry_after(future) <= 100
    assert registry._retry_after(None) is None and registry._retry_after("never") is None


def test_remote_reward_backoff_schedule_and_jitter():
    exact = registry.RemoteReward("http://127.0.0.1:1/", jitter=0.0)   # the defaults: 1 s, 30 s
    assert [exact.delay(k) for k in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    jittered = registry.RemoteReward("http://127.0.0.1:1/", jitter=0.5, backoff_seconds=0.1,
                                     max_backoff_seconds=10)
    jittered._random = random.Random(0)
    delays = [jittered.delay(k) for k in range(1, 6)]
    bases = [0.1, 0.2, 0.4, 0.8, 1.6]
    assert all(0.5 * b <= d <= b for d, b in zip(delays, bases, strict=True)), delays
    assert len({round(d / b, 6) for d, b in zip(delays, bases, strict=True)}) == 5, delays


@pytest.mark.parametrize("option, value", [
    ("retries", -1), ("retries", 2.5), ("retries", "many"), ("backoff_seconds", -0.1),
    ("max_backoff_seconds", -1), ("max_backoff_seconds", float("inf")), ("jitter", -0.1),
    ("jitter", 1.5)])
def test_remote_reward_validates_retry_options(option, value):
    with pytest.raises(ValueError, match=option):
        registry.get("remote", "http://127.0.0.1:1/", **{option: value})


def test_remote_reward_retry_options_through_the_config(server):
    import ml_collections

    from g2rpo_jax.run import config_lib
    from g2rpo_jax.tasks.flux import RewardModels

    url = _unique(server, "/flaky", fail=1, how=503)
    config = ml_collections.ConfigDict(dict(reward=dict(root="", models=dict(
        service=config_lib.reward_model("remote", url, timeout=10.0, retries=2,
                                        backoff_seconds=0.01, max_backoff_seconds=0.02,
                                        jitter=0.0),
        strict=config_lib.reward_model("remote", url, retries=0)))))
    models = RewardModels(config, mesh=None, rules=None, default_tokenizer=None)
    service = models.get("service")
    assert (service.retries, service.backoff_seconds, service.max_backoff_seconds,
            service.jitter, service.timeout) == (2, 0.01, 0.02, 0.0, 10.0)
    assert models.get("strict").retries == 0
    got = models.score(_IMAGES, _PROMPTS, ["service"])["service"]
    np.testing.assert_allclose(got, _EXPECTED, rtol=1e-6)
    assert _requests(url) == 2
