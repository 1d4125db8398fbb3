"""FLUX prompt embeddings, computed once and served as TFDS ArrayRecord datasets.

The RL job never runs the text encoders (T5-XXL alone is 4.8B parameters): `python -m
g2rpo_jax.preprocess` encodes a prompts file (HPDv2 style: one prompt per line) with FLUX.1's
T5 (`text_encoder_2/`, all `t5_max_length` states, as FluxPipeline feeds them) and CLIP-L text
(`text_encoder/`, the pooled output) and writes one dataset per prompts file:

  {"prompt": text, "index": int64 (0-based line number), "t5": [L, D], "clip_pooled": [Dy]}

stored in `storage_dtype` ("float32", or "bfloat16" kept bit-exact as its uint16 bit pattern:
TFDS cannot serialise bfloat16, and FLUX.1-dev's 512×4096 states are 4 MiB per prompt in it).

Preparation, `prepare(spec, data_dir, ...)`:
  1. encode: the prompts are cut into chunks of `chunk_size`; process h of H encodes chunks
     h, h + H, ... on its own devices and writes each as one .npz, atomically (temporary file,
     then rename). Finished chunks are skipped, so an interrupted run continues where it stopped.
  2. assemble: after a barrier, process 0 writes the ArrayRecord dataset from the chunks in
     order (TFDS builds into a temporary folder and renames it), then the chunks are removed
     (unless keep_chunks). Every process then reads the same dataset (data_dir must be shared).
Preparing twice gives byte-identical records (`records_digest`): encoding is deterministic for
a given chunk size and device layout (fixed chunk shapes, one program), and records are
serialized with sorted fields. Another device layout may change the last bits of a few values
(measured on the tiny fixture, 8 vs 1 CPU devices: ≤ 1.6e-6 absolute).

Every path may be a gs:// URL (g2rpo_jax.storage). With a gs:// data_dir the chunks are objects
there, process 0 assembles the dataset in the download cache (`storage.mirror`) and uploads it,
`dataset_info.json` last (so a dataset cut short is never taken as complete), and readers use
their local copy (`storage.local`); gs:// encoders are downloaded once into that cache.

Where: `{data_dir}/prompt_embeddings/{name}/1.0.0/` (`dataset_dir`); a dataset's metadata holds
a fingerprint of its prompts, settings and encoder files, and preparing another prompts file or
other settings under the same name is an error (not a silent rebuild). Reading:

  source = load(dataset_dir(data_dir, name))      # random access, TensorFlow never imported
  source.metadata                                 # t5_dim, clip_dim, t5_max_length, ...
  reader = reader.Reader(source, global_batch, seed, rows=host_rows)   # {"prompt", "t5", ...}
"""

from collections.abc import Sequence
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time

from absl import logging
import jax
import ml_dtypes
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import example_serializer
import tqdm

from g2rpo_jax import storage

BUILDER_NAME = "prompt_embeddings"
VERSION = "1.0.0"
SPLIT = "prompts"
STORAGE_DTYPES = ("float32", "bfloat16")
FEATURES = ("prompt", "index", "t5", "clip_pooled")
_ENCODER_FOLDERS = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
# A dataset's files that mark it complete, uploaded after its records (dataset_info.json last:
# readers check for it).
_COMPLETE_LAST = ("features.json", "metadata.json", "dataset_info.json")


# ---------------------------------------------------------------------------------------------
# Prompts files.


