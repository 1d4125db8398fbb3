"""Conditioning without downloads: a word-level tokenizer and a learned word encoder.

The embedded world's prompts use a small closed vocabulary, so instead of T5 + CLIP the text
stream gets learned token (+ position) embeddings, and the pooled vector is a projection of
their masked mean. The encoder returns the same conditioning dict the FLUX path builds from
T5/CLIP embeddings, so the rollout and update code cannot tell them apart:

  {"txt": [P, T, D_txt], "y": [P, D_pooled], "txt_ids": [T, 3]}
"""

from collections.abc import Sequence

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

PAD = "<pad>"


class WordTokenizer:
    """Whitespace word tokenizer over a fixed vocabulary; id 0 is padding."""

    def __init__(self, vocabulary: Sequence[str], max_length: int):
        words = list(dict.fromkeys(vocabulary))
        if PAD in words:
            raise ValueError(f"The vocabulary may not contain the padding token {PAD!r}.")
        self.vocabulary = [PAD, *words]
        self.ids = {w: i for i, w in enumerate(self.vocabulary)}
        self.max_length = max_length

    @property
    def vocab_size(self) -> int:
        return len(self.vocabulary)

    def encode(self, prompts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """Prompts → (ids [P, T] int32, mask [P, T] bool). Unknown words are an error."""
        ids = np.zeros((len(prompts), self.max_length), np.int32)
        for row, prompt in enumerate(prompts):
            words = prompt.lower().split()
            unknown = [w for w in words if w not in self.ids]
            if unknown:
                raise ValueError(f"Unknown word(s) {unknown} in prompt {prompt!r}; the vocabulary "
                                 f"is {self.vocabulary[1:]}.")
            if len(words) > self.max_length:
                raise ValueError(f"Prompt {prompt!r} has {len(words)} words; the tokenizer's "
                                 f"max_length is {self.max_length}.")
            ids[row, :len(words)] = [self.ids[w] for w in words]
        return ids, ids != 0

    def decode(self, ids: np.ndarray) -> list[str]:
        return [" ".join(self.vocabulary[i] for i in row if i != 0) for row in np.asarray(ids)]


class WordEncoder(nnx.Module):
    """Token + position embeddings → txt [P, T, D]; masked mean → Linear → y [P, D_pooled]."""

    def __init__(self, vocab_size: int, max_length: int, txt_dim: int, pooled_dim: int, *,
                 rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.token = nnx.Param(init(rngs.params(), (vocab_size, txt_dim)),
                               logical_axes=(None, None))
        self.position = nnx.Param(init(rngs.params(), (max_length, txt_dim)),
                                  logical_axes=(None, None))
        self.pooled = nnx.Linear(txt_dim, pooled_dim, rngs=rngs,
                                 kernel_metadata={"logical_axes": (None, None)},
                                 bias_metadata={"logical_axes": (None,)})

    def __call__(self, ids: jax.Array, mask: jax.Array) -> dict:
        """ids, mask [P, T] → {"txt": [P, T, D], "y": [P, D_pooled], "txt_ids": [T, 3]}."""
        m = mask.astype(jnp.float32)[..., None]
        txt = (self.token[...][ids] + self.position[...][None, :ids.shape[1]]) * m
        mean = txt.sum(1) / jnp.maximum(m.sum(1), 1.0)
        return {"txt": txt, "y": self.pooled(mean),
                "txt_ids": jnp.zeros((ids.shape[1], 3), jnp.float32)}
