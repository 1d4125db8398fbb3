r"""Prompt preprocessing for FLUX RL: encode the prompts files once with T5 and CLIP and write
the TFDS ArrayRecord datasets the RL job and the evaluation read
(g2rpo_jax.data.embedding_preparation, g2rpo_jax.data.embedding_dataset).

  python -m g2rpo_jax.preprocess --config=configs/flux_tiny.py \
      [--config.data.prompts_file=F] [--config.data.eval_prompts_file=E] [--config.x.y=...]

Reads config.data.prompts_file (its first data.max_prompts lines; 0 = all) and, if set,
config.data.eval_prompts_file (first data.max_eval_prompts), with the text encoders of
config.text.path (default: config.model.checkpoint, a FLUX.1 folder), and writes
data_dir/prompt_embeddings/<name>/ for each. Resumable: run it again after an interruption and
finished chunks are kept. On a multi-host job (--config.distributed.enabled=True) every process
runs this command and encodes its share; data_dir must be shared.
"""

import functools
import json
import time

from absl import app, flags, logging

from g2rpo_jax import parallel
from g2rpo_jax.core import storage
from g2rpo_jax.data import embedding_dataset, embedding_preparation, text_encoders
from g2rpo_jax.run import config_lib

_FLAGS = {}


def define_flags() -> None:
    """Command-line flags, defined only when run as a program (so that importing this module
    next to another entry point does not define --config twice)."""
    _FLAGS["config"] = config_lib.define_config_flag()
    flags.mark_flags_as_required(["config"])


def transformer_dims(checkpoint: str) -> tuple[int, int] | None:
    """(joint_attention_dim, pooled_projection_dim) of the transformer the embeddings are for,
    or None when no transformer is configured (then nothing is checked)."""
    if not checkpoint:
        return None
    from g2rpo_jax.models import flux, flux_weights

    if storage.is_remote(checkpoint):
        # A diffusers folder's config.json is read in place: the weights are not needed here.
        checkpoint = checkpoint.rstrip("/")
        for config_file in (f"{checkpoint}/transformer/config.json", f"{checkpoint}/config.json"):
            if storage.path(config_file).exists():
                cfg = flux.FluxConfig.from_dict(json.loads(storage.path(config_file).read_text()))
                return cfg.joint_attention_dim, cfg.pooled_projection_dim
        checkpoint = storage.local(checkpoint)   # a BFL single file
    cfg = flux_weights.load_config(checkpoint)
    return cfg.joint_attention_dim, cfg.pooled_projection_dim


def preprocess(config) -> dict[str, str]:
    """Prepares the datasets of a FLUX config; returns {"train": dir, "eval": dir (if set)}."""
    if config.get("task", "flux") != "flux":
        raise ValueError(f"Preprocessing is for the FLUX task; this config's task is "
                         f"{config.task!r} (the shapes world builds its own dataset).")
    for section in ("data", "text"):
        if section not in config:
            raise ValueError(f"The config has no `{section}` section: FLUX configs start from "
                             "config_lib.flux_config() (see configs/flux_tiny.py).")
    specs = embedding_preparation.specs_from_config(config)
    dims = transformer_dims(config.model.checkpoint)

    def check(t5_dim: int, clip_dim: int) -> None:
        if dims is not None:
            embedding_dataset.check_dims({"t5_dim": t5_dim, "clip_dim": clip_dim}, *dims,
                                         where=f"the encoders of {specs['train'].encoders}")

    first = specs["train"]
    # Loaded once, only if some chunk is left to encode, and shared by both datasets.
    load_encoders = functools.cache(lambda: text_encoders.TextEncoders(
        text_encoders.local_encoders(first.encoders), first.t5_max_length,
        first.clip_max_length, first.encoder_dtype))
    return {role: embedding_preparation.prepare(
        spec, config.data.data_dir or None, config.data.chunk_size, config.data.keep_chunks,
        load_encoders=load_encoders, validate_dims=check) for role, spec in specs.items()}


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _FLAGS["config"].value
    parallel.initialize_distributed(config.distributed)
    start = time.perf_counter()
    directories = preprocess(config)
    digests = {}
    for role, directory in directories.items():
        digests[role] = embedding_dataset.records_digest(directory)
        source = embedding_dataset.load(directory)
        meta = source.metadata
        logging.info("%s: %d prompts, T5 [%d, %d] and CLIP [%d] as %s in %s.", role, len(source),
                     meta["t5_max_length"], meta["t5_dim"], meta["clip_dim"],
                     meta["storage_dtype"], directory)
    # The digest identifies the records' bytes: preprocessing again gives the same one.
    print(json.dumps({"datasets": directories, "records_sha256": digests,
                      "seconds": round(time.perf_counter() - start, 1)}, indent=2), flush=True)


if __name__ == "__main__":
    define_flags()
    app.run(main)
