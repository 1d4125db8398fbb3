"""The torch-free safetensors reader and the atomic writer, against the reference `safetensors`
+ torch."""

import json
import os
import pathlib
import struct
import threading

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
import safetensors.torch
import torch

from g2rpo_jax.models import safetensors_io as sio
from g2rpo_jax.models.safetensors_io import (
    MissingTensorError,
    SafetensorsCheckpoint,
    SafetensorsError,
    write_safetensors,
)


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    """Raw bit pattern of a torch tensor as a numpy array (independent of our code)."""
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.bool:
        return t.numpy().view(np.uint8)
    return t.numpy()


def _np_bits(a: np.ndarray) -> np.ndarray:
    if a.dtype == ml_dtypes.bfloat16:
        return np.asarray(a).view(np.uint16)
    if a.dtype == np.bool_:
        return np.asarray(a).view(np.uint8)
    return np.asarray(a)


def _torch_state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "blocks.0.attn.qkv.weight": torch.randn(6, 4, generator=g),
        "blocks.0.attn.qkv.bias": torch.randn(6, generator=g).half(),
        "blocks.1.mlp.fc1.weight": torch.randn(3, 5, 2, generator=g).bfloat16(),
        "positions": torch.arange(-7, 9, dtype=torch.int64).reshape(4, 4),
        "mask": torch.rand(2, 7, generator=g) > 0.5,
        "scale": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
        "int8": torch.tensor([-128, -1, 0, 127], dtype=torch.int8),
        "uint8": torch.tensor([0, 1, 255], dtype=torch.uint8),
        "int32": torch.tensor([[-(2**31), 2**31 - 1]], dtype=torch.int32),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
    }


def _numpy_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "f32": rng.standard_normal((4, 3)).astype(np.float32),
        "f16": rng.standard_normal(5).astype(np.float16),
        "f64": rng.standard_normal((2, 2)),
        "i64": np.arange(-3, 3, dtype=np.int64).reshape(2, 3),
        "i32": np.array([-(2**31), 0, 2**31 - 1], np.int32),
        "i16": np.array([-(2**15), 7], np.int16),
        "i8": np.array([-128, 127], np.int8),
        "u8": np.array([[0, 255]], np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(3.25, np.float32),
        "empty": np.zeros((2, 0), np.float32),
        "big_endian": np.arange(4, dtype=">f4"),
        "fortran": np.asfortranarray(np.arange(6, dtype=np.float32).reshape(2, 3)),
    }


# --------------------------------------------------------------- reference writer -> our reader
def test_reads_files_written_by_safetensors_torch(tmp_path):
    sd = _torch_state_dict()
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(sd, str(path), metadata={"format": "pt", "note": "hi"})

    ckpt = SafetensorsCheckpoint(path)
    assert ckpt.keys() == sorted(sd)
    assert ckpt.files == [path]
    assert ckpt.metadata == {"format": "pt", "note": "hi"}
    expected_dtypes = {
        torch.float32: np.float32,
        torch.float16: np.float16,
        torch.bfloat16: ml_dtypes.bfloat16,
        torch.int64: np.int64,
        torch.bool: np.bool_,
        torch.int8: np.int8,
        torch.uint8: np.uint8,
        torch.int32: np.int32,
        torch.float64: np.float64,
    }
    for key, t in sd.items():
        assert key in ckpt
        assert ckpt.shape(key) == tuple(t.shape)
        assert ckpt.dtype(key) == np.dtype(expected_dtypes[t.dtype])
        arr = ckpt.array(key)
        assert arr.shape == tuple(t.shape)
        assert arr.dtype == ckpt.dtype(key)
        np.testing.assert_array_equal(_np_bits(arr), _torch_bits(t))
    # bf16 also by value.
    np.testing.assert_array_equal(
        ckpt.array("blocks.1.mlp.fc1.weight").astype(np.float32),
        sd["blocks.1.mlp.fc1.weight"].float().numpy(),
    )
    assert ckpt.array("scale").shape == () and float(ckpt.array("scale")) == 1.5
    assert ckpt.array("empty").shape == (0, 3)