def read_prompts(path: str, max_prompts: int = 0) -> list[str]:
    """The first `max_prompts` lines of a prompts file (0 = all), each one prompt.

    Raises:
      FileNotFoundError: no file at path.
      ValueError: an empty file, or a blank line among the lines used (named by line number:
        a blank line would silently shift every later prompt's index).
    """
    if not path:
        raise FileNotFoundError("No prompts file given: set config.data.prompts_file (and "
                                "config.data.eval_prompts_file for evaluation) to a text file "
                                "with one prompt per line.")
    if not storage.path(path).is_file():
        raise FileNotFoundError(f"No prompts file at {path}: set config.data.prompts_file / "
                                "eval_prompts_file to a text file with one prompt per line.")
    text = storage.path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    if not lines:
        raise ValueError(f"The prompts file {path} is empty: it needs one prompt per line.")
    if max_prompts > 0:
        lines = lines[:max_prompts]
    prompts = [line.rstrip("\r") for line in lines]
    blank = [i + 1 for i, p in enumerate(prompts) if not p.strip()]
    if blank:
        raise ValueError(f"The prompts file {path} has blank lines (line {blank[0]}"
                         f"{f' and {len(blank) - 1} more' if len(blank) > 1 else ''}): every line "
                         "must hold one prompt. Remove the blank lines.")
    return prompts


# ---------------------------------------------------------------------------------------------
# What a dataset is.


@dataclasses.dataclass(frozen=True)
class EmbeddingSpec:
    """One dataset's identity: its prompts and how they are encoded.

    Attributes:
      name: the dataset's name under data_dir (letters, digits, '_', '-', '.').
      prompts_file: the prompts text file; max_prompts: how many of its lines (0 = all).
      encoders: a folder with FLUX.1's text_encoder/, tokenizer/, text_encoder_2/, tokenizer_2/.
      t5_max_length: T5 tokens per prompt (FLUX.1-dev: 512; schnell: 256).
      clip_max_length: CLIP tokens per prompt (77).
      storage_dtype: "float32" or "bfloat16" (stored bit-exact as uint16).
      encoder_dtype: the encoders' compute dtype (FLUX pipelines run T5 in bfloat16).
    """

    name: str
    prompts_file: str
    encoders: str
    max_prompts: int = 0
    t5_max_length: int = 512
    clip_max_length: int = 77
    storage_dtype: str = "bfloat16"
    encoder_dtype: str = "bfloat16"

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z0-9_.\-]+", self.name or ""):
            raise ValueError(f"Dataset name {self.name!r} must be letters, digits, '_', '-' or "
                             "'.'; set config.data.name / eval_name.")
        if self.storage_dtype not in STORAGE_DTYPES:
            raise ValueError(f"Unknown storage dtype {self.storage_dtype!r}; use one of "
                             f"{STORAGE_DTYPES} (config.data.storage_dtype).")
        if self.t5_max_length < 1 or self.clip_max_length < 1:
            raise ValueError(f"Token lengths must be positive; got t5_max_length "
                             f"{self.t5_max_length}, clip_max_length {self.clip_max_length}.")


def _sanitize(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-]+", "_", stem).strip("_") or "prompts"


def specs_from_config(config) -> dict[str, EmbeddingSpec]:
    """{"train": spec, "eval": spec (if data.eval_prompts_file is set)} of a FLUX run config
    (sections `data`, `text`, and `model.checkpoint` as the default encoders folder)."""
    data, text = config.data, config.text
    encoders = text.path or config.model.checkpoint
    if not encoders:
        raise ValueError("No text encoders: set config.text.path (or config.model.checkpoint) "
                         "to the FLUX.1 folder that holds text_encoder/, tokenizer/, "
                         "text_encoder_2/ and tokenizer_2/.")
    common = dict(encoders=encoders, t5_max_length=text.t5_max_length,
                  clip_max_length=text.clip_max_length, storage_dtype=data.storage_dtype,
                  encoder_dtype=text.dtype)
    files = {"train": (data.prompts_file, data.name, data.max_prompts)}
    if data.eval_prompts_file:
        files["eval"] = (data.eval_prompts_file, data.eval_name, data.max_eval_prompts)
    specs = {}
    for role, (path, name, limit) in files.items():
        if not path:
            raise FileNotFoundError("No prompts file given: set config.data.prompts_file to a "
                                    "text file with one prompt per line.")
        name = name or _sanitize(os.path.splitext(os.path.basename(path))[0])
        specs[role] = EmbeddingSpec(name=name, prompts_file=path, max_prompts=limit, **common)
    if "eval" in specs and specs["eval"].name == specs["train"].name:
        raise ValueError(f"The training and evaluation prompts would both be stored as "
                         f"{specs['train'].name!r}: set config.data.name and "
                         "config.data.eval_name to different names.")
    return specs


