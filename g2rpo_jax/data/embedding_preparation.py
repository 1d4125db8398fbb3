"""Preparing the FLUX prompt-embedding datasets (g2rpo_jax.data.embedding_dataset): what a
dataset is (`EmbeddingSpec`, from a run config by `specs_from_config`), its fingerprint, and
`prepare`, which encodes the prompts across hosts in resumable chunks and assembles them.

Preparation, `prepare(spec, data_dir, ...)`:
  1. encode: the prompts are cut into chunks of `chunk_size`; process h of H encodes chunks
     h, h + H, ... on its own devices and writes each as one .npz, atomically (temporary file,
     then rename). Finished chunks are skipped, so an interrupted run continues where it stopped.
  2. assemble: after a barrier, process 0 writes the ArrayRecord dataset from the chunks in
     order (TFDS builds into a temporary folder and renames it), then the chunks are removed
     (unless keep_chunks). Every process then reads the same dataset (data_dir must be shared).
Preparing twice gives byte-identical records (`embedding_dataset.records_digest`): encoding is
deterministic for a given chunk size and device layout (fixed chunk shapes, one program), and
records are serialized with sorted fields. Another device layout may change the last bits of a
few values.

Every path may be a gs:// URL (g2rpo_jax.core.storage). With a gs:// data_dir the chunks are objects
there, process 0 assembles the dataset in the download cache (`storage.mirror`) and uploads it,
`dataset_info.json` last (so a dataset cut short is never taken as complete), and readers use
their local copy (`storage.local`); gs:// encoders are downloaded once into that cache.

A dataset's metadata holds the fingerprint of its prompts, settings and encoder files
(`fingerprint`); preparing another prompts file or other settings under the same name is an
error (not a silent rebuild).
"""

from collections.abc import Sequence
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time

from absl import logging
import jax
import numpy as np
import tqdm

from g2rpo_jax.core import storage
from g2rpo_jax.data import embedding_dataset, prompts_file, text_encoders, tfds_dirs

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
        if self.storage_dtype not in embedding_dataset.STORAGE_DTYPES:
            raise ValueError(f"Unknown storage dtype {self.storage_dtype!r}; use one of "
                             f"{embedding_dataset.STORAGE_DTYPES} (config.data.storage_dtype).")
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


def fingerprint(spec: EmbeddingSpec, prompts: Sequence[str], identity: dict) -> str:
    """sha256 of everything that determines the records (not where the files live);
    `identity` is `text_encoders.encoder_identity` of the encoders folder."""
    fields = {k: v for k, v in dataclasses.asdict(spec).items()
              if k not in ("name", "prompts_file", "encoders", "max_prompts")}
    blob = json.dumps({"prompts": list(prompts), "settings": fields, "encoders": identity},
                      sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Chunks.


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
      encode: `encode(prompts) -> (t5 [n, L, D], clip_pooled [n, Dy])`
        (`text_encoders.TextEncoders.encode`).
      chunk_dir: where chunk files go (shared by the hosts).
      chunk_size: prompts per chunk (C).
      storage_dtype: see `embedding_dataset.to_storage`.
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
            np.savez(f, t5=embedding_dataset.to_storage(t5_states, storage_dtype),
                     clip_pooled=embedding_dataset.to_storage(pooled, storage_dtype))
        bar.update(len(lines))
    bar.close()
    return todo


def chunk_examples(prompts: Sequence[str], chunk_dir: str, chunk_size: int):
    """Yields (key, record) of every prompt in prompts-file order, from the chunk files in a
    local `chunk_dir` (`embedding_dataset.write`'s examples)."""
    for chunk in range(num_chunks(len(prompts), chunk_size)):
        path = chunk_path(chunk_dir, chunk)
        if not os.path.exists(path):
            raise FileNotFoundError(
                f"Chunk {chunk} ({path}) is missing: a process did not finish encoding. "
                "Run the preprocess command again; finished chunks are kept.")
        with np.load(path) as arrays:
            t5_states, pooled = arrays["t5"], arrays["clip_pooled"]
        start = chunk * chunk_size
        for j, prompt in enumerate(prompts[start:start + chunk_size]):
            yield start + j, {"prompt": prompt, "index": start + j, "t5": t5_states[j],
                              "clip_pooled": pooled[j]}


# ---------------------------------------------------------------------------------------------
# Preparation.


def _barrier(name: str, process_count: int) -> None:
    if process_count > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


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
        the transformer (e.g. `embedding_dataset.check_dims`), called before anything is loaded
        or encoded.

    Raises:
      ValueError: the dataset `spec.name` exists with other prompts or settings.
    """
    start = time.perf_counter()
    data_dir = data_dir or tfds_dirs.default_data_dir()
    h = jax.process_index() if process_index is None else process_index
    count = jax.process_count() if process_count is None else process_count
    prompts = prompts_file.read_prompts(spec.prompts_file, spec.max_prompts)
    encoders_dir = text_encoders.local_encoders(spec.encoders)
    identity = text_encoders.encoder_identity(encoders_dir)
    digest = fingerprint(spec, prompts, identity)
    target = embedding_dataset.dataset_dir(data_dir, spec.name)
    found = embedding_dataset.stored_fingerprint(target)
    if found == digest:
        logging.info("Prompt embeddings %s are already prepared (%d prompts).", target,
                     len(prompts))
        return target
    if found is not None:
        raise ValueError(
            f"{target} holds embeddings of other prompts or settings (fingerprint {found[:12]}, "
            f"wanted {digest[:12]} for {spec.prompts_file}). Delete that folder, or set "
            "config.data.name / eval_name to another name.")
    chunk_dir = os.path.join(data_dir, f"{embedding_dataset.BUILDER_NAME}_chunks",
                             f"{spec.name}-{digest[:16]}-c{chunk_size}")
    # Checked from the config files, before minutes of loading T5-XXL.
    dims = text_encoders.encoder_dims(encoders_dir)
    if validate_dims is not None:
        validate_dims(*dims)
    total = num_chunks(len(prompts), chunk_size)
    left = [c for c in range(h, total, count)
            if not storage.path(chunk_path(chunk_dir, c)).exists()]
    encoders = None
    if left:
        encoders = (load_encoders() if load_encoders is not None else text_encoders.TextEncoders(
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
        local_chunks = storage.local(chunk_dir)
        embedding_dataset.write(build_dir, spec.name, metadata,
                                lambda: chunk_examples(prompts, local_chunks, chunk_size))
        if storage.is_remote(data_dir):
            storage.upload_tree(storage.mirror(target), target,
                                last=embedding_dataset.COMPLETE_LAST)
        if not keep_chunks:
            storage.remove(chunk_dir)
            if storage.is_remote(chunk_dir):
                shutil.rmtree(storage.mirror(chunk_dir), ignore_errors=True)
    _barrier(f"prompt_embeddings assembled {spec.name}", count)
    logging.info("Prompt embeddings: %d prompts of %s → %s in %.1f s.", len(prompts),
                 spec.prompts_file, target, time.perf_counter() - start)
    return target
