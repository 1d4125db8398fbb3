"""FLUX.1's CLIP text encoder (`text_encoder/`, a transformers CLIPTextModel) and its tokenizer.

A thin layer over `models.clip` (the one CLIP implementation) and `models.clip_weights`:

  model = from_pretrained("<FLUX.1-dev>/text_encoder")   # or the FLUX.1-dev folder itself
  tokenizer = load_tokenizer("<FLUX.1-dev>/tokenizer")
  last_hidden_state [B, 77, 768], pooled [B, 768] = model(tokenize(tokenizer, prompts))

FLUX uses `pooled` (the final-LayerNormed end-of-text token) as its `y` / pooled projection.
The tokenizer is transformers' CLIPTokenizer, read from a local folder (vocab.json + merges.txt
or tokenizer.json); `tokenizer_from_open_clip_bpe` builds the same tokenizer from OpenCLIP's
`bpe_simple_vocab_16e6.txt.gz` (the same BPE, so the same ids).
"""

import gzip
import os
from pathlib import Path

import jax
import numpy as np

from g2rpo_jax.models import clip, clip_weights
from g2rpo_jax.parallel import sharding as sharding_lib

CONTEXT_LENGTH = 77


def from_pretrained(path: str | os.PathLike, dtype: str | None = None, *,
                    mesh: jax.sharding.Mesh | None = None, rules=sharding_lib.DEFAULT_RULES,
                    **overrides) -> clip.TextTransformer:
    """Loads a CLIP text tower: `model(input_ids [B, T]) -> (last_hidden_state, pooled)`.

    Args:
      path: a transformers CLIPTextModel folder (FLUX.1-dev's `text_encoder/`), a folder that
        contains `text_encoder/`, or any CLIP checkpoint `clip_weights.from_pretrained` reads
        (its text tower is taken, the rest ignored).
      dtype, mesh, rules, **overrides: as for `clip_weights.from_pretrained`.
    """
    path = Path(os.fspath(path))
    if path.is_dir() and (path / "text_encoder").is_dir():
        path = path / "text_encoder"
    model = clip_weights.from_pretrained(path, towers=("text",), dtype=dtype, mesh=mesh,
                                         rules=rules, **overrides)
    return model.text_model


def load_tokenizer(path: str | os.PathLike):
    """transformers' CLIPTokenizer from a local folder (FLUX.1-dev's `tokenizer/`), or from an
    OpenCLIP `bpe_simple_vocab_16e6.txt.gz` file."""
    path = Path(os.fspath(path))
    if path.is_file() and path.name.endswith((".txt.gz", ".txt")):
        return tokenizer_from_open_clip_bpe(path)
    if path.is_dir() and (path / "tokenizer").is_dir() and not (path / "vocab.json").exists():
        path = path / "tokenizer"
    if not path.is_dir():
        raise FileNotFoundError(f"No tokenizer at {path}: give a folder with vocab.json + "
                                "merges.txt (or tokenizer.json), e.g. FLUX.1-dev's tokenizer/, or "
                                "OpenCLIP's bpe_simple_vocab_16e6.txt.gz.")
    from transformers import CLIPTokenizer

    return CLIPTokenizer.from_pretrained(str(path), local_files_only=True)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP's reversible byte → printable character table."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def tokenizer_from_open_clip_bpe(path: str | os.PathLike):
    """transformers' CLIPTokenizer with OpenCLIP's vocabulary, from its BPE merges file.

    The vocabulary is built in OpenCLIP's order: the 256 byte symbols, the same with the
    end-of-word mark "</w>", one token per merge (the first 48,894 merges), then
    <|startoftext|> (49406) and <|endoftext|> (49407).
    """
    from transformers import CLIPTokenizer

    path = Path(os.fspath(path))
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        lines = f.read().split("\n")
    # OpenCLIP keeps merges [1, 49152 - 256 - 2 + 1) (line 0 is a version header).
    merges = [tuple(line.split()) for line in lines[1:49152 - 256 - 2 + 1]]
    symbols = list(_bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols] + ["".join(m) for m in merges]
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {token: i for i, token in enumerate(vocab_list)}
    return CLIPTokenizer(vocab=vocab, merges=merges)


def tokenize(tokenizer, prompts: list[str] | str, max_length: int = CONTEXT_LENGTH) -> np.ndarray:
    """Token ids [B, max_length] int32: <|startoftext|> prompt <|endoftext|>, truncated to
    max_length (the end token kept) and padded with the tokenizer's pad token, as FLUX's
    pipeline tokenizes (padding="max_length", truncation=True)."""
    if isinstance(prompts, str):
        prompts = [prompts]
    encoded = tokenizer(list(prompts), padding="max_length", max_length=max_length,
                        truncation=True, return_tensors="np")
    return np.asarray(encoded["input_ids"], dtype=np.int32)
