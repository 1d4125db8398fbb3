"""safetensors checkpoints as lazy, zero-copy numpy views; atomic writes.

Format (https://github.com/huggingface/safetensors): [8 bytes: N, little-endian u64][N bytes:
JSON header][data]. The header maps each tensor name to {"dtype", "shape", "data_offsets"}
([begin, end) in the data region) and may hold "__metadata__" (str → str).

Writing is the `safetensors` library's (`safetensors.numpy.save_file`). Reading is ours, for
what the library (0.8) cannot do:

* sharded checkpoints: a folder with a `*.safetensors.index.json` (diffusers' and
  transformers' `*-0000x-of-0000y.safetensors`), or a folder of files merged; `safe_open`
  opens one file;
* zero-copy views: `SafetensorsCheckpoint.array` is a read-only `numpy.memmap` of the tensor's
  bytes, so a 12B model is placed on devices slice by slice, each device reading only the
  bytes of its shard, through any numpy indexing (rows picked from a fused qkv matrix, a
  transposed conv kernel). `safe_open`'s `get_tensor` copies the whole tensor, `get_slice`
  takes only slices and ints, and neither hands out the data offsets a memmap needs, hence
  the small header parser here;
* float8 and zero-size tensors, which `safe_open(framework="np")` fails to read;
* errors that name the file and the tensor: a missing key with its closest matches, a
  truncated or corrupted file with what is wrong where.

`stream_safetensors` writes a file one tensor at a time (the header first, from the tensors'
shapes and dtypes; then each tensor's bytes as it is produced), so exporting a 12B model holds
one tensor in host memory rather than the whole state dict `save_file` takes.

`write_safetensors` adds what `save_file` leaves to the caller: the write is atomic (temp file,
fsync, rename), arrays are passed C-ordered (save_file writes an array's memory as it lies, so
a Fortran-ordered one would come out transposed), and only dtypes this reader reads are
written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
import dataclasses
import difflib
import json
import math
import os
from pathlib import Path
import tempfile
import threading
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np
import safetensors.numpy

__all__ = [
    "MissingTensorError",
    "SafetensorsCheckpoint",
    "SafetensorsError",
    "TensorSpec",
    "stream_safetensors",
    "write_safetensors",
]

# safetensors' own limit on the JSON header size (guards against garbage lengths).
MAX_HEADER_SIZE = 100_000_000

_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"),
    "U32": np.dtype("<u4"),
    "U16": np.dtype("<u2"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
# Reverse map keyed on the byte-order-free dtype (so '>f4' input finds 'F32' too).
_DTYPE_NAMES: dict[np.dtype, str] = {dt.newbyteorder("="): name for name, dt in _DTYPES.items()}

_INDEX_SUFFIX = ".safetensors.index.json"


class SafetensorsError(ValueError):
    """A safetensors file, folder or index is malformed or inconsistent."""


class MissingTensorError(KeyError):
    """A tensor name is not present in the checkpoint."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.message = message
        self.key = key

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return self.message


class _TensorInfo:
    __slots__ = ("file", "dtype_name", "shape", "begin", "end")

    def __init__(self, file: Path, dtype_name: str, shape: tuple[int, ...], begin: int, end: int):
        self.file = file
        self.dtype_name = dtype_name
        self.shape = shape
        self.begin = begin  # absolute byte offsets in the file
        self.end = end


def _np_dtype(dtype_name: str, key: str, file: Path) -> np.dtype:
    try:
        return _DTYPES[dtype_name]
    except KeyError:
        raise SafetensorsError(
            f"Unsupported safetensors dtype {dtype_name!r} for tensor {key!r} in {file}; "
            f"supported: {', '.join(sorted(_DTYPES))}"
        ) from None


def _no_duplicate_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SafetensorsError(f"duplicate entry {k!r} in JSON header")
        out[k] = v
    return out


