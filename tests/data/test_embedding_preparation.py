"""Preparing prompt-embedding datasets: resumable and multi-host encoding, deterministic
assembly, what is read back, and the errors. A stand-in encoder (a deterministic function of
each prompt) keeps these fast; tests/test_flux_path.py runs the real T5 and CLIP."""

import json
import zlib

import ml_collections
import ml_dtypes
import numpy as np
import pytest

from g2rpo_jax.data import embedding_dataset, text_encoders
from g2rpo_jax.data import embedding_preparation as prep
from g2rpo_jax.data import reader as reader_lib

T5_LENGTH, T5_DIM, CLIP_DIM = 5, 4, 6


class FakeEncoders:
    """`encode(prompts) -> (t5 [n, 5, 4], pooled [n, 6])`, a fixed function of each prompt."""

    t5_dim, clip_dim = T5_DIM, CLIP_DIM

    def __init__(self, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after

    def encode(self, prompts):
        if self.fail_after is not None and self.calls >= self.fail_after:
            raise KeyboardInterrupt("interrupted")
        self.calls += 1
        rows = [np.random.default_rng(zlib.crc32(p.encode())) for p in prompts]
        return (np.stack([r.normal(size=(T5_LENGTH, T5_DIM)) for r in rows]).astype(np.float32),
                np.stack([r.normal(size=(CLIP_DIM,)) for r in rows]).astype(np.float32))


def _encoders_folder(root):
    """The four folders a FLUX.1 repo has for its text encoders, with their config files."""
    folder = root / "flux"
    for sub in text_encoders.ENCODER_FOLDERS:
        (folder / sub).mkdir(parents=True)
    (folder / "text_encoder_2" / "config.json").write_text(json.dumps({"d_model": T5_DIM}))
    (folder / "text_encoder" / "config.json").write_text(json.dumps({"hidden_size": CLIP_DIM}))
    return str(folder)


@pytest.fixture
def setup(tmp_path):
    prompts = [f"prompt number {i}, a {c} cat" for i, c in enumerate("abcdefghijk")]
    (tmp_path / "train.txt").write_text("\n".join(prompts) + "\n")
    spec = prep.EmbeddingSpec(name="train", prompts_file=str(tmp_path / "train.txt"),
                              encoders=_encoders_folder(tmp_path), t5_max_length=T5_LENGTH,
                              storage_dtype="float32")
    return tmp_path, spec, prompts


def _prepare(spec, data_dir, encoders=None, **kw):
    encoders = encoders or FakeEncoders()
    return prep.prepare(spec, str(data_dir), load_encoders=lambda: encoders, progress=False,
                        **kw)


@pytest.mark.parametrize("storage", ["float32", "bfloat16"])
def test_records_hold_every_prompt_in_file_order(setup, storage):
    tmp_path, spec, prompts = setup
    spec = prep.EmbeddingSpec(**dict(spec.__dict__, storage_dtype=storage))
    directory = _prepare(spec, tmp_path / "tfds", chunk_size=4)
    assert directory == embedding_dataset.dataset_dir(str(tmp_path / "tfds"), "train")
    source = embedding_dataset.load(directory)
    assert len(source) == len(prompts)
    assert source.metadata["t5_dim"] == T5_DIM and source.metadata["clip_dim"] == CLIP_DIM
    records = source.records_by_index()
    assert [r["prompt"].decode() for r in records] == prompts
    assert [int(r["index"]) for r in records] == list(range(len(prompts)))
    t5_states, pooled = FakeEncoders().encode(prompts)
    dtype = np.float32 if storage == "float32" else ml_dtypes.bfloat16
    for record, t, c in zip(records, t5_states, pooled):
        assert record["t5"].dtype == dtype and record["t5"].shape == (T5_LENGTH, T5_DIM)
        np.testing.assert_array_equal(record["t5"], t.astype(dtype))
        np.testing.assert_array_equal(record["clip_pooled"], c.astype(dtype))
    # The chunks are removed once the dataset is assembled.
    assert not list((tmp_path / "tfds" / "prompt_embeddings_chunks").iterdir())


def test_an_interrupted_run_continues_where_it_stopped(setup):
    tmp_path, spec, prompts = setup
    interrupted = FakeEncoders(fail_after=2)
    with pytest.raises(KeyboardInterrupt):
        _prepare(spec, tmp_path / "a", interrupted, chunk_size=3)
    chunk_dirs = list((tmp_path / "a" / "prompt_embeddings_chunks").iterdir())
    assert len(chunk_dirs) == 1
    assert sorted(p.name for p in chunk_dirs[0].iterdir()) == ["chunk_000000.npz",
                                                               "chunk_000001.npz"]
    resumed = FakeEncoders()
    directory = _prepare(spec, tmp_path / "a", resumed, chunk_size=3)
    assert resumed.calls == 2  # 11 prompts = 4 chunks of 3; two were already done
    clean = _prepare(spec, tmp_path / "b", chunk_size=3)
    assert embedding_dataset.records_digest(directory) == embedding_dataset.records_digest(clean)
    # Prepared already: nothing is encoded again.
    again = FakeEncoders()
    assert _prepare(spec, tmp_path / "a", again, chunk_size=3) == directory
    assert again.calls == 0


def test_hosts_encode_their_own_chunks_and_process_zero_assembles(setup):
    tmp_path, spec, prompts = setup
    chunk_dir = str(tmp_path / "chunks")
    encoders = [FakeEncoders(), FakeEncoders()]
    done = [prep.encode_chunks(prompts, encoders[h].encode, chunk_dir, 2, "float32", h, 2,
                               progress=False) for h in range(2)]
    assert done == [[0, 2, 4], [1, 3, 5]]  # 11 prompts, chunks of 2: host h takes h, h + 2, ...
    # A later run of every process finds its chunks done, encodes nothing, and process 0
    # assembles the same records as a single process would.
    for h in (1, 0):
        multi = prep.prepare(spec, str(tmp_path / "multi"), chunk_size=2, progress=False,
                             load_encoders=FakeEncoders, process_index=h, process_count=2)
    multi_dir = embedding_dataset.dataset_dir(str(tmp_path / "multi"), "train")
    assert multi == multi_dir
    single = _prepare(spec, tmp_path / "single", chunk_size=2)
    assert embedding_dataset.records_digest(multi_dir) == embedding_dataset.records_digest(single)


def test_a_name_holding_other_prompts_is_an_error(setup):
    tmp_path, spec, prompts = setup
    _prepare(spec, tmp_path / "tfds")
    (tmp_path / "train.txt").write_text("\n".join(prompts[:5]) + "\n")
    with pytest.raises(ValueError, match="holds embeddings of other prompts.*data.name"):
        _prepare(spec, tmp_path / "tfds")


def test_reader_batches_typed_embeddings(setup):
    tmp_path, spec, prompts = setup
    spec = prep.EmbeddingSpec(**dict(spec.__dict__, storage_dtype="bfloat16"))
    source = embedding_dataset.load(_prepare(spec, tmp_path / "tfds"))
    batch = next(reader_lib.Reader(source, 4, seed=0))
    assert sorted(batch) == sorted(embedding_dataset.FEATURES)
    assert batch["t5"].shape == (4, T5_LENGTH, T5_DIM) and batch["t5"].dtype == ml_dtypes.bfloat16
    assert batch["clip_pooled"].shape == (4, CLIP_DIM)
    assert [prompts[i] for i in batch["index"]] == batch["prompt"]


def test_errors_name_the_problem_and_the_fix(setup):
    _, spec, _ = setup
    with pytest.raises(ValueError, match="storage dtype 'float16'"):
        prep.EmbeddingSpec(**dict(spec.__dict__, storage_dtype="float16"))
    config = ml_collections.ConfigDict(dict(
        model=dict(checkpoint=""),
        text=dict(path="", dtype="float32", t5_max_length=8, clip_max_length=77),
        data=dict(prompts_file="a/prompts.txt", eval_prompts_file="b/prompts.txt", name="",
                  eval_name="", max_prompts=0, max_eval_prompts=0, storage_dtype="float32")))
    with pytest.raises(ValueError, match="No text encoders: set config.text.path"):
        prep.specs_from_config(config)
    config.text.path = "flux"
    with pytest.raises(ValueError, match="both be stored as 'prompts'.*eval_name"):
        prep.specs_from_config(config)
    config.data.eval_name = "held_out"
    specs = prep.specs_from_config(config)
    assert (specs["train"].name, specs["eval"].name) == ("prompts", "held_out")


@pytest.mark.slow
def test_two_processes_prepare_what_one_does(tmp_path):
    """Two jax.distributed processes (2 CPU devices each) on the tiny FLUX.1-dev: each encodes
    its chunks, process 0 assembles after the barrier, both read the result; it holds what this
    process prepares alone (bit-identical values need the same device layout: see
    embedding_preparation's docstring, so values are compared to 1e-5).

    Chunks of one prompt make 20 encoder calls per process: many programs in a row, where gloo
    mismatched the collectives of encoders sharded over both CPU devices
    (`text_encoders.encoder_devices`; benchmarks/investigations/two_process_preprocess.py counts such runs)."""
    import os
    import socket
    import subprocess
    import sys

    from g2rpo_jax.testing import flux_fixture

    folder = flux_fixture.write_tiny_flux_dev(str(tmp_path / "flux"))
    prompts = flux_fixture.write_prompts(str(tmp_path / "prompts"), train=40, held_out=2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    flags = ["--config=configs/flux_tiny.py", f"--config.model.checkpoint={folder}",
             f"--config.data.prompts_file={prompts['train']}",
             f"--config.data.data_dir={tmp_path / 'multi'}", "--config.data.chunk_size=1",
             "--config.distributed.enabled=True",
             f"--config.distributed.coordinator_address=127.0.0.1:{port}",
             "--config.distributed.num_processes=2"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="2")
    runs = [subprocess.Popen([sys.executable, "-m", "g2rpo_jax.preprocess", *flags,
                              f"--config.distributed.process_id={i}"], cwd=root, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]
    outputs = [run.communicate(timeout=600) for run in runs]
    for run in runs:
        assert run.returncode == 0, "\n\n".join(err[-2500:] for _, err in outputs)
    assert "encode prompts (process 0/2)" in outputs[0][1]  # process 0's progress bar
    spec = prep.EmbeddingSpec(name="train", prompts_file=prompts["train"], encoders=folder,
                              t5_max_length=16, storage_dtype="float32", encoder_dtype="float32")
    alone = embedding_dataset.load(prep.prepare(spec, str(tmp_path / "single"), chunk_size=3,
                                                progress=False))
    multi = embedding_dataset.load(
        embedding_dataset.dataset_dir(str(tmp_path / "multi"), "train"))
    assert multi.metadata["fingerprint"] == alone.metadata["fingerprint"]
    for a, b in zip(multi.records_by_index(), alone.records_by_index(), strict=True):
        assert (a["prompt"], int(a["index"])) == (b["prompt"], int(b["index"]))
        np.testing.assert_allclose(a["t5"], b["t5"], atol=1e-5)
        np.testing.assert_allclose(a["clip_pooled"], b["clip_pooled"], atol=1e-5)