def test_reads_float8_written_by_safetensors_torch(tmp_path):
    t = torch.tensor([0.0, 0.5, -1.25, 448.0, -2.0]).to(torch.float8_e4m3fn)
    u = torch.tensor([0.0, 0.5, -1.25, 57344.0, 3.0]).to(torch.float8_e5m2)
    path = tmp_path / "fp8.safetensors"
    safetensors.torch.save_file({"e4m3": t, "e5m2": u}, str(path))
    ckpt = SafetensorsCheckpoint(path)
    assert ckpt.dtype("e4m3") == np.dtype(ml_dtypes.float8_e4m3fn)
    assert ckpt.dtype("e5m2") == np.dtype(ml_dtypes.float8_e5m2)
    np.testing.assert_array_equal(ckpt.array("e4m3").view(np.uint8), t.view(torch.uint8).numpy())
    np.testing.assert_array_equal(ckpt.array("e5m2").view(np.uint8), u.view(torch.uint8).numpy())
    np.testing.assert_array_equal(ckpt.array("e4m3").astype(np.float32), t.float().numpy())


def test_reads_files_written_by_safetensors_numpy(tmp_path):
    tensors = {k: v for k, v in _numpy_tensors().items() if k not in ("big_endian", "fortran")}
    path = tmp_path / "np.safetensors"
    safetensors.numpy.save_file(tensors, str(path))
    ckpt = SafetensorsCheckpoint(str(path))
    for key, ref in tensors.items():
        np.testing.assert_array_equal(ckpt.array(key), ref)
        assert ckpt.array(key).dtype == ref.dtype
        assert ckpt.array(key).shape == ref.shape


# --------------------------------------------------------------- our writer -> reference reader
def test_written_files_load_in_safetensors_numpy(tmp_path):
    tensors = _numpy_tensors()
    path = tmp_path / "ours.safetensors"
    assert write_safetensors(path, tensors, metadata={"format": "np"}) == path
    loaded = safetensors.numpy.load_file(str(path))
    assert sorted(loaded) == sorted(tensors)
    for key, ref in tensors.items():
        assert loaded[key].shape == ref.shape
        assert loaded[key].dtype == ref.dtype.newbyteorder("=")
        np.testing.assert_array_equal(loaded[key], ref)
    with safetensors.safe_open(str(path), framework="np") as f:
        assert f.metadata() == {"format": "np"}
    # Data region is 8-byte aligned, like the reference writer's.
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert n % 8 == 0


def test_written_files_load_in_safetensors_torch(tmp_path):
    rng = np.random.default_rng(1)
    bf16 = rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16)
    e4m3 = np.array([0.5, -1.0, 448.0], ml_dtypes.float8_e4m3fn)
    e5m2 = np.array([0.25, -3.0], ml_dtypes.float8_e5m2)
    f32 = rng.standard_normal(5).astype(np.float32)
    mask = np.array([[True, False]])
    path = tmp_path / "bf16.safetensors"
    write_safetensors(path, {"bf16": bf16, "e4m3": e4m3, "e5m2": e5m2, "f32": f32, "mask": mask})

    loaded = safetensors.torch.load_file(str(path))
    assert loaded["bf16"].dtype == torch.bfloat16
    assert loaded["e4m3"].dtype == torch.float8_e4m3fn
    assert loaded["e5m2"].dtype == torch.float8_e5m2
    assert loaded["mask"].dtype == torch.bool
    np.testing.assert_array_equal(_torch_bits(loaded["bf16"]), bf16.view(np.uint16))
    np.testing.assert_array_equal(loaded["bf16"].float().numpy(), bf16.astype(np.float32))
    np.testing.assert_array_equal(loaded["e4m3"].view(torch.uint8).numpy(), e4m3.view(np.uint8))
    np.testing.assert_array_equal(loaded["e5m2"].view(torch.uint8).numpy(), e5m2.view(np.uint8))
    np.testing.assert_array_equal(loaded["f32"].numpy(), f32)
    np.testing.assert_array_equal(loaded["mask"].numpy(), mask)


