"""FLUX.1's text encoders as preprocessing runs them: the encoders folder (checked, made local,
identified without reading weights, its widths), the devices a process encodes on, and
`TextEncoders`, the jitted T5 + CLIP encoding of a batch of prompts."""

from collections.abc import Sequence
import hashlib
import json
import os

from flax import nnx
import jax
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.core import storage
from g2rpo_jax.models import clip_text, t5, t5_weights

# The subfolders of a FLUX.1 repo that hold its text encoders and their tokenizers.
ENCODER_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


def _check_encoders(folder: str) -> None:
    root = storage.path(folder)
    missing = [sub for sub in ENCODER_FOLDERS if not root.joinpath(sub).is_dir()]
    if missing:
        what = "does not exist" if not root.is_dir() else f"has no {missing}"
        raise FileNotFoundError(
            f"The text-encoder folder {folder} {what}: give FLUX.1-dev's folder (with "
            f"{', '.join(f'{s}/' for s in ENCODER_FOLDERS)}) as config.text.path or "
            "config.model.checkpoint.")


def local_encoders(folder: str) -> str:
    """The encoders folder, checked, as a local path (a gs:// folder: its four encoder
    subfolders downloaded once, `storage.local`)."""
    _check_encoders(folder)
    return storage.local(folder, parts=ENCODER_FOLDERS)


def encoder_identity(folder: str) -> dict:
    """What identifies the encoders without reading their weights: every file's size, and the
    content hash of the small ones (configs, tokenizers)."""
    _check_encoders(folder)
    files = {}
    for sub in ENCODER_FOLDERS:
        for root, _, names in os.walk(os.path.join(folder, sub)):
            for name in sorted(names):
                path = os.path.join(root, name)
                size = os.path.getsize(path)
                entry = {"size": size}
                if size < 4 << 20:
                    with open(path, "rb") as f:
                        entry["sha256"] = hashlib.sha256(f.read()).hexdigest()
                files[os.path.relpath(path, folder)] = entry
    return dict(sorted(files.items()))


def encoder_dims(folder: str) -> tuple[int, int]:
    """(T5 width, CLIP text width) from the encoders' config files."""
    with open(os.path.join(folder, "text_encoder_2", "config.json")) as f:
        t5_dim = json.load(f)["d_model"]
    with open(os.path.join(folder, "text_encoder", "config.json")) as f:
        values = json.load(f)
    return t5_dim, values.get("hidden_size") or values["text_config"]["hidden_size"]


def encoder_devices() -> list:
    """The devices this process encodes on: all its local devices, except on CPU in a
    multi-process run, where it is one.

    Once jax.distributed is initialised, XLA:CPU runs every collective through gloo, even
    between two devices of one process, and gloo there can pair a collective of one program
    with one of the next (aborting with "Received data size doesn't match expected size";
    `benchmarks/investigations/two_process_preprocess.py` counts such runs). One device needs no collective;
    TPU and GPU keep the sharded encoders.
    """
    if jax.process_count() > 1 and jax.default_backend() == "cpu":
        return jax.local_devices()[:1]
    return jax.local_devices()


class TextEncoders:
    """FLUX.1's two text encoders on this process's own devices.

    `encode(prompts) -> (t5 [P, t5_max_length, D], clip_pooled [P, Dy])`, float32 numpy: T5's
    last hidden states without an attention mask (FluxPipeline attends to the padding too) and
    CLIP's pooled output (the end token's final-LayerNormed state), each prompt tokenized as
    FluxPipeline does. Parameters are sharded over a mesh of the local devices (fsdp; default
    `encoder_devices()`), so every host encodes its own chunks independently.
    """

    def __init__(self, folder: str, t5_max_length: int, clip_max_length: int,
                 dtype: str = "bfloat16", devices=None):
        _check_encoders(folder)
        devices = list(encoder_devices() if devices is None else devices)
        self.mesh = parallel.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=devices)
        self.t5_max_length, self.clip_max_length = t5_max_length, clip_max_length
        self._t5_tokenizer = t5.load_tokenizer(folder)
        self._clip_tokenizer = clip_text.load_tokenizer(folder)
        t5_model = t5_weights.from_pretrained(folder, dtype, mesh=self.mesh)
        clip_model = clip_text.from_pretrained(folder, dtype, mesh=self.mesh)
        if clip_max_length > clip_model.tc.context_length:
            raise ValueError(f"clip_max_length {clip_max_length} exceeds the CLIP text model's "
                             f"{clip_model.tc.context_length} positions "
                             "(config.text.clip_max_length).")
        self.t5_dim, self.clip_dim = t5_model.cfg.d_model, clip_model.tc.width
        (t5_def, t5_state), (clip_def, clip_state) = nnx.split(t5_model), nnx.split(clip_model)
        self._states = (t5_state, clip_state)

        @jax.jit
        def encode(states, t5_ids, clip_ids):
            hidden = nnx.merge(t5_def, states[0])(t5_ids)
            _, pooled = nnx.merge(clip_def, states[1])(clip_ids)
            return hidden.astype(np.float32), pooled.astype(np.float32)

        self._encode = encode

    @property
    def batch_multiple(self) -> int:
        """Batches are padded to a multiple of this (the devices the batch is split over)."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        count = len(prompts)
        padded = list(prompts) + [prompts[-1]] * (-count % self.batch_multiple)
        t5_ids, _ = t5.tokenize(self._t5_tokenizer, padded, self.t5_max_length)
        clip_ids = clip_text.tokenize(self._clip_tokenizer, padded, self.clip_max_length)
        t5_ids, clip_ids = (jax.device_put(a, parallel.batch_sharding(self.mesh, a.shape))
                            for a in (t5_ids, clip_ids))
        with jax.set_mesh(self.mesh):
            hidden, pooled = self._encode(self._states, t5_ids, clip_ids)
        return np.asarray(hidden)[:count], np.asarray(pooled)[:count]
