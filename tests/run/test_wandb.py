"""Weights & Biases (config.logging.wandb), offline: a short RL run logs to W&B the scalars,
images and histograms it writes to TensorBoard, its resumption continues the same W&B run, a
gs:// workdir keeps the run id in the bucket; without the flag wandb is never imported; bad
settings are named.

What W&B wrote is read back from its offline transaction log (`run-<id>.wandb`: a LevelDB-style
log of wandb_internal_pb2.Record protos, the file `wandb sync` uploads)."""

import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import resume_helpers
from test_train import data_dir, mesh, short_rl_config  # noqa: F401 (fixtures)

from g2rpo_jax import parallel, train
from g2rpo_jax.run import checkpoint as checkpoint_lib
from g2rpo_jax.run import config_lib, metrics, wandb_logger

# The transaction log's framing (wandb-core's leveldb-style writer): a 7-byte file header,
# then 32 KiB blocks of chunks, each with a 7-byte header (CRC-32C, length, type); a record is
# one FULL chunk or FIRST, MIDDLE..., LAST; a block tail under 7 bytes is zero padding.
_HEADER = struct.Struct("<4sHB")   # b":W&B", magic 0xBEE1, version
_CHUNK = struct.Struct("<IHB")
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_env(monkeypatch, tmp_path) -> None:
    """Offline, quiet, and every W&B folder (settings, cache, staging) under tmp_path."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        folder = tmp_path / name.lower()
        folder.mkdir(exist_ok=True)
        monkeypatch.setenv(name, str(folder))


def read_records(path) -> list:
    """The wandb_internal_pb2.Record protos of a `.wandb` transaction log, in order."""
    from wandb.proto import wandb_internal_pb2

    data = open(path, "rb").read()
    ident, magic, _ = _HEADER.unpack_from(data)
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    records, pending, offset = [], b"", _HEADER.size
    while offset + _CHUNK.size <= len(data):
        if _BLOCK - offset % _BLOCK < _CHUNK.size:
            offset += _BLOCK - offset % _BLOCK
            continue
        _, length, kind = _CHUNK.unpack_from(data, offset)
        chunk = data[offset + _CHUNK.size:offset + _CHUNK.size + length]
        offset += _CHUNK.size + length
        if kind in (_FULL, _FIRST):
            pending = chunk
        elif kind in (_MIDDLE, _LAST):
            pending += chunk
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def offline_runs(wandb_dir) -> list[tuple[str, list]]:
    """(run id, records) of each offline run folder under WANDB_DIR/wandb, oldest first."""
    root = os.path.join(wandb_dir, "wandb")
    runs = []
    for folder in sorted(f for f in os.listdir(root) if f.startswith("offline-run-")):
        (log,) = [f for f in os.listdir(os.path.join(root, folder)) if f.endswith(".wandb")]
        runs.append((log[len("run-"):-len(".wandb")],
                     _finished_records(os.path.join(root, folder, log))))
    return runs


def _finished_records(path, timeout_s: float = 60.0) -> list:
    """The records of a run's log once its exit record (the last one W&B writes) is there: on
    CI a log read right after `run.finish()` once held no history rows yet."""
    from google.protobuf.message import DecodeError

    deadline = time.monotonic() + timeout_s

    while True:
        try:
            records = read_records(path)
        except (struct.error, DecodeError):   # a chunk still being written
            records = []
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} has no exit record {timeout_s:.0f} s after finish(): "
                                 f"{[r.WhichOneof('record_type') for r in records]}")
        time.sleep(0.2)


def history(records) -> list[dict]:
    """The logged rows: {name: value}, a media value as {field: value} ("_type", "path"...)."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row = {}
        for item in record.history.item:
            name, *field = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            if field:
                row.setdefault(name, {})[field[0]] = value
            else:
                row[name] = value
        rows.append(row)
    return rows


def of_kind(rows, kind: str) -> set[tuple[str, int]]:
    """(name, iteration) of every logged value of a media kind ("image-file", "histogram")."""
    return {(name, row["iteration"]) for row in rows for name, value in row.items()
            if isinstance(value, dict) and value.get("_type") == kind}


