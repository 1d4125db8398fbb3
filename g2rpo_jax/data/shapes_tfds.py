"""The embedded world as a tensorflow-datasets dataset in ArrayRecord format (no TensorFlow).

Each record is one rendered image of one prompt: {"image": uint8 [S, S, 3], "prompt": bytes}.
Splits "train" and "held_out" are `world.split_prompts(split_seed, held_out_fraction)`, so they
share no prompt (nor a mirrored paraphrase of one); each prompt is rendered
`images_per_prompt` times with a numpy generator seeded from (render_seed, prompt index), so a
rebuild gives the same bytes.

  builder_config = config_from(config)                # from a run config's world/data fields
  source = load_split(data_dir, "train", builder_config)   # builds on first use
  reader = Reader(source, batch_size=global_batch, seed=0, rows=host_rows)
  batch = next(reader)    # {"image": uint8 [R, S, S, 3], "prompt": [R] str}

`Reader` (data/reader.py) shuffles every epoch with one permutation shared by all hosts and
gives each host its rows of every global batch. Records are read by random access
(`as_data_source`); tensorflow is never imported.
"""

import dataclasses
import os
import shutil

import jax
import numpy as np
import tensorflow_datasets as tfds

from g2rpo_jax.core import storage
from g2rpo_jax.data import tfds_dirs, world

VERSION = "1.0.0"
SPLITS = ("train", "held_out")


@dataclasses.dataclass(frozen=True)
class ShapesConfig:
    """What a built dataset holds; its `name` keys the dataset's folder, so datasets of
    different settings live side by side in one data_dir."""

    image_size: int = world.REFERENCE_CANVAS
    split_seed: int = 0
    held_out_fraction: float = 0.2
    images_per_prompt: int = 16
    render_seed: int = 0
    placement_grid: int = 1  # world.sample_scene's grid

    def __post_init__(self):
        if self.images_per_prompt < 1:
            raise ValueError(f"images_per_prompt must be at least 1; got "
                             f"{self.images_per_prompt}.")

    @property
    def name(self) -> str:
        return (f"s{self.image_size}_split{self.split_seed}_held{self.held_out_fraction:g}"
                f"_n{self.images_per_prompt}_r{self.render_seed}"
                + (f"_g{self.placement_grid}" if self.placement_grid != 1 else ""))


def config_from(config) -> ShapesConfig:
    """The dataset settings of a run config (`world` and `data` sections)."""
    return ShapesConfig(image_size=config.world.image_size, split_seed=config.world.split_seed,
                        held_out_fraction=config.world.held_out_fraction,
                        images_per_prompt=config.data.images_per_prompt,
                        render_seed=config.data.render_seed,
                        placement_grid=config.world.get("placement_grid", 1))


class _BuilderConfig(tfds.core.BuilderConfig):
    def __init__(self, settings: ShapesConfig, name: str | None = None):
        super().__init__(name=name or settings.name, version=VERSION,
                         description="The embedded shapes world (g2rpo_jax.data.world).")
        self.settings = settings


class ShapesWorld(tfds.core.GeneratorBasedBuilder):
    """Rendered (image, prompt) pairs of the embedded world."""

    VERSION = tfds.core.Version(VERSION)
    # TFDS wants one registered config; `builder` always passes a custom one, named by its
    # settings (so never "registered").
    BUILDER_CONFIGS = [_BuilderConfig(ShapesConfig(), name="registered")]

    def _info(self) -> tfds.core.DatasetInfo:
        size = self.builder_config.settings.image_size
        return self.dataset_info_from_configs(
            features=tfds.features.FeaturesDict({
                # A plain uint8 tensor: encoding an Image feature would need PNG codecs.
                "image": tfds.features.Tensor(shape=(size, size, 3), dtype=np.uint8),
                "prompt": tfds.features.Text(),
            }),
            description=__doc__)

    def _split_generators(self, dl_manager):
        del dl_manager  # everything is rendered, nothing downloaded
        s = self.builder_config.settings
        splits = world.split_prompts(s.split_seed, s.held_out_fraction)
        return {name: self._generate_examples(splits[name]) for name in SPLITS}

    def _generate_examples(self, prompts):
        s = self.builder_config.settings
        index = {p: i for i, p in enumerate(world.all_prompts())}
        for prompt in prompts:
            rng = np.random.default_rng((s.render_seed, index[prompt]))
            for j in range(s.images_per_prompt):
                yield f"{index[prompt]}_{j}", {
                    "image": world.render_prompt(prompt, rng, s.image_size, s.placement_grid),
                    "prompt": prompt}


def builder(data_dir: str | None, settings: ShapesConfig) -> ShapesWorld:
    return ShapesWorld(config=_BuilderConfig(settings),
                       data_dir=data_dir or tfds_dirs.default_data_dir())


def load_split(data_dir: str | None, split: str, settings: ShapesConfig):
    """A random-access source of one split (built first if absent; the build is atomic:
    TFDS writes to a temporary folder and renames it). Only process 0 builds; the others wait
    for it and then read the same files (data_dir must be shared on a multi-host job).

    A gs:// data_dir: the dataset is built in the download cache (`storage.mirror`) and
    uploaded, dataset_info.json last; every process reads its local copy (`storage.local`)."""
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; the splits are {SPLITS}.")
    remote = data_dir if data_dir and storage.is_remote(data_dir) else None
    local_dir = storage.mirror(remote) if remote else data_dir
    b = builder(local_dir, settings)
    # The dataset's folder below data_dir: <name>/<config>/<version>.
    relative = os.path.relpath(b.data_dir, storage.mirror(remote)) if remote else ""
    if jax.process_index() == 0:
        if remote and not storage.path(f"{remote}/{relative}/dataset_info.json").exists():
            shutil.rmtree(b.data_dir, ignore_errors=True)   # built afresh, then uploaded
            b.download_and_prepare(file_format="array_record")
            storage.upload_tree(b.data_dir, f"{remote}/{relative}",
                                last=("features.json", "dataset_info.json"))
        elif not remote:
            b.download_and_prepare(file_format="array_record")
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("shapes_tfds built")
    if remote:
        storage.local(f"{remote}/{relative}")
    b = builder(local_dir, settings)  # re-read the info process 0 wrote (or downloaded)
    source = b.as_data_source(split=split)
    if len(source) == 0:
        raise ValueError(f"The {split!r} split of {b.data_dir} is empty: check "
                         "world.held_out_fraction and data.images_per_prompt.")
    return source