def _read_header(file: Path) -> tuple[dict[str, _TensorInfo], dict[str, str]]:
    """Parses (and validates) one file's header; reads no tensor data."""
    try:
        file_size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SafetensorsError(
                    f"{file} is not a valid safetensors file: it has {file_size} bytes, "
                    "fewer than the 8-byte header length (truncated or empty file?)"
                )
            header_len = int.from_bytes(prefix, "little")
            if header_len > MAX_HEADER_SIZE:
                raise SafetensorsError(
                    f"{file} is not a valid safetensors file: header length {header_len} exceeds "
                    f"the {MAX_HEADER_SIZE}-byte limit (corrupted file?)"
                )
            if 8 + header_len > file_size:
                raise SafetensorsError(
                    f"{file} is truncated or corrupted: header of {header_len} bytes announced but "
                    f"the file has only {file_size} bytes"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise SafetensorsError(f"cannot read safetensors file {file}: {e}") from e
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicate_pairs)
    except SafetensorsError as e:
        raise SafetensorsError(f"{file}: corrupted safetensors header: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SafetensorsError(
            f"{file}: corrupted safetensors header (not valid JSON: {e})"
        ) from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{file}: corrupted safetensors header (expected a JSON object)")

    data_start = 8 + header_len
    data_size = file_size - data_start
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise SafetensorsError(
            f"{file}: '__metadata__' must be a JSON object, got {type(metadata).__name__}"
        )

    tensors: dict[str, _TensorInfo] = {}
    for key, entry in header.items():
        try:
            dtype_name = entry["dtype"]
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            if not isinstance(dtype_name, str):
                raise TypeError("dtype must be a string")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise TypeError(f"bad shape {entry['shape']!r}")
            if not all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)):
                raise TypeError(f"bad data_offsets {entry['data_offsets']!r}")
        except (TypeError, KeyError, ValueError) as e:
            raise SafetensorsError(
                f"{file}: corrupted header entry for tensor {key!r}: {entry!r} ({e})"
            ) from None
        if not 0 <= begin <= end:
            raise SafetensorsError(
                f"{file}: tensor {key!r} has invalid data_offsets [{begin}, {end}]"
            )
        if end > data_size:
            raise SafetensorsError(
                f"{file} is truncated or corrupted: tensor {key!r} needs data bytes [{begin}, {end}) but the "
                f"data region has only {data_size} bytes"
            )
        dt = _DTYPES.get(dtype_name)
        if dt is not None:  # unknown dtypes are reported lazily, when the tensor is used
            expected = math.prod(shape) * dt.itemsize
            if end - begin != expected:
                raise SafetensorsError(
                    f"{file}: tensor {key!r} ({dtype_name}, shape {list(shape)}) should span {expected} bytes "
                    f"but data_offsets [{begin}, {end}] span {end - begin}"
                )
        tensors[key] = _TensorInfo(file, dtype_name, shape, data_start + begin, data_start + end)
    return tensors, {str(k): v for k, v in metadata.items()}


def _safetensors_subdirs(directory: Path) -> list[str]:
    try:
        return sorted(
            p.name for p in directory.iterdir() if p.is_dir() and any(p.glob("*.safetensors"))
        )
    except OSError:
        return []


