r"""Export a fine-tuned FLUX transformer for diffusers, ComfyUI and BFL's code.

  python -m g2rpo_jax.export --config=configs/flux_dev.py --checkpoint=WORKDIR --out=DIR \
      [--format=diffusers|bfl] [--dtype=bfloat16] [--pipeline=none|link|copy] \
      [--max_shard_size=10GB] [--overwrite] [--config.x.y=...]

`--checkpoint`: an Orbax checkpoint written by mode=train (the training workdir, its
checkpoints/ folder for the latest step, or one step's folder); the architecture and, with LoRA
(model.lora.rank > 0), the base weights the adapters are merged into come from
config.model.checkpoint, as in training. A pretrained transformer (a diffusers folder or a BFL
file) is accepted too, which converts between the layouts and dtypes.

What DIR holds:

  diffusers   DIR/transformer/: config.json and the weights as diffusers'
              `FluxTransformer2DModel.save_pretrained` writes them (one
              diffusion_pytorch_model.safetensors, or shards of at most --max_shard_size with
              diffusion_pytorch_model.safetensors.index.json). With --pipeline=link|copy, the
              other components of config.model.checkpoint's FLUX.1 folder (model_index.json,
              scheduler/, vae/, text encoders, tokenizers) are linked or copied beside it, so
              DIR loads with `FluxPipeline.from_pretrained(DIR)`.
  bfl         DIR/<--name>.safetensors in BFL's flux1-*.safetensors layout (fused qkv, fused
              single-block linears): what ComfyUI's diffusion_models/ folder and BFL's flux
              code load.
  export.json what was exported from where, in which dtype, and the tensors' total size.

Tensors are gathered from the devices and written one at a time (`flux_weights.stored_tensors`,
`safetensors_io.stream_safetensors`), so host memory holds one tensor beyond the model (on an
accelerator the model is in device memory; on CPU it is host memory, once). The export is
written to a temporary folder beside DIR and renamed into place when complete, so a failure
(a full disk) leaves no folder that looks like an export; on gs:// the files are written in
place with config.json, the index and export.json last, and removed again on failure.
"""

import json
import os
import re
import shutil
import sys
import time
import uuid

from absl import app, flags, logging
from flax import nnx
import jax
import numpy as np

from g2rpo_jax import parallel
from g2rpo_jax.core import storage
from g2rpo_jax.models import execution, flux, flux_weights, lora, safetensors_io
from g2rpo_jax.parallel import sharding as sharding_lib
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib
from g2rpo_jax.tasks import flux as flux_task

FORMATS = flux_weights.LAYOUTS
PIPELINE_MODES = ("none", "link", "copy")
DTYPES = ("bfloat16", "float16", "float32")
# The FLUX.1 folder's components other than the transformer; model_index.json, which makes the
# folder a pipeline for diffusers, last.
PIPELINE_COMPONENTS = ("scheduler", "vae", "text_encoder", "text_encoder_2", "tokenizer",
                       "tokenizer_2", "model_index.json")
WEIGHTS_NAME = "diffusion_pytorch_model"
REPORT = "export.json"

_FLAGS = {}


def define_flags() -> None:
    """Command-line flags, defined only when run as a program."""
    _FLAGS["config"] = config_lib.define_config_flag()
    _FLAGS["checkpoint"] = flags.DEFINE_string(
        "checkpoint", None, "An Orbax checkpoint of mode=train (workdir, checkpoints/ or a "
        "step), or a pretrained transformer (diffusers folder / BFL file).")
    _FLAGS["out"] = flags.DEFINE_string("out", None, "The folder to write (local or gs://).")
    _FLAGS["format"] = flags.DEFINE_enum("format", "diffusers", FORMATS, "The weights' layout.")
    _FLAGS["dtype"] = flags.DEFINE_enum("dtype", "bfloat16", DTYPES, "The stored dtype.")
    _FLAGS["pipeline"] = flags.DEFINE_enum(
        "pipeline", "none", PIPELINE_MODES, "diffusers: also link or copy the other pipeline "
        "components of config.model.checkpoint beside transformer/.")
    _FLAGS["max_shard_size"] = flags.DEFINE_string(
        "max_shard_size", "10GB", "diffusers: the largest weight file (e.g. 10GB, 500MB).")
    _FLAGS["name"] = flags.DEFINE_string("name", "flux1-g2rpo", "bfl: the file's name.")
    _FLAGS["overwrite"] = flags.DEFINE_bool("overwrite", False, "Replace an existing --out.")
    flags.mark_flags_as_required(["config", "checkpoint", "out"])


