"""The embedding dataset format: storage dtypes, reading errors, the transformer's dims (datasets
are written and read back in test_embedding_preparation.py)."""

import ml_dtypes
import numpy as np
import pytest

from g2rpo_jax.data import embedding_dataset


def test_bfloat16_storage_is_lossless_for_bfloat16_values():
    x = np.random.default_rng(0).normal(size=(3, 7)).astype(np.float32) * 100
    stored = embedding_dataset.to_storage(x, "bfloat16")
    assert stored.dtype == np.uint16
    back = embedding_dataset.from_storage(stored, "bfloat16")
    assert back.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(back, x.astype(ml_dtypes.bfloat16))
    np.testing.assert_array_equal(embedding_dataset.from_storage(
        embedding_dataset.to_storage(x, "float32"), "float32"), x)


def test_errors_name_the_problem_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="joint_attention_dim is 64.*config.text.path"):
        embedding_dataset.check_dims({"t5_dim": 4, "clip_dim": 6}, 64, 6)
    with pytest.raises(ValueError, match="pooled_projection_dim is 32"):
        embedding_dataset.check_dims({"t5_dim": 4, "clip_dim": 6}, 4, 32)
    with pytest.raises(FileNotFoundError, match=r"No prepared prompt embeddings.*preprocess"):
        embedding_dataset.load(str(tmp_path / "nothing"))
