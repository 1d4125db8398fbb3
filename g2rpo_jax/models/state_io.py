"""Our own models' weights as one self-describing safetensors file.

The embedded world's models (the shipped base generator, the learned judge) are written by this
project, so they need no public key map: each nnx Variable is stored under its dotted state path
(stacked layers stay one tensor), and the file's metadata holds a JSON config that rebuilds the
module. Writes are atomic (`write_safetensors`; a gs:// path is written locally, then uploaded
as one object), so a file is never half-written; a gs:// file is read from the download cache
(`storage.local`).

  save(path, {"flux": flux_state, "text_encoder": enc_state}, config={...})
  config = read_config(path)
  state = load(path, abstract_state, prefix="flux", shardings=...)
"""

from collections.abc import Mapping
import json
import os
import tempfile

from flax import nnx
import jax
import numpy as np

from g2rpo_jax.core import storage
from g2rpo_jax.models.safetensors_io import SafetensorsCheckpoint, write_safetensors
from g2rpo_jax.models.weights import CheckpointMismatchError

CONFIG_KEY = "config"


def _key(prefix: str, path) -> str:
    return ".".join([prefix, *map(str, path)]) if prefix else ".".join(map(str, path))


def flat_arrays(state, prefix: str = "") -> dict[str, np.ndarray]:
    """nnx.State → {"prefix.path.to.param": host array}."""
    return {_key(prefix, path): np.asarray(jax.device_get(v.get_value()
                                                          if isinstance(v, nnx.Variable) else v))
            for path, v in nnx.to_flat_state(state)}


def save(path: str | os.PathLike, states: Mapping[str, object], config: Mapping | None = None):
    """Writes several named states (each key prefixes its tensors) and a JSON config."""
    tensors = {}
    for prefix, state in states.items():
        tensors.update(flat_arrays(state, prefix))
    metadata = {CONFIG_KEY: json.dumps(dict(config or {}), sort_keys=True)}
    if not storage.is_remote(path):
        return write_safetensors(path, tensors, metadata)
    with tempfile.TemporaryDirectory(prefix="g2rpo_jax_save_") as staging:
        storage.put(write_safetensors(os.path.join(staging, "weights.safetensors"), tensors,
                                      metadata), path)
    return path


def _open(path) -> SafetensorsCheckpoint:
    missing = FileNotFoundError(f"No weights file at {path}: train it first or pass the right "
                                "path (a .safetensors file written by g2rpo_jax).")
    try:
        local = storage.local(path)
    except FileNotFoundError:
        raise missing from None
    if not os.path.isfile(local):
        raise missing
    return SafetensorsCheckpoint(local)


def read_config(path: str | os.PathLike) -> dict:
    """The JSON config stored with the weights."""
    checkpoint = _open(path)
    if CONFIG_KEY not in checkpoint.metadata:
        raise CheckpointMismatchError(f"{path} has no {CONFIG_KEY!r} metadata; it was not written "
                                      "by g2rpo_jax.models.state_io.save.")
    return json.loads(checkpoint.metadata[CONFIG_KEY])


def load(path: str | os.PathLike, abstract_state, prefix: str = "", shardings=None):
    """Fills `abstract_state` (Variables of ShapeDtypeStructs) from the file, each array straight
    into its sharding (from `shardings`, same tree) and cast to the abstract dtype.

    Raises:
      FileNotFoundError: no file at path.
      CheckpointMismatchError: every missing, mis-shaped or unused tensor, named.
    """
    checkpoint = _open(path)
    flat = list(nnx.to_flat_state(abstract_state))
    flat_shardings = dict(nnx.to_flat_state(shardings)) if shardings is not None else {}
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    problems = []
    for p, variable in flat:
        key = _key(prefix, p)
        if key not in checkpoint:
            problems.append(f"missing tensor {key!r} (shape {tuple(variable.shape)})")
        elif tuple(checkpoint.shape(key)) != tuple(variable.shape):
            problems.append(f"tensor {key!r} has shape {tuple(checkpoint.shape(key))}, the model "
                            f"needs {tuple(variable.shape)}")
    wanted = {_key(prefix, p) for p, _ in flat}
    mine = [k for k in checkpoint.keys() if not prefix or k.startswith(prefix + ".")]
    unused = sorted(set(mine) - wanted)
    if unused:
        problems.append(f"{len(unused)} tensors are not used by the model (is the config "
                        f"right?): {unused[:10]}")
    if problems:
        listing = "\n  ".join(problems[:20])
        raise CheckpointMismatchError(f"{path} does not match the model:\n  {listing}")
    loaded = []
    for p, variable in flat:
        stored = checkpoint.array(_key(prefix, p))
        sharding = flat_shardings.get(p)
        sharding = sharding.get_value() if isinstance(sharding, nnx.Variable) else sharding
        dtype = variable.dtype
        array = jax.make_array_from_callback(
            tuple(variable.shape), sharding or default,
            lambda index, stored=stored, dtype=dtype: np.asarray(stored[index], dtype=dtype))
        loaded.append((p, variable.replace(array)))
    return nnx.from_flat_state(loaded)
