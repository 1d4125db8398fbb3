"""The TFDS ArrayRecord dataset of the embedded world: build, random access, splits, per-host
shuffling and sharding, and the round trip through the verifier."""

import dataclasses

import numpy as np
import pytest

from g2rpo_jax.data import reader as reader_lib
from g2rpo_jax.data import shapes_tfds, world
from g2rpo_jax.rewards import verifier
from g2rpo_jax.run import config_lib

SETTINGS = shapes_tfds.ShapesConfig(images_per_prompt=2, render_seed=3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tfds"))


@pytest.fixture(scope="module")
def sources(data_dir):
    return {split: shapes_tfds.load_split(data_dir, split, SETTINGS)
            for split in shapes_tfds.SPLITS}


def _records(source):
    return [source[i] for i in range(len(source))]


def test_splits_hold_the_world_splits_and_share_no_prompt(sources):
    expected = world.split_prompts(SETTINGS.split_seed, SETTINGS.held_out_fraction)
    for split, source in sources.items():
        prompts = [r["prompt"].decode() for r in _records(source)]
        assert len(source) == SETTINGS.images_per_prompt * len(expected[split])
        assert sorted(set(prompts)) == expected[split]
        # Every prompt appears exactly images_per_prompt times.
        _, counts = np.unique(prompts, return_counts=True)
        assert set(counts) == {SETTINGS.images_per_prompt}
    train = {r["prompt"] for r in _records(sources["train"])}
    held = {r["prompt"] for r in _records(sources["held_out"])}
    assert not train & held


def test_every_stored_image_satisfies_its_prompt(sources):
    records = _records(sources["held_out"])[:120]
    images = np.stack([r["image"] for r in records])
    assert images.dtype == np.uint8 and images.shape[1:] == (32, 32, 3)
    scores = verifier.score_batch(images, [r["prompt"].decode() for r in records])
    np.testing.assert_array_equal(scores, 1.0)


def test_rebuilding_gives_the_same_bytes(tmp_path, sources):
    again = shapes_tfds.load_split(str(tmp_path), "held_out", SETTINGS)
    first = sorted((r["prompt"], r["image"].tobytes()) for r in _records(sources["held_out"]))
    second = sorted((r["prompt"], r["image"].tobytes()) for r in _records(again))
    assert first == second
    # Another render seed draws other scenes for the same prompts.
    other = shapes_tfds.load_split(str(tmp_path), "held_out", shapes_tfds.ShapesConfig(
        images_per_prompt=2, render_seed=4))
    third = sorted((r["prompt"], r["image"].tobytes()) for r in _records(other))
    assert [p for p, _ in third] == [p for p, _ in first] and third != first


def test_hosts_read_disjoint_rows_of_each_batch_that_cover_the_epoch(sources):
    """Hosts holding the rows {0, 3, 6, ...}, {1, 4, ...}, {2, 5, ...} of a global batch of
    21 (a layout the mesh can give): disjoint, the epoch covered once, each host's batch the
    one-host batch at its rows."""
    source = sources["held_out"]
    batch, hosts = 21, 3
    readers = [reader_lib.Reader(source, batch, seed=5, rows=range(h, batch, hosts))
               for h in range(hosts)]
    whole = reader_lib.Reader(source, batch, seed=5)
    per_epoch = len(source) // batch
    assert readers[0].batches_per_epoch == whole.batches_per_epoch == per_epoch
    seen = []
    for reader in readers:
        batches = [next(reader) for _ in range(per_epoch)]
        assert all(b["image"].shape == (batch // hosts, 32, 32, 3) for b in batches)
        seen.append([(p, img.tobytes()) for b in batches
                     for p, img in zip(b["prompt"], b["image"])])
    everything = [x for host in seen for x in host]
    assert len(set(everything)) == len(everything) == per_epoch * batch
    for a in range(hosts):
        for b in range(a + 1, hosts):
            assert not set(seen[a]) & set(seen[b])
    first = next(whole)
    assert seen[1][:batch // hosts] == [(first["prompt"][i], first["image"][i].tobytes())
                                        for i in range(1, batch, hosts)]
    # The next epoch is another permutation (same records, other order).
    next_epoch = [next(readers[0]) for _ in range(per_epoch)]
    again = [(p, img.tobytes()) for b in next_epoch for p, img in zip(b["prompt"], b["image"])]
    assert again != seen[0]


def test_reader_is_reproducible_from_its_seed(sources):
    a = reader_lib.Reader(sources["train"], 4, seed=1)
    b = reader_lib.Reader(sources["train"], 4, seed=1)
    c = reader_lib.Reader(sources["train"], 4, seed=2)
    first = [next(a)["prompt"] for _ in range(3)]
    assert first == [next(b)["prompt"] for _ in range(3)]
    assert first != [next(c)["prompt"] for _ in range(3)]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="The split has 0 records.*empty"):
        reader_lib.Reader([], 4)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        reader_lib.Reader([{"prompt": b"a red circle"}] * 3, 4)
    with pytest.raises(ValueError, match="are not rows of a batch of 4"):
        reader_lib.Reader([{"prompt": b"a red circle"}] * 8, 4, rows=[2, 4])
    with pytest.raises(ValueError, match="Unknown split 'test'"):
        shapes_tfds.load_split(None, "test", SETTINGS)
    with pytest.raises(ValueError, match="images_per_prompt must be at least 1"):
        shapes_tfds.ShapesConfig(images_per_prompt=0)


def test_placement_grid_reaches_the_stored_images(tmp_path):
    """The shapes configs' world.placement_grid flows into the dataset (its own folder name)
    and every stored object's box starts on the lattice 2 + 4·j."""
    settings = shapes_tfds.config_from(config_lib.shapes_config())
    assert settings.placement_grid == 4 and settings.name.endswith("_g4")
    assert SETTINGS.name != dataclasses.replace(SETTINGS, placement_grid=4).name
    source = shapes_tfds.load_split(str(tmp_path), "held_out", dataclasses.replace(
        SETTINGS, images_per_prompt=1, placement_grid=4))
    for record in _records(source)[:60]:
        for blob in verifier.detect_objects(record["image"]):
            top, left = blob.bbox[:2]
            assert (top - 2) % 4 == 0 and (left - 2) % 4 == 0, record["prompt"]