def local_encoders(folder: str) -> str:
    """The encoders folder, checked, as a local path (a gs:// folder: its four encoder
    subfolders downloaded once, `storage.local`)."""
    _check_encoders(folder)
    return storage.local(folder, parts=_ENCODER_FOLDERS)


def _check_encoders(folder: str) -> None:
    root = storage.path(folder)
    missing = [sub for sub in _ENCODER_FOLDERS if not root.joinpath(sub).is_dir()]
    if missing:
        what = "does not exist" if not root.is_dir() else f"has no {missing}"
        raise FileNotFoundError(
            f"The text-encoder folder {folder} {what}: give FLUX.1-dev's folder (with "
            f"{', '.join(f'{s}/' for s in _ENCODER_FOLDERS)}) as config.text.path or "
            "config.model.checkpoint.")


def encoder_identity(folder: str) -> dict:
    """What identifies the encoders without reading their weights: every file's size, and the
    content hash of the small ones (configs, tokenizers)."""
    _check_encoders(folder)
    files = {}
    for sub in _ENCODER_FOLDERS:
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


def fingerprint(spec: EmbeddingSpec, prompts: Sequence[str], identity: dict) -> str:
    """sha256 of everything that determines the records (not where the files live)."""
    fields = {k: v for k, v in dataclasses.asdict(spec).items()
              if k not in ("name", "prompts_file", "encoders", "max_prompts")}
    blob = json.dumps({"prompts": list(prompts), "settings": fields, "encoders": identity},
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def dataset_dir(data_dir: str, name: str) -> str:
    """Where the dataset `name` lives under a TFDS data_dir."""
    return os.path.join(data_dir, BUILDER_NAME, name, VERSION)


def default_data_dir() -> str:
    """TFDS's own default (~/tensorflow_datasets, or $TFDS_DATA_DIR)."""
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))


# ---------------------------------------------------------------------------------------------
# Storage dtypes.


def to_storage(x: np.ndarray, storage_dtype: str) -> np.ndarray:
    """float arrays → what is stored: float32, or bfloat16's bits as uint16 (lossless for
    bfloat16 values)."""
    if storage_dtype == "bfloat16":
        return np.asarray(x).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.asarray(x, np.float32)


def from_storage(x: np.ndarray, storage_dtype: str) -> np.ndarray:
    """The inverse of `to_storage`: float32, or bfloat16 (the stored bits reinterpreted)."""
    if storage_dtype == "bfloat16":
        return np.asarray(x, np.uint16).view(ml_dtypes.bfloat16)
    return np.asarray(x, np.float32)


def _stored_dtype(storage_dtype: str):
    return np.uint16 if storage_dtype == "bfloat16" else np.float32


# ---------------------------------------------------------------------------------------------
# Encoding.


