"""Prompts files (HPDv2 style: one prompt per line), as the FLUX path reads them."""

from g2rpo_jax.core import storage


def read_prompts(path: str, max_prompts: int = 0) -> list[str]:
    """The first `max_prompts` lines of a prompts file (0 = all), each one prompt.

    Raises:
      FileNotFoundError: no file at path.
      ValueError: an empty file, or a blank line among the lines used (named by line number:
        a blank line would silently shift every later prompt's index).
    """
    if not path:
        raise FileNotFoundError("No prompts file given: set config.data.prompts_file (and "
                                "config.data.eval_prompts_file for evaluation) to a text file "
                                "with one prompt per line.")
    if not storage.path(path).is_file():
        raise FileNotFoundError(f"No prompts file at {path}: set config.data.prompts_file / "
                                "eval_prompts_file to a text file with one prompt per line.")
    text = storage.path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    if not lines:
        raise ValueError(f"The prompts file {path} is empty: it needs one prompt per line.")
    if max_prompts > 0:
        lines = lines[:max_prompts]
    prompts = [line.rstrip("\r") for line in lines]
    blank = [i + 1 for i, p in enumerate(prompts) if not p.strip()]
    if blank:
        raise ValueError(f"The prompts file {path} has blank lines (line {blank[0]}"
                         f"{f' and {len(blank) - 1} more' if len(blank) > 1 else ''}): every line "
                         "must hold one prompt. Remove the blank lines.")
    return prompts