def parse_size(size: str | int) -> int:
    """Bytes of "10GB", "500MB", "2GiB" or a plain number (diffusers' decimal units)."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", size, re.IGNORECASE)
    if not match:
        raise ValueError(f"Cannot read the size {size!r}; write e.g. 10GB, 500MB or 2GiB.")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(number * base ** power)


# ---------------------------------------------------------------------------------------------
# The transformer to export.


def _abstract_params(model_abstract) -> dict:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        nnx.to_pure_dict(model_abstract))


def load_trained(config, checkpoint: str, mesh, rules) -> tuple[flux.Flux, dict]:
    """(the transformer of `checkpoint` with any LoRA adapters merged, what it was read from).

    Raises:
      FileNotFoundError: nothing at `checkpoint`.
      checkpoint_lib.CheckpointError: an Orbax checkpoint of another model (names the
        parameters and the config fields that differ).
    """
    rules = parallel.rules_from_config(rules)
    execution = config_lib.execution_fields(config.model)
    step_dir = checkpoint_lib.find_step(checkpoint)
    if step_dir is None:
        if not storage.path(checkpoint).exists():
            raise FileNotFoundError(f"No checkpoint at {checkpoint}: give an Orbax checkpoint "
                                    "written by mode=train (its workdir, checkpoints/ or a step) "
                                    "or a pretrained FLUX transformer.")
        model = flux_weights.from_pretrained(storage.local(checkpoint, parts=("transformer",)),
                                             mesh=mesh, rules=rules, **execution)
        return model, {"checkpoint": storage.absolute(checkpoint), "kind": "pretrained"}
    flux_task.check_config(config)
    base = storage.local(config.model.checkpoint, parts=("transformer",))
    lora_config = lora.LoRAConfig.from_config(config.model.get("lora"))
    if lora_config.rank:
        # The checkpoint holds the adapters only: the base comes from model.checkpoint.
        model = flux_weights.from_pretrained(base, mesh=mesh, rules=rules, **execution)
        lora.apply(model, lora_config, jax.random.key(config.seed), mesh, rules)
        trained = nnx.state(model, nnx.LoRAParam)
    else:
        cfg = flux_weights.load_config(base, **execution)
        flux.validate_mesh(cfg, mesh)
        graphdef, trained = nnx.split(flux.abstract_model(cfg, rules))
    checkpoint_lib.check_params(step_dir, _abstract_params(trained), config)
    shardings = sharding_lib.state_shardings(trained, mesh, rules)
    if lora_config.rank:
        shardings = jax.tree.map(lambda x: x.sharding, trained)
    restored = checkpoint_lib.restore_params(step_dir, trained, shardings)
    if lora_config.rank:
        nnx.update(model, restored)
        lora.merge(model)
    else:
        model = nnx.merge(graphdef, restored)
    return model, {"checkpoint": storage.absolute(step_dir), "kind": "orbax",
                   "step": int(os.path.basename(step_dir.rstrip("/"))),
                   "base": storage.absolute(config.model.checkpoint),
                   "lora_rank": lora_config.rank}


# ---------------------------------------------------------------------------------------------
# Files.


def _shards(specs, max_bytes: int) -> list[list]:
    """Consecutive groups of specs, each at most max_bytes (a larger tensor alone)."""
    shards, current, size = [], [], 0
    for spec in specs:
        if current and size + spec.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    return shards + ([current] if current else [])


def _write_weights(path: str, specs, metadata: dict, writer: bool) -> None:
    """One safetensors file, streamed; processes other than the writer only take part in the
    gathers (their bytes go nowhere)."""
    if not writer:
        with open(os.devnull, "wb") as sink:
            safetensors_io.stream_safetensors(sink, specs, metadata)
        return
    with storage.open_atomic(path) as f:
        safetensors_io.stream_safetensors(f, specs, metadata)


def write_diffusers(folder: str, model: flux.Flux, dtype: str, max_shard_bytes: int,
                    base_config: dict | None, writer: bool = True) -> list[str]:
    """Writes `folder` as a diffusers transformer/ folder; returns the files written, the
    ones that mark it complete (index, config.json) last."""
    specs = flux_weights.stored_tensors(model, "diffusers", dtype)
    shards = _shards(specs, max_shard_bytes)
    metadata = {"format": "pt"}
    written = []
    if len(shards) == 1:
        names = [f"{WEIGHTS_NAME}.safetensors"]
    else:
        names = [f"{WEIGHTS_NAME}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                 for i in range(len(shards))]
    for name, shard in zip(names, shards):
        _write_weights(f"{folder}/{name}", shard, metadata, writer)
        written.append(name)
    if not writer:
        return written
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(s.nbytes for s in specs)},
                 "weight_map": {s.key: n for n, shard in zip(names, shards) for s in shard}}
        storage.write_json(f"{folder}/{WEIGHTS_NAME}.safetensors.index.json", index)
        written.append(f"{WEIGHTS_NAME}.safetensors.index.json")
    storage.write_json(f"{folder}/config.json",
                       flux_weights.diffusers_config(model.cfg, base_config))
    return written + ["config.json"]


def _base_diffusers_config(config, info: dict) -> dict | None:
    """The config.json of the transformer the run started from, where it has one."""
    source = info.get("base") or info.get("checkpoint")
    if not source:
        return None
    for candidate in (f"{source.rstrip('/')}/config.json",
                      f"{source.rstrip('/')}/transformer/config.json"):
        if storage.path(candidate).exists():
            return json.loads(storage.path(candidate).read_text())
    return None


def _add_components(out: str, source: str, mode: str) -> list[str]:
    """Links or copies FLUX.1's other components from the folder `source` into `out`."""
    present = [c for c in PIPELINE_COMPONENTS if storage.path(f"{source}/{c}").exists()]
    if "model_index.json" not in present:
        raise FileNotFoundError(
            f"--pipeline={mode} needs a FLUX.1 folder with model_index.json as "
            f"config.model.checkpoint (found none in {source}); export the transformer alone "
            "with --pipeline=none.")
    for component in present:
        src, dst = f"{source}/{component}", f"{out}/{component}"
        if mode == "link":
            if storage.is_remote(src) or storage.is_remote(dst):
                raise ValueError("--pipeline=link needs local folders; use --pipeline=copy "
                                 "for gs:// paths.")
            os.symlink(os.path.abspath(src), dst)
        elif storage.is_remote(dst):
            local = storage.local(src)
            if os.path.isdir(local):
                storage.upload_tree(local, dst)
            else:
                storage.put(local, dst)
        else:
            local = storage.local(src)
            (shutil.copytree if os.path.isdir(local) else shutil.copy2)(local, dst)
    return present


