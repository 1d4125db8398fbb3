"""Prompts files: lines, line endings, max_prompts and the errors."""

import pytest

from g2rpo_jax.data import prompts_file


def test_read_prompts(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("a red cat\r\nblue dog\nthird\n")
    assert prompts_file.read_prompts(str(path)) == ["a red cat", "blue dog", "third"]
    assert prompts_file.read_prompts(str(path), max_prompts=2) == ["a red cat", "blue dog"]
    path.write_text("a\nb\n\nc\n   \n")
    with pytest.raises(ValueError, match=r"blank lines \(line 3 and 1 more\)"):
        prompts_file.read_prompts(str(path))
    # Only the lines used count.
    assert prompts_file.read_prompts(str(path), max_prompts=2) == ["a", "b"]
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        prompts_file.read_prompts(str(path))
    with pytest.raises(FileNotFoundError, match="config.data.prompts_file"):
        prompts_file.read_prompts(str(tmp_path / "missing.txt"))
