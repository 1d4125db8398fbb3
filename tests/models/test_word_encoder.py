"""Word tokenizer and learned word encoder."""

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest

from g2rpo_jax.models import word_encoder

VOCAB = ["a", "red", "blue", "circle", "circles", "two", "left", "of", "square"]


def test_tokenizer_round_trip_and_padding():
    tok = word_encoder.WordTokenizer(VOCAB, max_length=6)
    ids, mask = tok.encode(["two red circles", "a blue square left of a red circle"[:22]])
    assert tok.vocab_size == len(VOCAB) + 1
    np.testing.assert_array_equal(ids[0], [6, 2, 5, 0, 0, 0])     # hand-computed: pad is 0
    np.testing.assert_array_equal(mask[0], [True, True, True, False, False, False])
    assert tok.decode(ids) == ["two red circles", "a blue square left of"]


def test_tokenizer_errors_name_the_problem():
    tok = word_encoder.WordTokenizer(VOCAB, max_length=3)
    with pytest.raises(ValueError, match=r"Unknown word\(s\) \['green'\] in prompt 'two green circles'"):
        tok.encode(["two green circles"])
    with pytest.raises(ValueError, match="has 4 words; the tokenizer's max_length is 3"):
        tok.encode(["a red circle left"])
    with pytest.raises(ValueError, match="padding token"):
        word_encoder.WordTokenizer(["<pad>", "a"], 3)


def test_encoder_ignores_padding_and_keeps_the_conditioning_layout():
    tok = word_encoder.WordTokenizer(VOCAB, max_length=5)
    enc = word_encoder.WordEncoder(tok.vocab_size, 5, txt_dim=8, pooled_dim=4, rngs=nnx.Rngs(0))
    ids, mask = tok.encode(["two red circles", "a blue square"])
    cond = enc(jnp.asarray(ids), jnp.asarray(mask))
    assert cond["txt"].shape == (2, 5, 8) and cond["y"].shape == (2, 4)
    assert cond["txt_ids"].shape == (5, 3)
    np.testing.assert_array_equal(np.asarray(cond["txt"])[0, 3:], 0.0)   # padded positions
    # The pooled vector is the projection of the mean over real tokens only (hand formula).
    token, position = np.asarray(enc.token[...]), np.asarray(enc.position[...])
    mean = (token[ids[0, :3]] + position[:3]).mean(0)
    expected = mean @ np.asarray(enc.pooled.kernel[...]) + np.asarray(enc.pooled.bias[...])
    np.testing.assert_allclose(np.asarray(cond["y"])[0], expected, rtol=1e-5, atol=1e-6)