class SafetensorsCheckpoint:
    """Read-only, lazy view of a safetensors file, a sharded folder, or a folder of files.

    Args:
      path: a ``.safetensors`` file, a ``*.safetensors.index.json`` file, or a
        directory. For a directory, an ``*.safetensors.index.json`` is used when
        present (its ``weight_map`` decides which shard holds each tensor);
        otherwise every ``*.safetensors`` file in it is merged.
      prefix: selects the file stem in a directory holding several checkpoints,
        e.g. ``"diffusion_pytorch_model"`` or ``"model"`` (uses
        ``{prefix}.safetensors.index.json`` if present, else ``{prefix}.safetensors``
        / ``{prefix}-*.safetensors``).

    Only headers are read at construction. :meth:`array` returns read-only
    zero-copy memmap views; each file is mapped once and cached.
    """

    def __init__(self, path: str | os.PathLike, *, prefix: str | None = None):
        self.path = Path(os.fspath(path))
        self._lock = threading.Lock()
        self._maps: dict[Path, np.memmap] = {}
        self.index_metadata: dict[str, Any] = {}

        index_file, files = self._resolve(self.path, prefix)
        headers = {f: _read_header(f) for f in files}

        self._tensors: dict[str, _TensorInfo] = {}
        if index_file is not None:
            weight_map = self._weight_map
            for key, shard in weight_map.items():
                shard_tensors = headers[shard][0]
                if key not in shard_tensors:
                    raise SafetensorsError(
                        f"{index_file} maps tensor {key!r} to {shard.name}, but that shard has no such tensor "
                        "(index and shards are out of sync?)"
                    )
                self._tensors[key] = shard_tensors[key]
        else:
            for f, (tensors, _) in headers.items():
                for key, info in tensors.items():
                    if key in self._tensors:
                        raise SafetensorsError(
                            f"tensor {key!r} appears in both {self._tensors[key].file.name} and {f.name} in "
                            f"{self.path}; pass prefix=... to pick one checkpoint (e.g. "
                            "'diffusion_pytorch_model' or 'model') or remove the extra file"
                        )
                    self._tensors[key] = info

        self.files: list[Path] = list(files)
        self.metadata: dict[str, str] = {}
        for _, meta in headers.values():
            self.metadata.update(meta)
        self._keys = sorted(self._tensors)

    # ----------------------------------------------------------------- resolve
    def _resolve(self, path: Path, prefix: str | None) -> tuple[Path | None, list[Path]]:
        if not path.exists():
            raise FileNotFoundError(f"safetensors checkpoint not found: {path}")
        if path.is_file():
            if path.name.endswith(_INDEX_SUFFIX):
                return path, self._load_index(path)
            return None, [path]
        if not path.is_dir():
            raise SafetensorsError(f"{path} is neither a file nor a directory")

        indexes = sorted(path.glob("*" + _INDEX_SUFFIX))
        if prefix is not None:
            indexes = [p for p in indexes if p.name == prefix + _INDEX_SUFFIX]
        if len(indexes) > 1:
            raise SafetensorsError(
                f"{path} holds several safetensors index files: {', '.join(p.name for p in indexes)}; "
                "pass prefix=... (e.g. 'diffusion_pytorch_model' or 'model') to choose one"
            )
        if indexes:
            return indexes[0], self._load_index(indexes[0])

        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
        if prefix is not None:
            files = [
                p
                for p in files
                if p.name == prefix + ".safetensors" or p.name.startswith(prefix + "-")
            ]
        if not files:
            wanted = (
                f"'{prefix}.safetensors', '{prefix}-0000x-of-0000y.safetensors' or '{prefix}{_INDEX_SUFFIX}'"
                if prefix is not None
                else f"'*.safetensors' files or a '*{_INDEX_SUFFIX}' (e.g. diffusion_pytorch_model.safetensors, "
                "model.safetensors)"
            )
            msg = f"no safetensors checkpoint in directory {path}: expected {wanted}"
            subdirs = _safetensors_subdirs(path)
            if subdirs:
                msg += f"; sub-directories with safetensors files: {', '.join(subdirs)}"
            raise FileNotFoundError(msg)
        return None, files

    def _load_index(self, index_file: Path) -> list[Path]:
        try:
            index = json.loads(index_file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"cannot parse safetensors index {index_file}: {e}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise SafetensorsError(f"{index_file} has no (or an empty) 'weight_map'")
        index_meta = index.get("metadata") or {}
        self.index_metadata = dict(index_meta) if isinstance(index_meta, dict) else {}
        directory = index_file.parent
        self._weight_map: dict[str, Path] = {}
        shards: dict[Path, None] = {}
        for key, name in weight_map.items():
            if not isinstance(name, str):
                raise SafetensorsError(
                    f"{index_file}: weight_map entry for {key!r} is not a file name: {name!r}"
                )
            shard = directory / name
            self._weight_map[key] = shard
            shards[shard] = None
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise FileNotFoundError(
                f"{index_file} refers to shard file(s) missing from {directory}: {missing}"
            )
        return sorted(shards)

    # ----------------------------------------------------------------- lookup
    def _info(self, key: str) -> _TensorInfo:
        try:
            return self._tensors[key]
        except (KeyError, TypeError):
            pass
        close = difflib.get_close_matches(str(key), self._keys, n=5) if isinstance(key, str) else []
        hint = (
            f"closest existing keys: {close}"
            if close
            else f"no similar key among its {len(self._keys)} tensors (first: {self._keys[:5]})"
        )
        raise MissingTensorError(
            f"tensor {key!r} not found in safetensors checkpoint {self.path}; {hint}", key
        )

    def keys(self) -> list[str]:
        """All tensor names, sorted."""
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: str) -> np.ndarray:
        return self.array(key)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._info(key).shape

    def dtype(self, key: str) -> np.dtype:
        info = self._info(key)
        return _np_dtype(info.dtype_name, key, info.file)

    def file_of(self, key: str) -> Path:
        """The file holding ``key``."""
        return self._info(key).file

    def _memmap(self, file: Path) -> np.memmap:
        m = self._maps.get(file)
        if m is None:
            with self._lock:
                m = self._maps.get(file)
                if m is None:
                    m = np.memmap(file, dtype=np.uint8, mode="r")
                    self._maps[file] = m
        return m

    def array(self, key: str) -> np.ndarray:
        """Read-only zero-copy view of tensor ``key`` (a ``numpy.memmap`` for non-empty tensors).

        No data is read until the view (or a slice of it) is accessed.
        """
        info = self._info(key)
        dt = _np_dtype(info.dtype_name, key, info.file)
        if info.end == info.begin:
            out = np.empty(info.shape, dtype=dt)
            out.flags.writeable = False
            return out
        raw = self._memmap(info.file)[info.begin : info.end]
        return raw.view(dt).reshape(info.shape)

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.path)!r}, tensors={len(self._keys)}, files={len(self.files)})"