def test_write_read_roundtrip(tmp_path):
    tensors = _numpy_tensors()
    tensors["bf16"] = np.arange(-4, 4, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(2, 4)
    path = tmp_path / "sub" / "rt.safetensors"  # parent created on demand
    write_safetensors(path, tensors, metadata={"a": "1"})
    ckpt = SafetensorsCheckpoint(path)
    assert ckpt.keys() == sorted(tensors)
    assert ckpt.metadata == {"a": "1"}
    for key, ref in tensors.items():
        np.testing.assert_array_equal(ckpt.array(key), ref)
        assert ckpt.shape(key) == ckpt.array(key).shape == ref.shape
        assert ckpt.dtype(key) == ref.dtype.newbyteorder("=")


def test_write_is_atomic_and_replaces(tmp_path):
    path = tmp_path / "w.safetensors"
    write_safetensors(path, {"a": np.zeros(2, np.float32)})
    write_safetensors(path, {"b": np.ones(3, np.int64)})
    assert SafetensorsCheckpoint(path).keys() == ["b"]

    class Boom:
        def __array__(self, dtype=None, copy=None):
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_safetensors(path, {"a": np.zeros(1), "z": Boom()})
    # Unsupported dtype fails before anything is written; the old file survives.
    with pytest.raises(SafetensorsError, match="complex64"):
        write_safetensors(path, {"c": np.zeros(2, np.complex64)})
    with pytest.raises(TypeError, match="metadata"):
        write_safetensors(path, {"a": np.zeros(1)}, metadata={"k": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.safetensors"]  # no temp files
    np.testing.assert_array_equal(SafetensorsCheckpoint(path).array("b"), np.ones(3))


# --------------------------------------------------------------- directories / shards
def test_sharded_directory_with_index_from_huggingface_hub(tmp_path):
    huggingface_hub = pytest.importorskip("huggingface_hub")
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.{i}.weight": torch.randn(16, 16, generator=g) for i in range(4)}
    sd["norm.weight"] = torch.randn(16, generator=g).bfloat16()
    huggingface_hub.save_torch_state_dict(
        sd,
        tmp_path,
        filename_pattern="diffusion_pytorch_model{suffix}.safetensors",
        max_shard_size=2500,
    )
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    assert index.exists()
    shards = sorted(tmp_path.glob("diffusion_pytorch_model-*-of-*.safetensors"))
    assert len(shards) > 1

    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.files == shards
    assert ckpt.keys() == sorted(sd)
    weight_map = json.loads(index.read_text())["weight_map"]
    for key, t in sd.items():
        assert ckpt.file_of(key).name == weight_map[key]
        np.testing.assert_array_equal(_np_bits(ckpt.array(key)), _torch_bits(t))
    # Also via the prefix and via the index file itself.
    assert SafetensorsCheckpoint(tmp_path, prefix="diffusion_pytorch_model").keys() == sorted(sd)
    assert SafetensorsCheckpoint(index).keys() == sorted(sd)


def _write_hand_sharded(directory: pathlib.Path, stem: str = "model") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    part1 = {
        "embed.weight": torch.randn(8, 4, generator=g),
        "embed.bias": torch.randn(4, generator=g),
    }
    part2 = {"head.weight": torch.randn(4, 8, generator=g).bfloat16(), "step": torch.tensor(3)}
    names = [f"{stem}-00001-of-00002.safetensors", f"{stem}-00002-of-00002.safetensors"]
    safetensors.torch.save_file(part1, str(directory / names[0]), metadata={"format": "pt"})
    safetensors.torch.save_file(part2, str(directory / names[1]), metadata={"shard": "2"})
    weight_map = {k: names[0] for k in part1} | {k: names[1] for k in part2}
    (directory / f"{stem}.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 1234}, "weight_map": weight_map})
    )
    return part1 | part2


def test_hand_written_index(tmp_path):
    sd = _write_hand_sharded(tmp_path)
    ckpt = SafetensorsCheckpoint(os.fspath(tmp_path))
    assert ckpt.keys() == sorted(sd)
    assert len(ckpt.files) == 2
    assert ckpt.metadata == {"format": "pt", "shard": "2"}
    assert ckpt.index_metadata == {"total_size": 1234}
    for key, t in sd.items():
        np.testing.assert_array_equal(_np_bits(ckpt.array(key)), _torch_bits(t))


def test_index_is_authoritative_extra_shard_keys_ignored(tmp_path):
    _write_hand_sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"]["step"]
    index.write_text(json.dumps(data))
    assert "step" not in SafetensorsCheckpoint(tmp_path)


def test_directory_without_index_reads_all_files(tmp_path):
    a = {"a.weight": torch.randn(3, 2)}
    b = {"b.weight": torch.randn(2).half(), "b.bias": torch.tensor([True, False])}
    safetensors.torch.save_file(a, str(tmp_path / "part_a.safetensors"))
    safetensors.torch.save_file(b, str(tmp_path / "part_b.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = SafetensorsCheckpoint(tmp_path)
    assert ckpt.keys() == ["a.weight", "b.bias", "b.weight"]
    assert [p.name for p in ckpt.files] == ["part_a.safetensors", "part_b.safetensors"]
    for key, t in (a | b).items():
        np.testing.assert_array_equal(_np_bits(ckpt.array(key)), _torch_bits(t))


def test_several_indexes_need_prefix(tmp_path):
    sd_model = _write_hand_sharded(tmp_path, "model")
    safetensors.torch.save_file(
        {"x": torch.ones(2)}, str(tmp_path / "other-00001-of-00001.safetensors")
    )
    (tmp_path / "other.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "other-00001-of-00001.safetensors"}})
    )
    with pytest.raises(SafetensorsError) as e:
        SafetensorsCheckpoint(tmp_path)
    assert "model.safetensors.index.json" in str(e.value)
    assert "other.safetensors.index.json" in str(e.value)
    assert "prefix" in str(e.value)
    assert SafetensorsCheckpoint(tmp_path, prefix="model").keys() == sorted(sd_model)
    assert SafetensorsCheckpoint(tmp_path, prefix="other").keys() == ["x"]


def test_duplicate_keys_across_files_and_prefix_without_index(tmp_path):
    safetensors.torch.save_file(
        {"w": torch.ones(2)}, str(tmp_path / "diffusion_pytorch_model.safetensors")
    )
    safetensors.torch.save_file(
        {"w": torch.ones(2).half()}, str(tmp_path / "diffusion_pytorch_model.fp16.safetensors")
    )
    with pytest.raises(SafetensorsError, match="'w'.*both"):
        SafetensorsCheckpoint(tmp_path)
    ckpt = SafetensorsCheckpoint(tmp_path, prefix="diffusion_pytorch_model")
    assert ckpt.dtype("w") == np.float32
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        SafetensorsCheckpoint(tmp_path, prefix="model")


def test_index_key_missing_in_shard(tmp_path):
    _write_hand_sharded(tmp_path)
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["ghost.weight"] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(SafetensorsError, match=r"'ghost\.weight'.*model-00002-of-00002"):
        SafetensorsCheckpoint(tmp_path)


def test_index_refers_to_missing_shard(tmp_path):
    _write_hand_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        SafetensorsCheckpoint(tmp_path)


# --------------------------------------------------------------- laziness / memmap
def test_array_is_readonly_zero_copy_memmap_and_slices(tmp_path):
    ref = np.arange(10 * 7, dtype=np.float32).reshape(10, 7)
    path = tmp_path / "m.safetensors"
    write_safetensors(path, {"w": ref, "b": np.arange(3, dtype=np.int16)})
    ckpt = SafetensorsCheckpoint(path)
    arr = ckpt.array("w")
    assert isinstance(arr, np.memmap)
    assert not arr.flags.writeable
    with pytest.raises(ValueError):
        arr[0, 0] = 1.0
    np.testing.assert_array_equal(arr[3:5], ref[3:5])
    np.testing.assert_array_equal(arr[:, 2], ref[:, 2])
    np.testing.assert_array_equal(arr[-1, ::3], ref[-1, ::3])
    assert not arr[3:5].flags.writeable
    # Zero-copy: both tensors are views into one cached map of the file.
    assert len(ckpt._maps) == 1
    m = ckpt._maps[path]
    assert np.shares_memory(arr, m) and np.shares_memory(ckpt.array("b"), m)
    assert ckpt.array("w").ctypes.data == arr.ctypes.data
    empty = SafetensorsCheckpoint(tmp_path / "m.safetensors")
    assert empty._maps == {}  # nothing mapped until a tensor is requested
    assert ckpt["b"].tolist() == [0, 1, 2]
    assert len(ckpt) == 2 and list(ckpt) == ["b", "w"]


def test_thread_safe_concurrent_reads(tmp_path):
    tensors = {f"t{i}": np.full((16,), i, np.float32) for i in range(32)}
    path = tmp_path / "many.safetensors"
    write_safetensors(path, tensors)
    ckpt = SafetensorsCheckpoint(path)
    errors = []

    def worker():
        try:
            for i in range(32):
                assert float(ckpt.array(f"t{i}").sum()) == 16 * i
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(ckpt._maps) == 1


# --------------------------------------------------------------- errors
def test_missing_key_message(tmp_path):
    path = tmp_path / "k.safetensors"
    write_safetensors(path, {"transformer.blocks.0.attn.to_q.weight": np.zeros(2, np.float32)})
    ckpt = SafetensorsCheckpoint(path)
    with pytest.raises(MissingTensorError) as e:
        ckpt.array("transformer.blocks.0.attn.to_k.weight")
    msg = str(e.value)
    assert isinstance(e.value, KeyError)
    assert "transformer.blocks.0.attn.to_k.weight" in msg
    assert "transformer.blocks.0.attn.to_q.weight" in msg
    assert str(path) in msg
    for method in (ckpt.shape, ckpt.dtype):
        with pytest.raises(KeyError, match="nope"):
            method("nope")
    assert "nope" not in ckpt


def test_missing_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        SafetensorsCheckpoint(tmp_path / "does_not_exist")
    with pytest.raises(FileNotFoundError, match="does_not_exist.safetensors"):
        SafetensorsCheckpoint(tmp_path / "does_not_exist.safetensors")


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "transformer").mkdir()
    write_safetensors(
        tmp_path / "transformer" / "diffusion_pytorch_model.safetensors", {"a": np.zeros(1)}
    )
    with pytest.raises(FileNotFoundError) as e:
        SafetensorsCheckpoint(tmp_path)
    msg = str(e.value)
    assert str(tmp_path) in msg and ".safetensors" in msg and "transformer" in msg


def _valid_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "ok.safetensors"
    write_safetensors(path, {"w": np.arange(8, dtype=np.float32)})
    return path


def _raw(header: dict | bytes, data: bytes = b"") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def test_corrupted_header(tmp_path):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(_raw(b"{not json"))
    with pytest.raises(SafetensorsError, match="bad.safetensors.*corrupted"):
        SafetensorsCheckpoint(bad)

    bad.write_bytes(_raw({"w": {"dtype": "F32", "shape": [2]}}, b"\0" * 8))  # no data_offsets
    with pytest.raises(SafetensorsError, match="bad.safetensors.*'w'"):
        SafetensorsCheckpoint(bad)

    # Offsets disagree with dtype*shape.
    bad.write_bytes(_raw({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8))
    with pytest.raises(SafetensorsError, match="'w'.*12 bytes"):
        SafetensorsCheckpoint(bad)

    # Absurd header length (e.g. random bytes).
    bad.write_bytes(b"\xff" * 64)
    with pytest.raises(SafetensorsError, match="bad.safetensors"):
        SafetensorsCheckpoint(bad)

    bad.write_bytes(_raw(b"[1, 2]"))
    with pytest.raises(SafetensorsError, match="bad.safetensors"):
        SafetensorsCheckpoint(bad)

    # The reference library also rejects what we reject (sanity check of the fixtures).
    with pytest.raises(Exception):  # noqa: B017
        safetensors.numpy.load_file(str(bad))


def test_truncated_files(tmp_path):
    path = _valid_file(tmp_path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])

    cut_data = tmp_path / "cut_data.safetensors"
    cut_data.write_bytes(raw[:-4])
    with pytest.raises(SafetensorsError, match="cut_data.safetensors.*truncated"):
        SafetensorsCheckpoint(cut_data)
    with pytest.raises(Exception):  # noqa: B017 - the reference agrees the file is broken
        safetensors.numpy.load_file(str(cut_data))

    cut_header = tmp_path / "cut_header.safetensors"
    cut_header.write_bytes(raw[: 8 + n // 2])
    with pytest.raises(SafetensorsError, match="cut_header.safetensors.*truncated"):
        SafetensorsCheckpoint(cut_header)

    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(raw[:5])
    with pytest.raises(SafetensorsError, match="tiny.safetensors"):
        SafetensorsCheckpoint(tiny)

    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    with pytest.raises(SafetensorsError, match="empty.safetensors"):
        SafetensorsCheckpoint(empty)


def test_unknown_dtype_is_named(tmp_path):
    path = tmp_path / "odd.safetensors"
    path.write_bytes(
        _raw(
            {
                "odd": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]},
                "ok": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]},
            },
            np.arange(4, dtype=np.float32).tobytes(),
        )
    )
    ckpt = SafetensorsCheckpoint(path)  # other tensors remain usable
    np.testing.assert_array_equal(ckpt.array("ok"), [2.0, 3.0])
    assert ckpt.shape("odd") == (1,)
    with pytest.raises(SafetensorsError, match="C64"):
        ckpt.array("odd")
    with pytest.raises(SafetensorsError, match="C64"):
        ckpt.dtype("odd")


def test_dtype_table_matches_reference_names(tmp_path):
    # Every dtype we claim to support is one the reference writes under the same name.
    torch_dtypes = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
    }
    path = tmp_path / "all.safetensors"
    safetensors.torch.save_file(
        {k: torch.zeros(2, dtype=v) for k, v in torch_dtypes.items()}, str(path)
    )
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    ckpt = SafetensorsCheckpoint(path)
    for name in torch_dtypes:
        assert header[name]["dtype"] == name
        assert ckpt.dtype(name) == sio._DTYPES[name]
        assert (
            ckpt.array(name).dtype.itemsize
            == torch.zeros(0, dtype=torch_dtypes[name]).element_size()
        )
