"""FLUX prompt embeddings as TFDS ArrayRecord datasets: the record format, how records are
written (deterministically) and how they are read.

The RL job never runs the text encoders (T5-XXL alone is 4.8B parameters): `python -m
g2rpo_jax.preprocess` (g2rpo_jax.data.embedding_preparation) encodes a prompts file (HPDv2
style: one prompt per line) with FLUX.1's T5 (`text_encoder_2/`, all `t5_max_length` states, as
FluxPipeline feeds them) and CLIP-L text (`text_encoder/`, the pooled output) and writes one
dataset per prompts file:

  {"prompt": text, "index": int64 (0-based line number), "t5": [L, D], "clip_pooled": [Dy]}

stored in `storage_dtype` ("float32", or "bfloat16" kept bit-exact as its uint16 bit pattern:
TFDS cannot serialise bfloat16, and FLUX.1-dev's 512×4096 states are 4 MiB per prompt in it).
Records are serialized with sorted fields (`write`), so the same records always give the same
bytes (`records_digest`).

Where: `{data_dir}/prompt_embeddings/{name}/1.0.0/` (`dataset_dir`); a dataset's metadata holds
the fingerprint of its prompts, settings and encoder files (`stored_fingerprint`). With a gs://
data_dir a dataset is uploaded with `COMPLETE_LAST` last (so one cut short is never taken as
complete) and readers use their local copy (`storage.local`). Reading:

  source = load(dataset_dir(data_dir, name))      # random access, TensorFlow never imported
  source.metadata                                 # t5_dim, clip_dim, t5_max_length, ...
  reader = reader.Reader(source, global_batch, seed, rows=host_rows)   # {"prompt", "t5", ...}
"""

from collections.abc import Callable, Iterator, Sequence
import contextlib
import hashlib
import json
import os

import ml_dtypes
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.core import example_serializer

from g2rpo_jax.core import storage

BUILDER_NAME = "prompt_embeddings"
VERSION = "1.0.0"
SPLIT = "prompts"
STORAGE_DTYPES = ("float32", "bfloat16")
FEATURES = ("prompt", "index", "t5", "clip_pooled")
# A dataset's files that mark it complete, uploaded after its records (dataset_info.json last:
# readers check for it).
COMPLETE_LAST = ("features.json", "metadata.json", "dataset_info.json")


def dataset_dir(data_dir: str, name: str) -> str:
    """Where the dataset `name` lives under a TFDS data_dir."""
    return os.path.join(data_dir, BUILDER_NAME, name, VERSION)


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
# Writing.


class _BuilderConfig(tfds.core.BuilderConfig):
    def __init__(self, name: str, examples: Callable[[], Iterator] | None = None,
                 metadata: dict | None = None):
        super().__init__(
            name=name, version=VERSION,
            description="FLUX.1 prompt embeddings (g2rpo_jax.data.embedding_dataset).")
        self.examples, self.metadata = examples, dict(metadata or {})


class PromptEmbeddings(tfds.core.GeneratorBasedBuilder):
    """(prompt, T5 states, pooled CLIP) records of one prompts file."""

    VERSION = tfds.core.Version(VERSION)
    # TFDS wants one registered config; `write` always passes its own, named by the dataset.
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
        del dl_manager  # the records come from `examples`
        return {SPLIT: self._generate_examples()}

    def _generate_examples(self):
        yield from self.builder_config.examples()


@contextlib.contextmanager
def _deterministic_serialization():
    """Records are tf.train.Example protos whose features are a protobuf map, which protobuf
    serializes in hash order, and that order differs between processes (the same records
    written by two runs can differ only in the order of their fields). `deterministic=True`
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


def write(data_dir: str, name: str, metadata: dict, examples: Callable[[], Iterator]) -> None:
    """Builds the dataset `name` under a local TFDS data_dir (into a temporary folder, then
    renamed, as TFDS does).

    Args:
      data_dir: a local TFDS data_dir; the dataset goes to `dataset_dir(data_dir, name)`.
      name: the dataset's name.
      metadata: the dataset's metadata: storage_dtype, t5_max_length, t5_dim and clip_dim fix
        the features; all of it is stored (metadata.json).
      examples: `examples()` yields (key, {"prompt", "index", "t5", "clip_pooled"}) with the
        arrays already in the storage dtype (`to_storage`).
    """
    builder = PromptEmbeddings(config=_BuilderConfig(name, examples, metadata), data_dir=data_dir)
    with _deterministic_serialization():
        builder.download_and_prepare(file_format="array_record")


def stored_fingerprint(directory: str) -> str | None:
    """The fingerprint in a dataset's metadata, or None where no dataset is (yet)."""
    path = storage.path(os.path.join(directory, "metadata.json"))
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("fingerprint")


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