def _encoder_devices() -> list:
    """The devices this process encodes on: all its local devices, except on CPU in a
    multi-process run, where it is one.

    Once jax.distributed is initialised, XLA:CPU runs every collective through gloo, even
    between two devices of one process, and gloo there can pair a collective of one program
    with one of the next (`benchmarks/two_process_preprocess.py`, before this rule: 4 of 6
    runs aborted with gloo's "Received data size doesn't match expected size"; with it, 0 of
    9). One device needs no collective; TPU and GPU keep the sharded encoders.
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
    `_encoder_devices()`), so every host encodes its own chunks independently.
    """

    def __init__(self, folder: str, t5_max_length: int, clip_max_length: int,
                 dtype: str = "bfloat16", devices=None):
        from flax import nnx

        from g2rpo_jax import parallel
        from g2rpo_jax.models import clip_text, t5

        _check_encoders(folder)
        devices = list(_encoder_devices() if devices is None else devices)
        self.mesh = parallel.make_mesh({"data": 1, "fsdp": -1, "tensor": 1}, devices=devices)
        self.t5_max_length, self.clip_max_length = t5_max_length, clip_max_length
        self._t5_tokenizer = t5.load_tokenizer(folder)
        self._clip_tokenizer = clip_text.load_tokenizer(folder)
        t5_model = t5.from_pretrained(folder, dtype, mesh=self.mesh)
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
        self._t5, self._clip = t5, clip_text

    @property
    def batch_multiple(self) -> int:
        """Batches are padded to a multiple of this (the devices the batch is split over)."""
        return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        from g2rpo_jax import parallel

        count = len(prompts)
        padded = list(prompts) + [prompts[-1]] * (-count % self.batch_multiple)
        t5_ids, _ = self._t5.tokenize(self._t5_tokenizer, padded, self.t5_max_length)
        clip_ids = self._clip.tokenize(self._clip_tokenizer, padded, self.clip_max_length)
        t5_ids, clip_ids = (jax.device_put(a, parallel.batch_sharding(self.mesh, a.shape))
                            for a in (t5_ids, clip_ids))
        with jax.set_mesh(self.mesh):
            hidden, pooled = self._encode(self._states, t5_ids, clip_ids)
        return np.asarray(hidden)[:count], np.asarray(pooled)[:count]


def chunk_path(chunk_dir: str, chunk: int) -> str:
    return os.path.join(chunk_dir, f"chunk_{chunk:06d}.npz")


