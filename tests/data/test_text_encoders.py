"""The text encoders' folder checks and the devices a process encodes on (the real T5 and CLIP
encodings are compared to transformers' in tests/test_flux_path.py)."""

import jax
import pytest

from g2rpo_jax.data import text_encoders


def test_a_missing_encoders_folder_is_named_with_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere does not exist.*config.text.path"):
        text_encoders.encoder_identity(str(tmp_path / "nowhere"))


def test_multi_process_cpu_encodes_on_one_device(monkeypatch):
    """XLA:CPU sends in-process collectives through gloo once jax.distributed is up, and gloo
    mismatched them (see test_embedding_preparation.py's two-process test), so CPU processes of
    a multi-process run encode on one device; a single process keeps its whole local mesh."""
    assert text_encoders.encoder_devices() == jax.local_devices()
    assert len(jax.local_devices()) == 8
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    assert text_encoders.encoder_devices() == jax.local_devices()[:1]