def export(config, checkpoint: str, out: str, mesh, rules, *, fmt: str = "diffusers",
           dtype: str = "bfloat16", pipeline: str = "none", max_shard_size: str | int = "10GB",
           name: str = "flux1-g2rpo", overwrite: bool = False) -> dict:
    """Writes the transformer of `checkpoint` to `out` (see the module docstring); returns the
    report also written as out/export.json.

    Raises:
      ValueError: an unknown format, dtype or pipeline mode, --pipeline with the bfl format.
      FileExistsError: `out` exists and not `overwrite`.
      FileNotFoundError, checkpoint_lib.CheckpointError: see `load_trained`.
    """
    if fmt not in FORMATS:
        raise ValueError(f"Unknown --format {fmt!r}; use one of {FORMATS}.")
    if dtype not in DTYPES:
        raise ValueError(f"Unknown --dtype {dtype!r}; use one of {DTYPES}.")
    if pipeline not in PIPELINE_MODES:
        raise ValueError(f"Unknown --pipeline {pipeline!r}; use one of {PIPELINE_MODES}.")
    if pipeline != "none" and fmt != "diffusers":
        raise ValueError("--pipeline adds diffusers components: use it with --format=diffusers.")
    max_shard_bytes = parse_size(max_shard_size)
    out = out.rstrip("/")
    remote = storage.is_remote(out)
    if storage.path(out).exists():
        if not overwrite:
            raise FileExistsError(f"{out} exists: pass --overwrite to replace it, or choose "
                                  "another --out.")
    start = time.perf_counter()
    model, info = load_trained(config, checkpoint, mesh, rules)
    flux_weights.check_exportable(model.cfg, fmt)
    writer = jax.process_index() == 0
    # Local: a hidden folder beside `out`, renamed into place when complete. gs:// has no
    # rename of folders: the files go in place, the ones marking completion last.
    target = out if remote else os.path.join(
        os.path.dirname(os.path.abspath(out)), f".{os.path.basename(out)}.partial-{uuid.uuid4().hex[:8]}")
    if remote and writer and storage.path(out).exists():
        storage.remove(out)
    try:
        if writer and not remote:
            os.makedirs(target)
        if fmt == "diffusers":
            files = [f"transformer/{f}" for f in write_diffusers(
                f"{target}/transformer", model, dtype, max_shard_bytes,
                _base_diffusers_config(config, info), writer)]
            if pipeline != "none" and writer:
                files += _add_components(target, flux_task.model_folder(config), pipeline)
        else:
            files = [f"{name}.safetensors"]
            _write_weights(f"{target}/{files[0]}", flux_weights.stored_tensors(model, "bfl",
                                                                               dtype),
                           {"format": "pt"}, writer)
        specs = flux_weights.stored_layout(model.cfg, fmt)
        report = dict(info, format=fmt, dtype=dtype, out=storage.absolute(out), files=files,
                      tensors=len(specs),
                      bytes=int(sum(np.prod(s.shape) for s in specs)
                                * np.dtype(execution.to_dtype(dtype)).itemsize),
                      parameters=int(sum(np.prod(s.shape) for s in specs)),
                      architecture=model.cfg.architecture(), pipeline=pipeline,
                      seconds=round(time.perf_counter() - start, 2))
        report["architecture"]["axes_dims_rope"] = list(model.cfg.axes_dims_rope)
        if writer:
            storage.write_json(f"{target}/{REPORT}", report)
            if not remote:
                if os.path.lexists(out):
                    shutil.rmtree(out) if os.path.isdir(out) and not os.path.islink(out) \
                        else os.unlink(out)
                os.replace(target, out)
    except BaseException:
        if writer:
            if remote:
                storage.remove(out)
            else:
                shutil.rmtree(target, ignore_errors=True)
        raise
    return report


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    config = _FLAGS["config"].value
    parallel.initialize_distributed(config.distributed)
    mesh = parallel.mesh_from_config(config.mesh)
    report = export(config, _FLAGS["checkpoint"].value, _FLAGS["out"].value, mesh,
                    config.sharding_rules, fmt=_FLAGS["format"].value,
                    dtype=_FLAGS["dtype"].value, pipeline=_FLAGS["pipeline"].value,
                    max_shard_size=_FLAGS["max_shard_size"].value, name=_FLAGS["name"].value,
                    overwrite=_FLAGS["overwrite"].value)
    if jax.process_index() == 0:
        size = report["bytes"] / 1e9
        print(f"exported {report['parameters']:,} parameters ({report['tensors']} tensors, "
              f"{size:.3f} GB {report['dtype']}, {report['format']} layout) from "
              f"{report['checkpoint']} to {report['out']} in {report['seconds']:.1f} s",
              flush=True)
    logging.info("Export took %.1f s.", report["seconds"])


if __name__ == "__main__":
    define_flags()
    sys.exit(app.run(main))