def num_chunks(num_prompts: int, chunk_size: int) -> int:
    return -(-num_prompts // chunk_size)


def encode_chunks(prompts: Sequence[str], encode, chunk_dir: str, chunk_size: int,
                  storage_dtype: str, process_index: int = 0, process_count: int = 1,
                  progress: bool = True) -> list[int]:
    """Encodes this process's missing chunks (h, h + H, ...) and writes each atomically.

    Args:
      prompts: every prompt of the dataset (chunk i is prompts[i·C : (i+1)·C]).
      encode: `encode(prompts) -> (t5 [n, L, D], clip_pooled [n, Dy])` (`TextEncoders.encode`).
      chunk_dir: where chunk files go (shared by the hosts).
      chunk_size: prompts per chunk (C).
      storage_dtype: see `to_storage`.
      process_index, process_count: this process (h) and the number of processes (H).

    Returns:
      The chunks this call encoded (finished ones found on disk are skipped).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1; got {chunk_size} "
                         "(config.data.chunk_size).")
    storage.makedirs(chunk_dir)
    mine = range(process_index, num_chunks(len(prompts), chunk_size), process_count)
    todo = [c for c in mine if not storage.path(chunk_path(chunk_dir, c)).exists()]
    done = len(mine) - len(todo)
    bar = tqdm.tqdm(total=sum(len(prompts[c * chunk_size:(c + 1) * chunk_size]) for c in mine),
                    initial=min(done * chunk_size, len(prompts)), unit="prompt",
                    desc=f"encode prompts (process {process_index}/{process_count})",
                    dynamic_ncols=True, disable=not progress)
    for chunk in todo:
        lines = prompts[chunk * chunk_size:(chunk + 1) * chunk_size]
        t5_states, pooled = encode(lines)
        # A chunk file exists only once it is complete (a rename, or one uploaded object).
        with storage.open_atomic(chunk_path(chunk_dir, chunk)) as f:
            np.savez(f, t5=to_storage(t5_states, storage_dtype),
                     clip_pooled=to_storage(pooled, storage_dtype))
        bar.update(len(lines))
    bar.close()
    return todo


# ---------------------------------------------------------------------------------------------
# The TFDS dataset.


class _BuilderConfig(tfds.core.BuilderConfig):
    def __init__(self, name: str, prompts: Sequence[str] = (), chunk_dir: str = "",
                 chunk_size: int = 1, metadata: dict | None = None):
        super().__init__(name=name, version=VERSION,
                         description="FLUX.1 prompt embeddings (g2rpo_jax.data.prompt_embeddings).")
        self.prompts, self.chunk_dir, self.chunk_size = list(prompts), chunk_dir, chunk_size
        self.metadata = dict(metadata or {})


class PromptEmbeddings(tfds.core.GeneratorBasedBuilder):
    """(prompt, T5 states, pooled CLIP) records of one prompts file, assembled from chunks."""

    VERSION = tfds.core.Version(VERSION)
    # TFDS wants one registered config; `prepare` always passes its own, named by the dataset.
    BUILDER_CONFIGS = [_BuilderConfig("registered")]

    def _info(self) -> tfds.core.DatasetInfo:
        meta = self.builder_config.metadata
        stored = _stored_dtype(meta.get("storage_dtype", "float32"))
        # Raw bytes: exact for both dtypes, and fast (no per-value proto fields).
        encoding = tfds.features.Encoding.BYTES
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                "prompt": tfds.features.Text(),
                "index": np.int64,
                "t5": tfds.features.Tensor(shape=(meta.get("t5_max_length", 1),
                                                  meta.get("t5_dim", 1)),
                                           dtype=stored, encoding=encoding),
                "clip_pooled": tfds.features.Tensor(shape=(meta.get("clip_dim", 1),),
                                                    dtype=stored, encoding=encoding),
            }),
            metadata=tfds.core.MetadataDict(meta), description=__doc__)

    def _split_generators(self, dl_manager):
        del dl_manager  # everything comes from the chunk files
        return {SPLIT: self._generate_examples()}

    def _generate_examples(self):
        cfg = self.builder_config
        for chunk in range(num_chunks(len(cfg.prompts), cfg.chunk_size)):
            path = chunk_path(cfg.chunk_dir, chunk)
            if not os.path.exists(path):
                raise FileNotFoundError(
                    f"Chunk {chunk} ({path}) is missing: a process did not finish encoding. "
                    "Run the preprocess command again; finished chunks are kept.")
            with np.load(path) as arrays:
                t5_states, pooled = arrays["t5"], arrays["clip_pooled"]
            start = chunk * cfg.chunk_size
            for j, prompt in enumerate(cfg.prompts[start:start + cfg.chunk_size]):
                yield start + j, {"prompt": prompt, "index": start + j, "t5": t5_states[j],
                                  "clip_pooled": pooled[j]}


@contextlib.contextmanager
def _deterministic_serialization():
    """Records are tf.train.Example protos whose features are a protobuf map, which protobuf
    serializes in hash order, and that order differs between processes (seen: the same records
    written by two runs differed only in the order of their fields). `deterministic=True`
    sorts the map, so every run writes the same bytes. TFDS builds its serializer internally,
    so its method is swapped for the duration of the build."""
    cls = example_serializer.ExampleSerializer
    original = cls.serialize_example

    def serialize_example(self, example):
        return self.get_tf_example(example).SerializeToString(deterministic=True)

    cls.serialize_example = serialize_example
    try:
        yield
    finally:
        cls.serialize_example = original


def _barrier(name: str, process_count: int) -> None:
    if process_count > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _existing_fingerprint(directory: str) -> str | None:
    path = storage.path(os.path.join(directory, "metadata.json"))
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("fingerprint")


def prepare(spec: EmbeddingSpec, data_dir: str | None = None, chunk_size: int = 256,
            keep_chunks: bool = False, load_encoders=None,
            process_index: int | None = None, process_count: int | None = None,
            validate_dims=None, progress: bool = True) -> str:
    """Encodes and assembles one dataset (see the module docstring); returns its directory.

    Args:
      spec: what to encode.
      data_dir: the TFDS data_dir ("" / None: TFDS's default); shared by all processes.
      chunk_size: prompts per chunk file (and per encoder call on one host).
      keep_chunks: keep the chunk files after assembly (default: removed).
      load_encoders: `load_encoders() -> TextEncoders`, called only if this process has a chunk
        left to encode (default: load spec.encoders).
      process_index, process_count: default: jax's.
      validate_dims: optional `validate_dims(t5_dim, clip_dim)` that raises on a mismatch with
        the transformer (e.g. `check_dims`), called before anything is loaded or encoded.

    Raises:
      ValueError: the dataset `spec.name` exists with other prompts or settings.
    """
    start = time.perf_counter()
    data_dir = data_dir or default_data_dir()
    h = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    prompts = read_prompts(spec.prompts_file, spec.max_prompts)
    encoders_dir = local_encoders(spec.encoders)
    identity = encoder_identity(encoders_dir)
    digest = fingerprint(spec, prompts, identity)
    target = dataset_dir(data_dir, spec.name)
    found = _existing_fingerprint(target)
    if found == digest:
        logging.info("Prompt embeddings %s are already prepared (%d prompts).", target,
                     len(prompts))
        return target
    if found is not None:
        raise ValueError(
            f"{target} holds embeddings of other prompts or settings (fingerprint {found[:12]}, "
            f"wanted {digest[:12]} for {spec.prompts_file}). Delete that folder, or set "
            "config.data.name / eval_name to another name.")
    chunk_dir = os.path.join(data_dir, f"{BUILDER_NAME}_chunks",
                             f"{spec.name}-{digest[:16]}-c{chunk_size}")
    # Checked from the config files, before minutes of loading T5-XXL.
    dims = _config_dims(encoders_dir)
    if validate_dims is not None:
        validate_dims(*dims)
    total = num_chunks(len(prompts), chunk_size)
    left = [c for c in range(h, total, count)
            if not storage.path(chunk_path(chunk_dir, c)).exists()]
    encoders = None
    if left:
        encoders = (load_encoders() if load_encoders is not None else TextEncoders(
            encoders_dir, spec.t5_max_length, spec.clip_max_length, spec.encoder_dtype))
    encode_chunks(prompts, encoders.encode if encoders else None, chunk_dir, chunk_size,
                  spec.storage_dtype, h, count, progress=progress and h == 0)
    _barrier(f"prompt_embeddings encoded {spec.name}", count)
    if h == 0:
        metadata = dict(dataclasses.asdict(spec), fingerprint=digest, num_prompts=len(prompts),
                        t5_dim=dims[0], clip_dim=dims[1])
        build_dir = storage.mirror(data_dir)
        if storage.is_remote(data_dir):   # built afresh in the cache, then uploaded
            shutil.rmtree(storage.mirror(target), ignore_errors=True)
        builder = PromptEmbeddings(config=_BuilderConfig(spec.name, prompts,
                                                         storage.local(chunk_dir), chunk_size,
                                                         metadata),
                                   data_dir=build_dir)
        with _deterministic_serialization():
            builder.download_and_prepare(file_format="array_record")
        if storage.is_remote(data_dir):
            storage.upload_tree(storage.mirror(target), target, last=_COMPLETE_LAST)
        if not keep_chunks:
            storage.remove(chunk_dir)
            if storage.is_remote(chunk_dir):
                shutil.rmtree(storage.mirror(chunk_dir), ignore_errors=True)
    _barrier(f"prompt_embeddings assembled {spec.name}", count)
    logging.info("Prompt embeddings: %d prompts of %s → %s in %.1f s.", len(prompts),
                 spec.prompts_file, target, time.perf_counter() - start)
    return target


def _config_dims(folder: str) -> tuple[int, int]:
    """(T5 width, CLIP text width) from the encoders' config files."""
    with open(os.path.join(folder, "text_encoder_2", "config.json")) as f:
        t5_dim = json.load(f)["d_model"]
    with open(os.path.join(folder, "text_encoder", "config.json")) as f:
        values = json.load(f)
    return t5_dim, values.get("hidden_size") or values["text_config"]["hidden_size"]


# ---------------------------------------------------------------------------------------------
# Reading.


class EmbeddingSource:
    """Random access to a prepared dataset, records typed: {"prompt": bytes, "index": int64,
    "t5": [L, D], "clip_pooled": [Dy]} in float32 or bfloat16 (the storage dtype)."""

    def __init__(self, directory: str):
        if not storage.path(os.path.join(directory, "dataset_info.json")).exists():
            raise FileNotFoundError(
                f"No prepared prompt embeddings at {directory}. Make them with: python -m "
                "g2rpo_jax.preprocess --config=<the same config and overrides> (it reads "
                "config.data.prompts_file / eval_prompts_file and writes under "
                "config.data.data_dir).")
        builder = tfds.builder_from_directory(storage.local(directory))
        self.directory = directory
        self.metadata = dict(builder.info.metadata or {})
        self._source = builder.as_data_source(split=SPLIT)
        self._dtype = self.metadata.get("storage_dtype", "float32")

    def __len__(self) -> int:
        return len(self._source)

    def _typed(self, record: dict) -> dict:
        return dict(record, t5=from_storage(record["t5"], self._dtype),
                    clip_pooled=from_storage(record["clip_pooled"], self._dtype))

    def __getitem__(self, i: int) -> dict:
        return self._typed(self._source[i])

    def __getitems__(self, indices: Sequence[int]) -> list[dict]:
        return [self._typed(r) for r in self._source.__getitems__(list(indices))]

    def records_by_index(self) -> list[dict]:
        """Every record, in prompts-file order (TFDS stores them shuffled by key)."""
        records = self.__getitems__(range(len(self)))
        return sorted(records, key=lambda r: int(r["index"]))


def load(directory: str) -> EmbeddingSource:
    return EmbeddingSource(directory)


def records_digest(directory: str) -> str:
    """sha256 of a prepared dataset's serialized records, in file order: equal digests mean
    byte-identical record contents (how preprocessing's determinism is checked)."""
    from array_record.python import array_record_module

    digest = hashlib.sha256()
    directory = storage.local(directory)
    files = sorted(f for f in os.listdir(directory) if ".array_record" in f)
    if not files:
        raise FileNotFoundError(f"No ArrayRecord files in {directory}.")
    for name in files:
        reader = array_record_module.ArrayRecordReader(os.path.join(directory, name))
        for record in reader.read_all():
            digest.update(len(record).to_bytes(8, "little"))
            digest.update(record)
        reader.close()
    return digest.hexdigest()


def check_dims(metadata: dict, joint_attention_dim: int, pooled_projection_dim: int,
               where: str = "") -> None:
    """Raises when the stored embeddings do not fit the transformer's text inputs."""
    t5_dim, clip_dim = metadata.get("t5_dim"), metadata.get("clip_dim")
    problems = []
    if t5_dim != joint_attention_dim:
        problems.append(f"T5 states are {t5_dim}-d but the transformer's joint_attention_dim "
                        f"is {joint_attention_dim}")
    if clip_dim != pooled_projection_dim:
        problems.append(f"pooled CLIP embeddings are {clip_dim}-d but the transformer's "
                        f"pooled_projection_dim is {pooled_projection_dim}")
    if problems:
        raise ValueError(f"The prompt embeddings{f' in {where}' if where else ''} do not fit the "
                         f"transformer: {'; '.join(problems)}. Preprocess with the text encoders "
                         "that belong to this transformer (config.text.path), or load the "
                         "matching transformer (config.model.checkpoint).")