# ------------------------------------------------------------------- writer
def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Writes ``tensors`` to a safetensors file, atomically (temp file + ``os.replace``).

    Supports the reader's dtypes (incl. ``ml_dtypes.bfloat16`` / float8); ``metadata`` must
    map str to str. Everything is checked before the file is touched. Returns the path.
    """
    path = Path(os.fspath(path))
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must be a dict of str -> str")
    arrays: dict[str, np.ndarray] = {}
    for key in sorted(tensors):
        if not isinstance(key, str) or key == "__metadata__":
            raise ValueError(f"invalid tensor name {key!r}")
        arr = np.asarray(tensors[key])
        name = _DTYPE_NAMES.get(arr.dtype.newbyteorder("="))
        if name is None:
            raise SafetensorsError(
                f"cannot write tensor {key!r}: dtype {arr.dtype} has no safetensors equivalent "
                f"(supported: {', '.join(sorted(_DTYPES))})"
            )
        # Little-endian and C order (np.ascontiguousarray would turn 0-d into 1-d).
        arrays[key] = np.asarray(arr, dtype=_DTYPES[name], order="C")

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.close(fd)
        safetensors.numpy.save_file(arrays, tmp, metadata=dict(metadata) if metadata else None)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One tensor of a streamed file: its name, shape and dtype, and how to make its values
    (called once, when its bytes are due; the result is dropped after writing)."""

    key: str
    shape: tuple[int, ...]
    dtype: np.dtype
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _header(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    header: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must be a dict of str -> str")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for spec in specs:
        if spec.key in header or spec.key == "__metadata__":
            raise ValueError(f"invalid or repeated tensor name {spec.key!r}")
        name = _DTYPE_NAMES.get(np.dtype(spec.dtype).newbyteorder("="))
        if name is None:
            raise SafetensorsError(f"cannot write tensor {spec.key!r}: dtype {spec.dtype} has no "
                                   f"safetensors equivalent (supported: {', '.join(sorted(_DTYPES))})")
        header[spec.key] = {"dtype": name, "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)   # the data region starts 8-byte aligned, as the library's
    return len(raw).to_bytes(8, "little") + raw


def stream_safetensors(f: BinaryIO, specs: Sequence[TensorSpec],
                       metadata: Mapping[str, str] | None = None) -> int:
    """Writes a safetensors file to the open binary file `f`, tensor by tensor, in the order of
    `specs`: at most one produced tensor is alive at a time. Every produced array must have its
    spec's shape (it is cast to the spec's dtype). Returns the bytes written.

    The caller makes the write atomic (e.g. `storage.open_atomic`): a failure mid-way leaves `f`
    holding a prefix."""
    head = _header(specs, metadata)
    f.write(head)
    written = len(head)
    for spec in specs:
        value = np.asarray(spec.produce())
        if tuple(value.shape) != tuple(spec.shape):
            raise SafetensorsError(f"tensor {spec.key!r} was produced with shape "
                                   f"{tuple(value.shape)}, but its header says {tuple(spec.shape)}")
        value = np.ascontiguousarray(value, dtype=np.dtype(spec.dtype).newbyteorder("<"))
        f.write(value.reshape(-1).view(np.uint8).data if value.size else b"")
        written += spec.nbytes
        del value
    return written
