"""Checkpoint tensors → sharded nnx parameter states.

A model's loader describes, for each of its parameters, where the values live in a public
checkpoint (`TensorSource`: a key, optional row ranges / a column range of the stored tensor,
and whether the stored matrix is PyTorch's [out, in]). `load_state` validates every parameter
against the checkpoint first (missing, unexpected and mis-shaped tensors are reported by name
and shape, all at once), then builds each parameter with `jax.make_array_from_callback`: every
device shard reads only its own slice from the memory-mapped file, so no process ever holds a
full replica of a large model.
"""

from collections.abc import Callable, Sequence
import dataclasses
import math

from flax import nnx
import jax
import numpy as np

from g2rpo_jax.models.safetensors_io import MissingTensorError, SafetensorsCheckpoint

__all__ = ["CheckpointMismatchError", "CheckpointView", "MissingTensorError",
           "SafetensorsCheckpoint", "TensorSource", "linear_sources", "load_state"]


class CheckpointMismatchError(ValueError):
    """The checkpoint does not fit the model: missing, unexpected or mis-shaped tensors."""


@dataclasses.dataclass(frozen=True)
class TensorSource:
    """Where one parameter (of one layer) lives in a checkpoint.

    Attributes:
      key: the stored tensor's name.
      rows: ranges [start, stop) of the stored tensor's dim 0, concatenated in this order
        (selects q / k / v from a fused qkv matrix, or reorders (scale, shift) halves).
      cols: a range [start, stop) of the stored tensor's dim 1 (splits a fused input).
      transpose: the stored matrix is [out, in] (PyTorch Linear) and ours is [in, out].
    """

    key: str
    rows: tuple[tuple[int, int], ...] | None = None
    cols: tuple[int, int] | None = None
    transpose: bool = False

    def row_index(self, stored_rows: int) -> np.ndarray:
        ranges = self.rows or ((0, stored_rows),)
        return np.concatenate([np.arange(a, b) for a, b in ranges])

    def col_range(self, stored_cols: int) -> tuple[int, int]:
        return self.cols or (0, stored_cols)

    def selected_shape(self, stored_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Our (per-layer) shape that this source yields from a stored tensor of stored_shape."""
        shape = list(stored_shape)
        if self.rows is not None:
            shape[0] = sum(b - a for a, b in self.rows)
        if self.cols is not None:
            shape[1] = self.cols[1] - self.cols[0]
        return tuple(reversed(shape)) if self.transpose else tuple(shape)

    def in_bounds(self, stored_shape: tuple[int, ...]) -> bool:
        rows_ok = self.rows is None or all(0 <= a < b <= stored_shape[0] for a, b in self.rows)
        cols_ok = self.cols is None or (len(stored_shape) > 1
                                        and 0 <= self.cols[0] < self.cols[1] <= stored_shape[1])
        return rows_ok and cols_ok and (not self.transpose or len(stored_shape) == 2)


def linear_sources(prefix: str, rows: tuple[tuple[int, int], ...] | None = None,
                   cols: tuple[int, int] | None = None,
                   bias: bool = True) -> dict[str, TensorSource]:
    """A PyTorch Linear `prefix` (weight [out, in], bias [out]) as an nnx.Linear's sources: the
    kernel [in, out] transposed from the weight, the bias as is; `rows` / `cols` select a part
    of a fused weight (see TensorSource)."""
    out = {"kernel": TensorSource(f"{prefix}.weight", rows=rows, cols=cols, transpose=True)}
    if bias:
        out["bias"] = TensorSource(f"{prefix}.bias", rows=rows)
    return out


class CheckpointView:
    """A checkpoint with the tensors `keep` rejects hidden, so `load_state` neither needs nor
    reports them: non-parameter buffers (`position_ids`), the decoder of an encoder-decoder
    checkpoint, or a tower the model leaves out."""

    def __init__(self, checkpoint, keep: Callable[[str], bool]):
        self._checkpoint = checkpoint
        self._keys = [k for k in checkpoint.keys() if keep(k)]
        self._key_set = set(self._keys)
        self.path = checkpoint.path

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key) -> bool:
        return key in self._key_set

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._checkpoint.shape(key)

    def array(self, key: str) -> np.ndarray:
        return self._checkpoint.array(key)

    def __getitem__(self, key: str) -> np.ndarray:
        return self.array(key)


def _as_slice(index: np.ndarray) -> slice | np.ndarray:
    """A contiguous index array as a slice, so memory-mapped reads stay lazy."""
    if len(index) and np.all(np.diff(index) == 1):
        return slice(int(index[0]), int(index[-1]) + 1)
    return index


def read_block(checkpoint: SafetensorsCheckpoint, source: TensorSource,
               index: Sequence[slice], dtype) -> np.ndarray:
    """Reads the part `index` (slices of OUR per-layer shape) of a source, cast to dtype."""
    stored = checkpoint.array(source.key)
    if stored.ndim == 0:
        return np.asarray(stored, dtype=dtype)
    index = tuple(index) + (slice(None),) * (stored.ndim - len(index))
    if source.transpose:
        index = index[::-1]
    rows = source.row_index(stored.shape[0])[index[0]]
    block = stored[_as_slice(rows)]
    if stored.ndim > 1:
        c0, c1 = source.col_range(stored.shape[1])
        col = index[1].indices(c1 - c0)
        block = block[:, c0 + col[0]:c0 + col[1]:col[2], ...][(slice(None), slice(None)) + index[2:]]
    block = np.asarray(block)
    return np.ascontiguousarray(block.T if source.transpose else block).astype(dtype, copy=False)


SourceFn = Callable[[tuple[str, ...]], "TensorSource | Callable[[int], TensorSource]"]


def _describe(path) -> str:
    return ".".join(map(str, path))


def load_state(checkpoint: SafetensorsCheckpoint, abstract_state, source_fn: SourceFn,
               shardings=None):
    """Fills an abstract nnx state from a checkpoint, each array straight into its sharding.

    Args:
      checkpoint: the open checkpoint.
      abstract_state: `nnx.split(nnx.eval_shape(...))[1]`: Variables of ShapeDtypeStructs.
        A Variable whose logical axes start with "layers" is a stack of per-layer tensors.
      source_fn: our parameter path → TensorSource, or for stacked parameters a function of
        the layer index returning the TensorSource of that layer.
      shardings: the same tree with NamedShardings, or None for the default device.

    Returns:
      The concrete state (same tree).

    Raises:
      CheckpointMismatchError: listing every missing, mis-shaped or unused tensor.
    """
    flat = list(nnx.to_flat_state(abstract_state))
    flat_shardings = (dict(nnx.to_flat_state(shardings)) if shardings is not None else {})
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    problems: list[str] = []
    used_elements: dict[str, int] = {}
    plans = []
    for path, variable in flat:
        axes = variable.get_metadata().get("logical_axes") or ()
        stacked = bool(axes) and axes[0] == "layers"
        try:
            source = source_fn(tuple(map(str, path)))
        except KeyError:
            problems.append(f"{_describe(path)}: the loader has no checkpoint key for it")
            continue
        sources = [source(layer) for layer in range(variable.shape[0])] if stacked else [source]
        expected = tuple(variable.shape[1:] if stacked else variable.shape)
        for src in sources:
            if src.key not in checkpoint:
                problems.append(f"missing tensor {src.key!r} (for {_describe(path)}, expected "
                                f"shape {expected})")
                continue
            stored_shape = tuple(checkpoint.shape(src.key))
            if not src.in_bounds(stored_shape) or src.selected_shape(stored_shape) != expected:
                problems.append(
                    f"tensor {src.key!r} has shape {stored_shape}, but {_describe(path)} needs "
                    f"{expected}" + (f" from rows {src.rows}" if src.rows else "")
                    + (f" / cols {src.cols}" if src.cols else ""))
                continue
            used_elements[src.key] = used_elements.get(src.key, 0) + math.prod(expected)
        plans.append((path, variable, sources, stacked))
    for key, used in used_elements.items():
        total = math.prod(checkpoint.shape(key))
        if used != total:
            problems.append(f"tensor {key!r} of shape {tuple(checkpoint.shape(key))} is only "
                            f"partly used by the model ({used} of {total} values)")
    unused = sorted(set(checkpoint.keys()) - set(used_elements))
    if unused:
        problems.append(f"{len(unused)} checkpoint tensors are not used by the model (is the "
                        f"config right?): {unused[:10]}")
    if problems:
        listing = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointMismatchError(
            f"Checkpoint {checkpoint.path} does not match the model:\n  {listing}{more}")

    loaded = []
    for path, variable, sources, stacked in plans:
        sharding = flat_shardings.get(path)
        sharding = sharding.get_value() if isinstance(sharding, nnx.Variable) else sharding
        dtype = variable.dtype

        def callback(index, sources=sources, stacked=stacked, dtype=dtype):
            if not stacked:
                return read_block(checkpoint, sources[0], index, dtype)
            layers = range(*index[0].indices(len(sources)))
            return np.stack([read_block(checkpoint, sources[layer], index[1:], dtype)
                             for layer in layers])

        array = jax.make_array_from_callback(tuple(variable.shape), sharding or default, callback)
        loaded.append((path, variable.replace(array)))
    return nnx.from_flat_state(loaded)