@pytest.fixture(scope="module")
def wandb_run(tmp_path_factory, data_dir, mesh):  # noqa: F811
    """A 2-iteration run with W&B offline, then extended to 3 (a resumption): the workdir, the
    run id after each start, and TensorBoard's events."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    tmp = tmp_path_factory.mktemp("wandb")
    workdir = tmp / "run"
    config = short_rl_config(data_dir)
    config.train.samples_every = 2
    config.logging.wandb = True
    config.logging.wandb_mode = "offline"
    config.logging.wandb_tags = ("shapes,test",)
    rules = parallel.rules_from_config(config.sharding_rules)
    ids = []
    with pytest.MonkeyPatch.context() as patch:
        wandb_env(patch, tmp)
        for iterations in (2, 3):
            config.train.num_iterations = iterations
            train.train(config, str(workdir), mesh, rules)
            ids.append((workdir / wandb_logger.RUN_ID_FILE).read_text().strip())
    events = ea.EventAccumulator(str(workdir / "tensorboard"), size_guidance={
        ea.IMAGES: 0, ea.HISTOGRAMS: 0, ea.TENSORS: 0, ea.SCALARS: 0})
    events.Reload()
    return workdir, ids, events


def test_offline_run_logs_what_tensorboard_shows(wandb_run):
    """Every TensorBoard scalar (name, iteration, value), image and histogram of the run (both
    starts) is in the W&B run, at the same iterations; histograms count the same values."""
    workdir, _, events = wandb_run
    rows = [row for _, records in offline_runs(workdir) for row in history(records)]
    assert all("iteration" in row for row in rows)
    logged = {(name, row["iteration"]): value for row in rows for name, value in row.items()
              if not name.startswith("_") and name != "iteration"}
    tags = events.Tags()
    scalars = {(tag, e.step): e.value for tag in tags["scalars"] for e in events.Scalars(tag)}
    assert {"train/loss", "eval/in_domain", "time/update_s"} <= {tag for tag, _ in scalars}
    for key, value in scalars.items():
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    images = {(tag, e.step) for tag in tags["images"] for e in events.Images(tag)}
    assert images == of_kind(rows, "image-file")
    assert {("eval/samples", 3), ("train/samples", 2)} <= images
    histograms = {(tag, e.step): e.histogram_value.num for tag in tags["histograms"]
                  for e in events.Histograms(tag)}
    assert set(histograms) == of_kind(rows, "histogram")
    for key, count in histograms.items():
        assert sum(logged[key]["values"]) == count, key
    assert logged[("config", 0)]["_type"] == "html-file"   # the text, as preformatted HTML


def test_resumed_run_continues_the_same_wandb_run(wandb_run):
    """Both starts log to one W&B run id (kept in WORKDIR/wandb_run_id), named after the
    workdir, with the config and the tags; the second start logs only its new iterations,
    every metric plotted against "iteration"."""
    workdir, ids, _ = wandb_run
    run_id = ids[0]
    assert ids == [run_id, run_id]
    runs = offline_runs(workdir)
    assert [found for found, _ in runs] == [run_id, run_id]
    for _, records in runs:
        (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.project, run.display_name) == (run_id, "g2rpo-jax", "run")
        assert list(run.tags) == ["shapes", "test"]
        config = {item.key: json.loads(item.value_json) for item in run.config.update}
        assert config["algorithm"]["group_size"] == 4
        metrics_defined = [r.metric for r in records if r.WhichOneof("record_type") == "metric"]
        assert any(m.glob_name == "*" and m.step_metric == "iteration" for m in metrics_defined)
    iterations = [sorted({row["iteration"] for row in history(records)}) for _, records in runs]
    assert iterations == [[0, 1, 2], [3]]


def test_start_over_starts_a_new_wandb_run_and_resuming_may_turn_it_on(tmp_path):
    """train.start_over removes the run id and W&B's local files with the other outputs; the
    logging section may change when a run resumes (and be absent from an older checkpoint)."""
    (tmp_path / wandb_logger.RUN_ID_FILE).write_text("abc\n")
    (tmp_path / "wandb" / "offline-run-1-abc").mkdir(parents=True)
    checkpoint_lib.start_over(str(tmp_path))
    assert not (tmp_path / wandb_logger.RUN_ID_FILE).exists()
    assert not (tmp_path / "wandb").exists()
    config = config_lib.load_config("shapes_cpu.py")
    stored = checkpoint_lib.config_json(config)
    del stored["logging"]
    differences = checkpoint_lib.config_differences(stored, checkpoint_lib.config_json(
        _wandb_config(wandb_mode="offline")))
    assert differences and all(map(checkpoint_lib.is_resumable_field, differences))


# A normal run's logging (train.py and pretrain.py imported, a logger used and closed), then
# whether wandb got imported.
_WITHOUT_FLAG = """
import sys
import time
import numpy as np
from g2rpo_jax import pretrain, train
from g2rpo_jax.run import config_lib, metrics
logger = metrics.MetricsLogger(sys.argv[1], config=config_lib.load_config("shapes_cpu.py"))
logger.image(0, "samples", np.zeros((4, 4, 3), np.uint8))
logger.histogram(0, "values", np.arange(5.0))
logger.text(0, "config", "text")
logger.write(0, {"x": 1.0})
logger.close()
print("wandb imported:", "wandb" in sys.modules)
"""


def test_without_the_flag_wandb_is_never_imported(tmp_path):
    result = subprocess.run([sys.executable, "-c", _WITHOUT_FLAG, str(tmp_path)],
                            cwd=resume_helpers.ROOT, env=resume_helpers.environment(1),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb imported: False" in result.stdout
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "tensorboard"]


def _wandb_config(**fields):
    config = config_lib.load_config("shapes_cpu.py")
    config.logging.wandb = True
    config.logging.update(fields)
    return config


def test_bad_mode_and_missing_package_are_named(tmp_path, monkeypatch):
    """Named before anything is written: a mode W&B does not have, and the flag without the
    package (the install command)."""
    with pytest.raises(ValueError, match="wandb_mode is 'ofline'; use one of .*'offline'"):
        metrics.MetricsLogger(str(tmp_path), config=_wandb_config(wandb_mode="ofline"))
    monkeypatch.setitem(sys.modules, "wandb", None)   # as if not installed
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        wandb_logger.validate(_wandb_config().logging)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[wandb\]"'):
        metrics.MetricsLogger(str(tmp_path), config=_wandb_config())
    assert not (tmp_path / wandb_logger.RUN_ID_FILE).exists()
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tags_from_a_tuple_or_a_comma_separated_string():
    assert wandb_logger.tags(("a,b", " c ")) == ["a", "b", "c"]
    assert wandb_logger.tags("a, b") == ["a", "b"]
    assert wandb_logger.tags(()) == []


def test_held_media_are_logged_with_the_scalars_of_their_step(tmp_path, monkeypatch):
    """An image of step 1 waits for step 1's write (in one row with its scalars), a histogram
    of step 0 still held then gets a row of its own; float images become 8-bit."""
    wandb_env(monkeypatch, tmp_path)
    workdir = tmp_path / "run"
    logger = metrics.MetricsLogger(str(workdir), config=_wandb_config(wandb_mode="offline"))
    logger.histogram(0, "h", np.arange(4.0))
    logger.image(1, "image", np.full((8, 8, 3), 0.5, np.float32))
    logger.write(1, {"x": 2.0, "not_finite": float("nan")})
    logger.close()
    ((_, records),) = offline_runs(workdir)
    rows = [{k: v for k, v in row.items() if not k.startswith("_")} for row in history(records)]
    assert [sorted(row) for row in rows] == [["h", "iteration"], ["image", "iteration", "x"]]
    assert [row["iteration"] for row in rows] == [0, 1]
    assert rows[1]["image"]["caption"] == "iteration 1"


_GS_WORKDIR = """
import sys
import time
from g2rpo_jax.run import config_lib, metrics
config = config_lib.load_config("shapes_cpu.py")
config.logging.wandb = True
for start in range(2):
    logger = metrics.MetricsLogger(sys.argv[1], config=config)
    logger.write(start, {"x": float(start)})
    logger.close()
"""


def test_gs_workdir_keeps_the_run_id_in_the_bucket(tmp_path):
    """A gs:// workdir: the run id is an object next to the metrics, W&B's files are in
    $WANDB_DIR/wandb, and a restart resumes the same run."""
    from gcs_emulator import GcsEmulator

    with GcsEmulator() as gcs:
        env = {**resume_helpers.environment(1), **gcs.env, "WANDB_MODE": "offline",
               "WANDB_SILENT": "true"}
        for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            env[name] = str(tmp_path / name.lower())
        result = subprocess.run(
            [sys.executable, "-c", _GS_WORKDIR, f"gs://{gcs.bucket}/runs/gs_run"],
            cwd=resume_helpers.ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        objects = gcs.objects("runs/gs_run/")
        assert "runs/gs_run/wandb_run_id" in objects and "runs/gs_run/metrics.jsonl" in objects
    runs = offline_runs(tmp_path / "wandb_dir")
    assert len(runs) == 2 and runs[0][0] == runs[1][0]
    (run,) = [r.run for r in runs[0][1] if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "gs_run"
