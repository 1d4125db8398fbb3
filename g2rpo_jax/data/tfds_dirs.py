"""Where TFDS datasets live when a config names no data_dir."""

import os


def default_data_dir() -> str:
    """TFDS's own default (~/tensorflow_datasets, or $TFDS_DATA_DIR), read at call time."""
    return os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
